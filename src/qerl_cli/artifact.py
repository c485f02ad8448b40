"""The artifact contract (DESIGN §2): one directory per stage output, described by ``manifest.json``.

* ``key`` = sha256 of (stage kind, schema, config minus cosmetic fields, input digests): the cache key.
* ``digest`` = sha256 of the key and every payload file's sha256: what downstream artifacts record.
* A stage writes into a temporary sibling directory and renames it into place; a killed stage leaves no
  half artifact (stale temporaries are swept on the next run).
* An existing output with the same key whose files verify is a cache hit; anything else at the output path
  is only replaced with ``force``.
"""

from __future__ import annotations

import datetime as _dt
import glob
import hashlib
import json
import os
import resource
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from rich.markup import escape

from . import __version__, names, ui
from .errors import QerlError

_HASH_CHUNK = 1 << 22


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _safe_relpath(rel: str, root: Path) -> Path:
    """A manifest path must name a file inside its artifact: no absolute paths, no ``..``."""
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or not p.parts or "\\" in rel:
        raise QerlError(f"{root} has a manifest entry '{rel}' that points outside the artifact.")
    return root / Path(*p.parts)


DIGEST_PREFIX = "sha256:"


def tagged(digest: str) -> str:
    """Digests in manifests name their algorithm: ``sha256:<hex>``."""
    return digest if digest.startswith(DIGEST_PREFIX) else DIGEST_PREFIX + digest


@dataclass(frozen=True)
class Input:
    """One input of a stage, as recorded in the manifest (its digest is stored as ``sha256:<hex>``)."""

    kind: str
    path: str
    digest: str

    def __post_init__(self):
        object.__setattr__(self, "digest", tagged(self.digest))

    def as_dict(self) -> dict:
        return {names.K_KIND: self.kind, names.K_PATH: self.path, names.K_DIGEST: self.digest}


@dataclass
class Artifact:
    path: Path
    manifest: dict

    @property
    def kind(self) -> str:
        return self.manifest[names.K_KIND]

    @property
    def key(self) -> str:
        return self.manifest[names.K_KEY]

    @property
    def digest(self) -> str:
        return self.manifest[names.K_DIGEST]

    @property
    def config(self) -> dict:
        return self.manifest[names.K_CONFIG]

    @property
    def metrics(self) -> dict:
        return self.manifest.get(names.K_METRICS, {})

    @property
    def inputs(self) -> list[dict]:
        return self.manifest.get(names.K_INPUTS, [])

    def input_of(self, kind: str) -> tuple[Path, str] | None:
        """(path, digest) of this artifact's first input of ``kind`` as its manifest records it (the path resolved:
        it is stored relative to this artifact); None without one."""
        i = next((i for i in self.inputs if i.get(names.K_KIND) == kind), None)
        return None if i is None else ((self.path / i[names.K_PATH]).resolve(), i[names.K_DIGEST])

    def file(self, rel: str) -> Path:
        return _safe_relpath(rel, self.path)

    def read_json(self, rel: str) -> Any:
        """A JSON file of this artifact; one sentence if it cannot be read (a hand edit the manifest was
        re-hashed over, a disk error)."""
        return read_json_file(self.file(rel), self.path)

    def read_tensors(self, rel: str) -> dict:
        """A safetensors file of this artifact; one sentence if it cannot be read."""
        return read_tensors_file(self.file(rel), self.path)

    def as_input(self, out: Path) -> Input:
        """This artifact as an input of the artifact that will live at ``out`` (path relative to it)."""
        return Input(self.kind, os.path.relpath(self.path.resolve(), Path(out).resolve()), self.digest)


def _damaged(root: Path, f: Path, e: BaseException) -> QerlError:
    why = (str(e).splitlines() or [type(e).__name__])[0].rstrip(".")
    return QerlError(f"{root} is damaged: its {f.name} cannot be read ({why}); recreate it with --force.")


def read_json_file(f: Path, root: Path) -> Any:
    try:
        return json.loads(Path(f).read_text())
    except (OSError, ValueError) as e:  # (UnicodeDecodeError is a ValueError)
        raise _damaged(root, Path(f), e) from None


def read_tensors_file(f: Path, root: Path) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(f))
    except (SafetensorError, OSError, ValueError) as e:
        raise _damaged(root, Path(f), e) from None


def read_manifest(path: Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise QerlError(f"{path} does not exist.")
    if not path.is_dir():
        raise QerlError(f"{path} is not a directory, so it cannot be a qerl artifact.")
    mf = path / names.MANIFEST
    if not mf.is_file():
        if (path / names.RUN_CONFIG).is_file():
            raise QerlError(f"{path} is an unfinished train run (it gets its {names.MANIFEST} after its last step): "
                            "finish it with the same qerl train command plus --resume.")
        raise QerlError(f"{path} is not a qerl artifact: it has no {names.MANIFEST}.")
    try:
        manifest = json.loads(mf.read_text())
    except (OSError, ValueError) as e:
        raise QerlError(f"{mf} is not valid JSON ({e}).") from None
    if not isinstance(manifest, dict):
        raise QerlError(f"{mf} does not hold a JSON object.")
    schema = str(manifest.get(names.K_SCHEMA, ""))
    sname, _, major = schema.partition("/")
    if sname != names.SCHEMA_NAME or not major.isdigit():
        raise QerlError(f"{path} has an unknown manifest schema '{schema}' (expected {names.SCHEMA}).")
    if int(major) != names.SCHEMA_MAJOR:
        raise QerlError(f"{path} was written with artifact schema {schema}; this qerl reads {names.SCHEMA}.")
    for k in (names.K_KIND, names.K_KEY, names.K_DIGEST, names.K_CONFIG, names.K_FILES):
        if k not in manifest:
            raise QerlError(f"{mf} lacks the required field '{k}'.")
    files, inputs = manifest[names.K_FILES], manifest.get(names.K_INPUTS, [])
    ok = (all(isinstance(manifest[k], str) for k in (names.K_KIND, names.K_KEY, names.K_DIGEST))
          and isinstance(manifest[names.K_CONFIG], dict) and isinstance(manifest.get(names.K_METRICS, {}), dict)
          and isinstance(files, list) and isinstance(inputs, list)
          and all(isinstance(f, dict) and isinstance(f.get(names.K_PATH), str) for f in files)
          and all(isinstance(i, dict) and all(isinstance(i.get(k), str) for k in (names.K_KIND, names.K_PATH,
                                                                                  names.K_DIGEST)) for i in inputs))
    if not ok:
        raise QerlError(f"{mf} has fields of the wrong type (kind, key and digest must be strings, config and metrics "
                        "objects, files and inputs lists of objects, each input with a kind, path and digest); "
                        "recreate the artifact with --force.")
    return manifest


def check_files(path: Path, files: list[dict], listing: str = "the manifest") -> str | None:
    """None if every file entry (path, bytes, sha256; as ``list_files`` gives them) names an existing file of
    ``path`` with that size and sha256, else why not (``listing``: what holds the entries, for the message)."""
    for entry in files:
        rel = entry.get(names.K_PATH, "")
        f = _safe_relpath(rel, path)
        if not f.is_file():
            return f"file '{rel}' is missing"
        if f.stat().st_size != entry.get(names.K_BYTES):
            return f"file '{rel}' has {f.stat().st_size} bytes, {listing} says {entry.get(names.K_BYTES)}"
        if sha256_file(f) != entry.get(names.K_SHA256):
            return f"file '{rel}' does not match its sha256"
    return None


def verify_files(path: Path, manifest: dict) -> str | None:
    """None if every listed file exists with its size and sha256 (and no file is missing), else why not."""
    problem = check_files(path, manifest[names.K_FILES])
    if problem is not None:
        return problem
    if _digest(manifest[names.K_KEY], manifest[names.K_FILES]) != manifest[names.K_DIGEST]:
        return "its digest does not match its key and files"
    return None


def _a(word: str) -> str:
    """The article before ``word`` ('an eval', 'a run')."""
    return "an" if word[:1].lower() in "aeiou" else "a"


def open_artifact(path: str | Path, kind: str | tuple[str, ...], check_files: bool = True) -> Artifact:
    """Open an artifact directory, checking schema, kind and (by default) every file hash."""
    path = Path(path)
    manifest = read_manifest(path)
    kinds = (kind,) if isinstance(kind, str) else kind
    if manifest[names.K_KIND] not in kinds:
        want = " or ".join(f"'{k}'" for k in kinds)
        got = manifest[names.K_KIND]
        raise QerlError(f"{path} is {_a(got)} '{got}' artifact, but {_a(kinds[0])} {want} artifact is needed here.")
    if check_files:
        problem = verify_files(path, manifest)
        if problem:
            raise QerlError(f"{path} is damaged: {problem}; recreate it with --force.")
    return Artifact(path, manifest)


def cache_key(kind: str, config: dict, inputs: list[Input]) -> str:
    material = {
        "stage": kind,
        "schema": names.SCHEMA,
        "config": {k: v for k, v in config.items() if k not in names.COSMETIC_FIELDS},
        "inputs": sorted(i.digest for i in inputs),
    }
    return tagged(sha256_json(material))


def _digest(key: str, files: list[dict]) -> str:
    h = hashlib.sha256(key.encode())
    for f in sorted(files, key=lambda e: e[names.K_PATH]):
        h.update(f"{f[names.K_PATH]}:{f[names.K_SHA256]}".encode())
    return tagged(h.hexdigest())


def list_files(root: Path, skip: str = names.MANIFEST) -> list[dict]:
    """Every plain file under ``root`` but those named ``skip`` (the manifest that lists them), as entries
    (path, sha256, bytes) of a manifest's ``files``."""
    files = []
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            raise QerlError(f"stage output {p.name} is a symbolic link; artifacts hold plain files only.")
        if p.is_file() and p.name != skip:
            rel = p.relative_to(root).as_posix()
            files.append({names.K_PATH: rel, names.K_SHA256: sha256_file(p), names.K_BYTES: p.stat().st_size})
    return files


_ARTIFACT_KINDS = {names.KIND_MODEL, names.KIND_CALIB, names.KIND_QUANT, names.KIND_PACKED, names.KIND_VERIFY,
                   names.KIND_ROLLOUT, names.KIND_EVAL, names.KIND_REPORT, names.KIND_RUN}


def check_output_apart(out: str | Path, inputs: list[Input]) -> None:
    """A clear error when the output directory is one of the inputs, holds one, or lies inside one: replacing
    it would destroy that input (artifact inputs are recorded relative to the output, data files, prompts,
    adapters and tasks as given); and when it lies inside any artifact (a train run's directory too)."""
    o = Path(out).resolve()
    for p in o.parents:  # (an artifact written inside another was deleted when that one was replaced: --force)
        if _is_run_config(p / names.RUN_CONFIG) or ((p / names.MANIFEST).is_file() and is_qerl_manifest(p)):
            raise QerlError(f"the output {out} lies inside the artifact {p}, which would lose it when replaced; "
                            "choose an output outside it.")
    for i in inputs:
        cands = [Path(out) / i.path] if i.kind in _ARTIFACT_KINDS else [Path(i.path), Path(out) / i.path]
        for c in cands:
            try:
                c = c.resolve()  # (first: "out/.." must not depend on out existing)
                if not c.exists():
                    continue
            except OSError:
                continue
            if c == o or o in c.parents or c in o.parents:
                raise QerlError(f"the output {out} and the input {c} overlap (one is or holds the other), so writing "
                                "the output would destroy the input; choose another output.")


def _is_run_config(f: Path) -> bool:
    """Whether ``f`` is the run config of a qerl train run (one being written has no manifest yet): a JSON object
    with the run's key and definitions, not another tool's ``train_config.json``."""
    if not f.is_file():
        return False
    try:
        c = json.loads(f.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(c, dict) and str(c.get(names.K_KEY, "")).startswith("sha256:") and "definitions" in c


def is_qerl_manifest(root: Path) -> bool:
    """Whether ``root``'s manifest.json was written by qerl (its schema names ours), readable by this qerl or
    not: only such a directory may be replaced with --force."""
    try:
        m = json.loads((Path(root) / names.MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(m, dict) and str(m.get(names.K_SCHEMA, "")).startswith(names.SCHEMA_NAME + "/")


def foreign_manifest_error(out: Path) -> QerlError:
    return QerlError(f"{out} holds a {names.MANIFEST} that is not a qerl artifact's; it is never replaced, not even "
                     "with --force: choose another output.")


def _sweep_stale_temporaries(out: Path) -> None:
    """Remove temporaries left by stages that were killed. A replaced output (``.old-``) of a dead stage goes
    back to ``out`` when ``out`` is missing (killed between ``_replace_dir``'s two renames: the previous artifact,
    never the new one, is what the user had), else it is removed (killed before removing it)."""
    stale = []
    name = glob.escape(out.name)  # (an output named "v[12]" must not match another output's ".v1.old-…")
    for p in [*out.parent.glob(f".{name}.tmp-*"), *out.parent.glob(f".{name}.old-*")]:
        try:
            pid = int(p.name.rsplit("-", 2)[-2])
        except (ValueError, IndexError):
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            stale.append(p)
    olds = sorted((p for p in stale if p.name.startswith(f".{out.name}.old-")), key=lambda p: p.lstat().st_ctime)
    if olds and not out.exists() and not out.is_symlink():
        os.rename(olds[-1], out)  # (renamed last: the most recent output)
        stale.remove(olds[-1])
    for p in stale:
        if p.is_symlink():  # (a replaced output that was a link: rmtree refuses links)
            p.unlink()
        else:
            shutil.rmtree(p, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _peak_cuda_bytes() -> int:
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return int(torch.cuda.max_memory_allocated())
    except Exception:  # pragma: no cover - best effort
        pass
    return 0


StageBody = Callable[[Path], "dict | None"]


def cached(kind: str, out: str | Path, config: dict, inputs: list[Input], force: bool = False) -> Artifact | None:
    """The artifact at ``out`` when it already is this exact one (what run_stage would find up to date), else
    None; the same errors as run_stage for an output it would refuse. For stages to call before their expensive
    loads (a model), with the config and inputs they then pass to run_stage."""
    return _existing_output(kind, Path(out), cache_key(kind, config, inputs), inputs, force)


def _existing_output(kind: str, out: Path, key: str, inputs: list[Input], force: bool) -> Artifact | None:
    check_output_apart(out, inputs)
    if out.parent.is_dir():  # first: a previous output stranded by a killed stage goes back before the checks
        _sweep_stale_temporaries(out)
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise QerlError(f"output path {out} exists and is not a directory.")
        existing = out / names.MANIFEST
        if existing.is_file():
            try:
                manifest = read_manifest(out)
            except QerlError:
                manifest = None
                if not is_qerl_manifest(out):
                    raise foreign_manifest_error(out) from None
            if manifest is not None and not force and manifest[names.K_KEY] == key:
                problem = verify_files(out, manifest)
                if problem is None:
                    ui.info(f"[green]{kind}[/]: {escape(str(out))} is up to date (cached); nothing to do. "
                            "Use --force to recompute.")
                    return Artifact(out, manifest)
                raise QerlError(f"{out} holds this {kind} artifact but {problem}; rerun with --force to recompute it.")
            if not force:
                what = f"a different '{manifest[names.K_KIND]}' artifact" if manifest else "an unreadable artifact"
                raise QerlError(f"{out} already holds {what}; pass --force to replace it or choose another output.")
        elif any(out.iterdir()):
            raise QerlError(f"{out} is a non-empty directory that is not a qerl artifact; choose another output.")
    return None


def run_stage(kind: str, out: str | Path, config: dict, inputs: list[Input], body: StageBody,
              force: bool = False) -> Artifact:
    """Run ``body(tmp_dir)`` unless ``out`` already holds this exact artifact; return the artifact.

    ``body`` writes the payload files into ``tmp_dir`` and may return extra metrics.
    """
    out = Path(out)
    key = cache_key(kind, config, inputs)
    hit = _existing_output(kind, out, key, inputs, force)
    if hit is not None:
        return hit
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # ("File exists (a/file)." named no mistake)
        blocker = next(p for p in (out.parent, *out.parent.parents) if p.exists() or p.is_symlink())
        raise QerlError(f"the output {out} cannot be made: {blocker} is a file, not a folder.") from None
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
        except Exception:  # pragma: no cover
            pass
        t0 = time.perf_counter()
        extra = body(tmp) or {}
        wall = time.perf_counter() - t0
        files = list_files(tmp)
        metrics = {
            "wall_s": round(wall, 4),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "peak_cuda_bytes": _peak_cuda_bytes(),
            **extra,
        }
        manifest = write_manifest(tmp, kind, config, inputs, key, metrics, files).manifest
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Artifact(out, manifest)


def write_manifest(root: Path, kind: str, config: dict, inputs: list[Input], key: str, metrics: dict,
                   files: list[dict] | None = None) -> Artifact:
    """Hash every payload file under ``root`` (unless ``files`` is given) and write its ``manifest.json``
    atomically (temporary file + rename). ``run_stage`` calls it on its temporary directory; a stage that
    writes its directory incrementally (``train``) calls it last, on the directory itself."""
    if files is None:
        files = list_files(root)
    manifest = {
        names.K_SCHEMA: names.SCHEMA,
        names.K_KIND: kind,
        names.K_VERSION: __version__,
        names.K_CREATED: _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        names.K_CONFIG: config,
        names.K_INPUTS: [i.as_dict() for i in inputs],
        names.K_FILES: files,
        names.K_KEY: key,
        names.K_DIGEST: _digest(key, files),
        names.K_METRICS: metrics,
    }
    part = root / f".{names.MANIFEST}.tmp-{os.getpid()}"
    part.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(part, root / names.MANIFEST)
    return Artifact(root, manifest)


def _replace_dir(tmp: Path, out: Path) -> None:
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.rename(out, old)
        try:
            os.rename(tmp, out)
        except BaseException:  # (a signal between the two renames): the old output goes back
            if not out.exists():
                os.rename(old, out)
            raise
        if old.is_symlink():  # (an output that was a link: the link goes, what it pointed to stays)
            old.unlink()
        else:
            shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)

