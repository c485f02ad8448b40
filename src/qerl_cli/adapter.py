"""LoRA adapters in PEFT format (``adapter_config.json`` + ``adapter_model.safetensors``), read without peft."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

from .artifact import sha256_file
from .engine import LoRA
from .errors import QerlError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def load_lora(path: str | Path, model) -> LoRA:
    """Read a PEFT LoRA adapter and check it fits ``model`` (module names and shapes)."""
    path = Path(path)
    if not (path / ADAPTER_CONFIG).is_file() or not (path / ADAPTER_WEIGHTS).is_file():
        raise QerlError(f"{path} is not a LoRA adapter: it needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}.")
    try:
        conf = json.loads((path / ADAPTER_CONFIG).read_text())
        r = int(conf.get("r", 0))
        alpha = float(conf.get("lora_alpha", r))
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise QerlError(f"{path / ADAPTER_CONFIG} is not a valid adapter config ({e}).") from None
    if r < 1:
        raise QerlError(f"{path / ADAPTER_CONFIG} has no valid rank r.")
    scaling = alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r
    try:
        tensors = load_file(str(path / ADAPTER_WEIGHTS))
    except Exception as e:  # (safetensors' own error type for a file cut short or not a safetensors file)
        raise QerlError(f"{path / ADAPTER_WEIGHTS} cannot be read ({e}).") from None
    factors: dict[str, list] = {}
    for key, t in tensors.items():
        for part, idx in (("lora_A", 0), ("lora_B", 1)):
            marker = f".{part}."
            if marker in key:
                name = key.split(marker)[0]
                for prefix in ("base_model.model.", "base_model."):
                    if name.startswith(prefix):
                        name = name[len(prefix):]
                        break
                factors.setdefault(name, [None, None])[idx] = t
    if not factors:
        raise QerlError(f"{path / ADAPTER_WEIGHTS} holds no LoRA tensors.")
    modules = dict(model.named_modules())
    out = {}
    for name, (a, b) in factors.items():
        if a is None or b is None:
            raise QerlError(f"adapter {path} has only one LoRA factor for {name}.")
        mod = modules.get(name)
        if mod is None:
            raise QerlError(f"adapter {path} targets {name}, which this model does not have (an adapter for another model?).")
        if a.shape != (r, mod.in_features) or b.shape != (mod.out_features, r):
            raise QerlError(f"adapter {path} has {name} factors of shapes {tuple(a.shape)}, {tuple(b.shape)}; "
                            f"this model needs [{r}, {mod.in_features}] and [{mod.out_features}, {r}] "
                            "(an adapter for another model?).")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise QerlError(f"adapter {path} holds NaN or infinite values in {name}.")
        out[name] = (a.float(), b.float())
    digest = sha256_file(path / ADAPTER_WEIGHTS)
    return LoRA(out, scaling, digest)
