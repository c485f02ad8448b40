"""verify: the transposed and fused products are checked, and checking nothing is a failure (src/qerl_cli/verify.py)."""

from __future__ import annotations

import json
import shutil

import torch

from qerl_cli import artifact, engine, names, packed_model, verify


def _verify_copy(tiny_pipeline, tmp_path, **kw) -> dict:
    """verify of a private copy of the session's packed + quant dirs (relative input paths preserved)."""
    for k in ("quant", "packed"):
        shutil.copytree(tiny_pipeline[k], tmp_path / k)
    v = verify.verify(tmp_path / "packed", tmp_path / "verify", progress=False, device="cpu", **kw)
    report = json.loads(v.file(names.VERIFY_REPORT).read_text())
    assert v.metrics["passed"] is report["passed"]
    return report


class _WrongBackward(torch.autograd.Function):
    """Identity forward, input gradient 1 % too large: a broken transposed product."""

    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        return g * 1.01


def test_a_wrong_transposed_product_fails(tiny_pipeline, tmp_path, monkeypatch):
    real = packed_model.PackedLinear.forward
    target = "model.layers.1.self_attn.o_proj"

    def forward(self, x):
        y = real(self, x)
        return _WrongBackward.apply(y) if getattr(self, "_name", None) == target else y

    real_load = verify.load_packed_model

    def load(*a, **kw):
        m = real_load(*a, **kw)
        m.get_submodule(target)._name = target
        return m

    monkeypatch.setattr(packed_model.PackedLinear, "forward", forward)
    monkeypatch.setattr(verify, "load_packed_model", load)
    report = _verify_copy(tiny_pipeline, tmp_path)
    proj = report["checks"]["1_projections"]
    assert report["passed"] is False and proj["passed"] is False
    (bad,) = [r for r in proj["layers"] if not r["passed"]]
    assert bad["name"] == target and bad["max_rel_error"] == 0.0 and bad["max_rel_error_t"] > 1e-3
    assert report["checks"]["2_model"]["passed"] and report["checks"]["3_round_trip"]["passed"]


def test_a_wrong_fused_product_fails(tiny_pipeline, tmp_path, monkeypatch):
    """A fused buffer built from the members in the wrong order: every member alone is right, the engine's
    fused q/k/v is not, and verify says so."""
    real_init = engine._Fused.__init__

    def init(self, modules, names_):
        real_init(self, modules, names_)
        if names_[0].endswith("q_proj"):
            b = self.base
            rows = [m.qweight for m in modules]
            self.base = packed_model.PackedLinear(torch.cat([rows[1], rows[0], rows[2]]), b.global_scale,
                                                  b.out_features, b.in_features, b.bias)

    monkeypatch.setattr(engine._Fused, "__init__", init)
    report = _verify_copy(tiny_pipeline, tmp_path)
    proj = report["checks"]["1_projections"]
    assert report["passed"] is False
    assert sorted(r["name"] for r in proj["layers"] if not r["passed"]) == [
        f"model.layers.{i}.self_attn.q_proj+k_proj+v_proj" for i in range(2)]


def test_no_packed_linear_checked_is_a_failure(tiny_pipeline, tmp_path, monkeypatch):
    """A packed model whose linears were never replaced by packed ones agrees with the reference everywhere;
    verify must not pass it for lack of anything to check."""
    def dense(art, dtype=torch.float32, device="cpu", tensors=None):
        q = artifact.open_artifact(tmp_path / "quant", names.KIND_QUANT)
        from qerl_cli.pack import load_checkpoint

        return packed_model.load_dequantized_model(load_checkpoint(q), q.path, dtype, device)

    monkeypatch.setattr(verify, "load_packed_model", dense)
    report = _verify_copy(tiny_pipeline, tmp_path)
    proj = report["checks"]["1_projections"]
    assert proj["layers"] == [] and proj["linears_checked"] == 0
    assert proj["passed"] is False and proj["problem"] == "no packed linear was checked"
    assert report["passed"] is False
    assert report["checks"]["2_model"]["passed"] and report["checks"]["3_round_trip"]["passed"]


def test_round_trip_of_nothing_is_a_failure():
    rt = verify.check_round_trip({}, {"linears": {}}, {}, True)
    assert rt["passed"] is False and rt["linears_checked"] == 0
    assert rt["problems"] == ["no packed linear was checked"]


def test_a_packed_bias_the_checkpoint_lacks_fails(tiny_pipeline, tmp_path, monkeypatch):
    """(review, session 27) check 1's reference took the packed module's own bias, so a wrong bias compared
    equal to itself; the reference now takes the checkpoint's."""
    target = "model.layers.0.mlp.down_proj"
    real_load = verify.load_packed_model

    def load(*a, **kw):
        m = real_load(*a, **kw)
        mod = m.get_submodule(target)
        mod.bias = torch.nn.Parameter(torch.full((mod.out_features,), 0.5), requires_grad=False)
        return m

    monkeypatch.setattr(verify, "load_packed_model", load)
    report = _verify_copy(tiny_pipeline, tmp_path)
    proj = report["checks"]["1_projections"]
    assert report["passed"] is False and proj["passed"] is False
    (bad,) = [r for r in proj["layers"] if not r["passed"]]
    assert bad["name"] == target and bad["max_rel_error"] > 1e-2


def test_round_trip_compares_every_other_tensor(tiny_pipeline):
    """(review, session 27) check 3 compared only codes and scales; embeddings, norms, biases and lm_head were
    left to check 2's loose bf16 bounds. Now each is the checkpoint's byte for byte, and the pack holds no more."""
    from qerl_cli.pack import load_checkpoint
    from qerl_cli.packed_model import packed_index

    p = artifact.open_artifact(tiny_pipeline["packed"], names.KIND_PACKED)
    q = artifact.open_artifact(tiny_pipeline["quant"], names.KIND_QUANT)
    ref, packed, index = load_checkpoint(q), p.read_tensors(names.MODEL_WEIGHTS), packed_index(p)
    ok = verify.check_round_trip(packed, index, ref, True)
    assert ok["passed"] and ok["other_tensors_checked"] >= 2 * 2 + 2  # two norms a layer, the final norm, embed
    norm = "model.layers.1.post_attention_layernorm.weight"
    for change, problem in ((lambda d: d.__setitem__(norm, d[norm] * (1 + 2 ** -6)), f"{norm}: differs"),
                            (lambda d: d.__setitem__(norm, d[norm].double()), f"{norm}: differs"),
                            (lambda d: d.pop(norm), f"{norm}: missing"),
                            (lambda d: d.__setitem__("extra.weight", torch.zeros(2)), "does not, e.g. extra.weight")):
        bad = dict(packed)
        change(bad)
        rt = verify.check_round_trip(bad, index, ref, True)
        assert rt["passed"] is False and any(problem in x for x in rt["problems"]), rt["problems"]
