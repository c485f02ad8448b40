"""calibrate: the stage on a tiny model, folding exactness, and bad data specs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import SHARED_DATA, check_calib_report, run_cli
from qerl_cli import artifact, calibrate, modelio, names, pack, quantize, verify
from qerl_cli.errors import QerlError

GSM8K_TRAIN = SHARED_DATA / "gsm8k" / "train.jsonl"


@pytest.fixture(scope="module")
def calib_dir(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("calib") / "calib"
    calibrate.calibrate(str(tiny_model_dir), str(GSM8K_TRAIN), out, samples=6, seq_len=48, field="question,answer",
                        progress=False)
    return out


def test_calib_artifact_contents(calib_dir, tiny_model_dir):
    art = artifact.open_artifact(calib_dir, names.KIND_CALIB)
    files = sorted(f["path"] for f in art.manifest["files"])
    assert files == sorted([names.CALIB_SCALES, names.CALIB_REPORT, names.CALIB_SAMPLES, names.MODEL_CONFIG,
                            names.GENERATION_CONFIG, "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"])
    samples = json.loads(art.file(names.CALIB_SAMPLES).read_text())
    assert samples["data"]["sha256"] == artifact.sha256_file(GSM8K_TRAIN)
    assert samples["samples"] == 6 and samples["seq_len"] == 48 and samples["tokens"] == 288
    assert len(samples["row_indices"]) == len(samples["row_token_lengths"]) >= 1
    assert sum(samples["row_token_lengths"]) + len(samples["row_indices"]) >= 288  # + eos per row
    scales = load_file(str(art.file(names.CALIB_SCALES)))
    # tiny model: 4 heads / 2 KV heads (GQA) -> v->o is skipped; qkv, gate_up, down per layer
    assert sorted(scales) == sorted(f"model.layers.{i}.{g}" for i in range(2) for g in ("qkv", "gate_up", "down"))
    assert scales["model.layers.0.qkv"].shape == (64,) and scales["model.layers.0.down"].shape == (128,)
    report = json.loads(art.file(names.CALIB_REPORT).read_text())
    # down is searched and folded before gate_up, dividing up_proj's rows by its scales: gate_up alone may end
    # above its RTN error when down gains more (the H200 run saw gain 0.99x); what holds is check_calib_report's
    assert [(r["layer"], r["group"]) for r in report["groups"]] == [(i, g) for i in range(2)
                                                                    for g in ("qkv", "down", "gate_up")]
    assert all(r["producer"] == "gate_up" for r in report["groups"] if r["group"] == "down")
    check_calib_report(report["groups"])
    kinds = [i["kind"] for i in art.inputs]
    assert kinds == [names.KIND_MODEL, "data"]


def test_reported_rtn_error_is_of_the_original_weights(tiny_model_dir):
    """error_rtn must be measured on the unfolded weights (a regression: the folds once changed them first)."""
    import copy

    from qerl_cli import awq

    net, _ = modelio.load(modelio.resolve(str(tiny_model_dir)), torch.float32)
    ids = torch.randint(0, 5000, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = net.model.embed_tokens(ids)
    layer = net.model.layers[0]
    orig = copy.deepcopy(layer)
    seen = []
    h = orig.self_attn.q_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].reshape(-1, a[0].shape[-1])))
    with torch.no_grad():
        calibrate._run_layer(orig, hidden, net.model.rotary_emb, 8)
    h.remove()
    x = torch.cat(seen)
    cfg = calibrate.CalibrateConfig(samples=2, seq_len=32, field="text", split="train", seed=0, n_grid=5,
                                    clip_search=True, clip_ratios=(1.0, 0.9), max_tokens=4096, batch_size=8,
                                    progress=False)
    keep = torch.arange(x.shape[0])
    _, scales, rows, _ = calibrate.search_layer(layer, hidden, net.model.rotary_emb, keep, cfg)
    a = orig.self_attn
    expected = awq.group_error(x, [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
    assert rows[0]["group"] == "qkv" and rows[0]["error_rtn"] == pytest.approx(expected, rel=1e-5)
    gu = next(r for r in rows if r["group"] == "gate_up")  # searched after the down fold changed up_proj
    m = orig.mlp
    seen.clear()
    h = m.gate_proj.register_forward_pre_hook(lambda mod, a: seen.append(a[0].reshape(-1, a[0].shape[-1])))
    with torch.no_grad():
        calibrate._run_layer(orig, hidden, net.model.rotary_emb, 8)
    h.remove()
    expected = awq.group_error(torch.cat(seen), [m.gate_proj.weight, m.up_proj.weight])
    assert gu["error_rtn"] == pytest.approx(expected, rel=1e-5)
    assert not torch.equal(layer.self_attn.q_proj.weight, a.q_proj.weight)  # the layer was folded


def _uneven_mha_layer(seed: int = 0, decades: float = 4.0):
    """A one-layer Llama without grouped-query attention (so v -> o is searched too) whose up_proj and v_proj
    output rows span ``decades`` decades: down's and o's inputs are very uneven, and so are their scales."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    conf = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                       attn_implementation="sdpa")
    m = LlamaForCausalLM(conf).float().eval()
    layer = m.model.layers[0]
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
        for lin in (layer.mlp.up_proj, layer.self_attn.v_proj):
            rows = lin.weight.shape[0]
            spread = torch.logspace(-decades / 2, decades / 2, rows)[torch.randperm(rows, generator=g)]
            lin.weight.mul_(spread.unsqueeze(1))
    return m


def _unfolded_error(x, original, folded, s, row_scale, ratios=None):
    """Written out from scratch: the output MSE, in the unfolded layer's units, of a group whose weights
    ``folded`` (its own scale ``s`` not yet applied; rows of member ``i`` divided by ``row_scale[i]`` or not)
    are quantized as ``W * s`` with one shared global scale: ``((x / s) @ Q(W * s)^T) * r`` against
    ``x @ W_orig^T``."""
    from qerl_cli import awq, nvfp4

    scaled = [w * s for w in folded]
    g = nvfp4.fused_global_scale(scaled)
    sse = 0.0
    for i, (w0, w) in enumerate(zip(original, scaled)):
        y = (x / s) @ awq.clipped_fake_quantize(w, g, 1.0 if ratios is None else ratios[i]).t()
        if row_scale[i] is not None:
            y = y * row_scale[i]
        sse += float((y - x @ w0.t()).double().square().sum())
    return sse / (x.shape[0] * sum(w.shape[0] for w in original))


def test_producer_groups_are_searched_and_reported_in_the_unfolded_units():
    """o and down are searched and folded before q/k/v and gate/up, dividing v_proj's and up_proj's rows by
    their scales s_c, which o's and down's columns multiply back. The q/k/v and gate/up scale search, their
    clip search and their reported error must measure the error of those rows times s_c (the layer's
    function), not on the folded weights: that way the search picked another alpha here (q/k/v: 0.5, whose
    error is 5 % above alpha 0's) and reported errors ~10x and ~160x too small, not comparable with RTN."""
    import copy

    from qerl_cli import awq

    m = _uneven_mha_layer()
    layer, rotary = m.model.layers[0], m.model.rotary_emb
    orig = copy.deepcopy(layer)
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = m.model.embed_tokens(ids)
    seen = {"qkv": [], "gate_up": []}
    hooks = [orig.get_submodule(n).register_forward_pre_hook(
        lambda mod, a, k=k: seen[k].append(a[0].reshape(-1, a[0].shape[-1]).clone()))
        for k, n in (("qkv", "self_attn.q_proj"), ("gate_up", "mlp.gate_proj"))]
    with torch.no_grad():
        calibrate._run_layer(orig, hidden, rotary, 8)
    for h in hooks:
        h.remove()
    cfg = calibrate.CalibrateConfig(samples=4, seq_len=32, field="text", split="train", seed=0, n_grid=10,
                                    clip_search=True, clip_ratios=(1.0, 0.9, 0.8), max_tokens=4096, batch_size=8,
                                    progress=False)
    _, scales, rows, clip = calibrate.search_layer(layer, hidden, rotary, torch.arange(ids.numel()), cfg)
    by = {r["group"]: r for r in rows}
    assert [r["group"] for r in rows] == ["o", "qkv", "down", "gate_up"]
    folded_choice_differs = False
    for gname, consumer, member in (("qkv", "o", "self_attn.v_proj"), ("gate_up", "down", "mlp.up_proj")):
        r, x, s_c = by[gname], torch.cat(seen[gname]), scales[consumer]
        assert by[consumer]["alpha"] > 0 and s_c.max() / s_c.min() > 10  # a fold that really rescales rows
        names_ = next(g.linears for g in calibrate.GROUPS if g.name == gname)
        w0 = [orig.get_submodule(n).weight.detach().float() for n in names_]
        rs = [s_c if n == member else None for n in names_]
        # the reported error is the layer's output error of the final quantized weights, written out here
        final = [layer.get_submodule(n).weight.detach().float() / scales[gname] for n in names_]
        direct = _unfolded_error(x, w0, final, scales[gname], rs, [clip[n] for n in names_])
        assert r["error_awq"] == pytest.approx(direct, rel=1e-4), gname
        assert r["ref_power_awq"] == pytest.approx(r["ref_power_rtn"], rel=1e-5), gname
        # alpha: the grid's minimizer of that error on the weights as the consumer's fold left them
        before = [awq.fold_into_linear_output(w, s_c) if n == member else w for n, w in zip(names_, w0)]
        stats = awq.activation_stats(x)
        errs = [_unfolded_error(x, w0, before, awq.scales_from_stats(stats, a), rs) for a in cfg.awq_config().alphas]
        assert errs[cfg.awq_config().alphas.index(r["alpha"])] <= min(errs) * (1 + 1e-6), (gname, r["alpha"], errs)
        assert r["error_alpha0"] == pytest.approx(errs[0], rel=1e-4)
        assert r["error_alpha0"] == pytest.approx(by[consumer]["producer_error"], rel=1e-12)
        # (the folded-units objective, rows weighted 1, picks another alpha in one of the groups here)
        ones = [None] * len(names_)
        folded = [_unfolded_error(x, before, before, awq.scales_from_stats(stats, a), ones)
                  for a in cfg.awq_config().alphas]
        folded_choice_differs |= min(range(len(folded)), key=folded.__getitem__) != min(range(len(errs)),
                                                                                          key=errs.__getitem__)
    assert folded_choice_differs
    check_calib_report([{"layer": 0, **r} for r in rows])


def test_folding_keeps_float_model(calib_dir, tiny_model_dir):
    src = modelio.resolve(str(tiny_model_dir))
    ref, _ = modelio.load(src, torch.float32)
    net, _ = modelio.load(src, torch.float32)
    clip, folds, _ = calibrate.apply_calibration(net, artifact.open_artifact(calib_dir, names.KIND_CALIB))
    ids = torch.randint(0, 5000, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ref(ids).logits, net(ids).logits
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    # the folds really changed the weights (otherwise this test proves nothing)
    assert not torch.equal(ref.model.layers[0].input_layernorm.weight, net.model.layers[0].input_layernorm.weight)
    assert set(folds) == {f"model.layers.{i}.{p}" for i in range(2)
                          for p in ("input_layernorm", "post_attention_layernorm", "mlp.up_proj")}
    assert all(0 < r <= 1 for r in clip.values())


def test_layerwise_forward_matches_model(tiny_model_dir):
    net, _ = modelio.load(modelio.resolve(str(tiny_model_dir)), torch.float32)
    ids = torch.randint(0, 5000, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        h = net.model.embed_tokens(ids)
        for layer in net.model.layers:
            h = calibrate._run_layer(layer, h, net.model.rotary_emb, batch_size=2)
        ref = net(ids, output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(net.model.norm(h), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type,attn,window", [("llama", "eager", None), ("llama", "sdpa", None),
                                                     ("mistral", "eager", 5), ("mistral", "sdpa", 5)])
def test_layerwise_forward_is_causal_whatever_the_attention(model_type, attn, window):
    """The per-layer run equals the model's own hidden states with eager attention too (attention_mask=None was
    bidirectional there), and honours a sliding window as the model does."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    kw = {} if window is None else {"sliding_window": window}
    conf = AutoConfig.for_model(model_type, vocab_size=256, hidden_size=64, intermediate_size=128,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                max_position_embeddings=512, attn_implementation=attn, **kw)
    net = AutoModelForCausalLM.from_config(conf).float().eval()
    assert net.config._attn_implementation == attn
    ids = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        h = net.model.embed_tokens(ids)
        hs = []
        for layer in net.model.layers:
            h = calibrate._run_layer(layer, h, net.model.rotary_emb, batch_size=2)
            hs.append(h)
        ref = net(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(hs[0], ref[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(net.model.norm(hs[-1]), ref[-1], rtol=1e-5, atol=1e-5)


def test_calibrate_pins_an_attention_that_takes_the_causal_mask(tmp_path):
    """A model whose config asks for eager attention is calibrated as with sdpa (same scales)."""
    from transformers import AutoTokenizer

    from conftest import REPO, build_tiny_llama

    tok = AutoTokenizer.from_pretrained(str(REPO / "tests" / "data" / "smollm2-tokenizer"))
    md = build_tiny_llama(tmp_path / "model", tok, kv_heads=4, dtype=torch.float32)
    eager = tmp_path / "eager"
    eager.mkdir()
    for f in md.iterdir():
        (eager / f.name).write_bytes(f.read_bytes())
    conf = json.loads((eager / "config.json").read_text())
    (eager / "config.json").write_text(json.dumps({**conf, "attn_implementation": "eager"}))
    assert modelio.load(modelio.resolve(str(eager)))[0].config._attn_implementation == "eager"
    kw = dict(samples=2, seq_len=32, field="question,answer", progress=False)
    a = calibrate.calibrate(str(md), str(GSM8K_TRAIN), tmp_path / "ca", **kw)
    b = calibrate.calibrate(str(eager), str(GSM8K_TRAIN), tmp_path / "cb", **kw)
    sa, sb = load_file(str(a.file(names.CALIB_SCALES))), load_file(str(b.file(names.CALIB_SCALES)))
    assert sorted(sa) == sorted(sb) and "model.layers.0.o" in sa
    for k in sa:
        torch.testing.assert_close(sb[k], sa[k], rtol=1e-4, atol=1e-6)


def test_awq_pipeline_end_to_end(calib_dir, tiny_model_dir, tmp_path):
    q = quantize.quantize(str(tiny_model_dir), tmp_path / "quant", calib=calib_dir, progress=False)
    assert q.config["method"] == "awq"
    assert {i["kind"] for i in q.inputs} == {names.KIND_MODEL, names.KIND_CALIB}
    assert names.FOLDING in {f["path"] for f in q.manifest["files"]}
    folds = load_file(str(q.file(names.FOLDING)))
    assert "model.layers.1.input_layernorm" in folds
    p = pack.pack(tmp_path / "quant", tmp_path / "packed", progress=False)
    assert names.FOLDING in {f["path"] for f in p.manifest["files"]}  # AQN downstream needs the factors
    v = verify.verify(tmp_path / "packed", tmp_path / "verify", progress=False)
    assert v.metrics["passed"] is True
    # AWQ changed the checkpoint relative to round-to-nearest
    rtn = quantize.quantize(str(tiny_model_dir), tmp_path / "quant-rtn", progress=False)
    a = load_file(str(q.file(names.MODEL_WEIGHTS)))
    b = load_file(str(rtn.file(names.MODEL_WEIGHTS)))
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight_packed"], b["model.layers.0.self_attn.q_proj.weight_packed"])


def test_an_awq_quant_indexes_its_weights_for_vllm(calib_dir, tiny_model_dir, tmp_path):
    """vLLM reads every *.safetensors file of a folder without a weight index, so an AWQ quant's folding factors
    were read as weights (and failed on their names). The quant now indexes exactly its weights file; a quant
    without the index is refused by the vLLM path in one sentence."""
    from qerl_cli import vllm_backend

    q = quantize.quantize(str(tiny_model_dir), tmp_path / "quant", calib=calib_dir, progress=False)
    index = q.read_json(names.MODEL_INDEX)
    weights = load_file(str(q.file(names.MODEL_WEIGHTS)))
    assert index["weight_map"] == {k: names.MODEL_WEIGHTS for k in weights}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in weights.values())
    assert names.MODEL_INDEX in {f["path"] for f in q.manifest["files"]} and q.file(names.FOLDING).is_file()
    vllm_backend.check_checkpoint(q.path)
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(  # (transformers still loads it, from the weights file)
        str(q.path), quantization_config=CompressedTensorsConfig(run_compressed=False), dtype=torch.bfloat16)
    assert torch.equal(model.model.norm.weight.detach(), weights["model.norm.weight"])
    (q.path / names.MODEL_INDEX).unlink()
    with pytest.raises(QerlError, match="has no model.safetensors.index.json.*rerun qerl quantize with --force"):
        vllm_backend.check_checkpoint(q.path)


def test_a_calib_damaged_under_a_rehashed_manifest_is_one_sentence_in_quantize(calib_dir, tiny_model_dir, tmp_path):
    """(review, session 34) quantize read a calib's scales with safetensors directly: a file cut short under a
    re-hashed manifest was safetensors' traceback (pack, verify and rollout already said it in one sentence)."""
    import shutil

    c = tmp_path / "calib"
    shutil.copytree(calib_dir, c)
    f = c / names.CALIB_SCALES
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    m = json.loads((c / names.MANIFEST).read_text())
    m["files"] = artifact.list_files(c)
    m["digest"] = artifact._digest(m["key"], m["files"])
    (c / names.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(QerlError, match=f"its {names.CALIB_SCALES} cannot be read"):
        quantize.quantize(str(tiny_model_dir), tmp_path / "quant", calib=c, progress=False)
    assert not (tmp_path / "quant").exists()


def test_calibrate_cached(calib_dir, tiny_model_dir, monkeypatch):
    calls = []
    monkeypatch.setattr(calibrate, "search_layer", lambda *a, **k: calls.append(1) or (_ for _ in ()).throw(AssertionError))
    art = calibrate.calibrate(str(tiny_model_dir), str(GSM8K_TRAIN), calib_dir, samples=6, seq_len=48,
                              field="question,answer", progress=False)
    assert calls == [] and art.kind == names.KIND_CALIB
    assert art.config["search"] == calibrate.SEARCH_VERSION  # an earlier search's calib is not served
    monkeypatch.setattr(calibrate, "SEARCH_VERSION", "qerl.awq/1")
    with pytest.raises(QerlError, match="different"):
        calibrate.calibrate(str(tiny_model_dir), str(GSM8K_TRAIN), calib_dir, samples=6, seq_len=48,
                            field="question,answer", progress=False)
    with pytest.raises(QerlError, match="different"):
        calibrate.calibrate(str(tiny_model_dir), str(GSM8K_TRAIN), calib_dir, samples=5, seq_len=48,
                            field="question,answer", progress=False)


@pytest.mark.parametrize("case", ["missing", "empty", "field", "short"])
def test_bad_data_specs(case, tiny_model_dir, tmp_path):
    data = {"missing": str(tmp_path / "nope.jsonl"), "field": str(GSM8K_TRAIN), "short": str(GSM8K_TRAIN)}
    args = ["--samples", "4", "--seq-len", "32", "--field", "question,answer"]
    if case == "empty":
        (tmp_path / "empty.jsonl").write_text("")
        data["empty"] = str(tmp_path / "empty.jsonl")
    if case == "field":
        args[-1] = "prompt"
    if case == "short":
        small = tmp_path / "small.jsonl"
        small.write_text(GSM8K_TRAIN.read_text().splitlines()[0] + "\n")
        data["short"] = str(small)
    out = tmp_path / "calib"
    r = run_cli("calibrate", str(tiny_model_dir), "--data", data[case], *args, "-o", str(out), "--no-progress")
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("error:") and "Traceback" not in r.stderr
    expected = {"missing": "does not exist", "empty": "no rows", "field": "field 'prompt'", "short": "fewer than"}
    assert expected[case] in " ".join(r.stderr.split())
    assert not out.exists()
    assert not list(tmp_path.glob(".calib.tmp-*"))


def test_chat_shaped_rows_use_the_chat_template(smollm2_tokenizer):
    from qerl_cli import data

    rows = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                          {"role": "assistant", "content": f"{2 * i}"}]} for i in range(40)]
    recs = data.Records(rows, {"type": "file", "spec": "chat.jsonl", "sha256": "0"})
    cfg = calibrate.CalibrateConfig(samples=2, seq_len=64, field="messages", split="train", seed=0, n_grid=4,
                                    clip_search=False, clip_ratios=(1.0,), max_tokens=64, batch_size=2,
                                    progress=False)
    tokens, info = calibrate.build_samples(recs, smollm2_tokenizer, cfg)
    text = smollm2_tokenizer.decode(tokens[0].tolist())
    assert tokens.shape == (2, 64) and "<|im_start|>user" in text and "<|im_start|>assistant" in text
    first = rows[info["row_indices"][0]]
    expected = smollm2_tokenizer.apply_chat_template(first["messages"], tokenize=False)
    assert smollm2_tokenizer.decode(tokens.flatten()[: info["row_token_lengths"][0]].tolist()) == expected


def test_aqn_sigma_is_defined_on_the_unfolded_norm_scales(calib_dir, tiny_model_dir, tmp_path):
    """On an AWQ pack the norm scales are w / s; each AQN draw is divided by s, so the same sigma and seed
    perturb w exactly as they would on the uncalibrated model (z on w, then folded)."""
    from qerl_cli.engine import Engine
    from qerl_cli.packed_model import load_packed_model

    quantize.quantize(str(tiny_model_dir), tmp_path / "quant", calib=calib_dir, progress=False)
    art = pack.pack(tmp_path / "quant", tmp_path / "packed", progress=False)
    model = load_packed_model(art)
    folds = load_file(str(art.file(names.FOLDING)))
    assert set(model.qerl_norm_folding) == {k for k in folds if k.endswith("layernorm")} != set()
    eng = Engine(model)
    eng.set_noise(0.05, 7)
    noisy = eng.effective_norm_weights()
    model.qerl_norm_folding = {}  # the same draw without the factors: z itself
    plain = Engine(model)
    plain.set_noise(0.05, 7)
    raw = plain.effective_norm_weights()
    for i, (n, r, c) in enumerate(zip(noisy, raw, eng.clean)):
        for t in ("input_layernorm", "post_attention_layernorm"):
            s = folds[f"model.layers.{i}.{t}"]
            torch.testing.assert_close((n[t] - c[t]) * s, r[t] - c[t], rtol=1e-4, atol=1e-6)
    assert eng.noise.space == "unfolded norm scales"
    # the dequantized reference of the quant artifact (evaluate on a quant checkpoint) carries the factors too
    from qerl_cli.pack import load_checkpoint
    from qerl_cli.packed_model import load_dequantized_model

    q = artifact.open_artifact(tmp_path / "quant", names.KIND_QUANT)
    deq = load_dequantized_model(load_checkpoint(q), q.path)
    assert set(deq.qerl_norm_folding) == {k for k in folds if k.endswith("layernorm")}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_calibrate_device_without_cuda_is_one_clear_error(tiny_model_dir, tmp_path):
    r = run_cli("calibrate", str(tiny_model_dir), "--data", str(GSM8K_TRAIN), "--field", "question,answer",
                "--samples", "2", "--seq-len", "16", "--device", "cuda", "-o", str(tmp_path / "c"))
    assert r.returncode == 1 and "no CUDA device is available" in r.stderr + r.stdout
    assert "Traceback" not in r.stderr and not (tmp_path / "c").exists()
    with pytest.raises(QerlError, match="must be 'cpu' or 'cuda'"):
        calibrate.calibrate(str(tiny_model_dir), str(GSM8K_TRAIN), tmp_path / "d", device="tpu", progress=False)


def _tiny_of_type(path: Path, tokenizer, model_type: str) -> Path:
    """A tiny random model of another architecture (norm weights and biases away from their defaults)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    conf = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                                max_position_embeddings=512)
    m = AutoModelForCausalLM.from_config(conf).float().eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.copy_((1.0 if n.endswith("weight") else 0.0) + 0.2 * torch.randn_like(p))
    modelio.fix_special_tokens(m, tokenizer)
    m.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


@pytest.mark.parametrize("model_type", ["gemma2", "gemma", "stablelm"])
def test_models_whose_norms_do_not_fold_are_refused(model_type, smollm2_tokenizer, tmp_path, monkeypatch):
    """Dividing a (1 + w) norm (Gemma) or a LayerNorm with bias (StableLM) by s changes the model (in Gemma 2
    post_attention_layernorm is not even the MLP input): calibrate, quantize --calib and apply_calibration refuse
    such models in one sentence instead of corrupting them."""
    md = _tiny_of_type(tmp_path / "model", smollm2_tokenizer, model_type)
    msg = f"exact only for llama, mistral, qwen2, qwen3 models, and .* is a '{model_type}' model"
    with pytest.raises(QerlError, match=msg):
        calibrate.calibrate(str(md), str(GSM8K_TRAIN), tmp_path / "calib", samples=2, seq_len=16,
                            field="question,answer", progress=False)
    assert not (tmp_path / "calib").exists()
    if model_type != "gemma":
        return
    # a calib of such a model made before the check (simulated): quantize --calib refuses it too
    monkeypatch.setattr(calibrate, "FOLDABLE_MODEL_TYPES", calibrate.FOLDABLE_MODEL_TYPES + (model_type,))
    calibrate.calibrate(str(md), str(GSM8K_TRAIN), tmp_path / "calib", samples=2, seq_len=16,
                        field="question,answer", progress=False)
    monkeypatch.undo()
    with pytest.raises(QerlError, match=msg):
        quantize.quantize(str(md), tmp_path / "quant", calib=tmp_path / "calib", progress=False)
    assert not (tmp_path / "quant").exists()
    net, _ = modelio.load(modelio.resolve(str(md)), torch.float32)
    with pytest.raises(QerlError, match=msg):
        calibrate.apply_calibration(net, artifact.open_artifact(tmp_path / "calib", names.KIND_CALIB))
    # round-to-nearest (nothing folded) still quantizes it
    assert quantize.quantize(str(md), tmp_path / "quant", progress=False).config["method"] == "rtn"


@pytest.mark.parametrize("model_type", calibrate.FOLDABLE_MODEL_TYPES)
def test_folding_is_exact_on_every_allowed_model_type(model_type, smollm2_tokenizer, tmp_path):
    """Every allowed type keeps its float function under random folds of all four groups."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    conf = AutoConfig.for_model(model_type, vocab_size=256, hidden_size=64, intermediate_size=128,
                                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                                max_position_embeddings=512)
    m = AutoModelForCausalLM.from_config(conf).float().eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.copy_((1.0 if n.endswith("weight") else 0.0) + 0.2 * torch.randn_like(p))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    layer = calibrate.decoder_layers(m)[0]
    groups = calibrate.active_groups(layer)
    assert [g.name for g in groups] == ["o", "qkv", "down", "gate_up"]
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        ref = m(ids).logits
        for grp in groups:
            calibrate.fold_group(layer, grp, torch.rand(layer.get_submodule(grp.linears[0]).in_features,
                                                        generator=g) * 2 + 0.25)
        out = m(ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dims", [{"hidden": 40, "intermediate": 128}, {"hidden": 64, "intermediate": 120}])
def test_calibrate_k_not_a_multiple_of_16_is_one_clear_error(dims, smollm2_tokenizer, tmp_path):
    """quantize refuses such a model in one sentence; calibrate (which searches under the same quantizer) must
    too, not end in a ValueError traceback from the search."""
    from conftest import build_tiny_llama

    md = build_tiny_llama(tmp_path / "odd", smollm2_tokenizer, layers=1, heads=4, kv_heads=2, **dims)
    _calibrate_fails_in_one_sentence(md, tmp_path, "not a multiple of 16")


def test_activations_that_overflow_inside_a_layer_are_one_clear_error(smollm2_tokenizer, tmp_path):
    """Finite weights whose MLP product overflows fp32 (act(gate) * up = inf, the input of down_proj): the
    stage's own 'produced NaN or infinite activations' sentence, not a ValueError traceback from the search."""
    from safetensors.torch import save_file

    from conftest import build_tiny_llama

    md = build_tiny_llama(tmp_path / "big", smollm2_tokenizer, layers=1)
    t = load_file(str(md / "model.safetensors"))
    for n in ("gate_proj", "up_proj"):
        t[f"model.layers.0.mlp.{n}.weight"] *= 1e21
    save_file(t, str(md / "model.safetensors"), metadata={"format": "pt"})
    _calibrate_fails_in_one_sentence(md, tmp_path, "layer 0 produced NaN or infinite activations")


def _calibrate_fails_in_one_sentence(md, tmp_path, says: str) -> None:
    """`qerl calibrate` of the model at ``md`` on CPU: exit 1 with one 'error:' sentence holding ``says``, no
    traceback, no output or temporary left."""
    out = tmp_path / "calib"
    r = run_cli("calibrate", str(md), "--data", str(GSM8K_TRAIN), "--field", "question,answer", "--samples", "2",
                "--seq-len", "16", "--device", "cpu", "--no-progress", "-o", str(out))
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.startswith("error:"), r.stderr
    assert says in " ".join(r.stderr.split())
    assert not out.exists() and not list(tmp_path.glob(".calib.tmp-*"))


def _calibrate_small(md, out, config_file=None):
    return calibrate.calibrate(str(md), str(GSM8K_TRAIN), out, samples=2, seq_len=16, field="question,answer",
                               config_file=config_file, progress=False, device="cpu")


def _no_search(monkeypatch):
    monkeypatch.setattr(calibrate, "search_layer",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("searched again")))


def test_split_of_a_local_data_file_is_not_part_of_the_calib_key(tiny_model_dir, tmp_path, monkeypatch):
    """A local file has no splits (load_records ignores --split for it, and the data digest is the file's): a
    calib made with another split is the same artifact, served from the cache, not 'a different artifact'."""
    out = tmp_path / "calib"
    _calibrate_small(tiny_model_dir, out)
    cfg = tmp_path / "split.toml"
    cfg.write_text('split = "test"\n')
    _no_search(monkeypatch)
    assert _calibrate_small(tiny_model_dir, out, cfg).kind == names.KIND_CALIB


def test_clip_ratios_without_clip_search_are_not_part_of_the_calib_key(tiny_model_dir, tmp_path, monkeypatch):
    """With clip_search = false the clip ratios are never read: other ratios give the same calib (cached)."""
    out = tmp_path / "calib"
    a = tmp_path / "a.toml"
    a.write_text("clip_search = false\n")
    _calibrate_small(tiny_model_dir, out, a)
    b = tmp_path / "b.toml"
    b.write_text("clip_search = false\nclip_ratios = [1.0, 0.5]\n")
    _no_search(monkeypatch)
    assert _calibrate_small(tiny_model_dir, out, b).kind == names.KIND_CALIB
    # with the clip search on, the ratios matter again: not served from that cache
    c = tmp_path / "c.toml"
    c.write_text("clip_ratios = [1.0, 0.5]\n")
    with pytest.raises(QerlError, match="different"):
        _calibrate_small(tiny_model_dir, out, c)


def test_calib_samples_record_chat_rows_read_through_the_default_field(tiny_model_dir, tmp_path):
    """Rows with 'messages' and no 'text' go through the chat template under the default field 'text'
    (data.row_text): calib_samples.json must say chat_shaped, not only when the field is named 'messages'."""
    rows = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                          {"role": "assistant", "content": f"{2 * i}"}]} for i in range(40)]
    f = tmp_path / "chat.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    art = calibrate.calibrate(str(tiny_model_dir), str(f), tmp_path / "calib", samples=2, seq_len=16,
                              progress=False, device="cpu")
    samples = json.loads(art.file(names.CALIB_SAMPLES).read_text())
    assert samples["field"] == "text" and samples["chat_shaped"] is True


@pytest.mark.parametrize("device", ["cuda:abc", "cuda:3", "cuda:-1"])
def test_calibrate_device_that_is_not_one_of_this_machines_gpus_is_one_clear_error(device, tiny_model_dir, tmp_path,
                                                                                  monkeypatch):
    """On a machine with one GPU, '--device cuda:3' (no such ordinal) or a malformed 'cuda:abc' was a
    RuntimeError traceback from torch inside the stage; one sentence before any work instead."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(calibrate.modelio, "load", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    with pytest.raises(QerlError, match="--device"):
        calibrate.calibrate(str(tiny_model_dir), str(GSM8K_TRAIN), tmp_path / "c", samples=2, seq_len=16,
                            field="question,answer", device=device, progress=False)
    assert not (tmp_path / "c").exists() and not list(tmp_path.glob(".c.tmp-*"))
