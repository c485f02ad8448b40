"""``qerl pack``: the quant checkpoint's codes and scales re-laid into the kernel's tile layout (see layout.py)."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.markup import escape
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from . import artifact, config, layout, names, nvfp4, ui
from .errors import QerlError

LINEAGE_FILES = (names.MODEL_CONFIG, names.GENERATION_CONFIG, "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja", "special_tokens_map.json", names.QUANT_REPORT, names.FOLDING)


@dataclass
class PackConfig:
    progress: bool
    layout: str = layout.LAYOUT_NAME


def load_checkpoint(art: artifact.Artifact) -> dict[str, torch.Tensor]:
    """All tensors of a quant artifact (its files were verified when it was opened)."""
    try:
        return load_file(str(art.file(names.MODEL_WEIGHTS)))
    except (SafetensorError, OSError) as e:
        raise QerlError(f"{art.path / names.MODEL_WEIGHTS} is not a readable safetensors file ({e}).") from None


def quant_linears(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the NVFP4 linears in a compressed-tensors state dict."""
    return sorted(k[: -len(names.CT_PACKED) - 1] for k in tensors if k.endswith("." + names.CT_PACKED))


def check_linear(tensors: dict[str, torch.Tensor], name: str) -> tuple[int, int]:
    """Validate one NVFP4 linear's tensors; return (N, K)."""
    try:
        packed, scale, g = (tensors[f"{name}.{s}"] for s in (names.CT_PACKED, names.CT_SCALE, names.CT_GLOBAL))
    except KeyError as e:
        raise QerlError(f"quant checkpoint lacks tensor {e.args[0]}.") from None
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise QerlError(f"{name}.{names.CT_PACKED} must be a 2-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}.")
    n, k = packed.shape[0], packed.shape[1] * 2
    if k == 0 or k % nvfp4.GROUP_SIZE:
        raise QerlError(f"{name}.{names.CT_PACKED} holds {k} inputs per row, not a positive multiple of "
                        f"{nvfp4.GROUP_SIZE}; it is not an NVFP4 weight.")
    if scale.dtype != torch.float8_e4m3fn or tuple(scale.shape) != (n, k // nvfp4.GROUP_SIZE):
        raise QerlError(f"{name}.{names.CT_SCALE} must be float8_e4m3fn of shape {(n, k // nvfp4.GROUP_SIZE)}, "
                        f"got {scale.dtype} {tuple(scale.shape)}.")
    if g.dtype != torch.float32 or g.numel() != 1 or not torch.isfinite(g).all() or float(g) <= 0:
        raise QerlError(f"{name}.{names.CT_GLOBAL} must be one positive finite fp32 value.")
    if not torch.isfinite(scale.float()).all():
        raise QerlError(f"{name}.{names.CT_SCALE} holds NaN values.")
    return n, k


def pack_tensors(tensors: dict[str, torch.Tensor], progress: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
    """Packed state dict and the index describing each packed linear."""
    linears = quant_linears(tensors)
    if not linears:
        raise QerlError("the quant checkpoint holds no NVFP4 linear layers.")
    out: dict[str, torch.Tensor] = {}
    index: dict[str, dict] = {}
    consumed = set()
    for name in ui.track(linears, "packing", enabled=progress):
        n, k = check_linear(tensors, name)
        codes = nvfp4.unpack_nibbles(tensors[f"{name}.{names.CT_PACKED}"])
        out[f"{name}.{names.PK_QWEIGHT}"] = layout.pack(codes, tensors[f"{name}.{names.CT_SCALE}"])
        out[f"{name}.{names.PK_GLOBAL}"] = tensors[f"{name}.{names.CT_GLOBAL}"].reshape(1).clone()
        index[name] = {"out_features": n, "in_features": k, "has_bias": f"{name}.bias" in tensors}
        consumed.update(f"{name}.{s}" for s in (names.CT_PACKED, names.CT_SCALE, names.CT_GLOBAL))
    for key, t in tensors.items():
        if key not in consumed:
            if key.endswith(("." + names.CT_SCALE, "." + names.CT_GLOBAL)):  # (its codes are missing)
                raise QerlError(f"the quant checkpoint holds {key} without the "
                                f"{key.rsplit('.', 1)[0]}.{names.CT_PACKED} it scales.")
            if t.is_floating_point() and not torch.isfinite(t.float()).all():
                raise QerlError(f"{key} holds NaN or infinite values.")
            out[key] = t
    return out, {"layout": layout.LAYOUT_NAME, "tile": [layout.TILE_N, layout.TILE_K],
                 "record_bytes": layout.RECORD_BYTES, "linears": index}


def pack(quant: str | Path, output: str | Path, config_file: str | Path | None = None, force: bool = False,
         progress: bool = True) -> artifact.Artifact:
    """Pack a quant artifact into the kernel layout (a ``packed`` artifact)."""
    output = Path(output)
    cfg = config.load("pack", PackConfig, config_file, {"progress": progress})
    q = artifact.open_artifact(quant, names.KIND_QUANT)

    def body(tmp: Path) -> dict:
        packed, index = pack_tensors(load_checkpoint(q), cfg.progress)
        save_file(packed, str(tmp / names.MODEL_WEIGHTS), metadata={"format": "pt", "layout": layout.LAYOUT_NAME})
        (tmp / names.PACKED_INDEX).write_text(json.dumps(index, indent=1) + "\n")
        conf = q.read_json(names.MODEL_CONFIG)
        conf.pop("quantization_config", None)  # the packed dir is not a compressed-tensors checkpoint
        for f in LINEAGE_FILES:
            if f != names.MODEL_CONFIG and q.file(f).is_file():
                shutil.copy2(q.file(f), tmp / f)
        (tmp / names.MODEL_CONFIG).write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
        qbytes = sum(t.numel() for k, t in packed.items() if k.endswith(names.PK_QWEIGHT))
        qweights = sum(v["out_features"] * v["in_features"] for v in index["linears"].values())
        return {"linears": len(index["linears"]), "packed_weight_bytes": qbytes,
                "bytes_per_weight": qbytes / qweights}

    art = artifact.run_stage(names.KIND_PACKED, output, config.as_dict(cfg), [q.as_input(output)], body, force=force)
    ui.info(f"packed: {escape(str(art.path))} ({art.metrics.get('linears')} linears, "
            f"{art.metrics.get('bytes_per_weight', 0):.4f} bytes per weight)")
    return art
