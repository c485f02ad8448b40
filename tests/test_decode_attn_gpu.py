"""One decode step's attention kernel (fused.decode_attn, csrc/decode_attn.cuh) against an fp32 reference, its
declines, its determinism and CUDA-graph replay, and the engine with it against the engine with SDPA. Skipped
without a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qerl_cli import fused
from qerl_cli.engine import Engine, SamplingConfig

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def built():
    assert fused.available(), f"fused kernels failed to build: {fused.build_error()}"


def _case(b, h, kv, d, s_len, slot, seed=0):
    """q, caches, key mask (left padding of a different length per row; with two rows or more the last one has
    every slot masked, so only the step's own slot counts), slot; the slots after ``slot`` hold NaN (never
    attended: a kernel that reads them fails), masked slots hold large finite keys (they would dominate)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, h, 1, d, device="cuda", generator=g).bfloat16()
    kc = torch.randn(b, kv, s_len, d, device="cuda", generator=g).bfloat16()
    vc = torch.randn(b, kv, s_len, d, device="cuda", generator=g).bfloat16()
    key_mask = torch.ones(b, s_len + 5, dtype=torch.bool, device="cuda")  # (wider than the cache: allowed)
    for i in range(b):
        pad = (i * 37) % (slot + 1) if i < b - 1 or b == 1 else s_len  # row i's left padding: slots [0, pad)
        key_mask[i, :pad] = False
        kc[i, :, :pad] = 30.0
    kc[:, :, slot + 1:] = float("nan")
    vc[:, :, slot + 1:] = float("nan")
    return q, kc, vc, key_mask, torch.tensor([slot], device="cuda")


def _reference(q, kc, vc, key_mask, slot):
    """fp32 attention of the step: slots [0, slot] allowed by key_mask, the own slot always."""
    b, h, _, d = q.shape
    kv, n = kc.shape[1], int(slot) + 1
    k = kc[:, :, :n].float().repeat_interleave(h // kv, 1)
    v = vc[:, :, :n].float().repeat_interleave(h // kv, 1)
    s = (q.float() @ k.transpose(-1, -2)) * d ** -0.5  # [b, h, 1, n]
    allowed = key_mask[:, :n].clone()
    allowed[:, n - 1] = True
    s = s.masked_fill(~allowed[:, None, None, :], float("-inf"))
    return (s.softmax(-1) @ v).reshape(b, 1, h * d)


def _run(q, kc, vc, key_mask, slot):
    """The extension called on a NaN-poisoned output (every element must be written)."""
    b, h, _, d = q.shape
    out = torch.full((b, 1, h * d), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert fused._load().decode_attn(q, kc, vc, key_mask, slot, out, d ** -0.5)
    return out


@pytest.mark.parametrize("b,h,kv,d,s_len,slot", [
    (8, 28, 4, 128, 768, 300),     # Qwen2.5-7B, batch 8: several splits
    (8, 28, 4, 128, 768, 767),     # the last slot of the cache
    (64, 28, 4, 128, 768, 511),    # batch 64
    (3, 9, 3, 64, 384, 200),       # SmolLM2-135M (head_dim 64, 3 query heads per KV head)
    (2, 8, 8, 128, 64, 0),         # one query head per KV head, only the own slot
    (5, 14, 2, 64, 4096, 4000),    # Qwen2.5-0.5B shape, a long cache
    (1, 40, 8, 128, 2048, 1500),   # Qwen2.5-32B shape (5 per KV head)
    (2, 16, 2, 128, 32768, 20000), # the most slots the kernel takes at head_dim 128 (256 splits of 128)
])
def test_decode_attn_against_fp32(b, h, kv, d, s_len, slot):
    """Within one bf16 rounding of the fp32 attention (fp32 scores, softmax, sums; output rounded once), where
    SDPA rounds its probabilities to bf16 too; every output written, slots after the step's never read."""
    q, kc, vc, key_mask, sl = _case(b, h, kv, d, s_len, slot)
    out = _run(q, kc, vc, key_mask, sl)
    ref = _reference(q, kc, vc, key_mask, slot)
    assert torch.isfinite(out).all()
    err = (out.float() - ref).abs()
    assert float((err - 2**-8 * ref.abs()).max()) <= 1e-5, float(err.max())
    # and no further from the reference than SDPA over the slots it may see (bf16 probabilities)
    n = slot + 1
    allowed = key_mask[:, :n].clone()
    allowed[:, n - 1] = True
    add = torch.zeros(b, 1, 1, n, dtype=torch.bfloat16, device="cuda").masked_fill(~allowed[:, None, None],
                                                                                     float("-inf"))
    sdpa = F.scaled_dot_product_attention(q, kc[:, :, :n], vc[:, :, :n], attn_mask=add, enable_gqa=kv != h)
    sdpa_err = float((sdpa.transpose(1, 2).reshape(b, 1, h * d).float() - ref).abs().max())
    assert float(err.max()) <= sdpa_err + 1e-3


@pytest.mark.parametrize("splits", [1, 6, 13, 64, 256])
def test_decode_attn_forced_splits(splits):
    """A requested number of splits (raised to the 6 that the 768 slots' buffers need; 256 leaves most blocks
    without slots: each must still report an empty partial) gives the fp32 result within one bf16 rounding."""
    q, kc, vc, key_mask, sl = _case(8, 28, 4, 128, 768, 300, seed=2)
    out = fused.decode_attn(q, kc, vc, key_mask, sl, splits=splits)
    ref = _reference(q, kc, vc, key_mask, 300)
    assert out is not None and torch.isfinite(out).all()
    assert float(((out.float() - ref).abs() - 2**-8 * ref.abs()).max()) <= 1e-5
    with pytest.raises(ValueError, match="splits"):
        fused.decode_attn(q, kc, vc, key_mask, sl, splits=-1)


@pytest.mark.parametrize("b,h,kv,d,s_len,slot", [
    (8, 28, 4, 128, 768, 300),   # Qwen2.5-7B (7 query heads per KV head)
    (3, 9, 3, 64, 384, 200),     # SmolLM2 (head_dim 64, 3 per KV head)
    (2, 40, 8, 128, 1024, 1000), # Qwen2.5-32B (5 per KV head)
])
@pytest.mark.parametrize("splits", [2, 3, 5, 8])
def test_decode_attn_cluster_equals_workspace(b, h, kv, d, s_len, slot, splits):
    """2 ... 8 splits added in a thread-block cluster (distributed shared memory) give the bits of the same splits
    added through the workspace by the last block, and the fp32 result within one bf16 rounding."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread-block clusters need sm_90")
    q, kc, vc, key_mask, sl = _case(b, h, kv, d, s_len, slot, seed=3)
    need = -(-s_len // (32768 // (2 * d)))  # the splits the slot buffers need
    if splits < need:
        pytest.skip(f"{s_len} slots need {need} splits")
    ext = fused._load()
    via_cluster = fused.decode_attn(q, kc, vc, key_mask, sl, splits=splits, cluster=True)
    assert ext.decode_attn_last_splits() == -splits  # (a cluster: these blocks fit one wave)
    via_ws = fused.decode_attn(q, kc, vc, key_mask, sl, splits=splits, cluster=False)
    assert ext.decode_attn_last_splits() == splits
    assert via_cluster is not None and via_ws is not None
    assert torch.equal(via_cluster, via_ws)
    ref = _reference(q, kc, vc, key_mask, slot)
    assert float(((via_cluster.float() - ref).abs() - 2**-8 * ref.abs()).max()) <= 1e-5


@pytest.mark.parametrize("cluster", [None, False])
def test_decode_attn_deterministic_and_graph_replay(cluster):
    """The same bits on every call (the split partials are added in split order; the tickets reset), and a CUDA
    graph captured at one slot replays for another slot as an eager call there; a graph captured first and never
    replayed leaves the next graph's tickets intact; with the splits in a cluster (the default on sm_90) and through
    the workspace and its tickets."""
    q, kc, vc, key_mask, sl = _case(8, 28, 4, 128, 768, 700, seed=1)
    kc = kc.nan_to_num(0.5)
    vc = vc.nan_to_num(0.5)
    first = fused.decode_attn(q, kc, vc, key_mask, sl, cluster=cluster)
    for _ in range(3):
        assert torch.equal(fused.decode_attn(q, kc, vc, key_mask, sl, cluster=cluster), first)
    slot = torch.tensor([257], device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused.decode_attn(q, kc, vc, key_mask, slot, cluster=cluster)  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(stream)
    unused = torch.cuda.CUDAGraph()  # (a rollout of one token captures its decode graph and never replays it)
    with torch.cuda.graph(unused):
        fused.decode_attn(q, kc, vc, key_mask, slot, cluster=cluster)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused.decode_attn(q, kc, vc, key_mask, slot, cluster=cluster)
    for s in (257, 300, 511, 767, 700):
        slot.fill_(s)
        graph.replay()
        torch.cuda.synchronize()
        eager = fused.decode_attn(q, kc, vc, key_mask, torch.tensor([s], device="cuda"), cluster=cluster)
        assert torch.equal(captured, eager), s
    assert torch.equal(captured, first)  # (the last replay was at slot 700, first's slot)


def test_decode_attn_one_wave_rule():
    """Where the blocks fit one wave (7B heads at batch 8) the default adds the splits in a cluster; at batch 64
    they do not, so the workspace adds them and ``one_wave_only`` declines (the engine's SDPA then runs)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread-block clusters need sm_90")
    ext = fused._load()
    q, kc, vc, key_mask, sl = _case(8, 28, 4, 128, 768, 300, seed=4)
    assert fused.decode_attn(q, kc, vc, key_mask, sl, one_wave_only=True) is not None
    assert ext.decode_attn_last_splits() < -1
    q, kc, vc, key_mask, sl = _case(64, 28, 4, 128, 768, 300, seed=4)
    out = fused.decode_attn(q, kc, vc, key_mask, sl)
    assert out is not None and ext.decode_attn_last_splits() > 1
    ref = _reference(q, kc, vc, key_mask, 300)
    assert float(((out.float() - ref).abs() - 2**-8 * ref.abs()).max()) <= 1e-5
    assert fused.decode_attn(q, kc, vc, key_mask, sl, one_wave_only=True) is None


@pytest.mark.parametrize("cluster", [True, False])
def test_decode_attn_late_trigger_same_bits(cluster):
    """The PDL trigger once a block's loads have landed (set_attn_late_trigger) changes when the next kernel may
    start, not the result: the same bits as the trigger at the start, eager and behind a PDL-launched kernel."""
    ext = fused._load()
    q, kc, vc, key_mask, sl = _case(8, 28, 4, 128, 768, 500, seed=5)
    early = fused.decode_attn(q, kc, vc, key_mask, sl, cluster=cluster)
    ext.set_attn_late_trigger(True)
    try:
        late = fused.decode_attn(q, kc, vc, key_mask, sl, cluster=cluster)
        chained = fused.decode_attn(q, kc, vc, key_mask, sl, cluster=cluster)  # (after a PDL launch of itself)
    finally:
        ext.set_attn_late_trigger(False)
    assert torch.equal(early, late) and torch.equal(early, chained)


def test_decode_attn_declines_what_it_does_not_take():
    q, kc, vc, key_mask, sl = _case(2, 8, 2, 128, 64, 10)
    assert fused.decode_attn(q[..., :96].contiguous(), kc[..., :96].contiguous(), vc[..., :96].contiguous(),
                             key_mask, sl) is None  # head_dim 96
    q9 = torch.randn(2, 18, 1, 128, device="cuda").bfloat16()
    assert fused.decode_attn(q9, kc, vc, key_mask, sl) is None  # 9 query heads per KV head
    assert fused.decode_attn(q, kc, vc, key_mask.float(), sl) is None  # a float mask
    assert fused.decode_attn(q, kc, vc, key_mask[:, :30], sl) is None  # a mask shorter than the cache
    assert fused.decode_attn(q.expand(2, 8, 1, 128).transpose(0, 1).contiguous().transpose(0, 1), kc, vc, key_mask,
                             sl) is None  # not contiguous
    assert fused.decode_attn(q, kc, vc, key_mask, sl.int()) is None  # an int32 slot
    big = torch.zeros(1, 1, 256 * 128 + 1, 128, dtype=torch.bfloat16, device="cuda")
    assert fused.decode_attn(q[:1, :2], big, big, torch.ones(1, big.shape[2], dtype=torch.bool, device="cuda"),
                             sl) is None  # more slots than 256 splits of 128


@pytest.fixture(scope="module")
def model64():
    """A tiny Llama with head_dim 64 (the kernel's; the fused tests' model has 32) and 4 query heads per KV head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    conf = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=3,
                       num_attention_heads=8, num_key_value_heads=2, initializer_range=0.08)
    return LlamaForCausalLM(conf).to("cuda", torch.bfloat16).eval()


PROMPTS = [[1, 20, 300, 41, 77, 901, 12], [1, 3000, 4], [1, 9, 8, 7, 6, 5, 4, 3, 2000, 1500, 17, 18]]


@pytest.mark.parametrize("mode", [True, "wave"])
def test_engine_decode_attn_same_policy(model64, monkeypatch, mode):
    """The engine's decode steps with the kernel (counted, with the rotary inside or not; everywhere, or only where its blocks fit one wave: all of
    these small steps) against SDPA: greedy tokens agreeing, sampled tokens' behaviour log-probs against a
    teacher-forced forward within the bounds of the SDPA engine; a declined call falls back to SDPA with the mask
    built on the spot (the same tokens as SDPA)."""
    calls = []

    def counting(real):
        def counted(*a, **k):
            out = real(*a, **k)
            if out is not None:  # (a call that declined falls back to the next route: not counted)
                calls.append(k.get("one_wave_only", False))
            return out
        return counted

    monkeypatch.setattr(fused, "decode_attn", counting(fused.decode_attn))
    monkeypatch.setattr(fused, "rope_decode_attn", counting(fused.rope_decode_attn))
    on, off = Engine(model64, "cuda"), Engine(model64, "cuda")
    on.decode_attn, off.decode_attn = mode, False
    assert on._decode_attn_ok() and not off._decode_attn_ok()
    assert on.decode_attention().startswith("fused.decode_attn") and off.decode_attention() == "SDPA"
    cfg = SamplingConfig(temperature=0, max_new_tokens=16)
    a = on.generate(PROMPTS, 2, cfg, 0, set(), 0)
    assert calls, "the decode steps never called fused.decode_attn"
    assert all(c == (mode == "wave") for c in calls)
    n_on = len(calls)
    b = off.generate(PROMPTS, 2, cfg, 0, set(), 0)
    assert len(calls) == n_on  # SDPA engine: no call
    assert float((a.completion_ids[:, :4] == b.completion_ids[:, :4]).float().mean()) >= 0.75
    eager_engine = Engine(model64, "cuda", cuda_graph=False)
    eager_engine.decode_attn = mode
    eager = eager_engine.generate(PROMPTS, 2, cfg, 0, set(), 0)
    assert torch.equal(a.completion_ids, eager.completion_ids)
    s = on.generate(PROMPTS, 4, SamplingConfig(temperature=1.0, max_new_tokens=24), 5, set(), 0)
    with torch.no_grad():
        lp = on.sequence_logprobs(s.prompt_ids, s.completion_ids, s.completion_mask, 1.0, 0, group=4).float()
    beh = (lp.cpu() - s.behaviour_logprobs).abs()[s.completion_mask]
    assert torch.isfinite(beh).all() and float(beh.max()) < 0.25 and float(beh.mean()) < 0.03
    monkeypatch.setattr(fused, "decode_attn", lambda *a, **k: None)  # the kernel declines every call
    monkeypatch.setattr(fused, "rope_decode_attn", lambda *a, **k: None)
    declining = Engine(model64, "cuda")
    declining.decode_attn = True
    declined = declining.generate(PROMPTS, 2, cfg, 0, set(), 0)
    assert torch.equal(declined.completion_ids, b.completion_ids)
    # a declined step builds its mask once, in its first layer, for all of them (not once per layer)
    built = {"mask": 0, "forward": 0}

    def count(key, real):
        def counted(*a, **k):
            built[key] += 1
            return real(*a, **k)
        return counted

    eager_declining = Engine(model64, "cuda", cuda_graph=False)
    eager_declining.decode_attn = True
    monkeypatch.setattr(eager_declining, "_mask", count("mask", eager_declining._mask))
    monkeypatch.setattr(eager_declining, "forward", count("forward", eager_declining.forward))
    assert torch.equal(eager_declining.generate(PROMPTS, 2, cfg, 0, set(), 0).completion_ids, b.completion_ids)
    assert built["forward"] > 2 and built["mask"] == built["forward"], built
    assert eager_declining._step_mask is None  # (not kept past its forward)


@pytest.mark.parametrize("b,h,kv,d,s_len", [(8, 28, 4, 128, 768), (64, 28, 4, 128, 768), (256, 9, 3, 64, 384),
                                             (3, 9, 3, 64, 384), (2, 16, 2, 128, 32768), (2, 16, 2, 128, 40000),
                                             (4, 8, 2, 32, 64), (4, 36, 2, 64, 64)])
def test_decode_attn_takes_is_the_launchers_decision(b, h, kv, d, s_len):
    """fused.decode_attn_takes (the engine asks it before a rollout's decode steps) says, from the shapes alone,
    what decode_attn decides on the tensors: with and without one_wave_only, on shapes it takes in one wave, past
    one wave (SmolLM2 at batch 256), past its slots, and at head dims or groups it never takes."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, h, 1, d, device="cuda", generator=g).bfloat16()
    kc = torch.randn(b, kv, s_len, d, device="cuda", generator=g).bfloat16()
    vc = torch.randn_like(kc)
    key_mask = torch.ones(b, s_len, dtype=torch.bool, device="cuda")
    slot = torch.tensor([s_len - 1], device="cuda")
    for wave in (False, True):
        ran = fused.decode_attn(q, kc, vc, key_mask, slot, one_wave_only=wave) is not None
        assert fused.decode_attn_takes(b, h, kv, s_len, d, kc.device, one_wave_only=wave) == ran, (wave, ran)


def test_rope_table_rows_are_the_rotary_modules_bits(model64):
    """The engine's cos / sin table (made once per rollout, gathered per decode step) holds, at every position,
    the bits the model's rotary module gives for it; a forward with a cache longer than the table uses the module."""
    eng = Engine(model64, "cuda")
    eng._rope_table(300)
    assert eng._rope_tab is not None and eng._rope_tab.shape[0] >= 300
    pos = torch.randint(0, 300, (4, 7), device="cuda")
    x = torch.empty(0, dtype=torch.bfloat16, device="cuda")
    cos, sin = eng.rotary(x, pos)
    c2, s2 = eng._cos_sin(x, pos, [(torch.empty(1, 1, 300, 1), None)])
    assert torch.equal(cos, c2) and torch.equal(sin, s2)
    c3, _ = eng._cos_sin(x, pos, [(torch.empty(1, 1, 301, 1), None)])  # a cache longer than the table: the module
    assert torch.equal(cos, c3)


def _rope_case(b, h, kv, d, s_len, slot, seed=0):
    """A decode step's fused q/k/v row ``y [b, 1, (h + 2 kv) d]``, cos / sin ``[b, 1, d]`` of a position per row,
    and _case's caches, mask and slot; the step's own slot holds NaN in the caches (it must be written)."""
    _, kc, vc, key_mask, sl = _case(b, h, kv, d, s_len, slot, seed=seed)
    kc[:, :, slot] = float("nan")
    vc[:, :, slot] = float("nan")
    g = torch.Generator(device="cuda").manual_seed(seed + 100)
    y = torch.randn(b, 1, (h + 2 * kv) * d, device="cuda", generator=g).bfloat16()
    pos = torch.randint(0, 4096, (b, 1, 1), device="cuda", generator=g).float()
    inv = 10000.0 ** (-torch.arange(0, d, 2, device="cuda").float() / d)
    ang = torch.cat([pos * inv, pos * inv], -1)
    return y, ang.cos().bfloat16(), ang.sin().bfloat16(), kc, vc, key_mask, sl


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality, NaN payloads included (torch.equal calls NaN unequal)."""
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("b,h,kv,d,s_len,slot", [
    (8, 28, 4, 128, 768, 300),     # Qwen2.5-7B, batch 8
    (8, 28, 4, 128, 768, 767),     # the cache's last slot
    (8, 28, 4, 128, 768, 0),       # the first slot (only the own slot)
    (64, 28, 4, 128, 768, 511),    # batch 64 (more blocks than a wave: workspace sums)
    (3, 9, 3, 64, 384, 200),       # SmolLM2-135M (head_dim 64)
    (1, 40, 8, 128, 2048, 1500),   # Qwen2.5-32B heads
    (2, 8, 8, 128, 4096, 4095),    # one query head per KV head, many splits
])
@pytest.mark.parametrize("cluster", [None, False])
def test_rope_decode_attn_equals_rope_kv_then_decode_attn(b, h, kv, d, s_len, slot, cluster):
    """The rotary and the step's cache write inside the attention kernel give the bits of rope_kv followed by
    decode_attn: in the output (NaN-poisoned beforehand) and in both caches (the own slot written, nothing else
    touched), with the splits' sums in a cluster or through the workspace, and forced split counts."""
    y, cos, sin, kc, vc, key_mask, sl = _rope_case(b, h, kv, d, s_len, slot, seed=slot + b)
    for splits in (0, 3, 8):
        kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        q = fused.rope_kv(y, cos, sin, kc1, vc1, sl, h)
        two = fused.decode_attn(q, kc1, vc1, key_mask, sl, splits=splits, cluster=cluster)
        one = fused.rope_decode_attn(y, cos, sin, kc2, vc2, key_mask, sl, h, splits=splits, cluster=cluster)
        assert two is not None and one is not None, splits
        assert not torch.isnan(one).any()
        assert torch.equal(one, two), splits
        assert _same_bits(kc1, kc2) and _same_bits(vc1, vc2), splits
        assert not torch.isnan(kc2[:, :, slot]).any() and not torch.isnan(vc2[:, :, slot]).any()
    ref = _reference(q, kc1, vc1, key_mask, slot)
    assert float(((one.float() - ref).abs() - 2**-8 * ref.abs()).max()) <= 1e-5


def test_rope_decode_attn_graph_replay_and_declines():
    """A CUDA graph of the fused step captured at one slot replays for others as the eager call there (output and
    caches); where the kernel does not take the inputs it returns None and writes nothing."""
    y, cos, sin, kc, vc, key_mask, sl = _rope_case(8, 28, 4, 128, 768, 700, seed=7)
    kc, vc = kc.nan_to_num(0.5), vc.nan_to_num(0.5)
    slot = torch.tensor([257], device="cuda")
    kg, vg = kc.clone(), vc.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused.rope_decode_attn(y, cos, sin, kg, vg, key_mask, slot, 28)  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused.rope_decode_attn(y, cos, sin, kg, vg, key_mask, slot, 28)
    for s in (257, 300, 511, 767):
        slot.fill_(s)
        graph.replay()
        torch.cuda.synchronize()
        ke, ve = kc.clone(), vc.clone()
        for w in (257, 300, 511, 767):  # the slots the replays so far wrote, in the same order
            ke_out = fused.rope_decode_attn(y, cos, sin, ke, ve, key_mask, torch.tensor([w], device="cuda"), 28)
            if w == s:
                break
        assert torch.equal(captured, ke_out), s
        assert _same_bits(kg, ke) and _same_bits(vg, ve), s
    before_k, before_v = kc.clone(), vc.clone()
    assert fused.rope_decode_attn(y.repeat(1, 2, 1), cos.repeat(1, 2, 1), sin.repeat(1, 2, 1), kc, vc, key_mask, sl,
                                  28) is None  # two tokens per row
    assert fused.rope_decode_attn(y[..., :-128].contiguous(), cos, sin, kc, vc, key_mask, sl, 28) is None  # width
    assert fused.rope_decode_attn(y, cos.float(), sin.float(), kc, vc, key_mask, sl, 28) is None  # fp32 cos / sin
    assert fused.rope_decode_attn(y, cos, sin, kc, vc, key_mask[:, :30], sl, 28) is None  # a short mask
    assert _same_bits(kc, before_k) and _same_bits(vc, before_v)


def test_engine_rope_in_attn_same_bits(model64, monkeypatch):
    """The engine with the rotary inside the attention kernel (the default; its calls counted) samples the same
    tokens with the same behaviour log-probs as with rope_kv + decode_attn (the same bits in every step), in its
    CUDA graph."""
    made = []
    real = fused.rope_decode_attn

    def counted(*a, **k):
        out = real(*a, **k)
        made.append(out is not None)
        return out

    monkeypatch.setattr(fused, "rope_decode_attn", counted)
    on, off = Engine(model64, "cuda"), Engine(model64, "cuda")
    on.decode_attn = off.decode_attn = "wave"
    assert on.rope_in_attn
    off.rope_in_attn = False
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=24)
    a = on.generate(PROMPTS, 4, cfg, 11, set(), 0)
    assert made and all(made)  # (the warm-up and the captured step ran the fused kernel)
    n_on = len(made)
    b = off.generate(PROMPTS, 4, cfg, 11, set(), 0)
    assert len(made) == n_on
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.behaviour_logprobs, b.behaviour_logprobs)
