"""Where a small-M NVFP4 launch spends its time: per-CTA timestamps of the mma kernels, in a chain and in a decode step.

    QERL_KERNEL_TIMELINE=1 is set by this script: it builds the probe extension (qerl_nvfp4_tl, -DQERL_TIMELINE),
    in which thread 0 of every CTA of the small-M kernels stamps %globaltimer at entry, when its PDL wait returns,
    when its K loop ends and when it leaves (after its split-K share), one 128-byte record per CTA (the stream-K
    kernel adds its first segment's loop end, its last ticket and sum, and its units).

    python benchmarks/probe_timeline.py [--json benchmarks/results/timeline.json] [--ms 1,8] [--skip-engine]

(a) Chains: for each Qwen2.5-7B projection shape and M, a CUDA graph of CALLS back-to-back ``kernel.linear``
    launches, each on its own weight copy (as bench_kernel.py times them); per launch, relative to the end of the
    launch before (its last CTA's exit): when its first CTA started, when its first / median PDL wait returned,
    when its CTAs finished their K loops (first, median, last) and when its last CTA left.
(b) A decode step of the 7B-shape NVFP4 engine at batch 8 (CUDA graph, random weights): the same per projection
    launch of every layer, where the time between a projection's wait and the end of the projection before it is
    what the kernels between them (norms, rotary, attention, SiLU·mul) and their launches took.
Times are medians over launches, in µs. The timer's granularity (smallest step seen) is printed with them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
from pathlib import Path

os.environ["QERL_KERNEL_TIMELINE"] = "1"  # before qerl_cli.kernel loads its extension

import numpy as np  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))
from qerl_cli import kernel  # noqa: E402

REC = np.dtype([("tag", "<u8"), ("qw", "<u8"), ("t_entry", "<u8"), ("t_wait", "<u8"), ("t_loop", "<u8"),
                ("t_exit", "<u8"), ("block", "<u4"), ("grid", "<u4"), ("smid", "<u4"), ("flags", "<u4"),
                ("t_loop0", "<u8"), ("t_ticket", "<u8"), ("t_sum", "<u8"), ("units0", "<u4"), ("units", "<u4"),
                ("nseg", "<u4"), ("pad", "<u4"), ("pad2", "<u8", (3,))])
assert REC.itemsize == 128
SHAPES_7B = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
NAME_OF = {(n << 32) | k: name for name, (n, k) in SHAPES_7B.items()}


def name_of(tag: int) -> str:
    return NAME_OF.get(tag, f"{tag >> 32}x{tag & 0xFFFFFFFF}")


class Timeline:
    def __init__(self, ext, records: int = 1 << 20):
        self.ext = ext
        self.buf = torch.zeros(records * REC.itemsize, dtype=torch.uint8, device="cuda")

    def __enter__(self):
        torch.cuda.synchronize()
        self.ext.set_timeline(self.buf)
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize()
        self.n = self.ext.timeline_count()
        self.ext.set_timeline(torch.empty(0, dtype=torch.uint8, device="cuda"))
        cap = self.buf.numel() // REC.itemsize
        if self.n > cap:
            print(f"probe_timeline: {self.n - cap} records dropped (buffer of {cap})", file=sys.stderr)
        self.recs = np.frombuffer(self.buf[: min(self.n, cap) * REC.itemsize].cpu().numpy().tobytes(), dtype=REC)
        return False


def launches(recs: np.ndarray) -> list[dict]:
    """Records grouped into launches by (shape, weight address), split where one address recurs (a later step),
    ordered by their first CTA's start; times in ns."""
    out = []
    keys = np.unique(recs[["tag", "qw"]])
    for key in keys:
        r = recs[(recs["tag"] == key["tag"]) & (recs["qw"] == key["qw"])]
        r = r[np.argsort(r["t_entry"])]
        grid = int(r["grid"][0])
        for i in range(0, len(r) - grid + 1, grid):  # each launch has `grid` CTAs; entries of one launch come first
            g = r[i:i + grid]
            waits = np.sort(g["t_wait"][g["t_wait"] > 0])
            loops = np.sort(g["t_loop"][g["t_loop"] > 0])
            out.append({"tag": int(key["tag"]), "qw": int(key["qw"]), "grid": grid, "first_entry": int(g["t_entry"].min()),
                        "last_entry": int(g["t_entry"].max()),
                        "first_wait": int(waits[0]) if len(waits) else 0,
                        "median_wait": int(np.median(waits)) if len(waits) else 0,
                        "first_loop": int(loops[0]) if len(loops) else 0,
                        "median_loop": int(np.median(loops)) if len(loops) else 0,
                        "last_loop": int(loops[-1]) if len(loops) else 0,
                        "last_exit": int(g["t_exit"].max()), "sms": int(len(np.unique(g["smid"]))),
                        **mid_sums(g),
                        "flags": sorted({int(f) for f in g["flags"]})})
    return sorted(out, key=lambda d: d["first_entry"])


def last_launches(recs: np.ndarray) -> np.ndarray:
    """The records of every (shape, weight address)'s last launch: in a decode step's recording, its last step."""
    keep = []
    for key in np.unique(recs[["tag", "qw"]]):
        r = recs[(recs["tag"] == key["tag"]) & (recs["qw"] == key["qw"])]
        r = r[np.argsort(r["t_entry"])]
        grid = int(r["grid"][0])
        n = len(r) // grid
        keep.append(r[(n - 1) * grid:n * grid])
    return np.concatenate(keep) if keep else recs[:0]


def mid_sums(g: np.ndarray) -> dict:
    """Stream-K launches (flags >= 16): how many blocks summed a row group before their last segment (flag bit 32),
    and what share of the latest tenth of K-loop ends those blocks make (is a mid-kernel sum what makes them late?)."""
    if not (g["flags"] >= 16).all():
        return {"mid_sum_blocks": 0, "late_mid_share": 0.0}
    mid = (g["flags"] & 32) != 0
    late = g["t_loop"] >= np.quantile(g["t_loop"], 0.9)
    return {"mid_sum_blocks": int(mid.sum()), "late_mid_share": float(mid[late].mean()) if late.any() else 0.0}


RAW: dict[str, np.ndarray] = {}  # every recorded launch set, for --raw (offline analysis)


def stragglers(recs: np.ndarray) -> dict:
    """Stream-K chain launches: the latest tenth of K-loop ends against the rest (medians, µs relative to each launch's
    median K-loop end): their PDL wait and first-segment end, whether their SM's other CTA is late too, and how
    often an SM is among the late ones in several launches (a structural cause: its GPC or memory path)."""
    out = {"late_wait": [], "rest_wait": [], "late_loop0": [], "rest_loop0": [], "pair_late": [], "sm_hits": {}}
    for key in np.unique(recs[["tag", "qw"]]):
        r = recs[(recs["tag"] == key["tag"]) & (recs["qw"] == key["qw"])]
        r = r[np.argsort(r["t_entry"])]
        grid = int(r["grid"][0])
        for i in range(0, len(r) - grid + 1, grid):
            g = r[i:i + grid]
            if not (g["flags"] >= 16).all() or (g["t_loop0"] == 0).any():
                continue
            med = float(np.median(g["t_loop"]))
            late = g["t_loop"] >= np.quantile(g["t_loop"], 0.9)
            rel = lambda f: (g[f].astype(np.float64) - med) / 1e3  # noqa: E731
            out["late_wait"].append(float(np.median(rel("t_wait")[late])))
            out["rest_wait"].append(float(np.median(rel("t_wait")[~late])))
            out["late_loop0"].append(float(np.median(rel("t_loop0")[late])))
            out["rest_loop0"].append(float(np.median(rel("t_loop0")[~late])))
            late_sms = g["smid"][late]
            out["pair_late"].append(float(np.mean([np.sum(late_sms == sm) > 1 for sm in late_sms])))
            for sm in late_sms:
                out["sm_hits"][int(sm)] = out["sm_hits"].get(int(sm), 0) + 1
    if not out["late_wait"]:
        return {}
    hits = sorted(out["sm_hits"].values(), reverse=True)
    return {k: statistics.median(v) for k, v in out.items() if k != "sm_hits"} | {
        "launches": len(out["late_wait"]), "late_sms": len(hits), "top_sm_hits": hits[:8]}


def phases(seq: list[dict]) -> list[dict]:
    """Each launch after the first, relative to the previous launch's last exit (µs)."""
    rows = []
    for prev, cur in zip(seq, seq[1:]):
        e = prev["last_exit"]
        rows.append({"tag": cur["tag"], "grid": cur["grid"], "sms": cur["sms"], "flags": cur["flags"],
                     "mid_sum_blocks": cur["mid_sum_blocks"], "late_mid_share": cur["late_mid_share"],
                     "start": (cur["first_entry"] - e) / 1e3, "all_started": (cur["last_entry"] - e) / 1e3,
                     "wait": (cur["first_wait"] - e) / 1e3, "median_wait": (cur["median_wait"] - e) / 1e3,
                     "first_loop": (cur["first_loop"] - e) / 1e3, "median_loop": (cur["median_loop"] - e) / 1e3,
                     "last_loop": (cur["last_loop"] - e) / 1e3, "exit": (cur["last_exit"] - e) / 1e3})
    return rows


COLS = ["start", "all_started", "wait", "median_wait", "first_loop", "median_loop", "last_loop", "exit"]


def summary(rows: list[dict]) -> dict:
    return {c: statistics.median(r[c] for r in rows) for c in COLS} | {
        "grid": rows[0]["grid"], "sms": statistics.median(r["sms"] for r in rows), "n": len(rows),
        "mid_sum_blocks": statistics.median(r["mid_sum_blocks"] for r in rows),
        "late_mid_share": statistics.median(r["late_mid_share"] for r in rows),
        "flags": sorted({f for r in rows for f in r["flags"]})}


def granularity(recs: np.ndarray) -> float:
    t = np.unique(np.concatenate([recs["t_entry"], recs["t_exit"]]))
    d = np.diff(t)
    return float(d[d > 0].min()) if len(d) and (d > 0).any() else float("nan")


def print_row(label: str, s: dict) -> None:
    print(f"{label:<22} grid {s['grid']:>4} sms {s['sms']:>5.0f} | " + " ".join(f"{s[c]:7.2f}" for c in COLS)
          + f" | flags {s['flags']} mid-sum blocks {s['mid_sum_blocks']:.0f} (late tenth {s['late_mid_share']:.0%})",
          flush=True)


def header() -> None:
    print(f"{'':<22} {'':>9} {'':>9} | " + " ".join(f"{c[:7]:>7}" for c in COLS), flush=True)


def chains(ext, ms: list[int], calls: int, result: dict, key: str = "chains", only: tuple[str, ...] = ()) -> None:
    from bench_kernel import capture_graph, random_packed

    gen = torch.Generator(device="cuda").manual_seed(0)
    print("(a) chains of back-to-back launches, µs after the previous launch's last exit (median over launches)")
    header()
    for name, (n, k) in SHAPES_7B.items():
        if only and name not in only:
            continue
        qws = [random_packed(n, k, gen) for _ in range(calls)]
        gs = torch.tensor([2000.0], device="cuda")
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(calls)]

            def fn(i):
                ext.linear_out(x, qws[i], gs, n, k, outs[i], -1)

            g = capture_graph(fn, calls, calls)  # (every launch its own weight copy)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            g.replay()
            e1.record()
            e1.synchronize()
            per_call = e0.elapsed_time(e1) * 1e3 / calls
            with Timeline(ext) as tl:
                g.replay()
            seq = launches(tl.recs)
            rows = phases(seq)
            s = summary(rows) | {"shape": name, "m": m, "graph_us_per_call_untimed": per_call,
                                 "timer_step_ns": granularity(tl.recs), "variant": int(ext.auto_variant(m, n, k)),
                                 "stragglers": stragglers(tl.recs)}
            result.setdefault(key, []).append(s)
            RAW[f"{key}_{name}_m{m}"] = tl.recs.copy()
            print_row(f"{name} M={m} ({per_call:.1f}/call)", s)
            if s["stragglers"]:
                st = s["stragglers"]
                print(f"{'':<22} late tenth vs rest (µs from the median loop end): wait {st['late_wait']:.2f} / "
                      f"{st['rest_wait']:.2f}, first-segment end {st['late_loop0']:.2f} / {st['rest_loop0']:.2f}; "
                      f"SM's other CTA late too {st['pair_late']:.0%}; {st['late_sms']} SMs late over "
                      f"{st['launches']} launches, most often {st['top_sm_hits']}", flush=True)
            del g
        qws.clear()
        gc.collect()
        torch.cuda.empty_cache()
    print(f"timer step seen: {min(c['timer_step_ns'] for c in result[key]):.0f} ns")


def engine_step(ext, batch: int, result: dict) -> None:
    from bench_rollout import prompts, qwen7b_config, random_model

    from qerl_cli.engine import Engine, SamplingConfig
    from qerl_cli.packed_model import pack_model_inplace

    model = pack_model_inplace(random_model(qwen7b_config()))
    gc.collect()
    torch.cuda.empty_cache()
    eng = Engine(model, "cuda", cuda_graph=True)
    ps = prompts(batch, 256, 152064)
    eng.generate(ps, 1, SamplingConfig(temperature=1.0, max_new_tokens=8), 0, set(), 0)
    torch.cuda.synchronize()
    with Timeline(ext) as tl:
        b = eng.generate(ps, 1, SamplingConfig(temperature=1.0, max_new_tokens=4), 1, set(), 0)
    seq = launches(tl.recs)
    RAW["engine_step_last"] = last_launches(tl.recs)  # (the last recorded step: every weight's last launch)
    # the decode steps: every packed weight once per step; keep the last full step
    per_step = len({(d["tag"], d["qw"]) for d in seq})
    steps = len(seq) // per_step
    step = seq[(steps - 1) * per_step: steps * per_step]
    rows = phases(step)
    print(f"(b) decode step of the 7B-shape engine at batch {batch} ({steps} steps recorded, last one shown; "
          f"graph step {1e3 * b.timings['decode_s'] / max(1, b.timings['decode_steps']):.2f} ms): "
          f"µs after the previous projection's last exit")
    header()
    out = {"batch": batch, "steps_recorded": steps, "timer_step_ns": granularity(tl.recs),
           "step_span_us": (step[-1]["last_exit"] - step[0]["first_entry"]) / 1e3}
    for name in dict.fromkeys(name_of(r["tag"]) for r in rows):
        rs = [r for r in rows if name_of(r["tag"]) == name]
        if rs:
            s = summary(rs)
            out[name] = s
            print_row(f"{name} (x{len(rs)})", s)
    proj = sum(r["exit"] - r["wait"] for r in rows) + (step[0]["last_exit"] - step[0]["first_wait"]) / 1e3
    between = sum(r["wait"] for r in rows)
    out["projections_wait_to_exit_us"] = proj
    out["between_projections_us"] = between
    print(f"step span (first qkv start to last down exit) {out['step_span_us']:.0f} µs: projections (wait -> last "
          f"exit) {proj:.0f} µs, between projections (previous exit -> wait) {between:.0f} µs", flush=True)
    result["engine_step"] = out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "timeline.json")
    ap.add_argument("--ms", default="1,8")
    ap.add_argument("--calls", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--no-pdl-ms", default="8", help="the chains again at these M with PDL off ('' for none)")
    ap.add_argument("--grids", default="", help="the gate/up and down chains at M = 8 again with the stream-K kernel's "
                    "CTA count forced to each of these (comma-separated)")
    ap.add_argument("--raw", type=Path, default=None, help="every record, per chain and for the step, to this .npz")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_timeline: needs a CUDA device", file=sys.stderr)
        return 2
    ext = kernel._load()
    if ext is None or not hasattr(ext, "set_timeline"):
        print(f"probe_timeline: the timeline build is unavailable: {kernel.build_error()}", file=sys.stderr)
        return 2
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "pdl": bool(ext.get_pdl())}
    try:
        chains(ext, [int(v) for v in args.ms.split(",")], args.calls, result)
        if args.no_pdl_ms:
            ext.set_pdl(False)
            try:
                print("PDL off:")
                chains(ext, [int(v) for v in args.no_pdl_ms.split(",")], args.calls, result, "chains_no_pdl")
            finally:
                ext.set_pdl(True)
        for p in [int(v) for v in args.grids.split(",") if v]:
            ext.set_v2_grid(p)
            try:
                print(f"stream-K grid forced to {p}:")
                chains(ext, [8], args.calls, result, f"chains_grid{p}", only=("gate_up", "down"))
            finally:
                ext.set_v2_grid(0)
        if not args.skip_engine:
            engine_step(ext, args.batch, result)
    finally:
        if args.raw is not None and RAW:
            args.raw.parent.mkdir(parents=True, exist_ok=True)
            np.savez_compressed(args.raw, **RAW)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
