"""PEFT adapters read by our engine: per-module ranks and alphas as peft applies them, and one clear error for
what the engine would not apply (LoRA variants such as DoRA, LoRA outside the projections, extra tensors)."""

from __future__ import annotations

import copy

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
