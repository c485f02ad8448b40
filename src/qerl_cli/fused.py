"""Fused elementwise CUDA kernels of a decoder layer (``csrc/fused_ops.cu``) for the rollout engine.

The engine's no-grad CUDA forwards on bf16 use them where the shapes allow (else torch's ops run):

* ``add_norm(h, d, w, eps)`` -> ``(h + d, rmsnorm(h + d) * w)`` in one kernel (``d`` may be None: norm only);
  ``w`` is ``[H]`` or one row per group of rows (``[R, 1, H]``, AQN's per-prompt-group noise), bf16 or fp32
  (AQN's noisy scales, kept fp32 so that small draws do not round away);
* ``silu_mul(g, u)`` -> ``silu(g) * u`` on the strided halves of a fused gate/up output, one kernel;
* ``rope_kv(y, cos, sin, kc, vc, slot0, n_heads)`` -> q with rotary applied ``[B, H, T, D]``; k (rotary
  applied) and v are written into the KV cache at slots ``slot0 + t``, one kernel instead of seven;
* ``decode_attn(q, kc, vc, key_mask, slot)`` -> one decode step's attention over the KV cache: the slots up to
  the step's whose key-mask entry is set, the G query heads of a KV head served by one read of its cache rows
  (SDPA reads every head's cache and every slot under an additive mask); ``decode_attn_takes(...)`` says by the
  shapes alone whether it takes a step;
* ``lora_add(y, x, a, bs)`` -> ``y + bf16(x @ a^T) @ bs`` (a batched LoRA term) for decode steps of at most 16
  rows, in two small kernels instead of two cuBLAS matmuls (None where the shapes need the matmuls); the engine
  uses it for outputs up to ``LORA_KERNEL_MAX_N`` wide (``QERL_ENGINE_LORA_KERNELS=0``: never);
* ``add_norm_shrink(h, d, w, eps, a)`` and ``silu_mul_shrink(g, u, a)``: ``add_norm`` / ``silu_mul`` that also
  return the LoRA shrink ``hs = bf16(x @ a^T)`` (fp32 holding bf16 values) of the output ``x`` they make, for the
  projections that read it: no separate shrink launch; ``lora_expand(y, hs, bs)`` -> ``y + hs @ bs`` is then the
  rest of ``lora_add`` (decode steps of at most 16 rows), and ``lora_shrink(x, a)`` its first kernel alone (for
  ``kernel.linear_lora``, which adds ``hs @ bs`` inside the NVFP4 product);
* ``sample_step(...)``: one decode step's draw at temperature T without truncation (the Gumbel-max trick on
  Philox4x32-10 noise keyed by seed, step and row: an exact draw from the tempered softmax) with its log-prob and
  the step's bookkeeping (finished rows, eos, pad, mask, the log-prob columns), in one kernel.

Each rounds where the torch chain it replaces rounds (``silu_mul`` and ``rope_kv`` bit-exact; ``add_norm``
sums the squares in another order, at most one bf16 unit apart; ``lora_add`` accumulates in fp32 in its own fixed
order, so it differs from cuBLAS's ``addmm`` in the last bits). The extension is JIT-built on first use like
the NVFP4 kernel's; ``available()`` says whether it loaded and ``build_error()`` why not. ``QERL_ENGINE_KERNELS=0``
turns them off.
"""

from __future__ import annotations

import os
import threading
import warnings

import torch

from . import kernel

__all__ = ["available", "build_error", "add_norm", "silu_mul", "rope_kv", "decode_attn", "decode_attn_takes",
           "lora_add",
           "add_norm_shrink", "silu_mul_shrink", "lora_expand", "lora_shrink", "sample_step", "LORA_MAX_ROWS"]

MAX_WIDTH = 8192  # add_norm's widest row (8 x 4 x 256 in csrc/fused_ops.cu)
LORA_MAX_ROWS = 16  # lora_add's most rows (kLoraMaxM)
# the engine's widest LoRA output for lora_add: wider ones (gate/up of a 7B, 37888) measured slower in the
# kernels than in cuBLAS (session 8, H200, benchmarks/results/lora_terms_m8_s8b_h200.json: +17.4 against
# +16.0 us at M = 8, rank 32; q/k/v, o and down faster: +11.0 / +7.8 / +8.6 against +12.0 / +10.3 / +13.4)
LORA_KERNEL_MAX_N = 16384
SHRINK_MAX_R = 512  # add_norm_shrink's / silu_mul_shrink's most rank rows (lora_expand's limit at 16 rows)

_lock = threading.Lock()
_ext = None
_err: str | None = None
_tried = False


def _load():
    global _ext, _err, _tried
    if _tried:
        return _ext
    with _lock:
        if not _tried:
            try:
                if os.environ.get("QERL_ENGINE_KERNELS") == "0":
                    raise RuntimeError("QERL_ENGINE_KERNELS=0")
                _ext = kernel.build_extension("qerl_fused", "fused_ops.cu")
            except Exception as e:  # noqa: BLE001 - no build means the torch ops run
                _ext, _err = None, kernel.error_line(e)
                if torch.cuda.is_available() and os.environ.get("QERL_ENGINE_KERNELS") != "0":
                    warnings.warn(f"qerl.fused: the engine's fused kernels did not build, torch's ops run instead "
                                  f"(slower): {_err}", RuntimeWarning, stacklevel=3)
            _tried = True
    return _ext


def available() -> bool:
    return _load() is not None


def build_error() -> str | None:
    _load()
    return _err


def add_norm(h: torch.Tensor, d: torch.Tensor | None, w: torch.Tensor, eps: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h + d, rmsnorm(h + d) * w)`` for ``h, d [..., H]``; ``w`` ``[H]`` or ``[R, 1, H]`` with ``h`` ``[R, T, H]``."""
    if not h.is_cuda or w.dtype not in (h.dtype, torch.float32):  # the kernel reads bf16 or fp32 (noisy) scales
        return _add_norm_torch(h, d, w, eps)
    s, x, _ = _add_rmsnorm(h, d, w, eps)
    return s, x


def _add_rmsnorm(h: torch.Tensor, d: torch.Tensor | None, w: torch.Tensor, eps: float, a: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The extension's add_rmsnorm on ``h [..., H]`` (``w`` ``[H]`` or per-row ``[R, 1, H]`` for ``h [R, T, H]``;
    ``d`` None: norm only, ``h`` itself is returned as the residual): ``(h + d, x, hs)``, ``hs`` the fp32
    ``[rows, R]`` shrink ``bf16(x @ a^T)`` with ``a``, else None."""
    width = h.shape[-1]
    h2 = h.reshape(-1, width)
    w2 = (w if w.dim() == 1 else w.reshape(-1, width)).contiguous()
    rows_per_w = 1 if w.dim() == 1 else h2.shape[0] // w2.shape[0]
    x = torch.empty_like(h2)
    s = x if d is None else torch.empty_like(h2)  # (no residual written without d)
    hs = None if a is None else torch.empty(h2.shape[0], a.shape[0], dtype=torch.float32, device=h.device)
    _load().add_rmsnorm(h2.contiguous(), None if d is None else d.reshape(-1, width).contiguous(), w2, rows_per_w,
                        s, x, eps, a, hs)
    return (h if d is None else s.view(h.shape)), x.view(h.shape), hs


def _shrink_factor_ok(a: torch.Tensor, x_like: torch.Tensor) -> bool:
    return (a.dim() == 2 and a.dtype == torch.bfloat16 and a.is_cuda and a.device == x_like.device
            and a.is_contiguous() and a.shape[1] == x_like.shape[-1] and 0 < a.shape[0] <= SHRINK_MAX_R
            and a.data_ptr() % 16 == 0)


def add_norm_shrink(h: torch.Tensor, d: torch.Tensor | None, w: torch.Tensor, eps: float, a: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``add_norm`` plus the LoRA shrink of its output in the same kernel: ``(h + d, x, hs)`` with
    ``hs [rows, R] = bf16(x @ a^T)`` as fp32 (``x`` bit-identical to ``add_norm``'s); None (nothing computed) where
    the kernel does not take the tensors (not CUDA bf16, scales neither bf16 nor fp32, ``a`` not ``[R <=
    SHRINK_MAX_R, H]`` contiguous bf16)."""
    if not (h.is_cuda and h.dtype == torch.bfloat16 and w.dtype in (h.dtype, torch.float32)
            and _shrink_factor_ok(a, h) and h.shape[-1] % 8 == 0 and h.shape[-1] <= MAX_WIDTH):
        return None
    return _add_rmsnorm(h, d, w, eps, a)


def silu_mul_shrink(g: torch.Tensor, u: torch.Tensor, a: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``silu_mul`` (bit-identical) plus ``hs [rows, R] = bf16(out @ a^T)`` as fp32 in the same kernel (one block
    per row and pair of rank rows); None where the kernel does not take the tensors."""
    width = g.shape[-1]
    g2, u2 = g.reshape(-1, width), u.reshape(-1, width)
    if not (g.is_cuda and g.dtype == u.dtype == torch.bfloat16 and _shrink_factor_ok(a, g) and width % 8 == 0
            and g2.stride() == u2.stride() and g2.stride(1) == 1 and g2.stride(0) % 8 == 0
            and g2.data_ptr() % 16 == 0 and u2.data_ptr() % 16 == 0):
        return None
    out = torch.empty(g2.shape, dtype=g.dtype, device=g.device)
    hs = torch.empty(g2.shape[0], a.shape[0], dtype=torch.float32, device=g.device)
    _load().silu_mul(g2, u2, out, a, hs)
    return out.view(g.shape), hs


def lora_expand(y: torch.Tensor, hs: torch.Tensor, bs: torch.Tensor, segs: tuple[int, ...] = ()
                ) -> torch.Tensor | None:
    """``y + hs @ bs`` for ``hs [M, R]`` from ``add_norm_shrink`` / ``silu_mul_shrink`` (the second kernel of
    ``lora_add``, same order of sums); None where the kernel does not take the tensors."""
    if not (hs.dim() == y.dim() == bs.dim() == 2 and hs.shape[0] == y.shape[0] and bs.shape == (hs.shape[1], y.shape[1])):
        raise ValueError(f"lora_expand: shapes disagree: hs {tuple(hs.shape)}, y {tuple(y.shape)}, bs {tuple(bs.shape)}")
    out = torch.empty_like(y)
    return out if _load().lora_expand(hs, y, bs, out, list(segs)) else None


def lora_shrink(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor | None:
    """``hs [M, R] = bf16(x @ a^T)`` as fp32 (the first kernel of ``lora_add`` alone) for bf16 ``x [M, K]``,
    ``a [R, K]`` (contiguous, ``M <= LORA_MAX_ROWS``): the input of ``kernel.linear_lora``'s term where no fused
    kernel made it; None (nothing computed) where the kernel does not take the tensors."""
    if not (x.dim() == a.dim() == 2 and a.shape[1] == x.shape[1]):
        raise ValueError(f"lora_shrink: shapes disagree: x {tuple(x.shape)}, a {tuple(a.shape)}")
    hs = torch.empty(x.shape[0], a.shape[0], dtype=torch.float32, device=x.device)
    return hs if _load().lora_shrink(x, a, hs) else None


def sample_step(logits: torch.Tensor, temperature: float, seed: int, step: int, finished: torch.Tensor,
                eos: torch.Tensor, pad: int, out: torch.Tensor, mask: torch.Tensor, blp: torch.Tensor,
                tlp: torch.Tensor, bad: torch.Tensor, tok: torch.Tensor | None = None) -> torch.Tensor | None:
    """Decode step ``step``'s tokens ``[rows]`` (int64), drawn from ``softmax(logits / temperature)`` (fp32
    ``logits [rows, V]``, nothing truncated) by the Gumbel-max trick on Philox4x32-10 noise with key ``seed`` and
    counter (token // 4, step, row): reproducible from (seed, step, row) alone. Writes column ``step`` of ``out``
    (the token), ``mask`` (live), ``blp`` and ``tlp`` (both the tempered log-prob: no truncation); a finished row
    gets ``pad``, mask 0 and log-prob 0, a live row that draws a token of ``eos`` becomes finished; a NaN or +inf
    logit raises ``bad`` (one int32) and is never drawn. None (nothing done) where the kernel does not take the
    tensors (then the caller samples with torch). ``tok``: where to write the tokens (int64 ``[rows]``, e.g. the
    tensor a decode graph reads them from); default a new tensor."""
    if tok is None:
        tok = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    if not _load().sample_step(logits, float(temperature), int(seed) & (2**63 - 1), int(step), finished, eos, int(pad),
                               tok, out, mask, blp, tlp, bad):
        return None
    return tok


def _add_norm_torch(h: torch.Tensor, d: torch.Tensor | None, w: torch.Tensor, eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_norm`` in torch ops for scales the kernel does not read (neither ``h``'s dtype nor fp32):
    ``s = h + d`` rounded to ``h``'s dtype, ``x = round(float(w) * rstd * float(s))`` as the kernel rounds."""
    s = h if d is None else h + d
    f = s.float()
    x = (w.float() * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps))).to(h.dtype)
    return s, x


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u`` for ``g, u [..., I]`` (views of one fused output are fine)."""
    width = g.shape[-1]
    out = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    _load().silu_mul(g.view(-1, width), u.view(-1, width), out.view(-1, width))
    return out


def rope_kv(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
            slot0: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rotary q ``[B, H, T, D]`` from the fused q/k/v output ``y [B, T, (H + 2 KV) * D]``; rotary k and v go
    into the caches ``[B, KV, S, D]`` at slots ``slot0 + t`` (``slot0``: one int64 on the device)."""
    b, t, _ = y.shape
    d = kc.shape[-1]
    q = torch.empty((b, n_heads, t, d), dtype=y.dtype, device=y.device)
    _load().rope_kv(y.reshape(b * t, -1), cos.reshape(b * t, d), sin.reshape(b * t, d), q, kc, vc,
                    slot0.reshape(1), t)
    return q


def decode_attn(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, key_mask: torch.Tensor, slot: torch.Tensor,
                scale: float | None = None, splits: int = 0, cluster: bool | None = None,
                one_wave_only: bool = False) -> torch.Tensor | None:
    """One decode step's attention ``[B, 1, H * D]`` (bf16) for ``q [B, H, 1, D]`` over the caches ``[B, KV, S, D]``
    (contiguous bf16; query head ``h`` reads KV head ``h // (H / KV)``): the slots ``0 ... slot`` (``slot``: one int64
    on the device, so a CUDA graph replays the step for a new slot) whose ``key_mask [B, >= S]`` entry is set, the
    step's own slot always; scores scaled by ``scale`` (default ``D ** -0.5``). fp32 scores, softmax and sums, one
    bf16 rounding. None (nothing computed) where the kernel does not take the tensors (D not 64 or 128, more than
    8 query heads per KV head, too many slots or rows). ``splits > 0`` asks for that many blocks per (row, KV head)
    (raised to what the slot buffers need, at most 256); 0 lets the launcher choose. ``cluster``: 2 ... 8 splits
    are added in a thread-block cluster (sm_90) when True, through a workspace when False, as ``QERL_ATTN_CLUSTER``
    says when None (clusters unless it is 0); both give the same bits, and a cluster is taken only where all the
    blocks fit one wave on the GPU. ``one_wave_only``: None unless they do (the regime where the kernel measured
    faster than SDPA; with more blocks SDPA won or tied, session 18)."""
    if splits < 0:
        raise ValueError(f"decode_attn: splits must be >= 0, got {splits}")
    b, h, _, d = q.shape
    out = torch.empty((b, 1, h * d), dtype=q.dtype, device=q.device)
    ok = _load().decode_attn(q, kc, vc, key_mask, slot.reshape(1), out, float(d ** -0.5 if scale is None else scale),
                             int(splits), -1 if cluster is None else int(bool(cluster)), bool(one_wave_only))
    return out if ok else None


def decode_attn_takes(rows: int, n_heads: int, n_kv: int, slots: int, head_dim: int, device: torch.device,
                      one_wave_only: bool = False) -> bool:
    """Whether ``decode_attn`` (its launcher's own splits and clusters) takes a decode step of ``rows`` rows of
    ``n_heads`` query heads over caches ``[rows, n_kv, slots, head_dim]`` on CUDA ``device``, by those shapes
    alone (``one_wave_only``: as ``decode_attn`` with it); False without the extension or off CUDA."""
    if torch.device(device).type != "cuda" or _load() is None:
        return False
    index = torch.device(device).index
    return bool(_load().decode_attn_takes(int(rows), int(n_heads), int(n_kv), int(slots), int(head_dim),
                                          torch.cuda.current_device() if index is None else int(index),
                                          bool(one_wave_only)))


def rope_decode_attn(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                     key_mask: torch.Tensor, slot: torch.Tensor, n_heads: int, scale: float | None = None,
                     splits: int = 0, cluster: bool | None = None, one_wave_only: bool = False) -> torch.Tensor | None:
    """``rope_kv`` then ``decode_attn`` in one kernel, for one decode step (T = 1): from the fused q/k/v output
    ``y [B, 1, (H + 2 KV) * D]`` and the step's ``cos, sin [B, 1, D]``, the attention ``[B, 1, H * D]`` with the
    rotary k and v of slot ``slot`` written into the caches as ``rope_kv`` writes them (the same bits in both).
    None (nothing computed, nothing written) where ``decode_attn`` would decline or the inputs do not fit; the
    arguments after ``n_heads`` are ``decode_attn``'s."""
    if splits < 0:
        raise ValueError(f"rope_decode_attn: splits must be >= 0, got {splits}")
    b, t, width = y.shape
    d = kc.shape[-1]
    if t != 1:
        return None
    out = torch.empty((b, 1, n_heads * d), dtype=y.dtype, device=y.device)
    ok = _load().rope_decode_attn(y.reshape(b, width), cos.reshape(b, d), sin.reshape(b, d), int(n_heads), kc, vc,
                                  key_mask, slot.reshape(1), out, float(d ** -0.5 if scale is None else scale),
                                  int(splits), -1 if cluster is None else int(bool(cluster)), bool(one_wave_only))
    return out if ok else None


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bs: torch.Tensor,
             segs: tuple[int, ...] = ()) -> torch.Tensor | None:
    """``y + bf16(x @ a^T) @ bs`` for bf16 ``x [M, K]``, ``a [R, K]``, ``y [M, N]``, ``bs [R, N]`` (contiguous,
    ``M <= LORA_MAX_ROWS``), fp32 accumulation; None (nothing computed) where the kernels do not take the shapes.
    ``segs``: flat ``(col_end, row_begin, row_end)`` triples for a block-diagonal ``bs`` (a fused group's members):
    the columns up to ``col_end`` read only rows ``[row_begin, row_end)`` (the others must be zero there)."""
    if not (x.dim() == a.dim() == y.dim() == bs.dim() == 2 and a.shape[1] == x.shape[1] and y.shape[0] == x.shape[0]
            and bs.shape == (a.shape[0], y.shape[1])):
        raise ValueError(f"lora_add: shapes disagree: x {tuple(x.shape)}, a {tuple(a.shape)}, y {tuple(y.shape)}, "
                         f"bs {tuple(bs.shape)}")
    out = torch.empty_like(y)
    return out if _load().lora_add(x, a, y, bs, out, list(segs)) else None
