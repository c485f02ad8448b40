"""Optional vLLM backend for ``qerl rollout --engine vllm`` — UNTESTED: no machine of this project has vLLM
(it is CUDA-only and cannot share an environment with llmcompressor), so this path has never run. It uses
only vLLM's public API: the NVFP4 checkpoint from ``quantize`` (which vLLM serves with its FP4 Marlin kernel
on Hopper), a ``LoRARequest`` for the adapter, ``SamplingParams(logprobs=0)`` with
``logprobs_mode="processed_logprobs"`` so the recorded log-prob is that of the distribution actually sampled
from (after temperature / top-k / top-p), and ``LLM.apply_model`` to put the AQN draw on vLLM's own RMSNorm
modules (from a clean snapshot every time, as our engine does). Unlike our engine, which keeps noisy scales in
fp32, vLLM's RMSNorm holds bf16 scales: there a draw much below one unit in the last place (2^-7 at 1) rounds
back to the clean scale, so small sigmas of the schedule's tail perturb little or nothing.
"""

from __future__ import annotations

import torch

from .engine import NoiseState, RolloutBatch, SamplingConfig
from .errors import QerlError


def require() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise QerlError("--engine vllm needs vLLM (pip install 'qerl[vllm]' in its own CUDA environment); "
                        "use --engine ours.") from None


class VLLMEngine:
    def __init__(self, quant_dir: str, max_lora_rank: int = 64, gpu_memory_utilization: float = 0.5):
        require()
        from vllm import LLM

        self.llm = LLM(model=quant_dir, enable_lora=True, max_lora_rank=max_lora_rank,
                       gpu_memory_utilization=gpu_memory_utilization, logprobs_mode="processed_logprobs")
        self.noise = NoiseState()
        self.llm.apply_model(_snapshot_norms)
        # AWQ folding factors of the norm scales (as our engine: sigma is defined on the unfolded scales)
        from pathlib import Path

        from safetensors.torch import load_file

        from .names import FOLDING

        fold = Path(quant_dir) / FOLDING
        self.folds = {k: v.float() for k, v in load_file(str(fold)).items()} if fold.is_file() else {}

    def set_noise(self, sigma: float, seed: int) -> NoiseState:
        self.noise = NoiseState(sigma=sigma, seed=seed, scope="batch", draws=self.noise.draws + (sigma > 0))
        self.llm.apply_model(lambda model: _draw_norms(model, sigma, seed, self.folds))
        return self.noise

    def generate(self, prompts: list[list[int]], group: int, sampling: SamplingConfig, seed: int,
                 adapter_dir: str | None = None, pad_id: int = 0) -> RolloutBatch:
        import time

        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest

        params = SamplingParams(n=group, temperature=sampling.temperature, top_p=sampling.top_p,
                                top_k=sampling.top_k or -1, max_tokens=sampling.max_new_tokens, logprobs=0, seed=seed)
        lora = LoRARequest("qerl-adapter", 1, adapter_dir) if adapter_dir else None
        t0 = time.perf_counter()
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, lora_request=lora)
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
        reasons = ["eos" if c.finish_reason == "stop" else "length" for c in seqs]
        # (vLLM gives one kind of log-prob per engine: the processed ones stand for the tempered ones too, which
        # differ from them, untruncated, only under top-p / top-k; greedy's are vLLM's, not our engine's zeros)
        return RolloutBatch([list(p) for p in prompts], group, ids, mask, lp, lp, reasons,
                            {"prefill_s": None, "decode_s": dt, "generated_tokens": int(mask.sum()),
                             "tokens_per_s": int(mask.sum()) / dt})


_NORMS = ("input_layernorm", "post_attention_layernorm")


def _snapshot_norms(model) -> None:
    for name, mod in model.named_modules():
        if name.rsplit(".", 1)[-1] in _NORMS and not hasattr(mod, "_qerl_clean"):
            mod._qerl_clean = mod.weight.detach().clone()


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
