"""PEFT adapters read by our engine: per-module ranks and alphas as peft applies them, and one clear error for
what the engine would not apply (LoRA variants such as DoRA, LoRA outside the projections, extra tensors)."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from qerl_cli.adapter import load_lora, pattern_key
from qerl_cli.engine import Engine
from qerl_cli.errors import QerlError

PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def base():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    conf = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return LlamaForCausalLM(conf).eval()


def _save(base, path, **conf):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    pm = get_peft_model(copy.deepcopy(base), LoraConfig(init_lora_weights=False, **conf))
    pm.save_pretrained(str(path), safe_serialization=True)
    return pm.eval()


def test_pattern_keys_match_as_peft_does():
    from peft.utils.other import get_pattern_key

    keys = ["q_proj", r"layers\.1\.mlp\.down_proj", "layers.0.mlp.up_proj", "proj"]
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "model.layers.0.mlp.down_proj",
                 "model.layers.0.mlp.up_proj", "model.layers.10.mlp.up_proj", "model.layers.0.self_attn.k_proj"):
        ours = pattern_key(keys, name)
        assert (ours if ours is not None else name) == get_pattern_key(keys, name)


@pytest.mark.parametrize("rslora", [False, True])
def test_rank_and_alpha_patterns_apply_as_in_peft(base, tmp_path, rslora):
    """rank_pattern / alpha_pattern give some modules their own rank and alpha (scaling alpha/r, or
    alpha/sqrt(r) with use_rslora): the engine's logits equal peft's on the same adapter."""
    pm = _save(base, tmp_path / "ad", r=4, lora_alpha=8, target_modules=PROJ, use_rslora=rslora,
               rank_pattern={"q_proj": 2, r"layers\.1\.mlp\.down_proj": 6},
               alpha_pattern={"v_proj": 3, r"layers\.0\..*up_proj": 16})
    lora = load_lora(tmp_path / "ad", base)
    assert lora.factors["model.layers.0.self_attn.q_proj"][0].shape[0] == 2
    assert lora.factors["model.layers.1.mlp.down_proj"][0].shape[0] == 6
    ids = torch.tensor([[1, 5, 9, 200, 17, 3], [4, 4, 80, 2, 99, 250]])
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    key = torch.ones_like(ids, dtype=torch.bool)
    eng = Engine(copy.deepcopy(base))
    with torch.no_grad():
        plain = eng.forward(ids, pos, key)
        eng.set_adapter(lora)
        ours = eng.forward(ids, pos, key)
        ref = pm(ids).logits
    effect = (ref - plain).abs().max()
    assert effect > 0.1
    assert (ours - ref).abs().max() < 1e-4 * effect


@pytest.mark.parametrize("conf,match", [
    (dict(target_modules=PROJ, use_dora=True), "DoRA"),
    (dict(target_modules=PROJ + ["lm_head"]), "LoRA on lm_head"),
    (dict(target_modules=["q_proj", "embed_tokens"]), "LoRA on model.embed_tokens"),
    (dict(target_modules=["q_proj"], modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(target_modules=["q_proj"], lora_bias=True), "lora_bias"),
])
def test_unsupported_adapters_are_one_clear_error(base, tmp_path, conf, match):
    _save(base, tmp_path / "ad", r=4, lora_alpha=8, **conf)
    with pytest.raises(QerlError, match=match) as e:
        load_lora(tmp_path / "ad", base)
    assert "does not apply" in str(e.value) and str(e.value).count(". ") == 0  # one sentence


def _rewrite(path, conf_update=None, tensors=None, metadata=None):
    """Change an adapter directory in place: its config's entries, its tensors (a function of the old ones) and the
    weights file's metadata."""
    import json

    from safetensors.torch import load_file, save_file

    cf, wf = path / "adapter_config.json", path / "adapter_model.safetensors"
    cf.write_text(json.dumps(json.loads(cf.read_text()) | (conf_update or {})))
    t = load_file(str(wf))
    save_file(tensors(t) if tensors else t, str(wf), metadata=metadata)


@pytest.mark.parametrize("conf_update,tensors,match", [
    # (review, session 31) PEFT drops factors its config does not target and keys without its prefix, silently:
    # qerl applied them all, another policy than PEFT's on the source model (and the same digest)
    ({"target_modules": ["q_proj"]}, None, "modules its config does not target, such as model.layers.0.mlp.down"),
    ({"exclude_modules": ["down_proj"]}, None, "modules its config does not target, such as model.layers.0.mlp.down"),
    ({"layers_to_transform": [0]}, None, "modules its config does not target, such as model.layers.1.mlp.down"),
    (None, lambda t: {k.replace("base_model.model.", ""): v for k, v in t.items()}, "without PEFT's 'base_model.model"),
    ({"lora_alpha": float("nan")}, None, "lora_alpha .* not a finite number"),
    (None, lambda t: {k: v.to(torch.float8_e4m3fn) for k, v in t.items()}, "float16, bfloat16, float32 or float64"),
])
def test_adapters_peft_would_read_otherwise_are_one_clear_error(base, tmp_path, conf_update, tensors, match):
    _save(base, tmp_path / "ad", r=4, lora_alpha=8, target_modules=PROJ)
    load_lora(tmp_path / "ad", base)  # (as saved: fine)
    _rewrite(tmp_path / "ad", conf_update, tensors)
    with pytest.raises(QerlError, match=match) as e:
        load_lora(tmp_path / "ad", base)
    assert str(e.value).count(". ") == 0  # one sentence


def test_all_linear_and_regex_targets_read_as_peft_reads_them(base, tmp_path):
    _save(base, tmp_path / "ad", r=4, lora_alpha=8, target_modules="all-linear")
    assert len(load_lora(tmp_path / "ad", base).factors) == 14
    _save(base, tmp_path / "re", r=4, lora_alpha=8, target_modules=r".*\.(q_proj|v_proj)")
    assert len(load_lora(tmp_path / "re", base).factors) == 4


def test_the_digest_is_of_the_factors_not_the_files_bytes(base, tmp_path):
    """(review, session 31) safetensors writes its metadata in no fixed order, so saving one adapter twice made files
    of other bytes, and the digest (of the file) called the same adapter another policy about half the time."""
    _save(base, tmp_path / "ad", r=4, lora_alpha=8, target_modules=PROJ)
    first = load_lora(tmp_path / "ad", base).digest
    _rewrite(tmp_path / "ad", metadata={"format": "pt", "note": "same factors"})
    assert load_lora(tmp_path / "ad", base).digest == first
    _rewrite(tmp_path / "ad", tensors=lambda t: {k: v * (1.5 if "lora_B" in k else 1.0) for k, v in t.items()})
    assert load_lora(tmp_path / "ad", base).digest != first


def _folded(base, kv_heads: int, seed: int = 0):
    """A copy of a Llama like ``base`` (``kv_heads`` KV heads: 4 = no GQA, so v -> o folds too) and that copy
    folded with random AWQ factors for every group its layers support (the float function unchanged), the
    factors attached as an AWQ pack attaches them."""
    from transformers import LlamaForCausalLM

    from qerl_cli import calibrate

    conf = copy.deepcopy(base.config)
    conf.num_key_value_heads = kv_heads
    torch.manual_seed(seed)
    plain = LlamaForCausalLM(conf).eval()
    with torch.no_grad():
        for n, p in plain.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    folded = copy.deepcopy(plain)
    g = torch.Generator().manual_seed(seed + 1)
    folds = {}
    for i, layer in enumerate(calibrate.decoder_layers(folded)):
        for grp in calibrate.active_groups(layer):
            s = torch.rand(layer.get_submodule(grp.linears[0]).in_features, generator=g) * 3 + 0.25
            calibrate.fold_group(layer, grp, s)
            folds[f"model.layers.{i}.{grp.prev}"] = s
    folded.qerl_folding = folds
    return plain, folded


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_an_adapter_means_the_same_policy_on_an_awq_folded_model(base, tmp_path, kv_heads):
    """An adapter file holds the source model's coordinates; fitted to an AWQ-folded model (whose q/k/v, gate/up,
    o and down inputs are divided by s and whose v and up outputs are) it is folded, so the folded model with it
    computes what the source model with it does. Before, the factors were applied unchanged: another policy."""
    plain, folded = _folded(base, kv_heads)
    assert any(k.endswith("v_proj") for k in folded.qerl_folding) == (kv_heads == 4)
    assert any(k.endswith("up_proj") for k in folded.qerl_folding)
    _save(plain, tmp_path / "ad", r=4, lora_alpha=8, target_modules=PROJ)
    ids = torch.tensor([[1, 5, 9, 200, 17, 3], [4, 4, 80, 2, 99, 250]])
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    key = torch.ones_like(ids, dtype=torch.bool)
    out = {}
    for tag, m in (("plain", plain), ("folded", folded)):
        eng = Engine(copy.deepcopy(m))
        with torch.no_grad():
            out[tag + "0"] = eng.forward(ids, pos, key)
            lora = load_lora(tmp_path / "ad", m)
            eng.set_adapter(lora)
            out[tag] = eng.forward(ids, pos, key)
    assert (out["plain0"] - out["folded0"]).abs().max() < 1e-4  # (the folds keep the function)
    effect = (out["plain"] - out["plain0"]).abs().max()
    assert effect > 0.1
    assert (out["folded"] - out["plain"]).abs().max() < 1e-4 * effect
    # fitting the same LoRA again (to either model) starts from the file's factors, never folds twice
    from qerl_cli.adapter import fit_lora

    fit_lora(lora, folded, "ad")
    fit_lora(lora, plain, "ad")
    fresh = load_lora(tmp_path / "ad", plain)
    assert all(torch.equal(lora.factors[n][i], fresh.factors[n][i]) for n in fresh.factors for i in (0, 1))


def test_training_on_an_awq_folded_model_saves_source_coordinates_and_resumes_exactly(base, tmp_path):
    """save_adapter unfolds what trained on a folded model (the file loads onto the source model as the same
    policy, PEFT's way included); load_adapter_weights folds it back, and with the exact factors a checkpoint
    keeps, bit for bit."""
    from peft import PeftModel, get_peft_model_state_dict

    from qerl_cli import lora as lora_mod

    plain, folded = _folded(base, 4)
    pm = _wrapped_on_folded(folded)
    lora_mod.save_adapter(pm, tmp_path / "ad")
    ids = torch.tensor([[1, 5, 9, 200, 17, 3]])
    with torch.no_grad():
        trained = pm(ids).logits
        peft_plain = PeftModel.from_pretrained(copy.deepcopy(plain), str(tmp_path / "ad")).eval()(ids).logits
        untouched = plain(ids).logits
    assert (trained - untouched).abs().max() > 0.1
    assert (peft_plain - trained).abs().max() < 1e-4 * (trained - untouched).abs().max()
    sd = {k: v.clone() for k, v in get_peft_model_state_dict(pm).items()}
    pm2 = lora_mod.wrap(copy.deepcopy(folded), 4, 8, seed=5)
    pm2.get_base_model().qerl_folding = folded.qerl_folding
    lora_mod.load_adapter_weights(pm2, tmp_path / "ad")
    got = get_peft_model_state_dict(pm2)
    assert all(torch.allclose(got[k], sd[k], rtol=1e-6, atol=1e-7) for k in sd)
    lora_mod.load_adapter_weights(pm2, tmp_path / "ad", exact=sd)
    assert all(torch.equal(get_peft_model_state_dict(pm2)[k], sd[k]) for k in sd)
    # the file says its coordinates; a train checkpoint of an older qerl (unmarked: the coordinates of the pack it
    # trained on) is refused on an AWQ pack, where the two cannot be told apart, and read as before elsewhere
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from qerl_cli.adapter import ADAPTER_WEIGHTS

    with safe_open(str(tmp_path / "ad" / ADAPTER_WEIGHTS), "pt") as f:
        assert f.metadata()["qerl_coordinates"] == "source"
    old = tmp_path / "old-step"
    shutil.copytree(tmp_path / "ad", old)
    (old / "trainer_state.json").write_text("{}")
    save_file({"state.0.step": torch.zeros(())}, str(old / "optimizer.safetensors"))  # (as every qerl checkpoint)
    save_file(load_file(str(old / ADAPTER_WEIGHTS)), str(old / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with pytest.raises(QerlError, match="saved by a qerl before session 28"):
        load_lora(old, folded)
    assert load_lora(old, plain).source is None
    third_party = tmp_path / "peft-made"  # (no trainer_state.json: a PEFT adapter, the source model's by definition)
    shutil.copytree(old, third_party)
    (third_party / "trainer_state.json").unlink()
    (third_party / "optimizer.safetensors").unlink()
    assert load_lora(third_party, folded).source is not None


def _wrapped_on_folded(folded):
    """peft-wrapped copy of ``folded`` (its folds attached) with random B factors."""
    from qerl_cli import lora as lora_mod

    pm = lora_mod.wrap(copy.deepcopy(folded), 4, 8)
    pm.get_base_model().qerl_folding = folded.qerl_folding
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    return pm


def _trained_on_folded(folded):
    """``_wrapped_on_folded`` with one AdamW step taken (optimizer state)."""
    from qerl_cli import lora as lora_mod

    pm = _wrapped_on_folded(folded)
    params = [p for _, p in lora_mod.trainable(pm)]
    opt = torch.optim.AdamW(params, lr=1e-3)
    pm(torch.tensor([[1, 5, 9, 200]])).logits.square().mean().backward()
    opt.step()
    opt.zero_grad()
    return pm, opt


def test_resuming_an_older_unmarked_checkpoint_on_an_awq_pack_is_exact(base, tmp_path):
    """A train checkpoint of a qerl before session 28 holds the factors as they trained on the AWQ pack (its
    pack's coordinates, no marker, no param.* copies): --resume of that unfinished run (same key: same pack) must
    continue from those factors, not fold them a second time as if they were the source model's."""
    import json

    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file, save_file

    from qerl_cli import artifact, names, train
    from qerl_cli import lora as lora_mod

    _, folded = _folded(base, 4)
    pm, opt = _trained_on_folded(folded)
    trained = {k: v.clone() for k, v in get_peft_model_state_dict(pm).items()}
    run = tmp_path / "run"
    run.mkdir()
    d = train._save_step(run, 2, pm, opt, 0, 1)
    # what the older qerl wrote: the adapter as trained (folded), unmarked; the optimizer state only
    save_file({k: v.contiguous() for k, v in trained.items()}, str(d / names.ADAPTER_WEIGHTS), metadata={"format": "pt"})
    flat = load_file(str(d / names.OPTIMIZER_STATE))
    save_file({k: v for k, v in flat.items() if k.startswith("state.")}, str(d / names.OPTIMIZER_STATE))
    (d / names.STEP_HASHES).write_text(json.dumps(
        {names.K_FILES: artifact.list_files(d, skip=names.STEP_HASHES)}, indent=1) + "\n")
    pm2 = lora_mod.wrap(copy.deepcopy(folded), 4, 8, seed=5)
    pm2.get_base_model().qerl_folding = folded.qerl_folding
    opt2 = torch.optim.AdamW([p for _, p in lora_mod.trainable(pm2)], lr=1e-3)
    train._load_step(d, pm2, opt2)
    got = get_peft_model_state_dict(pm2)
    assert all(torch.equal(got[k], trained[k]) for k in trained)


def test_a_transformers_trainer_checkpoint_is_a_peft_adapter_on_an_awq_pack(base, tmp_path):
    """transformers' / TRL's Trainer writes PEFT adapters into checkpoint-N/ dirs beside its own trainer_state.json
    (and optimizer.pt, scheduler.pt): a third-party adapter in the source model's coordinates, not an older qerl
    checkpoint, so an AWQ pack takes it (folded) rather than refusing it as 'saved by a qerl before session 28'."""
    import json

    plain, folded = _folded(base, 4)
    ck = tmp_path / "checkpoint-500"
    _save(plain, ck, r=4, lora_alpha=8, target_modules=PROJ)
    (ck / "trainer_state.json").write_text(json.dumps({"global_step": 500, "log_history": [], "best_metric": None}))
    torch.save({}, ck / "optimizer.pt")
    torch.save({}, ck / "scheduler.pt")
    lora = load_lora(ck, folded)
    assert lora.source is not None
    # a qerl checkpoint (its optimizer.safetensors beside trainer_state.json) without the marker is still refused
    from safetensors.torch import save_file

    save_file({"state.0.step": torch.zeros(())}, str(ck / "optimizer.safetensors"))
    with pytest.raises(QerlError, match="saved by a qerl before session 28"):
        load_lora(ck, folded)


def test_the_older_checkpoint_refusal_says_how_to_train_again(base, tmp_path):
    """The run that wrote an older unmarked checkpoint is finished under the same key (the train key did not
    change), so `qerl train` with its command again is a cache hit ("up to date; nothing to do"): the refusal's
    remedy must name --force, or following it does nothing."""
    from safetensors.torch import save_file

    plain, folded = _folded(base, 4)
    old = tmp_path / "step-00000010"
    _save(plain, old, r=4, lora_alpha=8, target_modules=PROJ)
    (old / "trainer_state.json").write_text("{}")
    save_file({"state.0.step": torch.zeros(())}, str(old / "optimizer.safetensors"))
    with pytest.raises(QerlError, match="saved by a qerl before session 28") as e:
        load_lora(old, folded)
    assert "--force" in str(e.value) and str(e.value).count(". ") == 0


def test_the_folded_adapter_copy_for_vllm_means_the_same_policy_on_the_folded_checkpoint(base, tmp_path):
    """vLLM runs the AWQ-folded checkpoint and applies the adapter it is given as PEFT does, unchanged:
    write_folded_adapter's copy, applied that way to the folded model, computes what the source adapter does on
    the source model (the source file applied unchanged would not), and the source file is left as it was."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from qerl_cli.adapter import ADAPTER_WEIGHTS
    from qerl_cli.lora import write_folded_adapter

    plain, folded = _folded(base, 4)
    _save(plain, tmp_path / "ad", r=4, lora_alpha=8, target_modules=PROJ)
    before = load_file(str(tmp_path / "ad" / ADAPTER_WEIGHTS))
    copy_dir = write_folded_adapter(tmp_path / "ad", folded.qerl_folding)
    try:
        ids = torch.tensor([[1, 5, 9, 200, 17, 3], [4, 4, 80, 2, 99, 250]])
        with torch.no_grad():
            untouched = plain(ids).logits
            want = PeftModel.from_pretrained(copy.deepcopy(plain), str(tmp_path / "ad")).eval()(ids).logits
            got = PeftModel.from_pretrained(copy.deepcopy(folded), copy_dir).eval()(ids).logits
            naive = PeftModel.from_pretrained(copy.deepcopy(folded), str(tmp_path / "ad")).eval()(ids).logits
        effect = (want - untouched).abs().max()
        assert effect > 0.1
        assert (got - want).abs().max() < 1e-4 * effect
        assert (naive - want).abs().max() > 0.05 * effect  # (the folds matter: without them, another policy)
        after = load_file(str(tmp_path / "ad" / ADAPTER_WEIGHTS))
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    finally:
        shutil.rmtree(copy_dir)


def test_train_logs_the_adapter_norm_in_the_saved_files_coordinates(base, tmp_path):
    """train's adapter_norm is the norm of what the adapter file holds (the source model's coordinates), so the same
    adapter logs the same norm on an AWQ pack and elsewhere; the factors as trained on the folded model differ."""
    import math

    from safetensors.torch import load_file

    from qerl_cli import lora as lora_mod
    from qerl_cli.adapter import ADAPTER_WEIGHTS

    _, folded = _folded(base, 4)
    pm = _wrapped_on_folded(folded)
    lora_mod.save_adapter(pm, tmp_path / "ad")
    saved = math.sqrt(sum(float(t.double().pow(2).sum())
                          for t in load_file(str(tmp_path / "ad" / ADAPTER_WEIGHTS)).values()))
    as_trained = math.sqrt(sum(float(p.double().pow(2).sum()) for _, p in lora_mod.trainable(pm)))
    assert abs(as_trained - saved) > 0.01 * saved
    assert lora_mod.source_norm(pm) == pytest.approx(saved, rel=1e-6)
    plain_pm = lora_mod.wrap(copy.deepcopy(base), 4, 8)  # (no folds: the factors as they are)
    assert lora_mod.source_norm(plain_pm) == pytest.approx(
        math.sqrt(sum(float(p.double().pow(2).sum()) for _, p in lora_mod.trainable(plain_pm))), rel=1e-9)
