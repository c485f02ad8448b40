"""LoRA through peft on the frozen NVFP4 backbone.

peft does not know :class:`~qerl_cli.packed_model.PackedLinear`; ``LoraConfig._register_custom_module`` (peft
>= 0.14) maps it to :class:`PackedLoraLinear`, peft's own LoRA ``Linear`` told the base's shape (it has no
``weight``). The base stays packed: its forward (kernel on CUDA, cached dequantized matmul on CPU) gives input
gradients only, so the backward pass never materializes a bf16 copy of the model on GPU. Merging into a
packed base is refused (it would need requantization). Plain ``nn.Linear`` bases (the bf16 baseline) use
peft's default layer.

Adapters are saved in PEFT format (``adapter_config.json`` + ``adapter_model.safetensors``) and load onto the
bf16 source model with ``PeftModel.from_pretrained`` or into our engine with :func:`qerl_cli.adapter.load_lora`.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from .errors import QerlError
from .packed_model import PackedLinear

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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


def save_adapter(pm, path: str | Path) -> None:
    """Save the adapter in PEFT format (config + safetensors), without peft's model card."""
    path = Path(path)
    pm.save_pretrained(str(path), safe_serialization=True)
    (path / "README.md").unlink(missing_ok=True)


def load_adapter_weights(pm, path: str | Path) -> None:
    """Load a saved adapter's factors into the wrapped model ``pm`` (exact values; resume)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from .adapter import ADAPTER_WEIGHTS

    sd = load_file(str(Path(path) / ADAPTER_WEIGHTS))
    res = set_peft_model_state_dict(pm, sd)
    bad = [k for k in getattr(res, "unexpected_keys", []) if "lora_" in k]
    if bad:
        raise QerlError(f"{path} holds adapter tensors this model does not have, e.g. {bad[0]}.")
