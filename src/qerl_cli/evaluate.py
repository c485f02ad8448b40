"""``qerl evaluate``: accuracy of a declared deployment policy, per example, with confidence intervals.

The policy is declared in the artifact: weights (bf16 model, quant checkpoint dequantized, or packed NVFP4),
adapter digest (the adapter is applied through the engine — the paper's public eval forgot it), temperature /
top-p / max tokens, and AQN (off unless ``--sigma`` is given, then with a recorded seed). Every source runs
through the same engine, prompts and answer checking, so their numbers compare.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.markup import escape
from rich.table import Table

from . import artifact, config, data, names, stats, tasks, ui
from .engine import Engine, SamplingConfig, check_positions, derive_seed
from .errors import QerlError
from .modelio import fix_tokenizer
from .rollout import BATCH_SEEDS_DEFINITION, base_model, eos_ids, resolve_policy


@dataclass
class EvaluateConfig:
    num_examples: int
    samples: int
    temperature: float
    top_p: float
    max_new_tokens: int
    sigma: float
    seed: int
    batch_prompts: int
    split: str
    cuda_graph: bool
    progress: bool
    device: str = "cpu"

    def __post_init__(self):
        problems = []
        if self.samples < 1:
            problems.append("samples (k) must be >= 1")
        if self.samples > 1 and self.temperature == 0:
            problems.append("k > 1 samples need temperature > 0 (greedy gives k identical answers)")
        if not 0 <= self.sigma < float("inf"):  # (also refuses nan)
            problems.append("sigma must be a finite number >= 0")
        problems += config.seed_problems(seed=self.seed)
        if self.num_examples < 0 or self.batch_prompts < 1:
            problems.append("num_examples must be >= 0 (0 = all) and batch_prompts >= 1")
        try:
            SamplingConfig(self.temperature, self.top_p, 0, self.max_new_tokens)
        except ValueError as e:
            problems.append(str(e))
        config.validate(problems)


def _resolve_source(source: str | Path, device: str, verify_dir, skip_verify: bool):
    """(tokenizer, inputs, info, load) for a packed artifact, a quant artifact (dequantized reference) or a source
    model, as ``rollout.resolve_policy``: ``load()`` reads the weights."""
    src = Path(str(source))
    kind = artifact.read_manifest(src)[names.K_KIND] if (src / names.MANIFEST).is_file() else None
    if kind not in (None, names.KIND_QUANT, names.KIND_PACKED):  # ("a 'packed' artifact is needed" said too little)
        raise QerlError(f"{src} is {artifact._a(kind)} '{kind}' artifact; evaluate takes a 'packed' or 'quant' "
                        "artifact, or a model.")
    if kind == names.KIND_QUANT:
        from transformers import AutoTokenizer

        from .pack import load_checkpoint
        from .packed_model import load_dequantized_model

        q = artifact.open_artifact(src, names.KIND_QUANT)
        dt = torch.bfloat16 if device.startswith("cuda") else torch.float32
        return (AutoTokenizer.from_pretrained(str(q.path)), [q], {"weights": "nvfp4-dequantized", "quant": q.digest},
                lambda: load_dequantized_model(load_checkpoint(q), q.path, dt, device))
    return resolve_policy(source, device, verify_dir=verify_dir, skip_verify=skip_verify)


def evaluate(source: str | Path, data_spec: str, output: str | Path, adapter: str | Path | None = None,
             num_examples: int | None = None, samples: int | None = None, temperature: float | None = None,
             top_p: float | None = None, max_new_tokens: int | None = None, sigma: float | None = None,
             seed: int | None = None, verify_dir=None, skip_verify: bool = False,
             config_file: str | Path | None = None, force: bool = False, progress: bool = True,
             device: str | None = None) -> artifact.Artifact:
    """Evaluate SOURCE (+ adapter) on DATA under the declared policy; write an ``eval`` artifact."""
    output = Path(output)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = config.load("evaluate", EvaluateConfig, config_file, {
        "num_examples": num_examples, "samples": samples, "temperature": temperature, "top_p": top_p,
        "max_new_tokens": max_new_tokens, "sigma": sigma, "seed": seed, "progress": progress, "device": device})
    generated = tasks.is_generated(data_spec)
    split = "heldout" if generated else cfg.split
    problems = tasks.load_problems(data_spec, 0 if generated else cfg.seed,
                                   cfg.num_examples or None, split)
    if not problems:
        raise QerlError(f"{data_spec} holds no problems.")
    tok, input_arts, info, load_model = _resolve_source(source, device, verify_dir, skip_verify)
    fix_tokenizer(tok)
    from .adapter import check_base_model, fit_lora, load_lora

    lora = load_lora(adapter, None) if adapter is not None else None  # (fit to the model once it loads)
    if lora is not None:
        check_base_model(lora, base_model(input_arts), adapter)
    lora_digest = lora.digest if lora is not None else None
    dataset_id = artifact.sha256_json([[p.question, p.answer] for p in problems])
    inputs = [a.as_input(output) if isinstance(a, artifact.Artifact) else a for a in input_arts]
    inputs.append(artifact.Input("data", data_spec, dataset_id))
    if lora_digest is not None:
        inputs.append(artifact.Input("adapter", str(adapter), lora_digest))
    policy = info | {"adapter": str(adapter) if adapter else None, "adapter_digest": lora_digest,
                     "temperature": cfg.temperature, "top_p": cfg.top_p, "max_new_tokens": cfg.max_new_tokens,
                     "samples": cfg.samples, "sampling_seed": cfg.seed if cfg.temperature > 0 else None,
                     "batch_prompts": cfg.batch_prompts,  # (each batch's seed and noise draw follow from it)
                     "aqn": {"sigma": cfg.sigma, "seed": cfg.seed if cfg.sigma > 0 else None},
                     "seeds": BATCH_SEEDS_DEFINITION}

    scoring = tasks.verifier()  # the answer checker that ran (results differ between checkers)
    # (seeds: how each batch's seeds follow from seed, which session 28 changed: part of the key)
    # num_examples as the count selected and split as the split read (none for a local file): the data input
    # holds the problems, so -n 4 and -n 0 (= all) on a 4-problem set are one eval
    selected = {"num_examples": len(problems),
                "split": split if generated or not data.is_local(data_spec) else None}
    run_config = config.without_unused_sampling(
        config.as_dict(cfg) | selected | {"verifier": scoring, "seeds": BATCH_SEEDS_DEFINITION,
                                       "prompt_format": tasks.prompt_format()}
        | config.result_env(), cfg.temperature, cfg.sigma)
    hit = artifact.cached(names.KIND_EVAL, output, run_config, inputs, force)
    if hit is None:  # (a cache hit loads no model)
        model = load_model()
        if lora is not None:
            fit_lora(lora, model, adapter)
        # every prompt, tokenized once: the longest against the model's positions before the first batch (the
        # engine checks each batch, so a long prompt in a late batch failed after the earlier batches' work)
        prompt_ids = [tasks.chat_prompt(tok, p.question) for p in problems]
        check_positions(model.config, max(map(len, prompt_ids)), cfg.max_new_tokens)

    def body(tmp: Path) -> dict:
        eng = Engine(model, device, cuda_graph=cfg.cuda_graph)
        eng.set_adapter(lora)
        eos = eos_ids(model, tok)
        sampling = SamplingConfig(cfg.temperature, cfg.top_p, 0, cfg.max_new_tokens)
        per_example, gen_tokens, wall = [], 0, 0.0
        starts = list(range(0, len(problems), cfg.batch_prompts))
        for bi, s in enumerate(ui.track(starts, "evaluating", enabled=cfg.progress)):
            chunk = problems[s: s + cfg.batch_prompts]
            eng.set_noise(cfg.sigma, derive_seed(cfg.seed, "noise", bi))
            b = eng.generate(prompt_ids[s: s + cfg.batch_prompts], cfg.samples, sampling,
                             derive_seed(cfg.seed, "sample", bi), eos, tok.pad_token_id)
            gen_tokens += b.timings["generated_tokens"]
            wall += (b.timings["prefill_s"] or 0.0) + b.timings["decode_s"]  # (None: inside decode_s)
            for i, p in enumerate(chunk):
                outs = []
                for j in range(cfg.samples):
                    r = i * cfg.samples + j
                    text = tok.decode(b.completion_ids[r][b.completion_mask[r]].tolist(), skip_special_tokens=True)
                    o = tasks.score(text, p.answer, b.finish_reason[r] == "length")
                    outs.append({"completion": text, "extracted": o.extracted, "correct": o.status == tasks.CORRECT,
                                 "unparsable": o.status == tasks.UNPARSABLE, "truncated": o.status == tasks.TRUNCATED,
                                 "tokens": int(b.completion_mask[r].sum())})
                c = sum(x["correct"] for x in outs)
                per_example.append({"index": s + i, "prompt": p.question, "gold": p.answer, "samples": outs,
                                    "correct": outs[0]["correct"] if cfg.samples == 1 else c / cfg.samples,
                                    f"pass@{cfg.samples}": stats.pass_at_k(cfg.samples, c, cfg.samples)})
        with open(tmp / names.EVAL_EXAMPLES, "w") as f:
            for e in per_example:
                f.write(json.dumps(e) + "\n")
        n = len(per_example)
        correct_all = sum(x["correct"] for e in per_example for x in e["samples"])
        acc = correct_all / (n * cfg.samples)
        prompts = [e["prompt"] for e in per_example]  # (a repeated prompt is one cluster, not new trials)
        (lo, hi), ci_method = stats.accuracy_ci([e["correct"] for e in per_example], k=cfg.samples, clusters=prompts)
        flat = [x for e in per_example for x in e["samples"]]
        summary = {"dataset": data_spec, "dataset_id": dataset_id, "examples": n, "distinct_prompts": len(set(prompts)),
                   "samples_per_example": cfg.samples,
                   "accuracy": acc, "accuracy_ci95": [lo, hi], "ci_method": ci_method,
                   f"pass@{cfg.samples}": sum(e[f"pass@{cfg.samples}"] for e in per_example) / n,
                   "unparsable_rate": sum(x["unparsable"] for x in flat) / len(flat),
                   "truncated_rate": sum(x["truncated"] for x in flat) / len(flat),
                   "generated_tokens": gen_tokens, "generation_s": wall, "policy": policy, "verifier": scoring}
        (tmp / names.EVAL_SUMMARY).write_text(json.dumps(summary, indent=1) + "\n")
        peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else 0
        return {"accuracy": acc, "accuracy_ci95": [lo, hi], "examples": n, "peak_cuda_allocated": peak}

    art = hit if hit is not None else artifact.run_stage(names.KIND_EVAL, output, run_config, inputs, body, force=force)
    s = json.loads(art.file(names.EVAL_SUMMARY).read_text())
    t = Table(title=f"qerl evaluate — {escape(str(art.path))}")
    for c in ("examples", "k", "accuracy", "95% CI", "unparsable", "truncated", "adapter"):
        t.add_column(c, justify="right")
    t.add_row(str(s["examples"]), str(s["samples_per_example"]), f"{s['accuracy']:.4f}",
              f"[{s['accuracy_ci95'][0]:.3f}, {s['accuracy_ci95'][1]:.3f}]", f"{s['unparsable_rate']:.3f}",
              f"{s['truncated_rate']:.3f}", (s["policy"]["adapter_digest"] or "none")[:12])
    ui.out.print(t)
    return art
