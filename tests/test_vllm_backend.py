"""The vLLM backend against a stand-in of the vLLM API it uses (vLLM itself is not installed on any machine of this
project). The stand-in does what vLLM 0.34 does at the points where session 34's review found our use wrong:
``apply_model`` pickles its function (the engine runs in another process), ``SamplingParams`` refuses n > 1 when
greedy, and a request's j-th sample is seeded with seed + j."""

from __future__ import annotations

import os
import pickle
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from qerl_cli import config, names, rollout, vllm_backend
from qerl_cli.engine import SamplingConfig
from qerl_cli.errors import QerlError


class _Norm(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))


class _Model(torch.nn.Module):  # vLLM's module names: model.layers.N.{input,post_attention}_layernorm
    def __init__(self, layers: int = 2, n: int = 8):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList()
        for _ in range(layers):
            layer = torch.nn.Module()
            layer.input_layernorm, layer.post_attention_layernorm = _Norm(n), _Norm(n)
            self.model.layers.append(layer)
        self.model.norm = _Norm(n)


class _SamplingParams:
    def __init__(self, n=1, temperature=1.0, seed=None, **kw):
        if temperature == 0 and n > 1:
            raise ValueError("n must be 1 when using greedy sampling")
        self.n, self.temperature, self.seed, self.kw = n, temperature, seed, kw


@pytest.fixture
def fake_vllm(monkeypatch):
    """A stand-in ``vllm`` package; ``state`` records what the backend asked of it."""
    state = SimpleNamespace(llm=None, finish="stop")

    class LLM:
        def __init__(self, **kw):
            self.kw, self.env = kw, os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION")
            self.model, self.resets, self.requests, self.params = _Model(), 0, [], []
            state.llm = self

        def apply_model(self, fn):
            return [pickle.loads(pickle.dumps(fn))(self.model)]  # (sent to the engine process)

        def reset_prefix_cache(self):
            self.resets += 1

        def generate(self, prompts, params, lora_request=None):
            self.requests, self.params, self.lora = prompts, params, lora_request
            outs = []
            for p, sp in zip(prompts, params):
                toks = [3 + len(p["prompt_token_ids"]), 2]
                lp = [{t: SimpleNamespace(logprob=-0.25 * (k + 1))} for k, t in enumerate(toks)]
                outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=toks, logprobs=lp,
                                                                     finish_reason=state.finish)
                                                     for _ in range(sp.n)]))
            return outs

    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = LLM, _SamplingParams
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    lora = types.ModuleType("vllm.lora")
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = lambda name, i, path: (name, i, path)
    for name, mod in (("vllm", vllm), ("vllm.inputs", inputs), ("vllm.lora", lora), ("vllm.lora.request", request)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    return state


def test_noise_reaches_the_engine_process_and_resets_the_prefix_cache(fake_vllm, tmp_path):
    """The noise function crosses to vLLM's engine process (it pickled ``self`` and the LLM with it: a lambda),
    every draw is from the clean scales, and the prefix cache is reset after each draw (its blocks were computed
    under the previous one)."""
    eng = vllm_backend.VLLMEngine(str(tmp_path), max_lora_rank=16)
    llm = fake_vllm.llm
    assert llm.env == "1" and llm.kw["max_lora_rank"] == 16 and llm.kw["logprobs_mode"] == "processed_logprobs"
    norm = llm.model.model.layers[1].post_attention_layernorm
    clean = norm.weight.detach().clone()
    eng.set_noise(0.05, seed=3)
    first = norm.weight.detach().clone()
    assert not torch.equal(first, clean) and llm.resets == 1
    eng.set_noise(0.05, seed=3)  # (the same seed again: the same scales, not twice the noise)
    assert torch.equal(norm.weight.detach(), first) and llm.resets == 2 and eng.noise.draws == 2
    eng.set_noise(0.0, seed=4)
    assert torch.equal(norm.weight.detach(), clean)
    assert torch.equal(llm.model.model.norm.weight.detach(), torch.ones(8, dtype=torch.bfloat16))  # (final norm)


def test_requests_seeds_and_finish_reasons(fake_vllm, tmp_path):
    eng = vllm_backend.VLLMEngine(str(tmp_path))
    llm = fake_vllm.llm
    prompts = [[1, 2], [1, 2, 3]]
    # sampling: one request per prompt, n = G, and a seed per request (seed + j for its j-th sample)
    b = eng.generate(prompts, 3, SamplingConfig(temperature=1.0, max_new_tokens=2), seed=5)
    assert [r["prompt_token_ids"] for r in llm.requests] == prompts and [p.n for p in llm.params] == [3, 3]
    assert len({p.seed for p in llm.params}) == 2
    assert b.rows == 6 and b.finish_reason == ["eos"] * 6 and b.completion_ids[3].tolist() == [6, 2]
    assert b.behaviour_logprobs[0].tolist() == [-0.25, -0.5]
    # greedy: vLLM takes n = 1 only, so each sample is a request (prompt-major rows, as our engine's)
    b = eng.generate(prompts, 3, SamplingConfig(temperature=0.0, max_new_tokens=2), seed=5)
    assert [len(r["prompt_token_ids"]) for r in llm.requests] == [2, 2, 2, 3, 3, 3]
    assert [p.n for p in llm.params] == [1] * 6 and b.rows == 6
    fake_vllm.finish = "length"
    assert eng.generate(prompts, 1, SamplingConfig(temperature=1.0), seed=0).finish_reason == ["length"] * 2
    fake_vllm.finish = "abort"  # (vLLM's abort / error / repetition were recorded as "length")
    with pytest.raises(QerlError, match="finish reason 'abort'"):
        eng.generate(prompts, 1, SamplingConfig(temperature=1.0), seed=0)


def test_lora_rank_setting_and_temperature_bound():
    assert [vllm_backend.lora_rank_setting(r) for r in (1, 8, 9, 32, 33, 300, 512)] == [8, 8, 16, 32, 64, 320, 512]
    with pytest.raises(QerlError, match="LoRA ranks up to 512; this adapter has rank 513"):
        vllm_backend.lora_rank_setting(513)
    with pytest.raises(QerlError, match="--engine vllm samples at temperatures up to 2"):
        config.load("rollout", rollout.RolloutConfig, None, {"engine": "vllm", "temperature": 2.5})
    config.load("rollout", rollout.RolloutConfig, None, {"engine": "ours", "temperature": 2.5})


def test_rollout_through_the_vllm_path(fake_vllm, tiny_pipeline, tmp_path):
    """``qerl rollout --engine vllm`` end to end on the stand-in: the pack's quant checkpoint is what vLLM serves,
    the noise is drawn per batch on its norms, and the artifact records vLLM's tokens and log-probs."""
    a = rollout.rollout(tiny_pipeline["packed"], "arith:3", tmp_path / "r", group=2, max_new_tokens=2, sigma=0.01,
                        seed=0, engine="vllm", progress=False)
    llm = fake_vllm.llm
    assert llm.kw["model"] == str(tiny_pipeline["quant"].resolve()) and llm.kw["max_lora_rank"] == 8
    assert llm.resets >= 1 and a.config["engine"] == "vllm"
    meta = a.read_json(names.ROLLOUT_META)
    assert meta["policy"]["engine"] == "vllm" and meta["summary"]["samples"] == 6
    # the noise record: the draw vLLM's norms got, in the dtype they hold there (bf16), per batch
    assert [(n["sigma"], n["dtype"], n["batch"]) for n in meta["noise"]] == [(0.01, "bfloat16", 0)]
    t = load_file(str(a.file(names.ROLLOUT_TENSORS)))
    assert t["completion_ids"].shape == (6, 2) and t["behaviour_logprobs"][0].tolist() == [-0.25, -0.5]
    assert t["finished_by_eos"].all()  # (vLLM's "stop")
