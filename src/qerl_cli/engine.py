"""Our rollout engine: batched prefill, a preallocated KV cache, a decode loop (one CUDA graph per step on
GPU, eager on CPU), temperature / top-k / top-p sampling with recorded behaviour log-probs, LoRA next to the
(packed or bf16) base, and Adaptive Quantization Noise on the RMSNorm scales.

The engine runs on the modules of a HF Llama-family model (``model.model.layers``): their linears may be
:class:`~qerl_cli.packed_model.PackedLinear` (NVFP4) or plain ``nn.Linear`` (bf16 baseline), so every backend
shares this one code path. It never changes the model's values: norm weights are read into a clean snapshot
and the noisy copies live in the engine (``effective_norm_weights``), LoRA factors are applied as two small
matmuls beside each base linear and swapped with :meth:`Engine.set_adapter`.

Fused projections (on CUDA by default; ``fuse``): the q/k/v weights of a layer, and its gate/up weights, are
re-homed into one buffer each (the modules keep their exact values as views into it), so each group runs as
one matmul — one packed-kernel launch instead of three (two) per layer in every decode step. NVFP4 groups
fuse only where the members share one tensor scale (``qerl quantize`` gives fused sets one, as vLLM needs).
Each member's LoRA (our container or a peft layer) is added to its slice of the fused output. No-grad calls
(rollouts, scoring) batch the LoRA terms of each fused group and linear into one pair of matmuls (a snapshot of
the adapter per call, see ``_lora_terms``); differentiable forwards compute them as peft does.

Fused kernels (CUDA, bf16, no grad; :mod:`qerl_cli.fused`): residual add + RMSNorm, rotary + KV-cache write,
SiLU·mul, each one kernel, rounding where torch's ops round; in decode steps the rotary and the cache write ride
in the decode attention kernel (``fused.rope_decode_attn``) and SiLU·mul in the gate/up NVFP4 kernel
(``kernel.linear_silu``, with the group's LoRA term where an adapter is on). Where a layer's packed products take
the dequantize + cuBLAS path (batched steps past the small-M kernels, prefills), one launch dequantizes all of
its projections (``Engine.dequant_layer``).

Opt-in (``Engine.attend_buckets``): decode steps that attend in SDPA (an adapter, or batches past the decode
attention kernel's one wave) attend over the cache's first slots up to a bucket of ``ATTEND_BUCKET`` above the
step's own, not over the whole cache under a mask: one decode graph per bucket.

Behaviour log-probs: for each sampled token, the log-prob under the distribution it was **actually sampled
from**: logits / temperature, then top-k and top-p truncation, renormalized (``behaviour_logprobs``). The
log-prob under the untruncated tempered softmax is stored too (``tempered_logprobs``); both are equal when
top-k = 0 and top-p = 1. Greedy decoding (temperature 0) records 0.0 (a deterministic policy).

Non-finite logits (NaN/Inf: a diverged adapter, overflowing activations) are a clear error, never a crash in
``torch.multinomial`` (a raw RuntimeError on CPU, a device-side assert that kills the process on CUDA): each
decode step replaces such rows by finite ones before sampling (the fused sampling kernel never draws a NaN or +inf
logit) and records on the device that it did, and the loop reads that record where it syncs anyway (every 8
steps and at the end), raising before any batch returns.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from . import fused as _fk
from . import kernel as _kernel
from .errors import QerlError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
# On CUDA a rollout's KV cache holds a multiple of this many slots (``Engine.cache_slots``).
SLOT_BUCKET = 32
# Forwards of the fused kernels whose packed products take the dequantize + cuBLAS path (batched decode steps above
# the small-M range, prefills, log-prob passes) dequantize a layer's projections in one launch where they hold at
# most this many weights together (a bf16 copy of 128 MiB at most; ``Engine.dequant_layer``).
DEQUANT_LAYER_MAX_WEIGHTS = 2 ** 26
# Decode steps that attend in SDPA attend over the cache's first n slots, n their slot + 1 rounded up to a multiple
# of this (``Engine.attend_buckets``).
ATTEND_BUCKET = 64
# Teacher-forced log-probs project at most this many logits at a time (fp32: 1 GiB).
LOGIT_CHUNK_ELEMENTS = 2 ** 28


MIN_TEMPERATURE = 1e-4  # the smallest temperature > 0 sampled (below it, logits / T overflow fp32 into NaN)


def derive_seed(*parts) -> int:
    """A seed in [0, 2**63) from ``parts``: int.from_bytes(sha256(':'.join(map(str, parts))).digest()[:8],
    'little') >> 1. Each engine call's sampling and noise seeds come from (run seed, purpose, position), so streams
    of different purposes (a noise draw and a sampler on one CPU generator type), batches or run seeds never
    coincide, as ``seed + batch`` and ``seed * 1,000,003 + batch`` did at seed 0 and between neighbouring seeds."""
    import hashlib

    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


def check_positions(model_config, longest_prompt: int, max_new_tokens: int) -> None:
    """One sentence (QerlError) where the longest prompt plus the new tokens need more positions than the model
    has (``max_position_embeddings``, where its config gives one)."""
    limit = getattr(model_config, "max_position_embeddings", None)
    if limit and longest_prompt + max_new_tokens > limit:
        raise QerlError(f"the longest prompt ({longest_prompt} tokens) plus max_new_tokens ({max_new_tokens}) needs "
                        f"{longest_prompt + max_new_tokens} positions, more than the model's max_position_embeddings "
                        f"({limit}).")


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256

    def __post_init__(self):
        problems = []
        if not 0 <= self.temperature < math.inf:  # (NaN fails too)
            problems.append("temperature must be finite and >= 0")
        elif 0 < self.temperature < MIN_TEMPERATURE:  # logits / T would overflow fp32 (review, session 19)
            problems.append(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}")
        if not 0 < self.top_p <= 1:
            problems.append("top_p must be in (0, 1]")
        if self.top_k < 0:
            problems.append("top_k must be >= 0")
        if self.max_new_tokens < 1:
            problems.append("max_new_tokens must be >= 1")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass
class NoiseState:
    """One AQN draw: z ~ N(0, sigma^2) added to the clean RMSNorm scales (never accumulated). The noisy scales
    are kept in fp32 whatever the model's dtype: in bf16 (a unit in the last place is 2^-7 at 1) most draws of
    sigma <= 2e-3 would round back to the clean scale, and the logged sigma would overstate the noise."""

    sigma: float = 0.0
    seed: int = 0
    scope: str = "batch"  # "batch": one draw for the whole batch; "group": one draw per prompt group
    targets: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    final_norm: bool = False  # the final norm (model.norm) too: off unless asked (drawn after every layer's)
    draws: int = 0  # how many draws this engine has made (each from the clean snapshot)
    # sigma is defined on the model's original (unfolded) norm scales: on an AWQ-folded model (scale w / s)
    # each draw is divided by s, so a given sigma perturbs the model function the same with or without AWQ
    space: str = "unfolded norm scales"
    dtype: str = "float32"  # of the noisy scales; the norm's product with them is rounded to the model's dtype

    def as_dict(self) -> dict:
        d = asdict(self)
        d["targets"] = list(self.targets)
        return d


@dataclass
class RolloutBatch:
    """What one ``generate`` call produced; tensors on CPU. Rows are prompt-major: row = prompt * G + sample."""

    prompt_ids: list[list[int]]
    group: int
    completion_ids: torch.Tensor  # [R, T] int64 (pad after the end)
    completion_mask: torch.Tensor  # [R, T] bool: tokens the policy generated (eos included)
    behaviour_logprobs: torch.Tensor  # [R, T] fp32, 0 where masked
    tempered_logprobs: torch.Tensor  # [R, T] fp32
    finish_reason: list[str]  # "eos" | "length"
    timings: dict = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return self.completion_ids.shape[0]

    def lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(1)


def _sliding_window(config) -> int | None:
    """The attention window of a model whose layers all use sliding-window attention (Mistral), None for full
    attention (Llama; Qwen2 unless ``use_sliding_window``). Mixed layer types are refused."""
    w = getattr(config, "sliding_window", None)
    if not w or getattr(config, "use_sliding_window", True) is False:
        return None
    types = set(getattr(config, "layer_types", None) or ["sliding_attention"])
    if types == {"full_attention"}:
        return None
    if types != {"sliding_attention"}:
        raise QerlError(f"the rollout engine does not support models that mix attention types per layer ({sorted(types)}).")
    return int(w)


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm (normalize in fp32, round to the input's dtype, times ``w``); fp32 (noisy) scales on a bf16
    input multiply in fp32 and round the product once to the input's dtype."""
    dt = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    y = w * h.to(dt)
    return y if y.dtype == dt else y.to(dt)


def _rope1(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def _rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    return _rope1(q, cos, sin), _rope1(k, cos, sin)


def _rms_norm_fused(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``_rms_norm`` through torch's fused RMSNorm on the input's own dtype (fp32 statistics inside, no cast
    kernels). A plain weight vector of the input's dtype is applied inside the same kernel (one rounding
    instead of ``_rms_norm``'s two, at most one unit in the last place apart); per-row (noisy) weights are
    applied after it."""
    # (under autocast rms_norm runs in fp32 and returns fp32: back to the input dtype, as _rms_norm rounds)
    if w.dim() == 1 and w.dtype == x.dtype:
        return F.rms_norm(x, (x.shape[-1],), w, eps=eps).to(x.dtype)
    return (w * F.rms_norm(x, (x.shape[-1],), eps=eps).to(x.dtype)).to(x.dtype)  # (fp32 noisy w: one rounding)


def _add_then(norm):
    """Residual add, then ``norm`` of the sum: ``(h, d, w, eps) -> (new residual, normed)``."""

    def add_norm(h: torch.Tensor, d: torch.Tensor, w: torch.Tensor, eps: float):
        h = h + d
        return h, norm(h, w, eps)

    return add_norm


def _silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return F.silu(g) * u


def _silu_mul_kernel(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``_silu_mul`` in one fused CUDA kernel where the views allow 16-byte accesses (else torch's ops)."""
    ok = g.stride() == u.stride() and g.stride(-1) == 1 and g.shape[-1] % 8 == 0 and g.stride(-2) % 8 == 0
    return _fk.silu_mul(g, u) if ok else _silu_mul(g, u)


class _Ops:
    """The elementwise pieces of a layer: eager (CPU: exactly HF's op order), eager with torch's fused RMSNorm
    (CUDA), or each compiled into one fused kernel (torch.compile, opt-in)."""

    def __init__(self, compiled: bool, fused_norm: bool = False):
        wrap = (lambda f: torch.compile(f, dynamic=True, fullgraph=True)) if compiled else (lambda f: f)
        norm = _rms_norm_fused if fused_norm else _rms_norm
        self.norm, self.rope, self.rope1, self.add_norm, self.silu_mul = (
            wrap(f) for f in (norm, _rope, _rope1, _add_then(norm), _silu_mul))


_EAGER_OPS = _Ops(False)
_CUDA_OPS = _Ops(False, fused_norm=True)
_COMPILED_OPS: _Ops | None = None


def _compiled_ops() -> _Ops:
    global _COMPILED_OPS
    if _COMPILED_OPS is None:
        import torch._inductor.config as inductor_config

        # round where eager rounds (bf16 casts inside the norm), so compiled rollouts sample from the policy
        # the eager training forward scores
        inductor_config.emulate_precision_casts = True
        _COMPILED_OPS = _Ops(True)
    return _COMPILED_OPS


PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")
FUSED_GROUPS = {"qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")), "gate_up": ("mlp", ("gate_proj", "up_proj"))}


def _reference_packed(model) -> bool:
    """True when the model has packed linears but the CUDA kernel is unavailable: their pure-torch fallback
    copies index tables to the device on every call, which a CUDA graph cannot capture (eager decode then)."""
    from .packed_model import PackedLinear

    if not any(isinstance(m, PackedLinear) for m in model.modules()):
        return False
    try:
        from . import kernel
    except ImportError:
        return True
    return not kernel.available()


def _base_layer(m):
    """The frozen base of a (possibly peft-wrapped) linear."""
    return getattr(m, "base_layer", m)


def _peft_delta(m, x: torch.Tensor) -> torch.Tensor | None:
    """The LoRA term a peft ``LoraLayer`` adds to its base output (None for a plain module or no adapter)."""
    if not hasattr(m, "lora_A") or getattr(m, "disable_adapters", False):
        return None
    if getattr(m, "merged", False):
        raise QerlError("a LoRA adapter merged into its base layer cannot run on fused projections.")
    out = None
    for name in m.active_adapters:
        if name not in m.lora_A:
            continue
        a, b = m.lora_A[name], m.lora_B[name]
        xa = x.to(a.weight.dtype) if not torch.is_autocast_enabled(x.device.type) else x
        d = b(a(m.lora_dropout[name](xa))) * m.scaling[name]
        out = d if out is None else out + d
    return out


_NO_LORA = object()  # a linear or fused group without LoRA terms (in a LoRA snapshot)


def _lora_terms(modules: list, names: list[str], sizes: list[int], lora: "LoRA | None"):
    """The LoRA terms of sibling linears on one input (a fused group's members, or one linear) as one pair
    for no-grad calls: ``(A [sum r, in], Bs [sum r, sum out], segs)`` with the members' A stacked and their B, times
    the scaling, block-diagonal and transposed, so ``y + (x @ A^T) @ Bs`` is the whole LoRA term (``segs``: each
    member's last column and rank rows, flat, for ``fused.lora_add``) — two matmuls
    (the second with the add in its epilogue) instead of four ops per member plus a concatenation.
    ``_NO_LORA`` when no member has a term; None when they cannot be batched (several adapters on one member,
    active dropout, differing scalings or dtypes): then each member's term is computed as in training."""
    terms = []
    for m, n in zip(modules, names):
        found = []
        if hasattr(m, "lora_A") and not getattr(m, "disable_adapters", False):
            if getattr(m, "merged", False):
                return None
            for name in m.active_adapters:
                if name in m.lora_A:
                    drop = m.lora_dropout[name]
                    if (drop.training and getattr(drop, "p", 0.0) > 0) or getattr(m, "use_dora", {}).get(name):
                        return None
                    found.append((m.lora_A[name].weight.detach(), m.lora_B[name].weight.detach(),
                                  float(m.scaling[name])))
        if lora is not None and n in lora.factors:
            a, b = lora.factors[n]
            found.append((a, b, lora.scaling))
        if len(found) > 1:
            return None
        terms.append(found[0] if found else None)
    present = [t for t in terms if t is not None]
    if not present:
        return _NO_LORA
    if len({t[2] for t in present}) > 1 or len({(t[0].dtype, t[1].dtype, t[0].device) for t in present}) > 1:
        return None
    a = torch.cat([t[0] for t in present])
    bs = torch.zeros(a.shape[0], sum(sizes), dtype=present[0][1].dtype, device=a.device)
    row = col = 0
    segs: list[int] = []  # (col_end, row_begin, row_end) per member: the nonzero block of its columns
    for t, size in zip(terms, sizes):
        r = t[0].shape[0] if t is not None else 0
        if t is not None:
            bs[row: row + r, col: col + size] = t[1].t() * t[2]
        col += size
        segs += [col, row, row + r]
        row += r
    return a, bs, tuple(segs)


def _lora_add(y: torch.Tensor, x: torch.Tensor, terms: tuple[torch.Tensor, torch.Tensor, tuple[int, ...]],
              kernels: bool = False, shrunk: torch.Tensor | None = None) -> torch.Tensor:
    """``y`` plus the batched LoRA term of ``x`` (see ``_lora_terms``); the add rides in the second matmul's
    epilogue where the dtypes agree (peft's fp32 factors on bf16 activations without autocast: added after).
    ``kernels``: no-grad bf16 CUDA calls of at most ``fused.LORA_MAX_ROWS`` rows (decode steps) and outputs at
    most ``fused.LORA_KERNEL_MAX_N`` wide run the two fused kernels of ``fused.lora_add`` instead of the matmuls.
    ``shrunk``: ``bf16(x @ A^T)`` already made (``[rows, R]``: fp32 from the fused kernel that made ``x``, or
    bf16 from a matmul above ``fused.LORA_MAX_ROWS`` rows): only the expand is left (bf16 tensors, no grad, no
    autocast)."""
    a, bs, segs = terms
    auto = torch.is_autocast_enabled(x.device.type)
    y2 = y.reshape(-1, y.shape[-1])
    fits = (kernels and not auto and y.is_cuda and y2.shape[0] <= _fk.LORA_MAX_ROWS and not torch.is_grad_enabled()
            and y2.shape[1] <= _fk.LORA_KERNEL_MAX_N and x.dtype == y.dtype == a.dtype == bs.dtype == torch.bfloat16)
    if shrunk is not None:
        out = _fk.lora_expand(y2.contiguous(), shrunk, bs, segs) if fits else None
        return out.view(y.shape) if out is not None else torch.addmm(y2, shrunk.to(bs.dtype), bs).view(y.shape)
    if fits:  # decode steps: the two small fused kernels (no split-K reduce kernels, launches overlapped)
        out = _fk.lora_add(y2.contiguous(), x.reshape(-1, x.shape[-1]).contiguous(), a, bs, segs)
        if out is not None:
            return out.view(y.shape)
    h = (x if auto else x.to(a.dtype)).reshape(-1, x.shape[-1]) @ a.t()
    if auto or h.dtype == y.dtype == bs.dtype:
        return torch.addmm(y2, h, bs).view(y.shape).to(y.dtype)
    return (y2 + (h @ bs).to(y.dtype)).view(y.shape)


def _rehomed(bases: list, tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The fused buffer an earlier engine made for these modules, if they are still its consecutive views."""
    w = getattr(bases[0], "_qerl_fused_buffer", None)
    if w is None:
        return None
    at = 0
    for t in tensors:
        if t.data_ptr() != w[at:].data_ptr() or t.shape[1:] != w.shape[1:]:
            return None
        at += t.shape[0]
    return w if at == w.shape[0] else None


def _fused_bias(bases: list, device) -> torch.Tensor | None:
    """The members' biases end to end (zeros for a member without one, in the others' dtype), or None."""
    given = [b.bias for b in bases if b.bias is not None]
    if not given:
        return None
    return torch.cat([b.bias.detach() if b.bias is not None else
                      torch.zeros(b.out_features, dtype=given[0].dtype, device=device) for b in bases])


class _Fused:
    """One matmul for a group of sibling linears (views of one weight buffer) and the slices of its output."""

    def __init__(self, modules: list, names: list[str]):
        from .packed_model import PackedLinear

        bases = [_base_layer(m) for m in modules]
        self.modules, self.names = modules, names
        self.sizes = [b.out_features for b in bases]
        if all(isinstance(b, PackedLinear) for b in bases):
            w = _rehomed(bases, [b.qweight for b in bases])
            w = torch.cat([b.qweight for b in bases]) if w is None else w
            bias = _fused_bias(bases, w.device)
            self.base = PackedLinear(w, bases[0].global_scale.clone(), sum(self.sizes), bases[0].in_features, bias)
            at = 0
            for b in bases:  # the members keep their values, now as views into the fused buffer
                rows = b.qweight.shape[0]
                b._buffers["qweight"] = w[at: at + rows]
                b._dense = None
                at += rows
        else:
            w = _rehomed(bases, [b.weight.detach() for b in bases])
            w = torch.cat([b.weight.detach() for b in bases]) if w is None else w
            bias = _fused_bias(bases, w.device)
            at = 0
            for b in bases:
                b.weight.data = w[at: at + b.out_features]
                at += b.out_features
            self.base = lambda x: F.linear(x, w, bias)
        bases[0]._qerl_fused_buffer = w  # a later engine on the same model reuses it (no second copy)

    @staticmethod
    def possible(modules: list) -> bool:
        from .packed_model import PackedLinear

        bases = [_base_layer(m) for m in modules]
        if len({b.in_features for b in bases}) != 1:
            return False
        if all(isinstance(b, PackedLinear) for b in bases):
            g = bases[0].global_scale
            return all(b.out_features % 16 == 0 and torch.equal(b.global_scale, g) for b in bases)
        if all(type(b) is torch.nn.Linear for b in bases):
            return len({(b.weight.dtype, b.weight.device) for b in bases}) == 1
        return False


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class LoRA:
    """LoRA factors per linear: ``y += scaling * (x @ A^T) @ B^T``; a plain container, swapped as a whole.
    ``source``: the factors as the adapter file holds them (the source model's coordinates) where ``factors``
    were folded for an AWQ pack (``adapter.fit_lora``), else None."""

    def __init__(self, factors: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float, digest: str = "",
                 source: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None):
        self.factors = factors
        self.scaling = scaling
        self.digest = digest
        self.source = source

    def to(self, device, dtype) -> "LoRA":
        return LoRA({k: (a.to(device, dtype), b.to(device, dtype)) for k, (a, b) in self.factors.items()},
                    self.scaling, self.digest, self.source)


@dataclass(eq=False)
class _DecodeGraph:
    """A decode step's CUDA graph with every tensor it reads that a rollout call refills (see
    ``Engine._decoder``): kept between calls while its key holds."""
    key: tuple | None
    cache: list[tuple[torch.Tensor, torch.Tensor]]
    key_mask: torch.Tensor
    norms: list[dict[str, torch.Tensor]]
    snap: dict[int, object] | None
    rope: torch.Tensor | None  # (kept alive: the graph reads its rows)
    lora: object = None  # the adapter object the graph was captured with (compared by identity)
    tok: torch.Tensor | None = None
    pos: torch.Tensor | None = None
    at: torch.Tensor | None = None
    # attended slots (None: the whole cache, see Engine._attend_bucket) -> (graph, its logits); one memory pool
    graphs: dict | None = None
    pool: object = None


def _attended(slot: int, bucket: int | None, slots: int) -> int | None:
    """The slots a decode step writing slot ``slot`` attends over: ``slot + 1`` rounded up to a multiple of
    ``bucket``, at most ``slots``; None (the whole cache) without a bucket."""
    return None if bucket is None else min(slots, -(-(slot + 1) // bucket) * bucket)


def _snap_signature(t) -> object:
    """The structure of one LoRA snapshot entry (see ``_lora_terms``): what a kept graph needs to be unchanged."""
    if t is None or t is _NO_LORA:
        return "unbatched" if t is None else "none"
    a, bs, segs = t
    return (tuple(a.shape), a.dtype, tuple(bs.shape), bs.dtype, segs)


def _copy_snapshot(dst: dict[int, object] | None, src: dict[int, object] | None) -> None:
    """Copy the values of LoRA snapshot ``src`` into ``dst`` of the same structure (a kept graph's)."""
    if dst is None:
        return
    pairs = [(d, s) for k, t in dst.items() if isinstance(t, tuple)
             for d, s in zip(t[:2], src[k][:2])]
    if pairs:
        torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])


class Engine:
    def __init__(self, model, device: str | torch.device | None = None, cuda_graph: bool = True,
                 grad_checkpoint: bool = False, fuse: bool | None = None, compile_elementwise: bool | None = None,
                 kernels: bool | None = None):
        mt = getattr(model.config, "model_type", None)
        if mt not in SUPPORTED_MODEL_TYPES:
            raise QerlError(f"the rollout engine supports {', '.join(SUPPORTED_MODEL_TYPES)} models, not '{mt}'.")
        act = getattr(model.config, "hidden_act", "silu")
        if act != "silu":  # (its MLP is SiLU(gate) * up, in torch and in the fused kernels alike)
            raise QerlError(f"the rollout engine computes SiLU MLPs, but this model's hidden_act is '{act}'.")
        self.model = model.eval()
        p = next(model.parameters())
        self.device = torch.device(device) if device is not None else p.device
        self.dtype = model.model.embed_tokens.weight.dtype
        c = model.config
        self.n_heads = c.num_attention_heads
        self.n_kv = getattr(c, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // self.n_heads
        self.eps = c.rms_norm_eps
        self.window = _sliding_window(c)  # keys more than this many positions back are not attended to
        self.layers = list(model.model.layers)
        # Qwen3: an RMSNorm over each head of q and of k before the rotary (per-layer q_norm / k_norm weights)
        self.qk_norm = [(layer.self_attn.q_norm.weight.detach(), layer.self_attn.k_norm.weight.detach())
                        for layer in self.layers] if hasattr(self.layers[0].self_attn, "q_norm") else None
        self.embed = model.model.embed_tokens
        self.final_norm = model.model.norm.weight.detach().clone()  # (clean: hf_policy writes draws into the model's)
        self.lm_head = model.lm_head
        self.rotary = model.model.rotary_emb
        self._rope_tab: torch.Tensor | None = None  # [P, 2, head_dim]: cos, sin of positions 0 ... P - 1 (_rope_table)
        self.clean = [{t: getattr(layer, t).weight.detach().clone() for t in NoiseState.targets}
                      for layer in self.layers]
        folds = getattr(model, "qerl_norm_folding", None) or {}
        self.noise_divisor = [{t: folds.get(f"model.layers.{i}.{t}") for t in NoiseState.targets}
                              for i in range(len(self.layers))]
        self.noise = NoiseState()
        self._noisy: list[dict[str, torch.Tensor]] | None = None  # [H] or [R, 1, H] per layer and target
        self._noise_groups: tuple[int, int] | None = None  # a per-group draw's (groups, group_size)
        self._noisy_final: torch.Tensor | None = None  # the final norm's draw, where asked
        self.lora: LoRA | None = None
        self.use_graph = cuda_graph and self.device.type == "cuda" and not _reference_packed(model)
        from .packed_model import PackedLinear

        # whether products run the NVFP4 kernels, whose process-wide settings a kept decode graph must match
        self._nvfp4_on_cuda = self.device.type == "cuda" and any(isinstance(m, PackedLinear) for m in model.modules())
        # differentiable forwards without a cache recompute each layer in the backward pass
        self.grad_checkpoint = grad_checkpoint
        if fuse is None:  # default: on CUDA; QERL_ENGINE_FUSE=0/1 overrides
            env = os.environ.get("QERL_ENGINE_FUSE")
            fuse = self.device.type == "cuda" if env is None else env == "1"
        if compile_elementwise is None:  # opt-in (QERL_ENGINE_COMPILE=1): inference forwards on CUDA only
            compile_elementwise = os.environ.get("QERL_ENGINE_COMPILE") == "1"
        self._ops = _compiled_ops() if compile_elementwise and self.device.type == "cuda" else None
        # fused elementwise CUDA kernels (csrc/fused_ops.cu) for no-grad bf16 forwards on CUDA (default where
        # they build), unless the compiled ops were asked for, kernels=False or QERL_ENGINE_KERNELS=0
        self._kernels = (kernels is not False and self._ops is None and self.device.type == "cuda"
                         and self.dtype == torch.bfloat16 and c.hidden_size % 8 == 0
                         and c.hidden_size <= _fk.MAX_WIDTH and _fk.available())
        self.fused: list[dict[str, _Fused]] = [{} for _ in self.layers]
        if fuse:
            for i, layer in enumerate(self.layers):
                for key, (parent, members) in FUSED_GROUPS.items():
                    mods = [getattr(getattr(layer, parent), n) for n in members]
                    if _Fused.possible(mods):
                        self.fused[i][key] = _Fused(mods, [f"model.layers.{i}.{parent}.{n}" for n in members])
        # the decode step's CUDA graph and KV cache are kept after a rollout call: the next call with the same
        # rows, cache slots (``cache_slots``), adapter structure and settings refills them and replays the graph
        # instead of two warm-up steps and a capture; False (or QERL_ENGINE_KEEP_GRAPH=0): each call captures its
        # own and frees it (the cache's memory returns to torch's allocator between calls)
        self.keep_graph = os.environ.get("QERL_ENGINE_KEEP_GRAPH", "1") != "0"
        self._graph: _DecodeGraph | None = None
        self._eos: set[int] = set()
        # no-grad calls batch the LoRA terms of each fused group and linear (a snapshot taken when the call starts,
        # dropped when it ends, so it never outlives the adapter weights it copied); False (or
        # QERL_ENGINE_BATCH_LORA=0): the terms as in training
        self.batch_lora = os.environ.get("QERL_ENGINE_BATCH_LORA", "1") != "0"
        # with the fused kernels on, the batched terms of decode steps (<= fused.LORA_MAX_ROWS rows, bf16 factors,
        # outputs up to fused.LORA_KERNEL_MAX_N wide) run as two small fused kernels (fused.lora_add) instead of
        # two cuBLAS matmuls (session 8, H200, 7B shapes at batch 8, rank 32: 1,729 against 1,624 tokens/s);
        # QERL_ENGINE_LORA_KERNELS=0 keeps the matmuls
        self.lora_kernels = os.environ.get("QERL_ENGINE_LORA_KERNELS", "1") != "0"
        # with those, the shrink x @ A^T of the q/k/v, gate/up and down terms rides in the kernel that makes x
        # (add + RMSNorm, SiLU·mul: fused.add_norm_shrink, fused.silu_mul_shrink; session 13, H200, 7B shapes at
        # batch 8, rank 32: 1,800 / 1,803 against 1,727 / 1,718 tokens/s); QERL_ENGINE_FUSED_SHRINK=0 (or False)
        # launches it on its own
        self.fused_shrink = os.environ.get("QERL_ENGINE_FUSED_SHRINK", "1") != "0"
        # with those, the term's expand rides in the NVFP4 product itself (kernel.linear_lora: decode steps of at
        # most 16 rows on the small-M kernels, session 14; up to 64 since session 15: the shrink comes from the
        # fused kernel that made x, else fused.lora_shrink, above 16 rows from a matmul): one launch fewer per
        # projection, and the gate/up term no longer a cuBLAS addmm.
        # QERL_ENGINE_LORA_IN_KERNEL=0 (or False) keeps the separate expand kernels
        self.lora_in_kernel = os.environ.get("QERL_ENGINE_LORA_IN_KERNEL", "1") != "0"
        # with the fused kernels on, a packed gate/up group without LoRA terms whose product the stream-K kernel
        # (v2w8 or v2w10) runs writes silu(gate) * up itself (kernel.linear_silu; rows the stream-K split cuts between blocks
        # are summed in another fp32 order): the SiLU·mul kernel and the [M, 2I] intermediate go.
        # QERL_ENGINE_SILU_IN_KERNEL=0 (or False) keeps the two kernels
        self.silu_in_kernel = os.environ.get("QERL_ENGINE_SILU_IN_KERNEL", "1") != "0"
        # with an adapter (decode steps, our LoRA's batched terms in the kernels), the gate/up group's term rides in
        # that same launch before the SiLU (session 22) and down's shrink runs in fused.lora_shrink, instead of the
        # [M, 2I] product plus the SiLU·mul kernel with down's shrink; QERL_ENGINE_SILU_LORA_IN_KERNEL=0 (or False)
        # keeps the two kernels there
        self.silu_lora_in_kernel = os.environ.get("QERL_ENGINE_SILU_LORA_IN_KERNEL", "1") != "0"
        self._lora_snap: dict[int, object] | None = None
        # decode steps on CUDA at temperature > 0 without top-k / top-p draw their tokens in one fused kernel
        # (fused.sample_step: Gumbel-max on Philox noise, with the step's bookkeeping) instead of about fifteen
        # torch ops; QERL_ENGINE_FUSED_SAMPLER=0 (or False) keeps torch's multinomial
        self.fused_sampler = os.environ.get("QERL_ENGINE_FUSED_SAMPLER", "1") != "0"
        # with the fused kernels on, decode steps (one token per row, q from the rotary + KV-write kernel, no sliding
        # window) may attend with fused.decode_attn: the slots up to the step's only, each KV head's cache read once
        # for its query heads, no additive mask built. QERL_ENGINE_DECODE_ATTN=1 (or True): wherever the kernel
        # takes the shapes; "wave": only where its blocks fit one wave on the GPU (else SDPA); 0 (or False): SDPA;
        # "auto" (the default): "wave" without an adapter, SDPA with one. Session 18 on an H100, 7B shapes at batch
        # 8 interleaved (benchmarks/results/s18/): "wave" 2,256-2,318 tok/s against SDPA's 2,232-2,280 without an
        # adapter, but 1,778-1,816 against 1,814-1,833 with a rank-32 one (slower in all four pairs, not understood)
        mode = os.environ.get("QERL_ENGINE_DECODE_ATTN", "auto")
        if mode not in ("0", "1", "wave", "auto"):
            raise QerlError(f"QERL_ENGINE_DECODE_ATTN must be 0, 1, wave or auto, not {mode!r}.")
        self.decode_attn: bool | str = mode if mode in ("wave", "auto") else mode == "1"
        # where decode steps attend with our kernel, the rotary of q and k and the step's cache write ride in it
        # (fused.rope_decode_attn: one kernel instead of rope_kv + decode_attn, the same bits);
        # QERL_ENGINE_ROPE_IN_ATTN=0 (or False) keeps the two kernels
        self.rope_in_attn = os.environ.get("QERL_ENGINE_ROPE_IN_ATTN", "1") != "0"
        # a decode step's additive mask where fused.decode_attn declined it in a layer: built once, in the first
        # such layer, and reused by the others of the same forward (reset at each forward's start and end)
        self._step_mask: torch.Tensor | None = None
        # with the fused kernels on, a layer's packed projections that take the dequantize + cuBLAS path (more rows
        # than the small-M kernels take: batched decode steps such as SmolLM2's at batch 256, prefills) are
        # dequantized by one launch at the layer's start (kernel.dequantize_many; DEQUANT_LAYER_MAX_WEIGHTS at most)
        # instead of one per projection: the same bits, three launches fewer per layer (session 33);
        # QERL_ENGINE_DEQUANT_LAYER=0 (or False) keeps one per projection
        self.dequant_layer = os.environ.get("QERL_ENGINE_DEQUANT_LAYER", "1") != "0"
        self._dense_w: dict[int, torch.Tensor] | None = None  # id(packed base) -> its bf16 copy, in _layer_kernels
        # opt-in (QERL_ENGINE_ATTEND_BUCKETS=1 or True): on CUDA, decode steps that attend in SDPA (with an adapter
        # under decode_attn "auto", at shapes our kernel does not take, or past the one wave that "wave" allows, e.g.
        # SmolLM2 at batch 256) attend over the cache's first n slots, n the step's slot + 1 rounded up to a multiple
        # of ATTEND_BUCKET, not over every slot under the mask (the slots past the step's are masked out anyway): one
        # decode graph per such n, all captured before the first step (session 33), each with its own fp32 logits
        # (rows x vocab x 4 bytes per bucket, kept with the graph). Off by default: on an H100 at
        # SmolLM2's shapes, batch 256, 256 new tokens, a kept graph's call ran 6-8 % faster with them, but a call
        # that captures its own graphs 5-14 % slower (four captures instead of one), and `qerl train` captures anew
        # every step
        self.attend_buckets = os.environ.get("QERL_ENGINE_ATTEND_BUCKETS", "0") == "1"

    # ---------------------------------------------------------------- adapters and noise
    def set_adapter(self, lora: LoRA | None) -> None:
        """Use ``lora`` (or none) from the next forward on; the base weights are never touched."""
        if lora is not None:
            names = {n for n, m in self.model.named_modules()}
            unknown = [k for k in lora.factors if k not in names]
            if unknown:
                raise QerlError(f"the adapter targets {unknown[0]}, which this model does not have.")
            projections = {f"model.layers.{i}.{p}" for i in range(len(self.layers)) for p in PROJECTIONS}
            other = [k for k in lora.factors if k not in projections]
            if other:  # the forward adds LoRA terms on the seven projections only: never drop one silently
                raise QerlError(f"the adapter targets {other[0]}; the rollout engine applies LoRA to the attention "
                                "and MLP projections only.")
            lora = lora.to(self.device, self.dtype)
        self.lora = lora
        self._graph = None

    def set_noise(self, sigma: float, seed: int, scope: str = "batch", groups: int = 1, group_size: int = 1,
                  final_norm: bool = False) -> NoiseState:
        """Draw AQN noise from the clean snapshot (replacing any previous draw). ``scope='group'`` draws one
        vector per prompt group; rows of a group share it. ``final_norm``: the final norm's scale too, drawn
        after every layer's (so the layers' draws are those of the same seed without it)."""
        if sigma < 0 or not math.isfinite(sigma):
            raise QerlError(f"the noise sigma must be a finite number >= 0, got {sigma}.")
        if scope not in ("batch", "group"):
            raise QerlError(f"noise scope must be 'batch' or 'group', got '{scope}'.")
        self.noise = NoiseState(sigma=sigma, seed=seed, scope=scope, final_norm=bool(final_norm and sigma > 0),
                                draws=self.noise.draws + (sigma > 0))
        self._noisy_final = None
        self._noise_groups = (groups, group_size) if scope == "group" else None
        if sigma == 0:
            self._noisy = None
            return self.noise
        g = torch.Generator(device="cpu").manual_seed(seed)
        noisy = []
        for clean, div in zip(self.clean, self.noise_divisor):
            d = {}
            for t, w in clean.items():
                shape = (groups,) + tuple(w.shape) if scope == "group" else tuple(w.shape)
                z = torch.randn(shape, generator=g, dtype=torch.float32) * sigma
                if div[t] is not None:  # AWQ-folded scale w / s: the same draw on w, folded
                    z = z / div[t]
                v = (w.float().cpu() + z).to(self.device)  # fp32: see NoiseState
                if scope == "group":
                    v = v.repeat_interleave(group_size, dim=0).unsqueeze(1)  # [R, 1, H]
                d[t] = v
            noisy.append(d)
        self._noisy = noisy
        if final_norm:  # (no AWQ fold touches the final norm)
            w = self.final_norm
            z = torch.randn((groups,) + tuple(w.shape) if scope == "group" else tuple(w.shape), generator=g,
                            dtype=torch.float32) * sigma
            v = (w.float().cpu() + z).to(self.device)
            self._noisy_final = v.repeat_interleave(group_size, dim=0).unsqueeze(1) if scope == "group" else v
        return self.noise

    def select_noise_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` of a per-group draw (a training forward over a subset of the sampled groups)."""
        if self._noisy is not None and self.noise.scope == "group":
            self._noisy = [{t: v[rows] for t, v in d.items()} for d in self._noisy]
            self._noise_groups = None  # (a subset of rows: no longer groups of one size)
            if self._noisy_final is not None:
                self._noisy_final = self._noisy_final[rows]

    def effective_norm_weights(self) -> list[dict[str, torch.Tensor]]:
        """The norm scales the next forward uses (clean snapshot, or the current noisy draw)."""
        return self._noisy if self._noisy is not None else self.clean

    def effective_final_norm(self) -> torch.Tensor:
        """The final norm's scale the next forward uses (clean, or its draw where one was asked for)."""
        return self._noisy_final if self._noisy_final is not None else self.final_norm

    # ---------------------------------------------------------------- forward
    def _linear(self, module, name: str, x: torch.Tensor, shrunk: torch.Tensor | None = None) -> torch.Tensor:
        """``module(x)`` with the adapter's term (``shrunk``: its shrink already made, see ``_shrink_terms``)."""
        snap = self._lora_snap.get(id(module)) if self._lora_snap is not None else None
        if snap is not None:  # a no-grad call: the base, then the batched LoRA term (see _lora_terms)
            base = _base_layer(module)
            if snap is _NO_LORA:
                return self._base_out(base, x)
            y, shrunk = self._lora_in_kernel(base, x, snap, shrunk)
            if y is not None:
                return y
            return _lora_add(self._base_out(base, x), x, snap, self._kernels and self.lora_kernels, shrunk)
        y = self._base_out(module, x)  # (a peft-wrapped module has no bf16 copy: module(x))
        if self.lora is not None:
            f = self.lora.factors.get(name)
            if f is not None:
                a, b = f
                y = y + (x @ a.t()) @ b.t() * self.lora.scaling
        return y

    def _base_out(self, base, x: torch.Tensor) -> torch.Tensor:
        """``base(x)``, from the bf16 copy that ``_layer_dense`` made of a packed base where there is one: the
        dequantize + cuBLAS path's own steps (``kernel.linear``: the product into a fresh output, then the bias
        added to the bf16 result), so the same bits."""
        w = self._dense_w.get(id(base)) if self._dense_w is not None else None
        if w is None:
            return base(x)
        x2 = x.reshape(-1, x.shape[-1])
        y = torch.mm(x2, w.t(), out=torch.empty(x2.shape[0], w.shape[0], dtype=x.dtype, device=x.device))
        if base.bias is not None:
            y.add_(base.bias.to(x.dtype).contiguous())
        return y.view(*x.shape[:-1], w.shape[0])

    def _layer_dense(self, i: int, h: torch.Tensor) -> dict[int, torch.Tensor] | None:
        """Bf16 copies of layer ``i``'s packed bases (fused groups' and lone projections') whose product on
        hidden states ``h`` takes the dequantize + cuBLAS path, made by one ``kernel.dequantize_many`` launch,
        by ``id`` of the base; None where fewer than two qualify, they hold more than
        ``DEQUANT_LAYER_MAX_WEIGHTS`` weights, or ``dequant_layer`` is off."""
        if not (self.dequant_layer and self._nvfp4_on_cuda):
            return None
        from .packed_model import PackedLinear

        rows, layer, fused = h.shape[0] * h.shape[1], self.layers[i], self.fused[i]
        in_group = {n for key, (_, members) in FUSED_GROUPS.items() if key in fused for n in members}
        bases = [f.base for f in fused.values()]
        for p in PROJECTIONS:
            parent, name = p.split(".")
            if name not in in_group:
                m = getattr(getattr(layer, parent), name)
                # (_linear hands _base_out the base where the snapshot has an entry for the module, else the module
                # itself: a peft wrapper then computes its own base, and no copy would be read)
                snap = self._lora_snap.get(id(m)) if self._lora_snap is not None else None
                bases.append(_base_layer(m) if snap is not None else m)
        take = [b for b in bases if isinstance(b, PackedLinear)
                and _kernel.path(rows, b.out_features, b.in_features) == _kernel.BACKEND_DEQUANT]
        if len(take) < 2 or sum(b.out_features * b.in_features for b in take) > DEQUANT_LAYER_MAX_WEIGHTS:
            return None
        ws = _kernel.dequantize_many([(b.qweight, b.global_scale, b.out_features, b.in_features) for b in take])
        return {id(b): w for b, w in zip(take, ws)}

    def _lora_in_kernel(self, base, x: torch.Tensor, terms: tuple, shrunk: torch.Tensor | None
                        ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(base(x) + term, shrunk)`` from one NVFP4 kernel launch with the batched LoRA ``terms`` inside
        (``kernel.linear_lora``) for no-grad bf16 CUDA decode steps of a packed base; ``(None, shrunk)`` where it
        does not apply — the shrink, if made here, is handed back so the caller's expand uses it. The shrink
        ``bf16(x @ A^T)`` comes from the kernel that made ``x`` or ``fused.lora_shrink`` up to
        ``fused.LORA_MAX_ROWS`` rows, from a matmul (bf16 out) above, up to ``kernel.LORA_MAX_ROWS``: the batches
        of RL rollouts (prompts x group) then skip the expand's launch too."""
        _, bs, segs = terms
        x2, shrunk = self._term_in_kernel(base, x, terms, shrunk)
        if x2 is None:
            return None, shrunk
        y = _kernel.linear_lora(x2, base.qweight, base.global_scale, base.out_features, base.in_features, shrunk,
                                bs, segs, bias=base.bias)
        return (None if y is None else y.view(*x.shape[:-1], base.out_features)), shrunk

    def _term_in_kernel(self, base, x: torch.Tensor, terms: tuple, shrunk: torch.Tensor | None
                        ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(x as contiguous [rows, in], shrink)`` where the batched LoRA ``terms`` of packed ``base`` can ride
        in its NVFP4 kernel (no-grad bf16 CUDA decode rows, the LoRA kernels on, no autocast, a small-M kernel runs
        the product), the shrink made here if not given; ``(None, shrunk)`` where not."""
        from .packed_model import PackedLinear

        a, bs, _ = terms
        rows = x.numel() // x.shape[-1] if x.dim() else 0
        # (bf16 CUDA tensors are the kernels' own checks: each declines anything else)
        if not (self.lora_in_kernel and self._kernels and self.lora_kernels and isinstance(base, PackedLinear)
                and x.dtype == a.dtype == bs.dtype and 0 < rows <= _kernel.LORA_MAX_ROWS
                and not torch.is_grad_enabled() and not torch.is_autocast_enabled(x.device.type)
                and _kernel.takes_lora(rows, base.out_features, base.in_features)):
            return None, shrunk
        x2 = x.reshape(rows, x.shape[-1]).contiguous()
        if shrunk is None:
            shrunk = _fk.lora_shrink(x2, a) if rows <= _fk.LORA_MAX_ROWS else x2 @ a.t()
            if shrunk is None:
                return None, None
        return x2, shrunk

    def _fused_out(self, f: _Fused, x: torch.Tensor, shrunk: torch.Tensor | None = None) -> torch.Tensor:
        """The fused group's output ``[..., sum(sizes)]``, each member's LoRA added to its slice (``shrunk``:
        the batched terms' shrink already made, see ``_shrink_terms``)."""
        snap = self._lora_snap.get(id(f)) if self._lora_snap is not None else None
        if snap is not None and snap is not _NO_LORA:  # one batched pair for the whole group (see _lora_terms)
            y, shrunk = self._lora_in_kernel(f.base, x, snap, shrunk)
            if y is not None:
                return y
            return _lora_add(self._base_out(f.base, x), x, snap, self._kernels and self.lora_kernels, shrunk)
        y = self._base_out(f.base, x)
        if snap is _NO_LORA:
            return y
        deltas: list[torch.Tensor | None] = []
        for m, n in zip(f.modules, f.names):
            d = _peft_delta(m, x)
            if self.lora is not None and n in self.lora.factors:
                a, b = self.lora.factors[n]
                c = (x @ a.t()) @ b.t() * self.lora.scaling
                d = c if d is None else d + c
            deltas.append(d)
        if all(d is None for d in deltas):
            return y
        ref = next(d for d in deltas if d is not None)
        # back to the base output's dtype, as peft does (fp32 LoRA factors on bf16 activations without autocast)
        return y + torch.cat([d if d is not None else ref.new_zeros(ref.shape[:-1] + (size,))
                              for d, size in zip(deltas, f.sizes)], -1).to(y.dtype)

    def _group(self, i: int, key: str, modules: list, names: list[str], x: torch.Tensor,
               shrunk: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Outputs of sibling linears on the same input: one fused matmul where the layer has one (``shrunk``:
        that group's LoRA shrink already made)."""
        f = self.fused[i].get(key)
        if f is None:
            return [self._linear(m, n, x) for m, n in zip(modules, names)]
        return list(self._fused_out(f, x, shrunk).split(f.sizes, dim=-1))

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, key_mask: torch.Tensor,
                cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None, write_at: torch.Tensor | None = None,
                rows: slice | None = None, hidden_only: bool = False, attend: int | None = None,
                norms: list[dict[str, torch.Tensor]] | None = None) -> torch.Tensor:
        """Logits ``[B, T, V]`` for tokens ``ids [B, T]`` at positions ``pos``. Without a cache, attention is
        causal over ``ids`` with ``key_mask [B, T]``; with a cache, K/V are written at ``write_at`` (T slots
        from there) and queries attend to every cache slot allowed by ``key_mask [B, S]`` and causality.
        ``attend`` (with a cache): only the first ``attend`` slots can be attended to (the prefill, whose
        queries never see later slots): attention is computed over those alone, not the whole cache.
        ``norms``: the norm scales to use instead of ``effective_norm_weights()`` (a kept decode graph's copy)."""
        b, t = ids.shape
        h = self.embed(ids)
        cos, sin = self._cos_sin(h, pos, cache)  # [B, T, head_dim]
        norms = self.effective_norm_weights() if norms is None else norms
        if cache is None:
            s_len, base = t, torch.zeros((), dtype=torch.long, device=ids.device)
        else:
            s_len, base = cache[0][0].shape[2] if attend is None else attend, write_at
            key_mask = key_mask[:, :s_len]
        qpos = base + torch.arange(t, device=ids.device)
        ckpt = self.grad_checkpoint and cache is None and torch.is_grad_enabled()
        kernels = self._use_kernels(h)
        # a decode step through fused.decode_attn needs no mask (should the kernel decline, _attention builds it)
        dattn = kernels and cache is not None and t == 1 and attend is None and self._decode_attn_ok()
        mask = None if dattn else self._mask(key_mask, s_len, qpos, h.dtype if kernels else None)
        pending = None  # with the kernels, each layer's MLP output is added inside the next layer's norm
        self._step_mask = None
        try:
            for i in range(len(self.layers)):
                nw = norms[i]
                w_in, w_post = nw["input_layernorm"], nw["post_attention_layernorm"]
                if rows is not None and w_in.dim() == 3:
                    w_in, w_post = w_in[rows], w_post[rows]
                if ckpt:  # keep only each layer's input; recompute the layer in the backward pass
                    h = torch.utils.checkpoint.checkpoint(self._layer, i, h, w_in, w_post, cos, sin, mask, None,
                                                          None, use_reentrant=False)
                elif kernels:
                    h, pending = self._layer_kernels(i, h, pending, w_in, w_post, cos, sin, mask, cache, qpos,
                                                     key_mask if dattn else None)
                else:
                    h = self._layer(i, h, w_in, w_post, cos, sin, mask, cache, qpos)
        finally:
            self._step_mask = None
        fw = self.effective_final_norm()
        if rows is not None and fw.dim() == 3:
            fw = fw[rows]
        if kernels:  # the last MLP output's residual add and the final norm in one fused kernel
            h = _fk.add_norm(h, pending, fw, self.eps)[1]
        else:
            h = _rms_norm(h if pending is None else h + pending, fw, self.eps)
        return h if hidden_only else self.lm_head(h)

    def _rope_table(self, n: int) -> None:
        """Make the table of cos / sin for positions ``0 ... n - 1`` (at least) where the model's rotary embedding
        is static (rope types default, linear, llama3), on CUDA: the module itself on every position at once, the
        same elementwise kernels as per call, so a row is bit-identical to the module's output at that position.
        Called before a rollout's forwards (never inside a CUDA-graph capture); a decode step then gathers its rows
        in one kernel instead of the module's eight or so."""
        if self.device.type != "cuda" or getattr(self.rotary, "rope_type", None) not in ("default", "linear", "llama3"):
            return  # (on CPU a long tensor's cos can take another vector path than a short one's: not the same bits)
        tab = self._rope_tab
        # (the device as "cuda" never equals a tensor's "cuda:0": compare type and, where given, index; rebuilt on
        # every call, the table's new id made every kept decode graph's key differ)
        same_device = tab is not None and tab.device.type == self.device.type and (
            self.device.index is None or tab.device.index == self.device.index)
        if same_device and tab.shape[0] >= n and tab.dtype == self.dtype:
            return
        pos = torch.arange(max(n, 1), device=self.device)[None]
        cos, sin = self.rotary(torch.empty(0, dtype=self.dtype, device=self.device), pos)
        self._rope_tab = torch.stack([cos[0], sin[0]], 1)

    def _cos_sin(self, h: torch.Tensor, pos: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[B, T, head_dim]`` at positions ``pos``: rows of the table of ``_rope_table`` for a forward
        with a cache of no more slots than the table has rows (a position never exceeds its slot), else the
        rotary module."""
        tab = self._rope_tab
        if (cache is None or tab is None or tab.shape[0] < cache[0][0].shape[2] or tab.device != h.device
                or tab.dtype != h.dtype):
            return self.rotary(h, pos)
        cs = tab[pos]  # [B, T, 2, D]
        return cs[..., 0, :], cs[..., 1, :]

    def _mask(self, key_mask: torch.Tensor, s_len: int, qpos: torch.Tensor, additive: torch.dtype | None
              ) -> torch.Tensor:
        """The attention mask ``[B, 1, T, s_len]`` of queries at slots ``qpos`` over the first ``s_len`` slots:
        causal, ``key_mask``, the sliding window; bool, or additive (0 / -inf) in dtype ``additive``."""
        slots = torch.arange(s_len, device=qpos.device)
        causal = slots[None, :] <= qpos[:, None]
        if self.window is not None:  # (a row's slots and positions differ by its left padding only)
            causal = causal & (qpos[:, None] - slots[None, :] < self.window)
        # every query also sees its own slot: a left-padding query would otherwise see nothing (NaN); real
        # queries see their own slot anyway
        mask = (causal[None, None] & key_mask[:, None, None, :]) | (slots[None, :] == qpos[:, None])[None, None]
        if additive is None:
            return mask
        # (with the kernels: the additive form once per forward, not a bool -> float conversion in every layer)
        return torch.zeros(mask.shape, dtype=additive, device=mask.device).masked_fill_(~mask, float("-inf"))

    def _decode_attn_mode(self) -> bool | str:
        """The decode-attention mode in force: ``decode_attn``, with "auto" resolved ("wave" without an adapter,
        False — SDPA — with one)."""
        if self.decode_attn == "auto":
            return False if self.lora is not None else "wave"
        return self.decode_attn

    def _decode_attn_ok(self) -> bool:
        """Whether decode steps attend with ``fused.decode_attn`` (q from the rotary + KV-write kernel, shapes the
        kernel takes; it may still decline a call, e.g. for a cache of more slots than it takes, or in "wave" mode
        where its blocks do not fit one wave)."""
        return bool(self._decode_attn_mode() and self.window is None and self.qk_norm is None
                    and self.head_dim in (64, 128) and self.n_heads % self.n_kv == 0 and self.n_heads // self.n_kv <= 8
                    and all(f.get("qkv") is not None for f in self.fused) and _fk.available())

    def _layer(self, i: int, h: torch.Tensor, w_in: torch.Tensor, w_post: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, mask: torch.Tensor, cache, slots: torch.Tensor | None) -> torch.Tensor:
        """One decoder layer (pre-norm attention + pre-norm SwiGLU MLP, residuals) on hidden states ``h``."""
        if self._ops is not None and not torch.is_grad_enabled():
            ops = self._ops
        else:
            ops = _CUDA_OPS if h.is_cuda else _EAGER_OPS
        x = ops.norm(h, w_in, self.eps)
        h, x = ops.add_norm(h, self._attention(i, x, cos, sin, mask, cache, slots, ops), w_post, self.eps)
        return h + self._mlp(i, x, ops.silu_mul)

    def _mlp(self, i: int, x: torch.Tensor, silu_mul, shrunk: torch.Tensor | None = None,
             down_terms: tuple | None = None) -> torch.Tensor:
        """The SwiGLU MLP of layer ``i`` on normed ``x`` (``silu_mul(g, u)``: the activation's implementation;
        ``shrunk``: the gate/up terms' shrink already made; ``down_terms``: the down projection's batched LoRA
        terms, whose shrink then rides in the SiLU·mul kernel where it takes them)."""
        mlp, pre = self.layers[i].mlp, f"model.layers.{i}.mlp."
        if silu_mul is _silu_mul_kernel:
            a, shrunk = self._silu_in_kernel(i, x, shrunk, down_terms is None)
            if a is not None:
                return self._linear(mlp.down_proj, pre + "down_proj", a)  # (down's LoRA shrink: fused.lora_shrink)
        g, u = self._group(i, "gate_up", [mlp.gate_proj, mlp.up_proj], [pre + "gate_proj", pre + "up_proj"], x,
                           shrunk)
        made = _fk.silu_mul_shrink(g, u, down_terms[0]) if down_terms is not None else None
        if made is None:
            return self._linear(mlp.down_proj, pre + "down_proj", silu_mul(g, u))
        return self._linear(mlp.down_proj, pre + "down_proj", made[0], made[1])

    def _silu_in_kernel(self, i: int, x: torch.Tensor, shrunk: torch.Tensor | None = None,
                        down_plain: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(silu(gate) * up, shrunk)`` of layer ``i`` on normed ``x`` from one NVFP4 kernel launch
        (``kernel.linear_silu``) where its fused gate/up group is packed, unbiased, of two equal members without a
        peft LoRA; our adapter's batched term of the group rides in the same launch (``shrunk``: its shrink, made
        here if not given) where the kernel takes it (``silu_lora_in_kernel``, the conditions of
        ``_term_in_kernel``). ``down_plain``: the down projection has no batched LoRA term; where it has one, this
        route is taken only with ``silu_lora_in_kernel`` on (down's shrink then runs in ``fused.lora_shrink``
        instead of the SiLU·mul kernel), whether the group has a term or not. ``(None, shrunk)`` where not (the
        caller runs the group with that shrink, then the SiLU·mul kernel)."""
        from .packed_model import PackedLinear

        f = self.fused[i].get("gate_up")
        if not (self.silu_in_kernel and f is not None and isinstance(f.base, PackedLinear) and f.base.bias is None
                and len(f.sizes) == 2 and f.sizes[0] == f.sizes[1]
                and not any(hasattr(m, "lora_A") for m in f.modules)):
            return None, shrunk
        b = f.base
        if self.lora is None or not any(n in self.lora.factors for n in f.names):
            if not down_plain and not self.silu_lora_in_kernel:
                return None, shrunk
            a = _kernel.linear_silu(x.reshape(-1, x.shape[-1]), b.qweight, b.global_scale, b.out_features,
                                    b.in_features)
            return (None if a is None else a.view(*x.shape[:-1], f.sizes[0])), shrunk
        snap = self._lora_snap.get(id(f)) if self._lora_snap is not None else None
        if not (self.silu_lora_in_kernel and isinstance(snap, tuple)):
            return None, shrunk
        x2, shrunk = self._term_in_kernel(b, x, snap, shrunk)
        if x2 is None:
            return None, shrunk
        a = _kernel.linear_silu(x2, b.qweight, b.global_scale, b.out_features, b.in_features, shrunk, *snap[1:])
        return (None if a is None else a.view(*x.shape[:-1], f.sizes[0])), shrunk

    def _attention(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                   cache, slots: torch.Tensor | None, ops: _Ops, kernels: bool = False,
                   shrunk: torch.Tensor | None = None, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The attention half of layer ``i`` on normed ``x``: q/k/v, rotary, KV-cache write, SDPA, o_proj.
        ``kernels``: rotary and the cache write of a fused q/k/v in one fused kernel where possible. ``shrunk``:
        the fused q/k/v's LoRA shrink already made. ``key_mask`` (a decode step, ``mask`` None): attention by
        ``fused.decode_attn`` over the cache slots up to ``slots[0]`` that ``key_mask`` allows."""
        b, t, _ = x.shape
        attn, pre = self.layers[i].self_attn, f"model.layers.{i}."
        f = self.fused[i].get("qkv")
        qkn = self.qk_norm[i] if self.qk_norm is not None else None
        if kernels and f is not None and cache is not None and self.head_dim % 16 == 0 and qkn is None:
            kc, vc = cache[i]
            y = self._fused_out(f, x, shrunk)
            wave = self._decode_attn_mode() == "wave"
            if key_mask is not None and t == 1 and self.rope_in_attn:
                o = _fk.rope_decode_attn(y, cos, sin, kc, vc, key_mask, slots[:1], self.n_heads, one_wave_only=wave)
                if o is not None:
                    return self._linear(attn.o_proj, pre + "self_attn.o_proj", o)
            q = _fk.rope_kv(y, cos, sin, kc, vc, slots[:1], self.n_heads)
            if key_mask is not None and t == 1:
                o = _fk.decode_attn(q, kc, vc, key_mask, slots[:1], one_wave_only=wave)
                if o is not None:
                    return self._linear(attn.o_proj, pre + "self_attn.o_proj", o)
            k, v = kc, vc
        elif f is not None:  # q and k are adjacent in the fused output: one rotary pass over all their heads
            y = self._fused_out(f, x, shrunk)
            nq, nk, _ = f.sizes
            qk = y[..., : nq + nk].view(b, t, self.n_heads + self.n_kv, self.head_dim)
            if qkn is not None:
                qk = torch.cat([_rms_norm(qk[:, :, : self.n_heads], qkn[0], self.eps),
                                _rms_norm(qk[:, :, self.n_heads:], qkn[1], self.eps)], 2)
            qk = ops.rope1(qk, cos.unsqueeze(2), sin.unsqueeze(2))
            q, k = qk[:, :, : self.n_heads].transpose(1, 2), qk[:, :, self.n_heads:].transpose(1, 2)
            v = y[..., nq + nk:].view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        else:
            q, k, v = (self._linear(m, pre + "self_attn." + n, x) for m, n in
                       ((attn.q_proj, "q_proj"), (attn.k_proj, "k_proj"), (attn.v_proj, "v_proj")))
            q = q.reshape(b, t, self.n_heads, self.head_dim)
            k = k.reshape(b, t, self.n_kv, self.head_dim)
            if qkn is not None:
                q, k = _rms_norm(q, qkn[0], self.eps), _rms_norm(k, qkn[1], self.eps)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = v.reshape(b, t, self.n_kv, self.head_dim).transpose(1, 2)
            q, k = ops.rope(q, k, cos.unsqueeze(1), sin.unsqueeze(1))
        if cache is not None:
            kc, vc = cache[i]
            if k is not kc:  # (the fused kernel has written them already)
                kc.index_copy_(2, slots, k.to(kc.dtype))  # slots: this call's T cache slots (one per forward)
                vc.index_copy_(2, slots, v.to(vc.dtype))
            if mask is None:  # (fused.decode_attn declined this step: one mask for all the forward's layers)
                if self._step_mask is None:
                    self._step_mask = self._mask(key_mask, kc.shape[2], slots, x.dtype)
                mask = self._step_mask
            n = mask.shape[-1]  # the slots this forward can attend to (fewer than the cache in a prefill)
            k, v = (kc, vc) if n == kc.shape[2] else (kc[:, :, :n], vc[:, :, :n])
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_kv != self.n_heads)
        o = o.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)
        return self._linear(attn.o_proj, pre + "self_attn.o_proj", o)

    def _use_kernels(self, h: torch.Tensor) -> bool:
        return self._kernels and not torch.is_grad_enabled() and h.is_cuda and h.dtype == torch.bfloat16

    def _layer_kernels(self, i: int, h: torch.Tensor, pending: torch.Tensor | None, w_in: torch.Tensor,
                       w_post: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None, cache,
                       slots: torch.Tensor, key_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``_layer`` with the fused kernels (no grad, CUDA, bf16): the residual add of the previous layer's MLP
        output (``pending``) inside this layer's input norm, rotary + KV-cache write in one kernel, SiLU·mul in
        one. Returns the residual stream and this layer's MLP output, not yet added. The layer's projections on
        the dequantize path read the bf16 copies of one launch (``_layer_dense``)."""
        t_qkv, t_gu = (self._shrink_terms(self.fused[i].get(k), h) for k in ("qkv", "gate_up"))
        t_down = self._shrink_terms(self.layers[i].mlp.down_proj, h)
        self._dense_w = self._layer_dense(i, h)
        try:
            h, x, s_qkv = self._add_norm(h, pending, w_in, t_qkv)
            o = self._attention(i, x, cos, sin, mask, cache, slots, _CUDA_OPS, kernels=True, shrunk=s_qkv,
                                key_mask=key_mask)
            h, x, s_gu = self._add_norm(h, o, w_post, t_gu)
            return h, self._mlp(i, x, _silu_mul_kernel, s_gu, t_down)
        finally:
            self._dense_w = None

    def _add_norm(self, h: torch.Tensor, d: torch.Tensor | None, w: torch.Tensor, terms: tuple | None):
        """``fused.add_norm``, with the LoRA shrink of ``terms`` in the same kernel where it takes them:
        ``(h + d, x, shrink or None)``."""
        if terms is not None and (made := _fk.add_norm_shrink(h, d, w, self.eps, terms[0])) is not None:
            return made
        return (*_fk.add_norm(h, d, w, self.eps), None)

    def _shrink_terms(self, module, h: torch.Tensor) -> tuple | None:
        """The batched LoRA terms of ``module`` (a fused group or a linear) in this no-grad call on hidden states
        ``h``, where their shrink can ride in the fused kernel that makes their input: decode steps (at most
        ``fused.LORA_MAX_ROWS`` rows) with the LoRA kernels on, factors in the activations' dtype (the kernels
        take bf16), no autocast. Else None."""
        if (module is None or self._lora_snap is None or not (self.lora_kernels and self.fused_shrink)
                or h.shape[0] * h.shape[1] > _fk.LORA_MAX_ROWS or torch.is_autocast_enabled(h.device.type)):
            return None
        t = self._lora_snap.get(id(module))
        return t if isinstance(t, tuple) and t[0].dtype == t[1].dtype == h.dtype else None

    # ---------------------------------------------------------------- sampling
    def _new_cache(self, rows: int, slots: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (rows, self.n_kv, slots, self.head_dim)
        return [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                 torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in self.layers]

    def cache_slots(self, prompt_len: int, max_new_tokens: int) -> int:
        """The KV-cache slots of a rollout: ``prompt_len + max_new_tokens``, rounded up on CUDA to a multiple of
        ``SLOT_BUCKET`` (within the model's positions) so that calls whose longest prompts differ a little share
        one decode graph (``keep_graph``); the extra slots are never written nor attended to."""
        need = prompt_len + max_new_tokens
        if self.device.type != "cuda":
            return need
        slots = -(-need // SLOT_BUCKET) * SLOT_BUCKET
        limit = getattr(self.model.config, "max_position_embeddings", None)
        return slots if limit is None or slots <= limit else need

    def release_graph(self) -> None:
        """Drop the kept decode graph and its KV cache (the next rollout captures a new one)."""
        self._graph = None

    def _graph_key(self, rows: int, slots: int, norms: list[dict[str, torch.Tensor]]) -> tuple:
        """Everything a captured decode step depends on besides the values copied into it: shapes, the dtype and
        autocast state, the engine's flags (every plain attribute), the adapter object, the LoRA snapshot's and the
        norm scales' structure, the rotary table and the kernels' process-wide settings."""
        flags = tuple(sorted((k, v) for k, v in vars(self).items()
                             if isinstance(v, (bool, int, float, str)) and k != "keep_graph"))
        snap = None if self._lora_snap is None else tuple(sorted((k, _snap_signature(v))
                                                                 for k, v in self._lora_snap.items()))
        norm_sig = tuple(tuple((t, tuple(v.shape), v.dtype) for t, v in sorted(d.items())) for d in norms)
        autocast = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")) if self.device.type == "cuda" \
            else (torch.is_autocast_enabled("cpu"),)
        settings = tuple(sorted(_kernel.settings().items())) if self._nvfp4_on_cuda else ()
        return (rows, slots, self.dtype, autocast, flags, id(self.lora), id(self._ops), id(self._rope_tab), snap,
                norm_sig, settings, os.environ.get("QERL_ATTN_CLUSTER"))

    def _keepable(self) -> bool:
        """Whether a decode graph may be kept past this call: every LoRA term it reads comes from the batched
        snapshot (whose values a later call copies in). Terms computed as in training read the adapter's tensors
        and Python scalings directly (``batch_lora`` off, or terms that cannot be batched): not kept. Nor is a
        graph of a call with a final-norm draw (``set_noise(final_norm=True)``): the step reads that draw itself."""
        if self._noisy_final is not None:
            return False
        if self._lora_snap is not None:
            return all(t is not None for t in self._lora_snap.values())
        return self.lora is None and not any(hasattr(m, "lora_A") for m in self.model.modules())

    def _decoder(self, cache, key_mask: torch.Tensor, group: int, first_slot: int, first_pos: torch.Tensor,
                 steps: int | None = None) -> tuple[object, str]:
        """``(step, how)``: ``step(tokens [R]) -> logits [R, V] fp32``, the next decode step over a KV cache of
        ``R = rows of cache * group`` rows holding the prefill's ``cache`` (each row ``group`` times) and the key
        mask ``key_mask`` (prefill rows): the first call writes slot ``first_slot`` at positions ``first_pos
        [R, 1]``, each call one slot and position further (advanced on the device, inside the graph), at most
        ``steps`` calls (None: up to the cache's last slot). A CUDA
        graph on GPU (``use_graph``), else eager. ``step.tok``: the tensor the graph reads its tokens from (a
        sampler may write them there; else ``step`` copies them in), None when eager. ``how``: "new" (a new
        cache, and graph: two warm-up steps and a capture) or "kept" (those kept from an earlier call whose
        ``_graph_key`` is the same: the cache, key mask, norm scales and LoRA snapshot values are copied into the
        tensors the step reads, which are the same on CPU and in a graph).

        The warm-up runs before a capture really execute and write K/V: they write at ``first_slot``, the slot
        the first decode step overwrites anyway, never over the prompt's cache."""
        rows = cache[0][0].shape[0] * group
        slots = cache[0][0].shape[2]
        norms = self.effective_norm_weights()
        key = self._graph_key(rows, slots, norms)
        keep = self.keep_graph and self._keepable()
        kept = self._graph
        if not (keep and kept is not None and kept.key == key and kept.lora is self.lora):
            kept = None
        self._graph = None  # (a graph of another key goes before the new cache is allocated)
        if kept is None:
            kept = _DecodeGraph(key=key, cache=self._new_cache(rows, slots),
                                key_mask=torch.empty(rows, slots, dtype=torch.bool, device=self.device),
                                norms=[{t: v.clone() for t, v in d.items()} for d in norms], snap=self._lora_snap,
                                rope=self._rope_tab, lora=self.lora)
            how = "new"
        else:
            how = "kept"
            _copy_snapshot(kept.snap, self._lora_snap)
            torch._foreach_copy_([kd[t] for kd in kept.norms for t in kd], [d[t] for kd, d in zip(kept.norms, norms)
                                                                           for t in kd])
        for (kk, kv), (pk, pv) in zip(kept.cache, cache):  # each prefill row ``group`` times, every slot
            kk.view(-1, group, *kk.shape[1:]).copy_(pk[:, None])
            kv.view(-1, group, *kv.shape[1:]).copy_(pv[:, None])
        kept.key_mask.view(-1, group, slots).copy_(key_mask[:, None])
        if how == "new":
            kept.tok = torch.zeros(rows, dtype=torch.long, device=self.device)
            kept.pos = first_pos.clone()
            kept.at = torch.full((), first_slot, dtype=torch.long, device=self.device)
        else:
            kept.pos.copy_(first_pos)
            kept.at.fill_(first_slot)

        bucket = self._attend_bucket(rows, slots)
        slot = [first_slot]  # the next step's slot, on the host (the device's is kept.at)

        def forward(attend: int | None):
            prev, self._lora_snap = self._lora_snap, kept.snap
            try:
                return self.forward(kept.tok.view(-1, 1), kept.pos, kept.key_mask, kept.cache, kept.at,
                                    norms=kept.norms, attend=attend)[:, -1].float()
            finally:
                self._lora_snap = prev

        if not self.use_graph:
            def step(tok):
                kept.tok.copy_(tok)
                logits = forward(_attended(slot[0], bucket, slots))
                torch._foreach_add_([kept.pos, kept.at], 1)
                slot[0] += 1
                return logits

            step.tok = None
            if keep:
                self._graph = kept
            return step, how
        # the graphs this call's steps replay: one per bucket of attended slots from the first step's on
        last = slots if steps is None else min(slots, first_slot + max(steps, 1))
        need = sorted({_attended(s, bucket, slots) for s in range(first_slot, last)}, key=lambda n: n or 0) \
            if bucket is not None and first_slot < last else [None]
        if how == "new":
            kept.graphs = {}
        missing = [n for n in need if n not in kept.graphs]
        if missing:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            # autocast's cast cache off: a cached cast (made by the prefill, freed when the caller leaves autocast)
            # would be read by address from a kept graph instead of being cast in it
            nocache = torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"),
                                     enabled=torch.is_autocast_enabled("cuda"), cache_enabled=False)
            for n in missing:
                with torch.cuda.stream(side), nocache:
                    # warm-up outside the capture (lazy inits and autotuning; a new attended length's library plan)
                    for _ in range(2 if not kept.graphs else 1):
                        forward(n)
                torch.cuda.current_stream().wait_stream(side)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=kept.pool), nocache:
                    out = forward(n)
                    torch._foreach_add_([kept.pos, kept.at], 1)  # the next step's position and slot
                kept.pool = g.pool() if kept.pool is None else kept.pool  # (they never run at once: one pool)
                kept.graphs[n] = (g, out)
        if keep:  # (only once captured: a failed capture keeps nothing)
            self._graph = kept

        def replay(tok):
            if tok is not kept.tok:
                kept.tok.copy_(tok)
            g, out = kept.graphs[_attended(slot[0], bucket, slots)]
            g.replay()
            slot[0] += 1
            return out

        replay.tok = kept.tok
        return replay, how

    def _attend_bucket(self, rows: int, slots: int) -> int | None:
        """The bucket of attended slots (``ATTEND_BUCKET``) of the decode steps of ``rows`` rows over a cache of
        ``slots`` slots, where they attend in SDPA on CUDA; None where each step attends over the whole cache: off
        CUDA, ``attend_buckets`` off, a cache of at most one bucket, or steps that attend with
        ``fused.decode_attn`` (whether it takes the shapes is decided by them alone, as the kernel's launcher
        decides)."""
        if not (self.attend_buckets and self.device.type == "cuda" and slots > ATTEND_BUCKET):
            return None
        if self._kernels and self._decode_attn_ok() and _fk.decode_attn_takes(
                rows, self.n_heads, self.n_kv, slots, self.head_dim, self.device,
                one_wave_only=self._decode_attn_mode() == "wave"):
            return None
        return ATTEND_BUCKET

    def sampler(self, cfg: SamplingConfig, vocab: int) -> str:
        """How decode steps draw under ``cfg`` (recorded with a rollout: the same seed gives other tokens under
        the other sampler)."""
        if cfg.temperature == 0:
            return "greedy (argmax)"
        if self._fast_sampling(cfg, vocab):
            return "fused Gumbel-max on Philox4x32-10 (key: seed; counter: token // 4, step, row)"
        return "torch.multinomial (torch.Generator seeded per call)"

    def decode_attention(self) -> str:
        """How decode steps attend now (recorded with a rollout: our kernel and SDPA round differently)."""
        if not (self._kernels and self.device.type == "cuda" and self._decode_attn_ok()):
            return "SDPA"
        if self._decode_attn_mode() == "wave":
            return "fused.decode_attn where its blocks fit one wave on the GPU, else SDPA"
        return "fused.decode_attn where it takes the shapes, else SDPA"

    def _fast_sampling(self, cfg: SamplingConfig, vocab: int) -> bool:
        """Whether decode steps draw in the fused sampling kernel: CUDA with the fused kernels, temperature > 0,
        nothing truncated (the kernel draws from the whole tempered softmax, as ``sample`` does then)."""
        return (self.fused_sampler and self._kernels and self.device.type == "cuda" and cfg.temperature > 0
                and not (cfg.top_k and cfg.top_k < vocab) and cfg.top_p >= 1)

    @staticmethod
    def finite_rows(logits: torch.Tensor, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits with every non-finite row set to 0, whether any such row is among ``rows``)``, the flag a
        0-dim bool tensor on the logits' device (no host sync): sampling from the result cannot fail, and the
        caller raises on the flag. ``rows``: a bool mask of the rows that count (default all).

        A row is non-finite when its sum is: it holds a NaN or an Inf, or logits so huge (~1e34 and up) that they
        sum past fp32's range, which tempering and softmax would overflow anyway. One reduction per row, not an
        elementwise test and a reduction."""
        bad = ~torch.isfinite(logits.sum(-1))
        flag = (bad if rows is None else bad & rows).any()
        return logits.masked_fill(bad[:, None], 0.0), flag

    @staticmethod
    def sample(logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token, behaviour log-prob, tempered log-prob) per row of fp32 ``logits [R, V]`` (finite: see
        ``finite_rows``)."""
        if cfg.temperature == 0:
            tok = logits.argmax(-1)
            zero = torch.zeros(tok.shape, dtype=torch.float32, device=logits.device)
            return tok, zero, zero
        z = logits.float() / cfg.temperature
        full = torch.log_softmax(z, -1)
        zt = z
        if cfg.top_k and cfg.top_k < z.shape[-1]:
            kth = torch.topk(zt, cfg.top_k, dim=-1).values[:, -1:]
            zt = zt.masked_fill(zt < kth, -math.inf)
        if cfg.top_p < 1:
            srt, idx = torch.sort(zt, dim=-1, descending=True)
            probs = torch.softmax(srt, -1)
            before = torch.cumsum(probs, -1) - probs  # mass of the tokens ranked above
            srt = srt.masked_fill(before >= cfg.top_p, -math.inf)  # the top token always stays
            zt = torch.full_like(zt, -math.inf).scatter(-1, idx, srt)
        trunc = full if zt is z else torch.log_softmax(zt, -1)  # no truncation: the same distribution
        tok = torch.multinomial(trunc.exp(), 1, generator=gen).squeeze(1)
        return tok, trunc.gather(-1, tok[:, None]).squeeze(1), full.gather(-1, tok[:, None]).squeeze(1)

    def _snapshot_lora(self) -> dict[int, object] | None:
        if not self.batch_lora:
            return None
        snap = {}
        for i, layer in enumerate(self.layers):
            grouped = set()
            for f in self.fused[i].values():
                grouped.update(id(m) for m in f.modules)
                # None (terms that cannot be batched) is stored too: _keepable reads it
                snap[id(f)] = _lora_terms(f.modules, f.names, f.sizes, self.lora)
            for name in PROJECTIONS:
                m = layer.get_submodule(name)
                if id(m) not in grouped:
                    snap[id(m)] = _lora_terms([m], [f"model.layers.{i}.{name}"], [_base_layer(m).out_features],
                                              self.lora)
        return snap

    @contextlib.contextmanager
    def _lora_batched(self):
        """Within: no-grad forwards use a snapshot of the batched LoRA terms; it is dropped on leaving, so it
        never outlives the adapter weights it copied. Differentiable calls get none."""
        self._lora_snap = None if torch.is_grad_enabled() else self._snapshot_lora()
        try:
            yield
        finally:
            self._lora_snap = None

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], group: int, sampling: SamplingConfig, seed: int,
                 eos_ids: set[int] | list[int], pad_id: int) -> RolloutBatch:
        """Sample ``group`` completions per prompt (sharing the prompt's prefill)."""
        with self._lora_batched():
            return self._generate(prompts, group, sampling, seed, eos_ids, pad_id)

    def _generate(self, prompts: list[list[int]], group: int, sampling: SamplingConfig, seed: int,
                  eos_ids: set[int] | list[int], pad_id: int) -> RolloutBatch:
        if group < 1:
            raise QerlError(f"the group size G must be >= 1, got {group}.")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise QerlError("every prompt must hold at least one token.")
        dev = self.device
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        b, g, t_new = len(prompts), group, sampling.max_new_tokens
        r = b * g
        p_len = max(len(p) for p in prompts)
        check_positions(self.model.config, p_len, t_new)
        if self._noisy is not None and self.noise.scope == "group":
            drawn = next(iter(self._noisy[0].values())).shape[0]
            # (a draw of one row would broadcast over every prompt: batch noise, logged as per group; b * G rows
            # drawn in groups of another size: the prefill, one row per prompt, ran under another row's draw)
            shape = (f"covers {drawn} rows" if drawn != r or self._noise_groups is None else
                     "has {} groups of {} rows".format(*self._noise_groups))
            if drawn != r or self._noise_groups not in (None, (b, g)):
                raise QerlError(f"the per-group noise draw {shape}, but this batch has {b} prompts x G = {g} = {r} "
                                f"rows: draw it with set_noise(..., groups={b}, group_size={g}).")
        slots = self.cache_slots(p_len, t_new)
        ids = torch.full((b, p_len), pad_id, dtype=torch.long)
        pmask = torch.zeros(b, p_len, dtype=torch.bool)
        for i, p in enumerate(prompts):
            ids[i, p_len - len(p):] = torch.tensor(p)
            pmask[i, p_len - len(p):] = True
        ids, pmask = ids.to(dev), pmask.to(dev)
        pos = (pmask.long().cumsum(1) - 1).clamp(min=0)
        key_mask = torch.ones(b, slots, dtype=torch.bool, device=dev)
        key_mask[:, :p_len] = pmask
        self._rope_table(slots)
        sync()
        t0 = time.perf_counter()
        cache = self._new_cache(b, slots)
        rows = slice(0, None, g) if (self._noisy is not None and self.noise.scope == "group") else None
        # the prompt's last position alone goes through lm_head; attention covers the prompt's slots only
        h_last = self.forward(ids, pos, key_mask, cache, torch.zeros((), dtype=torch.long, device=dev), rows,
                              hidden_only=True, attend=p_len)[:, -1]
        logits = self.lm_head(h_last)
        logits = logits.float().repeat_interleave(g, 0)
        sync()
        t1 = time.perf_counter()
        decode, graph_how = self._decoder(cache, key_mask, g, p_len, pos[:, -1:].repeat_interleave(g, 0) + 1,
                                          steps=t_new - 1)
        del cache  # (the decoder's cache holds it now, each row G times)
        sync()  # (a kept state's copies are device work: counted here, not in the first step)
        t_graph = time.perf_counter() - t1
        gen = torch.Generator(device=dev).manual_seed(seed)
        eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=dev)
        out = torch.full((r, t_new), pad_id, dtype=torch.long, device=dev)
        mask = torch.zeros(r, t_new, dtype=torch.bool, device=dev)
        blp = torch.zeros(r, t_new, dtype=torch.float32, device=dev)
        tlp = torch.zeros(r, t_new, dtype=torch.float32, device=dev)
        finished = torch.zeros(r, dtype=torch.bool, device=dev)
        fast = self._fast_sampling(sampling, logits.shape[-1])
        bad = torch.zeros(1, dtype=torch.int32, device=dev)  # the fused sampler's record of a NaN / +inf logit
        nonfinite = torch.zeros(t_new, dtype=torch.bool, device=dev)  # per step: a live row's logits had NaN/Inf
        steps = 0
        for step in range(t_new):
            tok = (_fk.sample_step(logits, sampling.temperature, seed, step, finished, eos, pad_id, out, mask, blp,
                                   tlp, bad, getattr(decode, "tok", None)) if fast else None)
            if tok is None:  # torch's ops (CPU, truncation, or shapes the kernel declines)
                live = ~finished
                logits, bad_rows = self.finite_rows(logits, live)
                nonfinite[step] = bad_rows
                tok, lb, lt = self.sample(logits, sampling, gen)
                tok = torch.where(live, tok, torch.full_like(tok, pad_id))
                out[:, step] = tok
                mask[:, step] = live
                blp[:, step] = torch.where(live, lb, torch.zeros_like(lb))
                tlp[:, step] = torch.where(live, lt, torch.zeros_like(lt))
                finished = finished | (live & torch.isin(tok, eos))
            steps = step + 1
            # the all-finished (and non-finite) test syncs with the GPU: only every 8 steps, so the host queues
            # ahead in between (steps past the last live token are trimmed below; they sample pad only)
            if step == t_new - 1 or (step % 8 == 7 and bool(finished.all() | nonfinite.any() | (bad != 0).any())):
                break
            logits = decode(tok)  # (writes slot p_len + step at the next positions)
        sync()
        t2 = time.perf_counter()
        if bool(nonfinite.any() | (bad != 0).any()):
            where = (f"at decode step {int(nonfinite.nonzero()[0]) + 1} of {t_new}" if bool(nonfinite.any())
                     else "at a decode step")
            raise QerlError(f"the model's logits are not finite (NaN or Inf) {where}, so nothing can be sampled "
                            "from them; check the model's and the adapter's weights for NaN/Inf or huge values (a "
                            "diverged adapter: lower the learning rate) and that the AQN sigma is small.")
        steps = int(mask[:, :steps].any(0).nonzero()[-1]) + 1  # every row is live at step 0
        ended = (mask & torch.isin(out, eos)).any(1).cpu()
        gen_tokens = int(mask.sum())
        return RolloutBatch(
            prompt_ids=[list(p) for p in prompts], group=g,
            completion_ids=out[:, :steps].cpu(), completion_mask=mask[:, :steps].cpu(),
            behaviour_logprobs=blp[:, :steps].cpu(), tempered_logprobs=tlp[:, :steps].cpu(),
            finish_reason=["eos" if e else "length" for e in ended.tolist()],
            timings={"prefill_s": t1 - t0, "decode_s": t2 - t1, "decode_steps": steps,
                     "generated_tokens": gen_tokens, "tokens_per_s": gen_tokens / max(t2 - t0, 1e-9),
                     "cuda_graph": self.use_graph, "decode_state": graph_how, "decode_setup_s": t_graph,
                     "cache_slots": slots})

    def sequence_logprobs(self, prompts: list[list[int]], completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                          temperature: float, pad_id: int, group: int = 1) -> torch.Tensor:
        """Teacher-forced log-probs ``[R, T]`` of the completions under the tempered softmax (no truncation),
        in one forward without cache (differentiable through LoRA). Row ``r`` continues prompt ``r // group``."""
        dev = self.device
        r, t = completion_ids.shape
        p_len = max(len(p) for p in prompts)
        ids = torch.full((r, p_len + t), pad_id, dtype=torch.long)
        key = torch.zeros(r, p_len + t, dtype=torch.bool)
        for i in range(r):
            p = prompts[i // group]
            ids[i, p_len - len(p): p_len] = torch.tensor(p)
            key[i, p_len - len(p): p_len] = True
        ids[:, p_len:] = completion_ids
        key[:, p_len:] = completion_mask
        ids, key = ids.to(dev), key.to(dev)
        pos = (key.long().cumsum(1) - 1).clamp(min=0)
        # the vocabulary projection only where a completion token is predicted, a few rows at a time: the
        # [rows, T, vocab] fp32 logits never exist whole (in a differentiable pass each chunk's logits are
        # recomputed in the backward instead of kept)
        with self._lora_batched():
            h = self.forward(ids, pos, key, hidden_only=True)[:, p_len - 1: p_len + t - 1]
        targets = completion_ids.to(dev)
        inv_t = 1.0 / (temperature if temperature > 0 else 1.0)

        def chunk(hc: torch.Tensor, tc: torch.Tensor) -> torch.Tensor:
            z = self.lm_head(hc).float() * inv_t
            return z.gather(-1, tc[..., None]).squeeze(-1) - torch.logsumexp(z, -1)

        vocab = self.lm_head.weight.shape[0]
        step = max(1, LOGIT_CHUNK_ELEMENTS // max(t * vocab, 1))
        grad = torch.is_grad_enabled() and h.requires_grad
        parts = [torch.utils.checkpoint.checkpoint(chunk, h[i: i + step], targets[i: i + step], use_reentrant=False)
                 if grad else chunk(h[i: i + step], targets[i: i + step]) for i in range(0, r, step)]
        out = torch.cat(parts) if parts else h.new_zeros((0, t), dtype=torch.float32)
        return out * completion_mask.to(dev)
