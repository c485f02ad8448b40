"""Reading text records: local jsonl / json / parquet / txt files, or a HF dataset name (through ``datasets``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .artifact import sha256_file
from .errors import QerlError

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".txt")


@dataclass
class Records:
    """Rows of a data source plus where they came from (recorded in manifests)."""

    rows: list[dict]
    origin: dict  # {"type": "file"|"hf", "spec": ..., "sha256"/"revision": ..., "split": ...}


def is_local(spec: str) -> bool:
    """Whether ``spec`` names a local file (which has no splits) rather than a HF dataset."""
    p = Path(spec)
    return p.suffix.lower() in LOCAL_SUFFIXES or p.exists()


def load_records(spec: str, split: str = "train") -> Records:
    """Load rows from ``spec``: a local file, or ``hf:NAME[:CONFIG]`` / a bare HF dataset name."""
    if not spec.strip():  # (Path("") is ".": "data file . is a directory" said nothing of the mistake)
        raise QerlError("the data spec is empty: give a .jsonl/.json/.parquet/.txt file or hf:NAME.")
    p = Path(spec)
    if is_local(spec):
        return _load_local(p)
    name = spec[3:] if spec.startswith("hf:") else spec
    if "/" not in name and not spec.startswith("hf:"):
        raise QerlError(f"data file {spec} does not exist (give a .jsonl/.json/.parquet/.txt file or hf:NAME).")
    try:
        import datasets
    except ImportError:
        raise QerlError(f"loading the HF dataset '{name}' needs the datasets package: pip install datasets") from None
    ds_name, _, cfg_name = name.partition(":")
    try:
        ds = datasets.load_dataset(ds_name, cfg_name or None, split=split)
    except Exception as e:  # datasets raises many types; the user needs the reason, not the traceback
        raise QerlError(f"could not load HF dataset '{name}' split '{split}': {str(e).splitlines()[0]}") from None
    rows = [dict(r) for r in ds]
    return Records(rows, {"type": "hf", "spec": name, "split": split,
                          "fingerprint": getattr(ds, "_fingerprint", None)})


def _json_rows(text: str) -> bool:
    """Whether ``text`` is JSON rows: its first non-blank line, or the whole text, parses to an object or a list."""
    first = next((ln for ln in text.splitlines() if ln.strip()), "")
    for part in (first, text):
        try:
            if isinstance(json.loads(part), (dict, list)):
                return True
        except ValueError:
            pass
    return False


def _load_local(p: Path) -> Records:
    if p.is_dir():
        raise QerlError(f"data file {p} is a directory; give a .jsonl/.json/.parquet/.txt file inside it.")
    if not p.is_file():
        raise QerlError(f"data file {p} does not exist.")
    suffix = p.suffix.lower()
    try:
        if suffix == ".jsonl":
            rows = []
            with open(p, encoding="utf-8-sig") as f:
                for i, line in enumerate(f):
                    if line.strip():
                        try:
                            rows.append(json.loads(line))
                        except ValueError:
                            raise QerlError(f"{p} line {i + 1} is not valid JSON.") from None
        elif suffix == ".json":
            try:
                data = json.loads(p.read_text(encoding="utf-8-sig"))
            except ValueError as e:
                raise QerlError(f"{p} is not valid JSON ({e}).") from None
            rows = data if isinstance(data, list) else data.get("data", data.get("rows")) if isinstance(data, dict) \
                else None
            if not isinstance(rows, list):
                raise QerlError(f"{p} holds neither a JSON list nor an object with a 'data' list.")
        elif suffix == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise QerlError("reading parquet needs pyarrow: pip install pyarrow") from None
            try:
                rows = pq.read_table(p).to_pylist()
            except Exception as e:  # pyarrow raises several types (ArrowInvalid, OSError) for a bad file
                raise QerlError(f"{p} is not a readable parquet file ({str(e).splitlines()[0]}).") from None
        else:
            text = p.read_text(encoding="utf-8-sig")
            if suffix != ".txt" and _json_rows(text):  # (JSON rows read as plain text lost their fields)
                raise QerlError(f"{p} is read as plain text (its name does not end in .jsonl, .json, .parquet or "
                                ".txt), but it holds JSON: name it .jsonl or .json.")
            rows = [{"text": t} for t in text.split("\n\n") if t.strip()]
    except UnicodeDecodeError:
        raise QerlError(f"{p} is not UTF-8 text.") from None
    if any(not isinstance(r, dict) for r in rows):
        raise QerlError(f"{p} has rows that are not JSON objects.")
    return Records(rows, {"type": "file", "spec": str(p), "sha256": sha256_file(p)})


def is_chat_row(row: dict, fields: list[str]) -> bool:
    """Whether ``row_text`` reads ``row`` through the chat template: the field 'messages', or the default 'text'
    on a row with a 'messages' list and no 'text'."""
    return fields == ["messages"] or (isinstance(row.get("messages"), list) and fields == ["text"]
                                      and "text" not in row)


def row_text(row: dict, fields: list[str], tokenizer=None) -> str:
    """Text of one row: chat-shaped rows (``messages``) through the chat template, else the fields joined."""
    msgs = row.get("messages")
    if is_chat_row(row, fields):
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise QerlError("chat-shaped data needs a model with a chat template.")
        if not (isinstance(msgs, list) and msgs and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                       and isinstance(m.get("content"), str) for m in msgs)):
            raise QerlError("chat-shaped rows need a non-empty 'messages' list of {\"role\": str, \"content\": str} "
                            f"objects; a row holds {str(msgs)[:80]!r}.")
        try:
            return tokenizer.apply_chat_template(msgs, tokenize=False)
        except Exception as e:  # jinja raises its own types for what a template refuses (e.g. the role order)
            why = (str(e).splitlines() or [type(e).__name__])[0]
            raise QerlError(f"the chat template cannot render a row ({why}).") from None
    parts = []
    for f in fields:
        if f not in row:
            raise QerlError(f"field '{f}' is not in the data (fields: {sorted(row)[:8]}).")
        if row[f] is None:
            raise QerlError(f"field '{f}' is null in a row of the data.")
        parts.append(str(row[f]))
    return "\n".join(parts)
