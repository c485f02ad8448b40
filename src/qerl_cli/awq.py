"""Activation-aware (AWQ) scale and clip search under the NVFP4 quantizer: pure math, no I/O.

One *smoothing group* is a set of linears that read the same input ``x [T, K]`` (q/k/v after
``input_layernorm``; gate/up after ``post_attention_layernorm``; o after v; down after up). A per-input-channel
scale ``s [K]`` is folded into the group: the op producing ``x`` is divided by ``s`` (:func:`fold_into_norm`,
:func:`fold_into_linear_output`) and every consuming weight's input columns are multiplied by ``s``
(:func:`apply_scales_to_weights`), so the float function is unchanged while the 4-bit rounding error moves away
from the channels with large activations.

The search runs under exactly the quantizer of ``quantize`` (:mod:`qerl_cli.nvfp4`), including the one tensor
scale ``G`` shared by a fused set, recomputed from the *scaled* weights for every candidate.

Error of a candidate (one number per group, fp32 math, accumulated in fp64)::

    err = sum_i || ((x / s) @ Q(W_i * s)^T - x @ W_i^T) * r_i ||^2 / (T * sum_i N_i)

computed as ``sum_n r_i[n]^2 || (x / s) @ (Q(W_i * s) - W_i * s)[n]^T ||^2``, which is the same quantity in
exact arithmetic (``x @ W^T == (x / s) @ (W * s)^T``) without the cancellation of two large fp32 products and
with one matmul instead of two.

``r_i [N_i]`` (``row_scale``; default all ones) serves a member whose output rows an earlier fold divided by
``r_i`` (a consumer's scale folded into its producer: ``up_proj``'s rows by ``down``'s scales, ``v_proj``'s by
``o``'s). The consumer multiplies those outputs back by ``r_i``: with ``W_i`` the folded weight,
``x @ W_i^T * r_i`` is the unfolded model's output, so the error is in the units of the unfolded model's
function, those of the group's round-to-nearest baseline on its original weights. Output powers
(:func:`output_power`) are weighted the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from . import nvfp4

#: Lower clamp of ``mean|x| ** alpha`` before normalization (as llm-awq / AutoAWQ), so a dead channel
#: (mean |x| == 0) never gives a zero or infinite scale.
SCALE_FLOOR = 1e-4
#: Tokens per matmul chunk when accumulating the error (bounds temporary memory at ``chunk * N`` floats).
ERROR_CHUNK_TOKENS = 2048

#: Per-member output-row scales of a group (``row_scale``): ``None``, or one ``None`` / fp32 ``[N_i]`` per member.
RowScale = Sequence[torch.Tensor | None] | None


def _default_clip_ratios() -> tuple[float, ...]:
    # 1.0, 0.975, ..., 0.75 (11 ratios), computed from integers so the values are exact decimals.
    return tuple(1.0 - i / 40 for i in range(11))


@dataclass(frozen=True)
class AWQConfig:
    """Search settings.

    ``n_grid``: alpha takes the values ``{0, 1/n_grid, ..., (n_grid-1)/n_grid}`` (alpha = 0 is plain RTN).
    ``clip_search``: also search a clipping ratio after the scales.
    ``clip_ratios``: candidate ratios in (0, 1]; 1.0 (no clipping) is always evaluated as the baseline.
    ``clip_granularity``: ``"tensor"`` (one ratio per linear) or ``"row"`` (one per output row; exact, since
        each output row's error depends only on that row's block scales).
    ``max_tokens``: tokens used for the *error* evaluation (a fixed-seed random subset, sorted); ``None`` = all.
        Activation statistics always use every token.
    ``seed``: seed of that subset.
    """

    n_grid: int = 20
    clip_search: bool = True
    clip_ratios: tuple[float, ...] = field(default_factory=_default_clip_ratios)
    clip_granularity: str = "tensor"
    max_tokens: int | None = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.n_grid, bool) or not isinstance(self.n_grid, int):
            raise ValueError(f"n_grid must be an integer >= 1, got {self.n_grid!r}")
        if self.n_grid < 1:
            raise ValueError(f"n_grid must be >= 1 (alpha grid {{0, 1/n, ..., (n-1)/n}}), got {self.n_grid}")
        ratios = tuple(self.clip_ratios)
        if len(ratios) == 0:
            raise ValueError("clip_ratios must not be empty")
        for r in ratios:
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or not 0.0 < r <= 1.0:
                raise ValueError(f"clip ratios must lie in (0, 1], got {r!r}")
        object.__setattr__(self, "clip_ratios", tuple(float(r) for r in ratios))
        if self.clip_granularity not in ("tensor", "row"):
            raise ValueError(f"clip_granularity must be 'tensor' or 'row', got {self.clip_granularity!r}")
        if self.max_tokens is not None:
            if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
                raise ValueError(f"max_tokens must be a positive integer or None, got {self.max_tokens!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    @property
    def alphas(self) -> list[float]:
        return [i / self.n_grid for i in range(self.n_grid)]


@dataclass
class ScaleResult:
    """Outcome of :func:`search_scales` for one smoothing group.

    ``scales`` is fp32 ``[K]`` (all exactly 1.0 when ``alpha == 0``); errors are mean squared output errors
    (see module doc, ``row_scale`` included); ``error_rtn`` is the alpha = 0 error (plain NVFP4
    round-to-nearest of the weights as given); ``ref_power`` is ``mean((x @ W^T * r)^2)`` over the same tokens,
    to turn errors into relative ones; ``global_scale`` is the shared NVFP4 tensor scale of the chosen scaled
    weights. :func:`search_scales_coupled` fills ``producer_error``: the producer group's error (same units,
    its ``row_scale`` and the chosen ``s`` included) at the chosen scale; ``None`` otherwise.
    """

    alpha: float
    scales: torch.Tensor
    error: float
    error_rtn: float
    alphas: list[float]
    errors: list[float]
    ref_power: float
    global_scale: torch.Tensor
    n_tokens: int
    producer_error: float | None = None

    def to_dict(self) -> dict:
        """JSON-friendly summary (without the scale tensor)."""
        return {"alpha": self.alpha, "error": self.error, "error_rtn": self.error_rtn,
                "alphas": list(self.alphas), "errors": list(self.errors), "ref_power": self.ref_power,
                "global_scale": float(self.global_scale.item()), "n_tokens": self.n_tokens,
                "producer_error": self.producer_error}


@dataclass
class ClipResult:
    """Outcome of :func:`search_clip` for one smoothing group (weights already scaled by ``scales``).

    ``ratios[i]`` is a float for ``clip_granularity == "tensor"`` or an fp32 ``[N_i]`` tensor for ``"row"``
    (pass it as-is to :func:`clipped_quantize_weight`). ``error`` <= ``error_unclipped`` always.
    ``curve`` maps each candidate ratio to the group error when every member uses it.
    """

    ratios: list
    error: float
    error_unclipped: float
    curve: dict[float, float]
    n_tokens: int

    def to_dict(self) -> dict:
        ratios = [r if isinstance(r, float) else r.tolist() for r in self.ratios]
        return {"ratios": ratios, "error": self.error, "error_unclipped": self.error_unclipped,
                "curve": {str(k): v for k, v in self.curve.items()}, "n_tokens": self.n_tokens}


# ----------------------------------------------------------------------------------------------- helpers


def _check_x(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"expected activations [T, K], got shape {tuple(x.shape)}")
    if x.shape[0] == 0:
        raise ValueError("no activation tokens")
    x = x.float()
    if not torch.isfinite(x).all():
        raise ValueError("activations hold NaN or infinite values")
    return x


def _check_weights(weights: Sequence[torch.Tensor], k: int, device: torch.device) -> list[torch.Tensor]:
    if len(weights) == 0:
        raise ValueError("a smoothing group needs at least one weight")
    out = []
    for i, w in enumerate(weights):
        if w.dim() != 2 or w.shape[1] != k:
            raise ValueError(f"weight {i} has shape {tuple(w.shape)}, expected [N, {k}]")
        if k % nvfp4.GROUP_SIZE:
            raise ValueError(f"input dimension {k} is not a multiple of {nvfp4.GROUP_SIZE}")
        w = w.to(device=device, dtype=torch.float32)
        if not torch.isfinite(w).all():
            raise ValueError(f"weight {i} holds NaN or infinite values")
        out.append(w)
    return out


def _check_scales(s: torch.Tensor, k: int) -> torch.Tensor:
    if s.dim() != 1 or s.shape[0] != k:
        raise ValueError(f"scales must have shape [{k}], got {tuple(s.shape)}")
    s = s.float()
    if not torch.isfinite(s).all() or not (s > 0).all():
        raise ValueError("scales must be finite and > 0")
    return s


def _check_row_scale(row_scale: RowScale, ws: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """One entry per member: ``None`` (weight 1) or a finite, positive fp32 ``[N_i]`` on the weights' device."""
    if row_scale is None:
        return [None] * len(ws)
    if len(row_scale) != len(ws):
        raise ValueError(f"{len(row_scale)} row scales for {len(ws)} weights")
    out: list[torch.Tensor | None] = []
    for i, (r, w) in enumerate(zip(row_scale, ws)):
        if r is None:
            out.append(None)
            continue
        if r.dim() != 1 or r.shape[0] != w.shape[0]:
            raise ValueError(f"row scale {i} must have shape [{w.shape[0]}], got {tuple(r.shape)}")
        r = r.to(device=w.device, dtype=torch.float32)
        if not torch.isfinite(r).all() or not (r > 0).all():
            raise ValueError(f"row scale {i} must be finite and > 0")
        out.append(r)
    return out


def subsample_tokens(x: torch.Tensor, max_tokens: int | None, seed: int = 0) -> torch.Tensor:
    """Deterministic subset of rows of ``x``: all rows if ``T <= max_tokens``, else a fixed-seed random
    choice of ``max_tokens`` rows kept in their original order (random, not strided, so it cannot alias
    with the sequence length of packed calibration batches)."""
    t = x.shape[0]
    if max_tokens is None or t <= max_tokens:
        return x
    g = torch.Generator(device="cpu").manual_seed(seed)
    idx = torch.randperm(t, generator=g)[:max_tokens].sort().values
    return x[idx.to(x.device)]


def _row_sse(xs: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """Per-output-row sum over tokens of ``(xs @ delta^T)^2``: fp64 ``[N]``."""
    acc = torch.zeros(delta.shape[0], dtype=torch.float64, device=xs.device)
    for start in range(0, xs.shape[0], ERROR_CHUNK_TOKENS):
        y = xs[start:start + ERROR_CHUNK_TOKENS] @ delta.t()
        acc += y.double().square().sum(dim=0)
    return acc


def _weighted(row_sse: torch.Tensor, r: torch.Tensor | None) -> float:
    """``sum_n r_n^2 * row_sse_n`` in fp64 (``r=None``: the plain sum, bit for bit as without weights)."""
    if r is None:
        return float(row_sse.sum())
    return float((row_sse * r.double().square()).sum())


def _group_sse(xs: torch.Tensor, scaled: list[torch.Tensor], quantized: list[torch.Tensor],
               row_scale: Sequence[torch.Tensor | None] | None = None) -> float:
    rs = [None] * len(scaled) if row_scale is None else row_scale
    return sum(_weighted(_row_sse(xs, q - w), r) for w, q, r in zip(scaled, quantized, rs))


def _power(xs: torch.Tensor, ws: Sequence[torch.Tensor], rs: Sequence[torch.Tensor | None]) -> float:
    """Summed ``r^2``-weighted squared outputs of ``xs @ W_i^T`` (not yet divided by ``T * sum N_i``)."""
    return sum(_weighted(_row_sse(xs, w), r) for w, r in zip(ws, rs))


# ----------------------------------------------------------------------------------------------- public


def activation_stats(x: torch.Tensor) -> torch.Tensor:
    """Per-input-channel mean |x| over all tokens, fp32 ``[K]`` (x may be bf16; ``[..., K]`` is flattened)."""
    if x.dim() < 2:
        raise ValueError(f"expected activations [..., K], got shape {tuple(x.shape)}")
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] == 0:
        raise ValueError("no activation tokens")
    return x2.float().abs().mean(dim=0)


def scales_from_stats(stats: torch.Tensor, alpha: float) -> torch.Tensor:
    """AWQ scale ``s = clamp(stats ** alpha, 1e-4)``, normalized by ``sqrt(max(s) * min(s))``; fp32 ``[K]``.
    ``alpha == 0`` gives exactly ones."""
    stats = stats.float()
    if alpha == 0:
        return torch.ones_like(stats)
    s = stats.clamp(min=0).pow(alpha).clamp(min=SCALE_FLOOR)
    return s / (s.max() * s.min()).sqrt()


def apply_scales_to_weights(weights: Sequence[torch.Tensor], s: torch.Tensor) -> list[torch.Tensor]:
    """Consuming linears' input columns times ``s``: ``W_i * s`` (column-wise), fp32."""
    s = s.float()
    return [w.to(device=s.device, dtype=torch.float32) * s for w in weights]


def fold_into_norm(norm_weight: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Preceding RMSNorm weight divided by ``s`` (fp32 ``[K]``). Exact only for a weight-only norm of the form
    ``x_hat * w`` (Llama, Qwen, Mistral), not ``x_hat * (1 + w)`` (Gemma) nor a LayerNorm with a bias: the
    calibrate stage refuses other model types (``calibrate.FOLDABLE_MODEL_TYPES``). Also right for the bias
    of a preceding linear."""
    if norm_weight.shape != s.shape:
        raise ValueError(f"norm weight shape {tuple(norm_weight.shape)} != scales shape {tuple(s.shape)}")
    return norm_weight.float() / s.float()


def fold_into_linear_output(prev_weight: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Preceding linear's output rows divided by ``s``: ``prev_weight [K, K_in] / s[:, None]``, fp32.
    Valid when the path from that linear to the consumer is linear and elementwise in those channels
    (v -> attention -> o with one value channel per o column; up -> act(gate) * up -> down). A bias of the
    preceding linear must be divided too (:func:`fold_into_norm`)."""
    if prev_weight.dim() != 2 or prev_weight.shape[0] != s.shape[0]:
        raise ValueError(f"previous weight shape {tuple(prev_weight.shape)} has no {s.shape[0]} output rows")
    return prev_weight.float() / s.float().unsqueeze(1)


def clipped_block_scales(weight: torch.Tensor, gscale: torch.Tensor,
                         ratio: float | torch.Tensor = 1.0) -> torch.Tensor:
    """e4m3 block scales ``[N, K/16]`` from ``ratio * amax_block``: ``e4m3(min(G * (r * amax) / 6, 448))``,
    0 replaced by 0.125. ``ratio`` is a float or a per-row ``[N]`` tensor. ``ratio == 1`` is
    :func:`qerl_cli.nvfp4.block_scales` bit for bit (same operations in the same order)."""
    amax = nvfp4.block_amax(weight)
    if isinstance(ratio, torch.Tensor):
        r = ratio.to(device=amax.device, dtype=torch.float32)
        if r.dim() == 0:
            r = r.reshape(1, 1)
        elif r.dim() == 1 and r.shape[0] == amax.shape[0]:
            r = r.unsqueeze(1)
        else:
            raise ValueError(f"ratio tensor must be a scalar or [{amax.shape[0]}], got {tuple(r.shape)}")
        if not torch.isfinite(r).all() or not ((r > 0) & (r <= 1)).all():
            raise ValueError("clip ratios must lie in (0, 1]")
        amax = amax * r
    else:
        if not 0.0 < float(ratio) <= 1.0:
            raise ValueError(f"clip ratio must lie in (0, 1], got {ratio!r}")
        if float(ratio) != 1.0:
            amax = amax * float(ratio)
    s = (gscale.float() * (amax / nvfp4.E2M1_MAX)).clamp(max=nvfp4.E4M3_MAX).to(torch.float8_e4m3fn)
    zero = s.float() == 0
    if zero.any():
        # in fp32 (exact: both values are e4m3 numbers), on the scales' own device
        s = torch.where(zero, torch.full_like(s, nvfp4.ZERO_SCALE_REPLACEMENT, dtype=torch.float32), s.float())
        s = s.to(torch.float8_e4m3fn)
    return s


def clipped_quantize_weight(weight: torch.Tensor, gscale: torch.Tensor | None = None,
                            ratio: float | torch.Tensor = 1.0) -> dict[str, torch.Tensor]:
    """:func:`qerl_cli.nvfp4.quantize_weight` with block scales from ``ratio * amax`` (codes clamp to ±6, so
    values above the shrunk range saturate). Same dict (``weight_packed``, ``weight_scale``,
    ``weight_global_scale``); identical bytes for ``ratio == 1``. ``gscale`` is not clipped: it stays the
    fused set's ``448 * 6 / amax``."""
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(weight.shape)}")
    if not torch.isfinite(weight).all():
        raise ValueError("weight holds NaN or infinite values")
    if gscale is None:
        gscale = nvfp4.global_scale(weight.float().abs().amax())
    scales = clipped_block_scales(weight, gscale, ratio)
    codes = nvfp4.quantize_codes(weight, scales, gscale)
    return {"weight_packed": nvfp4.pack_nibbles(codes), "weight_scale": scales,
            "weight_global_scale": gscale.float().reshape(1).clone()}


def clipped_fake_quantize(weight: torch.Tensor, gscale: torch.Tensor | None = None,
                          ratio: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Quantize with :func:`clipped_quantize_weight` and dequantize (fp32); equals
    :func:`qerl_cli.nvfp4.fake_quantize` for ``ratio == 1``."""
    if gscale is None:
        gscale = nvfp4.global_scale(weight.float().abs().amax())
    scales = clipped_block_scales(weight, gscale, ratio)  # codes straight to values: no nibble packing
    return nvfp4.dequantize(nvfp4.quantize_codes(weight, scales, gscale), scales, gscale)


def output_power(x: torch.Tensor, weights: Sequence[torch.Tensor], row_scale: RowScale = None) -> float:
    """``mean((x @ W_i^T * r_i)^2)`` over the group's outputs: the scale that makes an output error relative.
    With ``row_scale`` (rows an earlier fold divided by ``r_i``) it is the unfolded model's output power."""
    x = _check_x(x)
    ws = _check_weights(weights, x.shape[1], x.device)
    rs = _check_row_scale(row_scale, ws)
    return _power(x, ws, rs) / (x.shape[0] * sum(w.shape[0] for w in ws))


def group_error(x: torch.Tensor, weights: Sequence[torch.Tensor], s: torch.Tensor | None = None,
                ratios: Sequence[float | torch.Tensor] | None = None, row_scale: RowScale = None) -> float:
    """Mean squared output error of a group under NVFP4 (no subsampling: pass the tokens you want):
    ``sum_i ||((x/s) @ Q_r(W_i*s)^T - x @ W_i^T) * r_i||^2 / (T * sum N_i)`` with one shared global scale from
    the scaled set. ``s=None`` and ``ratios=None`` is plain round-to-nearest (the quantizer of ``quantize``);
    ``row_scale=None`` weighs every output row 1 (see the module doc)."""
    x = _check_x(x)
    ws = _check_weights(weights, x.shape[1], x.device)
    rs = _check_row_scale(row_scale, ws)
    if s is None:
        scaled, xs = ws, x
    else:
        s = _check_scales(s.to(x.device), x.shape[1])
        scaled, xs = apply_scales_to_weights(ws, s), x / s
    g = nvfp4.fused_global_scale(scaled)
    if ratios is None:
        ratios = [1.0] * len(scaled)
    if len(ratios) != len(scaled):
        raise ValueError(f"{len(ratios)} clip ratios for {len(scaled)} weights")
    quant = [clipped_fake_quantize(w, g, r) for w, r in zip(scaled, ratios)]
    denom = x.shape[0] * sum(w.shape[0] for w in ws)
    return _group_sse(xs, scaled, quant, rs) / denom


def search_scales(x: torch.Tensor, weights: Sequence[torch.Tensor], cfg: AWQConfig | None = None,
                  stats: torch.Tensor | None = None, row_scale: RowScale = None) -> ScaleResult:
    """Grid-search alpha for one smoothing group. ``x [T, K]`` is the group's input (any float dtype),
    ``weights`` its consumers ``[N_i, K]`` that share one NVFP4 global scale. ``stats`` (mean |x| per channel)
    may be passed when accumulated over more tokens than ``x`` holds; by default it is computed from all of
    ``x``. ``row_scale`` (per member ``None`` or ``[N_i]``): the factors an earlier fold divided the members'
    output rows by, so errors and ``ref_power`` are in the unfolded model's units (module doc). The error uses
    ``cfg.max_tokens`` tokens. Ties keep the smaller alpha (so RTN wins a tie)."""
    cfg = cfg or AWQConfig()
    x = _check_x(x)
    k = x.shape[1]
    ws = _check_weights(weights, k, x.device)
    rs = _check_row_scale(row_scale, ws)
    if stats is None:
        stats = activation_stats(x)
    else:
        if stats.shape != (k,):
            raise ValueError(f"stats must have shape [{k}], got {tuple(stats.shape)}")
        stats = stats.to(device=x.device, dtype=torch.float32)
        if not torch.isfinite(stats).all() or (stats < 0).any():
            raise ValueError("stats must be finite and >= 0")
    xe = subsample_tokens(x, cfg.max_tokens, cfg.seed)
    denom = xe.shape[0] * sum(w.shape[0] for w in ws)

    best = None
    errors: list[float] = []
    alphas = cfg.alphas
    for alpha in alphas:
        s = scales_from_stats(stats, alpha)
        scaled = apply_scales_to_weights(ws, s)
        g = nvfp4.fused_global_scale(scaled)
        quant = [nvfp4.fake_quantize(w, g) for w in scaled]
        xs = xe if alpha == 0 else xe / s
        err = _group_sse(xs, scaled, quant, rs) / denom
        if not math.isfinite(err):
            err = math.inf
        errors.append(err)
        if best is None or err < best[0]:
            best = (err, alpha, s, g)

    ref_power = _power(xe, ws, rs) / denom
    err, alpha, s, g = best
    return ScaleResult(alpha=alpha, scales=s, error=err, error_rtn=errors[0], alphas=alphas, errors=errors,
                       ref_power=ref_power, global_scale=g, n_tokens=xe.shape[0])


def search_clip(x: torch.Tensor, weights: Sequence[torch.Tensor], scales: torch.Tensor | None = None,
                cfg: AWQConfig | None = None, row_scale: RowScale = None) -> ClipResult:
    """Search the clipping ratio of each member of a group, given the AWQ ``scales`` (``None`` = no scaling,
    e.g. weights with the scales already folded in and ``x`` divided by them). The search quantizes
    ``W_i * s`` with the shared global scale of the scaled set (unchanged by clipping) and block scales from
    ``r * amax``, minimizing the same output error as :func:`search_scales` (``row_scale`` weights included).
    With the global scale fixed, member errors (and row errors) are independent, so the per-member (per-row)
    choice is the exact minimizer of the group error. Ratio 1.0 is always a candidate, reproduces the
    unclipped quantizer bit for bit and wins ties, so the result is never worse than no clipping."""
    cfg = cfg or AWQConfig()
    x = _check_x(x)
    k = x.shape[1]
    ws = _check_weights(weights, k, x.device)
    rs = _check_row_scale(row_scale, ws)
    xe = subsample_tokens(x, cfg.max_tokens, cfg.seed)
    if scales is None:
        scaled, xs = ws, xe
    else:
        s = _check_scales(scales.to(x.device), k)
        scaled, xs = apply_scales_to_weights(ws, s), xe / s
    g = nvfp4.fused_global_scale(scaled)
    denom = xe.shape[0] * sum(w.shape[0] for w in ws)
    cands = [1.0] + [r for r in dict.fromkeys(cfg.clip_ratios) if r != 1.0]

    # row_err[i]: [len(cands), N_i] fp64 squared error per output row for each candidate ratio (times r^2).
    row_err = []
    for w, rw in zip(scaled, rs):
        rows = torch.stack([_row_sse(xs, clipped_fake_quantize(w, g, r) - w) for r in cands])
        row_err.append(rows if rw is None else rows * rw.double().square())
    curve = {r: sum(float(e[j].sum()) for e in row_err) / denom for j, r in enumerate(cands)}

    ratios: list = []
    total = 0.0
    for e in row_err:
        if cfg.clip_granularity == "tensor":
            tot = e.sum(dim=1)
            j = 0
            for jj in range(1, len(cands)):  # strict improvement only: ties keep the earlier (1.0 first)
                if tot[jj] < tot[j]:
                    j = jj
            ratios.append(cands[j])
            total += float(tot[j])
        else:
            # argmin over candidates per row; torch.argmin returns the first minimum, i.e. 1.0 on a tie.
            j = torch.argmin(e, dim=0)
            cand_t = torch.tensor(cands, dtype=torch.float32, device=e.device)
            ratios.append(cand_t[j])
            total += float(e.gather(0, j.unsqueeze(0)).sum())
    return ClipResult(ratios=ratios, error=total / denom, error_unclipped=curve[1.0], curve=curve,
                      n_tokens=xe.shape[0])


@dataclass
class Producer:
    """The group whose member ``index`` *produces* the input of a linear-output smoothing group (gate/up for
    up -> down, q/k/v for v -> o): folding ``s`` divides that member's rows by ``s``, which changes how the
    producer group quantizes (its rows and its shared global scale). ``x`` is the producer group's input;
    ``row_scale`` (as in :func:`search_scales`) the factors earlier folds already divided its members' rows by
    (``None``: none)."""

    x: torch.Tensor
    weights: Sequence[torch.Tensor]
    index: int
    row_scale: RowScale = None


def producer_error(producer: Producer, s: torch.Tensor | None, cfg: AWQConfig | None = None) -> float:
    """The producer group's mean squared output error, in the unfolded model's units, after its member
    ``index`` has its rows divided by ``s`` (``None``: not divided): exactly the alpha = 0 error that
    :func:`search_scales` reports for that group once ``s`` is folded and passed in its ``row_scale`` (same
    tokens, same operations), which is how ``calibrate`` searches the producer after its consumer."""
    cfg = cfg or AWQConfig()
    px = subsample_tokens(_check_x(producer.x), cfg.max_tokens, cfg.seed)
    pws = _check_weights(producer.weights, px.shape[1], px.device)
    prs = _check_row_scale(producer.row_scale, pws)
    return _producer_sse(px, pws, prs, producer.index, s) / (px.shape[0] * sum(w.shape[0] for w in pws))


def _producer_sse(px: torch.Tensor, pws: list[torch.Tensor], prs: list[torch.Tensor | None], index: int,
                  s: torch.Tensor | None) -> float:
    prod, rs = list(pws), list(prs)
    if s is not None:
        prod[index] = fold_into_linear_output(prod[index], s)
        rs[index] = s.float() if rs[index] is None else rs[index] * s.float()
    pg = nvfp4.fused_global_scale(prod)
    return _group_sse(px, prod, [nvfp4.fake_quantize(w, pg) for w in prod], rs)


def search_scales_coupled(x: torch.Tensor, weights: Sequence[torch.Tensor], producer: Producer,
                          cfg: AWQConfig | None = None, stats: torch.Tensor | None = None,
                          row_scale: RowScale = None) -> ScaleResult:
    """:func:`search_scales` for a linear-output group, minimizing the sum of the **relative** output errors
    (MSE / output power) of the group and of its producer group with the producer member's rows divided by
    the candidate ``s``. Without the producer term a scale that helps ``down`` can wreck the quantization of
    ``up`` (and, through the shared global scale, ``gate``). Alpha = 0 leaves both at round-to-nearest.

    The producer's error is measured in the units its outputs have for the consumer (the unfolded model's):
    the folded member computes ``x_p @ Q(W/s)^T``, which the consumer's ``* s`` columns turn back into
    ``x_p @ (Q(W/s) * s)^T``, so row ``n``'s error ``x_p @ (Q(W/s) - W/s)[n]^T`` is weighted by ``s_n^2``
    (``row_scale`` of the folded member, as :func:`search_scales` then measures that group; weighing it 1
    shrinks the error of rows divided by a large s and so favoured large scales on outlier channels). The
    other members' errors are unchanged in units. Both terms are divided by output powers in the same units
    (of the weights before this fold). ``row_scale`` weighs the group's own rows (module doc)."""
    cfg = cfg or AWQConfig()
    x = _check_x(x)
    ws = _check_weights(weights, x.shape[1], x.device)
    rs = _check_row_scale(row_scale, ws)
    px = subsample_tokens(_check_x(producer.x), cfg.max_tokens, cfg.seed)
    pws = _check_weights(producer.weights, px.shape[1], px.device)
    prs = _check_row_scale(producer.row_scale, pws)
    if pws[producer.index].shape[0] != x.shape[1]:
        raise ValueError("the producer member's outputs must be the group's inputs")
    if stats is None:
        stats = activation_stats(x)
    xe = subsample_tokens(x, cfg.max_tokens, cfg.seed)
    denom = xe.shape[0] * sum(w.shape[0] for w in ws)
    pdenom = px.shape[0] * sum(w.shape[0] for w in pws)
    ref = _power(xe, ws, rs) / denom
    pref = _power(px, pws, prs) / pdenom
    best, errors, err_rtn = None, [], math.nan
    for alpha in cfg.alphas:
        s = scales_from_stats(stats.to(torch.float32), alpha)
        scaled = apply_scales_to_weights(ws, s)
        g = nvfp4.fused_global_scale(scaled)
        err = _group_sse(xe if alpha == 0 else xe / s, scaled, [nvfp4.fake_quantize(w, g) for w in scaled],
                         rs) / denom
        perr = _producer_sse(px, pws, prs, producer.index, None if alpha == 0 else s) / pdenom
        total = err / max(ref, 1e-30) + perr / max(pref, 1e-30)
        if alpha == 0:
            err_rtn = err
        errors.append(total)
        if best is None or total < best[0]:
            best = (total, alpha, s, g, err, perr)
    _, alpha, s, g, err, perr = best
    return ScaleResult(alpha=alpha, scales=s, error=err, error_rtn=err_rtn, alphas=cfg.alphas, errors=errors,
                       ref_power=ref, global_scale=g, n_tokens=xe.shape[0], producer_error=perr)
