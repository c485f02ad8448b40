"""The rollout engine on CPU (fp32): HF parity, behaviour log-probs, sampling, AQN and LoRA."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from qerl_cli import artifact, layout, names, pack, packed_model, quantize, verify
from qerl_cli.engine import Engine, LoRA, SamplingConfig
from qerl_cli.errors import QerlError

EOS, PAD = 2, 2


@pytest.fixture(scope="module")
def packed_dir(tmp_path_factory, smollm2_tokenizer):
    """A tiny Llama with weights large enough that greedy decoding is not degenerate, quantized and packed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("engine")
    torch.manual_seed(0)
    conf = LlamaConfig(vocab_size=len(smollm2_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, initializer_range=0.15,
                       tie_word_embeddings=True, eos_token_id=EOS, pad_token_id=PAD, bos_token_id=1)
    m = LlamaForCausalLM(conf)
    m.save_pretrained(str(root / "model"))
    smollm2_tokenizer.save_pretrained(str(root / "model"))
    quantize.quantize(str(root / "model"), root / "quant", progress=False)
    pack.pack(root / "quant", root / "packed", progress=False)
    verify.verify(root / "packed", root / "verify", progress=False)
    return root


@pytest.fixture(scope="module")
def model(packed_dir):
    return packed_model.load_packed_model(artifact.open_artifact(packed_dir / "packed", names.KIND_PACKED))


PROMPTS = [[1, 520, 33, 41, 77, 901, 12], [1, 3000, 4], [1, 9, 8, 7, 6, 5, 4, 3, 2000, 1500]]


def test_greedy_matches_hf_generate(model):
    eng = Engine(model)
    out = eng.generate(PROMPTS, 1, SamplingConfig(temperature=0, max_new_tokens=20), 0, {EOS}, PAD)
    for i, p in enumerate(PROMPTS):
        ref = model.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=EOS, pad_token_id=PAD)
        ours = out.completion_ids[i][out.completion_mask[i]].tolist()
        assert ours == ref[0, len(p):].tolist()
    assert len(set(out.completion_ids[0].tolist())) > 3  # not a degenerate repeat: the test has teeth


def test_early_eos_trims_the_batch_to_its_last_live_token(model):
    """Every row ends on its first token: the batch is one token wide although the loop checks for the end
    only every few steps, and nothing after eos is kept."""
    eng = Engine(model)
    greedy = SamplingConfig(temperature=0, max_new_tokens=20)
    first = eng.generate(PROMPTS, 1, greedy, 0, set(), PAD).completion_ids[:, 0]
    out = eng.generate(PROMPTS, 1, greedy, 0, set(first.tolist()), PAD)
    assert out.completion_ids.shape == (len(PROMPTS), 1) and out.completion_mask.all()
    assert torch.equal(out.completion_ids[:, 0], first)
    assert out.finish_reason == ["eos"] * len(PROMPTS) and out.timings["decode_steps"] == 1


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_equal_teacher_forced(model, temperature):
    eng = Engine(model)
    b = eng.generate(PROMPTS, 4, SamplingConfig(temperature=temperature, max_new_tokens=24), 3, {EOS}, PAD)
    with torch.no_grad():
        tf = eng.sequence_logprobs(b.prompt_ids, b.completion_ids, b.completion_mask, temperature, PAD, group=4)
    assert torch.equal(b.behaviour_logprobs, b.tempered_logprobs)  # no truncation: the two definitions agree
    assert (tf - b.behaviour_logprobs).abs().max() <= 1e-4
    assert (b.behaviour_logprobs[b.completion_mask] < 0).all()


def test_top_p_logprobs_are_of_the_truncated_distribution(model):
    eng = Engine(model)
    b = eng.generate(PROMPTS, 4, SamplingConfig(temperature=1.0, top_p=0.5, max_new_tokens=16), 5, {EOS}, PAD)
    with torch.no_grad():
        tf = eng.sequence_logprobs(b.prompt_ids, b.completion_ids, b.completion_mask, 1.0, PAD, group=4)
    m = b.completion_mask
    assert (tf - b.tempered_logprobs).abs().max() <= 1e-4  # the untruncated one is what a forward gives
    assert (b.behaviour_logprobs[m] >= b.tempered_logprobs[m] - 1e-6).all()  # renormalized over the nucleus
    assert (b.behaviour_logprobs[m] > b.tempered_logprobs[m] + 1e-3).any()


def test_sampling_rules():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).repeat(4000, 1)
    tok, lb, lt = Engine.sample(logits, SamplingConfig(temperature=0), None)
    assert (tok == 0).all() and (lb == 0).all()
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(logits[0], -1)
    nucleus = {0, 1}  # p0 = 0.56 < 0.7, p0 + p1 = 0.77 >= 0.7
    assert probs[0] < 0.7 <= probs[0] + probs[1]
    tok, lb, _ = Engine.sample(logits, SamplingConfig(temperature=1.0, top_p=0.7), g)
    assert set(tok.tolist()) == nucleus
    expect = torch.log(probs[tok] / probs[:2].sum())
    torch.testing.assert_close(lb, expect)
    tok, _, _ = Engine.sample(logits, SamplingConfig(temperature=1.0, top_k=3), g)
    assert set(tok.tolist()) == {0, 1, 2}
    tok, _, _ = Engine.sample(logits, SamplingConfig(temperature=1.0), g)
    freq = torch.bincount(tok, minlength=6).float() / len(tok)
    assert (freq - probs).abs().max() < 0.03


def test_finite_rows_flags_and_neutralizes_nan_and_inf_rows():
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[1.0, 2.0, 3.0], [nan, 0.0, 1.0], [inf, 0.0, 1.0], [-inf, 0.0, 1.0], [3e38, 3e38, 0.0]])
    out, flag = Engine.finite_rows(logits)
    assert bool(flag) and torch.isfinite(out).all()
    assert torch.equal(out[0], logits[0]) and (out[1:] == 0).all()  # (3e38: past fp32 once summed or tempered)
    _, flag = Engine.finite_rows(logits, torch.tensor([True, False, False, False, False]))
    assert not bool(flag)  # the rows with NaN/Inf do not count (finished rows)
    g = torch.Generator().manual_seed(0)
    Engine.sample(out, SamplingConfig(temperature=0.7, top_p=0.9, top_k=2), g)  # multinomial accepts them


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.0), dict(temperature=0.8, top_p=0.9,
                                                                                             top_k=5)])
def test_nan_logits_are_a_clear_error_not_a_multinomial_crash(model, sampling):
    """A NaN in the model (here the final norm) made torch.multinomial raise a RuntimeError (on CUDA: a device-side
    assert that kills the process); greedy decoding returned argmax-of-NaN tokens as if nothing were wrong."""
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.model.norm.weight[5] = float("nan")
    with pytest.raises(QerlError, match=r"logits are not finite \(NaN or Inf\) at decode step 1 of 6.*adapter"):
        Engine(broken).generate(PROMPTS, 2, SamplingConfig(max_new_tokens=6, **sampling), 0, {EOS}, PAD)


def test_nan_logits_mid_rollout_stop_at_the_next_sync_point(model, monkeypatch):
    """Logits of one row turn NaN at decode step 5: the loop (which reads the device only every 8 steps) stops at
    step 8 instead of decoding all 40, and raises instead of returning the batch."""
    calls = []
    make = Engine._decoder

    def decoder(self, *a, **k):
        step, how = make(self, *a, **k)

        def poisoned(tok):
            calls.append(1)
            logits = step(tok)
            if len(calls) == 4:  # the logits of the 5th generated token
                logits = logits.clone()
                logits[1, 7] = float("nan")
            return logits

        return poisoned, how

    monkeypatch.setattr(Engine, "_decoder", decoder)
    with pytest.raises(QerlError, match="at decode step 5 of 40"):
        Engine(model).generate(PROMPTS, 2, SamplingConfig(temperature=1.0, max_new_tokens=40), 0, set(), PAD)
    assert len(calls) == 7  # decode steps 2..8; the check at step 8 ended the loop
    monkeypatch.setattr(Engine, "_decoder", make)
    assert Engine(model).generate(PROMPTS, 2, SamplingConfig(max_new_tokens=10), 0, set(), PAD).rows == 6


def test_noise_zero_is_bit_identical_and_seed_reproduces(model):
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=12)
    a = Engine(model).generate(PROMPTS, 2, cfg, 7, {EOS}, PAD)
    eng = Engine(model)
    eng.set_noise(0.0, 123)
    b = eng.generate(PROMPTS, 2, cfg, 7, {EOS}, PAD)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.behaviour_logprobs, b.behaviour_logprobs)
    eng.set_noise(0.05, 11)
    c = eng.generate(PROMPTS, 2, cfg, 7, {EOS}, PAD)
    eng.set_noise(0.05, 11)
    d = eng.generate(PROMPTS, 2, cfg, 7, {EOS}, PAD)
    assert torch.equal(c.completion_ids, d.completion_ids) and torch.equal(c.behaviour_logprobs, d.behaviour_logprobs)
    assert not torch.equal(a.behaviour_logprobs, c.behaviour_logprobs)


def test_noise_never_accumulates(model):
    eng = Engine(model)
    sigma = 0.02
    clean = eng.clean[0]["input_layernorm"].clone()
    for i in range(200):
        eng.set_noise(sigma, i)
    dev = eng.effective_norm_weights()[0]["input_layernorm"] - clean
    assert abs(float(dev.std()) - sigma) < 0.25 * sigma  # accumulating would give sigma * sqrt(200) ~ 14 sigma
    assert eng.noise.draws == 200 and eng.noise.seed == 199
    assert torch.equal(eng.clean[0]["input_layernorm"], clean)
    assert torch.equal(model.model.layers[0].input_layernorm.weight, clean)  # the model itself is untouched


def _engine_and_noisy_copy(model, eng):
    """(the engine's logits on PROMPTS[0], those ids, a copy of ``model`` whose two norms per layer hold the
    engine's current draw)."""
    ids = torch.tensor([PROMPTS[0]])
    noisy = copy.deepcopy(model)
    with torch.no_grad():
        ours = eng.forward(ids, torch.arange(ids.shape[1])[None], torch.ones_like(ids, dtype=torch.bool))
        for layer, w in zip(noisy.model.layers, eng.effective_norm_weights()):
            layer.input_layernorm.weight.copy_(w["input_layernorm"])
            layer.post_attention_layernorm.weight.copy_(w["post_attention_layernorm"])
    return ours, ids, noisy


def test_noise_reaches_the_norms_that_generate(model):
    """Engine logits under a draw equal a HF forward of a model whose two norms per layer hold that draw."""
    eng = Engine(model)
    eng.set_noise(0.1, 5)
    ours, ids, noisy = _engine_and_noisy_copy(model, eng)
    with torch.no_grad():
        ref = noisy(ids).logits
        clean = model(ids).logits
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    assert (ours - clean).abs().max() > 1e-2
    assert torch.equal(eng.final_norm, model.model.norm.weight)  # final norm excluded


@pytest.mark.parametrize("scope", ["batch", "group"])
def test_final_norm_noise_only_when_asked(model, scope):
    """final_norm=True also perturbs model.norm's scale (drawn after the layers': their draws are the seed's
    without it); the engine's logits equal a HF forward whose three norms hold the draw; behaviour log-probs
    equal a teacher-forced forward under it (per group too); the model itself stays clean."""
    kw = dict(scope=scope, groups=3, group_size=2) if scope == "group" else {}
    eng = Engine(model)
    eng.set_noise(0.1, 5, **kw)
    layers = [{t: v.clone() for t, v in d.items()} for d in eng.effective_norm_weights()]
    assert torch.equal(eng.effective_final_norm(), model.model.norm.weight) and not eng.noise.final_norm
    ns = eng.set_noise(0.1, 5, final_norm=True, **kw)
    assert ns.final_norm and ns.as_dict()["final_norm"] is True
    assert all(torch.equal(a[t], b[t]) for a, b in zip(layers, eng.effective_norm_weights()) for t in a)
    fw = eng.effective_final_norm()
    dev = (fw.reshape(-1, fw.shape[-1])[0] - model.model.norm.weight).float()
    assert 0.05 < float(dev.std()) < 0.15
    if scope == "group":
        assert fw.shape == (6, 1, 64) and torch.equal(fw[0], fw[1]) and not torch.equal(fw[1], fw[2])
    else:
        ours, ids, noisy = _engine_and_noisy_copy(model, eng)
        with torch.no_grad():
            noisy.model.norm.weight.copy_(fw)
            torch.testing.assert_close(ours, noisy(ids).logits, rtol=1e-4, atol=1e-4)
            without = copy.deepcopy(noisy)
            without.model.norm.weight.copy_(model.model.norm.weight)
            assert (ours - without(ids).logits).abs().max() > 1e-2
    b = eng.generate(PROMPTS, 2, SamplingConfig(temperature=1.0, max_new_tokens=8), 3, {EOS}, PAD)
    with torch.no_grad():
        tf = eng.sequence_logprobs(b.prompt_ids, b.completion_ids, b.completion_mask, 1.0, PAD, group=2)
    assert (tf - b.behaviour_logprobs)[b.completion_mask].abs().max() <= 1e-4
    assert not torch.equal(model.model.norm.weight, fw.reshape(-1, fw.shape[-1])[0])
    eng.set_noise(0.0, 5, final_norm=True)
    assert torch.equal(eng.effective_final_norm(), eng.final_norm) and not eng.noise.final_norm


def test_group_scope_shares_noise_within_groups(model):
    eng = Engine(model)
    eng.set_noise(0.05, 1, scope="group", groups=3, group_size=2)
    w = eng.effective_norm_weights()[1]["post_attention_layernorm"]
    assert w.shape[0] == 6
    assert torch.equal(w[0], w[1]) and torch.equal(w[2], w[3]) and not torch.equal(w[1], w[2])
    b = eng.generate(PROMPTS, 2, SamplingConfig(temperature=1.0, max_new_tokens=10), 3, {EOS}, PAD)
    with torch.no_grad():
        tf = eng.sequence_logprobs(b.prompt_ids, b.completion_ids, b.completion_mask, 1.0, PAD, group=2)
    assert (tf - b.behaviour_logprobs).abs().max() <= 1e-4


@pytest.mark.parametrize("groups,group_size,says", [(1, 1, "covers 1 rows"), (3, 1, "covers 3 rows"),
                                                     (2, 2, "covers 4 rows"), (6, 1, "has 6 groups of 1 rows")])
def test_group_noise_for_another_batch_is_refused(model, groups, group_size, says):
    """A per-group draw made for another batch shape is one clear error, not a silent broadcast (a one-row draw
    would give every prompt the same noise while the rollout logs it as per group; review, session 19). (review,
    session 31) So is one of the right row count in groups of another size: 6 groups of 1 for 3 prompts x G = 2
    ran each prompt's prefill under one row's draw and its other row's decode under another."""
    eng = Engine(model)
    eng.set_noise(0.05, 1, scope="group", groups=groups, group_size=group_size)
    with pytest.raises(QerlError, match=rf"per-group noise draw {says}, but this batch has 3 prompts x G = 2"):
        eng.generate(PROMPTS, 2, SamplingConfig(temperature=1.0, max_new_tokens=4), 3, {EOS}, PAD)


def test_a_model_whose_mlp_is_not_silu_is_refused(model):
    """(review, session 31) The engine computes SiLU(gate) * up whatever the config says: a Llama with hidden_act
    'gelu' passed quantize, pack and verify, and its rollouts sampled from another function than the model's."""
    import copy

    other = copy.deepcopy(model)
    other.config.hidden_act = "gelu"
    with pytest.raises(QerlError, match="computes SiLU MLPs, but this model's hidden_act is 'gelu'"):
        Engine(other)


def test_lora_applied_beside_the_base_and_swappable(model):
    eng = Engine(model)
    g = torch.Generator().manual_seed(0)
    name = "model.layers.0.mlp.down_proj"
    a, b = torch.randn(4, 128, generator=g) * 0.3, torch.randn(64, 4, generator=g) * 0.3
    ids = torch.tensor([PROMPTS[2]])
    key = torch.ones_like(ids, dtype=torch.bool)
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        base = eng.forward(ids, pos, key)
        eng.set_adapter(LoRA({name: (a, b)}, scaling=2.0))
        with_lora = eng.forward(ids, pos, key)
        merged = copy.deepcopy(model)
        lin = merged.get_submodule(name)
        dense = torch.nn.Linear(128, 64, bias=False)
        dense.weight.copy_(lin.dequantized_weight() + 2.0 * b @ a)
        parent = merged.get_submodule("model.layers.0.mlp")
        parent.down_proj = dense
        ref = merged(ids).logits
        eng.set_adapter(None)
        again = eng.forward(ids, pos, key)
    torch.testing.assert_close(with_lora, ref, rtol=1e-4, atol=1e-4)
    assert (with_lora - base).abs().max() > 1e-2
    assert torch.equal(again, base)
    # a module the forward never adds LoRA terms to (tied lm_head here) is refused, not silently dropped
    v = model.lm_head.weight.shape[0]
    with pytest.raises(QerlError, match="projections only"):
        eng.set_adapter(LoRA({"lm_head": (torch.zeros(4, 64), torch.zeros(v, 4))}, scaling=1.0))
    assert eng.lora is None


def _peft(qlora, model, targets):
    """``model`` wrapped in peft LoRA (rank 4) on ``targets``, its factors drawn non-zero."""
    pm = qlora.wrap(model, 4, 8.0, targets, 0)
    with torch.no_grad():
        for _, p in qlora.trainable(pm):
            p.normal_(0, 0.1)
    return pm


def _lora_factors(model, names_, rank=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n in names_:
        lin = model.get_submodule(n)
        out[n] = (torch.randn(rank, lin.in_features, generator=g) * 0.3, torch.randn(lin.out_features, rank, generator=g) * 0.3)
    return out


def test_fused_projections_equal_separate_ones(model):
    """q/k/v and gate/up as one matmul each (the CUDA default) give the same outputs, with and without LoRA, and
    leave the model's values untouched (its weights become views of the fused buffer)."""
    m = copy.deepcopy(model)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    plain = Engine(m, fuse=False)
    fused = Engine(m, fuse=True)
    assert set(fused.fused[0]) == {"qkv", "gate_up"} and not plain.fused[0]
    attn = m.model.layers[1].self_attn
    buf = fused.fused[1]["qkv"].base.qweight
    assert attn.k_proj.qweight.data_ptr() == buf[attn.q_proj.qweight.shape[0]:].data_ptr()  # a view, not a copy
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())
    assert Engine(m, fuse=True).fused[1]["qkv"].base.qweight.data_ptr() == buf.data_ptr()  # reused, not re-copied
    ids = torch.tensor([PROMPTS[0], PROMPTS[2][:7]])
    key = torch.ones_like(ids, dtype=torch.bool)
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    lora = LoRA(_lora_factors(m, ["model.layers.0.self_attn.k_proj", "model.layers.1.mlp.up_proj",
                                  "model.layers.1.mlp.down_proj"]), scaling=2.0)
    with torch.no_grad():
        for adapter in (None, lora):
            plain.set_adapter(adapter)
            fused.set_adapter(adapter)
            torch.testing.assert_close(fused.forward(ids, pos, key), plain.forward(ids, pos, key), rtol=1e-5, atol=1e-5)
    cfg = SamplingConfig(temperature=0, max_new_tokens=16)
    assert torch.equal(fused.generate(PROMPTS, 2, cfg, 0, {EOS}, PAD).completion_ids,
                       plain.generate(PROMPTS, 2, cfg, 0, {EOS}, PAD).completion_ids)


def test_batched_group_lora_equals_per_member_terms(model):
    """No-grad calls compute a fused group's LoRA as one batched pair (members' A stacked, B block-diagonal):
    same behaviour log-probs, tokens and teacher-forced log-probs as the per-member terms, for adapter factors
    on some members (ranks differing) and for peft-wrapped modules; terms that cannot be batched fall back."""
    from qerl_cli import engine as E
    from qerl_cli import lora as qlora

    m = copy.deepcopy(model)
    factors = _lora_factors(m, ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj",
                                "model.layers.1.mlp.gate_proj", "model.layers.0.self_attn.o_proj",
                                "model.layers.1.mlp.down_proj"])
    factors["model.layers.0.self_attn.v_proj"] = _lora_factors(m, ["model.layers.0.self_attn.v_proj"], rank=7)[
        "model.layers.0.self_attn.v_proj"]
    pm = _peft(qlora, copy.deepcopy(model), ("k_proj", "up_proj", "o_proj"))
    comp = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    mask = torch.ones_like(comp, dtype=torch.bool)
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=12)
    for base, lora in ((m, LoRA(factors, scaling=2.0)), (pm.get_base_model(), None)):
        res = []
        for batched in (False, True):
            eng = Engine(base, fuse=True)
            eng.set_adapter(lora)
            eng.batch_lora = batched
            snap = eng._snapshot_lora()
            assert (snap is None) != batched
            if batched:  # every group batched, and at least one with LoRA terms
                # both groups and the two single linears (o, down) of every layer
                assert len(snap) == 4 * len(eng.layers) and any(v is not E._NO_LORA for v in snap.values())
            b = eng.generate(PROMPTS, 2, cfg, 3, {EOS}, PAD)
            with torch.no_grad():
                tf = eng.sequence_logprobs([PROMPTS[0], PROMPTS[1]], comp, mask, 1.0, PAD)
            res.append((b, tf))
            assert eng._lora_snap is None  # dropped when the call ends
        (b0, tf0), (b1, tf1) = res
        assert torch.equal(b0.completion_ids, b1.completion_ids)
        torch.testing.assert_close(b1.behaviour_logprobs, b0.behaviour_logprobs, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tf1, tf0, rtol=1e-5, atol=1e-5)
        eng.set_adapter(None)
        if lora is not None:  # the terms matter: without the adapter the log-probs move
            with torch.no_grad():
                assert float((eng.sequence_logprobs([PROMPTS[0], PROMPTS[1]], comp, mask, 1.0, PAD) - tf1).abs().max()) > 1e-3
    # under autocast (the train stage's rollouts on CUDA): the batched terms run in the autocast dtype as peft's do
    outs = []
    for batched in (False, True):
        eng = Engine(pm.get_base_model(), fuse=True)
        eng.batch_lora = batched
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            outs.append(eng.sequence_logprobs([PROMPTS[0], PROMPTS[1]], comp, mask, 1.0, PAD).float())
    gap = (outs[0] - outs[1]).abs()
    assert torch.isfinite(gap).all() and float(gap.max()) < 0.1 and float(gap.mean()) < 0.02
    eng = Engine(m, fuse=True)
    eng.set_adapter(LoRA(factors, scaling=2.0))
    f = eng.fused[0]["qkv"]
    a, bs, segs = E._lora_terms(f.modules, f.names, f.sizes, eng.lora)
    assert a.shape == (4 + 7, m.config.hidden_size) and bs.shape == (11, sum(f.sizes))
    q_end, k_end = f.sizes[0], f.sizes[0] + f.sizes[1]
    assert segs == (q_end, 0, 4, k_end, 4, 4, sum(f.sizes), 4, 11)  # each member's columns and rank rows
    assert float(bs[:, f.sizes[0]: f.sizes[0] + f.sizes[1]].abs().max()) == 0.0  # k has no term: zero block
    q_b = factors["model.layers.0.self_attn.q_proj"][1]
    assert torch.equal(bs[:4, : f.sizes[0]], q_b.t() * 2.0) and float(bs[4:, : f.sizes[0]].abs().max()) == 0.0
    peft_eng = Engine(pm.get_base_model(), fuse=True)
    peft_eng.set_adapter(LoRA({"model.layers.0.self_attn.k_proj": factors["model.layers.0.self_attn.q_proj"]},
                              scaling=2.0))
    g = peft_eng.fused[0]["qkv"]
    assert E._lora_terms(g.modules, g.names, g.sizes, peft_eng.lora) is None  # peft and adapter on one member


def test_fused_projections_carry_peft_lora_and_gradients(model):
    from qerl_cli import lora as qlora

    pm = _peft(qlora, copy.deepcopy(model), ("q_proj", "v_proj", "up_proj"))
    comp = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    mask = torch.ones_like(comp, dtype=torch.bool)
    res = []
    for fuse in (False, True):
        eng = Engine(pm.get_base_model(), fuse=fuse)
        pm.zero_grad()
        lp = eng.sequence_logprobs([PROMPTS[0], PROMPTS[1]], comp, mask, 1.0, PAD)
        lp.sum().backward()
        res.append((lp.detach(), [p.grad.clone() for _, p in qlora.trainable(pm)]))
    torch.testing.assert_close(res[0][0], res[1][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(res[0][1], res[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert any(g.abs().max() > 0 for g in res[1][1])


def test_teacher_forced_logprobs_in_row_chunks(model, monkeypatch):
    """The vocabulary projection runs a few rows at a time (recomputed in the backward): same values and
    gradients as one whole-batch projection."""
    from qerl_cli import engine as eng_mod
    from qerl_cli import lora as qlora

    pm = _peft(qlora, copy.deepcopy(model), ("q_proj", "down_proj"))
    eng = Engine(pm.get_base_model())
    comp = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    res = []
    for chunk_rows in (None, 1):
        if chunk_rows is not None:  # one row per projection
            monkeypatch.setattr(eng_mod, "LOGIT_CHUNK_ELEMENTS", 4 * model.lm_head.weight.shape[0])
        pm.zero_grad()
        lp = eng.sequence_logprobs([PROMPTS[0], PROMPTS[1], PROMPTS[2]], comp, mask, 0.8, PAD)
        (lp * torch.arange(1, 13).view(3, 4)).sum().backward()
        res.append((lp.detach(), [p.grad.clone() for _, p in qlora.trainable(pm)]))
    torch.testing.assert_close(res[0][0], res[1][0], rtol=0, atol=1e-6)
    for a, b in zip(res[0][1], res[1][1]):  # (fp32 sums in another order: within 1e-5 of the gradient's scale)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
    assert float(res[0][0][2, 1:].abs().max()) == 0.0  # masked positions are 0
    full = torch.log_softmax(eng.forward(*_tf_inputs(PROMPTS[1], comp[1])).float() / 0.8, -1)
    ref = full[0, len(PROMPTS[1]) - 1: len(PROMPTS[1]) + 3].gather(-1, comp[1][:, None]).squeeze(-1)
    torch.testing.assert_close(res[1][0][1], ref.detach(), rtol=0, atol=1e-5)


def _tf_inputs(prompt, completion):
    ids = torch.tensor([list(prompt) + completion.tolist()])
    return ids, torch.arange(ids.shape[1])[None], torch.ones_like(ids, dtype=torch.bool)


def test_cuda_elementwise_variants_equal_the_reference_ops():
    """The CUDA op set (torch's fused RMSNorm) and the single-pass rotary of q and k compute what the CPU
    reference ops compute (checked here on CPU, where both run)."""
    from qerl_cli import engine as E

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(64, generator=g)).to(torch.bfloat16)
    for wt in (w, w * (1 + 0.01 * torch.randn(3, 1, 64, generator=g)).to(torch.bfloat16)):  # shared; per row
        a, b = E._rms_norm(x, wt, 1e-5).float(), E._rms_norm_fused(x, wt, 1e-5).float()
        assert float((a - b).abs().max()) <= 2 ** -7 * float(a.abs().max())  # at most bf16 rounding apart
    q, k = torch.randn(3, 4, 5, 16, generator=g), torch.randn(3, 2, 5, 16, generator=g)
    cos, sin = torch.randn(3, 5, 16, generator=g), torch.randn(3, 5, 16, generator=g)
    rq, rk = E._rope(q, k, cos.unsqueeze(1), sin.unsqueeze(1))
    qk = E._rope1(torch.cat([q, k], 1).transpose(1, 2), cos.unsqueeze(2), sin.unsqueeze(2)).transpose(1, 2)
    assert torch.equal(qk[:, :4], rq) and torch.equal(qk[:, 4:], rk)


def test_cuda_norm_keeps_the_activation_dtype_under_an_fp32_autocast_policy(monkeypatch):
    """CUDA autocast runs rms_norm in fp32 and returns fp32; the fused norm must hand the layer bf16 back (else
    the whole residual stream and every packed matmul after it silently run in fp32)."""
    from qerl_cli import engine as E

    real = F.rms_norm
    monkeypatch.setattr(E.F, "rms_norm", lambda x, shape, weight=None, eps=None:
                        real(x.float(), shape, None if weight is None else weight.float(), eps=eps))
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    assert E._rms_norm_fused(x, w, 1e-5).dtype == torch.bfloat16
    h, y = E._CUDA_OPS.add_norm(x, x, w, 1e-5)
    assert h.dtype == y.dtype == torch.bfloat16


def test_fused_projections_with_fp32_peft_factors_on_bf16_weights(packed_dir):
    """peft keeps the LoRA factors in fp32; without autocast their term must come back to the activations'
    dtype on the fused path as on peft's own (bf16 packed model on CPU)."""
    from qerl_cli import lora as qlora

    m = packed_model.load_packed_model(artifact.open_artifact(packed_dir / "packed", names.KIND_PACKED),
                                       dtype=torch.bfloat16)
    pm = _peft(qlora, m, ("q_proj", "v_proj", "up_proj"))
    comp = torch.tensor([[5, 6, 7], [8, 9, 10]])
    mask = torch.ones_like(comp, dtype=torch.bool)
    out = []
    for fuse in (False, True):
        eng = Engine(pm.get_base_model(), fuse=fuse)
        with torch.no_grad():
            out.append(eng.sequence_logprobs([PROMPTS[0], PROMPTS[1]], comp, mask, 1.0, PAD))
        b = eng.generate([PROMPTS[0]], 2, SamplingConfig(temperature=0, max_new_tokens=4), 0, {EOS}, PAD)
        assert b.completion_ids.shape[0] == 2
    assert out[1].dtype == out[0].dtype
    torch.testing.assert_close(out[1], out[0], rtol=0.05, atol=0.05)


def _add_norm_torch(h, d, w, eps):
    """fused.add_norm by its torch definition (the CPU plumbing tests)."""
    from qerl_cli import engine as E

    s = h if d is None else h + d
    return s, E._rms_norm_fused(s, w, eps)


def _rope_kv_torch(y, cos, sin, kc, vc, slot0, n_heads):
    """fused.rope_kv by its torch definition (the CPU plumbing tests)."""
    from qerl_cli import engine as E

    b, t, _ = y.shape
    d, kv = kc.shape[-1], kc.shape[1]
    qk = E._rope1(y[..., : (n_heads + kv) * d].view(b, t, n_heads + kv, d), cos.unsqueeze(2), sin.unsqueeze(2))
    slots = slot0.reshape(1) + torch.arange(t)
    kc.index_copy_(2, slots, qk[:, :, n_heads:].transpose(1, 2))
    vc.index_copy_(2, slots, y[..., (n_heads + kv) * d:].view(b, t, kv, d).transpose(1, 2))
    return qk[:, :, :n_heads].transpose(1, 2).contiguous()


def test_fused_kernel_path_plumbing_on_cpu(model, monkeypatch):
    """The engine's fused-kernel path (CUDA-only kernels) with the kernels replaced by their torch definitions,
    so its plumbing runs on CPU: the previous layer's MLP output added inside the next norm, the additive mask,
    rotary + KV-cache writes at ``slot0 + t`` in prefill and decode, the final residual add. Same tokens and
    log-probs as the plain path (fp32)."""
    from qerl_cli import engine as E

    calls = {"add_norm": 0, "rope_kv": 0, "silu_mul": 0}

    def counted(name, f):
        def g(*a):
            calls[name] += 1
            return f(*a)
        return g

    monkeypatch.setattr(E._fk, "add_norm", counted("add_norm", _add_norm_torch))
    monkeypatch.setattr(E._fk, "rope_kv", counted("rope_kv", _rope_kv_torch))
    monkeypatch.setattr(E._fk, "silu_mul", counted("silu_mul", lambda g, u: F.silu(g) * u))
    plain, kern = Engine(model, fuse=True), Engine(model, fuse=True)
    monkeypatch.setattr(kern, "_use_kernels", lambda h: not torch.is_grad_enabled())
    for eng in (plain, kern):
        eng.set_noise(0.05, 4, scope="group", groups=len(PROMPTS), group_size=2)  # per-row norm weights too
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=10)
    a = plain.generate(PROMPTS, 2, cfg, 7, {EOS}, PAD)
    b = kern.generate(PROMPTS, 2, cfg, 7, {EOS}, PAD)
    n_layers = len(model.model.layers)
    assert calls["rope_kv"] >= n_layers * 2 and calls["add_norm"] >= 2 * n_layers and calls["silu_mul"] >= n_layers
    assert torch.equal(a.completion_ids, b.completion_ids)
    torch.testing.assert_close(b.behaviour_logprobs, a.behaviour_logprobs, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        tf_a = plain.sequence_logprobs(a.prompt_ids, a.completion_ids, a.completion_mask, 1.0, PAD, group=2)
        tf_b = kern.sequence_logprobs(a.prompt_ids, a.completion_ids, a.completion_mask, 1.0, PAD, group=2)
    torch.testing.assert_close(tf_b, tf_a, rtol=1e-5, atol=1e-5)


def _add_norm_shrink_torch(h, d, w, eps, a):
    """``fused.add_norm_shrink``'s torch definition (fp32 on CPU: the shrink unrounded)."""
    s, x = _add_norm_torch(h, d, w, eps)
    return s, x, x.reshape(-1, x.shape[-1]) @ a.t()


def _silu_mul_shrink_torch(g, u, a):
    """``fused.silu_mul_shrink``'s torch definition."""
    out = F.silu(g) * u
    return out, out.reshape(-1, out.shape[-1]) @ a.t()


def _fused_as_torch(monkeypatch, E, **replace) -> None:
    """The engine's fused kernels (module ``E._fk``) replaced by their torch definitions; ``replace``: other
    stand-ins by name (counting wrappers)."""
    fakes = {"add_norm": _add_norm_torch, "add_norm_shrink": _add_norm_shrink_torch,
             "silu_mul_shrink": _silu_mul_shrink_torch, "rope_kv": _rope_kv_torch,
             "silu_mul": lambda g, u: F.silu(g) * u}
    for name, fn in {**fakes, **replace}.items():
        monkeypatch.setattr(E._fk, name, fn)


def _cpu_factors(model, rank: int, seed: int) -> dict:
    """Rank-``rank`` LoRA factors on every projection of ``model`` (fp32, CPU)."""
    from qerl_cli import engine as E

    g = torch.Generator().manual_seed(seed)
    factors = {}
    for i, layer in enumerate(model.model.layers):
        for name in E.PROJECTIONS:
            lin = layer.get_submodule(name)
            factors[f"model.layers.{i}.{name}"] = (torch.randn(rank, lin.in_features, generator=g) * 0.1,
                                                   torch.randn(lin.out_features, rank, generator=g) * 0.1)
    return factors


def _plain_and_kernel_path(model, monkeypatch, factors: dict) -> tuple[Engine, Engine]:
    """Two engines with the adapter ``factors``: the plain path, and one that takes the fused-kernel path (its
    kernels being whatever ``E._fk`` holds: the torch stand-ins here)."""
    plain, kern = Engine(model, fuse=True), Engine(model, fuse=True)
    monkeypatch.setattr(kern, "_use_kernels", lambda h: not torch.is_grad_enabled())
    for eng in (plain, kern):
        eng.set_adapter(LoRA(factors, scaling=2.0))
    return plain, kern


def test_layer_dense_plumbing_on_cpu(model, monkeypatch):
    """Engine._layer_dense (CUDA decode steps above the small-M range): one kernel.dequantize_many call per layer
    for the fused q/k/v and gate/up bases and the lone o / down projections whose product would take the
    dequantize path, bit-exact copies; _base_out then computes base(x) as that path does (the product, then the
    bias on the bf16 result) and the module itself without a copy; none while off, on the small-M path, over the
    size cap, or off CUDA."""
    from qerl_cli import engine as engine_mod
    from qerl_cli import kernel

    eng = Engine(copy.deepcopy(model), fuse=True)
    h = torch.zeros(1, 100, 64, dtype=torch.bfloat16)
    assert eng._layer_dense(1, h) is None  # (no NVFP4 products on CUDA)
    eng._nvfp4_on_cuda = True
    monkeypatch.setattr(kernel, "path", lambda m, n, k: kernel.BACKEND_DEQUANT if m > 64 else kernel.BACKEND_KERNEL)
    calls, real = [], kernel.dequantize_many
    monkeypatch.setattr(kernel, "dequantize_many", lambda ws: calls.append(len(ws)) or real(ws))
    dense = eng._layer_dense(1, h)
    layer = eng.layers[1]
    want = [eng.fused[1]["qkv"].base, layer.self_attn.o_proj, eng.fused[1]["gate_up"].base, layer.mlp.down_proj]
    assert calls == [4] and set(dense) == {id(b) for b in want}
    for b in want:
        ref = layout.dequantize(b.qweight, b.global_scale, b.out_features, b.in_features, torch.bfloat16)
        assert torch.equal(dense[id(b)], ref)
    x = torch.randn(2, 50, 64).bfloat16()
    b = eng.fused[1]["qkv"].base
    eng._dense_w = dense
    monkeypatch.setattr(b, "bias", torch.randn(b.out_features).bfloat16())
    y = eng._base_out(b, x)
    assert y.shape == (2, 50, b.out_features)
    assert torch.equal(y, ((x.reshape(-1, 64) @ dense[id(b)].t()) + b.bias).view(2, 50, -1))
    assert torch.equal(eng._base_out(layer.self_attn.q_proj, x.float()), layer.self_attn.q_proj(x.float()))
    eng._dense_w = None
    assert torch.equal(eng._base_out(b, x.float()), b(x.float()))
    assert eng._layer_dense(1, h[:, :64]) is None  # the small-M kernels' rows
    eng.dequant_layer = False
    assert eng._layer_dense(1, h) is None
    eng.dequant_layer = True
    monkeypatch.setattr(engine_mod, "DEQUANT_LAYER_MAX_WEIGHTS", sum(w.numel() for w in dense.values()) - 1)
    assert eng._layer_dense(1, h) is None
    assert calls == [4]
    monkeypatch.undo()
    # a peft-like wrapper whose terms cannot be batched (merged: no snapshot entry) computes its own base: no copy
    # of that base is made (it would never be read), while the other projections still get theirs
    monkeypatch.setattr(kernel, "path", lambda m, n, k: kernel.BACKEND_DEQUANT)

    class Merged(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base_layer, self.lora_A, self.merged = base, torch.nn.ModuleDict(), True
            self.in_features, self.out_features = base.in_features, base.out_features

        def forward(self, x):
            return self.base_layer(x)

    m = copy.deepcopy(model)
    for lay in m.model.layers:
        lay.self_attn.o_proj = Merged(lay.self_attn.o_proj)
    eng = Engine(m, fuse=True)
    eng._nvfp4_on_cuda = True
    o = m.model.layers[1].self_attn.o_proj
    with torch.no_grad(), eng._lora_batched():
        assert eng._lora_snap is not None and eng._lora_snap.get(id(o)) is None
        dense = eng._layer_dense(1, h)
    assert id(o.base_layer) not in dense and id(o) not in dense
    assert set(dense) == {id(eng.fused[1]["qkv"].base), id(eng.fused[1]["gate_up"].base),
                          id(m.model.layers[1].mlp.down_proj)}


def test_attend_buckets_plumbing_on_cpu(model, monkeypatch):
    """The attended slots of a decode step (engine._attended): its slot + 1 rounded up to the bucket, at most the
    cache, None without a bucket; Engine._attend_bucket gives one only on CUDA with attend_buckets on (opt-in), a cache
    longer than one bucket, and steps that fused.decode_attn does not take (asked with the step's shapes and
    "wave" as one_wave_only)."""
    from qerl_cli import engine as engine_mod
    from qerl_cli import fused

    att = engine_mod._attended
    assert [att(s, 64, 384) for s in (0, 62, 63, 64, 127, 128, 319, 320, 383)] == [64, 64, 64, 128, 128, 192, 320,
                                                                                  384, 384]
    assert att(300, 64, 310) == 310 and att(5, None, 384) is None
    eng = Engine(model)
    assert eng.attend_buckets is False  # (opt-in: QERL_ENGINE_ATTEND_BUCKETS=1)
    eng.attend_buckets = True
    assert eng._attend_bucket(256, 384) is None  # (CPU: every step over the whole cache)
    eng.device, eng._kernels = torch.device("cuda"), True
    asked = []
    takes = {"v": False}
    monkeypatch.setattr(fused, "decode_attn_takes", lambda *a, **k: asked.append((a, k)) or takes["v"])
    monkeypatch.setattr(eng, "_decode_attn_ok", lambda: True)
    assert eng._attend_bucket(256, 384) == engine_mod.ATTEND_BUCKET
    assert asked == [((256, eng.n_heads, eng.n_kv, 384, eng.head_dim, eng.device), {"one_wave_only": True})]
    takes["v"] = True
    assert eng._attend_bucket(8, 384) is None  # (the kernel attends)
    eng.decode_attn = "auto"
    eng.lora = LoRA({}, 1.0)  # with an adapter "auto" is SDPA: asked without one wave only
    eng._attend_bucket(8, 384)
    assert asked[-1][1] == {"one_wave_only": False}
    monkeypatch.setattr(eng, "_decode_attn_ok", lambda: False)
    assert eng._attend_bucket(8, 384) == engine_mod.ATTEND_BUCKET and len(asked) == 3
    assert eng._attend_bucket(8, engine_mod.ATTEND_BUCKET) is None  # (one bucket: nothing to save)
    eng.attend_buckets = False
    assert eng._attend_bucket(8, 384) is None


def test_fused_lora_shrink_plumbing_on_cpu(model, monkeypatch):
    """The fused-kernel path with an adapter, the kernels replaced by their torch definitions (fp32, CPU): the
    q/k/v and gate/up shrinks made by the norm, the down shrink by SiLU·mul, the expands after the base. Each fake
    is called (so the routing is what is tested), and tokens and log-probs equal those of the plain path with the
    same adapter; with ``fused_shrink`` off none is called."""
    from qerl_cli import engine as E

    calls = {"norm": 0, "silu": 0}

    ranks = []  # rank rows of every A a norm shrank with

    def add_norm_shrink(h, d, w, eps, a):
        calls["norm"] += 1
        ranks.append(a.shape[0])
        return _add_norm_shrink_torch(h, d, w, eps, a)

    def silu_mul_shrink(g, u, a):
        calls["silu"] += 1
        return _silu_mul_shrink_torch(g, u, a)

    _fused_as_torch(monkeypatch, E, add_norm_shrink=add_norm_shrink, silu_mul_shrink=silu_mul_shrink)
    factors = _cpu_factors(model, 5, 3)
    plain, kern = _plain_and_kernel_path(model, monkeypatch, factors)
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=10)
    a = plain.generate(PROMPTS, 2, cfg, 7, {EOS}, PAD)
    b = kern.generate(PROMPTS, 2, cfg, 7, {EOS}, PAD)
    n_layers = len(model.model.layers)
    assert calls["norm"] >= 2 * n_layers and calls["silu"] >= n_layers, calls
    assert torch.equal(a.completion_ids, b.completion_ids)
    torch.testing.assert_close(b.behaviour_logprobs, a.behaviour_logprobs, rtol=1e-5, atol=1e-5)
    before = dict(calls)
    kern.fused_shrink = False
    c = kern.generate(PROMPTS, 2, cfg, 7, {EOS}, PAD)
    assert calls == before and torch.equal(c.completion_ids, a.completion_ids)
    # a partial adapter (q and v of the q/k/v group, down; nothing on gate/up): the group's shrink covers its
    # members with a term only, gate/up's norm makes no shrink, and the result is still the plain path's
    kern.fused_shrink = True
    part = {n: f for n, f in factors.items() if n.endswith(("q_proj", "v_proj", "down_proj"))}
    for eng in (plain, kern):
        eng.set_adapter(LoRA(part, scaling=2.0))
    before = dict(calls)
    assert set(ranks) == {15, 10}  # full adapter: q/k/v 3 x 5 rank rows, gate/up 2 x 5
    ranks.clear()
    a = plain.generate(PROMPTS, 2, cfg, 7, {EOS}, PAD)
    b = kern.generate(PROMPTS, 2, cfg, 7, {EOS}, PAD)
    assert calls["silu"] > before["silu"] and calls["norm"] > before["norm"]
    assert set(ranks) == {10}  # q and v only: k has no rows in the stacked A, gate/up no shrink at all
    assert torch.equal(a.completion_ids, b.completion_ids)
    torch.testing.assert_close(b.behaviour_logprobs, a.behaviour_logprobs, rtol=1e-5, atol=1e-5)


def test_lora_in_kernel_plumbing_on_cpu(model, monkeypatch):
    """The engine's routing of decode steps' LoRA terms into the NVFP4 kernel (``kernel.linear_lora``, CUDA-only)
    with the kernels replaced by their torch definitions (fp32, CPU). Where ``takes_lora`` says yes (here the
    q/k/v and o shapes only, so that both routes run) the base and term come from one ``linear_lora`` call: q/k/v
    with the norm's shrink, o with ``fused.lora_shrink``'s; gate/up and down keep base + expand. Tokens and
    log-probs equal the plain path's with the same adapter; a declined call (None) falls back with the shrink it
    made; ``lora_in_kernel`` off calls nothing."""
    from qerl_cli import engine as E

    calls = {"in_kernel": [], "rows": [], "shrink": 0}
    hidden = model.config.hidden_size

    def takes_lora(m, n, k):
        return k == hidden and n != 2 * model.config.intermediate_size  # q/k/v, o

    def linear_lora(x, qweight, gs, n, k, hs, bs, segs=(), *, bias=None, out=None):
        calls["in_kernel"].append(n)
        calls["rows"].append(x.shape[0])
        y = x @ layout.dequantize(qweight, gs, n, k, torch.float32).t()
        col = 0
        for end, r0, r1 in zip(segs[::3], segs[1::3], segs[2::3]):  # only each member's block, as the kernel reads
            y[:, col:end] += hs[:, r0:r1] @ bs[r0:r1, col:end]
            col = end
        assert col == n
        return y if bias is None else y + bias

    def lora_shrink(x, a):
        calls["shrink"] += 1
        return x @ a.t()

    monkeypatch.setattr(E._kernel, "takes_lora", takes_lora)
    monkeypatch.setattr(E._kernel, "linear_lora", linear_lora)
    _fused_as_torch(monkeypatch, E, lora_shrink=lora_shrink)
    plain, kern = _plain_and_kernel_path(model, monkeypatch, _cpu_factors(model, 4, 4))
    kern._kernels = True  # (CUDA-only otherwise; every kernel it reaches is a fake here)
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=10)
    a = plain.generate(PROMPTS, 2, cfg, 7, {EOS}, PAD)
    b = kern.generate(PROMPTS, 2, cfg, 7, {EOS}, PAD)
    n_layers = len(model.model.layers)
    qkv = model.model.layers[0].self_attn
    widths = {qkv.q_proj.out_features + qkv.k_proj.out_features + qkv.v_proj.out_features, hidden}
    assert set(calls["in_kernel"]) == widths and len(calls["in_kernel"]) >= 2 * n_layers, calls
    # o's up to fused.LORA_MAX_ROWS rows (decode steps), q/k/v's from the norm; above (the prefill) a matmul's
    assert calls["shrink"] == sum(n == hidden and r <= E._fk.LORA_MAX_ROWS
                                  for n, r in zip(calls["in_kernel"], calls["rows"])) >= n_layers
    assert torch.equal(a.completion_ids, b.completion_ids)
    torch.testing.assert_close(b.behaviour_logprobs, a.behaviour_logprobs, rtol=1e-5, atol=1e-5)
    # declined (None): the same policy through base + expand, with the shrink already made
    monkeypatch.setattr(E._kernel, "linear_lora", lambda *args, **kw: calls["in_kernel"].append(0))
    c = kern.generate(PROMPTS, 2, cfg, 7, {EOS}, PAD)
    assert 0 in calls["in_kernel"] and torch.equal(c.completion_ids, a.completion_ids)
    torch.testing.assert_close(c.behaviour_logprobs, a.behaviour_logprobs, rtol=1e-5, atol=1e-5)
    before = (len(calls["in_kernel"]), calls["shrink"])
    kern.lora_in_kernel = False
    d = kern.generate(PROMPTS, 2, cfg, 7, {EOS}, PAD)
    assert (len(calls["in_kernel"]), calls["shrink"]) == before and torch.equal(d.completion_ids, a.completion_ids)


def test_lora_in_kernel_above_the_fused_kernels_rows_on_cpu(model, monkeypatch):
    """Above ``fused.LORA_MAX_ROWS`` rows (the rollout batches of RL, prompts x group; here that limit is lowered
    to 4 for 6 rows) the fused shrinks decline, the engine makes the shrink with a matmul and the term still rides
    in ``kernel.linear_lora`` (up to ``kernel.LORA_MAX_ROWS``), on every projection it takes: no separate expand.
    Kernels replaced by their torch definitions (fp32, CPU); tokens and log-probs equal the plain path's."""
    from qerl_cli import engine as E

    calls = {"rows": [], "shrink": 0, "norm_shrink": 0, "expand": 0}

    def linear_lora(x, qweight, gs, n, k, hs, bs, segs=(), *, bias=None, out=None):
        calls["rows"].append(x.shape[0])
        assert hs.shape == (x.shape[0], bs.shape[0])
        y = x @ layout.dequantize(qweight, gs, n, k, torch.float32).t() + hs @ bs
        return y if bias is None else y + bias

    def lora_shrink(x, a):
        calls["shrink"] += 1
        return x @ a.t()

    def add_norm_shrink(*args):
        calls["norm_shrink"] += 1
        return _add_norm_shrink_torch(*args)

    real_lora_add = E._lora_add

    def lora_add(*args, **kw):
        calls["expand"] += 1
        return real_lora_add(*args, **kw)

    monkeypatch.setattr(E._kernel, "takes_lora", lambda m, n, k: True)
    monkeypatch.setattr(E._kernel, "linear_lora", linear_lora)
    monkeypatch.setattr(E._fk, "LORA_MAX_ROWS", 4)
    monkeypatch.setattr(E, "_lora_add", lora_add)
    _fused_as_torch(monkeypatch, E, lora_shrink=lora_shrink, add_norm_shrink=add_norm_shrink)
    plain, kern = _plain_and_kernel_path(model, monkeypatch, _cpu_factors(model, 4, 5))
    kern._kernels = True  # (CUDA-only otherwise; every kernel it reaches is a fake here)
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=10)
    a = plain.generate(PROMPTS, 2, cfg, 7, {EOS}, PAD)
    calls["expand"] = 0  # (the plain path's)
    b = kern.generate(PROMPTS, 2, cfg, 7, {EOS}, PAD)
    n_layers = len(model.model.layers)
    steps = int(b.completion_mask.sum(1).max())
    # q/k/v, o, gate/up and down of every layer in every decode step (6 rows), all in the kernel
    assert calls["rows"].count(2 * len(PROMPTS)) >= 4 * n_layers * (steps - 1), calls["rows"]
    assert calls["shrink"] == calls["norm_shrink"] == calls["expand"] == 0, calls
    assert torch.equal(a.completion_ids, b.completion_ids)
    torch.testing.assert_close(b.behaviour_logprobs, a.behaviour_logprobs, rtol=1e-5, atol=1e-5)


def test_fused_kernels_failed_build_warns_and_falls_back(monkeypatch):
    """Where CUDA is present but the fused kernels do not build, one warning says so and the engine's torch ops
    run (no silent slowdown, no crash)."""
    from qerl_cli import fused, kernel

    monkeypatch.setattr(fused, "_tried", False)
    monkeypatch.setattr(fused, "_ext", None)
    monkeypatch.setattr(fused, "_err", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("QERL_ENGINE_KERNELS", raising=False)

    def broken(name, filename):
        raise RuntimeError("nvcc: not found")

    monkeypatch.setattr(kernel, "build_extension", broken)
    with pytest.warns(RuntimeWarning, match="fused kernels did not build.*nvcc: not found"):
        assert not fused.available()
    assert "nvcc: not found" in fused.build_error()


def test_small_noise_survives_a_bf16_model(packed_dir):
    """On a bf16 model a draw of sigma 5e-4 rounded into bf16 scales would mostly vanish (a unit in the last place
    is 2^-7 at 1): the noisy scales stay fp32, so the perturbation has std sigma and reaches the output, which
    stays bf16."""
    m = packed_model.load_packed_model(artifact.open_artifact(packed_dir / "packed", names.KIND_PACKED),
                                       dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # trained-like scales (a random model's are all 1)
        for layer in m.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.copy_(1 + 0.2 * torch.randn(norm.weight.shape, generator=g))
    eng = Engine(m)
    sigma = 5e-4
    eng.set_noise(sigma, 3)
    devs, lost = [], []
    for noisy, clean, div in zip(eng.effective_norm_weights(), eng.clean, eng.noise_divisor):
        for t in noisy:
            assert noisy[t].dtype == torch.float32 and clean[t].dtype == torch.bfloat16
            d = noisy[t] - clean[t].float()
            devs.append(d * div[t] if div[t] is not None else d)  # sigma is on the unfolded scales
            lost.append(noisy[t].to(torch.bfloat16) == clean[t])
    dev = torch.cat(devs)
    assert abs(float(dev.std()) - sigma) < 0.15 * sigma
    assert float(torch.cat(lost).float().mean()) > 0.5  # what rounding the draw into bf16 would have erased
    # the norm's output (bf16) carries it: elements near a rounding boundary flip, as many as the draw moves
    # across one; with the draw rounded into bf16 scales far fewer do
    from qerl_cli import engine as E

    h = torch.randn(256, m.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    w, c = eng.effective_norm_weights()[0]["input_layernorm"], eng.clean[0]["input_layernorm"]
    clean_x = E._rms_norm(h, c, eng.eps)
    flips = float((E._rms_norm(h, w, eng.eps) != clean_x).float().mean())
    flips_rounded = float((E._rms_norm(h, w.to(torch.bfloat16), eng.eps) != clean_x).float().mean())
    assert E._rms_norm(h, w, eng.eps).dtype == torch.bfloat16
    assert flips > 0.02 and flips > 2 * flips_rounded, (flips, flips_rounded)
    ids = torch.tensor([PROMPTS[0]])
    key, pos = torch.ones_like(ids, dtype=torch.bool), torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        assert eng.forward(ids, pos, key, hidden_only=True).dtype == torch.bfloat16


def test_fused_add_norm_takes_fp32_scales_through_torch_ops():
    """fused.add_norm with fp32 (noisy) scales never rounds them to bf16 and rounds its output as the kernel does
    (this path needs no CUDA)."""
    from qerl_cli import fused

    g = torch.Generator().manual_seed(0)
    h, d = (torch.randn(3, 5, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    w = 1 + 1e-3 * torch.randn(3, 1, 64, generator=g)  # per-row fp32 scales, off the bf16 grid
    s, x = fused.add_norm(h, d, w, 1e-5)
    assert torch.equal(s, h + d) and x.dtype == torch.bfloat16
    f = (h + d).float()
    want = (w * f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    assert torch.equal(x, want)
    _, x_rounded = fused._add_norm_torch(h, d, w.to(torch.bfloat16), 1e-5)
    assert not torch.equal(x, x_rounded)
    s0, x0 = fused.add_norm(h, None, w, 1e-5)
    assert s0 is h and torch.equal(x0, (w * h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-5))
                                    .to(torch.bfloat16))


def _assert_behaviour_equals_hf(model, prompts: list[list[int]], b) -> None:
    """Each row's behaviour log-probs (T = 1, no truncation) equal HF's forward of its unpadded sequence."""
    for r in range(b.rows):
        p = prompts[r // b.group]
        seq = torch.tensor([p + b.completion_ids[r].tolist()])
        with torch.no_grad():
            lp = torch.log_softmax(model(seq).logits[0, len(p) - 1:-1].float(), -1)
        ref = lp.gather(-1, b.completion_ids[r][:, None]).squeeze(-1)
        torch.testing.assert_close(b.behaviour_logprobs[r], ref, rtol=1e-4, atol=1e-4)


def test_sliding_window_attention_matches_hf_mistral():
    """A Mistral whose window is shorter than the sequence: keys further back than the window are masked, as in
    HF (teacher-forced and sampled log-probs agree with HF's forward of each unpadded sequence)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    conf = MistralConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, sliding_window=4, initializer_range=0.2,
                         attn_implementation="eager")
    m = MistralForCausalLM(conf).eval()
    prompts = [[5, 17, 33, 2, 99, 41, 7, 8, 120], [3, 4, 250]]
    eng = Engine(m)
    assert eng.window == 4
    b = eng.generate(prompts, 2, SamplingConfig(temperature=1.0, max_new_tokens=8), 0, set(), 0)
    _assert_behaviour_equals_hf(m, prompts, b)
    full = Engine(m)
    full.window = None  # the same weights attending to everything: a different function, so the test has teeth
    with torch.no_grad():
        a = eng.sequence_logprobs(prompts, b.completion_ids, b.completion_mask, 1.0, 0, group=2)
        c = full.sequence_logprobs(prompts, b.completion_ids, b.completion_mask, 1.0, 0, group=2)
    torch.testing.assert_close(a, b.behaviour_logprobs, rtol=1e-4, atol=1e-4)
    assert (a - c).abs().max() > 1e-2


@pytest.mark.parametrize("fuse", [False, True])
def test_qwen3_qk_norm_matches_hf(fuse):
    """Qwen3 normalizes each head of q and k before the rotary: sampled log-probs equal HF's forward of each
    unpadded sequence, with the q/k/v projections separate or fused."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    conf = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.2)
    m = Qwen3ForCausalLM(conf).eval()
    with torch.no_grad():  # trained-like q/k norm scales (a random model's are all 1)
        for layer in m.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.copy_(1 + 0.5 * torch.randn(norm.weight.shape))
    prompts = [[5, 17, 33, 2, 99, 41, 7], [3, 4, 250]]
    eng = Engine(m, fuse=fuse)
    assert eng.qk_norm is not None and bool(eng.fused[0]) == fuse
    b = eng.generate(prompts, 2, SamplingConfig(temperature=1.0, max_new_tokens=8), 0, set(), 0)
    _assert_behaviour_equals_hf(m, prompts, b)
    eng.qk_norm = None  # the same weights without the q/k norms: another function, so the test has teeth
    with torch.no_grad():
        c = eng.sequence_logprobs(prompts, b.completion_ids, b.completion_mask, 1.0, 0, group=2)
    assert (c - b.behaviour_logprobs).abs().max() > 1e-2


def test_qwen3_through_quantize_pack_verify_and_the_packed_engine(tmp_path, smollm2_tokenizer):
    """A Qwen3 (q/k norms, explicit head_dim) goes through the pipeline: verify passes and the packed engine's
    behaviour log-probs equal its teacher-forced ones, with q/k/v fused."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    conf = Qwen3Config(vocab_size=len(smollm2_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.2)
    Qwen3ForCausalLM(conf).save_pretrained(str(tmp_path / "model"))
    smollm2_tokenizer.save_pretrained(str(tmp_path / "model"))
    quantize.quantize(str(tmp_path / "model"), tmp_path / "quant", progress=False)
    pack.pack(tmp_path / "quant", tmp_path / "packed", progress=False)
    assert verify.verify(tmp_path / "packed", tmp_path / "verify", progress=False).metrics["passed"]
    pm = packed_model.load_packed_model(artifact.open_artifact(tmp_path / "packed", names.KIND_PACKED))
    eng = Engine(pm, fuse=True)
    assert eng.qk_norm is not None and "qkv" in eng.fused[0]
    b = eng.generate([PROMPTS[0]], 2, SamplingConfig(temperature=1.0, max_new_tokens=6), 0, set(), PAD)
    with torch.no_grad():
        tf = eng.sequence_logprobs(b.prompt_ids, b.completion_ids, b.completion_mask, 1.0, PAD, group=2)
    torch.testing.assert_close(tf, b.behaviour_logprobs, rtol=1e-4, atol=1e-4)


def test_sampler_named_per_config():
    """What a rollout records as its sampler: greedy at T = 0; on CPU torch's multinomial at any temperature; the
    fused kernel only on CUDA and only without truncation (its condition, checked without a GPU)."""

    class Fake:  # only the attributes the choice reads
        fused_sampler, _kernels, device = True, True, torch.device("cuda")
        _fast_sampling = Engine._fast_sampling

    assert Engine.sampler(Fake(), SamplingConfig(temperature=0, max_new_tokens=1), 100) == "greedy (argmax)"
    assert Engine.sampler(Fake(), SamplingConfig(temperature=1.0, max_new_tokens=1), 100).startswith("fused Gumbel")
    for cfg in (SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=1),
                SamplingConfig(temperature=1.0, top_k=5, max_new_tokens=1)):
        assert Engine.sampler(Fake(), cfg, 100).startswith("torch.multinomial")
    assert Engine.sampler(Fake(), SamplingConfig(temperature=1.0, top_k=100, max_new_tokens=1), 100).startswith("fused")
    cpu = Fake()
    cpu.device = torch.device("cpu")
    assert Engine.sampler(cpu, SamplingConfig(temperature=1.0, max_new_tokens=1), 100).startswith("torch.multinomial")


def test_fused_add_norm_wrapper_plumbing_on_cpu(monkeypatch):
    """fused's wrapper of the add + RMSNorm kernel (shared by add_norm and add_norm_shrink), the extension replaced
    by the kernel's torch definition: rows flattened, per-row (AQN per-group) scales mapped to their rows, the
    residual written only with d (else h itself comes back), the shrink made with a and only then."""
    from qerl_cli import fused

    seen = []

    class Ext:
        def add_rmsnorm(self, h, d, w, rows_per_w, h_out, x_out, eps, a=None, hs=None):
            seen.append((tuple(h.shape), rows_per_w, d is None, h_out is x_out))
            s = h if d is None else h + d
            if d is not None:
                h_out.copy_(s)
            wr = w if w.dim() == 1 else w.repeat_interleave(rows_per_w, 0)
            x_out.copy_((wr.float() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)).to(x_out.dtype))
            if a is not None:
                hs.copy_(x_out @ a.t())

    monkeypatch.setattr(fused, "_load", lambda: Ext())
    g = torch.Generator().manual_seed(0)
    h, d = torch.randn(3, 2, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    a = torch.randn(5, 16, generator=g)
    for w in (torch.rand(16, generator=g) + 0.5, torch.rand(3, 1, 16, generator=g) + 0.5):
        for dd in (d, None):
            s, x, hs = fused._add_rmsnorm(h, dd, w, 1e-5, a)
            s_ref, x_ref = fused._add_norm_torch(h, dd, w, 1e-5)
            assert torch.equal(s, s_ref) and (dd is not None or s is h)
            torch.testing.assert_close(x, x_ref, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(hs, x.reshape(6, 16) @ a.t(), rtol=1e-6, atol=1e-6)
            assert seen[-1] == ((6, 16), 1 if w.dim() == 1 else 2, dd is None, dd is None)
    assert fused._add_rmsnorm(h, d, w, 1e-5)[2] is None


def test_decode_attention_mode(model, monkeypatch):
    """QERL_ENGINE_DECODE_ATTN: "auto" (the default) attends with the decode-attention kernel where its blocks fit
    one wave ("wave") without an adapter and with SDPA (False) while one is set; 0, 1 and "wave" are taken as
    given; anything else is one clear error."""
    monkeypatch.delenv("QERL_ENGINE_DECODE_ATTN", raising=False)
    eng = Engine(model)
    assert eng.decode_attn == "auto" and eng._decode_attn_mode() == "wave"
    eng.set_adapter(LoRA(_lora_factors(model, ["model.layers.0.self_attn.q_proj"]), scaling=2.0))
    assert eng._decode_attn_mode() is False
    eng.set_adapter(None)
    assert eng._decode_attn_mode() == "wave"
    assert not eng._decode_attn_ok()  # (no fused kernels on the CPU: SDPA whatever the mode)
    for value, mode in (("0", False), ("1", True), ("wave", "wave")):
        monkeypatch.setenv("QERL_ENGINE_DECODE_ATTN", value)
        e = Engine(model)
        e.set_adapter(LoRA(_lora_factors(model, ["model.layers.0.self_attn.q_proj"]), scaling=2.0))
        assert e._decode_attn_mode() == mode and type(e._decode_attn_mode()) is type(mode)
    monkeypatch.setenv("QERL_ENGINE_DECODE_ATTN", "yes")
    with pytest.raises(QerlError, match="QERL_ENGINE_DECODE_ATTN"):
        Engine(model)


def _same(a, b) -> bool:
    return (torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.completion_mask, b.completion_mask)
            and torch.equal(a.behaviour_logprobs, b.behaviour_logprobs))


def test_kept_decode_state_refills_everything_a_call_changes(model):
    """A second call of the same shapes reuses the kept cache (and on GPU the graph): it gives the bits of a fresh
    engine whatever the previous call left behind (another noise draw, other prompts, a call that failed on NaN
    logits), and a call of other shapes or flags, or keep_graph off, makes a new one."""
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=9)
    eng = Engine(model, fuse=True)
    eng.set_noise(0.05, 1)
    first = eng.generate(PROMPTS, 2, cfg, 3, {EOS}, PAD)
    kept = eng._graph
    assert first.timings["decode_state"] == "new" and kept is not None
    eng.set_noise(0.05, 2)  # another draw: the kept norm scales take its values
    again = eng.generate(PROMPTS, 2, cfg, 3, {EOS}, PAD)
    assert again.timings["decode_state"] == "kept" and eng._graph is kept
    fresh = Engine(model, fuse=True)
    fresh.set_noise(0.05, 2)
    assert _same(again, fresh.generate(PROMPTS, 2, cfg, 3, {EOS}, PAD))
    assert not torch.equal(again.behaviour_logprobs, first.behaviour_logprobs)  # the new draw took effect
    # other prompts of the same padded length: the cache and key mask are refilled
    other = [p[::-1] for p in PROMPTS]
    eng.set_noise(0.0, 0)
    b = eng.generate(other, 2, cfg, 4, {EOS}, PAD)
    assert b.timings["decode_state"] == "kept"
    assert _same(b, Engine(model, fuse=True).generate(other, 2, cfg, 4, {EOS}, PAD))
    # the longest prompt one token shorter, one more new token: the same cache slots, another first slot and mask
    shorter = PROMPTS[:-1] + [PROMPTS[-1][:-1]]
    longer = SamplingConfig(temperature=1.0, max_new_tokens=10)
    s = eng.generate(shorter, 2, longer, 4, {EOS}, PAD)
    assert s.timings["decode_state"] == "kept"
    assert _same(s, Engine(model, fuse=True).generate(shorter, 2, longer, 4, {EOS}, PAD))
    # a call that fails (huge noise: non-finite logits) leaves nothing the next call reads
    eng.set_noise(1e30, 5)
    with pytest.raises(QerlError, match="not finite"):
        eng.generate(PROMPTS, 2, cfg, 3, {EOS}, PAD)
    eng.set_noise(0.0, 0)
    c = eng.generate(PROMPTS, 2, cfg, 3, {EOS}, PAD)
    assert c.timings["decode_state"] == "kept"
    assert _same(c, Engine(model, fuse=True).generate(PROMPTS, 2, cfg, 3, {EOS}, PAD))
    # other rows, cache slots or engine flags: a new one replaces the kept one
    assert eng.generate(PROMPTS, 1, cfg, 3, {EOS}, PAD).timings["decode_state"] == "new"
    assert eng.generate(PROMPTS, 1, SamplingConfig(temperature=1.0, max_new_tokens=10), 3, {EOS},
                        PAD).timings["decode_state"] == "new"
    eng.lora_kernels = not eng.lora_kernels
    assert eng.generate(PROMPTS, 1, SamplingConfig(temperature=1.0, max_new_tokens=10), 3, {EOS},
                        PAD).timings["decode_state"] == "new"
    # a final-norm draw is read by the step itself: that call's graph is not kept, and the next one is new
    eng.set_noise(0.05, 6, final_norm=True)
    f = eng.generate(PROMPTS, 1, cfg, 3, {EOS}, PAD)
    assert f.timings["decode_state"] == "new" and eng._graph is None
    fresh = Engine(model, fuse=True)
    fresh.set_noise(0.05, 6, final_norm=True)
    assert _same(f, fresh.generate(PROMPTS, 1, cfg, 3, {EOS}, PAD))
    eng.set_noise(0.0, 0)
    assert eng.generate(PROMPTS, 1, cfg, 3, {EOS}, PAD).timings["decode_state"] == "new" and eng._graph is not None
    eng.release_graph()
    assert eng._graph is None
    eng.keep_graph = False
    for _ in range(2):
        assert eng.generate(PROMPTS, 1, cfg, 3, {EOS}, PAD).timings["decode_state"] == "new"
    assert eng._graph is None


def test_kept_decode_state_takes_lora_weights_changed_in_place(model):
    """Training updates the adapter in place between rollouts: the kept decode step reads a snapshot copied from
    the new values (the batched LoRA terms), so its rollouts equal a fresh engine's; a new adapter object drops
    the kept state."""
    from qerl_cli import lora as qlora

    pm = _peft(qlora, copy.deepcopy(model), ("q_proj", "k_proj", "up_proj", "down_proj"))
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=8)
    eng = Engine(pm.get_base_model(), fuse=True)
    a = eng.generate(PROMPTS, 2, cfg, 0, {EOS}, PAD)
    assert eng._graph is not None and eng._graph.snap and any(isinstance(t, tuple) for t in eng._graph.snap.values())
    with torch.no_grad():
        for _, p in qlora.trainable(pm):
            p.add_(torch.randn_like(p) * 0.2)
    b = eng.generate(PROMPTS, 2, cfg, 0, {EOS}, PAD)
    assert b.timings["decode_state"] == "kept"
    assert _same(b, Engine(pm.get_base_model(), fuse=True).generate(PROMPTS, 2, cfg, 0, {EOS}, PAD))
    assert not torch.equal(a.behaviour_logprobs, b.behaviour_logprobs)
    # terms computed as in training read peft's tensors and scalings directly: nothing is kept
    eng.batch_lora = False
    for _ in range(2):
        assert eng.generate(PROMPTS, 2, cfg, 0, {EOS}, PAD).timings["decode_state"] == "new" and eng._graph is None
    eng.batch_lora = True
    # ... and so are terms that cannot be batched (q and k with other scalings, in one fused q/k/v group)
    k_proj = pm.get_base_model().model.layers[0].self_attn.k_proj
    k_proj.scaling = {n: 2 * v for n, v in k_proj.scaling.items()}
    for _ in range(2):
        assert eng.generate(PROMPTS, 2, cfg, 0, {EOS}, PAD).timings["decode_state"] == "new" and eng._graph is None
    k_proj.scaling = {n: v / 2 for n, v in k_proj.scaling.items()}
    # (gate_proj's term shares its fused group with peft's up_proj: the same scaling, so they batch)
    up_scaling = float(pm.get_base_model().model.layers[0].mlp.up_proj.scaling["default"])
    eng.set_adapter(LoRA(_lora_factors(pm.get_base_model(), ["model.layers.0.mlp.gate_proj"]), scaling=up_scaling))
    assert eng._graph is None
    assert eng.generate(PROMPTS, 2, cfg, 0, {EOS}, PAD).timings["decode_state"] == "new"
    assert eng.generate(PROMPTS, 2, cfg, 0, {EOS}, PAD).timings["decode_state"] == "kept"
    eng.lora = LoRA(dict(eng.lora.factors), scaling=up_scaling)  # another adapter object, not through set_adapter
    assert eng.generate(PROMPTS, 2, cfg, 0, {EOS}, PAD).timings["decode_state"] == "new"


def test_cache_slots_round_up_on_cuda_only(model, monkeypatch):
    eng = Engine(model)
    assert eng.cache_slots(10, 9) == 19  # CPU: exact
    eng.device = torch.device("cuda")  # (the rounding depends on the device type alone)
    assert eng.cache_slots(10, 9) == 32 and eng.cache_slots(33, 31) == 64 and eng.cache_slots(64, 0) == 64
    monkeypatch.setattr(model.config, "max_position_embeddings", 100)
    assert eng.cache_slots(90, 5) == 96 and eng.cache_slots(90, 8) == 98  # never past the model's positions


def test_decode_step_reads_only_what_a_kept_graph_refills(model):
    """Every tensor a decode step reads (each op's inputs, traced on CPU, where the step runs the same engine code
    eagerly) lives in the model's parameters and buffers, in the kept decode state the next call refills (cache,
    key mask, norm scales, LoRA snapshot, tokens, positions, slot), or was made by the step itself: nothing that a
    later call could free or replace while a kept CUDA graph still reads its address."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from qerl_cli import lora as qlora

    def storage(t):
        return t.untyped_storage().data_ptr()

    class Reads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.read, self.made = set(), set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            flat = torch.utils._pytree.tree_leaves((args, kwargs or {}))
            self.read |= {storage(t) for t in flat if isinstance(t, torch.Tensor) and t.numel()}
            out = func(*args, **(kwargs or {}))
            self.made |= {storage(t) for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)}
            return out

    pm = _peft(qlora, copy.deepcopy(model), ("q_proj", "up_proj", "down_proj"))
    eng = Engine(pm.get_base_model(), fuse=True)
    eng.set_noise(0.05, 1, scope="group", groups=len(PROMPTS), group_size=2)
    eng.generate(PROMPTS, 2, SamplingConfig(temperature=1.0, max_new_tokens=3), 0, {EOS}, PAD)
    kept = eng._graph
    assert kept is not None and kept.snap and any(isinstance(t, tuple) for t in kept.snap.values())
    allowed = {storage(t) for t in list(pm.parameters()) + list(pm.buffers())}
    allowed |= {storage(t) for (k, v) in kept.cache for t in (k, v)}
    allowed |= {storage(t) for d in kept.norms for t in d.values()}
    allowed |= {storage(t) for v in kept.snap.values() if isinstance(v, tuple) for t in v[:2]}
    allowed |= {storage(t) for t in (kept.key_mask, kept.tok, kept.pos, kept.at)}
    allowed.add(storage(eng.final_norm))  # (the engine's clean copy, never written: a final-norm draw is not kept)
    if kept.rope is not None:
        allowed.add(storage(kept.rope))
    with torch.no_grad(), eng._lora_batched():  # (as generate calls it: the snapshot of this call)
        step, how = eng._decoder([(k[::2].clone(), v[::2].clone()) for k, v in kept.cache],
                                 kept.key_mask[::2].clone(), 2, 12, kept.pos.clone())
        assert how == "kept"
        with Reads() as reads:
            step(torch.full((kept.tok.shape[0],), 5))
    outside = reads.read - reads.made - allowed
    assert not outside, f"the decode step reads {len(outside)} tensor(s) a kept graph does not own"
