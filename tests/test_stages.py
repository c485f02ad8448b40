"""quantize -> pack -> verify on the tiny random Llama through the Python API (src/qerl_cli/{quantize,pack,verify}.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qerl_cli import artifact, layout, names, nvfp4
from qerl_cli import pack as pack_mod

LINEAGE = {"chat_template.jinja", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}
QUANT_FILES = LINEAGE | {"manifest.json", "model.safetensors", "model.safetensors.index.json", "quant.json"}
PACKED_FILES = LINEAGE | {"manifest.json", "model.safetensors", "packed.json", "quant.json"}
VERIFY_FILES = {"manifest.json", "report.json"}
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _files(d: Path) -> set[str]:
    return {p.relative_to(d).as_posix() for p in d.rglob("*")}


def _linear_names(tensors) -> list[str]:
    return sorted(k[: -len(".weight_packed")] for k in tensors if k.endswith(".weight_packed"))


def _source_state(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


# ---------------------------------------------------------------------------------------- the pipeline


def test_pipeline_passes(tiny_pipeline):
    v = artifact.open_artifact(tiny_pipeline["verify"], names.KIND_VERIFY)
    assert v.metrics["passed"] is True
    report = json.loads(v.file(names.VERIFY_REPORT).read_text())
    assert report["passed"] is True and report["backend"] == "torch-reference"
    checks = report["checks"]
    assert list(checks) == ["1_projections", "2_model", "3_round_trip"]
    assert all(c["passed"] for c in checks.values())
    proj = checks["1_projections"]
    # every linear, plus the engine's fused q/k/v and gate/up of each layer
    assert [r["name"] for r in proj["layers"] if not r["fused"]] == [
        f"model.layers.{i}.{p}" for i in range(2) for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                            "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                            "mlp.down_proj")]
    fused = {r["name"]: r["shape"] for r in proj["layers"] if r["fused"]}
    assert fused == {**{f"model.layers.{i}.self_attn.q_proj+k_proj+v_proj": [64 + 32 + 32, 64] for i in range(2)},
                     **{f"model.layers.{i}.mlp.gate_proj+up_proj": [2 * 128, 64] for i in range(2)}}
    assert proj["linears_checked"] == 2 * len(PROJ) and proj["fused_checked"] == 4
    # M reaches each CUDA kernel instance (<= 8, 8 < M <= 16, 16 < M <= 32, 32 < M <= 64, above)
    assert proj["batch_sizes"] == [1, 7, 8, 12, 16, 32, 48, 64, 300] and proj["batch_sizes_t"] == [7, 64]
    assert all(r["max_rel_error"] <= 1e-5 and r["max_rel_error_t"] <= 1e-5 for r in proj["layers"])
    assert checks["2_model"]["top1_agreement"] == 1.0 and checks["2_model"]["tokens"] > 0
    assert checks["3_round_trip"]["linears_checked"] == 2 * len(PROJ)


def test_exact_file_sets(tiny_pipeline):
    assert _files(tiny_pipeline["quant"]) == QUANT_FILES
    assert _files(tiny_pipeline["packed"]) == PACKED_FILES
    assert _files(tiny_pipeline["verify"]) == VERIFY_FILES
    for kind in ("quant", "packed", "verify"):
        art = artifact.open_artifact(tiny_pipeline[kind], kind)
        assert {f["path"] for f in art.manifest["files"]} == _files(tiny_pipeline[kind]) - {"manifest.json"}


def test_lineage_chain(tiny_pipeline):
    q = artifact.open_artifact(tiny_pipeline["quant"], "quant")
    p = artifact.open_artifact(tiny_pipeline["packed"], "packed")
    v = artifact.open_artifact(tiny_pipeline["verify"], "verify")
    assert [i["kind"] for i in q.inputs] == ["model"]
    assert q.inputs[0]["path"] == str(tiny_pipeline["model"])
    assert p.inputs == [{"kind": "quant", "path": "../quant", "digest": q.digest}]
    assert {(i["kind"], i["digest"]) for i in v.inputs} == {("packed", p.digest), ("quant", q.digest)}
    # each artifact is self-describing: the tokenizer (with the fixed eos/pad) loads from it
    from transformers import AutoTokenizer

    for d in (tiny_pipeline["quant"], tiny_pipeline["packed"]):
        tok = AutoTokenizer.from_pretrained(str(d))
        assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|im_end|>"
        assert tok.chat_template
        conf = json.loads((d / "config.json").read_text())
        assert conf["model_type"] == "llama" and conf["architectures"] == ["LlamaForCausalLM"]
        assert conf["eos_token_id"] == tok.eos_token_id == 2


def test_same_weights_by_another_path_give_the_same_artifact(tiny_pipeline, tmp_path):
    """config.json holds no ``_name_or_path``: the same model named by another path (a copy, another venv) gives
    the same files, so the same digest, and a pack made from either is the same artifact."""
    from qerl_cli.quantize import quantize

    copy = shutil.copytree(tiny_pipeline["model"], tmp_path / "elsewhere" / "model")
    quantize(str(copy), tmp_path / "quant", progress=False)
    assert "_name_or_path" not in json.loads((tmp_path / "quant" / "config.json").read_text())
    a = artifact.open_artifact(tiny_pipeline["quant"], "quant")
    b = artifact.open_artifact(tmp_path / "quant", "quant")
    assert {f["path"]: f["sha256"] for f in a.manifest["files"]} == {f["path"]: f["sha256"] for f in b.manifest["files"]}
    assert a.digest == b.digest


# ------------------------------------------------------------------------------------- the quant format


def test_quant_manifest_says_rtn(tiny_pipeline):
    q = artifact.open_artifact(tiny_pipeline["quant"], "quant")
    assert q.config["method"] == "rtn" and q.metrics["method"] == "rtn"
    rep = json.loads(q.file(names.QUANT_REPORT).read_text())
    assert rep["method"] == "rtn"
    assert len(rep["layers"]) == 2 * len(PROJ)
    assert all(r["clip_ratio"] == 1.0 for r in rep["layers"])


def test_quantization_config_block(tiny_pipeline):
    qc = json.loads((tiny_pipeline["quant"] / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["format"] == "nvfp4-pack-quantized"
    assert qc["quantization_status"] == "compressed"
    assert qc["ignore"] == ["lm_head"]
    (group,) = qc["config_groups"].values()
    assert group["targets"] == ["Linear"]
    assert group.get("input_activations") is None
    w = group["weights"]
    assert {k: w[k] for k in ("num_bits", "type", "strategy", "group_size", "symmetric", "dynamic", "scale_dtype")} == {
        "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
        "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"}


def test_quant_tensors(tiny_pipeline):
    t = load_file(str(tiny_pipeline["quant"] / "model.safetensors"))
    src = _source_state(tiny_pipeline["model"])
    linears = _linear_names(t)
    assert linears == sorted(f"model.layers.{i}.{'self_attn' if p in PROJ[:4] else 'mlp'}.{p}"
                             for i in range(2) for p in PROJ)
    assert "lm_head.weight" not in t  # tied to the embeddings
    for name in linears:
        assert f"{name}.weight" not in t
        assert t[f"{name}.weight_packed"].dtype == torch.uint8
        assert t[f"{name}.weight_scale"].dtype == torch.float8_e4m3fn
        g = t[f"{name}.weight_global_scale"]
        assert g.dtype == torch.float32 and tuple(g.shape) == (1,)
        n, k = src[f"{name}.weight"].shape
        assert tuple(t[f"{name}.weight_packed"].shape) == (n, k // 2)
        assert tuple(t[f"{name}.weight_scale"].shape) == (n, k // 16)
    rest = {k for k in t if not any(k.startswith(n + ".") for n in linears)}
    assert rest == {k for k in src if not any(k.startswith(n + ".") for n in linears)} - {"lm_head.weight"}
    for k in rest:  # embeddings and norms: bf16, unchanged
        assert t[k].dtype == torch.bfloat16 and torch.equal(t[k], src[k].to(torch.bfloat16)), k


def test_fused_sets_share_global_scale_and_codes_match(tiny_pipeline):
    t = load_file(str(tiny_pipeline["quant"] / "model.safetensors"))
    src = _source_state(tiny_pipeline["model"])
    for i in range(2):
        sets = [[f"model.layers.{i}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")],
                [f"model.layers.{i}.mlp.{p}" for p in ("gate_proj", "up_proj")],
                [f"model.layers.{i}.self_attn.o_proj"], [f"model.layers.{i}.mlp.down_proj"]]
        for members in sets:
            amax = max(float(src[f"{m}.weight"].float().abs().amax()) for m in members)
            # python-scalar / tensor, as compressed-tensors computes it (torch: 2688 * (1 / amax), which can
            # differ by one ulp from the correctly rounded quotient)
            want = 2688.0 / torch.tensor([amax], dtype=torch.float32)
            for m in members:
                assert torch.equal(t[f"{m}.weight_global_scale"], want), m
                ours = nvfp4.quantize_weight(src[f"{m}.weight"], want)
                assert torch.equal(t[f"{m}.weight_packed"], ours["weight_packed"]), m
                assert torch.equal(t[f"{m}.weight_scale"].view(torch.uint8), ours["weight_scale"].view(torch.uint8))
        g = [t[f"model.layers.{i}.self_attn.{p}.weight_global_scale"] for p in ("q_proj", "o_proj")]
        assert not torch.equal(*g)  # separate sets really are separate


def test_transformers_loads_quant_checkpoint_bit_exact(tiny_pipeline):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    d = tiny_pipeline["quant"]
    model = AutoModelForCausalLM.from_pretrained(
        str(d), quantization_config=CompressedTensorsConfig(run_compressed=False), dtype=torch.bfloat16)
    t = load_file(str(d / "model.safetensors"))
    linears = _linear_names(t)
    checked = 0
    for name in linears:
        w = model.get_submodule(name).weight
        ours = nvfp4.dequantize(nvfp4.unpack_nibbles(t[f"{name}.weight_packed"]), t[f"{name}.weight_scale"],
                                t[f"{name}.weight_global_scale"], torch.bfloat16)
        assert w.dtype == torch.bfloat16
        assert torch.equal(w.detach().view(torch.int16), ours.view(torch.int16)), name
        checked += 1
    assert checked == 2 * len(PROJ)
    emb = model.get_input_embeddings().weight
    assert emb.dtype == torch.bfloat16 and torch.equal(emb.detach(), t["model.embed_tokens.weight"])
    assert model.lm_head.weight.data_ptr() == emb.data_ptr()  # tied
    assert torch.equal(model.model.norm.weight.detach(), t["model.norm.weight"])


def test_config_override_targets_and_wrong_lineage(tiny_pipeline, tmp_path):
    """--config with fewer targets: those stay dense; verifying the first pack against it fails the round trip."""
    from qerl_cli.quantize import quantize
    from qerl_cli.verify import verify

    cfg = tmp_path / "q.toml"
    cfg.write_text('targets = ["o_proj", "down_proj"]\nfused_groups = []\n')
    q2 = quantize(str(tiny_pipeline["model"]), tmp_path / "quant2", config_file=cfg, progress=False)
    t = load_file(str(q2.path / "model.safetensors"))
    assert _linear_names(t) == sorted(f"model.layers.{i}.{p}" for i in range(2) for p in ("self_attn.o_proj", "mlp.down_proj"))
    assert t["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert q2.config["targets"] == ["o_proj", "down_proj"]
    v = verify(tiny_pipeline["packed"], tmp_path / "verify", against=q2.path, progress=False, device="cpu")
    rt = json.loads(v.file("report.json").read_text())["checks"]["3_round_trip"]
    assert v.metrics["passed"] is False and rt["passed"] is False
    assert any("not made from this quant checkpoint" in p for p in rt["problems"])


def test_narrowed_targets_are_ignored_and_the_checkpoint_loads(tiny_pipeline, tmp_path):
    """Linears left dense by narrowed targets are named in ``ignore`` (compressed-tensors reads every other
    Linear as NVFP4): transformers loads them as the dense bf16 weights, nothing missing, finite logits equal to
    the dequantized reference's."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    from qerl_cli.packed_model import load_dequantized_model
    from qerl_cli.quantize import quantize

    cfg = tmp_path / "q.toml"
    cfg.write_text('targets = ["o_proj", "down_proj"]\nfused_groups = []\n')
    q = quantize(str(tiny_pipeline["model"]), tmp_path / "quant", config_file=cfg, progress=False)
    qc = json.loads((q.path / "config.json").read_text())["quantization_config"]
    dense = [f"model.layers.{i}.{p}" for i in range(2)
             for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")]
    assert sorted(qc["ignore"]) == sorted(dense + ["lm_head"])
    model, info = AutoModelForCausalLM.from_pretrained(
        str(q.path), quantization_config=CompressedTensorsConfig(run_compressed=False), dtype=torch.bfloat16,
        output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    src = _source_state(tiny_pipeline["model"])
    for name in dense:
        assert torch.equal(model.get_submodule(name).weight.detach(), src[f"{name}.weight"]), name
    t = load_file(str(q.path / "model.safetensors"))
    ref = load_dequantized_model(t, q.path, torch.bfloat16)
    ids = torch.randint(0, 5000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = model(ids).logits, ref(ids).logits
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the full-target checkpoint still ignores lm_head only
    qc = json.loads((tiny_pipeline["quant"] / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["lm_head"]


# ------------------------------------------------------------------------------------ planted corruptions


def _first_linear(tiny_pipeline) -> str:
    return _linear_names(load_file(str(tiny_pipeline["quant"] / "model.safetensors")))[0]


def _swap_nibbles(rec: torch.Tensor) -> torch.Tensor:
    rec = rec.clone()
    code = rec[0, 0, : layout.CODE_BYTES]
    differ = ((code & 0xF) != (code >> 4)).nonzero().flatten()[:8]
    assert len(differ) == 8
    b = code[differ]
    code[differ] = (b >> 4) | ((b & 0xF) << 4)
    return rec


def _transpose_scale_block(rec: torch.Tensor) -> torch.Tensor:
    rec = rec.clone()
    s = rec[0, 0, layout.CODE_BYTES:]
    t = s.reshape(8, 4, 2).permute(2, 1, 0).reshape(64)  # stored [g, j, r] -> [r, j, g]
    assert not torch.equal(s, t)
    rec[0, 0, layout.CODE_BYTES:] = t
    return rec


def _run_corrupted(tiny_pipeline, tmp_path, monkeypatch, corrupt_record=None, scale_global=None):
    from qerl_cli.verify import verify

    target = _first_linear(tiny_pipeline)
    if corrupt_record is not None:
        real_pack = layout.pack
        calls = []

        def bad_pack(codes, scales):
            out = real_pack(codes, scales)
            calls.append(1)
            return corrupt_record(out) if len(calls) == 1 else out  # linears are packed in sorted order

        monkeypatch.setattr(layout, "pack", bad_pack)
    if scale_global is not None:
        real_tensors = pack_mod.pack_tensors

        def bad_tensors(tensors, progress=True):
            out, index = real_tensors(tensors, progress)
            out[f"{target}.{names.PK_GLOBAL}"] = out[f"{target}.{names.PK_GLOBAL}"] * scale_global
            return out, index

        monkeypatch.setattr(pack_mod, "pack_tensors", bad_tensors)
    # the quant artifact is shared: pack from a copy so the session's pipeline stays pristine
    quant = tmp_path / "quant"
    shutil.copytree(tiny_pipeline["quant"], quant)
    pack_mod.pack(quant, tmp_path / "packed", progress=False)
    monkeypatch.undo()
    v = verify(tmp_path / "packed", tmp_path / "verify", progress=False, device="cpu")
    report = json.loads(v.file("report.json").read_text())
    return target, v, report


@pytest.mark.parametrize("kind,problem", [("nibbles", "codes differ"), ("scales", "block scales differ"),
                                          ("global", "global scale differs")])
def test_verify_catches_planted_corruption(tiny_pipeline, tmp_path, monkeypatch, kind, problem):
    kw = {"nibbles": {"corrupt_record": _swap_nibbles}, "scales": {"corrupt_record": _transpose_scale_block},
          "global": {"scale_global": 1.01}}[kind]
    target, v, report = _run_corrupted(tiny_pipeline, tmp_path, monkeypatch, **kw)
    assert v.metrics["passed"] is False and report["passed"] is False
    proj = report["checks"]["1_projections"]
    assert proj["passed"] is False
    assert [r["name"] for r in proj["layers"] if not r["passed"]] == [target]
    rt = report["checks"]["3_round_trip"]
    assert rt["passed"] is False
    assert rt["problems"] == [f"{target}: {problem}"]


def test_pack_of_another_layout_version_is_refused(tiny_pipeline, tmp_path, monkeypatch):
    """A pack written by a qerl with another record layout (v1 before session 5) is refused in one sentence."""
    from qerl_cli import packed_model
    from qerl_cli.errors import QerlError

    quant = tmp_path / "quant"
    shutil.copytree(tiny_pipeline["quant"], quant)
    monkeypatch.setattr(layout, "LAYOUT_NAME", "qerl-nvfp4-tile16x64-v1")
    pack_mod.pack(quant, tmp_path / "packed", progress=False)
    monkeypatch.undo()
    with pytest.raises(QerlError, match="uses packed layout 'qerl-nvfp4-tile16x64-v1'; this qerl reads "
                                        "qerl-nvfp4-tile16x64-v2: re-run `qerl pack`"):
        packed_model.load_packed_model(artifact.open_artifact(tmp_path / "packed", "packed"))
    # the real command: verify says the same (before comparing any record), exits 1 and writes no artifact
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "qerl_cli.cli", "verify", str(tmp_path / "packed"), "--no-progress",
                          "-o", str(tmp_path / "v")], capture_output=True, text=True, timeout=300)
    assert res.returncode == 1 and "uses packed layout" in res.stdout + res.stderr, (res.stdout, res.stderr)
    assert not (tmp_path / "v").exists()


def test_verify_against_a_checkpoint_of_another_shape_is_one_sentence(tiny_pipeline, tmp_path, smollm2_tokenizer):
    """A quant of another model (hidden 32, not 64) was a traceback in the first matmul; nothing is written."""
    from conftest import build_tiny_llama
    from qerl_cli.errors import QerlError
    from qerl_cli.quantize import quantize
    from qerl_cli.verify import verify

    other = build_tiny_llama(tmp_path / "small", smollm2_tokenizer, hidden=32, intermediate=64)
    q = quantize(str(other), tmp_path / "quant-small", progress=False)
    with pytest.raises(QerlError, match=r"is a checkpoint of another model than .* \(the shape of model\.layers\.0\."):
        verify(tiny_pipeline["packed"], tmp_path / "verify", against=q.path, progress=False, device="cpu")
    assert not (tmp_path / "verify").exists()
    # (review, session 31) the same linears and another vocabulary: the guard read the linears alone, and the model
    # check then crashed comparing logits of 49152 and 49216 entries
    wide = build_tiny_llama(tmp_path / "wide", smollm2_tokenizer, extra_vocab=64)
    q = quantize(str(wide), tmp_path / "quant-wide", progress=False)
    with pytest.raises(QerlError, match=r"is a checkpoint of another model than .* \(the shape of model\.embed_tokens"):
        verify(tiny_pipeline["packed"], tmp_path / "verify", against=q.path, progress=False, device="cpu")
    assert not (tmp_path / "verify").exists()
