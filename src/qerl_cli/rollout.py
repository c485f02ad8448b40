"""``qerl rollout``: batched sampling with our engine (packed NVFP4 or bf16 weights), AQN and recorded
behaviour log-probs; optionally scored by a task verifier."""

from __future__ import annotations

import contextlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.markup import escape
from rich.table import Table
from safetensors.torch import save_file

from . import artifact, config, kernel, modelio, names, tasks, ui
from .engine import Engine, RolloutBatch, SamplingConfig, check_positions, derive_seed
from .errors import QerlError

LOGPROB_DEFINITION = ("behaviour_logprobs: log-prob of each sampled token under the distribution it was sampled "
                      "from = softmax(logits / temperature) truncated by top-k then top-p and renormalized; "
                      "tempered_logprobs: under the untruncated softmax(logits / temperature); greedy (T=0): 0")
BATCH_SEEDS_DEFINITION = ("batch b (prompts [b * batch_prompts, (b + 1) * batch_prompts)) samples with seed "
                          "int.from_bytes(sha256(f'{seed}:sample:{b}').digest()[:8], 'little') >> 1 and draws its AQN "
                          "noise with seed int.from_bytes(sha256(f'{seed}:noise:{b}').digest()[:8], 'little') >> 1")
SEEDS_DEFINITION = (BATCH_SEEDS_DEFINITION + " (recorded in noise[b].seed); generated prompts (arith:N) come from "
                    "prompt_seed, not seed")


@dataclass
class RolloutConfig:
    group: int
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    sigma: float
    noise_scope: str
    noise_final_norm: bool
    seed: int
    prompt_seed: int
    num_prompts: int
    batch_prompts: int
    format_reward: float
    cuda_graph: bool
    progress: bool
    engine: str = "ours"
    device: str = "cpu"

    def __post_init__(self):
        problems = []
        if self.group < 1:
            problems.append("group (G) must be >= 1")
        if not 0 <= self.sigma < float("inf"):  # (also refuses nan)
            problems.append("sigma must be a finite number >= 0")
        problems += config.seed_problems(seed=self.seed, prompt_seed=self.prompt_seed)
        if self.noise_scope not in ("batch", "group"):
            problems.append("noise_scope must be 'batch' or 'group'")
        if self.num_prompts < 0 or self.batch_prompts < 1:
            problems.append("num_prompts must be >= 0 (0 = all) and batch_prompts >= 1")
        if self.engine not in ("ours", "hf", "vllm"):
            problems.append("engine must be 'ours', 'hf' or 'vllm'")
        if self.engine == "vllm" and self.noise_scope == "group" and self.sigma > 0:  # (review, session 19)
            problems.append("--engine vllm draws AQN noise per batch only: use noise_scope 'batch' with it")
        if self.engine == "vllm" and self.noise_final_norm and self.sigma > 0:
            problems.append("--engine vllm draws AQN noise on the decoder layers' norms only, not the final norm")
        if self.engine == "vllm" and self.temperature > 2.0:  # (vLLM's SamplingParams refuses it)
            problems.append("--engine vllm samples at temperatures up to 2")
        try:
            self.sampling()
        except ValueError as e:
            problems.append(str(e))
        config.validate(problems)

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_p, self.top_k, self.max_new_tokens)


def require_verified(packed: artifact.Artifact, verify_dir: str | Path | None, device: str = "cpu"
                     ) -> artifact.Artifact:
    """The verify artifact of ``packed`` that passed; a clear error otherwise. A run on ``device`` that will use
    the CUDA kernel needs a verify that ran the kernel (not the torch reference, which a CPU verify checks)
    under the same kernel switches (``config.kernel_env``)."""
    cand = Path(verify_dir) if verify_dir is not None else packed.path.parent / "verify"
    hint = f"run `qerl verify {packed.path} -o DIR` and pass --verify DIR, or pass --skip-verify"
    if not (cand / names.MANIFEST).is_file():
        raise QerlError(f"{packed.path} has not been verified (no verify artifact at {cand}); {hint}.")
    v = artifact.open_artifact(cand, names.KIND_VERIFY)
    if not any(i.get(names.K_DIGEST) == packed.digest for i in v.inputs):
        raise QerlError(f"{cand} verified a different pack than {packed.path}; {hint}.")
    from .verify import backend_name, verify_backend, verify_passed

    if not verify_passed(v):
        raise QerlError(f"{packed.path} failed verification ({cand}); fix the pack before sampling from it.")
    if str(device).startswith("cuda"):  # (asks whether the kernel builds only when the verify did not run it)
        hint = (f"run `qerl verify {packed.path} -o DIR` on this GPU with this run's environment and pass "
                "--verify DIR, or pass --skip-verify")
        if (ran := verify_backend(v)) != "cuda-kernel":
            if backend_name(device) == "cuda-kernel":
                raise QerlError(f"{cand} checked the pack with the {ran}, not the CUDA kernel this run uses; {hint}.")
            return v
        then, now = config.kernel_env(v.config.get("result_env", {})), config.kernel_env()
        if then != now:
            raise QerlError(f"{cand} verified the CUDA kernel under other kernel switches "
                            f"({then or 'none set'}) than this run's ({now or 'none set'}); {hint}.")
        from . import kernel

        then, now = v.config.get("kernel_build"), kernel.build_identity(device)
        if then != now:
            what = [k for k in now if (then or {}).get(k) != now[k]] if isinstance(then, dict) else ["the record"]
            raise QerlError(f"{cand} verified another build of the CUDA kernel than this run's ({', '.join(what)} "
                            f"differ: its sources, arch flags or GPU); {hint}.")
    return v


def resolve_policy(source: str | Path, device: str, dtype: torch.dtype | None = None, verify_dir=None,
                   skip_verify: bool = False):
    """(tokenizer, inputs, info, load) for a packed artifact (its verify artifact checked) or a source model (bf16
    baseline), with no weight read: ``load()`` reads them (the HF-module model on ``device``). A stage checks its
    cache between the two, so a rerun that is a cache hit never loads a model."""
    from transformers import AutoTokenizer

    from .packed_model import load_packed_model

    src = Path(str(source))
    dt = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    if (src / names.MANIFEST).is_file():
        packed = artifact.open_artifact(src, names.KIND_PACKED)
        inputs = [packed]
        info = {"weights": "nvfp4-packed", "packed_digest": packed.digest}
        if skip_verify:
            info["verify"] = "skipped (--skip-verify)"
        else:
            v = require_verified(packed, verify_dir, device)
            inputs.append(v)
            info["verify"] = v.digest
        return (AutoTokenizer.from_pretrained(str(packed.path)), inputs, info,
                _with_base(lambda: load_packed_model(packed, dt, device), inputs))
    ms = modelio.resolve(str(source))
    tok = modelio.load_tokenizer(ms)
    modelio.fix_tokenizer(tok)  # (as modelio.load leaves it)
    inputs = [ms.as_input()]

    def load():
        return modelio.load(ms, dt)[0].to(device)

    return tok, inputs, {"weights": str(dt).replace("torch.", ""), "model": ms.spec}, _with_base(load, inputs)


def base_model(inputs: list) -> dict | None:
    """The source model a policy's weights come from, ``{"spec", "digest"}``: its model input, or the model input
    of a packed artifact's quant checkpoint (read from the lineage the manifests record); None where that cannot
    be followed (a quant moved away, or changed since the pack was made)."""
    def of_quant(q: artifact.Artifact) -> dict | None:
        m = next((j for j in q.inputs if j.get(names.K_KIND) == names.KIND_MODEL), None)
        return {"spec": m[names.K_PATH], "digest": m[names.K_DIGEST]} if m is not None else None

    for a in inputs:
        if isinstance(a, artifact.Input) and a.kind == names.KIND_MODEL:
            return {"spec": a.path, "digest": a.digest}
        if isinstance(a, artifact.Artifact) and a.kind == names.KIND_QUANT:
            return of_quant(a)
        if isinstance(a, artifact.Artifact) and a.kind == names.KIND_PACKED:
            recorded = a.input_of(names.KIND_QUANT)
            try:
                q = artifact.open_artifact(recorded[0], names.KIND_QUANT, check_files=False) if recorded else None
            except QerlError:  # (the quant is gone)
                q = None
            return of_quant(q) if q is not None and q.digest == recorded[1] else None
    return None


def _with_base(load, inputs: list):
    """``load`` whose model carries ``qerl_base_model`` (``base_model(inputs)``): adapters saved from it record
    the model they were trained on (``lora.save_adapter``)."""
    def loaded():
        model = load()
        model.qerl_base_model = base_model(inputs)
        return model
    return loaded


def load_policy(source: str | Path, device: str, dtype: torch.dtype | None = None, verify_dir=None,
                skip_verify: bool = False):
    """(HF-module model, tokenizer, inputs, info) for a packed artifact or a source model (bf16 baseline)."""
    tok, inputs, info, load = resolve_policy(source, device, dtype, verify_dir, skip_verify)
    return load(), tok, inputs, info


def eos_ids(model, tok) -> set[int]:
    ids = {tok.eos_token_id}
    ge = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids |= set(ge if isinstance(ge, list) else [ge] if ge is not None else [])
    return {i for i in ids if i is not None}


def score_batch(batch: RolloutBatch, tok, problems: list[tasks.Problem] | None, format_reward: float) -> list[dict]:
    rows = []
    for r in range(batch.rows):
        ids = batch.completion_ids[r][batch.completion_mask[r]].tolist()
        text = tok.decode(ids, skip_special_tokens=True)
        row = {"prompt": r // batch.group, "sample": r % batch.group, "completion": text,
               "finish_reason": batch.finish_reason[r], "tokens": len(ids)}
        if problems is not None:
            p = problems[r // batch.group]
            o = tasks.score(text, p.answer, batch.finish_reason[r] == "length", format_reward)
            row |= {"gold": p.answer, "extracted": o.extracted, "status": o.status, "reward": o.reward}
        rows.append(row)
    return rows


def load_prompts(spec: str, seed: int, n: int, tok) -> tuple[list[str], list[tasks.Problem] | None]:
    """(prompt texts, problems or None) of ``spec``, the first ``n`` (0 = all). Problems (scored): ``arith[:M]``
    or a jsonl/json/parquet file / HF dataset with question and answer fields. Unscored prompts: rows with a
    ``prompt`` field, or a ``.txt`` file with one prompt per blank-line-separated block (surrounding white
    space dropped)."""
    from . import data

    txt = not tasks.is_generated(spec) and Path(spec).suffix.lower() == ".txt"
    if not txt:
        try:
            problems = tasks.load_problems(spec, seed, n or None)
            return [p.question for p in problems], problems
        except QerlError as e:
            if "lacks the field" not in str(e):
                raise
    rows = data.load_records(spec).rows[: n or None]
    if txt:
        return [r["text"].strip() for r in rows], None
    return [data.row_text(r, ["prompt"], tok) for r in rows], None


def rollout(source: str | Path, prompts: str, output: str | Path, group: int | None = None,
            max_new_tokens: int | None = None, adapter: str | Path | None = None, sigma: float | None = None,
            seed: int | None = None, temperature: float | None = None, top_p: float | None = None,
            top_k: int | None = None, num_prompts: int | None = None, noise_scope: str | None = None,
            prompt_seed: int | None = None, noise_final_norm: bool | None = None, engine: str = "ours",
            verify_dir: str | Path | None = None, skip_verify: bool = False, config_file: str | Path | None = None,
            force: bool = False, progress: bool = True, device: str | None = None) -> artifact.Artifact:
    """Sample ``group`` completions per prompt; record tokens, masks, behaviour log-probs, rewards, noise."""
    output = Path(output)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = config.load("rollout", RolloutConfig, config_file, {
        "group": group, "max_new_tokens": max_new_tokens, "sigma": sigma, "seed": seed, "temperature": temperature,
        "top_p": top_p, "top_k": top_k, "num_prompts": num_prompts, "noise_scope": noise_scope,
        "prompt_seed": prompt_seed, "noise_final_norm": noise_final_norm, "progress": progress, "engine": engine,
        "device": device})
    quant = None  # (the vLLM engine's checkpoint: the pack's quant input)
    if cfg.engine == "vllm":
        from . import vllm_backend

        vllm_backend.require()
        quant = artifact.open_artifact(source, names.KIND_PACKED).input_of(names.KIND_QUANT)
        if quant is None:
            raise QerlError("--engine vllm needs a packed artifact made from a quant checkpoint.")
        vllm_backend.check_checkpoint(quant[0])
    tok, input_arts, info, load_model = resolve_policy(source, device, verify_dir=verify_dir, skip_verify=skip_verify)
    modelio.fix_tokenizer(tok)
    texts, problems = load_prompts(prompts, cfg.prompt_seed, cfg.num_prompts, tok)
    if not texts:
        raise QerlError(f"{prompts} holds no prompts.")
    prompt_ids = [tasks.chat_prompt(tok, t) for t in texts]
    from .adapter import check_base_model, fit_lora, load_lora, model_folding

    lora = load_lora(adapter, None) if adapter is not None else None  # (fit to the model once it loads)
    if lora is not None:
        check_base_model(lora, base_model(input_arts), adapter)
    lora_digest = lora.digest if lora is not None else None
    inputs = [a.as_input(output) if isinstance(a, artifact.Artifact) else a for a in input_arts]
    # the rewards depend on the gold answers and the verifier as much as on the questions
    scoring = tasks.verifier() if problems is not None else None
    inputs.append(artifact.Input("prompts", prompts, artifact.sha256_json(
        {"prompts": texts, "answers": [p.answer for p in problems] if problems is not None else None,
         "verifier": scoring})))
    if lora_digest is not None:
        inputs.append(artifact.Input("adapter", str(adapter), lora_digest))
    # the answer checker that scored (results differ between checkers): recorded, and part of the key
    # num_prompts as the count it selected (the prompts input holds their texts): --num-prompts 4 and 0 (= all)
    # on a 4-prompt set are one rollout; prompt_seed only where it drew the prompts (arith:N), not for a file
    selected = {"num_prompts": len(texts), "prompt_seed": cfg.prompt_seed if tasks.is_generated(prompts) else None}
    run_config = config.without_unused_sampling(
        config.as_dict(cfg) | {"verifier": scoring, "prompt_format": tasks.prompt_format()} | selected
        | config.result_env(), cfg.temperature, cfg.sigma)
    hit = artifact.cached(names.KIND_ROLLOUT, output, run_config, inputs, force)
    if hit is not None:  # (before the model loads: minutes for a large one)
        _print(json.loads(hit.file(names.ROLLOUT_META).read_text())["summary"], hit.path)
        return hit
    vllm_engine = None
    if cfg.engine == "vllm":
        rank = max((a.shape[0] for a, _ in lora.factors.values()), default=1) if lora is not None else 1
        vllm_engine = vllm_backend.VLLMEngine(str(quant[0]), max_lora_rank=vllm_backend.lora_rank_setting(rank))
    model = load_model()
    check_positions(model.config, max(map(len, prompt_ids)), cfg.max_new_tokens)  # (every engine, not only ours)
    if lora is not None:
        fit_lora(lora, model, adapter)
    vllm_adapter = str(adapter) if adapter is not None else None
    if vllm_engine is not None and adapter is not None and lora.source is not None:
        # vLLM runs the AWQ-folded checkpoint: it gets a copy of the adapter folded into its coordinates
        from .lora import write_folded_adapter

        vllm_adapter = write_folded_adapter(adapter, model_folding(model))

    def body(tmp: Path) -> dict:
        eng = Engine(model, device, cuda_graph=cfg.cuda_graph)
        eng.set_adapter(lora)
        eos = eos_ids(model, tok)
        batches, rows, noise_states = [], [], []
        starts = list(range(0, len(prompt_ids), cfg.batch_prompts))
        for bi, s in enumerate(ui.track(starts, "sampling", enabled=cfg.progress)):
            chunk = prompt_ids[s: s + cfg.batch_prompts]
            nseed, sseed = derive_seed(cfg.seed, "noise", bi), derive_seed(cfg.seed, "sample", bi)
            ns = eng.set_noise(cfg.sigma, nseed, cfg.noise_scope, len(chunk), cfg.group, cfg.noise_final_norm)
            noise_states.append(noise_record(ns, cfg.engine, model) | {"batch": bi, "prompts": [s, s + len(chunk)]})
            if vllm_engine is not None:
                ns = vllm_engine.set_noise(cfg.sigma, nseed)
                noise_states[-1] = ns.as_dict() | {"dtype": vllm_engine.norm_dtype, "batch": bi,
                                                   "prompts": [s, s + len(chunk)]}
                b = vllm_engine.generate(chunk, cfg.group, cfg.sampling(), sseed, vllm_adapter, tok.pad_token_id)
            elif cfg.engine == "hf":
                b = hf_generate(model, chunk, cfg, eos, tok.pad_token_id, sseed, eng)
            else:
                b = eng.generate(chunk, cfg.group, cfg.sampling(), sseed, eos, tok.pad_token_id)
            sub = problems[s: s + len(chunk)] if problems is not None else None
            for row in score_batch(b, tok, sub, cfg.format_reward):
                row["prompt"] += s
                rows.append(row)
            batches.append(b)
        tensors = _stack(batches, tok.pad_token_id)
        if problems is not None:
            tensors["rewards"] = torch.tensor([r["reward"] for r in rows], dtype=torch.float32)
        save_file(tensors, str(tmp / names.ROLLOUT_TENSORS), metadata={"format": "pt"})
        with open(tmp / names.ROLLOUT_SAMPLES, "w") as f:
            for r in rows:
                f.write(json.dumps(r | {"prompt_text": texts[r["prompt"]]}) + "\n")
        summary = _summary(rows, batches)
        meta = {"policy": info | {"engine": cfg.engine, "device": device, "dtype": str(eng.dtype),
                                  "adapter_digest": lora.digest if lora else None,
                                  "cuda_graph": eng.use_graph and cfg.engine == "ours",
                                  "sampler": (eng.sampler(cfg.sampling(), eng.lm_head.weight.shape[0])
                                              if cfg.engine == "ours" else cfg.engine),
                                  "decode_attention": eng.decode_attention() if cfg.engine == "ours" else cfg.engine,
                                  # (which NVFP4 kernel, grid and split-K reduction our engine's products ran on)
                                  "nvfp4_kernel": kernel.settings() if cfg.engine == "ours" else cfg.engine},
                "sampling": cfg.sampling().__dict__, "logprobs": LOGPROB_DEFINITION, "seeds": SEEDS_DEFINITION,
                "verifier": scoring,
                "noise": noise_states, "summary": summary}
        (tmp / names.ROLLOUT_META).write_text(json.dumps(meta, indent=1) + "\n")
        peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else 0
        return summary | {"peak_cuda_allocated": peak}

    try:
        art = artifact.run_stage(names.KIND_ROLLOUT, output, run_config, inputs, body, force=force)
    finally:
        if vllm_adapter is not None and vllm_adapter != str(adapter):
            shutil.rmtree(vllm_adapter, ignore_errors=True)
    _print(json.loads(art.file(names.ROLLOUT_META).read_text())["summary"], art.path)
    return art


def noise_record(ns, engine: str, model) -> dict:
    """The noise state a rollout records for a batch: the engine's draw, with the dtype its noisy scales had where
    they ran. ``--engine hf`` writes the draw into the HF model's own norm weights (:func:`hf_policy`), so there it
    is the model's dtype (bf16 on GPU: the draw rounded), not the engine's fp32."""
    d = ns.as_dict()
    if engine == "hf":
        d["dtype"] = str(model.model.layers[0].input_layernorm.weight.dtype).removeprefix("torch.")
    return d


@contextlib.contextmanager
def hf_policy(model, eng: Engine, row: int | None = None):
    """Within: the HF model itself runs the policy ``eng`` declares, for transformers' ``generate``: the
    engine's current AQN draw written into every layer's ``input_layernorm`` / ``post_attention_layernorm``
    weight and, where drawn, the final norm's (``row``: which row of a per-group draw), and the engine's adapter
    added by forward hooks on its projections (``y += scaling * (x @ A^T) @ B^T``, as the engine does). On leaving, the norm weights are the
    engine's clean snapshot again and the hooks are gone. (The HF norms hold the model's dtype: on a bf16 model
    the draw is rounded to bf16 there, unlike in the engine, whose noisy scales stay fp32.)"""
    norms = eng.effective_norm_weights()
    layers = list(model.model.layers)
    hooks = []
    try:
        with torch.no_grad():
            for layer, nw in zip(layers, norms):
                for t, w in nw.items():
                    getattr(layer, t).weight.copy_(w[row, 0] if w.dim() == 3 else w)
            fw = eng.effective_final_norm()
            model.model.norm.weight.copy_(fw[row, 0] if fw.dim() == 3 else fw)
        if eng.lora is not None:
            for name, (a, b) in eng.lora.factors.items():
                def add_lora(_m, args, out, a=a, b=b, s=eng.lora.scaling):
                    return out + ((args[0] @ a.t()) @ b.t() * s).to(out.dtype)

                hooks.append(model.get_submodule(name).register_forward_hook(add_lora))
        yield model
    finally:
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for layer, clean in zip(layers, eng.clean):
                for t, w in clean.items():
                    getattr(layer, t).weight.copy_(w)
            model.model.norm.weight.copy_(eng.final_norm)


def hf_generate(model, prompts: list[list[int]], cfg: RolloutConfig, eos: set[int], pad: int, seed: int,
                eng: Engine) -> RolloutBatch:
    """Reference path: transformers' ``generate`` on the HF model under the same policy as the engine path
    (``eng``'s AQN draw and adapter applied through :func:`hf_policy`; sampling seeded with ``seed``, one per
    batch). Log-probs as the engine records them: ``behaviour_logprobs`` from the processed scores the tokens
    were sampled from (tempered, top-k / top-p truncated, renormalized), ``tempered_logprobs`` from the raw
    logits / temperature (untruncated); both 0 when greedy (T = 0). Only our sampling settings apply: the
    model's own ``generation_config`` (e.g. a default top-k or repetition penalty) is set aside for the call.
    A per-group AQN draw (noise scope "group") generates prompt by prompt, each under its own draw."""
    import time

    from transformers import GenerationConfig

    dev = next(model.parameters()).device
    kw = {"do_sample": cfg.temperature > 0}
    if cfg.temperature > 0:
        kw |= {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k}  # (top_k 0: off)
    # each prompt G times, one sequence each: what num_return_sequences=G does inside generate, which refuses it
    # when greedy (T = 0)
    gen_cfg = GenerationConfig(max_new_tokens=cfg.max_new_tokens, num_return_sequences=1,
                               eos_token_id=sorted(eos), pad_token_id=pad, output_scores=True, output_logits=True,
                               return_dict_in_generate=True, **kw)
    per_group = eng.effective_norm_weights()[0]["input_layernorm"].dim() == 3
    chunks = [[p] for p in prompts] if per_group else [prompts]
    own_cfg = model.generation_config
    t0 = time.perf_counter()
    parts = []
    try:
        model.generation_config = GenerationConfig()
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            torch.manual_seed(seed)
            for ci, chunk in enumerate(chunks):
                with hf_policy(model, eng, row=ci * cfg.group if per_group else None):
                    parts.append(_hf_chunk(model, [p for p in chunk for _ in range(cfg.group)], gen_cfg,
                                           cfg.temperature, eos, pad, dev))
    finally:
        model.generation_config = own_cfg
    dt = time.perf_counter() - t0
    t = max(x[0].shape[1] for x in parts)
    seq = torch.cat([torch.nn.functional.pad(x[0], (0, t - x[0].shape[1]), value=pad) for x in parts])
    mask, blp, tlp = (torch.cat([torch.nn.functional.pad(x[i], (0, t - x[i].shape[1])) for x in parts])
                      for i in (1, 2, 3))
    ended = (mask & torch.isin(seq, torch.tensor(sorted(eos)))).any(1)
    return RolloutBatch([list(p) for p in prompts], cfg.group, seq, mask, blp, tlp,
                        ["eos" if e else "length" for e in ended.tolist()],
                        {"prefill_s": None, "decode_s": dt, "generated_tokens": int(mask.sum()),  # (not separable)
                         "tokens_per_s": int(mask.sum()) / dt})


class _FiniteLogits:
    """A transformers logits processor that raises the engine's sentence on NaN / +inf scores, before transformers' sampling reaches them (a raw
    RuntimeError in torch.multinomial on CPU, a device-side assert on CUDA). -inf is left alone: the truncation
    warpers put it there. A host sync per step: this is the slow reference path."""

    def __init__(self, max_new_tokens: int):
        self.step, self.total = 0, max_new_tokens

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.step += 1
        if bool((torch.isnan(scores) | torch.isposinf(scores)).any()):
            raise QerlError(f"the model's logits are not finite (NaN or Inf) at decode step {self.step} of "
                            f"{self.total}, so nothing can be sampled from them; check the model's and the adapter's "
                            "weights for NaN/Inf or huge values (a diverged adapter: lower the learning rate) and that "
                            "the AQN sigma is small.")
        return scores


def _hf_chunk(model, prompts: list[list[int]], gen_cfg, temperature: float, eos: set[int], pad: int, dev):
    """(completion ids, mask, behaviour log-probs, tempered log-probs) of one ``generate`` call, on CPU."""
    p_len = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), p_len), pad, dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, p_len - len(p):] = torch.tensor(p)
        att[i, p_len - len(p):] = 1
    from transformers import LogitsProcessorList

    out = model.generate(input_ids=ids.to(dev), attention_mask=att.to(dev), generation_config=gen_cfg,
                         logits_processor=LogitsProcessorList([_FiniteLogits(gen_cfg.max_new_tokens)]))
    seq = out.sequences[:, p_len:].cpu()
    t = seq.shape[1]
    is_eos = torch.isin(seq, torch.tensor(sorted(eos)))
    first = torch.where(is_eos.any(1), is_eos.float().argmax(1), torch.full((seq.shape[0],), t))
    mask = torch.arange(t)[None] <= first[:, None]  # through the first eos
    if temperature == 0:  # greedy: a deterministic policy, recorded as 0 (as the engine does)
        zero = torch.zeros(seq.shape, dtype=torch.float32)
        return seq, mask, zero, zero.clone()
    processed = torch.stack(out.scores, 1).float().cpu()  # what each token was sampled from
    raw = torch.stack(out.logits, 1).float().cpu()
    blp = torch.log_softmax(processed, -1).gather(-1, seq[..., None]).squeeze(-1)
    tlp = torch.log_softmax(raw / temperature, -1).gather(-1, seq[..., None]).squeeze(-1)
    # (after a row's end its pad tokens may be -inf under a truncated distribution: masked to 0, never NaN)
    return seq, mask, torch.where(mask, blp, 0.0), torch.where(mask, tlp, 0.0)


def _stack(batches: list[RolloutBatch], pad: int) -> dict[str, torch.Tensor]:
    t = max(b.completion_ids.shape[1] for b in batches)
    p = max(len(x) for b in batches for x in b.prompt_ids)
    comp, mask, blp, tlp, prompt, plen = [], [], [], [], [], []
    for b in batches:
        extra = t - b.completion_ids.shape[1]
        comp.append(torch.nn.functional.pad(b.completion_ids, (0, extra), value=pad))
        mask.append(torch.nn.functional.pad(b.completion_mask, (0, extra), value=False))
        blp.append(torch.nn.functional.pad(b.behaviour_logprobs, (0, extra)))
        tlp.append(torch.nn.functional.pad(b.tempered_logprobs, (0, extra)))
        for x in b.prompt_ids:
            prompt.append(torch.tensor([pad] * (p - len(x)) + x))
            plen.append(len(x))
    reasons = [r for b in batches for r in b.finish_reason]
    row_prompt, base = [], 0
    for b in batches:
        row_prompt += [base + r // b.group for r in range(b.rows)]
        base += len(b.prompt_ids)
    return {"prompt_ids": torch.stack(prompt), "prompt_lengths": torch.tensor(plen, dtype=torch.int32),
            "row_prompt": torch.tensor(row_prompt, dtype=torch.int32),
            "completion_ids": torch.cat(comp), "completion_mask": torch.cat(mask),
            "behaviour_logprobs": torch.cat(blp), "tempered_logprobs": torch.cat(tlp),
            "finished_by_eos": torch.tensor([r == "eos" for r in reasons])}


def _summary(rows: list[dict], batches: list[RolloutBatch]) -> dict:
    gen = sum(b.timings["generated_tokens"] for b in batches)
    # prefill_s None: an engine that does not time its prefill apart (HF generate, vLLM), whose decode_s holds it
    split = all(b.timings["prefill_s"] is not None for b in batches)
    pre = sum(b.timings["prefill_s"] for b in batches) if split else None
    dec = sum(b.timings["decode_s"] for b in batches)
    s = {"samples": len(rows), "generated_tokens": gen, "prefill_s": pre, "decode_s": dec,
         "decode_s_includes_prefill": not split, "tokens_per_s": gen / max((pre or 0.0) + dec, 1e-9),
         # decode steps set up (graph captures on GPU: inside decode_s) and calls that reused the previous one's
         "decode_setup_s": sum(b.timings.get("decode_setup_s", 0.0) for b in batches),
         "decode_states_kept": sum(b.timings.get("decode_state") == "kept" for b in batches),
         "length_fraction": sum(r["finish_reason"] == "length" for r in rows) / len(rows),
         "mean_length": gen / len(rows)}
    if rows and "reward" in rows[0]:
        for st in (tasks.CORRECT, tasks.WRONG, tasks.UNPARSABLE, tasks.TRUNCATED):
            # (truncated_fraction: cut off with no complete marked answer; length_fraction above: every sample that
            # hit max_new_tokens, answered or not)
            s[f"{st}_fraction"] = sum(r["status"] == st for r in rows) / len(rows)
        s["reward_mean"] = sum(r["reward"] for r in rows) / len(rows)
    return s


def _print(summary: dict, path: Path) -> None:
    t = Table(title=f"qerl rollout — {escape(str(path))}")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    for k, v in summary.items():
        t.add_row(k, f"{v:.4g}" if isinstance(v, float) else str(v))
    ui.out.print(t)
