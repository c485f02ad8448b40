"""LoRA through peft on the frozen NVFP4 backbone.

peft does not know :class:`~qerl_cli.packed_model.PackedLinear`; ``LoraConfig._register_custom_module`` (peft
>= 0.14) maps it to :class:`PackedLoraLinear`, peft's own LoRA ``Linear`` told the base's shape (it has no
``weight``). The base stays packed: its forward (kernel on CUDA, cached dequantized matmul on CPU) gives input
gradients only, so the backward pass never materializes a bf16 copy of the model on GPU. Merging into a
packed base is refused (it would need requantization). Plain ``nn.Linear`` bases (the bf16 baseline) use
peft's default layer.

Adapters are saved in PEFT format (``adapter_config.json`` + ``adapter_model.safetensors``) and load onto the
bf16 source model with ``PeftModel.from_pretrained`` or into our engine with :func:`qerl_cli.adapter.load_lora`.
On an AWQ pack the factors train in the pack's folded coordinates; the file holds them in the source model's
(:func:`save_adapter` unfolds, :func:`load_adapter_weights` folds back; ``adapter`` module doc).
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import torch

from . import names
from .errors import QerlError
from .packed_model import PackedLinear

DEFAULT_TARGETS = names.PROJECTIONS


def _peft():
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:  # pragma: no cover - a declared dependency
        raise QerlError("training needs peft (pip install 'peft>=0.14').") from None
    return Linear


def _packed_lora_class():
    Linear = _peft()

    class PackedLoraLinear(Linear):
        """peft's LoRA Linear around a PackedLinear base: ``y = base(x) + scaling * B(A(dropout(x)))``."""

        def _get_in_out_features(self, module):
            return module.in_features, module.out_features

        def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
            raise QerlError("a LoRA adapter cannot be merged into a packed NVFP4 base; load it on the bf16 "
                            "model with PeftModel.from_pretrained and merge there.")

        def get_delta_weight(self, adapter):
            return (self.lora_B[adapter].weight @ self.lora_A[adapter].weight) * self.scaling[adapter]

    PackedLoraLinear.__name__ = PackedLoraLinear.__qualname__ = "PackedLoraLinear"
    return PackedLoraLinear


_CLASS = None


def packed_lora_class():
    global _CLASS
    if _CLASS is None:
        _CLASS = _packed_lora_class()
    return _CLASS


def lora_config(rank: int, alpha: float, targets: tuple[str, ...] = DEFAULT_TARGETS, dropout: float = 0.0):
    """A peft ``LoraConfig`` with PackedLinear registered as a custom module."""
    from peft import LoraConfig

    conf = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=dropout, bias="none",
                      task_type="CAUSAL_LM")
    conf._register_custom_module({PackedLinear: packed_lora_class()})
    return conf


def wrap(model, rank: int, alpha: float, targets: tuple[str, ...] = DEFAULT_TARGETS, seed: int = 0,
         dropout: float = 0.0):
    """``get_peft_model`` on ``model`` (in place): LoRA A initialized from ``seed`` (B = 0), fp32 factors,
    every other parameter frozen."""
    from peft import get_peft_model

    found = {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
             if isinstance(m, (PackedLinear, torch.nn.Linear)) and not n.endswith("lm_head")}
    missing = [t for t in targets if t not in found]
    if missing:
        raise QerlError(f"LoRA targets {missing} are not linear layers of this model (it has {sorted(found)}).")
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft reads transformers' deprecated is_gradient_checkpointing: a FutureWarning on stderr in every run
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        torch.manual_seed(seed)
        pm = get_peft_model(model, lora_config(rank, alpha, targets, dropout))
    for n, p in pm.named_parameters():
        if "lora_" in n:
            p.data = p.data.float()
            p.requires_grad_(True)
        else:
            p.requires_grad_(False)
    return pm


def trainable(pm) -> list[tuple[str, torch.nn.Parameter]]:
    """The LoRA parameters in a fixed order (name-sorted)."""
    return sorted(((n, p) for n, p in pm.named_parameters() if p.requires_grad), key=lambda x: x[0])


def _pairs(sd: dict[str, torch.Tensor]) -> dict[str, tuple[str, str]]:
    """module key -> (its lora_A key, its lora_B key) in a PEFT adapter state dict."""
    out: dict[str, list] = {}
    for k in sd:
        for i, tag in enumerate((".lora_A.weight", ".lora_B.weight")):
            if k.endswith(tag):
                out.setdefault(k[: -len(tag)], [None, None])[i] = k
    return {m: (a, b) for m, (a, b) in out.items() if a is not None and b is not None}


def refold(sd: dict[str, torch.Tensor], folds: dict[str, torch.Tensor], to_model: bool) -> dict[str, torch.Tensor]:
    """A PEFT adapter state dict with its factors moved into (``to_model``) or out of a folded model's
    coordinates (:func:`qerl_cli.adapter.fold_factors`); unchanged without folds."""
    if not folds:
        return sd
    from .adapter import fold_factors

    pairs = _pairs(sd)
    moved = fold_factors({m: (sd[a], sd[b]) for m, (a, b) in pairs.items()}, folds, to_model)
    out = dict(sd)
    for m, (a, b) in pairs.items():
        out[a], out[b] = (t.contiguous() for t in moved[m])
    return out


def write_folded_adapter(path: str | Path, folds: dict[str, torch.Tensor]) -> str:
    """A copy of the adapter at ``path`` with its factors folded by ``folds`` (for a backend that runs the folded
    checkpoint itself, e.g. vLLM), in a new temporary directory; the caller removes it."""
    import shutil
    import tempfile

    from safetensors.torch import load_file, save_file

    from .adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    dest = Path(tempfile.mkdtemp(prefix="qerl-folded-adapter-"))
    shutil.copyfile(Path(path) / ADAPTER_CONFIG, dest / ADAPTER_CONFIG)
    save_file(refold(load_file(str(Path(path) / ADAPTER_WEIGHTS)), folds, to_model=True), str(dest / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    return str(dest)


def source_norm(pm) -> float:
    """The L2 norm of the wrapped model's LoRA factors in the source model's coordinates, as the saved adapter file
    holds them (train's ``adapter_norm``): the same number for the same adapter on an AWQ pack or any other."""
    from peft import get_peft_model_state_dict

    from .adapter import model_folding

    with torch.no_grad():
        sd = refold(get_peft_model_state_dict(pm), model_folding(pm.get_base_model()), to_model=False)
        return math.sqrt(sum(float(t.double().pow(2).sum()) for k, t in sd.items() if "lora_" in k))


def save_adapter(pm, path: str | Path) -> None:
    """Save the adapter in PEFT format (config + safetensors, the source model's coordinates), without peft's
    model card."""
    from safetensors.torch import load_file, save_file

    from .adapter import ADAPTER_WEIGHTS, BASE_MODEL_KEY, COORDINATES_KEY, SOURCE_COORDINATES, model_folding

    path = Path(path)
    pm.save_pretrained(str(path), safe_serialization=True)
    (path / "README.md").unlink(missing_ok=True)
    # always rewritten: the metadata marks the factors as the source model's (adapter.COORDINATES_KEY), and names
    # that model where the stage knows it (adapter.BASE_MODEL_KEY: stages refuse the adapter on another model)
    f = path / ADAPTER_WEIGHTS
    meta = {"format": "pt", COORDINATES_KEY: SOURCE_COORDINATES}
    base = getattr(pm.get_base_model(), "qerl_base_model", None)
    if base is not None:
        meta[BASE_MODEL_KEY] = json.dumps(base, sort_keys=True)
    save_file(refold(load_file(str(f)), model_folding(pm.get_base_model()), to_model=False), str(f), metadata=meta)


def load_adapter_weights(pm, path: str | Path, exact: dict[str, torch.Tensor] | None = None) -> None:
    """Load a saved adapter's factors into the wrapped model ``pm`` (resume): folded into an AWQ pack's
    coordinates, or, given ``exact`` (the state dict as trained, which a checkpoint keeps beside the unfolded file
    on a folded model), those values bit for bit. A file without qerl's coordinates marker (a checkpoint of a qerl
    before session 28, which kept no ``exact`` copy) holds the factors as they trained, in the coordinates of the
    pack the run trains on (the run's key pins it): loaded unchanged, never folded a second time."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from .adapter import ADAPTER_WEIGHTS, marked_source, model_folding

    f = Path(path) / ADAPTER_WEIGHTS
    sd = exact if exact else refold(load_file(str(f)), model_folding(pm.get_base_model()) if marked_source(f) else {},
                                    to_model=True)
    own = dict(pm.named_parameters())
    for k, t in sd.items():  # (torch's own error is a multi-line load_state_dict report)
        mine = own.get(k) if k in own else own.get(k.replace(".weight", ".default.weight"))
        if mine is not None and tuple(mine.shape) != tuple(t.shape):
            raise QerlError(f"{path} holds adapter factors of another rank or model: {k} has shape {tuple(t.shape)}, "
                            f"this model's {tuple(mine.shape)}.")
    res = set_peft_model_state_dict(pm, sd)
    bad = [k for k in getattr(res, "unexpected_keys", []) if "lora_" in k]
    if bad:
        raise QerlError(f"{path} holds adapter tensors this model does not have, e.g. {bad[0]}.")
    # the other way round too: a factor of the model that the file lacks would keep its fresh initialisation
    missing = [k for k in getattr(res, "missing_keys", []) if "lora_" in k]
    if missing:
        raise QerlError(f"{path} does not hold all of this model's adapter tensors, e.g. not {missing[0]}.")
