"""Rollout throughput and correctness on the GPU: our engine (NVFP4 packed and bf16) vs HF generate (bf16).

    python benchmarks/bench_rollout.py [--smollm2 /root/smol/smol.gguf] [--json benchmarks/results/rollout_h200.json]

(a) SmolLM2-135M-Instruct (real weights if --smollm2 points at the GGUF, else random weights at its shapes):
    batch 64 and 256, 128-token prompts, 256 new tokens (eos ignored), temperature 1.
(b) A random-weight model with Qwen2.5-7B shapes (from a config, no download): batch 8 and 64, 256-token
    prompts, 512 new tokens (eos ignored).
Plus correctness: greedy match rate of our engine vs HF generate on the same dequantized NVFP4 weights over
the first 32 tokens (SmolLM2), CUDA-graph vs eager greedy tokens, and the largest |behaviour - teacher-forced|
log-prob gap in bf16. Peak memory is torch.cuda.max_memory_allocated per run; resident weight bytes are
counted from the model's tensors.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from qerl_cli.engine import PROJECTIONS, Engine, LoRA, SamplingConfig
from qerl_cli.packed_model import PackedLinear, pack_model_inplace

REPO = Path(__file__).resolve().parents[1]


def smollm2_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, rms_norm_eps=1e-5,
                       rope_theta=100000.0, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
                       pad_token_id=2)


def qwen7b_config():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False, rms_norm_eps=1e-6,
                       rope_theta=1e6, max_position_embeddings=32768, eos_token_id=151645, pad_token_id=151643)


def random_model(conf, dtype=torch.bfloat16):
    from transformers import AutoModelForCausalLM

    with torch.device("cuda"):
        m = AutoModelForCausalLM.from_config(conf, dtype=dtype)
    return m.eval()


def weight_bytes(model) -> dict:
    packed = sum(m.qweight.numel() + m.global_scale.numel() * 4 for m in model.modules() if isinstance(m, PackedLinear))
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    qw = sum(m.out_features * m.in_features for m in model.modules() if isinstance(m, PackedLinear))
    return {"packed_bytes": packed, "dense_bytes": dense, "quantized_weights": qw,
            "packed_bytes_per_quantized_weight": packed / qw if qw else None}


def prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (batch, length), generator=g).tolist()


def random_lora(model, rank: int) -> LoRA:
    """A rank-``rank`` adapter on every projection (random factors: speed does not depend on their values)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    factors = {}
    for i, layer in enumerate(model.model.layers):
        for name in PROJECTIONS:
            lin = layer.get_submodule(name)
            factors[f"model.layers.{i}.{name}"] = (
                torch.randn(rank, lin.in_features, device="cuda", generator=g, dtype=torch.bfloat16) * 0.01,
                torch.randn(lin.out_features, rank, device="cuda", generator=g, dtype=torch.bfloat16) * 0.01)
    return LoRA(factors, scaling=2.0)


def time_engine(model, batch, p_len, new, vocab, graph=True, lora_rank=0, batch_lora=True, lora_kernels=True,
                sigma=0.0, noise_scope="batch", fused_shrink=True, fused_sampler=True, lora_in_kernel=True,
                decode_attn=None, silu_in_kernel=None, rope_in_attn=None, silu_lora_in_kernel=None,
                keep_graph=True, dequant_layer=None, attend_buckets=None, **engine_kw) -> dict:
    eng = Engine(model, "cuda", cuda_graph=graph, **engine_kw)
    if dequant_layer is not None:  # (None: the engine's default)
        eng.dequant_layer = dequant_layer
    if attend_buckets is not None:  # (None: the engine's default)
        eng.attend_buckets = attend_buckets
    # keep_graph (the engine's default since session 25): the timed call, of the warm-up's shapes, replays the
    # warm-up's decode graph; False: it captures its own (two warm-up steps + a capture inside its decode time)
    eng.keep_graph = keep_graph
    if silu_lora_in_kernel is not None:  # (None: the engine's default)
        eng.silu_lora_in_kernel = silu_lora_in_kernel
    if rope_in_attn is not None:  # (None: the engine's default)
        eng.rope_in_attn = rope_in_attn
    if silu_in_kernel is not None:  # (None: the engine's default)
        eng.silu_in_kernel = silu_in_kernel
    if decode_attn is not None:  # (None: the engine's default)
        eng.decode_attn = decode_attn
    if sigma:  # an AQN draw (fp32 noisy norm scales), per batch or per prompt (each prompt its own group of 1)
        eng.set_noise(sigma, 0, noise_scope, batch if noise_scope == "group" else 1, 1)
    eng.fused_sampler = fused_sampler
    if lora_rank:  # an adapter on every projection, as in training rollouts
        eng.set_adapter(random_lora(model, lora_rank))
        eng.batch_lora = batch_lora
        eng.lora_kernels = lora_kernels
        eng.fused_shrink = fused_shrink
        eng.lora_in_kernel = lora_in_kernel
    ps = prompts(batch, p_len, vocab)
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=new)
    # warm-up on exactly the measured shapes, cache length included: a first call at a new shape pays library
    # plan selection (cuDNN attention plans, cuBLAS heuristics); a warm-up with fewer new tokens (a shorter
    # cache) left 0.67-0.83 s of it inside the timed bf16 prefill, the first engine of the process
    eng.generate(ps, 1, cfg, 0, set(), 0)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    b = eng.generate(ps, 1, cfg, 1, set(), 0)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    toks = int(b.completion_mask.sum())
    return {"tokens": toks, "wall_s": dt, "tokens_per_s": toks / dt, "prefill_s": b.timings["prefill_s"],
            "decode_s": b.timings["decode_s"], "decode_state": b.timings["decode_state"],
            "decode_setup_s": b.timings["decode_setup_s"], "peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30}


def time_hf(model, batch, p_len, new, vocab, device="cuda") -> dict:
    ps = torch.tensor(prompts(batch, p_len, vocab), device=device)
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
              pad_token_id=0)
    # warm-up on exactly the measured shapes, as time_engine's (a first call at a new shape pays library plan
    # selection: a 2-row, 4-token warm-up left it inside HF's timed call only)
    model.generate(ps, **kw)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = model.generate(ps, **kw)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    toks = (out.shape[1] - p_len) * batch
    return {"tokens": toks, "wall_s": dt, "tokens_per_s": toks / dt, "peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30}


def correctness(model, tok_prompts: list[list[int]], eos: int) -> dict:
    eng = Engine(model, "cuda", cuda_graph=True)
    greedy = SamplingConfig(temperature=0, max_new_tokens=32)
    ours = eng.generate(tok_prompts, 1, greedy, 0, {eos}, eos)
    eager = Engine(model, "cuda", cuda_graph=False).generate(tok_prompts, 1, greedy, 0, {eos}, eos)
    match, total, divergences = 0, 0, []
    for i, p in enumerate(tok_prompts):
        r = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=32, do_sample=False, eos_token_id=eos,
                           pad_token_id=eos, output_scores=True, return_dict_in_generate=True)
        ref = r.sequences[0, len(p):].tolist()
        mine = ours.completion_ids[i][ours.completion_mask[i]].tolist()
        n = min(len(ref), len(mine), 32)
        match += sum(a == b for a, b in zip(ref[:n], mine[:n]))
        total += n
        # where the two greedy paths part, and HF's top-1 minus top-2 logit there (a near-tie flips on bf16
        # rounding; once flipped, the rest of the completion differs)
        j = next((k for k in range(n) if ref[k] != mine[k]), None)
        if j is not None:
            top2 = r.scores[j][0].float().topk(2).values
            divergences.append({"prompt": i, "first_divergence": j, "hf_top2_logit_margin": float(top2[0] - top2[1])})
    b = eng.generate(tok_prompts, 4, SamplingConfig(temperature=1.0, max_new_tokens=32), 3, {eos}, eos)
    with torch.no_grad():
        tf = eng.sequence_logprobs(b.prompt_ids, b.completion_ids, b.completion_mask, 1.0, eos, group=4).float().cpu()
    gap = (tf - b.behaviour_logprobs).abs()[b.completion_mask]
    return {"greedy_match_rate_first32_vs_hf": match / max(total, 1), "greedy_divergences": divergences,
            "graph_equals_eager_greedy": bool(torch.equal(ours.completion_ids, eager.completion_ids)),
            "bf16_logprob_gap_max": float(gap.max()), "bf16_logprob_gap_mean": float(gap.mean())}


def _engine_with(model, graph: bool, lora, settings: dict) -> Engine:
    """An engine on ``model`` with the adapter ``lora`` and the attributes of ``settings`` that are not None."""
    eng = Engine(model, "cuda", cuda_graph=graph)
    eng.set_adapter(lora)
    for name, value in settings.items():
        if value is not None:
            setattr(eng, name, value)
    return eng


def _kernel_times(eng: Engine, ps, new: int) -> tuple[dict, dict]:
    """GPU time and launches per kernel name of one profiled generate of ``new`` tokens, and its timings."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        b = eng.generate(ps, 1, SamplingConfig(temperature=1.0, max_new_tokens=new), 1, set(), 0)
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if e.device_type == torch.autograd.DeviceType.CUDA and t:
            kernels[e.key] = {"us_total": t, "calls": e.count}
    return kernels, b.timings


def profile_decode(model, batch: int, p_len: int, vocab: int, new: int = 24, lora_rank: int = 0,
                   decode_attn=None, dequant_layer=None, attend_buckets=None) -> dict:
    """Where a decode step's GPU time goes: torch.profiler over an eager generate of ``new`` tokens (same kernels as
    the graph) minus one of 4 tokens (the prefill and first steps), kernels grouped by name, divided by the decode
    steps between the two (session 33: the prefill's kernels are no longer in the per-step figures; the short run's
    cache has fewer slots, so its 3 steps attend over fewer and the long run's per-step attention comes out a few
    microseconds high); plus the
    CUDA-graph step time over ``new`` tokens for comparison. ``lora_rank``: with an adapter of that rank on every
    projection (the training case). ``decode_attn``, ``dequant_layer``, ``attend_buckets``: the engines' settings
    of those (None: their default)."""
    ps = prompts(batch, p_len, vocab)
    lora = random_lora(model, lora_rank) if lora_rank else None
    settings = {"decode_attn": decode_attn, "dequant_layer": dequant_layer, "attend_buckets": attend_buckets}
    eager = _engine_with(model, False, lora, settings)
    eager.generate(ps, 1, SamplingConfig(temperature=1.0, max_new_tokens=4), 0, set(), 0)
    torch.cuda.synchronize()
    long_k, long_t = _kernel_times(eager, ps, new)
    short_k, short_t = _kernel_times(eager, ps, 4)
    steps = long_t["decode_steps"] - short_t["decode_steps"]
    kernels = {}
    for name, v in long_k.items():
        s = short_k.get(name, {"us_total": 0.0, "calls": 0})
        if v["calls"] > s["calls"]:
            kernels[name] = {"us_total": v["us_total"] - s["us_total"], "calls": v["calls"] - s["calls"]}
    top = sorted(kernels.items(), key=lambda kv: -kv[1]["us_total"])[:25]
    total = sum(v["us_total"] for v in kernels.values())
    graph = _engine_with(model, True, lora, settings)
    graph.generate(ps, 1, SamplingConfig(temperature=1.0, max_new_tokens=new), 0, set(), 0)
    g = graph.generate(ps, 1, SamplingConfig(temperature=1.0, max_new_tokens=new), 1, set(), 0)
    out = {"batch": batch, "prompt": p_len, "new_tokens": new, "lora_rank": lora_rank, **settings, "pdl": _pdl_on(),
           "decode_steps_profiled": steps, "gpu_kernel_us_decode_steps": total,
           "kernel_launches": sum(v["calls"] for v in kernels.values()),
           "eager_decode_ms_per_step": 1e3 * (long_t["decode_s"] - short_t["decode_s"]) / steps,
           "graph_decode_ms_per_step": 1e3 * g.timings["decode_s"] / g.timings["decode_steps"],
           "top_kernels": [{"name": k[:120], **v, "us_per_step": v["us_total"] / steps} for k, v in top]}
    print(f"decode profile b{batch} lora rank {lora_rank}: eager {out['eager_decode_ms_per_step']:.2f} ms/step, graph "
          f"{out['graph_decode_ms_per_step']:.2f} ms/step, {out['kernel_launches'] / steps:.0f} kernels/step")
    for k in out["top_kernels"]:
        print(f"  {k['us_per_step']:9.1f} us/step  {k['calls'] / steps:6.1f} calls/step  {k['name']}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smollm2", type=Path, default=None, help="SmolLM2 GGUF file (real weights)")
    ap.add_argument("--skip-7b", action="store_true")
    ap.add_argument("--skip-smollm2", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="profile the 7B-shape NVFP4 decode step at batch 8 (with --lora-only: with the adapter) and, "
                         "unless --skip-smollm2, the SmolLM2 decode step at batch 256 in bf16 and NVFP4 (without "
                         "programmatic dependent launch), with attention over slot buckets (opt-in) timed against "
                         "the whole cache's, and NVFP4's per-layer dequantize against one launch per projection")
    ap.add_argument("--lora-only", action="store_true",
                    help="7B shapes at batch 8 only: each engine without and with a rank-32 adapter on every "
                         "projection (NVFP4 also with the LoRA terms in cuBLAS matmuls and per member)")
    ap.add_argument("--aqn", action="store_true",
                    help="7B-shape NVFP4 rollouts with an AQN draw: fp32-scale norm kernel against torch norms")
    ap.add_argument("--sampler", action="store_true",
                    help="7B-shape NVFP4 rollouts at batch 8 and 64: the fused sampling kernel against torch's "
                         "sampling ops, interleaved twice (and at batch 8 with a rank-32 adapter)")
    ap.add_argument("--keep-graph", action="store_true",
                    help="only the kept decode graph against a capture per call (7B shapes, batch 8; bf16, NVFP4, "
                         "NVFP4 with a rank-32 adapter), interleaved twice")
    ap.add_argument("--prefetch-arm", type=int, default=0,
                    help="with --keep-graph: also the NVFP4 arms kept with this rolling L2 prefetch distance (tiles)")
    ap.add_argument("--kernel-variants", default=None,
                    help="comma-separated small-M kernel variants (qerl_cli.kernel.VARIANTS): 7B shapes, NVFP4 "
                         "only, batch 8 and 64, each variant forced in turn (one packed model, one process)")
    ap.add_argument("--rl-batches", default=None,
                    help="comma-separated batch sizes (e.g. 8,32,64): 7B shapes, 256 -> 512 tokens, our engine "
                         "bf16 with a rank-32 adapter on every projection, NVFP4 without and with it (terms in the "
                         "kernel against outside, interleaved): the rollout batches of RL (prompts x group)")
    ap.add_argument("--decode-attn", action="store_true",
                    help="7B shapes (NVFP4), 256 -> 512 tokens: decode steps attending with fused.decode_attn "
                         "(PDL trigger early and late) against SDPA, interleaved: batch 8 without and with a rank-32 "
                         "adapter twice each, batch 64 once")
    ap.add_argument("--decode-attn-lora", action="store_true",
                    help="7B shapes (NVFP4), batch 8, rank-32 adapter: decode attention in our kernel against SDPA "
                         "with PDL on and off, interleaved twice, then per-kernel profiles of both without PDL")
    ap.add_argument("--silu-in-kernel", action="store_true",
                    help="7B shapes (NVFP4), 256 -> 512 tokens, batch 8: silu(gate) * up written by the gate/up kernel "
                         "(the default) against the SiLU·mul kernel after it, interleaved three times")
    ap.add_argument("--v2-aligned", action="store_true",
                    help="7B shapes (NVFP4), 256 -> 512 tokens, batch 8: the stream-K kernels' row-group-aligned "
                         "grids (the default) against the default grids, interleaved three times, then once each "
                         "with a rank-32 adapter")
    ap.add_argument("--silu-lora", action="store_true",
                    help="7B shapes (NVFP4), 256 -> 512 tokens, batch 8, rank-32 adapter: the gate/up term inside the "
                         "SiLU·mul pair kernel (the default) against the two kernels, interleaved three times")
    ap.add_argument("--rope-in-attn", action="store_true",
                    help="7B shapes (NVFP4), 256 -> 512 tokens, batch 8: rotary and the cache write inside the decode "
                         "attention kernel (the default) against rope_kv + decode_attn, interleaved three times, "
                         "then a rank-32 adapter with attention in our kernel against SDPA")
    ap.add_argument("--v2-cluster", action="store_true",
                    help="7B shapes (NVFP4), 256 -> 512 tokens, batch 8: the aligned grids' split-K sums through "
                         "thread-block clusters (the default) against the workspace, interleaved twice, then once "
                         "each with a rank-32 adapter")
    ap.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "rollout_h200.json")
    args = ap.parse_args()
    from qerl_cli import fused

    rows, result = [], {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                        "fused_elementwise_kernels": fused.available(), "fused_build_error": fused.build_error()}

    def save():  # after every measurement, so a run cut short still leaves its numbers
        result["runs"] = rows
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(rows[-1]) if rows else "", flush=True)

    # (a) SmolLM2
    base = tok = None
    if args.skip_smollm2:
        pass
    elif args.smollm2 is not None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(args.smollm2.parent), gguf_file=args.smollm2.name)
        base = AutoModelForCausalLM.from_pretrained(str(args.smollm2.parent), gguf_file=args.smollm2.name,
                                                    dtype=torch.bfloat16).cuda().eval()
        from qerl_cli.modelio import fix_special_tokens

        fix_special_tokens(base, tok)
        result["smollm2_weights"] = "real (GGUF)"
    else:
        base, tok = random_model(smollm2_config()), None
        result["smollm2_weights"] = "random at SmolLM2 shapes"
    if not args.skip_smollm2:
        smollm2_part(base, tok, result, rows, save, profile=args.profile)
        base = None

    # (b) Qwen2.5-7B shapes, random weights
    gc.collect()
    torch.cuda.empty_cache()
    if args.aqn:
        aqn_part(result, rows, save)
    elif args.sampler:
        sampler_part(result, rows, save)
    elif args.keep_graph:
        keep_part(rows, save, args.prefetch_arm)
    elif args.kernel_variants:
        variants_part(result, rows, save, [v.strip() for v in args.kernel_variants.split(",") if v.strip()])
    elif args.silu_in_kernel:
        silu_part(rows, save)
    elif args.rope_in_attn:
        rope_attn_part(rows, save)
    elif args.silu_lora:
        silu_lora_part(rows, save)
    elif args.v2_aligned:
        aligned_part(rows, save)
    elif args.v2_cluster:
        aligned_part(rows, save, cluster=True)
    elif args.decode_attn:
        attn_part(rows, save)
    elif args.decode_attn_lora:
        attn_lora_part(result, rows, save)
    elif args.rl_batches:
        rl_part(rows, save, [int(b) for b in args.rl_batches.split(",") if b.strip()])
    elif args.lora_only:
        lora_part(result, rows, save, profile=args.profile)
    elif not args.skip_7b:
        big = random_model(qwen7b_config())
        for batch in (8, 64):
            rows.append({"model": "Qwen2.5-7B-shape", "engine": "ours-bf16", "batch": batch,
                         **time_engine(big, batch, 256, 512, 152064)})
            save()
            rows.append({"model": "Qwen2.5-7B-shape", "engine": "hf-generate-bf16", "batch": batch,
                         **time_hf(big, batch, 256, 512, 152064)})
            save()
        rows.append({"model": "Qwen2.5-7B-shape", "engine": "ours-bf16 no-kernels", "batch": 8,
                     **time_engine(big, 8, 256, 512, 152064, kernels=False)})
        save()
        rows.append({"model": "Qwen2.5-7B-shape", "engine": "ours-bf16 no-PDL", "batch": 8,
                     **without_pdl(lambda: time_engine(big, 8, 256, 512, 152064))})
        save()
        big = pack_model_inplace(big)
        gc.collect()
        torch.cuda.empty_cache()
        result["qwen7b_weight_bytes"] = weight_bytes(big)
        if args.profile:
            _profiled(result, "qwen7b_nvfp4_decode_profile_b8", lambda: profile_decode(big, 8, 256, 152064), save)
        for batch in (8, 64):
            rows.append({"model": "Qwen2.5-7B-shape", "engine": "ours-nvfp4", "batch": batch,
                         **time_engine(big, batch, 256, 512, 152064)})
            save()
        # ablations of the decode step: separate q/k/v and gate/up launches; torch's elementwise ops instead of
        # the fused kernels; those ops compiled
        for name, kw in (("ours-nvfp4 unfused", {"fuse": False}), ("ours-nvfp4 no-kernels", {"kernels": False}),
                         ("ours-nvfp4 +compile", {"compile_elementwise": True})):
            rows.append({"model": "Qwen2.5-7B-shape", "engine": name, "batch": 8,
                         **time_engine(big, 8, 256, 512, 152064, **kw)})
            save()
        rows.append({"model": "Qwen2.5-7B-shape", "engine": "ours-nvfp4 no-PDL", "batch": 8,
                     **without_pdl(lambda: time_engine(big, 8, 256, 512, 152064))})
        save()
    print_table(result, rows)


def keep_part(rows, save, prefetch: int = 0) -> None:
    """Session 25: ``Engine.keep_graph`` (a rollout call of the previous call's shapes replays that call's decode
    graph) against a capture in every call, 7B shapes at batch 8: bf16, then NVFP4 without and with a rank-32
    adapter, each pair interleaved twice in one process. prefetch > 0 (session 29): the NVFP4 arms also run kept
    with the stream-K kernels' rolling L2 prefetch at that distance (``kernel.set_v2_prefetch``), in the same
    rounds."""
    from qerl_cli import kernel

    big = random_model(qwen7b_config())
    for label, kw in (("ours-bf16", {}), ("ours-nvfp4", {}), ("ours-nvfp4 +lora32", {"lora_rank": 32})):
        if label == "ours-nvfp4":
            big = pack_model_inplace(big)
            gc.collect()
            torch.cuda.empty_cache()
        arms = [(True, 0), (False, 0)] + ([(True, prefetch)] if prefetch and "nvfp4" in label else [])
        for _ in range(2):
            for keep, pf in arms:
                kernel.set_v2_prefetch(pf)
                try:
                    r = time_engine(big, 8, 256, 512, 152064, keep_graph=keep, **kw)
                finally:
                    kernel.set_v2_prefetch(0)
                rows.append({"model": "Qwen2.5-7B-shape", "batch": 8, "v2_prefetch": pf,
                             "engine": label + ("" if keep else " capture per call") + (f" L2 prefetch {pf}" if pf else ""),
                             **r})
                save()


def without_pdl(fn):
    """fn() with programmatic dependent launch off (csrc/pdl.cuh; graphs captured inside fn keep it off)."""
    from qerl_cli import kernel

    kernel.set_pdl(False)
    try:
        return fn()
    finally:
        kernel.set_pdl(True)


def aqn_part(result, rows, save) -> None:
    """What an AQN draw costs the 7B-shape NVFP4 rollout at batch 8 and 64: no noise, sigma 1e-3 per batch and per
    prompt with the fused add + RMSNorm kernel reading the fp32 noisy scales, and the same with those norms in
    torch ops (main's fallback before the kernel read fp32 scales)."""
    from qerl_cli import fused

    big = pack_model_inplace(random_model(qwen7b_config()))
    gc.collect()
    torch.cuda.empty_cache()
    kernel_add_norm = fused.add_norm
    for batch in (8, 64):
        rows.append({"model": "Qwen2.5-7B-shape", "engine": "ours-nvfp4", "batch": batch,
                     **time_engine(big, batch, 256, 512, 152064)})
        save()
        for scope in ("batch", "group"):
            for kern in (True, False):
                fused.add_norm = kernel_add_norm if kern else (
                    lambda h, d, w, eps: fused._add_norm_torch(h, d, w, eps) if w.dtype != h.dtype
                    else kernel_add_norm(h, d, w, eps))
                try:
                    r = time_engine(big, batch, 256, 512, 152064, sigma=1e-3, noise_scope=scope)
                finally:
                    fused.add_norm = kernel_add_norm
                rows.append({"model": "Qwen2.5-7B-shape", "batch": batch,
                             "engine": f"ours-nvfp4 AQN {scope} " + ("fp32-scale kernel" if kern else "torch norms"),
                             **r})
                save()


def sampler_part(result, rows, save) -> None:
    """The 7B-shape NVFP4 rollout with the decode step's sampling in the fused kernel (fused.sample_step, the
    default) and in torch's ops, interleaved twice at batch 8 and 64, then both at batch 8 with a rank-32 adapter."""
    big = pack_model_inplace(random_model(qwen7b_config()))
    gc.collect()
    torch.cuda.empty_cache()
    for batch in (8, 64):
        for _ in range(2):
            for fused_sampler in (True, False):
                rows.append({"model": "Qwen2.5-7B-shape", "batch": batch,
                             "engine": "ours-nvfp4 " + ("fused sampler" if fused_sampler else "torch sampler"),
                             **time_engine(big, batch, 256, 512, 152064, fused_sampler=fused_sampler)})
                save()
    for fused_sampler in (True, False):
        rows.append({"model": "Qwen2.5-7B-shape", "batch": 8,
                     "engine": "ours-nvfp4 +lora32 " + ("fused sampler" if fused_sampler else "torch sampler"),
                     **time_engine(big, 8, 256, 512, 152064, lora_rank=32, fused_sampler=fused_sampler)})
        save()


def variants_part(result, rows, save, names: list[str]) -> None:
    """The 7B-shape NVFP4 rollout at batch 8 and 64 under each forced small-M kernel variant (the engine's CUDA
    graphs are captured per run, so each run launches only the variant set before it); the variant in force
    before is restored."""
    from qerl_cli import kernel

    bad = [v for v in names if v not in kernel.VARIANTS]
    if bad:
        raise SystemExit(f"bench_rollout: unknown kernel variant(s) {bad}; known: {sorted(kernel.VARIANTS)}")
    big = pack_model_inplace(random_model(qwen7b_config()))
    gc.collect()
    torch.cuda.empty_cache()
    before = kernel.variant()
    try:
        for batch in (8, 64):
            for v in names:
                kernel.set_variant(v)
                rows.append({"model": "Qwen2.5-7B-shape", "engine": f"ours-nvfp4 kernel={v}", "batch": batch,
                             **time_engine(big, batch, 256, 512, 152064)})
                save()
    finally:
        kernel.set_variant(before)


def lora_part(result, rows, save, profile: bool = False) -> None:
    """Rollout speed with an adapter (the training case): 7B shapes, batch 8, LoRA rank 32 on every projection.
    The default (shrinks fused into the norm and SiLU·mul kernels, the q/k/v and o terms inside the NVFP4 kernel)
    and its A/B partner (every expand its own kernel: session 13's default) run three times, interleaved.
    (Session 13 also timed every shrink on its own and the q/k/v expand inside the rotary kernel, session 14's
    first run the gate/up expand in our kernel instead of cuBLAS: all slower, benchmarks/results/s13c_*,
    s14_*.) ``profile``: then the decode step's kernels with the adapter (torch.profiler)."""
    big = random_model(qwen7b_config())
    for name, kw in (("ours-bf16", {}), ("ours-bf16 +lora32", {"lora_rank": 32})):
        rows.append({"model": "Qwen2.5-7B-shape", "engine": name, "batch": 8, **time_engine(big, 8, 256, 512, 152064, **kw)})
        save()
    big = pack_model_inplace(big)
    gc.collect()
    torch.cuda.empty_cache()
    rows.append({"model": "Qwen2.5-7B-shape", "engine": "ours-nvfp4", "batch": 8,
                 **time_engine(big, 8, 256, 512, 152064)})
    save()
    for _ in range(3):
        for name, kw in (("ours-nvfp4 +lora32", {"lora_rank": 32}),
                         ("ours-nvfp4 +lora32 expand kernels", {"lora_rank": 32, "lora_in_kernel": False})):
            rows.append({"model": "Qwen2.5-7B-shape", "engine": name, "batch": 8,
                         **time_engine(big, 8, 256, 512, 152064, **kw)})
            save()
    if profile:
        try:
            result["qwen7b_nvfp4_lora32_decode_profile_b8"] = profile_decode(big, 8, 256, 152064, lora_rank=32)
        except Exception as e:  # a diagnosis: never lose the throughput rows to it
            result["qwen7b_nvfp4_lora32_decode_profile_b8"] = {"error": repr(e)}
        save()


def attn_part(rows, save) -> None:
    """Decode attention in our kernel (fused.decode_attn) against SDPA, interleaved: 7B shapes (NVFP4), 256 -> 512
    tokens. Batch 8 without and with a rank-32 adapter, twice each: the kernel where its blocks fit one wave
    ("wave": all of batch 8's steps) with its PDL trigger at its start and once its loads have landed ("late"),
    against SDPA; then batch 64 once with the kernel everywhere ("all": no step fits one wave) against SDPA. Most
    important first, every row saved as it ends."""
    from qerl_cli import fused

    big = pack_model_inplace(random_model(qwen7b_config()))
    gc.collect()
    torch.cuda.empty_cache()
    arms = (("wave", False), ("wave", True), (False, False))
    for batch, reps, rank, modes in ((8, 2, 0, arms), (8, 2, 32, arms), (64, 1, 0, ((True, False), (False, False)))):
        for _ in range(reps):
            for attn, late in modes:
                fused._load().set_attn_late_trigger(late)
                name = "ours-nvfp4" + (" +lora32" if rank else "") + (
                    " sdpa" if attn is False else " attn:wave" if attn == "wave" else " attn:all") + (
                    " late" if late else "")
                try:
                    rows.append({"model": "Qwen2.5-7B-shape", "engine": name, "batch": batch,
                                 **time_engine(big, batch, 256, 512, 152064, lora_rank=rank, decode_attn=attn)})
                finally:
                    fused._load().set_attn_late_trigger(False)
                save()


def packed_7b():
    """The 7B-shape random model, packed (NVFP4), with the build's garbage released."""
    big = pack_model_inplace(random_model(qwen7b_config()))
    gc.collect()
    torch.cuda.empty_cache()
    return big


def toggle_ab(big, rows, save, flag: str, off_tag: str, rank: int = 0) -> None:
    """An engine setting (``flag``, a time_engine keyword) on against off, interleaved three times: 7B shapes,
    batch 8, 256 -> 512 tokens, a rank-``rank`` adapter (0: none)."""
    name = "ours-nvfp4" + (f" +lora{rank}" if rank else "")
    for _ in range(3):
        for on in (True, False):
            rows.append({"model": "Qwen2.5-7B-shape", "engine": name + ("" if on else f" {off_tag}"), "batch": 8,
                         **time_engine(big, 8, 256, 512, 152064, lora_rank=rank, **{flag: on})})
            save()


def silu_part(rows, save) -> None:
    """SiLU·mul in the gate/up kernel (Engine.silu_in_kernel, kernel.linear_silu: session 20) against the separate
    kernel, interleaved three times: 7B shapes (NVFP4), batch 8, 256 -> 512 tokens, no adapter."""
    toggle_ab(packed_7b(), rows, save, "silu_in_kernel", "silu-kernel")


def rope_attn_part(rows, save) -> None:
    """The rotary and the step's cache write inside the decode attention kernel (Engine.rope_in_attn,
    fused.rope_decode_attn: session 22) against rope_kv + decode_attn, interleaved three times: 7B shapes (NVFP4),
    batch 8, 256 -> 512 tokens, no adapter; then with a rank-32 adapter, attention in our kernel ("wave", rotary
    inside) against the default with an adapter (SDPA after rope_kv)."""
    big = packed_7b()
    toggle_ab(big, rows, save, "rope_in_attn", "rope_kv+attn")
    for attn in ("wave", None):
        rows.append({"model": "Qwen2.5-7B-shape", "engine": "ours-nvfp4 +lora32" + (" attn:wave" if attn else " sdpa"),
                     "batch": 8, **time_engine(big, 8, 256, 512, 152064, lora_rank=32, decode_attn=attn)})
        save()


def silu_lora_part(rows, save) -> None:
    """With a rank-32 adapter: the gate/up group's LoRA term inside the SiLU·mul pair kernel (Engine.
    silu_lora_in_kernel, session 22; down's shrink then in fused.lora_shrink) against the [M, 2I] product and the
    SiLU·mul kernel with down's shrink, interleaved three times: 7B shapes (NVFP4), batch 8, 256 -> 512 tokens."""
    toggle_ab(packed_7b(), rows, save, "silu_lora_in_kernel", "silu-kernel", rank=32)


def aligned_part(rows, save, cluster: bool = False) -> None:
    """Row-group-aligned grids of the stream-K kernels (kernel.set_v2_aligned, session 21: also v2w8 for the q/k/v
    and o weights at M <= 8) against the default grids, interleaved three times, then once each with a rank-32
    adapter: 7B shapes (NVFP4), batch 8, 256 -> 512 tokens. Each run captures its own decode graph. ``cluster``:
    instead, the aligned grids' split-K sums through thread-block clusters (kernel.set_v2_cluster) against the
    workspace, interleaved twice, then once each with the adapter."""
    from qerl_cli import kernel

    big = pack_model_inplace(random_model(qwen7b_config()))
    gc.collect()
    torch.cuda.empty_cache()
    toggle = kernel.set_v2_cluster if cluster else kernel.set_v2_aligned
    try:
        for rank in (0, 0, 32) if cluster else (0, 0, 0, 32):
            for on in (True, False):
                toggle(on)
                off_name = " sums:workspace" if cluster else " grid:default"
                name = "ours-nvfp4" + (f" +lora{rank}" if rank else "") + ("" if on else off_name)
                rows.append({"model": "Qwen2.5-7B-shape", "engine": name, "batch": 8,
                             **time_engine(big, 8, 256, 512, 152064, lora_rank=rank)})
                save()
    finally:
        kernel.set_v2_aligned(True)
        kernel.set_v2_cluster(True)


def attn_lora_part(result, rows, save) -> None:
    """Why decode attention in our kernel measured slower than SDPA with an adapter (session 18) while faster
    without one: 7B shapes (NVFP4), batch 8, rank 32, 256 -> 512 tokens, the kernel ("wave") against SDPA with
    programmatic dependent launch on and off, interleaved twice; then a per-kernel profile of both with PDL off
    (with PDL a kernel's profiled time includes its wait for the one before)."""
    big = pack_model_inplace(random_model(qwen7b_config()))
    gc.collect()
    torch.cuda.empty_cache()
    for _ in range(2):
        for pdl in (True, False):
            for attn in ("wave", False):
                name = "ours-nvfp4 +lora32" + (" attn:wave" if attn else " sdpa") + ("" if pdl else " no-PDL")
                run = lambda attn=attn: time_engine(big, 8, 256, 512, 152064, lora_rank=32, decode_attn=attn)  # noqa: E731
                rows.append({"model": "Qwen2.5-7B-shape", "engine": name, "batch": 8,
                             **(run() if pdl else without_pdl(run))})
                save()
    for attn in ("wave", False):
        key = f"qwen7b_nvfp4_lora32_decode_profile_b8_{'attn_wave' if attn else 'sdpa'}_nopdl"
        try:
            result[key] = without_pdl(lambda attn=attn: profile_decode(big, 8, 256, 152064, lora_rank=32,
                                                                       decode_attn=attn))
        except Exception as e:  # a diagnosis: never lose the throughput rows to it
            result[key] = {"error": repr(e)}
        save()


def rl_part(rows, save, batches: list[int]) -> None:
    """The rollout batches of RL training (prompts x group, with the adapter being trained): 7B shapes, 256-token
    prompts, 512 new tokens, our engine in bf16 with a rank-32 adapter on every projection, then NVFP4 (the same
    weights packed) without an adapter and with it, the LoRA terms inside the NVFP4 kernels (the default) and in
    separate expand kernels / cuBLAS (``lora_in_kernel`` off) interleaved twice."""
    big = random_model(qwen7b_config())
    for batch in batches:
        rows.append({"model": "Qwen2.5-7B-shape", "engine": "ours-bf16 +lora32", "batch": batch,
                     **time_engine(big, batch, 256, 512, 152064, lora_rank=32)})
        save()
    big = pack_model_inplace(big)
    gc.collect()
    torch.cuda.empty_cache()
    for batch in batches:
        rows.append({"model": "Qwen2.5-7B-shape", "engine": "ours-nvfp4", "batch": batch,
                     **time_engine(big, batch, 256, 512, 152064)})
        save()
        for _ in range(2):
            for name, kw in (("ours-nvfp4 +lora32", {}), ("ours-nvfp4 +lora32 terms outside", {"lora_in_kernel": False})):
                rows.append({"model": "Qwen2.5-7B-shape", "engine": name, "batch": batch,
                             **time_engine(big, batch, 256, 512, 152064, lora_rank=32, **kw)})
                save()


def _profiled(result, key, fn, save) -> None:
    """``result[key] = fn()``, or the error it raised (a profile is a diagnosis: never lose the throughput rows to
    it)."""
    try:
        result[key] = fn()
    except Exception as e:
        result[key] = {"error": repr(e)}
    save()


def _pdl_on() -> bool:
    from qerl_cli import kernel

    return bool(kernel.settings().get("pdl", True))


def _smollm2_arms(model, engine: str, rows, save) -> None:
    """The SmolLM2 shapes at batch 256, interleaved three times: the default engine (decode steps' SDPA over the whole
    cache under the mask) against attention over 64-slot buckets of it (``attend_buckets=True``, opt-in since
    session 33: on an H100 6-8 % faster with a kept graph), for bf16 both also with a capture per call
    (``keep_graph=False``: a one-off rollout pays the bucket graphs' warm-ups and captures; 5-14 % slower with
    buckets there), and for the packed model against one dequantize launch per projection (``dequant_layer=False``;
    the per-layer launch measured 3-8 % faster in session 33). (Session 32's arms, our attention kernel past one
    wave and the tiled tensor-core kernel at M = 256, were slower and are gone.)"""
    arms = [("", {}), (" attend-buckets", {"attend_buckets": True})]
    if engine == "ours-nvfp4":
        arms.append((" per-projection-dequant", {"dequant_layer": False}))
    else:  # a call that captures its own graphs (one per bucket: their warm-ups and captures inside its time)
        arms += [(" capture-per-call", {"keep_graph": False}),
                 (" attend-buckets capture-per-call", {"attend_buckets": True, "keep_graph": False})]
    for _ in range(3):
        for name, kw in arms:
            r = time_engine(model, 256, 128, 256, 49152, **kw)
            rows.append({"model": "SmolLM2-135M", "engine": engine + name, "batch": 256, **r})
            save()


def smollm2_part(base, tok, result, rows, save, profile: bool = False) -> None:
    # one model on the GPU at a time, so that each row's peak memory is its own model's: first the bf16 model
    # (our engine, HF generate), then the same model packed in place (a packed copy beside it put the other
    # model's weights into every row's peak)
    for batch in (64, 256):
        r = time_engine(base, batch, 128, 256, 49152)
        rows.append({"model": "SmolLM2-135M", "engine": "ours-bf16", "batch": batch, **r})
        save()
        r = time_hf(base, batch, 128, 256, 49152)
        rows.append({"model": "SmolLM2-135M", "engine": "hf-generate-bf16", "batch": batch, **r})
        save()
    if profile:  # (session 31: at batch 256 our step is 2.5 ms bf16 against HF's 14.7, short of 10x; session 33:
        # without programmatic dependent launch, so that each kernel's time is its own, not its wait on the one before)
        _smollm2_arms(base, "ours-bf16", rows, save)
        _profiled(result, "smollm2_bf16_decode_profile_b256_nopdl",
                  lambda: without_pdl(lambda: profile_decode(base, 256, 128, 49152, new=256)), save)
    nv = pack_model_inplace(base)
    del base
    gc.collect()
    torch.cuda.empty_cache()
    if tok is None:  # random weights: the engine-vs-HF check still compares the two on the same weights
        result["correctness_random_smollm2_shape_nvfp4"] = correctness(nv, prompts(8, 24, 49152), 2)
        save()
    else:
        from qerl_cli.tasks import chat_prompt

        qs = ["What is 7 + 5?", "What is 6 * 8?", "Name a color.", "Write a haiku about rain.",
              "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
              "How many clips did Natalia sell altogether?", "What is the capital of France?",
              "Count from 1 to 5.", "What is 9 - 4?"]
        result["correctness_smollm2_nvfp4"] = correctness(nv, [chat_prompt(tok, q) for q in qs], tok.eos_token_id)
        save()
    for batch in (64, 256):
        r = time_engine(nv, batch, 128, 256, 49152)
        rows.append({"model": "SmolLM2-135M", "engine": "ours-nvfp4", "batch": batch, **r})
        save()
    if profile:
        _smollm2_arms(nv, "ours-nvfp4", rows, save)
        _profiled(result, "smollm2_nvfp4_decode_profile_b256_nopdl",
                  lambda: without_pdl(lambda: profile_decode(nv, 256, 128, 49152, new=256)), save)
        _profiled(result, "smollm2_nvfp4_decode_profile_b256_nopdl_attend_buckets",
                  lambda: without_pdl(lambda: profile_decode(nv, 256, 128, 49152, new=256, attend_buckets=True)),
                  save)
    result["smollm2_weight_bytes"] = weight_bytes(nv)
    del nv
    gc.collect()
    torch.cuda.empty_cache()



def print_table(result: dict, rows: list[dict]) -> None:
    result["runs"] = rows
    con = Console()
    t = Table(title=f"rollout throughput on {result['device']}")
    for c in ("model", "engine", "batch", "tokens/s", "prefill s", "decode s", "decode setup", "peak GiB"):
        t.add_column(c, justify="right")
    for r in rows:
        setup = f"{r['decode_state']} {r['decode_setup_s'] * 1e3:.1f} ms" if "decode_state" in r else "-"
        # (HF generate's rows time the whole call only: no prefill / decode split to show)
        t.add_row(r["model"], r["engine"], str(r["batch"]), f"{r['tokens_per_s']:.0f}",
                  f"{r['prefill_s']:.3f}" if "prefill_s" in r else "-",
                  f"{r['decode_s']:.3f}" if "decode_s" in r else "-", setup, f"{r['peak_alloc_gib']:.2f}")
    con.print(t)
    con.print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
