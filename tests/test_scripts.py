"""The repository's shell scripts parse (``bash -n``): a device session script with a broken case block fails only
when its call has already cost device time."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted({p for p in ROOT.glob("**/*.sh") if ".venv" not in p.parts and "node_modules" not in p.parts}
                 | {ROOT / ".ci" / "run"})


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_shell_script_parses(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_gpu_session_parts_are_unique():
    """Every part of benchmarks/gpu_session.sh is one case label (a duplicate one would never run)."""
    lines = (ROOT / "benchmarks" / "gpu_session.sh").read_text().splitlines()
    labels = [ln[:-1] for ln in lines if ln[:1].isdigit() and ln.endswith(")") and ln[:-1].isdigit()]
    assert len(labels) > 10 and len(labels) == len(set(labels)), labels


def test_bench_kernel_refuses_unknown_tiled_configuration():
    """A tile number the kernels do not have is one sentence and exit 2, before any device is asked for."""
    import sys

    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_kernel.py"), "--tiled-cfgs", "4,9"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--tiled-cfgs takes configurations 1-7, got '4,9'" in r.stderr, r.stderr


def test_main_job_makefile_remakes_what_a_changed_setting_touches(tmp_path):
    """examples/smollm2 (make demo): a rerun does nothing; a changed setting remakes its stage and those after it
    with --force (they were "Nothing to be done", and a forced remake would have been refused); an interrupted
    train run is resumed (it failed with "holds an unfinished run")."""
    fake = tmp_path / "qerl"
    log = tmp_path / "calls"
    fake.write_text(f"""#!/usr/bin/env bash
o=""; prev=""
for a in "$@"; do [ "$prev" = "-o" ] && o="$a"; prev="$a"; done
echo "$1 $(basename "$o") $*" >> {log}
mkdir -p "$o" && touch "$o/manifest.json"
[ "$1" != train ] || touch "$o/train_config.json"
""")
    fake.chmod(0o755)

    def make(*settings: str) -> list[str]:
        log.write_text("")
        subprocess.run(["make", "-s", "-C", str(ROOT / "examples" / "smollm2"), f"QERL={fake}",
                        f"OUT={tmp_path / 'out'}", *settings], check=True, capture_output=True, text=True)
        return log.read_text().splitlines()

    first = make()
    assert [c.split()[0] for c in first] == ["calibrate", "quantize", "pack", "verify", "train", "evaluate"]
    assert first[4].endswith("--force") and "--steps 2" in first[4]  # (a fresh run: nothing to resume)
    assert make() == []
    assert [c.split()[0] for c in make("SAMPLES=64")] == ["calibrate", "quantize", "pack", "verify", "train",
                                                          "evaluate"]
    assert all(c.endswith("--force") for c in make("SAMPLES=64", "STEPS=3"))
    (tmp_path / "out" / "run" / "manifest.json").unlink()  # an interrupted run
    again = make("SAMPLES=64", "STEPS=3")
    assert [c.split()[0] for c in again] == ["train", "evaluate"] and again[0].endswith("--resume")
    assert make("SAMPLES=64", "STEPS=3") == []
    # interrupted, then other settings: the unfinished run is of the old ones, so it is replaced, not resumed
    import time

    time.sleep(1.1)  # (file times of one second)
    (tmp_path / "out" / "run" / "manifest.json").unlink()
    changed = make("SAMPLES=64", "STEPS=4")
    assert changed[0].split()[0] == "train" and "--steps 4" in changed[0] and changed[0].endswith("--force")


def _load_bench(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ab_kernel_other_build_has_this_builds_flags(monkeypatch, tmp_path):
    """ab_kernel.py --other builds the other source with exactly this build's nvcc flags (it had -O3 and sm_90a only:
    no -DQERL_HAS_SM90A, so the other side never ran the wgmma tiles, and no QERL_KERNEL_ARCH_FLAGS), so that an
    A/B measures the sources alone."""
    import shutil
    import sys

    import torch
    import torch.utils.cpp_extension as ce

    from qerl_cli import kernel

    other = tmp_path / "old"
    other.mkdir()
    for f in (ROOT / "csrc").iterdir():
        if f.suffix in (".cu", ".cuh"):
            shutil.copy(f, other)

    class Built(Exception):
        pass

    calls = []

    def fake_load(**kw):
        calls.append(kw)
        raise Built

    for var in ("QERL_KERNEL_ARCH_FLAGS", "QERL_DISABLE_KERNEL", "QERL_CSRC", "QERL_KERNEL_TIMELINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(ce, "load", fake_load)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(kernel, "available", lambda: True)
    monkeypatch.setattr(kernel, "_load", lambda: object())
    ab = _load_bench("ab_kernel")
    monkeypatch.setattr(sys, "argv", ["ab_kernel.py", "--other", str(other)])
    with pytest.raises(Built):
        ab.main()
    with pytest.raises(Built):
        kernel.build_extension("qerl_nvfp4", "nvfp4_kernel.cu")
    assert calls[0]["sources"] == [str(other / "nvfp4_kernel.cu")]
    assert calls[0]["extra_cuda_cflags"] == calls[1]["extra_cuda_cflags"]
    assert calls[0]["extra_cflags"] == calls[1]["extra_cflags"]


def test_bench_rollout_hf_warmup_is_the_measured_call(monkeypatch):
    """HF generate is warmed up on exactly the measured shapes, as our engine is (it was warmed on 2 rows and 4 new
    tokens, leaving the first call's plan selection at the measured shapes inside its timed call)."""
    import torch

    br = _load_bench("bench_rollout")
    for f in ("synchronize", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, f, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 0)
    calls = []

    class Fake:
        def generate(self, ids, **kw):
            calls.append((tuple(ids.shape), kw))
            return torch.zeros(ids.shape[0], ids.shape[1] + kw["max_new_tokens"], dtype=torch.long)

    r = br.time_hf(Fake(), 3, 5, 7, 1000, device="cpu")
    assert len(calls) == 2 and calls[0] == calls[1], calls
    assert calls[1][0] == (3, 5) and calls[1][1]["min_new_tokens"] == 7 and r["tokens"] == 3 * 7


def _tiny(conf):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=512)
    c = (LlamaConfig if conf.model_type == "llama" else Qwen2Config)(**small)
    m = AutoModelForCausalLM.from_config(c).eval()
    m._bench_probe = conf.model_type  # (copied by a deepcopy)
    return m


def test_bench_rollout_rows_one_model_resident_and_hf_on_both_models(monkeypatch, tmp_path):
    """Every throughput row of bench_rollout's default run is measured with only its own model alive (SmolLM2's
    NVFP4 and bf16 rows ran with both models resident, so each row's peak memory held the other's weights too),
    and HF generate (bf16) is measured on both models (it was missing for the 7B shapes)."""
    import gc
    import sys

    import torch

    from qerl_cli.packed_model import PackedLinear

    br = _load_bench("bench_rollout")
    seen = []

    def record(model, batch, engine):
        del model
        gc.collect()
        alive = [o for o in gc.get_objects() if isinstance(o, torch.nn.Module) and hasattr(o, "_bench_probe")]
        seen.append((alive[0]._bench_probe if alive else None, engine, batch, len(alive),
                     any(isinstance(m, PackedLinear) for m in alive[0].modules()) if alive else None))
        del alive

    def fake_engine(model, batch, p_len, new, vocab, **kw):
        record(model, batch, "engine")
        return {"tokens": 1, "wall_s": 1.0, "tokens_per_s": 1.0, "prefill_s": 0.1, "decode_s": 0.9,
                "decode_state": "new", "decode_setup_s": 0.0, "peak_alloc_gib": 0.0}

    def fake_hf(model, batch, p_len, new, vocab, **kw):
        record(model, batch, "hf")
        return {"tokens": 1, "wall_s": 1.0, "tokens_per_s": 1.0, "peak_alloc_gib": 0.0}

    monkeypatch.setattr(br, "random_model", _tiny)
    monkeypatch.setattr(br, "time_engine", fake_engine)
    monkeypatch.setattr(br, "time_hf", fake_hf)
    monkeypatch.setattr(br, "correctness", lambda *a, **k: {})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake")
    monkeypatch.setattr(sys, "argv", ["bench_rollout.py", "--json", str(tmp_path / "r.json")])
    br.main()
    assert seen and all(n == 1 for _, _, _, n, _ in seen), seen
    hf = {(m, b) for m, e, b, _, _ in seen if e == "hf"}
    assert hf == {("llama", 64), ("llama", 256), ("qwen2", 8), ("qwen2", 64)}, seen
    assert not any(packed for _, e, _, _, packed in seen if e == "hf")


def test_bench_rollout_table_shows_no_prefill_split_for_hf(monkeypatch, capsys):
    """HF generate's rows time the whole call: the table showed a prefill of 0.000 s and the whole wall time as
    "decode s" (the JSON has neither)."""
    monkeypatch.setenv("COLUMNS", "250")
    br = _load_bench("bench_rollout")
    br.print_table({"device": "fake"}, [{"model": "SmolLM2-135M", "engine": "hf-generate-bf16", "batch": 64,
                                         "tokens": 16384, "wall_s": 12.345, "tokens_per_s": 1327.2,
                                         "peak_alloc_gib": 1.2}])
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "hf-generate-bf16" in ln)
    assert "0.000" not in line and "12.345" not in line, line


def test_bench_rollout_profiles_the_smollm2_step_of_each_engine(monkeypatch, tmp_path):
    """--profile also profiles SmolLM2's decode step at batch 256 over its 256 new tokens (session 31: 2.5 ms bf16
    against HF's 14.7, short of the 10x target), the bf16 model before it is packed and the NVFP4 one after, with
    programmatic dependent launch off (session 33) and restored after; the NVFP4 one also with attention over slot
    buckets; a profile that fails is recorded as its error and the throughput rows are kept. At batch 256 each
    engine's arm alternates the default with attention over slot buckets, the bf16 one both also with a capture
    per call, the NVFP4 one with one dequantize launch per projection, interleaved three times."""
    import json
    import sys

    import torch

    from qerl_cli import kernel
    from qerl_cli.packed_model import PackedLinear

    br = _load_bench("bench_rollout")
    profiled, timed, pdl = [], [], {"on": True}

    def fake_profile(model, batch, p_len, vocab, **kw):
        profiled.append((model.config.model_type, batch, any(isinstance(m, PackedLinear) for m in model.modules()),
                         kw.get("new"), kw.get("attend_buckets"), pdl["on"]))
        if len(profiled) == 2:
            raise RuntimeError("profiler broke")
        return {"batch": batch}

    def fake_time(model, batch, *a, dequant_layer=None, attend_buckets=None, keep_graph=True, **k):
        timed.append((batch, any(isinstance(m, PackedLinear) for m in model.modules()), dequant_layer, attend_buckets)
                     + (() if keep_graph else ("capture",)))
        return row | {"prefill_s": 0.1, "decode_s": 0.9, "decode_state": "new", "decode_setup_s": 0.0}

    row = {"tokens": 1, "wall_s": 1.0, "tokens_per_s": 1.0, "peak_alloc_gib": 0.0}
    monkeypatch.setattr(br, "random_model", _tiny)
    monkeypatch.setattr(br, "time_engine", fake_time)
    monkeypatch.setattr(br, "time_hf", lambda *a, **k: dict(row))
    monkeypatch.setattr(br, "correctness", lambda *a, **k: {})
    monkeypatch.setattr(br, "profile_decode", fake_profile)
    monkeypatch.setattr(kernel, "set_pdl", lambda on: pdl.update(on=on))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake")
    monkeypatch.setattr(sys, "argv", ["bench_rollout.py", "--profile", "--skip-7b", "--json", str(tmp_path / "r.json")])
    br.main()
    assert profiled == [("llama", 256, False, 256, None, False), ("llama", 256, True, 256, None, False),
                        ("llama", 256, True, 256, True, False)] and pdl["on"]
    bf16_arm = [(256, False, None, None), (256, False, None, True), (256, False, None, None, "capture"),
                (256, False, None, True, "capture")]
    nvfp4_arm = [(256, True, None, None), (256, True, None, True), (256, True, False, None)]
    assert timed == ([(64, False, None, None), (256, False, None, None)] + bf16_arm * 3
                     + [(64, True, None, None), (256, True, None, None)] + nvfp4_arm * 3)
    out = json.loads((tmp_path / "r.json").read_text())
    assert out["smollm2_bf16_decode_profile_b256_nopdl"] == {"batch": 256}
    assert out["smollm2_nvfp4_decode_profile_b256_nopdl_attend_buckets"] == {"batch": 256}
    assert "profiler broke" in out["smollm2_nvfp4_decode_profile_b256_nopdl"]["error"] and len(out["runs"]) == 27
    assert [r["engine"] for r in out["runs"][-3:]] == ["ours-nvfp4", "ours-nvfp4 attend-buckets",
                                                       "ours-nvfp4 per-projection-dequant"]
