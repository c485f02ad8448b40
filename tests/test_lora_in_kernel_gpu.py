"""kernel.linear_lora: a decode step's LoRA term inside the small-M NVFP4 kernel (``-m gpu``), and the engine
routing it (session 14). CPU tests of the same code are in test_kernel.py and test_engine.py."""

from __future__ import annotations

import pytest
import torch

from qerl_cli import fused, kernel, layout
from test_kernel import make_packed

pytestmark = pytest.mark.gpu


def _term(sizes, ranks, m, seed):
    """A fused group's batched LoRA term: ``hs [m, R]`` (fp32 holding bf16 values), ``bs [R, n]`` bf16
    block-diagonal (member i: its ``ranks[i]`` rank rows, 0 = no term), ``segs`` as in ``fused.lora_add``."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n, r = sum(sizes), sum(ranks)
    hs = (torch.randn(m, r, device="cuda", generator=g) * 2).to(torch.bfloat16).float()
    bs = torch.zeros(r, n, device="cuda", dtype=torch.bfloat16)
    segs, row, col = [], 0, 0
    for size, rank in zip(sizes, ranks):
        bs[row: row + rank, col: col + size] = (torch.randn(rank, size, device="cuda", generator=g) * 0.5).to(
            torch.bfloat16)
        col += size
        segs += [col, row, row + rank]
        row += rank
    return hs, bs, tuple(segs)


def _fp32_slack(x, w, hs, bs):
    """What fp32 sums in another order may differ by: 2^-20 of the sums of |products| (``w``: the dequantized
    weight, fp32)."""
    return (x.float().abs() @ w.abs().t() + hs.abs() @ bs.float().abs()) * 2.0 ** -20


def _expect(x, w, hs, bs, bias):
    """The fp32 value of ``x W^T + hs @ bs (+ bias)`` and a bound on what rounding may move it: the kernel
    rounds base + term to bf16 once, then adds the bias and rounds again (at most half a bf16 unit, 2^-8
    relative, each), after fp32 sums in its own order."""
    base = x.float() @ w.t()
    term = hs @ bs.float()
    value, scale = base + term, base.abs() + term.abs()
    if bias is not None:
        value, scale = value + bias.float(), scale + bias.float().abs()
    return value, scale * 2.0 ** -7 + _fp32_slack(x, w, hs, bs) + 1e-6


@pytest.fixture
def settings():
    """Restores the variant, split override, cluster setting and large-M threshold a test changes; the tests run
    without autograd, as the engine's decode steps do (``linear_lora`` declines under grad mode)."""
    assert kernel.available(), f"CUDA extension failed to build: {kernel.build_error()}"
    ext = kernel._load()
    before = (kernel.variant(), bool(ext.get_cluster()), kernel.large_m_threshold())
    with torch.no_grad():
        yield ext
    ext.set_split_override(0)
    kernel.set_variant(before[0])
    kernel.set_cluster(before[1])
    kernel.set_large_m_threshold(before[2])


@pytest.mark.parametrize("sizes,ranks,k", [
    ((256, 64, 64), (16, 16, 16), 256),     # a small q/k/v group
    ((3584, 512, 512), (32, 32, 32), 3584),  # Qwen2.5-7B's q/k/v at rank 32
    ((3584, 512, 512), (32, 0, 32), 3584),   # q and v only: k's columns have no rank rows
    ((512,), (64,), 1024),                  # one linear (o), rank 64
    ((1000,), (16,), 1008),                 # rows past n in the last 16-row block, K past a 64-tile
    ((18944, 18944), (32, 32), 3584),        # Qwen2.5-7B's gate/up (auto: v2w8)
    ((3584,), (32,), 18944),                # Qwen2.5-7B's down
])
@pytest.mark.parametrize("variant", ["default", "alt", "v2", "v2w8"])
def test_linear_lora_against_fp32(sizes, ranks, k, variant, settings):
    """The output of ``linear_lora`` (poisoned before each call) is ``x W^T + hs @ bs (+ bias)`` within its two
    roundings, at M = 1 ... 16, for every small-M kernel: the two v1 configurations unsplit and with forced K
    splits reduced in a cluster and in the workspace (cluster and workspace give the same bits at the same split:
    the term is part of the last split's partial in both), the stream-K ones with row groups cut between CTAs
    (the large shapes); a second call gives the same bits."""
    ext = settings
    kernel.set_variant(variant)
    n = sum(sizes)
    qw, gs = make_packed(n, k, device="cuda", seed=n + k)
    w = layout.dequantize(qw, gs, n, k, torch.float32)
    b = (torch.randn(n, device="cuda") * 2).to(torch.bfloat16)
    kt = (k + 63) // 64
    clusters = torch.cuda.get_device_capability()[0] >= 9
    splits = (0,) if variant.startswith("v2") else sorted({0, 2, min(3, kt), min(8, kt)})
    for m in (1, 3, 8, 9, 16):
        hs, bs, segs = _term(sizes, ranks, m, seed=m)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for split in splits:
            ext.set_split_override(split)
            outs = {}
            for cl in ((True, False) if clusters and split else (False,)):
                kernel.set_cluster(cl)
                for bias in (None, b):
                    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                    y = kernel.linear_lora(x, qw, gs, n, k, hs, bs, segs, bias=bias, out=out)
                    assert y is out, (m, split, cl)
                    value, bound = _expect(x, w, hs, bs, bias)
                    err = (out.float() - value).abs()
                    assert not torch.isnan(out).any(), (m, split, cl)
                    assert bool((err <= bound).all()), (m, split, cl, bias is None, float((err - bound).max()))
                    outs[cl, bias is None] = out
            if len(outs) == 4:
                for nb in (True, False):
                    assert torch.equal(outs[True, nb], outs[False, nb]), (m, split, nb)
            again = kernel.linear_lora(x, qw, gs, n, k, hs, bs, segs)
            assert torch.equal(again, outs[next(iter(outs))[0], True])


def test_linear_lora_near_the_separate_expand(settings):
    """Against what the engine ran before (``linear`` then ``fused.lora_expand``, which rounds the base first):
    the two differ by at most their roundings (half a bf16 unit of the base, of each result)."""
    kernel.set_variant("auto")
    sizes, ranks, k = (3584, 512, 512), (32, 32, 32), 3584
    n = sum(sizes)
    qw, gs = make_packed(n, k, device="cuda", seed=5)
    hs, bs, segs = _term(sizes, ranks, 8, seed=9)
    x = torch.randn(8, k, device="cuda", dtype=torch.bfloat16)
    y = kernel.linear_lora(x, qw, gs, n, k, hs, bs, segs)
    chain = fused.lora_expand(kernel.linear(x, qw, gs, n, k), hs, bs, segs)
    assert y is not None and chain is not None
    a, c = y.float(), chain.float()
    base = kernel.linear(x, qw, gs, n, k).float()
    w = layout.dequantize(qw, gs, n, k, torch.float32)
    bound = (base.abs() + a.abs() + c.abs()) * 2.0 ** -8 + _fp32_slack(x, w, hs, bs) + 1e-6
    assert bool(((a - c).abs() <= bound).all())


def test_linear_lora_declines_without_launching(settings):
    """Where no small-M kernel runs the product or the term is outside what it takes, ``linear_lora`` returns
    None and leaves the output untouched: the dequantize path (the large-M threshold lowered under M), more than 16
    rows, rank rows that are not whole 16-row steps, a member boundary inside a 16-row block; ``takes_lora``
    agrees on the first two, and says yes for auto's stream-K choice (the 7B gate/up at M = 8)."""
    n, k = 384, 256
    qw, gs = make_packed(n, k, device="cuda", seed=1)
    x8 = torch.randn(8, k, device="cuda", dtype=torch.bfloat16)
    hs, bs, segs = _term((256, 64, 64), (16, 16, 16), 8, seed=2)

    def declined(x, hs, bs, segs):
        out = torch.full((x.shape[0], n), float("nan"), device="cuda", dtype=torch.bfloat16)
        r = kernel.linear_lora(x, qw, gs, n, k, hs, bs, segs, out=out)
        torch.cuda.synchronize()
        return r is None and bool(torch.isnan(out).all())

    kernel.set_variant("auto")
    assert kernel.takes_lora(8, n, k) and not declined(x8, hs, bs, segs)
    assert kernel.takes_lora(8, 37888, 3584)
    kernel.set_large_m_threshold(4)
    assert not kernel.takes_lora(8, n, k) and declined(x8, hs, bs, segs)
    kernel.set_large_m_threshold(64)
    x17 = torch.randn(17, k, device="cuda", dtype=torch.bfloat16)
    hs17, _, _ = _term((256, 64, 64), (16, 16, 16), 17, seed=3)
    assert not kernel.takes_lora(17, n, k) and declined(x17, hs17, bs, segs)
    hs6, bs6, segs6 = _term((256, 64, 64), (6, 6, 6), 8, seed=4)
    assert declined(x8, hs6, bs6, segs6)
    hs_b, bs_b, _ = _term((248, 72, 64), (16, 16, 16), 8, seed=5)
    assert declined(x8, hs_b, bs_b, (248, 0, 16, 320, 16, 32, 384, 32, 48))


@pytest.mark.parametrize("rank", [16, 6])
def test_engine_decode_with_lora_in_kernel(rank, monkeypatch):
    """Decode steps with an adapter: with rank 16 every projection of this model (all small enough for the v1
    kernel) takes its LoRA term inside the NVFP4 kernel (counted: ``linear_lora`` returns outputs, and the o
    projection's shrink comes from ``fused.lora_shrink``); rank 6 is declined and the separate expand runs. The
    policy is the one without the term in the kernel: greedy tokens agree on the first steps, and the behaviour
    log-probs of a sampled rollout match the teacher-forced forward within bf16 rounding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from qerl_cli import engine as engine_mod
    from qerl_cli.engine import Engine, LoRA, SamplingConfig
    from qerl_cli.packed_model import pack_model_inplace

    torch.manual_seed(0)
    conf = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                       num_attention_heads=8, num_key_value_heads=2, initializer_range=0.08)
    model = pack_model_inplace(LlamaForCausalLM(conf).to("cuda", torch.bfloat16).eval())
    calls = {"in_kernel": 0, "shrink": 0}

    def counting(name, fn):
        def call(*args, **kw):
            out = fn(*args, **kw)
            calls[name] += out is not None
            return out
        return call

    monkeypatch.setattr(engine_mod._kernel, "linear_lora", counting("in_kernel", kernel.linear_lora))
    monkeypatch.setattr(engine_mod._fk, "lora_shrink", counting("shrink", fused.lora_shrink))
    g = torch.Generator(device="cuda").manual_seed(1)
    factors = {}
    for i, layer in enumerate(model.model.layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            lin = layer.get_submodule(name)
            factors[f"model.layers.{i}.{name}"] = (
                torch.randn(rank, lin.in_features, device="cuda", generator=g) * 0.05,
                torch.randn(lin.out_features, rank, device="cuda", generator=g) * 0.05)
    engines = []
    for in_kernel in (False, True):
        eng = Engine(model, "cuda")
        eng.set_adapter(LoRA(factors, scaling=2.0))
        eng.lora_in_kernel = in_kernel
        engines.append(eng)
    greedy = SamplingConfig(temperature=0, max_new_tokens=16)
    off = engines[0].generate(PROMPTS, 2, greedy, 0, set(), 0)
    assert calls == {"in_kernel": 0, "shrink": 0}
    on = engines[1].generate(PROMPTS, 2, greedy, 0, set(), 0)
    n_layers = len(model.model.layers)
    if rank == 16:
        # q/k/v, o, gate/up, down per layer; the o shrink on its own (warm-up and graph capture at least)
        assert calls["in_kernel"] >= 4 * n_layers and calls["shrink"] >= n_layers, calls
    else:
        assert calls["in_kernel"] == 0, calls
    assert float((off.completion_ids[:, :4] == on.completion_ids[:, :4]).float().mean()) >= 0.75
    s = engines[1].generate(PROMPTS, 4, SamplingConfig(temperature=1.0, max_new_tokens=24), 5, set(), 0)
    with torch.no_grad():
        tf = engines[1].sequence_logprobs(s.prompt_ids, s.completion_ids, s.completion_mask, 1.0, 0,
                                          group=4).float().cpu()
    gap = (tf - s.behaviour_logprobs).abs()[s.completion_mask]
    assert torch.isfinite(gap).all() and float(gap.max()) < 0.25 and float(gap.mean()) < 0.03


PROMPTS = [[1, 20, 300, 41, 77, 901, 12], [1, 3000, 4], [1, 9, 8, 7, 6, 5, 4, 3, 2000, 1500, 17, 18]]
