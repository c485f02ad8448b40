"""Optional vLLM backend for ``qerl rollout --engine vllm`` — UNTESTED: no machine of this project has vLLM
(it is CUDA-only and cannot share an environment with llmcompressor), so this path has never run; its vLLM API
uses were checked against vLLM 0.34's source (session 34's review). It uses only vLLM's public API: the NVFP4
checkpoint from ``quantize`` (weight-only NVFP4, which vLLM serves on Hopper with an FP4 weight-only kernel of
its own), a ``LoRARequest`` for the adapter, ``SamplingParams(logprobs=0)`` with
``logprobs_mode="processed_logprobs"`` so the recorded log-prob is that of the distribution actually sampled
from (after temperature / top-k / top-p), and ``LLM.apply_model`` to put the AQN draw on vLLM's own RMSNorm
modules (from a clean snapshot every time, as our engine does; the prefix cache is reset after each draw, as its
blocks hold keys and values of the previous one). ``apply_model`` sends its function to vLLM's engine process,
which unpickles functions only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``: the engine sets it (unless set).
Unlike our engine, which keeps noisy scales in fp32, vLLM's RMSNorm holds bf16 scales: there a draw much below
one unit in the last place (2^-7 at 1) rounds back to the clean scale, so small sigmas of the schedule's tail
perturb little or nothing.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from . import names
from .engine import NoiseState, RolloutBatch, SamplingConfig, derive_seed
from .errors import QerlError

# the values vLLM accepts for max_lora_rank (its LoRA config); the engine takes the least that holds the adapter
LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


def require() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise QerlError("--engine vllm needs vLLM (pip install 'qerl[vllm]' in its own CUDA environment); "
                        "use --engine ours.") from None


def lora_rank_setting(rank: int) -> int:
    """vLLM's ``max_lora_rank`` for an adapter of ``rank``: the least of ``LORA_RANKS`` that holds it."""
    for r in LORA_RANKS:
        if rank <= r:
            return r
    raise QerlError(f"--engine vllm serves LoRA ranks up to {LORA_RANKS[-1]}; this adapter has rank {rank}.")


def check_checkpoint(quant_dir: str | Path) -> None:
    """vLLM reads every ``*.safetensors`` file of a folder without a weight index, the AWQ folding factors too
    (and fails on their names): a quant from before the index was written cannot be served."""
    q = Path(quant_dir)
    if (q / names.FOLDING).is_file() and not (q / names.MODEL_INDEX).is_file():
        raise QerlError(f"{q} has no {names.MODEL_INDEX}, without which vLLM reads its AWQ factors as weights: "
                        "rerun qerl quantize with --force (and pack after it).")


class VLLMEngine:
    def __init__(self, quant_dir: str, max_lora_rank: int = 64, gpu_memory_utilization: float = 0.5):
        require()
        check_checkpoint(quant_dir)
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # (apply_model sends our functions)
        from vllm import LLM

        self.llm = LLM(model=quant_dir, enable_lora=True, max_lora_rank=max_lora_rank,
                       gpu_memory_utilization=gpu_memory_utilization, logprobs_mode="processed_logprobs")
        self.noise = NoiseState()
        # (the dtype vLLM's norms hold, as the rollout records the noisy scales': bf16 rounds small draws away)
        self.norm_dtype = self.llm.apply_model(_snapshot_norms)[0]
        # AWQ folding factors of the norm scales (as our engine: sigma is defined on the unfolded scales)
        from safetensors.torch import load_file

        fold = Path(quant_dir) / names.FOLDING
        self.folds = {k: v.float() for k, v in load_file(str(fold)).items()} if fold.is_file() else {}

    def set_noise(self, sigma: float, seed: int) -> NoiseState:
        self.noise = NoiseState(sigma=sigma, seed=seed, scope="batch", draws=self.noise.draws + (sigma > 0))
        # (a module-level function and plain values: what apply_model sends to the engine process pickles
        # without this engine); cached prompt blocks hold keys and values computed under the previous draw
        self.llm.apply_model(functools.partial(_draw_norms, sigma=sigma, seed=seed, folds=self.folds))
        self.llm.reset_prefix_cache()
        return self.noise

    def generate(self, prompts: list[list[int]], group: int, sampling: SamplingConfig, seed: int,
                 adapter_dir: str | None = None, pad_id: int = 0) -> RolloutBatch:
        import time

        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest

        # one request per prompt with a seed of its own (vLLM seeds a request's j-th sample with seed + j, so one
        # seed for the batch drew the same noise for sample j of every prompt); greedy requests take n = 1 only,
        # so there each of the G samples is a request of its own
        greedy = sampling.temperature == 0
        reqs = [p for p in prompts for _ in range(group if greedy else 1)]
        params = [SamplingParams(n=1 if greedy else group, temperature=sampling.temperature, top_p=sampling.top_p,
                                 top_k=sampling.top_k or -1, max_tokens=sampling.max_new_tokens, logprobs=0,
                                 seed=derive_seed(seed, "vllm", i)) for i in range(len(reqs))]
        lora = LoRARequest("qerl-adapter", 1, adapter_dir) if adapter_dir else None
        t0 = time.perf_counter()
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in reqs], params, lora_request=lora)
        dt = time.perf_counter() - t0
        seqs = [c for o in outs for c in o.outputs]
        t = max(len(c.token_ids) for c in seqs)
        ids = torch.full((len(seqs), t), pad_id, dtype=torch.long)
        mask = torch.zeros(len(seqs), t, dtype=torch.bool)
        lp = torch.zeros(len(seqs), t)
        for i, c in enumerate(seqs):
            n = len(c.token_ids)
            ids[i, :n] = torch.tensor(c.token_ids)
            mask[i, :n] = True
            lp[i, :n] = torch.tensor([d[tok].logprob for d, tok in zip(c.logprobs, c.token_ids)])
        reasons = [_REASONS.get(c.finish_reason) for c in seqs]
        if None in reasons:
            raise QerlError(f"vLLM ended a sample with finish reason {seqs[reasons.index(None)].finish_reason!r}, "
                            "neither eos nor the token limit.")
        # (vLLM gives one kind of log-prob per engine: the processed ones stand for the tempered ones too, which
        # differ from them, untruncated, only under top-p / top-k; greedy's are vLLM's, not our engine's zeros)
        return RolloutBatch([list(p) for p in prompts], group, ids, mask, lp, lp, reasons,
                            {"prefill_s": None, "decode_s": dt, "generated_tokens": int(mask.sum()),
                             "tokens_per_s": int(mask.sum()) / dt})


_REASONS = {"stop": "eos", "length": "length"}  # (no stop strings are set: "stop" is the eos token)
_NORMS = ("input_layernorm", "post_attention_layernorm")


def _snapshot_norms(model) -> str:
    """Keep each decoder norm's clean scales on the module (once); the dtype they have."""
    dtypes = set()
    for name, mod in model.named_modules():
        if name.rsplit(".", 1)[-1] in _NORMS:
            if not hasattr(mod, "_qerl_clean"):
                mod._qerl_clean = mod.weight.detach().clone()
            dtypes.add(str(mod.weight.dtype).removeprefix("torch."))
    if not dtypes:
        raise QerlError("vLLM's model has no input_layernorm / post_attention_layernorm modules for AQN noise.")
    return "/".join(sorted(dtypes))


def _draw_norms(model, sigma: float, seed: int, folds: dict[str, torch.Tensor]) -> None:
    g = torch.Generator(device="cpu").manual_seed(seed)
    for name, mod in sorted(model.named_modules(), key=lambda kv: kv[0]):
        if hasattr(mod, "_qerl_clean"):
            z = torch.randn(mod._qerl_clean.shape, generator=g) * sigma
            s = folds.get(name) if name in folds else folds.get("model." + name.split("model.", 1)[-1])
            if s is not None:
                z = z / s
            with torch.no_grad():
                mod.weight.copy_(mod._qerl_clean + z.to(mod.weight.device, mod.weight.dtype))
