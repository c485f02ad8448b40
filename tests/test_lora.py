"""LoRA save / load on a packed model (tiny models built from a config)."""

from __future__ import annotations

import pytest
import torch

from qerl_cli import lora, packed_model
from qerl_cli.errors import QerlError


def _tiny_packed(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    conf = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)
    return packed_model.pack_model_inplace(LlamaForCausalLM(conf).float().eval())


def test_load_adapter_weights_refuses_an_adapter_missing_some_of_the_models_factors(tmp_path):
    """Resuming onto a wrapped model whose LoRA modules the file does not all hold must not leave the missing ones
    at their fresh initialisation silently (the mirror of the unexpected-keys refusal)."""
    small = lora.wrap(_tiny_packed(), 4, 8.0, targets=("q_proj",), seed=1)
    with torch.no_grad():
        for _, p in lora.trainable(small):
            p.add_(0.1)
    lora.save_adapter(small, tmp_path / "q-only")
    wide = lora.wrap(_tiny_packed(), 4, 8.0, targets=("q_proj", "v_proj"), seed=2)
    with pytest.raises(QerlError, match="does not hold"):
        lora.load_adapter_weights(wide, tmp_path / "q-only")
    # the same targets load, bit for bit
    same = lora.wrap(_tiny_packed(), 4, 8.0, targets=("q_proj",), seed=3)
    lora.load_adapter_weights(same, tmp_path / "q-only")
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(lora.trainable(small), lora.trainable(same)))



def test_load_adapter_weights_of_another_rank_is_one_sentence(tmp_path):
    """Factors of another rank: one QerlError naming the tensor and both shapes (was torch's multi-line
    RuntimeError from load_state_dict)."""
    lora.save_adapter(lora.wrap(_tiny_packed(), 4, 8.0, targets=("q_proj",), seed=1), tmp_path / "r4")
    r8 = lora.wrap(_tiny_packed(), 8, 8.0, targets=("q_proj",), seed=2)
    with pytest.raises(QerlError, match=r"rank .*lora_A.* has shape \(4, 64\).*\(8, 64\)") as e:
        lora.load_adapter_weights(r8, tmp_path / "r4")
    assert "\n" not in str(e.value)
