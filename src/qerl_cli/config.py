"""Stage configuration: shipped defaults in ``stages/<stage>.toml``, a user's ``--config`` file, then flags.

The shipped file is the single source of defaults (every parameter documented there); a stage's dataclass
validates the merged values in ``__post_init__`` and collects every problem into one error.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from .errors import QerlError

C = TypeVar("C")


# Environment switches that change what the engine and the NVFP4 kernels compute on CUDA (kernel variant, grids and
# split-K order, fused paths, the sampler): part of the cache key of the stages that run them, when set, so a run
# under other switches is never a cache hit of one without. Build, logging and probe switches are not.
_RESULT_ENV_PREFIXES = ("QERL_ENGINE_", "QERL_KERNEL_", "QERL_DISABLE_KERNEL", "QERL_CLUSTER", "QERL_TC_MAX_M",
                        "QERL_ATTN_CLUSTER")
_NOT_RESULT_ENV = {"QERL_KERNEL_VERBOSE", "QERL_KERNEL_TIMELINE", "QERL_KERNEL_ARCH_FLAGS"}
_ENGINE_ENV_PREFIXES = ("QERL_ENGINE_", "QERL_ATTN_CLUSTER")  # the engine's (not the NVFP4 kernels') switches


def without_unused_sampling(run_config: dict, temperature: float, sigma: float) -> dict:
    """``run_config`` for a cache key, with what a greedy draw ignores set to None: greedy (temperature 0) draws
    nothing, so top-p / top-k, and without AQN (sigma 0) the seed, change no token (the fields the config has)."""
    if temperature != 0:
        return run_config
    unused = [k for k in ("top_p", "top_k") if k in run_config] + (["seed"] if sigma == 0 else [])
    return run_config | dict.fromkeys(unused)


def result_env() -> dict:
    """{"result_env": {...}} of the switches set in this environment (see above), or {} when none is."""
    import os

    env = {k: v for k, v in sorted(os.environ.items())
           if k.startswith(_RESULT_ENV_PREFIXES) and k not in _NOT_RESULT_ENV}
    return {"result_env": env} if env else {}


def kernel_env(env: dict | None = None) -> dict:
    """The switches of ``env`` (a ``result_env`` mapping; default: this environment's) that change what the NVFP4
    kernels compute, the ones a verify of the kernel must have run under (the engine's own switches are not)."""
    if env is None:
        env = result_env().get("result_env", {})
    return {k: v for k, v in env.items() if not k.startswith(_ENGINE_ENV_PREFIXES)}


def stages_dir() -> Path:
    """Directory holding the shipped stage configs (inside the wheel, or ``stages/`` of a source checkout)."""
    packaged = resources.files("qerl_cli") / "stages"
    if packaged.is_dir():
        return Path(str(packaged))
    return Path(__file__).resolve().parents[2] / "stages"


def shipped_config_path(stage: str) -> Path:
    return stages_dir() / f"{stage}.toml"


def _read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise QerlError(f"config file {path} does not exist.") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise QerlError(f"config file {path} is not valid TOML ({e}).") from None
    except OSError as e:
        raise QerlError(f"config file {path} cannot be read ({e.strerror or e}).") from None


def load(stage: str, cls: type[C], config_file: str | Path | None = None, overrides: dict | None = None) -> C:
    """Shipped defaults < ``config_file`` < ``overrides`` (entries that are None are ignored)."""
    values = _read_toml(shipped_config_path(stage))
    fields = {f.name for f in dataclasses.fields(cls)}
    # Fields with a dataclass default are set by the stage itself (e.g. the method), not by config files.
    settable = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
    missing = settable - values.keys()
    if missing:  # a packaging defect, not a user error, but say it plainly
        raise QerlError(f"shipped config {shipped_config_path(stage)} lacks {sorted(missing)}.")
    if config_file is not None:
        user = _read_toml(Path(config_file))
        unknown = sorted(set(user) - settable)
        if unknown:
            raise QerlError(f"{config_file} sets unknown {stage} parameter(s) {unknown}; known: {sorted(settable)}.")
        values.update(user)
    for k, v in (overrides or {}).items():
        if v is not None:
            values[k] = v
    values = {k: v for k, v in values.items() if k in fields}
    for f in dataclasses.fields(cls):
        if f.name in values:
            values[f.name] = _coerce(stage, f.name, values[f.name], f.type)
    try:
        cfg = cls(**values)
    except (TypeError, ValueError) as e:
        raise QerlError(f"invalid {stage} config: {e}; change that option or --config value.") from None
    # after the stage's own checks (their sentences say more), what no setting of any stage means is refused by
    # name: a NaN (it passes every `<` check a stage forgot) or an infinity, and an integer of 2**40 or more in
    # size (a 2**63 one ended in an overflow traceback inside the stage)
    for problem, wrong in (("must be finite (not nan or inf)", lambda x: isinstance(x, float) and not math.isfinite(x)),
                           ("must be below 2**40 in size",
                            lambda x: isinstance(x, int) and not isinstance(x, bool) and abs(x) >= SEED_LIMIT)):
        bad = [k for k, v in values.items() if any(map(wrong, v if isinstance(v, tuple) else (v,)))]
        if bad:
            raise QerlError(f"invalid {stage} config: {', '.join(bad)} {problem}; change that option or --config value.")
    return cfg


_SCALARS = {"float": float, "int": int, "bool": bool, "str": str}


def _scalar_ok(value: Any, t: str) -> bool:
    if t == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if t == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, _SCALARS[t])


def _coerce(stage: str, name: str, value: Any, typ: Any) -> Any:
    t = typ if isinstance(typ, str) else getattr(typ, "__name__", str(typ))
    m = re.fullmatch(r"tuple\[(\w+), \.\.\.\]", t)
    if m and m.group(1) in _SCALARS:
        el = m.group(1)
        if not isinstance(value, list) or not all(_scalar_ok(v, el) for v in value):
            raise QerlError(f"{stage} parameter '{name}' must be a list of {el}s, got {value!r}.")
        return tuple(float(v) if el == "float" else v for v in value)
    if t in _SCALARS:
        if not _scalar_ok(value, t):
            raise QerlError(f"{stage} parameter '{name}' must be a {t}, got {value!r}.")
        return float(value) if t == "float" else value
    return value


# the largest seed + 1 a stage takes (torch's generators take 64 bits; derived seeds hash the seed's text)
SEED_LIMIT = 2**40


def seed_problems(**seeds: int) -> list[str]:
    """The problem sentence of each seed outside [0, SEED_LIMIT) (a huge one was an overflow traceback)."""
    return [f"{k} must be in [0, {SEED_LIMIT}) (2**40)" for k, v in seeds.items() if not 0 <= v < SEED_LIMIT]


def validate(problems: list[str]) -> None:
    """Raise one ValueError listing every problem (used by config ``__post_init__``)."""
    if problems:
        raise ValueError("; ".join(problems))


def as_dict(cfg: Any) -> dict:
    d = dataclasses.asdict(cfg)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
