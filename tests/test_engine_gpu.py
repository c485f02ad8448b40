"""The rollout engine on CUDA (bf16, packed kernel, CUDA-graph decode). Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from qerl_cli.engine import Engine, SamplingConfig
from qerl_cli.packed_model import pack_model_inplace

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    conf = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                       num_attention_heads=8, num_key_value_heads=2, initializer_range=0.08)
    m = LlamaForCausalLM(conf).to("cuda", torch.bfloat16).eval()
    return pack_model_inplace(m)


PROMPTS = [[1, 20, 300, 41, 77, 901, 12], [1, 3000, 4], [1, 9, 8, 7, 6, 5, 4, 3, 2000, 1500, 17, 18]]


def test_cuda_graph_decode_equals_eager(gpu_model):
    cfg = SamplingConfig(temperature=0, max_new_tokens=24)
    a = Engine(gpu_model, "cuda", cuda_graph=True).generate(PROMPTS, 2, cfg, 0, set(), 0)
    b = Engine(gpu_model, "cuda", cuda_graph=False).generate(PROMPTS, 2, cfg, 0, set(), 0)
    assert a.timings["cuda_graph"] and not b.timings["cuda_graph"]
    assert torch.equal(a.completion_ids, b.completion_ids)


def test_sampled_logprobs_match_teacher_forced_bf16(gpu_model):
    eng = Engine(gpu_model, "cuda")
    eng.set_noise(0.02, 1, scope="group", groups=len(PROMPTS), group_size=4)
    b = eng.generate(PROMPTS, 4, SamplingConfig(temperature=1.0, max_new_tokens=32), 5, set(), 0)
    with torch.no_grad():
        tf = eng.sequence_logprobs(b.prompt_ids, b.completion_ids, b.completion_mask, 1.0, 0, group=4).float().cpu()
    gap = (tf - b.behaviour_logprobs).abs()[b.completion_mask]
    # bf16 activations: prefill-with-cache and one-shot forwards round differently; measured bound, see README
    assert torch.isfinite(gap).all() and float(gap.max()) < 0.25 and float(gap.mean()) < 0.03


def test_seeded_rollout_reproduces_on_gpu(gpu_model):
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=16)
    eng = Engine(gpu_model, "cuda")
    eng.set_noise(0.05, 9)
    a = eng.generate(PROMPTS, 3, cfg, 11, set(), 0)
    eng.set_noise(0.05, 9)
    b = eng.generate(PROMPTS, 3, cfg, 11, set(), 0)
    assert torch.equal(a.completion_ids, b.completion_ids)


@pytest.mark.parametrize("packed", [True, False])
def test_fused_projections_on_cuda(gpu_model, packed):
    """One kernel launch for q/k/v and one for gate/up (the CUDA default) against separate launches."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    if packed:
        m = copy.deepcopy(gpu_model)
    else:
        torch.manual_seed(1)
        conf = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                           num_attention_heads=8, num_key_value_heads=2, initializer_range=0.08)
        m = LlamaForCausalLM(conf).to("cuda", torch.bfloat16).eval()
    plain, fused = Engine(m, "cuda", fuse=False), Engine(m, "cuda")
    assert set(fused.fused[0]) == {"qkv", "gate_up"}
    ids = torch.tensor([p + [5] * (12 - len(p)) for p in PROMPTS], device="cuda")
    pos = torch.arange(12, device="cuda")[None].expand_as(ids)
    key = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        a, b = plain.forward(ids, pos, key).float(), fused.forward(ids, pos, key).float()
    assert torch.isfinite(b).all()
    assert float((a - b).abs().max()) <= 0.05 * float(a.abs().max())  # bf16 rounding of a different split-K
    cfg = SamplingConfig(temperature=0, max_new_tokens=16)
    x = plain.generate(PROMPTS, 1, cfg, 0, set(), 0).completion_ids
    y = fused.generate(PROMPTS, 1, cfg, 0, set(), 0).completion_ids
    assert float((x[:, :4] == y[:, :4]).float().mean()) >= 0.75


def test_compiled_elementwise_decode(gpu_model):
    """QERL_ENGINE_COMPILE: norm / rope / residual / SwiGLU pieces compiled into fused kernels (inference only);
    the tokens and behaviour log-probs stay those of the eager policy up to bf16 rounding."""
    cfg = SamplingConfig(temperature=0, max_new_tokens=16)
    eager, comp = Engine(gpu_model, "cuda"), Engine(gpu_model, "cuda", compile_elementwise=True)
    x = eager.generate(PROMPTS, 2, cfg, 0, set(), 0).completion_ids
    y = comp.generate(PROMPTS, 2, cfg, 0, set(), 0).completion_ids
    assert float((x[:, :4] == y[:, :4]).float().mean()) >= 0.75
    b = comp.generate(PROMPTS, 4, SamplingConfig(temperature=1.0, max_new_tokens=24), 5, set(), 0)
    with torch.no_grad():
        tf = eager.sequence_logprobs(b.prompt_ids, b.completion_ids, b.completion_mask, 1.0, 0, group=4).float().cpu()
    gap = (tf - b.behaviour_logprobs).abs()[b.completion_mask]
    assert torch.isfinite(gap).all() and float(gap.max()) < 0.25 and float(gap.mean()) < 0.03


@pytest.mark.parametrize("lora_kernels", [False, True])
def test_batched_group_lora_on_cuda(gpu_model, lora_kernels):
    """A rank-8 adapter on every projection: the batched group terms (no-grad calls; in cuBLAS matmuls, or in the
    fused LoRA kernels as by default) against the per-member ones, CUDA graph and fused kernels on: greedy tokens
    agree, teacher-forced log-probs within bf16 rounding."""
    from qerl_cli.engine import LoRA

    factors = _random_factors(gpu_model, 8, 0)
    cfg = SamplingConfig(temperature=0, max_new_tokens=16)
    engines = []
    for batched in (False, True):
        eng = Engine(gpu_model, "cuda")
        eng.set_adapter(LoRA(factors, scaling=2.0))
        eng.batch_lora = batched
        eng.lora_kernels = lora_kernels
        engines.append(eng)
    b0, b1 = (e.generate(PROMPTS, 2, cfg, 0, set(), 0) for e in engines)
    plain = Engine(gpu_model, "cuda").generate(PROMPTS, 2, cfg, 0, set(), 0)
    assert not torch.equal(plain.completion_ids, b1.completion_ids)  # the adapter is applied
    assert float((b0.completion_ids[:, :4] == b1.completion_ids[:, :4]).float().mean()) >= 0.75
    with torch.no_grad():  # the same completions scored by both
        tf0, tf1 = (e.sequence_logprobs(b0.prompt_ids, b0.completion_ids, b0.completion_mask, 1.0, 0, group=2)
                    .float().cpu() for e in engines)
    gap = (tf0 - tf1).abs()[b0.completion_mask]
    assert torch.isfinite(gap).all() and float(gap.max()) < 0.25 and float(gap.mean()) < 0.03


def _packed_qwen2_with_biases():
    """A packed 3-layer Qwen2 on CUDA whose q/k/v biases are drawn large enough to matter."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    conf = Qwen2Config(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=3,
                       num_attention_heads=8, num_key_value_heads=2, initializer_range=0.08)
    m = Qwen2ForCausalLM(conf).eval()
    with torch.no_grad():
        for layer in m.model.layers:
            for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                p.bias.normal_(0, 0.5)
    return pack_model_inplace(m.to("cuda", torch.bfloat16))


def test_pdl_on_off_identical_packed_qwen2():
    """A packed Qwen2 model (q/k/v biases, added in the kernel's epilogue) through the CUDA-graph engine:
    programmatic dependent launch on and off give bit-identical tokens and behaviour log-probs, and the
    biases are really applied (the same engine without them samples differently)."""
    from qerl_cli import kernel

    m = _packed_qwen2_with_biases()
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=20)
    runs = []
    try:
        for pdl in (True, False):
            kernel.set_pdl(pdl)
            runs.append(Engine(m, "cuda").generate(PROMPTS, 3, cfg, 7, set(), 0))
    finally:
        kernel.set_pdl(True)
    a, b = runs
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.behaviour_logprobs, b.behaviour_logprobs)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.q_proj.bias.zero_()
            layer.self_attn.k_proj.bias.zero_()
    c = Engine(m, "cuda").generate(PROMPTS, 3, cfg, 7, set(), 0)
    assert not torch.equal(c.behaviour_logprobs, a.behaviour_logprobs)


def _random_factors(model, rank: int, seed: int) -> dict:
    """Rank-``rank`` LoRA factors (A, B) on every projection of ``model``, small enough to keep it sane."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    factors = {}
    for i, layer in enumerate(model.model.layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            lin = layer.get_submodule(name)
            factors[f"model.layers.{i}.{name}"] = (
                torch.randn(rank, lin.in_features, device="cuda", generator=g) * 0.05,
                torch.randn(lin.out_features, rank, device="cuda", generator=g) * 0.05)
    return factors


def _engines_with(model, factors: dict, attr: str) -> list[Engine]:
    """Two engines with the adapter ``factors``: ``attr`` off in the first, on in the second."""
    from qerl_cli.engine import LoRA

    engines = []
    for on in (False, True):
        eng = Engine(model, "cuda")
        eng.set_adapter(LoRA(factors, scaling=2.0))
        setattr(eng, attr, on)
        engines.append(eng)
    return engines


def _counting(calls: dict, name: str, fn):
    """``fn`` that adds 1 to ``calls[name]`` for every call that returns something (not None)."""
    def call(*args, **kw):
        out = fn(*args, **kw)
        calls[name] += out is not None
        return out
    return call


def _same_policy(greedy_off, greedy_on, eng: Engine, group: int = 4) -> None:
    """The policy of ``eng`` is the one without its fusion: greedy tokens agree on the first steps (a bf16
    near-tie may flip a later one), and the behaviour log-probs of a sampled rollout (``group`` samples per
    prompt) match the teacher-forced forward (which runs the matmul chain) within bf16 rounding."""
    assert float((greedy_off.completion_ids[:, :4] == greedy_on.completion_ids[:, :4]).float().mean()) >= 0.75
    s = eng.generate(PROMPTS, group, SamplingConfig(temperature=1.0, max_new_tokens=24), 5, set(), 0)
    with torch.no_grad():
        tf = eng.sequence_logprobs(s.prompt_ids, s.completion_ids, s.completion_mask, 1.0, 0,
                                   group=group).float().cpu()
    gap = (tf - s.behaviour_logprobs).abs()[s.completion_mask]
    assert torch.isfinite(gap).all() and float(gap.max()) < 0.25 and float(gap.mean()) < 0.03


def test_fused_lora_shrink_in_decode(gpu_model, monkeypatch):
    """Decode steps with an adapter: the q/k/v, gate/up and down shrinks ride in the norm and SiLU·mul kernels
    (counted), and the policy is the one without that fusion (``_same_policy``). Rank 6: rank rows that are not
    a multiple of the kernels' rows per block (the terms then stay out of the NVFP4 kernels)."""
    from qerl_cli import engine as engine_mod

    made = {"norm": 0, "silu": 0}
    monkeypatch.setattr(engine_mod._fk, "add_norm_shrink", _counting(made, "norm", engine_mod._fk.add_norm_shrink))
    monkeypatch.setattr(engine_mod._fk, "silu_mul_shrink", _counting(made, "silu", engine_mod._fk.silu_mul_shrink))
    off_eng, on_eng = _engines_with(gpu_model, _random_factors(gpu_model, 6, 1), "fused_shrink")
    greedy = SamplingConfig(temperature=0, max_new_tokens=16)
    off = off_eng.generate(PROMPTS, 2, greedy, 0, set(), 0)
    assert made == {"norm": 0, "silu": 0}
    on = on_eng.generate(PROMPTS, 2, greedy, 0, set(), 0)
    n_layers = len(gpu_model.model.layers)
    assert made["norm"] >= 2 * n_layers and made["silu"] >= n_layers, made  # (warm-up and graph capture)
    _same_policy(off, on, on_eng)


@pytest.mark.parametrize("rank", [16, 6])
def test_lora_in_kernel_decode(gpu_model, monkeypatch, rank):
    """Decode steps with an adapter (session 14): with rank 16 every projection of this model (all on small-M
    kernels at these rows) takes its LoRA term inside the NVFP4 kernel (counted: ``kernel.linear_lora`` returns
    outputs, and the o projection's shrink comes from ``fused.lora_shrink``); rank 6 is declined (rank rows not
    whole 16-row steps) and the expand kernels run. Either way the policy is the one without the term in the
    kernel (``_same_policy``)."""
    from qerl_cli import engine as engine_mod
    from qerl_cli import fused, kernel

    calls = {"in_kernel": 0, "shrink": 0}
    monkeypatch.setattr(engine_mod._kernel, "linear_lora", _counting(calls, "in_kernel", kernel.linear_lora))
    monkeypatch.setattr(engine_mod._fk, "lora_shrink", _counting(calls, "shrink", fused.lora_shrink))
    off_eng, on_eng = _engines_with(gpu_model, _random_factors(gpu_model, rank, 1), "lora_in_kernel")
    greedy = SamplingConfig(temperature=0, max_new_tokens=16)
    off = off_eng.generate(PROMPTS, 2, greedy, 0, set(), 0)
    assert calls == {"in_kernel": 0, "shrink": 0}
    on = on_eng.generate(PROMPTS, 2, greedy, 0, set(), 0)
    n_layers = len(gpu_model.model.layers)
    if rank == 16:  # q/k/v, o, gate/up, down per layer; o's shrink on its own (warm-up and graph capture at least)
        assert calls["in_kernel"] >= 4 * n_layers and calls["shrink"] >= n_layers, calls
    else:
        assert calls["in_kernel"] == 0, calls
    _same_policy(off, on, on_eng)


def test_lora_in_kernel_decode_above_16_rows(gpu_model, monkeypatch):
    """Decode steps of 24 rows (3 prompts x group 8: an RL rollout batch) with a rank-16 adapter (session 15): the
    fused shrinks stop at 16 rows, so the engine makes each shrink with a matmul (bf16) and every projection still
    takes its term inside the NVFP4 kernel (counted; ``fused.lora_shrink`` never called); the policy is the one
    without the term in the kernel (``_same_policy``)."""
    from qerl_cli import engine as engine_mod
    from qerl_cli import fused, kernel

    calls = {"in_kernel": 0, "shrink": 0}
    monkeypatch.setattr(engine_mod._kernel, "linear_lora", _counting(calls, "in_kernel", kernel.linear_lora))
    monkeypatch.setattr(engine_mod._fk, "lora_shrink", _counting(calls, "shrink", fused.lora_shrink))
    off_eng, on_eng = _engines_with(gpu_model, _random_factors(gpu_model, 16, 2), "lora_in_kernel")
    greedy = SamplingConfig(temperature=0, max_new_tokens=16)
    off = off_eng.generate(PROMPTS, 8, greedy, 0, set(), 0)
    assert calls == {"in_kernel": 0, "shrink": 0}
    on = on_eng.generate(PROMPTS, 8, greedy, 0, set(), 0)
    assert calls["in_kernel"] >= 4 * len(gpu_model.model.layers) and calls["shrink"] == 0, calls
    _same_policy(off, on, on_eng, group=8)  # (sampled at 24 rows too)


@pytest.mark.parametrize("adapter_on", ["none", "attention", "all"])
def test_silu_in_kernel_decode(gpu_model, monkeypatch, adapter_on):
    """(session 20) Where gate/up and down carry no LoRA term, a decode step's gate/up kernel writes silu(gate) * up
    itself (``kernel.linear_silu``, counted) and the SiLU·mul kernel is skipped; rollouts are bit-identical to the
    two-kernel route (variant v2w8 forced in both; at this model's shapes no row group is cut between blocks, so
    both sum in one order: kernel tests cover cut ones). An adapter on attention alone leaves it on. (Session 22)
    With one on every projection the gate/up group's term rides in that launch too (down's shrink then runs in
    fused.lora_shrink, not the SiLU·mul kernel: its fp32 sums in another order, so the same policy within bf16
    rounding, not the same bits); ``silu_lora_in_kernel`` off keeps the two kernels there."""
    from qerl_cli import engine as engine_mod
    from qerl_cli import kernel
    from qerl_cli.engine import LoRA

    calls = {"silu": 0}
    monkeypatch.setattr(engine_mod._kernel, "linear_silu", _counting(calls, "silu", kernel.linear_silu))
    factors = _random_factors(gpu_model, 16, 3)
    if adapter_on == "attention":
        factors = {k: v for k, v in factors.items() if "self_attn" in k}
    n_layers = len(gpu_model.model.layers)
    before = kernel.variant()
    kernel.set_variant("v2w8")
    try:
        def engine(on: bool, lora_on: bool = True) -> Engine:
            eng = Engine(gpu_model, "cuda")
            if adapter_on != "none":
                eng.set_adapter(LoRA(factors, scaling=2.0))
            eng.silu_in_kernel = on
            eng.silu_lora_in_kernel = lora_on
            return eng

        sampled = SamplingConfig(temperature=1.0, max_new_tokens=20)
        off = engine(False).generate(PROMPTS, 4, sampled, 7, set(), 0)
        assert calls["silu"] == 0
        on_eng = engine(True)
        on = on_eng.generate(PROMPTS, 4, sampled, 7, set(), 0)
        assert calls["silu"] >= n_layers, calls  # (prefill rows above 64 take the two kernels)
        if adapter_on != "all":
            assert torch.equal(off.completion_ids, on.completion_ids)
            assert torch.equal(off.behaviour_logprobs, on.behaviour_logprobs)
            return
        greedy = SamplingConfig(temperature=0, max_new_tokens=16)
        made = calls["silu"]
        two = engine(True, lora_on=False).generate(PROMPTS, 2, greedy, 0, set(), 0)
        assert calls["silu"] == made  # (the gate/up term keeps the two kernels)
        _same_policy(two, on_eng.generate(PROMPTS, 2, greedy, 0, set(), 0), on_eng)
    finally:
        kernel.set_variant(before)


def test_fused_sampler_in_decode(gpu_model, monkeypatch):
    """Decode steps at temperature > 0 without truncation draw in the fused sampling kernel (counted), with eos
    handling: a row that draws an eos stops (mask, finish reason), the behaviour log-probs match the teacher-
    forced forward; with top-p the torch path samples instead; a seeded rollout reproduces. Torch's sampler on the
    same engine gives the same token frequencies at the first step within sampling noise (256 rows)."""
    from qerl_cli import engine as engine_mod

    calls = {"n": 0}
    real = engine_mod._fk.sample_step

    def counting(*args):
        out = real(*args)
        calls["n"] += out is not None
        return out

    monkeypatch.setattr(engine_mod._fk, "sample_step", counting)
    eng = Engine(gpu_model, "cuda")
    cfg = SamplingConfig(temperature=0.9, max_new_tokens=20)
    eos = {5, 17, 300, 2000}  # frequent enough on a random model to end some rows early
    b = eng.generate(PROMPTS, 4, cfg, 3, eos, 0)
    assert calls["n"] >= 2
    ended = [r == "eos" for r in b.finish_reason]
    for i, e in enumerate(ended):
        row = b.completion_ids[i][b.completion_mask[i]]
        assert e == bool(row.numel() and int(row[-1]) in eos)  # an eos token ends the row, and only then
        assert not any(int(t) in eos for t in row[:-1])
        assert torch.equal(b.completion_mask[i], torch.arange(b.completion_mask.shape[1]) < row.numel())
    with torch.no_grad():
        tf = eng.sequence_logprobs(b.prompt_ids, b.completion_ids, b.completion_mask, 0.9, 0, group=4).float().cpu()
    gap = (tf - b.behaviour_logprobs).abs()[b.completion_mask]
    assert torch.isfinite(gap).all() and float(gap.max()) < 0.25 and float(gap.mean()) < 0.03
    assert torch.equal(b.behaviour_logprobs, b.tempered_logprobs)  # nothing truncated
    assert torch.equal(eng.generate(PROMPTS, 4, cfg, 3, eos, 0).completion_ids, b.completion_ids)
    n = calls["n"]
    eng.generate(PROMPTS, 2, SamplingConfig(temperature=0.9, top_p=0.9, max_new_tokens=8), 3, eos, 0)
    assert calls["n"] == n  # top-p: torch's truncation and multinomial
    one = SamplingConfig(temperature=0.3, max_new_tokens=1)  # (peaked: the frequencies carry weight)
    fast = eng.generate(PROMPTS[:1], 256, one, 4, set(), 0).completion_ids[:, 0]
    eng.fused_sampler = False
    slow = eng.generate(PROMPTS[:1], 256, one, 4, set(), 0).completion_ids[:, 0]
    top = torch.bincount(torch.cat([fast, slow]), minlength=4096).topk(5).indices
    f_fast = torch.stack([(fast == t).float().mean() for t in top])
    f_slow = torch.stack([(slow == t).float().mean() for t in top])
    assert float((f_fast - f_slow).abs().max()) < 0.15, (f_fast, f_slow)  # ~4 standard errors at p ~ 0.3


def test_nonfinite_logits_raise_on_gpu(gpu_model):
    """A NaN in the model's output (here a NaN lm_head row): the fused sampler never draws it, and the rollout
    ends with one clear error instead of tokens."""
    import copy

    from qerl_cli.errors import QerlError

    m = copy.deepcopy(gpu_model)
    with torch.no_grad():
        m.lm_head.weight[123] = float("nan")
    with pytest.raises(QerlError, match="not finite"):
        Engine(m, "cuda").generate(PROMPTS, 2, SamplingConfig(temperature=1.0, max_new_tokens=4), 0, set(), 0)


@pytest.mark.parametrize("graph", [True, False])
def test_nan_logits_raise_without_a_device_side_assert(gpu_model, graph):
    """NaN logits (here from the final norm) sent torch.multinomial into a device-side assert on CUDA, which kills
    the CUDA context; now the engine raises its sentence and the device keeps working."""
    import copy

    from qerl_cli.errors import QerlError

    broken = copy.deepcopy(gpu_model)
    with torch.no_grad():
        broken.model.norm.weight[3] = float("nan")
    cfg = SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=12)
    with pytest.raises(QerlError, match="logits are not finite .* at decode step 1 of 12"):
        Engine(broken, "cuda", cuda_graph=graph).generate(PROMPTS, 2, cfg, 0, set(), 0)
    del broken
    b = Engine(gpu_model, "cuda", cuda_graph=graph).generate(PROMPTS, 2, cfg, 0, set(), 0)
    torch.cuda.synchronize()
    assert b.rows == 6 and b.completion_mask.any()


def test_kept_decode_graph_equals_a_fresh_capture(gpu_model):
    """A call of the previous call's shapes replays the kept graph (no warm-up, no capture) on its own values:
    another per-group noise draw, adapter factors changed in place, shorter prompts in the same slot bucket; its
    rollout is bit-identical to a fresh engine's own capture, with the adapter (SDPA) and without (our decode
    attention kernel), and a changed kernel setting captures anew."""
    from qerl_cli import kernel
    from qerl_cli.engine import LoRA

    factors = _random_factors(gpu_model, 8, 1)
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=20)
    shorter = [p[:-1] for p in PROMPTS]

    def run(eng, noise_seed, prompts):
        eng.set_noise(0.02, noise_seed, scope="group", groups=len(prompts), group_size=2)
        return eng.generate(prompts, 2, cfg, 7, set(), 0)

    def same(a, b):
        return (torch.equal(a.completion_ids, b.completion_ids)
                and torch.equal(a.behaviour_logprobs, b.behaviour_logprobs))

    for adapter in (True, False):
        eng = Engine(gpu_model, "cuda")
        if adapter:
            eng.set_adapter(LoRA(factors, scaling=2.0))
        first = run(eng, 1, PROMPTS)
        assert first.timings["decode_state"] == "new" and first.timings["cache_slots"] == 32
        if adapter:
            with torch.no_grad():
                for _, b in eng.lora.factors.values():
                    b.mul_(1.5)
        again = run(eng, 2, shorter)
        assert again.timings["decode_state"] == "kept" and again.timings["cache_slots"] == 32
        fresh = Engine(gpu_model, "cuda")
        if adapter:
            fresh.set_adapter(eng.lora)
        ref = run(fresh, 2, shorter)
        assert ref.timings["decode_state"] == "new"
        assert same(again, ref) and not same(again, first)
        pdl = kernel.settings().get("pdl")
        if pdl is not None:
            kernel.set_pdl(not pdl)
            try:
                assert run(eng, 2, shorter).timings["decode_state"] == "new"
            finally:
                kernel.set_pdl(pdl)
    # torch's sampler (top-p, and greedy) writes its tokens into the kept graph's input: the same bits as fresh
    for trunc in (SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=20),
                  SamplingConfig(temperature=0.0, max_new_tokens=20)):
        eng = Engine(gpu_model, "cuda")
        assert eng.generate(PROMPTS, 2, trunc, 7, set(), 0).timings["decode_state"] == "new"
        again = eng.generate(shorter, 2, trunc, 8, set(), 0)
        assert again.timings["decode_state"] == "kept"
        assert same(again, Engine(gpu_model, "cuda").generate(shorter, 2, trunc, 8, set(), 0))


def test_dequant_layer_same_bits_as_one_launch_per_projection(monkeypatch):
    """Decode steps above the small-M range (3 prompts x 32 samples = 96 rows) and the teacher-forced pass over
    them: a layer's packed projections dequantized by one launch (Engine.dequant_layer) give bit-identical
    tokens, behaviour log-probs and log-probs to one dequantize per projection, with Qwen2's q/k/v biases, without
    and with a batched adapter; the one launch really runs (four weights per layer)."""
    from qerl_cli import kernel
    from qerl_cli.engine import LoRA

    m = _packed_qwen2_with_biases()
    calls, real = [], kernel.dequantize_many
    monkeypatch.setattr(kernel, "dequantize_many", lambda ws: calls.append(len(ws)) or real(ws))
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=20)
    for factors in (None, _random_factors(m, 8, 3)):
        runs = []
        for on in (True, False):
            calls.clear()
            eng = Engine(m, "cuda")
            eng.dequant_layer = on
            if factors is not None:
                eng.set_adapter(LoRA(factors, scaling=2.0))
            s = eng.generate(PROMPTS, 32, cfg, 7, set(), 0)
            with torch.no_grad():
                lp = eng.sequence_logprobs(s.prompt_ids, s.completion_ids, s.completion_mask, 1.0, 0, group=32)
            runs.append((s, lp))
            if on:
                assert len(calls) >= 2 * len(m.model.layers) and set(calls) == {4}, calls
            else:
                assert calls == []
        (a, lp_a), (b, lp_b) = runs
        assert a.completion_ids.shape[0] == 96
        assert torch.equal(a.completion_ids, b.completion_ids)
        assert torch.equal(a.behaviour_logprobs, b.behaviour_logprobs)
        assert torch.equal(lp_a, lp_b)


def test_attend_buckets_graphs_eager_kept_and_policy(gpu_model, monkeypatch):
    """With attend_buckets on (opt-in), decode steps in SDPA (this model's head dim is not the attention kernel's)
    attend over buckets of the cache's slots (ATTEND_BUCKET 16 here, a 64-slot cache): one graph per bucket from the
    first step's on, captured before the first step, each step over the smallest bucket that holds its slot; the
    eager engine attends over the same
    buckets and gives the same bits; a kept call whose shorter prompts need a lower bucket captures it alone and
    equals a fresh engine's capture; and the policy is the one over the whole cache (greedy tokens agree on the
    first steps, behaviour log-probs match the teacher-forced forward)."""
    from qerl_cli import engine as engine_mod

    monkeypatch.setattr(engine_mod, "ATTEND_BUCKET", 16)
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=40)
    longer = [p + [5] * (20 - len(p)) for p in PROMPTS]  # 20 prompt slots: the first step writes slot 20
    attended: list = []

    def recording(eng):
        real = eng.forward

        def forward(*a, **k):
            if k.get("norms") is not None:  # (the decoder's forwards: warm-ups, captures, eager steps)
                attended.append(k.get("attend"))
            return real(*a, **k)
        monkeypatch.setattr(eng, "forward", forward)
        return eng

    def bucketed(graph: bool = True) -> Engine:
        eng = Engine(gpu_model, "cuda", cuda_graph=graph)
        eng.attend_buckets = True  # (opt-in)
        return eng

    eng = recording(bucketed())
    assert eng._attend_bucket(6, 64) == 16
    a = eng.generate(longer, 2, cfg, 7, set(), 0)
    assert a.timings["cache_slots"] == 64 and a.timings["decode_state"] == "new"
    assert sorted(eng._graph.graphs) == [32, 48, 64]
    # two warm-ups before the first capture, one before each other capture
    assert attended == [32, 32, 32, 48, 48, 64, 64]
    attended.clear()
    eager = recording(bucketed(graph=False)).generate(longer, 2, cfg, 7, set(), 0)
    steps = a.timings["decode_steps"]
    assert attended == [engine_mod._attended(20 + j, 16, 64) for j in range(steps - 1)]
    assert torch.equal(eager.completion_ids, a.completion_ids)
    assert torch.equal(eager.behaviour_logprobs, a.behaviour_logprobs)
    attended.clear()
    again = eng.generate(PROMPTS, 2, cfg, 8, set(), 0)  # 12 prompt slots: bucket 16 too
    assert again.timings["decode_state"] == "kept" and sorted(eng._graph.graphs) == [16, 32, 48, 64]
    assert attended == [16, 16]  # one warm-up (the graph's lazy inits are done), the capture
    ref = bucketed().generate(PROMPTS, 2, cfg, 8, set(), 0)
    assert torch.equal(again.completion_ids, ref.completion_ids)
    assert torch.equal(again.behaviour_logprobs, ref.behaviour_logprobs)
    whole = Engine(gpu_model, "cuda")  # (the default: every step over the whole cache, one graph)
    greedy = SamplingConfig(temperature=0, max_new_tokens=40)
    off = whole.generate(longer, 2, greedy, 0, set(), 0)
    assert sorted(whole._graph.graphs, key=str) == [None]
    _same_policy(off, bucketed().generate(longer, 2, greedy, 0, set(), 0), bucketed())
