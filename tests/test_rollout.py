"""rollout: the stage and its CLI (artifact contents, cache, bad inputs), tasks and answer checking."""

from __future__ import annotations

import json
import shutil
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import SHARED_DATA, random_adapter, run_cli
from qerl_cli import artifact, names, packed_model, rollout, tasks
from qerl_cli.adapter import tensors_digest
from qerl_cli.engine import Engine, derive_seed
from qerl_cli.errors import QerlError


@pytest.fixture(scope="module")
def pipeline(tiny_pipeline):
    """The session's tiny quant/pack/verify artifacts (shared, read-only), addressed by their parent dir."""
    root = tiny_pipeline["packed"].parent
    assert tiny_pipeline["quant"].parent == root and tiny_pipeline["verify"].parent == root
    return root


def test_rollout_artifact(pipeline, tmp_path):
    art = rollout.rollout(pipeline / "packed", "arith:3", tmp_path / "ro", group=2, max_new_tokens=8, sigma=0.01,
                          seed=4, progress=False)
    assert sorted(f["path"] for f in art.manifest["files"]) == sorted(
        [names.ROLLOUT_TENSORS, names.ROLLOUT_SAMPLES, names.ROLLOUT_META])
    t = load_file(str(art.file(names.ROLLOUT_TENSORS)))
    assert t["completion_ids"].shape == (6, 8) and t["behaviour_logprobs"].shape == (6, 8)
    assert t["prompt_ids"].shape[0] == 3 and t["rewards"].shape == (6,)
    assert t["row_prompt"].tolist() == [0, 0, 1, 1, 2, 2]
    assert (t["behaviour_logprobs"][t["completion_mask"]] < 0).all()
    meta = json.loads(art.file(names.ROLLOUT_META).read_text())
    assert meta["noise"][0]["sigma"] == 0.01 and meta["noise"][0]["scope"] == "batch"
    assert "truncated" in meta["logprobs"] and meta["policy"]["weights"] == "nvfp4-packed"
    assert meta["policy"]["verify"] == artifact.open_artifact(pipeline / "verify", names.KIND_VERIFY).digest
    assert meta["policy"]["sampler"].startswith("torch.multinomial")  # (CPU: the fused sampler is CUDA's)
    assert meta["policy"]["decode_attention"] == "SDPA"  # (CPU: the decode-attention kernel is CUDA's)
    assert meta["policy"]["nvfp4_kernel"] == {"available": False, "variant": "auto"}  # (CPU: the torch reference)
    assert meta["summary"]["decode_states_kept"] == 0 and meta["summary"]["decode_setup_s"] >= 0  # (one batch)
    rows = [json.loads(line) for line in art.file(names.ROLLOUT_SAMPLES).read_text().splitlines()]
    assert len(rows) == 6 and {r["status"] for r in rows} <= {"correct", "wrong", "unparsable", "truncated"}
    assert [r["prompt"] for r in rows] == [0, 0, 1, 1, 2, 2]
    sm = meta["summary"]
    assert sm["prefill_s"] > 0 and sm["decode_s"] > 0 and sm["decode_s_includes_prefill"] is False
    # (review, session 26) length_fraction counts every sample that hit the limit; truncated_fraction, with rewards,
    # those cut off without a complete marked answer (the two had shared one key, the second overwriting the first)
    assert sm["length_fraction"] == sum(r["finish_reason"] == "length" for r in rows) / 6
    assert sm["truncated_fraction"] == sum(r["status"] == "truncated" for r in rows) / 6
    # same call again: cached, identical, and no model is loaded for it (review, session 26: a hit loaded the
    # whole model first, minutes for a 7B one)
    from qerl_cli import packed_model

    def no_load(*a, **k):
        raise AssertionError("a cache hit loaded the model")

    real = packed_model.load_packed_model
    packed_model.load_packed_model = no_load
    try:
        again = rollout.rollout(pipeline / "packed", "arith:3", tmp_path / "ro", group=2, max_new_tokens=8,
                                sigma=0.01, seed=4, progress=False)
    finally:
        packed_model.load_packed_model = real
    assert again.digest == art.digest


def test_rollout_reproducible_and_noise_changes_it(pipeline, tmp_path):
    kw = dict(group=2, max_new_tokens=6, seed=1, progress=False)
    a = rollout.rollout(pipeline / "packed", "arith:2", tmp_path / "a", sigma=0.05, **kw)
    b = rollout.rollout(pipeline / "packed", "arith:2", tmp_path / "b", sigma=0.05, force=True, **kw)
    c = rollout.rollout(pipeline / "packed", "arith:2", tmp_path / "c", sigma=0.0, **kw)
    ta, tb, tc = (load_file(str(x.file(names.ROLLOUT_TENSORS))) for x in (a, b, c))
    assert torch.equal(ta["completion_ids"], tb["completion_ids"])
    assert torch.equal(ta["behaviour_logprobs"], tb["behaviour_logprobs"])
    assert not torch.equal(ta["behaviour_logprobs"], tc["behaviour_logprobs"])


def test_adapter_is_applied_and_recorded(pipeline, tmp_path):
    g = torch.Generator().manual_seed(0)
    ad = tmp_path / "adapter"
    ad.mkdir()
    (ad / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "peft_type": "LORA"}))
    name = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{name}.lora_A.weight": torch.randn(4, 64, generator=g),
               f"{name}.lora_B.weight": torch.randn(64, 4, generator=g)}, str(ad / "adapter_model.safetensors"))
    kw = dict(group=1, max_new_tokens=6, seed=0, temperature=1.0, progress=False)
    a = rollout.rollout(pipeline / "packed", "arith:2", tmp_path / "with", adapter=ad, **kw)
    b = rollout.rollout(pipeline / "packed", "arith:2", tmp_path / "without", **kw)
    meta = json.loads(a.file(names.ROLLOUT_META).read_text())
    assert meta["policy"]["adapter_digest"] == artifact.sha256_json(
        {"weights": tensors_digest(load_file(str(ad / "adapter_model.safetensors"))),
         "scalings": {"model.layers.0.self_attn.q_proj": 2.0}, "coordinates": "source"})
    assert any(i["kind"] == "adapter" for i in a.inputs)
    ta, tb = (load_file(str(x.file(names.ROLLOUT_TENSORS))) for x in (a, b))
    assert not torch.equal(ta["behaviour_logprobs"], tb["behaviour_logprobs"])
    # the same weights with another lora_alpha are another policy: not the cached rollout (the stage refuses to
    # replace it unasked), another digest
    (ad / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 64, "peft_type": "LORA"}))
    with pytest.raises(QerlError, match="already holds"):
        rollout.rollout(pipeline / "packed", "arith:2", tmp_path / "with", adapter=ad, **kw)
    c = rollout.rollout(pipeline / "packed", "arith:2", tmp_path / "with", adapter=ad, force=True, **kw)
    meta_c = json.loads(c.file(names.ROLLOUT_META).read_text())
    assert meta_c["policy"]["adapter_digest"] != meta["policy"]["adapter_digest"]
    tc = load_file(str(c.file(names.ROLLOUT_TENSORS)))
    assert not torch.equal(tc["behaviour_logprobs"], ta["behaviour_logprobs"])


def _cli_fails(*args, match: str, out=None):
    r = run_cli("rollout", *args, "--no-progress")
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.startswith("error:") and "Traceback" not in r.stderr
    assert match in " ".join(r.stderr.split()), r.stderr
    if out is not None:
        assert not out.exists()


def test_rollout_bad_inputs(pipeline, tmp_path):
    out = tmp_path / "ro"
    unverified = tmp_path / "p2"
    shutil.copytree(pipeline / "packed", unverified)
    _cli_fails(str(unverified), "--prompts", "arith:2", "-o", str(out), match="has not been verified", out=out)
    _cli_fails(str(tmp_path / "missing"), "--prompts", "arith:2", "-o", str(out), match="does not exist", out=out)
    _cli_fails(str(pipeline / "packed"), "--prompts", "arith:2", "-G", "0", "-o", str(out), match="group", out=out)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    _cli_fails(str(pipeline / "packed"), "--prompts", str(empty), "-o", str(out), match="empty.jsonl holds no problems.", out=out)
    for eng in ("ours", "hf"):  # (hf generate ran past the model's positions without a word)
        _cli_fails(str(pipeline / "packed"), "--prompts", "arith:2", "--max-new-tokens", "100000", "--engine", eng,
                   "-o", str(out), match="max_position_embeddings", out=out)
    ad = tmp_path / "adapter"
    ad.mkdir()
    (ad / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4}))
    name = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{name}.lora_A.weight": torch.zeros(2, 576), f"{name}.lora_B.weight": torch.zeros(576, 2)},
              str(ad / "adapter_model.safetensors"))
    _cli_fails(str(pipeline / "packed"), "--prompts", "arith:2", "--adapter", str(ad), "-o", str(out),
               match="another model", out=out)
    _cli_fails(str(pipeline / "quant"), "--prompts", "arith:2", "-o", str(out), match="'quant' artifact", out=out)


def test_failed_verify_blocks_rollout(pipeline, tmp_path):
    """A verify artifact of this pack whose report failed blocks sampling, also after a hand edit of its
    manifest's metrics to "passed" (the verdict is read from the hashed report)."""
    packed = artifact.open_artifact(pipeline / "packed", names.KIND_PACKED)
    v = tmp_path / "verify"

    def body(tmp):
        (tmp / names.VERIFY_REPORT).write_text(json.dumps({"passed": False}))
        return {"passed": False}

    artifact.run_stage(names.KIND_VERIFY, v, {}, [packed.as_input(v)], body)
    for edit in (False, True):
        if edit:
            m = json.loads((v / names.MANIFEST).read_text())
            m["metrics"]["passed"] = True
            (v / names.MANIFEST).write_text(json.dumps(m))
        with pytest.raises(QerlError, match="failed verification"):
            rollout.rollout(pipeline / "packed", "arith:1", tmp_path / "ro", verify_dir=v, progress=False)


def test_kernel_runs_need_a_verify_of_the_kernel(pipeline, tmp_path, monkeypatch):
    """A verify made on CPU checked the torch reference, not the CUDA kernel: it does not authorise a run that
    uses the kernel, nor does a kernel verify made under other kernel switches (the engine's own may differ)."""
    from qerl_cli import verify as qverify

    packed = artifact.open_artifact(pipeline / "packed", names.KIND_PACKED)
    assert rollout.require_verified(packed, pipeline / "verify", "cpu")  # CPU runs: the CPU verify is enough
    monkeypatch.setattr(qverify, "backend_name", lambda device: "cuda-kernel")  # (a run on a GPU)
    with pytest.raises(QerlError, match="torch-reference, not the CUDA kernel"):
        rollout.require_verified(packed, pipeline / "verify", "cuda")
    v = tmp_path / "verify"

    def body(tmp):
        (tmp / names.VERIFY_REPORT).write_text(json.dumps({"passed": True, "backend": "cuda-kernel"}))
        return {"passed": True}

    from qerl_cli import kernel

    build = {"sources": "0123", "arch_flags": ["-gencode=arch=compute_90a,code=sm_90a"],
             "gpu": {"capability": "9.0", "sms": 132}}
    monkeypatch.setattr(kernel, "build_identity", lambda device=None: build)
    artifact.run_stage(names.KIND_VERIFY, v, {"backend": "cuda-kernel", "kernel_build": build},
                       [packed.as_input(v)], body)
    # a verify of the kernel does not need to ask whether the kernel builds (a cache hit builds nothing)
    monkeypatch.setattr(qverify, "backend_name", lambda device: pytest.fail("asked for the kernel"))
    assert rollout.require_verified(packed, v, "cuda")
    monkeypatch.setenv("QERL_ENGINE_FUSED_SAMPLER", "0")
    assert rollout.require_verified(packed, v, "cuda")
    # (session 28) a verify of another build: changed kernel sources, or another GPU (its grids differ)
    for other in ({**build, "sources": "4567"}, {**build, "gpu": {"capability": "9.0", "sms": 114}}):
        monkeypatch.setattr(kernel, "build_identity", lambda device=None: other)
        with pytest.raises(QerlError, match="verified another build of the CUDA kernel"):
            rollout.require_verified(packed, v, "cuda")
    monkeypatch.setattr(kernel, "build_identity", lambda device=None: build)
    monkeypatch.setenv("QERL_KERNEL_VARIANT", "v2")
    with pytest.raises(QerlError, match="other kernel switches"):
        rollout.require_verified(packed, v, "cuda")


def test_the_kernel_build_identity_follows_every_cuda_source(tmp_path, monkeypatch):
    """Editing any csrc/*.cu or *.cuh changes the identity a verify of the kernel records (and so its key)."""
    from qerl_cli import kernel

    csrc = shutil.copytree(Path(kernel.__file__).resolve().parents[2] / "csrc", tmp_path / "csrc")
    monkeypatch.setenv("QERL_CSRC", str(csrc))
    first = kernel.build_identity()
    assert first["sources"] and first["arch_flags"]
    for name in ("pdl.cuh", "fused_ops.cu"):
        (csrc / name).write_text((csrc / name).read_text() + "\n// edited\n")
        now = kernel.build_identity()
        assert now["sources"] != first["sources"]
        first = now


def test_the_kernel_build_identity_describes_the_runs_gpu(monkeypatch):
    """The GPU a verify or a run records is the one it runs on ("cuda:1"), not whichever device is current; a
    device without an index ("cuda") is the current one."""
    from types import SimpleNamespace

    from qerl_cli import kernel

    props = {0: SimpleNamespace(major=9, minor=0, multi_processor_count=132),
             1: SimpleNamespace(major=8, minor=0, multi_processor_count=108)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    assert kernel.build_identity("cuda:1")["gpu"] == {"capability": "8.0", "sms": 108}
    assert kernel.build_identity(torch.device("cuda", 1))["gpu"] == {"capability": "8.0", "sms": 108}
    assert kernel.build_identity("cuda")["gpu"] == kernel.build_identity()["gpu"] == {"capability": "9.0", "sms": 132}


@pytest.mark.parametrize("text,expected", [
    ("The total is $1,080.00", "1080"), ("so the answer is\n#### 72", "72"),
    (r"we get \boxed{\frac{1}{2}}", "1/2"), ("It weighs 12 kg in total.", "12"), ("I do not know", None),
    ("#### -3.50", "-7/2"), ("so 9-2 = 7, and 7-2", "2"), (r"\boxed{x = 5}", "5"), ("the change is -4", "-4"),
    ("x=-5", "-5"), ("a loss of (-12)", "-12"), ("#### 1,000", "1000"), ("So 12 - 5", "5"),
])
def test_answer_extraction(text, expected):
    got = tasks.extract_answer(text)
    if expected is None:
        assert got is None
    else:
        assert tasks.parse_number(got) == tasks.parse_number(expected)


@pytest.mark.parametrize("completion,gold", [
    (r"so she pays \boxed{\$18}", "18"), (r"\boxed{1{,}080}", "1,080"), (r"\boxed{\$1,080.00}", "1080"),
    (r"\boxed{-\frac{1}{2}}", "-1/2"), (r"\boxed{-\dfrac{3}{4}}", "-0.75"), (r"\boxed{18\%}", "18"),
    (r"\boxed{18 \text{ apples}}", "18"), (r"\boxed{\text{18}}", "18"), (r"\boxed{10\,000}", "10000"),
    (r"\boxed{10,\!000}", "10,000"), (r"\boxed{\textbf{42}}", "42"), (r"\boxed{5 \text{dollars}}", "5"),
])
def test_boxed_latex_answers_match_without_math_verify(completion, gold, monkeypatch):
    """(review-b) the built-in checker (math-verify is optional) read a correct LaTeX answer as wrong: an escaped
    dollar, a {,} or \\! thousands separator, a signed \\frac, a percent sign or a \\text{} unit."""
    monkeypatch.setattr(tasks, "_math_verify", lambda: None)
    o = tasks.score(completion, gold, truncated=False)
    assert o.status == tasks.CORRECT, (completion, o)
    assert tasks.score(completion, "19", truncated=False).status == tasks.WRONG


def test_scoring_statuses():
    assert tasks.score("3 + 4 = 7. #### 7", "7", truncated=False).status == tasks.CORRECT
    assert tasks.score("#### 8", "7", truncated=False).status == tasks.WRONG
    assert tasks.score("no idea", "7", truncated=False).status == tasks.UNPARSABLE
    assert tasks.score("first 3 then", "7", truncated=True).status == tasks.TRUNCATED
    assert tasks.score("#### 7 and more", "7", truncated=True).status == tasks.CORRECT
    assert tasks.score("#### 7", "7", False, format_reward=0.1).reward == pytest.approx(1.1)
    # (review, session 26) a #### answer that runs to the token limit may be cut mid-number ("1" of "11"); a
    # closed \boxed{} or anything after the number completes it; an empty \boxed{} is no answer and no bonus
    for cut in ("so\n#### 1", "#### 1.", "#### 1,", "#### 1 ", "#### 3 /", "#### $"):
        assert tasks.score(cut, "11", truncated=True, format_reward=0.1).status == tasks.TRUNCATED, cut
    assert tasks.score("#### 1", "1", truncated=False).status == tasks.CORRECT  # finished by eos: complete
    assert tasks.score("#### 11\n", "11", truncated=True).status == tasks.CORRECT
    assert tasks.score("#### 11 and so", "11", truncated=True).status == tasks.CORRECT
    assert tasks.score(r"\boxed{11}", "11", truncated=True).status == tasks.CORRECT
    # (session 32) the last marked answer, a \boxed{ at the cut, is incomplete: the #### 2 before it is not final
    assert tasks.score(r"#### 2 \boxed{1", "11", truncated=True).status == tasks.TRUNCATED
    empty = tasks.score(r"so \boxed{}", "1", False, format_reward=0.1)
    assert (empty.status, empty.reward, empty.extracted) == (tasks.UNPARSABLE, 0.0, None)
    assert tasks.score(r"\boxed{} so 4", "4", False, format_reward=0.1).reward == 1.0  # no bonus for an empty box
    gsm = tasks.load_problems(str(SHARED_DATA / "gsm8k" / "test.jsonl"), n=3)
    assert gsm[0].answer.replace(",", "").lstrip("-").isdigit()


def test_arithmetic_generator():
    a = tasks.arithmetic_problems(50, 0)
    assert a == tasks.arithmetic_problems(50, 0)
    assert a != tasks.arithmetic_problems(50, 0, split="heldout")
    for p in a:
        q = p.question
        if q.startswith("What is"):
            x, op, y = q[len("What is "):-1].split()
            assert int(p.answer) == (int(x) + int(y) if op == "+" else int(x) * int(y))
    assert all(int(p.answer) < 100 for p in a)


def _operands(p):
    return tuple(sorted(int(w) for w in p.question.replace("?", " ").split() if w.isdigit()))


def test_arithmetic_heldout_split_is_disjoint_from_training():
    train, held = tasks.arithmetic_problems(2000, 0), tasks.arithmetic_problems(500, 0, split="heldout")
    train_pairs, held_pairs = {_operands(p) for p in train}, {_operands(p) for p in held}
    assert held_pairs and not train_pairs & held_pairs
    assert not {p.question for p in train} & {p.question for p in held}
    assert len(train_pairs) > 30 and len(held_pairs) > 5  # both splits cover many operand pairs
    assert {d for pair in held_pairs for d in pair} == set(range(10))  # every digit is tested held out
    assert {p.question.split()[0] for p in held} >= {"What"}  # add/mul kinds present in held-out too
    with pytest.raises(QerlError, match="splits"):
        tasks.arithmetic_problems(5, 0, split="test")


def test_num_problems_truncates_generated_tasks_too():
    """The first N problems of arith:M (N < M) for evaluate's --num-examples and rollout's --num-prompts alike:
    load_problems is the one place that truncates, files and generated tasks the same way."""
    full = tasks.load_problems("arith:20", 0, None, "heldout")
    assert len(full) == 20
    assert tasks.load_problems("arith:20", 0, 5, "heldout") == full[:5]
    assert tasks.load_problems("arith:3", 0, 5, "heldout") == full[:3]  # N > M: all M
    assert len(tasks.load_problems("arith", 0, 7)) == 7  # no :M: N is the pool size
    gsm = str(SHARED_DATA / "gsm8k" / "test.jsonl")
    assert len(tasks.load_problems(gsm, 0, 2)) == 2


def test_plain_text_prompt_file(pipeline, tmp_path):
    """A .txt prompts file: one prompt per blank-line-separated block (as data.py reads .txt), not scored."""
    f = tmp_path / "prompts.txt"
    f.write_text("Say hello.\n\nCount to three,\nslowly.\n\n\nName a colour.\n")
    art = rollout.rollout(pipeline / "packed", str(f), tmp_path / "ro", group=2, max_new_tokens=4, seed=0,
                          progress=False)
    rows = [json.loads(line) for line in art.file(names.ROLLOUT_SAMPLES).read_text().splitlines()]
    assert [r["prompt_text"] for r in rows[::2]] == ["Say hello.", "Count to three,\nslowly.", "Name a colour."]
    assert "reward" not in rows[0] and "rewards" not in load_file(str(art.file(names.ROLLOUT_TENSORS)))
    one = rollout.rollout(pipeline / "packed", str(f), tmp_path / "one", group=1, max_new_tokens=4, num_prompts=1,
                          progress=False)
    assert len(one.file(names.ROLLOUT_SAMPLES).read_text().splitlines()) == 1


def test_cache_key_covers_result_switches(pipeline, tmp_path, monkeypatch):
    """(review, session 26) QERL_ENGINE_* / QERL_KERNEL_* switches change what CUDA computes (another sampler
    draws other tokens from the same seed): a run under them is not a cache hit of one without; verbosity is."""
    kw = dict(group=1, max_new_tokens=2, progress=False)
    a = rollout.rollout(pipeline / "packed", "arith:1", tmp_path / "ro", **kw)
    monkeypatch.setenv("QERL_KERNEL_VERBOSE", "1")
    assert rollout.rollout(pipeline / "packed", "arith:1", tmp_path / "ro", **kw).key == a.key
    monkeypatch.setenv("QERL_ENGINE_FUSED_SAMPLER", "0")
    with pytest.raises(QerlError, match="already holds a different"):
        rollout.rollout(pipeline / "packed", "arith:1", tmp_path / "ro", **kw)
    b = rollout.rollout(pipeline / "packed", "arith:1", tmp_path / "ro2", **kw)
    assert b.key != a.key and b.config["result_env"] == {"QERL_ENGINE_FUSED_SAMPLER": "0"}


def test_cache_key_covers_gold_answers(pipeline, tmp_path):
    """Rewards depend on the gold answers (and the verifier), not only the questions: a prompts file whose
    answers changed is a different rollout, never a cached one with stale rewards."""
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) + "\n"
                         for i in range(2)))
    kw = dict(group=1, max_new_tokens=2, seed=0, progress=False)
    a = rollout.rollout(pipeline / "packed", str(f), tmp_path / "ro", **kw)
    f.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 7}"}) + "\n"
                         for i in range(2)))
    with pytest.raises(QerlError, match="different 'rollout' artifact"):
        rollout.rollout(pipeline / "packed", str(f), tmp_path / "ro", **kw)
    b = rollout.rollout(pipeline / "packed", str(f), tmp_path / "ro", force=True, **kw)
    assert b.key != a.key
    rows = [json.loads(line) for line in b.file(names.ROLLOUT_SAMPLES).read_text().splitlines()]
    assert [r["gold"] for r in rows] == ["7", "8"]


def test_cache_key_ignores_what_changes_no_token(pipeline, tmp_path, monkeypatch):
    """(walkthrough, session 30) --num-prompts 4 and 0 (= all) on arith:4 select the same prompts, and a greedy
    rollout without AQN draws nothing (--seed, --top-p, --top-k change no token): one rollout, a cache hit that
    loads no model, never "a different artifact"; under sampling or AQN the seed still counts."""
    kw = dict(group=1, max_new_tokens=2, progress=False)
    a = rollout.rollout(pipeline / "packed", "arith:4", tmp_path / "g", temperature=0.0, seed=0, **kw)
    real_load = packed_model.load_packed_model
    monkeypatch.setattr(packed_model, "load_packed_model", lambda *a, **k: pytest.fail("an equal rollout recomputed"))
    assert rollout.rollout(pipeline / "packed", "arith:4", tmp_path / "g", temperature=0.0, seed=7, top_p=0.5,
                           top_k=3, num_prompts=4, **kw).digest == a.digest
    monkeypatch.setattr(packed_model, "load_packed_model", real_load)
    assert a.config["num_prompts"] == 4
    s1 = rollout.rollout(pipeline / "packed", "arith:4", tmp_path / "s1", temperature=1.0, seed=0, **kw)
    s2 = rollout.rollout(pipeline / "packed", "arith:4", tmp_path / "s2", temperature=1.0, seed=7, **kw)
    n1 = rollout.rollout(pipeline / "packed", "arith:4", tmp_path / "n1", temperature=0.0, seed=7, sigma=0.01, **kw)
    n2 = rollout.rollout(pipeline / "packed", "arith:4", tmp_path / "n2", temperature=0.0, seed=0, sigma=0.01, **kw)
    assert len({a.key, s1.key, s2.key, n1.key, n2.key}) == 5
    three = rollout.rollout(pipeline / "packed", "arith:4", tmp_path / "three", temperature=0.0, num_prompts=3, **kw)
    assert three.key != a.key and three.config["num_prompts"] == 3


def _fake_math_verify(monkeypatch):
    """math-verify "installed" (a stand-in that compares the parsed strings), version 9.9.9."""
    monkeypatch.setattr(tasks, "_math_verify", lambda: (str.strip, lambda g, p: g == p, "9.9.9"))


def test_answer_checker_is_recorded_and_keyed(pipeline, tmp_path, monkeypatch):
    """Which checker scored (math-verify when importable, else the built-in numeric match) is recorded in the
    rollout's config and meta and is part of its key: the two can score the same completion differently."""
    assert tasks.answer_checker() == tasks.NUMERIC_CHECKER  # (math-verify is not installed here)
    kw = dict(group=1, max_new_tokens=2, seed=0, progress=False)
    a = rollout.rollout(pipeline / "packed", "arith:2", tmp_path / "a", **kw)
    assert a.config["verifier"]["checker"] == {"name": "qerl.parse_number", "version": "3"}
    assert json.loads(a.file(names.ROLLOUT_META).read_text())["verifier"] == a.config["verifier"]
    _fake_math_verify(monkeypatch)
    assert tasks.answer_checker() == {"name": "math-verify", "version": "9.9.9"}
    assert tasks.answers_match("7.0", "7") is False  # the stand-in's rules, not parse_number's
    with pytest.raises(QerlError, match="different 'rollout' artifact"):  # not served from the cache
        rollout.rollout(pipeline / "packed", "arith:2", tmp_path / "a", **kw)
    b = rollout.rollout(pipeline / "packed", "arith:2", tmp_path / "b", **kw)
    assert b.config["verifier"]["checker"] == {"name": "math-verify", "version": "9.9.9"} and b.key != a.key
    assert json.loads(b.file(names.ROLLOUT_META).read_text())["verifier"]["checker"]["name"] == "math-verify"


def _teacher_forced(pipeline, art, sigma, seed, scope, adapter, temperature, final_norm=False):
    """The recorded completions' tempered log-probs under our engine with the given noise draw and adapter."""
    from qerl_cli.adapter import load_lora
    from qerl_cli.engine import Engine

    t = load_file(str(art.file(names.ROLLOUT_TENSORS)))
    prompts = [row[len(row) - int(n):].tolist() for row, n in zip(t["prompt_ids"], t["prompt_lengths"])]
    model, tok, _, _ = rollout.load_policy(pipeline / "packed", "cpu")
    eng = Engine(model, "cpu")
    eng.set_noise(sigma, derive_seed(seed, "noise", 0), scope, len(prompts), 2, final_norm)
    eng.set_adapter(load_lora(adapter, model) if adapter is not None else None)
    with torch.no_grad():
        tf = eng.sequence_logprobs(prompts, t["completion_ids"], t["completion_mask"], temperature, 2, group=2)
    return t, tf


@pytest.mark.parametrize("scope,final", [("batch", False), ("group", False), ("group", True)])
def test_hf_engine_samples_the_declared_policy(pipeline, tmp_path, scope, final):
    """--engine hf applies the AQN draw the engine would use (on the model's own norm weights) and the adapter,
    and records log-probs as the engine does: the tempered ones are untruncated (equal to our engine's
    teacher-forced log-probs under that same noise and adapter), the behaviour ones those of the top-p
    truncated distribution actually sampled from."""
    ad = random_adapter(tmp_path / "ad")
    art = rollout.rollout(pipeline / "packed", "arith:2", tmp_path / "ro", group=2, max_new_tokens=6, sigma=0.05,
                          seed=3, top_p=0.8, noise_scope=scope, adapter=ad, engine="hf", noise_final_norm=final,
                          progress=False)
    t, tf = _teacher_forced(pipeline, art, 0.05, 3, scope, ad, 1.0, final)
    if final:  # (the final norm's draw is part of the policy hf generate ran: without it, another policy)
        _, other = _teacher_forced(pipeline, art, 0.05, 3, scope, ad, 1.0)
        m = t["completion_mask"]
        assert (other[m] - tf[m]).abs().max() > 1e-3
    m = t["completion_mask"]
    assert m.sum() > 8 and (t["behaviour_logprobs"][~m] == 0).all() and (t["tempered_logprobs"][~m] == 0).all()
    assert torch.allclose(t["tempered_logprobs"][m], tf[m], atol=2e-4)
    _, clean = _teacher_forced(pipeline, art, 0.0, 3, scope, None, 1.0)
    assert (t["tempered_logprobs"][m] - clean[m]).abs().max() > 1e-2  # (noise and adapter change the policy)
    assert (t["behaviour_logprobs"][m] >= t["tempered_logprobs"][m] - 1e-6).all()  # truncated, renormalized
    assert (t["behaviour_logprobs"][m] > t["tempered_logprobs"][m] + 1e-3).any()
    meta = json.loads(art.file(names.ROLLOUT_META).read_text())
    assert meta["noise"][0]["sigma"] == 0.05 and meta["policy"]["adapter_digest"] and not meta["policy"]["cuda_graph"]
    assert meta["noise"][0]["final_norm"] is final
    assert meta["noise"][0]["dtype"] == "float32"  # (the CPU model's norm weights, where the draw ran)


def test_hf_noise_record_names_the_dtype_the_draw_ran_in(pipeline):
    """--engine hf adds the draw to the HF model's norm weights: on a bf16 model (the GPU default) the record says
    bfloat16, not the engine's fp32 scales (review, session 19)."""
    m = packed_model.load_packed_model(artifact.open_artifact(pipeline / "packed", names.KIND_PACKED),
                                       dtype=torch.bfloat16)
    ns = Engine(m).set_noise(0.01, 0, "batch", 1, 1)
    assert ns.dtype == "float32"
    assert rollout.noise_record(ns, "hf", m)["dtype"] == "bfloat16"
    assert rollout.noise_record(ns, "ours", m)["dtype"] == "float32"


def test_hf_engine_greedy_records_zero(pipeline, tmp_path):
    # G = 2 when greedy (transformers refuses num_return_sequences > 1 then: was a traceback): each prompt's two
    # completions are the same, and the same as our engine's greedy ones on the same weights
    greedy = rollout.rollout(pipeline / "packed", "arith:2", tmp_path / "g", group=2, max_new_tokens=4,
                             temperature=0.0, engine="hf", progress=False)
    t = load_file(str(greedy.file(names.ROLLOUT_TENSORS)))
    assert (t["behaviour_logprobs"] == 0).all() and (t["tempered_logprobs"] == 0).all()  # as the engine records
    assert t["completion_ids"].shape[0] == 4 and t["completion_mask"].any(1).all()
    assert torch.equal(t["completion_ids"][0::2], t["completion_ids"][1::2])
    ours = rollout.rollout(pipeline / "packed", "arith:2", tmp_path / "o", group=2, max_new_tokens=4,
                           temperature=0.0, progress=False)
    assert torch.equal(load_file(str(ours.file(names.ROLLOUT_TENSORS)))["completion_ids"], t["completion_ids"])
    sm = json.loads(greedy.file(names.ROLLOUT_META).read_text())["summary"]
    # HF generate does not time its prefill apart: not measured (was 0.0), and its decode_s holds it
    assert sm["prefill_s"] is None and sm["decode_s_includes_prefill"] is True and sm["decode_s"] > 0


def test_hf_engine_seeds_each_batch(pipeline, tmp_path):
    # one prompt per batch, the same prompt twice: each batch has its own seed (derived from seed and batch index)
    f = tmp_path / "same.jsonl"
    f.write_text(json.dumps({"question": "What is 2 + 2?", "answer": "4"}) + "\n" +
                 json.dumps({"question": "What is 2 + 2?", "answer": "4"}) + "\n")
    conf = tmp_path / "ro.toml"
    conf.write_text("batch_prompts = 1\n")
    art = rollout.rollout(pipeline / "packed", str(f), tmp_path / "s", group=1, max_new_tokens=6, seed=5,
                          engine="hf", config_file=conf, progress=False)
    c = load_file(str(art.file(names.ROLLOUT_TENSORS)))["completion_ids"]
    assert not torch.equal(c[0], c[1])


def test_hf_policy_restores_the_clean_model(pipeline, tmp_path):
    from qerl_cli.adapter import load_lora
    from qerl_cli.engine import Engine

    model, _, _, _ = rollout.load_policy(pipeline / "packed", "cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    eng = Engine(model, "cpu")
    eng.set_noise(0.1, 7)
    eng.set_adapter(load_lora(random_adapter(tmp_path / "ad"), model))
    ids = torch.tensor([[1, 5, 9, 200]])
    with torch.no_grad():
        plain = model(ids).logits
        with rollout.hf_policy(model, eng):
            w = model.model.layers[1].post_attention_layernorm.weight
            assert torch.equal(w, eng.effective_norm_weights()[1]["post_attention_layernorm"])
            noisy = model(ids).logits
        assert (noisy - plain).abs().max() > 1e-2
        assert torch.equal(model(ids).logits, plain)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_seed_changes_the_samples_not_the_questions(pipeline, tmp_path):
    """--seed seeds sampling and noise only: arith prompts come from prompt_seed (they changed with --seed, so
    runs at two seeds compared different questions). Each batch's sampling and noise seeds are derived apart
    (they were both ``batch`` at seed 0: one CPU generator stream for the draw and the sampler), recorded."""
    conf = tmp_path / "ro.toml"
    conf.write_text("batch_prompts = 2\n")
    kw = dict(group=2, max_new_tokens=4, sigma=0.01, config_file=conf, progress=False)
    a = rollout.rollout(pipeline / "packed", "arith:3", tmp_path / "a", seed=0, **kw)
    b = rollout.rollout(pipeline / "packed", "arith:3", tmp_path / "b", seed=1, **kw)
    c = rollout.rollout(pipeline / "packed", "arith:3", tmp_path / "c", seed=0, prompt_seed=1, **kw)

    def questions(art):
        return [json.loads(l)["prompt_text"] for l in art.file(names.ROLLOUT_SAMPLES).read_text().splitlines()]

    assert questions(a) == questions(b) != questions(c)
    meta = json.loads(a.file(names.ROLLOUT_META).read_text())
    assert [n["seed"] for n in meta["noise"]] == [derive_seed(0, "noise", 0), derive_seed(0, "noise", 1)]
    assert "sha256(f'{seed}:sample:{b}')" in meta["seeds"] and "prompt_seed" in meta["seeds"]
    seeds = {derive_seed(s, p, i) for s in (0, 1) for p in ("noise", "sample") for i in (0, 1)}
    assert len(seeds) == 8  # (no two streams of a run, nor of neighbouring run seeds, coincide)
    ta, tb = (load_file(str(x.file(names.ROLLOUT_TENSORS))) for x in (a, b))
    assert not torch.equal(ta["behaviour_logprobs"], tb["behaviour_logprobs"])


def test_a_leading_dot_decimal_is_not_its_digits():
    """(review-c) ".5" was read as 5 (the number pattern needed a digit before the point): "The answer is .5"
    scored correct against a gold 5 and wrong against 0.5, and "#### .5" was no marked answer at all."""
    assert tasks.parse_number(tasks.extract_answer("The answer is .5")) == tasks.parse_number("0.5")
    assert tasks.score("The answer is .5", "5", truncated=False).status == tasks.WRONG
    assert tasks.score("The answer is .5", "0.5", truncated=False).status == tasks.CORRECT
    assert tasks.score("It costs $.75 each.", "0.75", truncated=False).status == tasks.CORRECT
    assert tasks.score("so x = -.25", "-1/4", truncated=False).status == tasks.CORRECT
    o = tasks.score("#### .5\n", "0.5", truncated=True, format_reward=0.1)  # a complete marked answer
    assert (o.status, o.reward) == (tasks.CORRECT, pytest.approx(1.1))
    assert tasks.extract_answer("total 1.5") == "1.5" and tasks.extract_answer("step 3. then 4") == "4"


def test_prompt_seed_keys_only_generated_prompts(pipeline, tmp_path, monkeypatch):
    """(review-c) --prompt-seed draws generated prompts (arith:N) only: on a prompts file it changes nothing, so
    a rerun with another one is a cache hit that loads no model, never "a different artifact"."""
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) + "\n"
                         for i in range(2)))
    kw = dict(group=1, max_new_tokens=2, seed=0, progress=False)
    a = rollout.rollout(pipeline / "packed", str(f), tmp_path / "ro", prompt_seed=0, **kw)
    g = rollout.rollout(pipeline / "packed", "arith:2", tmp_path / "g", prompt_seed=3, **kw)
    monkeypatch.setattr(packed_model, "load_packed_model", lambda *a, **k: pytest.fail("an equal rollout recomputed"))
    assert rollout.rollout(pipeline / "packed", str(f), tmp_path / "ro", prompt_seed=5, **kw).digest == a.digest
    assert g.config["prompt_seed"] == 3  # (generated prompts: recorded)


@pytest.mark.parametrize("text", ["The answer is: 12, which took 3 steps.", "The answer is **12**, after 3 steps.",
                                  "Final answer: **12** (3 steps)", "The answer is 12 after 3 steps"])
def test_a_stated_answer_is_read_with_a_colon_or_in_bold(text):
    """(review-c) "The answer is: 12" and "The answer is **12**" were not read as stated answers: the last number
    of the text (3) was taken instead, so a correct reply scored wrong."""
    assert tasks.parse_number(tasks.extract_answer(text)) == 12
    assert tasks.score(text, "12", truncated=False).status == tasks.CORRECT


@pytest.mark.parametrize("spec", ["arith:²", "arith:٣"])
def test_a_generated_task_count_of_non_ascii_digits_is_one_sentence(spec):
    """(review-c) str.isdigit accepts digits int() refuses ('²'): a ValueError traceback instead of the sentence."""
    with pytest.raises(QerlError, match="whole number of problems"):
        tasks.load_problems(spec)


def test_a_generation_configs_other_stop_ids_are_kept():
    """fix_special_tokens puts the tokenizer's eos (``<|im_end|>``) first among the generation config's stop ids
    and keeps the others (Qwen2.5 lists ``[<|im_end|>, <|endoftext|>]``; a base model's ``<|endoftext|>`` was lost,
    and a rollout ran on past it); the model config holds the one eos."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from qerl_cli.modelio import fix_special_tokens
    from qerl_cli.rollout import eos_ids

    class Tok:  # a tokenizer whose vocabulary has the chat end token (id 7) and whose eos is another (id 5)
        eos_token, pad_token = "<|endoftext|>", None
        ids = {"<|endoftext|>": 5, "<|im_end|>": 7}

        def get_vocab(self):
            return dict(self.ids)

        @property
        def eos_token_id(self):
            return self.ids[self.eos_token]

        @property
        def pad_token_id(self):
            return self.ids.get(self.pad_token)

    conf = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, eos_token_id=5)
    for gen_eos, want in ((5, [7, 5]), ([7, 5, 9], [7, 5, 9]), (7, 7), (None, 7)):
        model = LlamaForCausalLM(conf)
        model.generation_config = GenerationConfig(eos_token_id=gen_eos)
        tok = Tok()
        fix_special_tokens(model, tok)
        assert model.generation_config.eos_token_id == want and model.config.eos_token_id == 7
        assert model.generation_config.pad_token_id == 7
        assert eos_ids(model, tok) == set(want if isinstance(want, list) else [want])


def test_a_packed_models_stop_ids_come_from_its_generation_config(tmp_path):
    """A model built from an artifact's config.json takes its generation config's stop ids from the artifact's
    generation_config.json (from_config alone knew config.json's one eos); a broken one is one sentence."""
    from transformers import LlamaConfig

    from qerl_cli.packed_model import _skeleton

    LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, eos_token_id=7).save_pretrained(str(tmp_path))
    assert _skeleton(tmp_path, torch.float32).generation_config.eos_token_id == 7
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 5], "pad_token_id": 7}))
    assert _skeleton(tmp_path, torch.float32).generation_config.eos_token_id == [7, 5]
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(QerlError, match="generation_config.json cannot be read"):
        _skeleton(tmp_path, torch.float32)


def test_vllm_backend_without_vllm_is_one_clear_error():
    """Without vLLM installed, both the check and the engine say so in one QerlError (no ImportError trace)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM installed")
    from qerl_cli import vllm_backend

    for call in (vllm_backend.require, lambda: vllm_backend.VLLMEngine("/nonexistent")):
        with pytest.raises(QerlError, match="needs vLLM"):
            call()


def test_a_cut_off_completion_whose_last_boxed_is_unclosed_is_truncated():
    """(review) A completion cut off while writing a new \\boxed{ answer after a closed one is truncated (reward 0),
    as one whose #### answer runs to the cut: the closed one was an earlier answer, not the final one. Finished, or
    with the last \\boxed{} closed, it is scored as before."""
    cut = "First \\boxed{1}, no wait, it is \\boxed{12"
    assert tasks.score(cut, "12", truncated=True).status == tasks.TRUNCATED
    assert tasks.score("So \\boxed{1}, then \\boxed{12} and more wor", "12", truncated=True).status == tasks.CORRECT
    assert tasks.score("So \\boxed{12} and more wor", "12", truncated=True).status == tasks.CORRECT
    assert tasks.score("\\boxed{\\frac{1}{2}} the end", "1/2", truncated=True).status == tasks.CORRECT
    assert tasks.score(cut, "1", truncated=False).status == tasks.CORRECT  # (not cut: its closed answer stands)


def test_a_comma_is_only_a_thousands_separator():
    """"1,5" was read as 15 (every comma was dropped), so a list or a decimal-comma answer scored correct against
    a gold 15. A comma now counts only where it groups the integer part in threes; a trailing one ends the answer."""
    assert tasks.parse_number("1,5") is None and tasks.parse_number("1,2,3") is None
    assert tasks.parse_number("1,0000") is None and tasks.parse_number(",5") is None
    assert tasks.parse_number("$1,080.00") == 1080 and tasks.parse_number("-1,234,567.5") == Fraction(-2469135, 2)
    assert tasks.parse_number("1,000/3") == Fraction(1000, 3) and tasks.parse_number("1{,}080") == 1080
    assert tasks.parse_number("15,") == 15 and tasks.parse_number("+1,200") == 1200
    assert tasks.score("so #### 1,5", "15", truncated=False).status == tasks.WRONG
    assert tasks.score("The answer is 1,5 kg.", "15", truncated=False).status == tasks.WRONG
    assert tasks.score("#### 15, as shown", "15", truncated=False).status == tasks.CORRECT
    assert tasks.score("It sold 1,080 in all.", "1080", truncated=False).status == tasks.CORRECT


def test_prompt_format_is_recorded_and_keyed(pipeline, tmp_path, monkeypatch):
    """The system hint before every question was in no cache key: after a change of it, rollout, evaluate and
    train served artifacts made from other prompts. It is now recorded (``prompt_format``) and keyed, and the
    prompts are built from what is recorded."""
    from transformers import AutoTokenizer

    from qerl_cli import config, evaluate, train

    kw = dict(group=1, max_new_tokens=2, seed=0, progress=False)
    a = rollout.rollout(pipeline / "packed", "arith:2", tmp_path / "a", **kw)
    assert a.config["prompt_format"] == {"system": tasks.SYSTEM_HINT}
    tok = AutoTokenizer.from_pretrained(str(pipeline / "packed"))
    before = tasks.chat_prompt(tok, "What is 3 + 4?")
    train_key = train._key_config(config.load("train", train.TrainConfig, None, {}), 4)
    monkeypatch.setattr(tasks, "SYSTEM_HINT", "Think step by step.")
    assert tasks.chat_prompt(tok, "What is 3 + 4?") != before
    with pytest.raises(QerlError, match="different 'rollout' artifact"):  # not served from the cache
        rollout.rollout(pipeline / "packed", "arith:2", tmp_path / "a", **kw)
    b = rollout.rollout(pipeline / "packed", "arith:2", tmp_path / "b", **kw)
    assert b.key != a.key and b.config["prompt_format"] == {"system": "Think step by step."}
    assert train._key_config(config.load("train", train.TrainConfig, None, {}), 4)["prompt_format"] != train_key["prompt_format"]
    e = evaluate.evaluate(pipeline / "packed", "arith:2", tmp_path / "e", num_examples=2, max_new_tokens=2,
                          progress=False)
    assert e.config["prompt_format"] == {"system": "Think step by step."}
