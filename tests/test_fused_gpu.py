"""The fused elementwise CUDA kernels (csrc/fused_ops.cu) against the torch chains they replace, and the
engine with them against the engine without. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qerl_cli import fused
from qerl_cli.engine import Engine, SamplingConfig, _rms_norm_fused, _rope1

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def built():
    assert fused.available(), f"fused kernels failed to build: {fused.build_error()}"


def _rand(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16)


@pytest.mark.parametrize("rows,width", [(1, 64), (8, 18944), (37, 1536)])
def test_silu_mul_bit_exact(rows, width):
    y = _rand(rows, 2 * width, scale=3.0)
    g, u = y.split(width, dim=-1)
    out = fused.silu_mul(g, u)
    assert torch.equal(out, F.silu(g) * u)


@pytest.mark.parametrize("b,t,h,kv,d,slot", [(8, 1, 28, 4, 128, 300), (3, 5, 8, 2, 32, 0), (2, 1, 9, 3, 64, 7)])
def test_rope_kv_bit_exact(b, t, h, kv, d, slot):
    s_len = slot + t + 3
    y = _rand(b, t, (h + 2 * kv) * d)
    ang = torch.randn(b, t, d // 2, device="cuda") * 3
    cos, sin = torch.cat([ang.cos()] * 2, -1).bfloat16(), torch.cat([ang.sin()] * 2, -1).bfloat16()
    kc, vc = _rand(b, kv, s_len, d), _rand(b, kv, s_len, d)
    k_ref, v_ref = kc.clone(), vc.clone()
    qk = _rope1(y[..., : (h + kv) * d].view(b, t, h + kv, d), cos.unsqueeze(2), sin.unsqueeze(2))
    slots = torch.arange(slot, slot + t, device="cuda")
    k_ref.index_copy_(2, slots, qk[:, :, h:].transpose(1, 2))
    v_ref.index_copy_(2, slots, y[..., (h + kv) * d:].view(b, t, kv, d).transpose(1, 2))
    q = fused.rope_kv(y, cos, sin, kc, vc, slots[:1], h)
    assert torch.equal(q, qk[:, :, :h].transpose(1, 2).contiguous())
    assert torch.equal(kc, k_ref) and torch.equal(vc, v_ref)  # the other slots untouched


@pytest.mark.parametrize("rows,width,per_row", [(8, 3584, False), (5, 576, True), (1, 8192, False)])
def test_add_norm_within_one_rounding(rows, width, per_row):
    h, d = _rand(rows, 1, width, scale=4), _rand(rows, 1, width, scale=4)
    w = (1 + 0.1 * torch.randn(rows if per_row else 1, 1, width, device="cuda")).bfloat16()
    w = w if per_row else w.view(width)
    s, x = fused.add_norm(h, d, w, 1e-5)
    assert torch.equal(s, h + d)
    ref = s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()
    assert float(((x.float() - ref).abs() - 2**-8 * ref.abs()).max()) <= 1e-6  # one bf16 rounding of the fp32 value
    torch_x = _rms_norm_fused(s, w, 1e-5)
    assert float(((x.float() - torch_x.float()).abs() - 2**-7 * torch_x.float().abs()).max()) <= 1e-6
    s2, x2 = fused.add_norm(s, None, w, 1e-5)
    assert s2 is s and torch.equal(x2, x)


@pytest.mark.parametrize("rows,width,per_row", [(1, 576, False), (24, 3584, True), (64, 5120, False),
                                                 (10, 8192, True)])
def test_add_norm_reads_fp32_noisy_scales(rows, width, per_row):
    """AQN's fp32 scales read by the kernel itself (no rounding to bf16): within one rounding of the fp32 value,
    equal to the torch definition but for the order of the sum of squares, and a draw far below a bf16 unit
    still changes the output."""
    h, d = _rand(rows, 1, width, scale=4), _rand(rows, 1, width, scale=4)
    clean = (1 + 0.1 * torch.randn(rows if per_row else 1, 1, width, device="cuda")).bfloat16()
    w = clean.float() + 5e-4 * torch.randn(clean.shape, device="cuda")
    clean, w = (clean, w) if per_row else (clean.view(width), w.view(width))
    assert float((w.bfloat16() == clean).float().mean()) > 0.5  # rounded to bf16, most of the draw would vanish
    s, x = fused.add_norm(h, d, w, 1e-5)
    assert torch.equal(s, h + d)
    ref = s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + 1e-5) * w
    assert float(((x.float() - ref).abs() - 2**-8 * ref.abs()).max()) <= 1e-6
    _, x_torch = fused._add_norm_torch(h, d, w, 1e-5)
    assert float(((x.float() - x_torch.float()).abs() - 2**-7 * x_torch.float().abs()).max()) <= 1e-6
    assert float((x == x_torch).float().mean()) > 0.99
    _, x_clean = fused.add_norm(h, d, clean, 1e-5)
    assert float((x != x_clean).float().mean()) > 0.02


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    conf = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                       num_attention_heads=8, num_key_value_heads=2, initializer_range=0.08)
    return LlamaForCausalLM(conf).to("cuda", torch.bfloat16).eval()


@pytest.mark.parametrize("m,k,r,n", [(8, 3584, 96, 4608), (1, 18944, 32, 3584), (16, 3584, 64, 37888),
                                     (5, 576, 24, 1536), (9, 200, 256, 66), (16, 64, 256, 2)])
def test_lora_add_against_fp32_reference(m, k, r, n):
    """y + bf16(x @ a^T) @ bs in the two fused kernels: within bf16 rounding of the fp32 chain (h rounded to
    bf16 as the matmul chain rounds it) and of torch's addmm path, deterministic, the output poisoned first."""
    x, a = _rand(m, k), _rand(r, k, scale=0.05)
    y, bs = _rand(m, n), _rand(r, n, scale=0.05)
    out = fused.lora_add(y, x, a, bs)
    assert out is not None
    h = (x.float() @ a.float().t()).bfloat16().float()
    ref = y.float() + h @ bs.float()
    err = float((out.float() - ref).norm() / ref.norm())
    assert torch.isfinite(out).all() and err < 4e-3, err
    chain = torch.addmm(y, x @ a.t(), bs)
    assert float((out.float() - chain.float()).norm() / chain.float().norm()) < 4e-3
    assert torch.equal(out, fused.lora_add(y, x, a, bs))  # a fixed summation order


def test_lora_add_block_diagonal_segments():
    """A fused group's block-diagonal bs (q rank 8, k none, v rank 24): with the member segments the kernel reads
    only each member's rows and gives the same result as over the whole bs (the zero blocks add exact zeros)."""
    m, k, sizes, ranks = 8, 3584, (3584, 512, 512), (8, 0, 24)
    x, a = _rand(m, k), _rand(sum(ranks), k, scale=0.05)
    y = _rand(m, sum(sizes))
    bs = torch.zeros(sum(ranks), sum(sizes), dtype=torch.bfloat16, device="cuda")
    segs, row, col = [], 0, 0
    for size, r in zip(sizes, ranks):
        bs[row: row + r, col: col + size] = _rand(r, size, scale=0.05)
        col += size
        segs += [col, row, row + r]
        row += r
    whole, seg = fused.lora_add(y, x, a, bs), fused.lora_add(y, x, a, bs, tuple(segs))
    assert whole is not None and seg is not None and torch.equal(whole, seg)
    assert torch.equal(seg[:, sizes[0]: sizes[0] + sizes[1]], y[:, sizes[0]: sizes[0] + sizes[1]])  # k: no term
    for bad in ((sum(sizes) - 1, 0, 8), (100, 0, 8, 50, 0, 8, sum(sizes), 8, 32), (sum(sizes), 0, 33)):
        assert fused.lora_add(y, x, a, bs, bad) is None  # odd, decreasing or past R: declined


def test_lora_add_declines_what_it_does_not_take():
    """More than 16 rows, K not a multiple of 8, or a non-bf16 factor: None, nothing computed (the engine then
    uses its matmuls); disagreeing shapes: an error."""
    x, a, y, bs = _rand(17, 64), _rand(8, 64), _rand(17, 32), _rand(8, 32)
    assert fused.lora_add(y, x, a, bs) is None
    assert fused.lora_add(_rand(4, 32), _rand(4, 60), _rand(8, 60), _rand(8, 32)) is None
    assert fused.lora_add(y[:4], x[:4], a.float(), bs) is None
    with pytest.raises(ValueError, match="shapes disagree"):
        fused.lora_add(y[:4], x[:4], _rand(8, 32), bs)


def _within_one_bf16_rounding(got: torch.Tensor, x: torch.Tensor, a: torch.Tensor) -> None:
    """``got`` is bf16(x @ a^T) up to the order of the fp32 sums: bf16 values, each within one bf16 unit of the
    fp32 product (plus a floor for sums that cancel), and not all zero."""
    ref = x.float().reshape(-1, x.shape[-1]) @ a.float().t()
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert torch.equal(got, got.bfloat16().float())  # rounded to bf16, as the matmul chain rounds h
    slack = 2**-7 * ref.abs() + 1e-5 * float(ref.abs().max())
    assert bool(((got - ref).abs() <= slack).all()), float((got - ref).abs().max())
    assert float(got.abs().max()) > 0


@pytest.mark.parametrize("rows,width,r,per_row,with_d", [(8, 3584, 96, True, True), (5, 576, 18, False, False),
                                                         (16, 8192, 40, False, True), (1, 5120, 7, True, True)])
def test_add_norm_shrink(rows, width, r, per_row, with_d):
    """add + RMSNorm with the LoRA shrink of its output in the same kernel: the residual and x bit-identical to
    add_norm's, hs = bf16(x @ a^T) within one rounding (fp32 noisy per-row scales, bf16 shared ones; rank rows
    not a multiple of the kernel's 4 per block; 64 KB of a in shared memory at width 8192); deterministic."""
    h, d = _rand(rows, 1, width, scale=4), (_rand(rows, 1, width, scale=4) if with_d else None)
    w = 1 + 0.1 * torch.randn(rows if per_row else 1, 1, width, device="cuda")
    w = w if per_row else w.view(width).bfloat16()
    a = _rand(r, width, scale=0.05)
    made = fused.add_norm_shrink(h, d, w, 1e-5, a)
    assert made is not None
    s, x, hs = made
    s_ref, x_ref = fused.add_norm(h, d, w, 1e-5)
    assert torch.equal(s, s_ref) and torch.equal(x, x_ref)
    _within_one_bf16_rounding(hs, x, a)
    assert torch.equal(hs, fused.add_norm_shrink(h, d, w, 1e-5, a)[2])


@pytest.mark.parametrize("rows,width,r", [(8, 18944, 32), (3, 1536, 5), (16, 27648, 64)])
def test_silu_mul_shrink(rows, width, r):
    """SiLU·mul with the down projection's LoRA shrink: the activation bit-identical to silu_mul's (on the strided
    halves of a fused gate/up output), hs = bf16(out @ a^T) within one rounding; deterministic."""
    y = _rand(rows, 2 * width, scale=3.0)
    g, u = y.split(width, dim=-1)
    a = _rand(r, width, scale=0.05)
    made = fused.silu_mul_shrink(g, u, a)
    assert made is not None
    out, hs = made
    assert torch.equal(out, F.silu(g) * u)
    _within_one_bf16_rounding(hs, out, a)
    assert torch.equal(hs, fused.silu_mul_shrink(g, u, a)[1])


def test_lora_expand_after_fused_shrink():
    """The expand alone on a fused shrink's hs: y + hs @ bs within bf16 rounding of the fp32 value, the member
    segments of a block-diagonal bs honoured (a member without a term keeps y), the same as lora_add's whole
    chain within bf16 rounding; more than 16 rows declined, disagreeing shapes an error."""
    m, k, sizes, ranks = 8, 3584, (3584, 512, 512), (8, 0, 24)
    h, a = _rand(m, 1, k, scale=4), _rand(sum(ranks), k, scale=0.05)
    w = (1 + 0.1 * torch.randn(k, device="cuda")).bfloat16()
    _, x, hs = fused.add_norm_shrink(h, None, w, 1e-5, a)
    y = _rand(m, sum(sizes))
    bs = torch.zeros(sum(ranks), sum(sizes), dtype=torch.bfloat16, device="cuda")
    segs, row, col = [], 0, 0
    for size, r in zip(sizes, ranks):
        bs[row: row + r, col: col + size] = _rand(r, size, scale=0.05)
        col += size
        segs += [col, row, row + r]
        row += r
    out = fused.lora_expand(y, hs, bs, tuple(segs))
    assert out is not None and torch.isfinite(out).all()
    ref = y.float() + hs @ bs.float()
    assert float(((out.float() - ref).abs() - 2**-8 * ref.abs()).max()) <= 1e-5
    assert torch.equal(out[:, sizes[0]: sizes[0] + sizes[1]], y[:, sizes[0]: sizes[0] + sizes[1]])
    chain = fused.lora_add(y, x.view(m, k), a, bs, tuple(segs))
    assert float((out.float() - chain.float()).norm() / chain.float().norm()) < 4e-3
    assert fused.lora_expand(_rand(17, 64), torch.zeros(17, 8, device="cuda"), _rand(8, 64)) is None
    with pytest.raises(ValueError, match="shapes disagree"):
        fused.lora_expand(y, hs[:, :4], bs)


def _sample_buffers(rows: int, steps: int):
    dev = "cuda"
    return (torch.zeros(rows, dtype=torch.bool, device=dev),                       # finished
            torch.full((rows, steps), -7, dtype=torch.long, device=dev),           # out (poisoned)
            torch.ones(rows, steps, dtype=torch.bool, device=dev),                 # mask (poisoned)
            torch.full((rows, steps), float("nan"), device=dev),                   # blp (poisoned)
            torch.full((rows, steps), float("nan"), device=dev),                   # tlp (poisoned)
            torch.zeros(1, dtype=torch.int32, device=dev))                         # bad


def test_sample_step_draws_from_the_tempered_softmax():
    """16,384 draws from one 10-token distribution at T = 0.7 (4,096 rows x 4 steps): frequencies within 0.015 of
    softmax(z / T) (about 4 standard errors), each log-prob = log_softmax(z / T)[token] to 1e-5 in both columns,
    mask set; the same (seed, step) draws the same tokens, another seed or step others."""
    rows, steps, t = 4096, 4, 0.7
    z = torch.randn(10, device="cuda") * 2
    logits = z.expand(rows, 10).contiguous()
    finished, out, mask, blp, tlp, bad = _sample_buffers(rows, steps)
    eos = torch.empty(0, dtype=torch.long, device="cuda")
    toks = [fused.sample_step(logits, t, 1234, s, finished, eos, 0, out, mask, blp, tlp, bad) for s in range(steps)]
    assert all(x is not None for x in toks) and int(bad) == 0
    assert torch.equal(torch.stack(toks, 1), out) and bool(mask.all())
    p_ref = torch.softmax(z / t, -1)
    freq = torch.bincount(out.flatten(), minlength=10).float() / out.numel()
    assert float((freq - p_ref).abs().max()) < 0.015, (freq, p_ref)
    lp_ref = torch.log_softmax(z / t, -1)[out]
    assert float((blp - lp_ref).abs().max()) < 1e-5 and torch.equal(blp, tlp)
    again = fused.sample_step(logits, t, 1234, 0, torch.zeros_like(finished), eos, 0, out.clone(), mask.clone(),
                              blp.clone(), tlp.clone(), bad)
    assert torch.equal(again, toks[0])
    other_seed = fused.sample_step(logits, t, 99, 0, torch.zeros_like(finished), eos, 0, out.clone(), mask.clone(),
                                   blp.clone(), tlp.clone(), bad)
    assert not torch.equal(other_seed, toks[0]) and not torch.equal(toks[1], toks[0])


@pytest.mark.parametrize("v", [152064, 1001, 3])
def test_sample_step_vocabularies(v):
    """A large vocabulary (many slices per row), one that is not a multiple of 4, a tiny one: a token 30 nats above
    the rest is drawn every time with log-prob ~0 (to 1e-4 of torch's log_softmax); a token masked to -inf is never
    drawn and adds nothing to the normalizer."""
    rows = 8
    logits = torch.randn(rows, v, device="cuda")
    top = torch.randint(0, v, (rows,), device="cuda")
    logits[torch.arange(rows), top] += 30
    finished, out, mask, blp, tlp, bad = _sample_buffers(rows, 1)
    eos = torch.tensor([v + 5], device="cuda")
    tok = fused.sample_step(logits, 1.0, 7, 0, finished, eos, 0, out, mask, blp, tlp, bad)
    assert torch.equal(tok, top) and int(bad) == 0
    ref = torch.log_softmax(logits, -1)[torch.arange(rows), top]
    assert float((blp[:, 0] - ref).abs().max()) < 1e-4
    masked = logits.clone()
    masked[torch.arange(rows), top] = float("-inf")
    masked[torch.arange(rows), (top + 1) % v] += 30  # a new favourite next to it
    tok2 = fused.sample_step(masked, 1.0, 7, 0, torch.zeros_like(finished), eos, 0, out, mask, blp, tlp, bad)
    assert not bool((tok2 == top).any()) and int(bad) == 0
    ref2 = torch.log_softmax(masked, -1).gather(1, tok2[:, None])[:, 0]
    assert float((blp[:, 0] - ref2).abs().max()) < 1e-4


def test_sample_step_bookkeeping():
    """Finished rows: pad, mask 0, log-probs 0, and they stay finished; a live row that draws an eos token becomes
    finished (with its token and log-prob recorded); a NaN logit raises the flag; what the kernel does not take
    (fp16 logits, temperature 0, mismatched buffers) is declined with nothing written."""
    rows, v = 6, 50
    logits = torch.randn(rows, v, device="cuda")
    logits[:, 7] += 40  # every live row draws token 7, an eos
    finished, out, mask, blp, tlp, bad = _sample_buffers(rows, 3)
    finished[1] = True
    finished[4] = True
    eos = torch.tensor([3, 7], device="cuda")
    tok = fused.sample_step(logits, 1.0, 5, 1, finished, eos, 2, out, mask, blp, tlp, bad)
    live = torch.tensor([True, False, True, True, False, True], device="cuda")
    assert torch.equal(tok, torch.where(live, 7, 2)) and torch.equal(out[:, 1], tok)
    assert torch.equal(mask[:, 1], live) and bool(finished.all())
    assert bool((blp[~live, 1] == 0).all()) and bool((blp[live, 1].abs() < 1e-6).all())
    assert bool((out[:, 0] == -7).all()) and bool((out[:, 2] == -7).all())  # only column 1 written
    assert int(bad) == 0
    logits[3, 11] = float("nan")
    fused.sample_step(logits, 1.0, 5, 2, torch.zeros_like(finished), eos, 2, out, mask, blp, tlp, bad)
    assert int(bad) == 1
    before = out.clone()
    assert fused.sample_step(logits.half(), 1.0, 5, 0, finished, eos, 2, out, mask, blp, tlp, bad) is None
    assert fused.sample_step(logits, 0.0, 5, 0, finished, eos, 2, out, mask, blp, tlp, bad) is None
    assert fused.sample_step(logits, 1.0, 5, 3, finished, eos, 2, out, mask, blp, tlp, bad) is None  # past T
    assert fused.sample_step(logits[:5], 1.0, 5, 0, finished, eos, 2, out, mask, blp, tlp, bad) is None
    assert torch.equal(out, before)


PROMPTS = [[1, 20, 300, 41, 77, 901, 12], [1, 3000, 4], [1, 9, 8, 7, 6, 5, 4, 3, 2000, 1500, 17, 18]]


def test_engine_with_kernels_matches_engine_without(model):
    """Same policy with and without the fused kernels: teacher-forced log-probs (with per-group AQN weights)
    within bf16 rounding, greedy tokens agreeing, CUDA graph equal to eager with the kernels on."""
    on, off = Engine(model, "cuda"), Engine(model, "cuda", kernels=False)
    assert on._kernels and not off._kernels
    cfg = SamplingConfig(temperature=0, max_new_tokens=16)
    a = on.generate(PROMPTS, 2, cfg, 0, set(), 0)
    b = off.generate(PROMPTS, 2, cfg, 0, set(), 0)
    assert float((a.completion_ids[:, :4] == b.completion_ids[:, :4]).float().mean()) >= 0.75
    eager = Engine(model, "cuda", cuda_graph=False).generate(PROMPTS, 2, cfg, 0, set(), 0)
    assert torch.equal(a.completion_ids, eager.completion_ids)
    for e in (on, off):
        e.set_noise(0.02, 3, scope="group", groups=len(PROMPTS), group_size=4)
    s = on.generate(PROMPTS, 4, SamplingConfig(temperature=1.0, max_new_tokens=24), 5, set(), 0)
    with torch.no_grad():
        lp_on = on.sequence_logprobs(s.prompt_ids, s.completion_ids, s.completion_mask, 1.0, 0, group=4).float()
        lp_off = off.sequence_logprobs(s.prompt_ids, s.completion_ids, s.completion_mask, 1.0, 0, group=4).float()
    gap = (lp_on - lp_off).abs().cpu()[s.completion_mask]
    assert torch.isfinite(gap).all() and float(gap.max()) < 0.25 and float(gap.mean()) < 0.03
    beh = (lp_on.cpu() - s.behaviour_logprobs).abs()[s.completion_mask]
    assert float(beh.max()) < 0.25 and float(beh.mean()) < 0.03
