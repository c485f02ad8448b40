"""Models built from artifacts: the packed NVFP4 model, and the dequantized reference it is checked against."""

from __future__ import annotations

from pathlib import Path

import torch

from . import layout, names, nvfp4
from .artifact import Artifact, read_json_file, read_tensors_file
from .errors import QerlError


def _matmul_backend():
    try:
        from . import kernel
    except ImportError:  # the kernel wrapper is optional; the layout's reference is always there
        return None
    return kernel


class PackedLinear(torch.nn.Module):
    """``y = x W^T (+ b)`` with ``W`` held in the packed NVFP4 layout (9/16 byte per weight).

    Uses the CUDA kernel on CUDA tensors and the pure-torch reference (dequantize, fp32 matmul) elsewhere.
    The packed weight is a frozen buffer: gradients flow to the input only.
    """

    def __init__(self, qweight: torch.Tensor, global_scale: torch.Tensor, out_features: int, in_features: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        if qweight.dtype != torch.uint8 or qweight.shape[-1] != layout.RECORD_BYTES:
            raise QerlError(f"packed weight must be uint8 [..., {layout.RECORD_BYTES}], got {qweight.dtype} {tuple(qweight.shape)}.")
        if layout.padded_shape(out_features, in_features) != (qweight.shape[0] * layout.TILE_N, qweight.shape[1] * layout.TILE_K):
            raise QerlError(f"packed weight of shape {tuple(qweight.shape)} cannot hold a [{out_features}, {in_features}] matrix.")
        self.out_features = out_features
        self.in_features = in_features
        self.register_buffer(names.PK_QWEIGHT, qweight)
        self.register_buffer(names.PK_GLOBAL, global_scale.float().reshape(1))
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self._dense: torch.Tensor | None = None  # CPU only: dequantized weight cache

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nvfp4 packed"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        backend = _matmul_backend() if x.is_cuda else None
        if backend is not None:  # the bias is added in the kernel's epilogue (same rounding as `y + bias`)
            return backend.linear(x, self.qweight, self.global_scale, self.out_features, self.in_features,
                                  bias=self.bias)
        # CPU (tests, CI): the pure-torch reference, with the dequantized fp32 weight cached after first use —
        # exactly the reference's values (an fp32 product, rounded once to x's dtype), computed once, not per call.
        if self._dense is None:
            self._dense = self.dequantized_weight(torch.float32)
        y = (x @ self._dense.t()) if x.dtype == torch.float32 else (x.float() @ self._dense.t()).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def _apply(self, fn, recurse=True):  # .to()/.cuda() invalidate the CPU cache
        self._dense = None
        gs = self.global_scale
        out = super()._apply(fn, recurse)
        if self.global_scale.dtype != torch.float32:  # a dtype cast (model.to(bf16)): the scale stays exact fp32
            self.global_scale = gs.to(self.global_scale.device)
        return out

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return layout.dequantize(self.qweight, self.global_scale, self.out_features, self.in_features, dtype)


def _skeleton(art_dir: Path, dtype: torch.dtype):
    """An uninitialised model of the artifact's architecture (weights are loaded over it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    conf_dict = read_json_file(art_dir / names.MODEL_CONFIG, art_dir)
    if not isinstance(conf_dict, dict):
        raise QerlError(f"{art_dir / names.MODEL_CONFIG} does not hold a JSON object; recreate the artifact with --force.")
    conf_dict.pop("quantization_config", None)
    model_type = conf_dict.pop("model_type", None)
    if model_type is None:
        raise QerlError(f"{art_dir / names.MODEL_CONFIG} has no model_type.")
    try:
        conf = AutoConfig.for_model(model_type, **conf_dict)
        model = AutoModelForCausalLM.from_config(conf, dtype=dtype)
    except (ValueError, KeyError, TypeError) as e:  # e.g. a model type newer than this machine's transformers
        import transformers

        first = (str(e).splitlines() or [type(e).__name__])[0].split(". ")[0][:200].rstrip(" .:")
        raise QerlError(f"{art_dir} holds a '{model_type}' model, which transformers {transformers.__version__} here "
                        f"cannot build ({first}); use a transformers that supports it.") from None
    if (art_dir / names.GENERATION_CONFIG).is_file():  # (its stop ids: from_config knows config.json's eos only)
        from transformers import GenerationConfig

        try:
            model.generation_config = GenerationConfig.from_pretrained(str(art_dir))
        except (OSError, ValueError, TypeError) as e:
            raise QerlError(f"{art_dir / names.GENERATION_CONFIG} cannot be read ({str(e).splitlines()[0][:200]}); "
                            "recreate the artifact with --force.") from None
    return model.eval()


def _set_module(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def _load_rest(model, tensors: dict[str, torch.Tensor], skip: set[str], dtype: torch.dtype, where: Path) -> None:
    rest = {k: v.to(dtype) for k, v in tensors.items() if k not in skip}
    missing, unexpected = model.load_state_dict(rest, strict=False)
    unexpected = [k for k in unexpected if k not in skip]
    if unexpected:
        raise QerlError(f"{where} holds tensors the model does not have, e.g. {unexpected[0]}.")
    real_missing = [k for k in missing if not any(k.startswith(s.rsplit(".", 1)[0] + ".") for s in skip)]
    real_missing = [k for k in real_missing if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if real_missing:
        raise QerlError(f"{where} lacks tensors the model needs, e.g. {real_missing[0]}.")
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()


def packed_index(art: Artifact) -> dict:
    """The ``packed.json`` of a packed artifact, after checking that its record layout is the one this qerl reads."""
    index = art.read_json(names.PACKED_INDEX)
    if not isinstance(index, dict):
        index = {}
    if index.get("layout") != layout.LAYOUT_NAME:
        raise QerlError(f"{art.path} uses packed layout '{index.get('layout')}'; this qerl reads {layout.LAYOUT_NAME}: "
                        f"re-run `qerl pack` on its quant artifact.")
    if not isinstance(index.get("linears"), dict) or not all(
            isinstance(i, dict) and isinstance(i.get("out_features"), int) and isinstance(i.get("in_features"), int)
            for i in index["linears"].values()):
        raise QerlError(f"{art.path} is damaged: its {names.PACKED_INDEX} is not a packed index; recreate it with "
                        "--force.")
    return index


def load_packed_model(art: Artifact, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                      tensors: dict[str, torch.Tensor] | None = None):
    """The model of a ``packed`` artifact with every quantized Linear replaced by :class:`PackedLinear`
    (``tensors``: the artifact's weights when the caller has already read them)."""
    index = packed_index(art)
    if tensors is None:
        tensors = art.read_tensors(names.MODEL_WEIGHTS)
    for k, t in tensors.items():  # (the codes are uint8; scales, norms and embeddings must be finite)
        if t.is_floating_point() and not torch.isfinite(t.float()).all():  # (float8 has no isfinite of its own)
            raise QerlError(f"{art.path} holds NaN or infinite values in {k}; recreate it from a finite model.")
    model = _skeleton(art.path, dtype)
    skip = set()
    for name, info in index["linears"].items():
        qk, gk = f"{name}.{names.PK_QWEIGHT}", f"{name}.{names.PK_GLOBAL}"
        if qk not in tensors or gk not in tensors:
            raise QerlError(f"{art.path} lacks the packed tensors of {name}.")
        bias = tensors.get(f"{name}.bias")
        _set_module(model, name, PackedLinear(tensors[qk], tensors[gk], info["out_features"], info["in_features"],
                                              None if bias is None else bias.to(dtype)))
        skip.update({qk, gk, f"{name}.bias"})
    _load_rest(model, tensors, skip, dtype, art.path)
    attach_norm_folding(model, art.path)
    return model.to(device)


def attach_norm_folding(model, art_dir: Path) -> None:
    """Record on ``model`` the AWQ factors of an artifact's ``awq_folding.safetensors`` (absent for
    round-to-nearest; module name -> s): all of them (``qerl_folding``: LoRA adapters are folded into the model's
    coordinates with them, ``adapter.fit_lora``) and those its RMSNorm scales were divided by
    (``qerl_norm_folding``: the rollout engine defines AQN's sigma on the unfolded scales with them)."""
    path = Path(art_dir) / names.FOLDING
    folds = read_tensors_file(path, Path(art_dir)) if path.is_file() else {}
    model.qerl_folding = {k: v.float() for k, v in folds.items()}
    model.qerl_norm_folding = {k: v.float() for k, v in folds.items() if k.rsplit(".", 1)[-1].endswith("layernorm")}


def load_dequantized_model(tensors: dict[str, torch.Tensor], art_dir: Path, dtype: torch.dtype = torch.float32,
                           device: str | torch.device = "cpu"):
    """A plain model whose Linear weights are the quant checkpoint's NVFP4 values, dequantized (the reference)."""
    from .pack import check_linear

    model = _skeleton(art_dir, dtype)
    skip = set()
    for key in tensors:
        if key.endswith("." + names.CT_PACKED):
            name = key[: -len(names.CT_PACKED) - 1]
            check_linear(tensors, name)  # (dtypes and shapes: one sentence, as pack gives, not a traceback)
            w = nvfp4.dequantize(nvfp4.unpack_nibbles(tensors[key]), tensors[f"{name}.{names.CT_SCALE}"],
                                 tensors[f"{name}.{names.CT_GLOBAL}"], dtype)
            mod = model.get_submodule(name)
            if tuple(mod.weight.shape) != tuple(w.shape):
                raise QerlError(f"{name} has shape {tuple(w.shape)} in the checkpoint but {tuple(mod.weight.shape)} in the model config.")
            with torch.no_grad():
                mod.weight.copy_(w)
            skip.update({key, f"{name}.{names.CT_SCALE}", f"{name}.{names.CT_GLOBAL}"})
    _load_rest(model, {k: v for k, v in tensors.items()}, skip, dtype, art_dir)
    attach_norm_folding(model, art_dir)
    return model.to(device)


def pack_model_inplace(model, targets: tuple[str, ...] = names.PROJECTIONS,
                       fused_groups: tuple[str, ...] = ("q_proj,k_proj,v_proj", "gate_proj,up_proj")):
    """Quantize (round-to-nearest, shared global scales) and pack every target Linear of ``model`` in memory,
    on its own device — the same math as ``quantize`` + ``pack`` without writing artifacts. For benchmarks
    on random-weight models at real shapes; the pipeline proper goes through the stages."""
    from .quantize import fused_sets, quantized_linears

    linears = quantized_linears(model, targets)
    by_name = dict(linears)
    with torch.no_grad():
        for group in fused_sets(linears, fused_groups):
            g = nvfp4.fused_global_scale([by_name[n].weight for n in group])
            for n in group:
                lin = by_name[n]
                q = nvfp4.quantize_weight(lin.weight, g)
                qweight = layout.pack(nvfp4.unpack_nibbles(q["weight_packed"]), q["weight_scale"])
                bias = None if lin.bias is None else lin.bias.detach()
                _set_module(model, n, PackedLinear(qweight, q["weight_global_scale"].to(qweight.device),
                                                   lin.out_features, lin.in_features, bias))
                lin.weight = None
    return model
