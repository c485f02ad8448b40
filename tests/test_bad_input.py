"""Bad input found by an adversarial pass over the CLI: each case is one clear sentence on stderr, exit 1, and
no output (or an untouched old output)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import run_cli
from qerl_cli import modelio, names
from qerl_cli.errors import QerlError


def _clean_error(res: subprocess.CompletedProcess, match: str = "") -> str:
    assert res.returncode == 1, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr + res.stdout
    lines = [l for l in res.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and lines[0].rstrip().endswith("."), res.stderr
    assert match in lines[0], lines[0]
    return lines[0]


def test_a_pack_without_its_manifest_is_not_taken_for_a_source_model(tiny_pipeline, tmp_path):
    """A packed dir whose manifest.json was deleted has config.json and model.safetensors, so it looked like a HF
    model directory: rollout loaded it as the bf16 baseline with every projection randomly initialised."""
    p = tmp_path / "packed"
    shutil.copytree(tiny_pipeline["packed"], p)
    (p / names.MANIFEST).unlink()
    out = tmp_path / "ro"
    _clean_error(run_cli("rollout", str(p), "--prompts", "arith:1", "-G", "1", "--max-new-tokens", "2",
                         "--no-progress", "-o", str(out)), "lost its manifest.json")
    assert not out.exists()


def test_a_model_directory_with_missing_weights_is_refused(tiny_pipeline, tmp_path):
    """transformers fills weights missing from a checkpoint with random numbers; qerl must refuse instead."""
    from safetensors.torch import load_file, save_file

    m = tmp_path / "model"
    shutil.copytree(tiny_pipeline["model"], m)
    t = load_file(str(m / names.MODEL_WEIGHTS))
    del t["model.layers.1.mlp.down_proj.weight"]
    save_file(t, str(m / names.MODEL_WEIGHTS), metadata={"format": "pt"})
    with pytest.raises(QerlError, match="lacks the weight model.layers.1.mlp.down_proj.weight"):
        modelio.load(modelio.resolve(str(m)))


def test_wrapping_a_model_in_lora_prints_no_warning(tiny_pipeline):
    """peft's FutureWarning about transformers' is_gradient_checkpointing reached stderr in every train run, so a
    failing train run printed three lines instead of one sentence."""
    import warnings

    from qerl_cli import artifact, lora
    from qerl_cli.packed_model import load_packed_model

    model = load_packed_model(artifact.open_artifact(tiny_pipeline["packed"], names.KIND_PACKED))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lora.wrap(model, 4, 8.0)


@pytest.mark.parametrize("args,match,help_of", [
    (("report",), "Missing argument 'artifacts'", "qerl report"),
    (("rollout", "x", "-o", "y", "--prompts", "arith:1", "-G", "abc"), "'--group'", "qerl rollout"),
    (("rollout", "x", "-o", "y", "--prompts", "arith:1", "--bogus"), "--bogus", "qerl rollout"),
    (("rollout", "x", "-o", "y"), "'--prompts'", "qerl rollout"),
    (("no-such-stage",), "no-such-stage", "qerl"),
    (("--bogus",), "--bogus", "qerl"),
    # click raises these (an option without its value, a flag given one) without the subcommand's context: the
    # hint named `qerl --help`
    (("rollout", "x", "-o", "y", "--prompts", "arith:1", "--temperature"), "'--temperature' requires an argument",
     "qerl rollout"),
    (("evaluate", "x", "-o", "y", "--data", "arith:2", "-k"), "'-k' requires an argument", "qerl evaluate"),
    (("pack", "q", "-o", "p", "--force=yes"), "'--force' does not take a value", "qerl pack"),
    *[((stage, "x", "-o"), "'-o' requires an argument", f"qerl {stage}")
      for stage in ("calibrate", "quantize", "pack", "verify", "rollout", "train", "evaluate", "report")],
])
def test_usage_errors_are_one_sentence(args, match, help_of):
    """A bad, missing or unknown option printed click's usage lines and an error box (5+ lines on stderr); the
    one line names the help of the subcommand that was called."""
    res = run_cli(*args)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr + res.stdout and not res.stdout.strip()
    lines = [l for l in res.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and lines[0].endswith("--help`."), res.stderr
    assert match in lines[0], lines[0]
    assert lines[0].endswith(f"; see `{help_of} --help`."), lines[0]


def test_help_version_and_no_arguments_still_work():
    res = run_cli("--version")
    assert res.returncode == 0 and res.stdout.startswith("qerl ")
    res = run_cli()
    assert "Usage: qerl" in res.stdout and "rollout" in res.stdout and res.returncode == 2
    res = run_cli("pack", "--help")
    assert res.returncode == 0 and "qerl pack" in res.stdout and not res.stderr.strip()


@pytest.mark.parametrize("target", [2.0, -0.1, float("nan")])
def test_report_refuses_a_target_accuracy_outside_0_1(tmp_path, target):
    """--target-accuracy 2 (a percent typed as a number?) or nan was accepted: 'not reached' for every run, and a
    NaN written into the manifest (not valid JSON)."""
    from qerl_cli import report

    with pytest.raises(QerlError, match="--target-accuracy must be an accuracy between 0 and 1"):
        report.report([tmp_path / "no-run"], tmp_path / "rep", target_accuracy=target)
    assert not (tmp_path / "rep").exists()


def _rehash(d: Path) -> None:
    """Re-hash an artifact's manifest after an edit: a tamper that the digest check cannot see."""
    import json

    from qerl_cli import artifact

    m = json.loads((d / names.MANIFEST).read_text())
    m["files"] = artifact.list_files(d)
    m["digest"] = artifact._digest(m["key"], m["files"])
    (d / names.MANIFEST).write_text(json.dumps(m))


def _garbage(f: Path) -> None:
    f.write_bytes(b"\x00" * 64)


def _truncated(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _nan_norm(f: Path) -> None:
    from safetensors.torch import load_file, save_file

    t = load_file(str(f))
    t["model.layers.0.input_layernorm.weight"][3] = float("nan")
    save_file(t, str(f), metadata={"format": "pt"})


@pytest.mark.parametrize("rel,edit,match", [
    (names.MODEL_WEIGHTS, _garbage, "its model.safetensors cannot be read"),
    (names.MODEL_WEIGHTS, _truncated, "its model.safetensors cannot be read"),
    (names.MODEL_WEIGHTS, _nan_norm, "NaN or infinite values in model.layers.0.input_layernorm.weight"),
    (names.PACKED_INDEX, lambda f: f.write_text("{not json"), "its packed.json cannot be read"),
    (names.PACKED_INDEX, lambda f: f.write_text('{"layout": "qerl-nvfp4-tile16x64-v2", "linears": 3}'),
     "not a packed index"),
    (names.MODEL_CONFIG, lambda f: f.write_text("[1, 2"), "its config.json cannot be read"),
])
def test_a_pack_damaged_under_a_rehashed_manifest_is_one_sentence(tiny_pipeline, tmp_path, rel, edit, match):
    """Files of a pack edited and the manifest re-hashed over them: verify and rollout raised safetensors' or
    json's exception (a traceback), and a NaN norm scale made rollout crash in torch.multinomial."""
    from qerl_cli import artifact
    from qerl_cli.packed_model import load_packed_model
    from qerl_cli.verify import verify

    run = tmp_path / "run"
    for k in ("quant", "packed"):
        shutil.copytree(tiny_pipeline[k], run / k)
    p = run / "packed"
    edit(p / rel)
    _rehash(p)
    with pytest.raises(QerlError, match=match):
        load_packed_model(artifact.open_artifact(p, names.KIND_PACKED))
    with pytest.raises(QerlError, match=match):
        verify(p, run / "verify", progress=False, device="cpu")
    assert not (run / "verify").exists()


def test_small_input_mistakes_are_named_as_they_are(tmp_path, tiny_pipeline):
    """A prompts/data path that is a directory was 'does not exist'; integer LoRA factors were cast and used;
    a config error ended without a period or a hint of what to do."""
    import torch
    from safetensors.torch import save_file

    from conftest import random_adapter
    from qerl_cli import adapter, artifact, config, data, rollout
    from qerl_cli.packed_model import load_packed_model

    with pytest.raises(QerlError, match="is a directory"):
        data.load_records(str(tmp_path))
    # (review, session 34) an empty spec was "data file . is a directory"; JSON rows in a file without a suffix
    # were read as plain text, and then lacked every field ("fields: ['text']")
    with pytest.raises(QerlError, match="the data spec is empty"):
        data.load_records("")
    (tmp_path / "rows").write_text('{"question": "What is 1 + 1?", "answer": "2"}\n')
    with pytest.raises(QerlError, match="rows is read as plain text .* but it holds JSON: name it .jsonl or .json"):
        data.load_records(str(tmp_path / "rows"))
    (tmp_path / "notes").write_text("plain text\n\nmore text\n")  # (text without a suffix reads as before)
    assert [r["text"] for r in data.load_records(str(tmp_path / "notes")).rows] == ["plain text", "more text\n"]
    (tmp_path / "toc.md").write_text("[TOC]\n\n# Title\n")  # (a bracket that is no JSON: plain text)
    assert len(data.load_records(str(tmp_path / "toc.md")).rows) == 2
    (tmp_path / "rows.md").write_text('[{"text": "a"}]')
    with pytest.raises(QerlError, match="rows.md is read as plain text .* but it holds JSON"):
        data.load_records(str(tmp_path / "rows.md"))
    # an output under a file was "File exists (…/afile)."; evaluate of a calib said a 'packed' artifact was needed
    (tmp_path / "afile").write_text("x")
    with pytest.raises(QerlError, match=r"the output .*afile/sub cannot be made: .*afile is a file, not a folder"):
        artifact.run_stage("eval", tmp_path / "afile" / "sub", {}, [], lambda tmp: {})
    with pytest.raises(QerlError, match=r"afile/sub/out cannot be made: \S*afile is a file, not a folder"):
        artifact.run_stage("eval", tmp_path / "afile" / "sub" / "out", {}, [], lambda tmp: {})
    from qerl_cli import evaluate

    # a model folder without tokenizer files: transformers' message was cut to "…from one of."; a pack moved
    # away from its quant: "…/quant does not exist."
    md = tmp_path / "no-tok"
    md.mkdir()
    for f in tiny_pipeline["model"].iterdir():
        if not f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, md / f.name)
    with pytest.raises(QerlError, match="has no tokenizer files .*copy its tokenizer beside the weights"):
        modelio.load_tokenizer(modelio.resolve(str(md)))
    shutil.copytree(tiny_pipeline["packed"], tmp_path / "moved" / "packed")
    from qerl_cli.verify import verify

    with pytest.raises(QerlError, match=r"records its quant input at .*quant, which does not exist .*--against"):
        verify(tmp_path / "moved" / "packed", tmp_path / "moved" / "verify", progress=False, device="cpu")
    calib = artifact.run_stage("calib", tmp_path / "calib", {}, [], lambda tmp: {})
    with pytest.raises(QerlError, match="is a 'calib' artifact; evaluate takes a 'packed' or 'quant' artifact"):
        evaluate.evaluate(calib.path, "arith:2", tmp_path / "ev", progress=False)
    a = random_adapter(tmp_path / "ad")
    from safetensors.torch import load_file

    t = {k: (v * 10).to(torch.int32) for k, v in load_file(str(a / names.ADAPTER_WEIGHTS)).items()}
    save_file(t, str(a / names.ADAPTER_WEIGHTS))
    model = load_packed_model(artifact.open_artifact(tiny_pipeline["packed"], names.KIND_PACKED))
    with pytest.raises(QerlError, match="LoRA factors are float16, bfloat16, float32 or float64"):
        adapter.load_lora(a, model)
    with pytest.raises(QerlError, match=r"top_p must be in \(0, 1\]; change that option or --config value\.$"):
        config.load("rollout", rollout.RolloutConfig, None, {"top_p": 1.5, "progress": False, "engine": "ours",
                                                             "device": "cpu"})


def test_nan_logits_mid_rollout_are_one_sentence_and_leave_the_old_output(tiny_pipeline, tmp_path):
    """An adapter with huge (finite, so accepted) factors overflows the activations to NaN logits: rollout crashed in
    torch.multinomial with a traceback. Now: one sentence, exit 1, the previous output untouched, no temporary left."""
    from conftest import random_adapter

    out = tmp_path / "ro"
    args = ("rollout", str(tiny_pipeline["packed"]), "--prompts", "arith:2", "-G", "2", "--max-new-tokens", "4",
            "--no-progress", "-o", str(out))
    assert run_cli(*args).returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    huge = random_adapter(tmp_path / "diverged", scale=1e20)
    _clean_error(run_cli(*args, "--adapter", str(huge), "--force"),
                 "the model's logits are not finite (NaN or Inf) at decode step 1 of 4")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["diverged", "ro"]
    # the HF reference path too (transformers' own sampling crashed in torch.multinomial)
    _clean_error(run_cli(*args, "--adapter", str(huge), "--force", "--engine", "hf"),
                 "the model's logits are not finite (NaN or Inf) at decode step 1 of 4")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_quant_linear_whose_k_is_not_a_multiple_of_16_is_one_sentence(tiny_pipeline, tmp_path):
    """A quant checkpoint edited under a re-hashed manifest so that a linear holds K = 40 inputs (weight_packed
    [N, 20], weight_scale [N, 2]: shapes that agree with each other): pack raised layout's ValueError."""
    from safetensors.torch import load_file, save_file

    from qerl_cli.pack import pack

    q = tmp_path / "quant"
    shutil.copytree(tiny_pipeline["quant"], q)
    f = q / names.MODEL_WEIGHTS
    t = load_file(str(f))
    n = "model.layers.0.self_attn.o_proj"
    t[f"{n}.{names.CT_PACKED}"] = t[f"{n}.{names.CT_PACKED}"][:, :20].contiguous()
    t[f"{n}.{names.CT_SCALE}"] = t[f"{n}.{names.CT_SCALE}"][:, :2].contiguous()
    save_file(t, str(f), metadata={"format": "pt"})
    _rehash(q)
    with pytest.raises(QerlError, match="40 inputs per row, not a positive multiple of 16"):
        pack(q, tmp_path / "packed", progress=False)
    assert not (tmp_path / "packed").exists()


def test_a_model_directory_whose_config_drops_layers_of_its_checkpoint_is_refused(tiny_pipeline, tmp_path):
    """A config.json describing fewer layers than its checkpoint holds: transformers ignored the extra weights (its
    warning silenced by qerl) and quantize went on with a truncated model. Weights the model does not use mean the
    config does not describe the checkpoint: one sentence, like missing ones."""
    import json

    m = tmp_path / "model"
    shutil.copytree(tiny_pipeline["model"], m)
    conf = json.loads((m / names.MODEL_CONFIG).read_text())
    conf["num_hidden_layers"] = 1
    (m / names.MODEL_CONFIG).write_text(json.dumps(conf))
    with pytest.raises(QerlError, match="holds the weight model.layers.1.* which the model's config.json does not"):
        modelio.load(modelio.resolve(str(m)))


def test_an_already_quantized_source_model_is_one_sentence(tiny_pipeline, tmp_path):
    """A compressed-tensors NVFP4 checkpoint (what llm-compressor or `qerl quantize` writes) given as the source
    model: with compressed-tensors installed transformers loaded it and modelio.load crashed with
    NotImplementedError ('isfinite' not implemented for 'Float8_e4m3fn')."""
    m = tmp_path / "ct"
    shutil.copytree(tiny_pipeline["quant"], m)
    for f in (names.MANIFEST, names.QUANT_REPORT):
        (m / f).unlink()
    out = tmp_path / "q2"
    _clean_error(run_cli("quantize", str(m), "--no-progress", "-o", str(out)), "is already quantized")
    assert not out.exists()


def test_a_gguf_symlink_as_in_the_hf_hub_cache_is_found(tmp_path):
    """The HF hub cache holds snapshots/<rev>/model.gguf as a symlink to ../../blobs/<hash>: resolve() took the
    link's target directory with the link's name, a file that does not exist (FileNotFoundError traceback in
    the model digest, and transformers was pointed at blobs/model.gguf)."""
    (tmp_path / "blobs").mkdir()
    (tmp_path / "snapshots" / "rev").mkdir(parents=True)
    (tmp_path / "blobs" / "0123abcd").write_bytes(b"GGUF" + bytes(60))
    link = tmp_path / "snapshots" / "rev" / "model.gguf"
    link.symlink_to(Path("..") / ".." / "blobs" / "0123abcd")
    s = modelio.resolve(str(link))
    assert (s.directory / s.gguf_file).is_file()
    plain = tmp_path / "model.gguf"
    plain.write_bytes(b"GGUF" + bytes(60))
    assert s.digest() == modelio.resolve(str(plain)).digest()


def test_a_model_directory_whose_config_mismatches_a_weight_shape_names_the_weight(tiny_pipeline, tmp_path):
    """A config.json whose intermediate_size disagrees with the checkpoint: the error was transformers' 'For details
    look at the above report!', a report qerl silences, so the user never learnt which weight or shapes."""
    import json

    m = tmp_path / "model"
    shutil.copytree(tiny_pipeline["model"], m)
    conf = json.loads((m / names.MODEL_CONFIG).read_text())
    conf["intermediate_size"] = 96
    (m / names.MODEL_CONFIG).write_text(json.dumps(conf))
    with pytest.raises(QerlError, match=r"model\.layers\.0\.mlp\.\w+_proj\.weight has shape \(\d+, \d+\) in the "
                                        r"checkpoint but \(\d+, \d+\) in its config\.json") as e:
        modelio.load(modelio.resolve(str(m)))
    assert "above report" not in str(e.value)


def test_an_artifact_of_a_model_type_this_transformers_lacks_is_one_sentence(tiny_pipeline, tmp_path):
    """Artifacts travel between machines with different transformers versions (DESIGN §6): a model_type the
    local transformers does not know raised AutoConfig's ValueError as a traceback from load_packed_model."""
    import json

    from qerl_cli import artifact
    from qerl_cli.packed_model import load_packed_model

    p = tmp_path / "packed"
    shutil.copytree(tiny_pipeline["packed"], p)
    conf = json.loads((p / names.MODEL_CONFIG).read_text())
    conf["model_type"] = "qerl_future_arch"
    (p / names.MODEL_CONFIG).write_text(json.dumps(conf))
    _rehash(p)
    with pytest.raises(QerlError, match="'qerl_future_arch'.*transformers"):
        load_packed_model(artifact.open_artifact(p, names.KIND_PACKED))


def test_a_quant_damaged_under_a_rehashed_manifest_is_one_sentence_in_pack_and_evaluate(tiny_pipeline, tmp_path):
    """(review, session 34) A quant whose down_proj codes were dropped, its scales kept, packed without complaint
    (the fp8 scales went into the pack as plain tensors) and verify / rollout then crashed in ``isfinite`` on
    float8; evaluate, which dequantizes the quant itself, raised torch's errors for a codes tensor of the wrong
    dtype or shape. Each is one sentence now."""
    import torch
    from safetensors.torch import load_file, save_file

    from qerl_cli import artifact
    from qerl_cli.pack import pack
    from qerl_cli.packed_model import load_dequantized_model, load_packed_model

    n = "model.layers.0.mlp.down_proj"
    cases = {
        "orphan": (lambda t: t.pop(f"{n}.{names.CT_PACKED}"), f"holds {n}.weight_(global_)?scale without the {n}.weight_packed"),
        "dtype": (lambda t: t.update({f"{n}.{names.CT_PACKED}": t[f"{n}.{names.CT_PACKED}"].float()}),
                  "must be a 2-D uint8 tensor"),
        "shape": (lambda t: t.update({f"{n}.{names.CT_SCALE}": t[f"{n}.{names.CT_SCALE}"][:, :1].contiguous()}),
                  "weight_scale must be float8_e4m3fn of shape"),
    }
    for name, (edit, match) in cases.items():
        q = tmp_path / name / "quant"
        shutil.copytree(tiny_pipeline["quant"], q)
        t = load_file(str(q / names.MODEL_WEIGHTS))
        edit(t)
        save_file(t, str(q / names.MODEL_WEIGHTS), metadata={"format": "pt"})
        _rehash(q)
        with pytest.raises(QerlError, match=match):
            pack(q, tmp_path / name / "packed", progress=False)
        assert not (tmp_path / name / "packed").exists()
        with pytest.raises(QerlError):  # (the orphan: tensors the model does not have, and down_proj's missing)
            load_dequantized_model(load_file(str(q / names.MODEL_WEIGHTS)), q)
    # a pack that holds a stray float8 tensor: one sentence, not isfinite's NotImplementedError
    p = tmp_path / "packed"
    shutil.copytree(tiny_pipeline["packed"], p)
    t = load_file(str(p / names.MODEL_WEIGHTS))
    t["model.layers.0.stray"] = torch.zeros(4).to(torch.float8_e4m3fn)
    save_file(t, str(p / names.MODEL_WEIGHTS), metadata={"format": "pt"})
    _rehash(p)
    with pytest.raises(QerlError, match="holds tensors the model does not have, e.g. model.layers.0.stray"):
        load_packed_model(artifact.open_artifact(p, names.KIND_PACKED))


def test_a_misspelt_quantize_target_and_a_huge_generated_task_are_refused(tiny_pipeline, tmp_path):
    """(review, session 34) A quantize config target naming no Linear (``down_porj``) left those layers dense,
    silently; ``arith:99999999999999`` held every problem in memory until the host killed the process."""
    import torch

    from qerl_cli import tasks
    from qerl_cli.quantize import quantize, quantized_linears

    cfg = tmp_path / "q.toml"
    cfg.write_text('targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_porj"]\n')
    with pytest.raises(QerlError, match=r"targets \['down_porj'\] name no Linear layer of the model"):
        quantize(str(tiny_pipeline["model"]), tmp_path / "quant", config_file=cfg, progress=False)
    # the usual projection names a model of another family lacks (Phi's qkv_proj) are no mistake: the rest is quantized
    phi = torch.nn.Module()
    phi.qkv_proj, phi.o_proj = torch.nn.Linear(16, 48), torch.nn.Linear(16, 16)
    assert [n for n, _ in quantized_linears(phi, ("q_proj", "k_proj", "v_proj", "o_proj"))] == ["o_proj"]
    assert not (tmp_path / "quant").exists()
    with pytest.raises(QerlError, match="the generated task holds at most 1,000,000 problems"):
        tasks.load_problems("arith:99999999999999")
    assert len(tasks.load_problems(f"arith:{tasks.MAX_GENERATED}", n=3)) == 3
    r = run_cli("rollout", str(tiny_pipeline["packed"]), "--prompts", "arith:99999999999999", "-o",
                str(tmp_path / "r"))
    _clean_error(r, "at most 1,000,000 problems")
