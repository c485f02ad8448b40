"""NVFP4 x BF16 products on the packed layout (:mod:`qerl_cli.layout`), CUDA kernel with a torch fallback.

Public API (all tensors may live on CPU, where the pure-torch reference runs)::

    available() -> bool
    last_backend() -> str           # "cuda-kernel" | "cuda-tiled-kernel" | "cuda-dequant-cublas" | "torch-reference"
    linear(x, qweight, global_scale, n, k, *, out=None)   # x [..., k] -> x @ W^T  [..., n], x.dtype
    linear_t(g, qweight, global_scale, n, k)              # g [..., n] -> g @ W    [..., k]
    dequantize(qweight, global_scale, n, k, dtype=torch.bfloat16)  # [n, k]
    dequantize_many([(qweight, global_scale, n, k), ...])          # bf16 [n, k] views of one buffer, one launch
    path(m, n, k) -> str | None     # the backend linear takes for bf16 x of m rows (None: no extension)

The products are torch custom ops in the ``qerl`` namespace (``torch.ops.qerl.linear``, ``linear_t``,
``dequantize``, ``dequantize_many`` and the in-place ``linear_out``) with fake implementations, so they trace under
``torch.compile`` / ``torch.export``; ``linear`` is differentiable with respect to ``x`` (its backward is
``linear_t``; the packed weight is frozen).

On CUDA the extension in ``csrc/nvfp4_kernel.cu`` is JIT-built on first use (cached by
``torch.utils.cpp_extension`` under ``$TORCH_EXTENSIONS_DIR``) for sm_90a plus generic sm_80/sm_89 code:

* bf16 ``x`` with at most ``large_m_threshold()`` rows (default 64): the mma.sync kernel that streams the
  packed weight and dequantizes in registers ("cuda-kernel"), except weights of <= 4e7 entries from M = 32 on
  where their K splits cannot reduce in a cluster (below: above the cluster M limit, or clusters off);
* bf16 ``x`` of ``large_m_threshold() < M <= tc_max_m()`` rows: the tiled tensor-core kernels ("cuda-tiled-kernel",
  sessions 23-24): 64-256-row x 64- or 128-token tiles, both operands through a 4-stage cp.async pipeline in
  shared memory, the weight dequantized in registers as in the small-M kernels and multiplied with mma.sync, or
  on an sm_90a device with warpgroup MMAs (wgmma) reading the activations from shared memory; split-K where the
  tiles do not fill the GPU; ``tc_max_m()`` is 0 (off) unless ``set_tc_max_m`` or ``QERL_TC_MAX_M`` sets it;
* above that, up to 128 rows, weights of more than 4e7 entries: the mma.sync kernel again (measured faster than
  writing and reading their dequantized copy);
* the rest, larger M, or fp16/fp32 ``x``: a dequantize kernel into a bf16/fp16/fp32 buffer, then cuBLAS
  ("cuda-dequant-cublas"); ``linear_t`` always takes this path. (``choose_path`` in the CUDA source.)
* an optional frozen ``bias`` is added in the kernel's epilogue, after the product's bf16 rounding;
* the small-M kernels (and the engine's fused kernels, ``csrc/fused_ops.cu``) launch with programmatic
  dependent launch on sm_90 (``csrc/pdl.cuh``): a launch overlaps the end of the kernel before it, warms L2
  with its first weight tiles and loads the very first ones into registers; ``set_pdl(False)`` or ``QERL_PDL=0`` turns it off (results are identical);
* up to M = 32 (``QERL_CLUSTER_MAX_M``) the small-M mma kernel's K splits (at most 8) may form one thread-block
  cluster per row group on sm_90 and add their partials through distributed shared memory (``set_cluster``,
  ``QERL_CLUSTER=0`` for the workspace path); above M = 16 not for wide weights (N > K) of >= 1e8 entries.

Small-M kernel variant: ``"auto"`` (the default) picks one per shape from H200 measurements (at M <= 8:
``"v2w8"`` for weights of >= 6e7 entries, for smaller ones of >= 5120 rows ``"v2"`` if wide (N > K) and
``"v2w8"`` otherwise, ``"v2w8"`` for those of >= 1e7 entries where its row-group-aligned grid forms on the device
(session 21, H100),
``"default"`` for the rest; up to M = 16, ``"v2w10"`` instead of ``"v2w8"`` where only 160-row groups align with
the resident CTA slots, e.g. the 7B gate/up weight; at 8 < M <= 16: ``"v2w8"`` for weights of >= 6e7 entries,
``"default"`` for smaller wide ones of >= 5120 rows, ``"alt"`` otherwise; at 16 < M <= 64: ``"v2w8"`` for
weights of >= 1e8 entries, ``"v2"`` for those of >= 6e7, ``"default"`` otherwise; see ``auto_variant`` in the CUDA source;
``ext.auto_variant(m, n, k)`` reports the choice). ``set_variant(name)`` or ``QERL_KERNEL_VARIANT=name`` in the
environment (read when the extension loads) forces one: ``"default"`` is the original kernel, ``"alt"`` its
alternative tuning configuration, ``"v2"`` the stream-K kernel (equal work per CTA, fewer instructions per
tile) for M <= 64, ``"v2w8"`` the same with 8
warps per block (the activations staged once serve 128 rows), ``"v2w10"`` with 10 (160 rows; up to M = 16, above
it runs ``"v2w8"``).
All read the same tile records and have the same op signatures. Up to M = 16 the stream-K kernels run a grid
aligned with their row groups (RG * s CTAs, each inside one row group's K range) where that fills at least 3/4 of
the resident CTA slots (``set_v2_aligned``, ``QERL_KERNEL_V2_ALIGNED=0`` off): CTAs that cross a row group end
mid-range were the late ones (session 21). Where such a grid's s splits of a row group (s <= 8) fit as
thread-block clusters on sm_90, they add their partials through distributed shared memory (``set_v2_cluster``,
``QERL_KERNEL_V2_CLUSTER=0`` off; the same bits as the workspace).

If CUDA is absent or the build fails, every call runs the reference (:func:`layout.reference_matmul`,
:func:`layout.dequantize`) and one warning line says why. Split-K launches keep a small self-resetting
ticket buffer per (device, stream); do not run the same op concurrently on one stream from two threads.
"""

from __future__ import annotations

import hashlib
import os
import threading
import warnings
from pathlib import Path

import torch

from . import layout

__all__ = ["available", "last_backend", "linear", "linear_t", "dequantize", "dequantize_many", "path",
           "large_m_threshold",
           "set_large_m_threshold", "tc_max_m", "set_tc_max_m", "build_error", "variant", "set_variant", "VARIANTS", "set_pdl", "set_cluster",
           "linear_lora", "takes_lora", "linear_silu", "LORA_MAX_ROWS", "set_v2_aligned", "set_v2_cluster", "set_v2_prefetch",
           "settings"]

BACKEND_KERNEL = "cuda-kernel"
BACKEND_DEQUANT = "cuda-dequant-cublas"
BACKEND_TILED = "cuda-tiled-kernel"
BACKEND_REFERENCE = "torch-reference"

VARIANTS = {"default": 0, "alt": 1, "v2": 2, "auto": 3, "v2w8": 4, "v2w10": 5}
LORA_MAX_ROWS = 64  # linear_lora's most rows (kLoraAugMaxTG token groups of 8 in csrc/nvfp4_kernel.cu)

_DEFAULT_ARCH_FLAGS = (
    "-gencode=arch=compute_90a,code=sm_90a",
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_89,code=sm_89",
    "-gencode=arch=compute_80,code=compute_80",  # PTX for anything newer without an exact cubin
)

_lock = threading.Lock()
_ext = None
_ext_error: str | None = None
_ext_tried = False
_variant = "auto"
_warned: set[str] = set()
_state = threading.local()


def _source(filename: str = "nvfp4_kernel.cu") -> Path | None:
    env = os.environ.get("QERL_CSRC")
    candidates = [Path(env)] if env else []
    here = Path(__file__).resolve()
    candidates += [here.parent / "csrc", here.parents[2] / "csrc"]
    for c in candidates:
        if (c / filename).is_file():
            return c / filename
    return None


def build_extension(name: str, filename: str, timeline: bool = False, src_dir: str | Path | None = None):
    """JIT-build (cached) and load the torch extension ``name`` from ``csrc/<filename>`` for this machine's
    arch flags; raises with the reason when CUDA, the source or the build is missing. ``timeline``: the probe
    build (``name`` + ``_tl``, ``-DQERL_TIMELINE``: per-CTA timestamps, benchmarks/probe_timeline.py).
    ``src_dir``: build ``src_dir/<filename>`` instead, with the same flags (benchmarks/ab_kernel.py --other)."""
    if os.environ.get("QERL_DISABLE_KERNEL", "0") not in ("", "0"):
        raise RuntimeError("QERL_DISABLE_KERNEL is set")
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0):
        cc = ".".join(map(str, torch.cuda.get_device_capability()))
        raise RuntimeError(f"the GPU's compute capability {cc} is below 8.0 (the kernel needs sm_80 or newer)")
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device")
    src = _source(filename) if src_dir is None else Path(src_dir) / filename
    if src is None or not src.is_file():
        raise RuntimeError(f"csrc/{filename} not found (set QERL_CSRC)" if src_dir is None else f"{src} not found")
    from torch.utils.cpp_extension import load

    arch = os.environ.get("QERL_KERNEL_ARCH_FLAGS")
    arch_flags = arch.split() if arch else list(_DEFAULT_ARCH_FLAGS)
    # torch's build cache hashes the listed source only: the headers it includes (csrc/*.cuh) enter the key
    # through a define, so editing one rebuilds
    headers = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(src.parent.glob("*.cuh")))).hexdigest()[:16]
    # -DQERL_HAS_SM90A: the build carries sm_90a code, so the host may pick the wgmma kernels on a cc 9.0 device
    sm90a = ["-DQERL_HAS_SM90A"] if any("sm_90a" in f for f in arch_flags) else []
    # --threads 0: nvcc compiles the arch targets side by side (one process each; four by default)
    return load(name=name + ("_tl" if timeline else ""), sources=[str(src)],
                extra_cuda_cflags=["-O3", "-lineinfo", "--threads=0", f"-DQERL_HEADERS_SHA={headers}", *arch_flags,
                                   *sm90a, *(["-DQERL_TIMELINE"] if timeline else [])],
                extra_cflags=["-O3"], verbose=bool(os.environ.get("QERL_KERNEL_VERBOSE")))


def build_identity(device: str | torch.device | None = None) -> dict:
    """What a verify of the kernel checked, which a run on the kernel must still have (``rollout.require_verified``):
    a digest of the CUDA sources the extensions build from (``csrc/*.cu``, ``*.cuh``), the arch flags, the compute
    capability and SM count of the GPU the run uses (``device``, e.g. ``"cuda:1"``; the current CUDA device where
    it names none: the per-shape grids and split-K sums follow from those), and the torch and CUDA versions the
    extension builds against. Builds nothing."""
    src = _source()
    files = sorted(src.parent.glob("*.cu")) + sorted(src.parent.glob("*.cuh")) if src is not None else []
    digest = hashlib.sha256(b"".join(p.name.encode() + b"\0" + p.read_bytes() for p in files)).hexdigest()[:16] \
        if files else None
    arch = os.environ.get("QERL_KERNEL_ARCH_FLAGS")
    gpu = None
    if torch.cuda.is_available():
        d = torch.device(device) if device is not None else None
        idx = d.index if d is not None and d.type == "cuda" and d.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        gpu = {"capability": f"{props.major}.{props.minor}", "sms": props.multi_processor_count}
    return {"sources": digest, "arch_flags": arch.split() if arch else list(_DEFAULT_ARCH_FLAGS), "gpu": gpu,
            "torch": torch.__version__, "cuda": torch.version.cuda}


def error_line(e: Exception) -> str:
    """One line saying why a build or load failed: the compiler's first error line where the message holds one
    (torch's "Error building extension ..." text ends in ninja's "build stopped", which says nothing), else the
    last line."""
    msg = [m.strip() for m in str(e).strip().splitlines() if m.strip()]
    errors = [m for m in msg[1:] if "error" in m.lower() and not m.lower().startswith("ninja: build stopped")]
    return f"{type(e).__name__}: {errors[0] if errors else msg[-1] if msg else ''}"[:300]


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"qerl.kernel: using the pure-torch reference: {reason}", RuntimeWarning, stacklevel=3)


def _load():
    """The compiled extension, or None (reason in ``build_error()``)."""
    global _ext, _ext_error, _ext_tried
    if _ext_tried:
        return _ext
    with _lock:
        if _ext_tried:
            return _ext
        try:
            # QERL_KERNEL_TIMELINE=1: the timeline probe build (benchmarks/probe_timeline.py)
            _ext = build_extension("qerl_nvfp4", "nvfp4_kernel.cu",
                                   timeline=os.environ.get("QERL_KERNEL_TIMELINE") == "1")
        except Exception as e:  # noqa: BLE001 - any build/load failure means: use the reference
            _ext_error = error_line(e)
            _ext = None
        if _ext is not None:
            _apply_variant(_ext)
        _ext_tried = True
    return _ext


def _apply_variant(ext) -> None:
    """Hand the chosen variant (``set_variant`` before the load, else ``QERL_KERNEL_VARIANT``) to the extension."""
    global _variant
    env = os.environ.get("QERL_KERNEL_VARIANT")
    if env and _variant == "auto":
        try:
            _variant = _variant_name(env)
        except ValueError as e:
            warnings.warn(f"qerl.kernel: ignoring QERL_KERNEL_VARIANT: {e}", RuntimeWarning, stacklevel=3)
    ext.set_variant(VARIANTS[_variant])
    if os.environ.get("QERL_KERNEL_V2_ALIGNED", "1") == "0":
        ext.set_v2_aligned(False)
    if os.environ.get("QERL_KERNEL_V2_CLUSTER", "1") == "0":
        ext.set_v2_cluster(False)
    pf = os.environ.get("QERL_KERNEL_V2_PREFETCH", "").strip()
    if pf:
        try:
            ext.set_v2_prefetch(int(pf))
        except (ValueError, RuntimeError) as e:
            warnings.warn(f"qerl.kernel: ignoring QERL_KERNEL_V2_PREFETCH={pf!r}: {e}", RuntimeWarning, stacklevel=3)


def _variant_name(v: str) -> str:
    name = str(v).strip().lower()
    if name not in VARIANTS:
        raise ValueError(f"unknown kernel variant {v!r}; expected one of {sorted(VARIANTS)}")
    return name


def variant() -> str:
    """The small-M kernel variant in use: "auto" (per shape), "default", "alt", "v2", "v2w8" or "v2w10"."""
    ext = _load()
    if ext is None:
        return _variant
    code = int(ext.get_variant())
    return next(k for k, c in VARIANTS.items() if c == code)


def set_variant(v: str) -> None:
    """Select the small-M kernel variant ("auto", "default", "alt", "v2", "v2w8" or "v2w10"), process-wide.

    Without a CUDA extension this only records the choice (the torch reference ignores it). Overrides
    ``QERL_KERNEL_VARIANT``."""
    global _variant
    name = _variant_name(v)
    ext = _load()
    _variant = name
    if ext is not None:
        ext.set_variant(VARIANTS[name])


def set_v2_aligned(on: bool) -> None:
    """Row-group-aligned grids of the stream-K kernels at M <= 16 (default on, ``QERL_KERNEL_V2_ALIGNED=0`` off):
    RG * s CTAs, each taking 1/s of one row group's K range, where such a grid fills at least 3/4 of the resident
    CTA slots; off, every slot takes an equal share of all units (a CTA may cross a row group end). Also decides
    whether auto picks ``"v2w8"`` for M <= 8 weights of 1e7 to 6e7 entries. Results differ only in the fp32 order
    of split sums. A no-op without the CUDA extension."""
    ext = _load()
    if ext is not None:
        ext.set_v2_aligned(bool(on))


def set_v2_cluster(on: bool) -> None:
    """Split-K sums of the stream-K kernels' row-group-aligned grids through sm_90 thread-block clusters (default
    on, ``QERL_KERNEL_V2_CLUSTER=0`` off): the s CTAs of a row group (s <= 8) run as one cluster and add their
    fp32 partials through distributed shared memory in split order, instead of the fp32 workspace and a ticket:
    the same order, so the same bits (tested). Only where every cluster fits on the device at once (8-warp
    instances, M <= 16). Off, ``auto`` also changes its choice at 8 < M <= 16 for the weights of < 6e7 entries
    that take v2w8 only where its sums run in clusters (session 22: the 32B q/k/v and o, the 7B o go back to the
    v1 kernel there), so an A/B of the sums alone forces v2w8. A no-op without the CUDA extension."""
    ext = _load()
    if ext is not None:
        ext.set_v2_cluster(bool(on))


def set_v2_prefetch(tiles: int) -> None:
    """The stream-K kernels' rolling L2 prefetch (``QERL_KERNEL_V2_PREFETCH``; default 0, off): each warp's lane 0
    asks L2 for its row block's K tiles ``tiles`` ahead of the chunk it computes (``cp.async.bulk.prefetch.L2``),
    beyond the PDL prologue's first 16, so more of the weight is in flight than the register tiles hold. Values
    are unchanged (bit-identical outputs, tested); only the timing changes. Only in a build with
    ``-DQERL_V2_PREFETCH_LOOP`` in ``QERL_KERNEL_ARCH_FLAGS`` (session 29, not yet measured; the default build's
    kernels are the measured ones): elsewhere a distance above 0 raises RuntimeError. A no-op without the CUDA
    extension."""
    tiles = int(tiles)
    if not 0 <= tiles <= 255:
        raise ValueError(f"the L2 prefetch distance must be 0 ... 255 tiles, not {tiles}")
    ext = _load()
    if ext is not None:
        ext.set_v2_prefetch(tiles)


def set_pdl(on: bool) -> None:
    """Programmatic dependent launch (csrc/pdl.cuh) of the small-M kernels and of the engine's fused kernels
    on or off, process-wide (default on, ``QERL_PDL=0`` off): with it a kernel launches while the one before it
    finishes, warms L2 with its first weight tiles and waits for that one before touching memory. Results are
    identical either way; only the timing changes. A no-op without the CUDA extensions."""
    from . import fused

    for ext in (_load(), fused._load()):
        if ext is not None:
            ext.set_pdl(bool(on))


def set_cluster(on: bool) -> None:
    """Split-K reduction of the small-M mma kernel ("default" / "alt", M <= 32) through sm_90 thread-block
    clusters (default on; ``QERL_CLUSTER=0`` off): the K splits of a row group run as one cluster of at most 8
    CTAs and add their fp32 partials through distributed shared memory, in split order; off, they go through an fp32
    workspace in global memory and the last CTA adds them, in the same order. The split count is chosen per
    shape either way (at most 8 with clusters), so results match whenever the split does. A no-op without the
    CUDA extension."""
    ext = _load()
    if ext is not None:
        ext.set_cluster(bool(on))


def available() -> bool:
    """True when the CUDA extension is built and loaded (tries the build once)."""
    return _load() is not None


def build_error() -> str | None:
    """Why the extension is unavailable (None when it loaded or was not tried yet)."""
    return _ext_error


def last_backend() -> str:
    """Which path the last call on this thread ran."""
    return getattr(_state, "backend", BACKEND_REFERENCE)


def _set_backend(name: str) -> None:
    _state.backend = name


def settings() -> dict:
    """The process-wide settings that decide which kernel, grid and split-K reduction run a product (outputs may
    differ between them in the fp32 order of split sums, never beyond bf16 rounding): recorded with rollouts so
    a run says which code made its tokens. Without the extension only ``available`` (False) and ``variant``."""
    ext = _load()
    out = {"available": ext is not None, "variant": variant()}
    if ext is not None:
        out |= {"pdl": bool(ext.get_pdl()), "cluster_split": bool(ext.get_cluster()),
                "cluster_max_m": int(ext.get_cluster_max_m()), "large_m_threshold": int(ext.get_large_m_threshold()),
                "tc_max_m": int(ext.get_tc_max_m()),
                "v2_aligned": bool(ext.get_v2_aligned()), "v2_cluster": bool(ext.get_v2_cluster()),
                "v2_prefetch": int(ext.get_v2_prefetch())}
    return out


def large_m_threshold() -> int:
    ext = _load()
    return int(ext.get_large_m_threshold()) if ext is not None else 64


def set_large_m_threshold(m: int) -> None:
    """Rows above which bf16 ``linear`` uses dequantize + cuBLAS instead of the mma kernel."""
    ext = _load()
    if ext is None:
        raise RuntimeError(f"CUDA extension unavailable: {_ext_error}")
    ext.set_large_m_threshold(int(m))


def tc_max_m() -> int:
    """The largest M that bf16 ``linear`` gives the tiled tensor-core kernel (above ``large_m_threshold()``);
    0: never (then dequantize + cuBLAS there)."""
    ext = _load()
    return int(ext.get_tc_max_m()) if ext is not None else 0


def set_tc_max_m(m: int) -> None:
    """Route bf16 ``linear`` of ``large_m_threshold() < M <= m`` rows to the tiled tensor-core kernel (0: never)."""
    ext = _load()
    if ext is None:
        raise RuntimeError(f"CUDA extension unavailable: {_ext_error}")
    if int(m) < 0:
        raise ValueError(f"tc_max_m must be >= 0, got {m}")
    ext.set_tc_max_m(int(m))


# ----------------------------------------------------------------------------------------------- checks
def _check_packed(qweight: torch.Tensor, global_scale: torch.Tensor, n: int, k: int) -> None:
    if n <= 0 or k <= 0 or k % 16:
        raise ValueError(f"need n > 0 and k a positive multiple of 16, got n={n}, k={k}")
    if qweight.dtype != torch.uint8 or qweight.dim() != 3 or qweight.shape[-1] != layout.RECORD_BYTES:
        raise ValueError(f"qweight must be uint8 [N_pad/16, K_pad/64, {layout.RECORD_BYTES}], "
                         f"got {qweight.dtype} {tuple(qweight.shape)}")
    np_, kp = layout.padded_shape(n, k)
    if tuple(qweight.shape[:2]) != (np_ // layout.TILE_N, kp // layout.TILE_K):
        raise ValueError(f"packed weight of shape {tuple(qweight.shape)} does not hold a [{n}, {k}] matrix")
    if global_scale.dtype != torch.float32 or global_scale.numel() != 1:
        raise ValueError(f"global_scale must be a float32 tensor of one element, got {global_scale.dtype} "
                         f"{tuple(global_scale.shape)}")
    if qweight.device != global_scale.device:
        raise ValueError(f"qweight on {qweight.device} but global_scale on {global_scale.device}")


def _check_act(x: torch.Tensor, width: int, what: str, qweight: torch.Tensor) -> None:
    if x.dim() < 1 or x.shape[-1] != width:
        raise ValueError(f"{what} must have last dimension {width}, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{what} must be floating point, got {x.dtype}")
    if x.device != qweight.device:
        raise ValueError(f"{what} on {x.device} but qweight on {qweight.device}")


def _use_kernel(t: torch.Tensor):
    if t.device.type != "cuda":
        _warn_once("tensors are not on a CUDA device")
        return None
    ext = _load()
    if ext is None:
        _warn_once(f"CUDA extension unavailable ({_ext_error})")
    return ext


def _gs(global_scale: torch.Tensor) -> torch.Tensor:
    return global_scale.reshape(1).contiguous()


# ------------------------------------------------------------------------------------------ the ops
_DEQUANT_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_bias(bias: torch.Tensor | None, x: torch.Tensor, n: int) -> None:
    if bias is None:
        return
    if bias.dim() != 1 or bias.shape[0] != n or bias.dtype != x.dtype or bias.device != x.device:
        raise ValueError(f"bias must be a [{n}] {x.dtype} tensor on {x.device}, "
                         f"got {bias.dtype} {tuple(bias.shape)} on {bias.device}")


def _path_backend(code) -> str:
    """The backend name of a path code of the extension's ``linear_out`` / ``choose_path`` (0 mma, 1 dequantize +
    cuBLAS, 2 tiled)."""
    return {0: BACKEND_KERNEL, 2: BACKEND_TILED}.get(int(code), BACKEND_DEQUANT)


def _linear_into(x2: torch.Tensor, qweight: torch.Tensor, gs: torch.Tensor, n: int, k: int,
                 out2: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    ext = _use_kernel(x2) if x2.dtype in _DEQUANT_KERNEL_DTYPES or x2.device.type != "cuda" else None
    if ext is None:
        y = layout.reference_matmul(x2, qweight, gs, n, k)
        out2.copy_(y if bias is None else y.to(out2.dtype) + bias)
        _set_backend(BACKEND_REFERENCE)
        return
    path = ext.linear_out(x2, qweight.contiguous(), _gs(gs), n, k, out2, -1,
                          None if bias is None else bias.contiguous())
    _set_backend(_path_backend(path))


@torch.library.custom_op("qerl::linear", mutates_args=())
def _linear_op(x: torch.Tensor, qweight: torch.Tensor, global_scale: torch.Tensor, n: int, k: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    _check_packed(qweight, global_scale, n, k)
    _check_act(x, k, "x", qweight)
    _check_bias(bias, x, n)
    x2 = x.reshape(-1, k)
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    _linear_into(x2, qweight, global_scale, n, k, out, bias)
    return out.reshape(*x.shape[:-1], n)


@_linear_op.register_fake
def _(x, qweight, global_scale, n, k, bias=None):
    _check_packed(qweight, global_scale, n, k)
    _check_act(x, k, "x", qweight)
    _check_bias(bias, x, n)
    return x.new_empty(*x.shape[:-1], n)


@torch.library.custom_op("qerl::linear_out", mutates_args=("out",))
def _linear_out_op(x: torch.Tensor, qweight: torch.Tensor, global_scale: torch.Tensor, n: int, k: int,
                   out: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    _check_packed(qweight, global_scale, n, k)
    _check_act(x, k, "x", qweight)
    _check_bias(bias, x, n)
    expect = (*x.shape[:-1], n)
    if tuple(out.shape) != expect or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {x.dtype} tensor of shape {expect} on {x.device}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    _linear_into(x.reshape(-1, k), qweight, global_scale, n, k, out.view(-1, n), bias)


@_linear_out_op.register_fake
def _(x, qweight, global_scale, n, k, out, bias=None):
    _check_packed(qweight, global_scale, n, k)
    _check_act(x, k, "x", qweight)
    _check_bias(bias, x, n)
    if tuple(out.shape) != (*x.shape[:-1], n):
        raise ValueError(f"out must have shape {(*x.shape[:-1], n)}, got {tuple(out.shape)}")


@torch.library.custom_op("qerl::linear_t", mutates_args=())
def _linear_t_op(g: torch.Tensor, qweight: torch.Tensor, global_scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    _check_packed(qweight, global_scale, n, k)
    _check_act(g, n, "g", qweight)
    g2 = g.reshape(-1, n)
    ext = _use_kernel(g2) if g2.dtype in _DEQUANT_KERNEL_DTYPES or g2.device.type != "cuda" else None
    if ext is None:
        w = layout.dequantize(qweight, global_scale, n, k, torch.float32)
        out = (g2.float() @ w).to(g.dtype)
        _set_backend(BACKEND_REFERENCE)
    else:
        out = torch.empty(g2.shape[0], k, dtype=g.dtype, device=g.device)
        if g2.shape[0]:
            ext.linear_t_out(g2.contiguous(), qweight.contiguous(), _gs(global_scale), n, k, out)
        _set_backend(BACKEND_DEQUANT)
    return out.reshape(*g.shape[:-1], k)


@_linear_t_op.register_fake
def _(g, qweight, global_scale, n, k):
    _check_packed(qweight, global_scale, n, k)
    _check_act(g, n, "g", qweight)
    return g.new_empty(*g.shape[:-1], k)


@torch.library.custom_op("qerl::dequantize", mutates_args=())
def _dequantize_op(qweight: torch.Tensor, global_scale: torch.Tensor, n: int, k: int,
                   dtype: torch.dtype) -> torch.Tensor:
    _check_packed(qweight, global_scale, n, k)
    ext = _use_kernel(qweight) if dtype in _DEQUANT_KERNEL_DTYPES else None
    if ext is None:
        _set_backend(BACKEND_REFERENCE)
        return layout.dequantize(qweight, global_scale, n, k, dtype)
    out = torch.empty(n, k, dtype=dtype, device=qweight.device)
    ext.dequantize_out(qweight.contiguous(), _gs(global_scale), n, k, out)
    _set_backend(BACKEND_KERNEL)
    return out


@_dequantize_op.register_fake
def _(qweight, global_scale, n, k, dtype):
    _check_packed(qweight, global_scale, n, k)
    return qweight.new_empty(n, k, dtype=dtype)


@torch.library.custom_op("qerl::dequantize_many", mutates_args=())
def _dequantize_many_op(qweights: list[torch.Tensor], global_scales: list[torch.Tensor], ns: list[int],
                        ks: list[int]) -> torch.Tensor:
    if not (len(qweights) == len(global_scales) == len(ns) == len(ks)) or not qweights:
        raise ValueError(f"dequantize_many needs one or more weights with as many scales, row and column counts, "
                         f"got {len(qweights)}, {len(global_scales)}, {len(ns)}, {len(ks)}")
    for q, g, n, k in zip(qweights, global_scales, ns, ks):
        _check_packed(q, g, n, k)
    dev = qweights[0].device
    if any(q.device != dev for q in qweights):
        raise ValueError("dequantize_many: the weights lie on different devices")
    ext = _use_kernel(qweights[0])
    if ext is None:
        _set_backend(BACKEND_REFERENCE)
        return torch.cat([layout.dequantize(q, g, n, k, torch.bfloat16).reshape(-1)
                          for q, g, n, k in zip(qweights, global_scales, ns, ks)])
    out = torch.empty(sum(n * k for n, k in zip(ns, ks)), dtype=torch.bfloat16, device=dev)
    ext.dequantize_many_out([q.contiguous() for q in qweights], [_gs(g) for g in global_scales],
                            [int(n) for n in ns], [int(k) for k in ks], out)
    _set_backend(BACKEND_KERNEL)
    return out


@_dequantize_many_op.register_fake
def _(qweights, global_scales, ns, ks):
    for q, g, n, k in zip(qweights, global_scales, ns, ks):
        _check_packed(q, g, n, k)
    return qweights[0].new_empty(sum(n * k for n, k in zip(ns, ks)), dtype=torch.bfloat16)


# autograd: d(x @ W^T)/dx = grad @ W and d(g @ W)/dg = g' @ W^T; the packed weight and its scale are frozen
def _linear_setup(ctx, inputs, output):
    qweight, global_scale, n, k = inputs[1:5]
    ctx.save_for_backward(qweight, global_scale)
    ctx.n, ctx.k = n, k


def _linear_backward(ctx, grad):
    qweight, global_scale = ctx.saved_tensors
    gx = torch.ops.qerl.linear_t(grad.contiguous(), qweight, global_scale, ctx.n, ctx.k) \
        if ctx.needs_input_grad[0] else None
    return gx, None, None, None, None, None  # the bias is frozen with the weight


_linear_op.register_autograd(_linear_backward, setup_context=_linear_setup)


def _linear_t_backward(ctx, grad):
    qweight, global_scale = ctx.saved_tensors
    gg = torch.ops.qerl.linear(grad.contiguous(), qweight, global_scale, ctx.n, ctx.k) \
        if ctx.needs_input_grad[0] else None
    return gg, None, None, None, None


_linear_t_op.register_autograd(_linear_t_backward, setup_context=_linear_setup)  # same saved state


# --------------------------------------------------------------------------------------------- API
def linear(x: torch.Tensor, qweight: torch.Tensor, global_scale: torch.Tensor, n: int, k: int, *,
           out: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for ``x [..., k]``: ``[..., n]`` in ``x.dtype`` (fp32 accumulation).

    ``bias`` (``[n]``, frozen: no gradient) is added after the product is rounded to ``x.dtype``, exactly as
    ``linear(x, ...) + bias`` would, but inside the kernel's epilogue (one launch fewer). With ``out``
    (contiguous, ``[..., n]``, ``x.dtype``) the result is written there and ``out`` returned (no autograd
    through that form)."""
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    if out is None:
        return torch.ops.qerl.linear(x, qweight, global_scale, int(n), int(k), bias)
    torch.ops.qerl.linear_out(x, qweight, global_scale, int(n), int(k), out, bias)
    return out


def takes_lora(m: int, n: int, k: int) -> bool:
    """Whether :func:`linear_lora` runs bf16 ``x`` of ``m`` rows against an ``[n, k]`` weight on this process's
    settings (at most ``LORA_MAX_ROWS`` rows on a small-M kernel, not the dequantize path); False without the
    extension. The term's own shapes are checked by :func:`linear_lora` itself."""
    ext = _load() if torch.cuda.is_available() else None
    if ext is None or not 1 <= m <= LORA_MAX_ROWS:
        return False
    return ext.choose_path(int(m), int(n), int(k)) == 0


def linear_lora(x: torch.Tensor, qweight: torch.Tensor, global_scale: torch.Tensor, n: int, k: int,
                hs: torch.Tensor, bs: torch.Tensor, segs: tuple[int, ...] = (), *,
                bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """``x @ W^T (+ bias) + hs @ bs`` for bf16 CUDA ``x [M, k]`` in one launch of the small-M kernel: the LoRA
    term of a decode step inside the NVFP4 product (no separate expand kernel). ``hs [M, R]``: the shrink
    ``bf16(x @ A^T)``, as fp32 holding bf16 values (``fused.add_norm_shrink``, ``fused.silu_mul_shrink``,
    ``fused.lora_shrink``) or as bf16 (a matmul's output); ``bs [R, n]`` bf16 (``B^T`` times the scaling, block-diagonal for a fused group with
    ``segs`` as in ``fused.lora_add``). Base and term are summed in fp32 and rounded to bf16 once, then the bias is
    added and rounded (the separate expand rounds the base, and the bias, first: the two differ by those
    roundings, half a bf16 unit of the base and of each result). No autograd (no-grad decode only). ``out``: a
    contiguous ``[M, n]`` bf16 tensor to write (else a new one).

    Every small-M kernel takes the term (``nvfp4_mma_kernel`` into its last K split's partial, the stream-K
    ``v2``/``v2w8`` into the partial of the CTA that ends a row group's K range). None, with nothing computed,
    where no small-M kernel would run the product (CPU, no extension, the dequantize + cuBLAS path, more than
    ``LORA_MAX_ROWS`` rows) or the term is outside what it takes (members not 16-row aligned, rank ranges not
    multiples of 16, more than 8 members): the caller adds the term itself."""
    if not (x.is_cuda and x.dim() == 2 and x.dtype == torch.bfloat16) or torch.is_grad_enabled():
        return None
    ext = _load()
    if ext is None:
        return None
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    _check_packed(qweight, global_scale, n, k)
    _check_act(x, k, "x", qweight)
    _check_bias(bias, x, n)
    if out is None:
        out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if not ext.linear_lora_out(x, qweight.contiguous(), _gs(global_scale), int(n), int(k), out,
                               None if bias is None else bias.contiguous(), hs, bs, [int(v) for v in segs]):
        return None
    _set_backend(BACKEND_KERNEL)
    return out


def linear_silu(x: torch.Tensor, qweight: torch.Tensor, global_scale: torch.Tensor, n: int, k: int,
                hs: torch.Tensor | None = None, bs: torch.Tensor | None = None, segs: tuple[int, ...] = ()
                ) -> torch.Tensor | None:
    """``silu(x @ Wg^T) * (x @ Wu^T)`` for a fused gate/up weight of ``n`` rows (gate rows first, up rows from
    ``n / 2``) and bf16 CUDA ``x [M, k]``: ``[M, n / 2]`` from one launch of the stream-K kernel in pair mode
    (its row groups hold gate block j and up block j side by side and write the SwiGLU activation instead of the
    product): ``fused.silu_mul`` on the halves of ``linear(x, ...)`` up to the fp32 summation order of the rows
    the stream-K split cuts between blocks (bit-identical to the route through the v2w8 or v2w10 product of the
    block-interleaved weight, whose split it shares) — one launch and the ``[M, n]`` intermediate fewer per
    decode step. None, with nothing computed, where it would not be the kernel
    ``linear`` runs there (no-grad only; CPU, no extension, a variant other than ``v2w8`` / ``v2w10`` chosen or forced for
    the shape, the dequantize path, more than 64 rows, ``n`` not a multiple of 32): the caller then takes the
    two-kernel route. ``hs, bs, segs``: a LoRA term of the gate/up group as ``linear_lora`` takes it (``bs``
    columns in the weight's row order, gate rows first), added to each row in fp32 before the SiLU; None where
    the kernel does not take the term either."""
    if not (x.is_cuda and x.dim() == 2 and x.dtype == torch.bfloat16) or torch.is_grad_enabled():
        return None
    if (hs is None) != (bs is None):
        raise ValueError("linear_silu: hs and bs come together (a LoRA term) or not at all")
    ext = _load()
    m = x.shape[0]
    if ext is None or not 1 <= m <= 64 or n % 32 != 0 or ext.choose_path(int(m), int(n), int(k)) != 0:
        return None
    code = int(ext.get_variant())
    code = int(ext.auto_variant(int(m), int(n), int(k))) if code == VARIANTS["auto"] else code
    if code not in (VARIANTS["v2w8"], VARIANTS["v2w10"]):  # (the pair mode has 8- and 10-warp instances)
        return None
    _check_packed(qweight, global_scale, n, k)
    _check_act(x, k, "x", qweight)
    out = torch.empty(m, n // 2, dtype=x.dtype, device=x.device)
    if not ext.linear_silu_out(x, qweight.contiguous(), _gs(global_scale), int(n), int(k), out, hs, bs,
                               [int(v) for v in segs]):
        return None
    _set_backend(BACKEND_KERNEL)
    return out


def linear_t(g: torch.Tensor, qweight: torch.Tensor, global_scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """``g @ W`` for ``g [..., n]``: ``[..., k]`` in ``g.dtype`` (the input gradient of :func:`linear`)."""
    return torch.ops.qerl.linear_t(g, qweight, global_scale, int(n), int(k))


def dequantize(qweight: torch.Tensor, global_scale: torch.Tensor, n: int, k: int,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dense ``[n, k]`` weight; bit-exact with :func:`layout.dequantize` (fp32 math, one rounding)."""
    return torch.ops.qerl.dequantize(qweight, global_scale, int(n), int(k), dtype)


def dequantize_many(weights: list[tuple[torch.Tensor, torch.Tensor, int, int]]) -> list[torch.Tensor]:
    """Dense bf16 ``[n, k]`` weights of several packed ones ``(qweight, global_scale, n, k)``, each bit-exact with
    :func:`dequantize`: views into one buffer, written by one kernel launch per 8 weights on CUDA (the engine's
    batched steps dequantize a layer's projections at once, session 33). The blocks follow one another, so a block
    is 256-byte aligned (as a fresh tensor is, and cuBLAS's choice of kernel for a product with it may depend on
    that) where the blocks before it hold multiples of 128 weights, as the projections of real models do."""
    if not weights:
        return []
    q, g, ns, ks = zip(*weights)
    flat = torch.ops.qerl.dequantize_many(list(q), list(g), [int(n) for n in ns], [int(k) for k in ks])
    out, at = [], 0
    for n, k in zip(ns, ks):
        out.append(flat[at: at + n * k].view(n, k))
        at += n * k
    return out


def path(m: int, n: int, k: int) -> str | None:
    """The backend :func:`linear` takes for bf16 CUDA ``x`` of ``m`` rows and an ``[n, k]`` weight on this
    process's settings (``BACKEND_KERNEL``, ``BACKEND_TILED`` or ``BACKEND_DEQUANT``); None without the extension."""
    ext = _load() if torch.cuda.is_available() else None
    if ext is None:
        return None
    return _path_backend(ext.choose_path(int(m), int(n), int(k)))
