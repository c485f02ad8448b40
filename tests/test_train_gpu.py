"""train on CUDA: the packed kernel under bf16 autocast, CUDA-graph rollouts, gradient checkpointing and the
held-out evaluation, end to end on the tiny pipeline. Skipped without a GPU."""

from __future__ import annotations

import json
import math

import pytest
from safetensors.torch import load_file

from qerl_cli import kernel, names, rollout, train

pytestmark = pytest.mark.gpu

KW = dict(task="arith:16", steps=3, prompts_per_step=4, group=4, max_new_tokens=8, lr=5e-3, save_every=3,
          sigma_stages=2, sigma_start=0.05, sigma_end=0.05, progress=False, device="cuda")


def _fake_score(batch, tok, problems, format_reward):  # informative groups from a random model
    return [{"status": "correct" if int(batch.completion_ids[r, 0]) % 2 == 0 else "wrong",
             "reward": float(int(batch.completion_ids[r, 0]) % 2 == 0)} for r in range(batch.rows)]


@pytest.fixture(scope="module")
def gpu_verify(tiny_pipeline, tmp_path_factory):
    """A verify of the tiny pack on CUDA: the shared one ran on CPU (the torch reference), which does not
    authorise a run that uses the kernel."""
    from qerl_cli.verify import verify

    out = tmp_path_factory.mktemp("gpu_verify") / "verify"
    verify(tiny_pipeline["packed"], out, progress=False, device="cuda")
    return out


@pytest.mark.parametrize("ckpt", [False, True])
def test_train_steps_on_cuda(tiny_pipeline, gpu_verify, tmp_path, monkeypatch, ckpt):
    monkeypatch.setattr(rollout, "score_batch", _fake_score)
    ovr = {"dynamic_sampling": False, "lora_rank": 4, "lora_alpha": 8.0, "batch_prompts": 2, "eval_every": 3,
           "eval_problems": 8, "gradient_checkpointing": ckpt}
    art = train.train(tiny_pipeline["packed"], tmp_path / "run", **KW, overrides=ovr, verify_dir=gpu_verify)
    ms = [json.loads(x) for x in (art.path / names.RUN_METRICS).read_text().splitlines()]
    steps = [m for m in ms if "time_step_s" in m]
    assert len(steps) == 3 and "heldout_accuracy" in ms[0] and "heldout_accuracy" in ms[-1]
    for m in steps:
        assert all(math.isfinite(m[k]) for k in ("loss", "grad_norm", "entropy", "logprob_gap_abs"))
        assert m["peak_mem_allocated_bytes"] > 0
    assert any(m["loss"] != 0 for m in steps)
    assert [m["sigma"] for m in steps] == [0.0, 0.0, pytest.approx(0.05)]  # K = 2 stages over 3 steps
    # the behaviour log-probs (bf16 CUDA-graph rollout) and the training forward agree on step 1 (no noise)
    assert steps[0]["logprob_gap_abs"] < 0.05
    a = load_file(str(art.path / "step-00000003" / names.ADAPTER_WEIGHTS))
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in a.items())
    if kernel.available():
        assert kernel.last_backend() != kernel.BACKEND_REFERENCE
