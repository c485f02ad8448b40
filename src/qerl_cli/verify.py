"""``qerl verify``: the packed model against dequantized references, before any RL.

Checks (numbered as in the report):

1. **projections** — every packed linear (kernel on CUDA, pure-torch reference elsewhere) against an fp32
   product with the quant checkpoint's dequantized weight, on fixed-seed random inputs at several M (chosen
   to reach each of the kernel's small-M instances: M <= 8, 8 < M <= 16, 16 < M <= 32, 32 < M <= 64, and its
   dequantize + cuBLAS path above), both ways: the forward ``x @ W^T`` and the transposed product ``g @ W``
   that the training backward runs through the frozen backbone (the module's autograd, i.e.
   ``kernel.linear_t`` on CUDA). The same for the fused q/k/v and gate/up products the rollout engine builds
   (one packed linear over the members' concatenated records, :class:`qerl_cli.engine._Fused`). Zero linears
   checked is a failure, not a vacuous pass.
2. **model** — logits of the whole packed model against the dequantized reference model on fixed prompts:
   max / mean absolute difference and top-1 agreement.
3. **round trip** — the packed bytes unpack to exactly the quant checkpoint's codes, scales and global scales,
   and the pack was made from that checkpoint.

The report is written either way; the stage's result says whether every check passed (the CLI exits 1 if not).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.table import Table

from . import artifact, config, layout, names, nvfp4, ui
from .errors import QerlError
from .pack import check_linear, load_checkpoint, quant_linears
from .packed_model import load_dequantized_model, load_packed_model, packed_index


@dataclass
class VerifyConfig:
    batch_sizes: tuple[int, ...]
    batch_sizes_t: tuple[int, ...]
    seed: int
    rel_tol_fp32: float
    rel_tol_bf16: float
    prompts: tuple[str, ...]
    logits_max_abs_fp32: float
    top1_min_bf16: float
    logits_mean_rel_bf16: float
    progress: bool
    device: str = "cpu"

    def __post_init__(self):
        problems = config.seed_problems(seed=self.seed)
        for f in ("batch_sizes", "batch_sizes_t"):
            if not getattr(self, f) or any(m < 1 for m in getattr(self, f)):
                problems.append(f"{f} must be positive integers")
        for f in ("rel_tol_fp32", "rel_tol_bf16", "logits_max_abs_fp32", "logits_mean_rel_bf16"):
            if not getattr(self, f) > 0:
                problems.append(f"{f} must be positive")
        if not 0 <= self.top1_min_bf16 <= 1:
            problems.append("top1_min_bf16 must be in [0, 1]")
        if not self.prompts:
            problems.append("prompts must hold at least one prompt")
        config.validate(problems)


def backend_name(device: str) -> str:
    """What computes the packed products on ``device``: "cuda-kernel" (the extension builds and loads) or
    "torch-reference"."""
    if not str(device).startswith("cuda"):
        return "torch-reference"
    try:
        from . import kernel

        return "cuda-kernel" if kernel.available() else "torch-reference"
    except ImportError:
        return "torch-reference"


def _rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    err = float((y.float() - ref).norm() / ref.norm().clamp(min=1e-30))
    return err if err == err else float("inf")


def _check_product(name: str, mod, w: torch.Tensor, bias: torch.Tensor | None, cfg: VerifyConfig,
                   gen: torch.Generator, act_dtype, tol: float, fused: bool) -> dict:
    """One packed module: forward ``x @ W^T (+ b)`` at each of ``batch_sizes`` and, through its autograd,
    ``g @ W`` (the input gradient training takes through the frozen weight) at each of ``batch_sizes_t``, both
    against fp32 products with ``w`` (dequantized from the quant checkpoint) and ``bias`` (the checkpoint's,
    not the packed module's own)."""
    dev = w.device
    worst = worst_t = 0.0
    nan = False
    for m in cfg.batch_sizes:
        x = torch.randn(m, mod.in_features, generator=gen).to(dev, act_dtype)
        with torch.no_grad():
            y = mod(x)
        ref = x.float() @ w.t()
        if bias is not None:
            ref = ref + bias.float()
        nan |= not bool(torch.isfinite(y).all())
        worst = max(worst, _rel_error(y, ref))
    for m in cfg.batch_sizes_t:
        x = torch.randn(m, mod.in_features, generator=gen).to(dev, act_dtype).requires_grad_(True)
        g = torch.randn(m, mod.out_features, generator=gen).to(dev, act_dtype)
        with torch.enable_grad():
            (gx,) = torch.autograd.grad(mod(x), x, g)
        nan |= not bool(torch.isfinite(gx).all())
        worst_t = max(worst_t, _rel_error(gx, g.float() @ w))
    return {"name": name, "shape": [mod.out_features, mod.in_features], "fused": fused, "max_rel_error": worst,
            "max_rel_error_t": worst_t, "bound": tol, "nan": nan,
            "passed": (not nan) and worst <= tol and worst_t <= tol}


def _fused_groups(packed_model) -> list[tuple[str, list[str], object]]:
    """(name, member names, fused module) of each q/k/v and gate/up group the rollout engine fuses: its own
    construction (one PackedLinear over the members' concatenated tile records; the members become views of
    that buffer, with unchanged values, as in the engine)."""
    from .engine import FUSED_GROUPS, _Fused

    layers = getattr(getattr(packed_model, "model", None), "layers", None) or []
    out = []
    for i, layer in enumerate(layers):
        for parent, members in FUSED_GROUPS.values():
            mods = [getattr(getattr(layer, parent, None), n, None) for n in members]
            if any(m is None for m in mods) or not _Fused.possible(mods):
                continue
            full = [f"model.layers.{i}.{parent}.{n}" for n in members]
            f = _Fused(mods, full)
            out.append((f"model.layers.{i}.{parent}.{'+'.join(members)}", full, f.base))
    return out


def check_projections(packed_model, ref_tensors: dict[str, torch.Tensor], cfg: VerifyConfig) -> list[dict]:
    """Check 1: each packed linear, and each fused group the engine builds, against fp32 products with the
    checkpoint's dequantized weights (forward and transposed)."""
    from .packed_model import PackedLinear

    dev = torch.device(cfg.device)
    act_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tol = cfg.rel_tol_bf16 if act_dtype == torch.bfloat16 else cfg.rel_tol_fp32
    rows = []
    mods = [(n, m) for n, m in packed_model.named_modules() if isinstance(m, PackedLinear)]
    gen = torch.Generator().manual_seed(cfg.seed)

    def ref_weight(name: str) -> torch.Tensor | None:
        key = f"{name}.{names.CT_PACKED}"
        if key not in ref_tensors:
            return None
        return nvfp4.dequantize(nvfp4.unpack_nibbles(ref_tensors[key]), ref_tensors[f"{name}.{names.CT_SCALE}"],
                                ref_tensors[f"{name}.{names.CT_GLOBAL}"]).to(dev)

    def ref_bias(name: str) -> torch.Tensor | None:
        b = ref_tensors.get(f"{name}.bias")
        return None if b is None else b.to(dev)

    groups = _fused_groups(packed_model)
    group_of = {m: grp for grp in groups for m in grp[1]}
    held: dict[str, torch.Tensor | None] = {}  # reference weights of fused members, until their group is checked
    for name, mod in ui.track(mods, "checking projections", enabled=cfg.progress):
        w = ref_weight(name)
        if w is None:
            rows.append({"name": name, "passed": False, "problem": "not in the quant checkpoint"})
        else:
            rows.append(_check_product(name, mod, w, ref_bias(name), cfg, gen, act_dtype, tol,
                                       fused=False))
        grp = group_of.get(name)
        if grp is None:
            continue
        held[name] = w
        gname, members, fmod = grp
        if all(m in held for m in members):  # the group's last member: check the fused product
            ws = [held.pop(m) for m in members]
            if any(x is None for x in ws):
                rows.append({"name": gname, "fused": True, "passed": False, "problem": "not in the quant checkpoint"})
            else:
                bs = [ref_bias(m) for m in members]
                bias = None if all(b is None for b in bs) else torch.cat(
                    [b if b is not None else torch.zeros(x.shape[0], device=dev) for b, x in zip(bs, ws)])
                rows.append(_check_product(gname, fmod, torch.cat(ws), bias, cfg, gen, act_dtype, tol, fused=True))
    return rows


def projections_section(rows: list[dict], batch_sizes, batch_sizes_t, bound: float) -> dict:
    """Check 1's report: passed only when at least one packed linear was checked and every row passed."""
    section = {"batch_sizes": list(batch_sizes), "batch_sizes_t": list(batch_sizes_t), "bound": bound, "linears_checked": sum(1 for r in rows if not r.get("fused")),
               "fused_checked": sum(1 for r in rows if r.get("fused")),
               "passed": bool(rows) and all(r["passed"] for r in rows), "layers": rows}
    if not any(not r.get("fused") for r in rows):
        section["problem"] = "no packed linear was checked"
        section["passed"] = False
    return section


def check_model(packed_model, ref_model, tokenizer, cfg: VerifyConfig) -> dict:
    """Check 2: whole-model logits on fixed prompts."""
    dev = torch.device(cfg.device)
    bf16 = dev.type == "cuda"
    texts = []
    for p in cfg.prompts:
        if getattr(tokenizer, "chat_template", None):
            texts.append(tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                       add_generation_prompt=True))
        else:
            texts.append(p)
    maxabs, sumabs, count, agree, total, ref_scale = 0.0, 0.0, 0, 0, 0, 0.0
    finite = True
    for t in texts:
        ids = torch.tensor([tokenizer(t, add_special_tokens=False)["input_ids"]], device=dev)
        with torch.no_grad():
            a = packed_model(ids).logits.float()
            b = ref_model(ids).logits.float()
        finite &= bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())
        d = (a - b).abs()
        dmax = float(d.max())
        maxabs = max(maxabs, dmax if dmax == dmax else float("inf"))  # (a NaN difference is not dropped)
        sumabs += float(d.sum())
        count += d.numel()
        ref_scale += float(b.abs().sum())
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += ids.shape[1]
    top1 = agree / max(total, 1)
    mean_abs = sumabs / max(count, 1)
    mean_rel = sumabs / max(ref_scale, 1e-30)
    if bf16:
        passed = finite and top1 >= cfg.top1_min_bf16 and mean_rel <= cfg.logits_mean_rel_bf16
        criterion = f"top-1 >= {cfg.top1_min_bf16}, mean |d| / mean |ref| <= {cfg.logits_mean_rel_bf16}"
    else:
        passed = finite and maxabs <= cfg.logits_max_abs_fp32 and top1 == 1.0
        criterion = f"max |d| <= {cfg.logits_max_abs_fp32}, top-1 agreement 1.0"
    return {"prompts": len(texts), "tokens": total, "max_abs_diff": maxabs, "mean_abs_diff": mean_abs,
            "mean_rel_diff": mean_rel, "top1_agreement": top1, "finite": finite, "criterion": criterion,
            "passed": passed}


def check_round_trip(packed_tensors: dict[str, torch.Tensor], index: dict, ref_tensors: dict[str, torch.Tensor],
                     lineage_ok: bool) -> dict:
    """Check 3: unpacking the packed bytes gives back the checkpoint's exact tensors."""
    problems = []
    if not lineage_ok:
        problems.append("the pack was not made from this quant checkpoint (input digest differs)")
    ref_names = set(quant_linears(ref_tensors))
    if set(index["linears"]) != ref_names:
        diff = sorted(set(index["linears"]) ^ ref_names)
        problems.append(f"linear sets differ, e.g. {diff[0]}")
    checked = 0
    for name in sorted(ref_names & set(index["linears"])):
        n, k = check_linear(ref_tensors, name)
        info = index["linears"][name]
        if (info["out_features"], info["in_features"]) != (n, k):
            problems.append(f"{name}: shape {info['out_features']}x{info['in_features']} vs {n}x{k}")
            continue
        try:
            codes, scales = layout.unpack(packed_tensors[f"{name}.{names.PK_QWEIGHT}"], n, k)
        except (KeyError, ValueError) as e:
            problems.append(f"{name}: {e}")
            continue
        if not torch.equal(nvfp4.pack_nibbles(codes), ref_tensors[f"{name}.{names.CT_PACKED}"]):
            problems.append(f"{name}: codes differ")
        if not torch.equal(scales.view(torch.uint8), ref_tensors[f"{name}.{names.CT_SCALE}"].view(torch.uint8)):
            problems.append(f"{name}: block scales differ")
        g = packed_tensors.get(f"{name}.{names.PK_GLOBAL}")
        if g is None or not torch.equal(g.reshape(1), ref_tensors[f"{name}.{names.CT_GLOBAL}"].reshape(1)):
            problems.append(f"{name}: global scale differs")
        checked += 1
    if not checked:
        problems.append("no packed linear was checked")
    # every other tensor (embeddings, norms, biases, lm_head) is the checkpoint's, byte for byte, and nothing else
    quant_keys = {f"{n}.{s}" for n in ref_names for s in (names.CT_PACKED, names.CT_SCALE, names.CT_GLOBAL)}
    packed_keys = {f"{n}.{s}" for n in index["linears"] for s in (names.PK_QWEIGHT, names.PK_GLOBAL)}
    others = sorted(set(ref_tensors) - quant_keys)
    for key in others:
        t = packed_tensors.get(key)
        if t is None:
            problems.append(f"{key}: missing from the pack")
        elif t.dtype != ref_tensors[key].dtype or t.shape != ref_tensors[key].shape or not torch.equal(
                t.reshape(-1).view(torch.uint8), ref_tensors[key].reshape(-1).view(torch.uint8)):
            problems.append(f"{key}: differs from the checkpoint's")
    extra = sorted(set(packed_tensors) - packed_keys - set(others))
    if extra:
        problems.append(f"the pack holds tensors the checkpoint does not, e.g. {extra[0]}")
    return {"linears_checked": checked, "other_tensors_checked": len(others), "problems": problems[:20],
            "n_problems": len(problems), "passed": not problems}


def print_report(report: dict) -> None:
    t = Table(title=f"qerl verify — {report['backend']} on {report['device']}")
    t.add_column("#")
    t.add_column("check")
    t.add_column("result")
    t.add_column("detail")
    proj = report["checks"]["1_projections"]
    worst = max((max(r.get("max_rel_error", float("inf")), r.get("max_rel_error_t", 0.0)) for r in proj["layers"]),
                default=float("nan"))
    failed = [r["name"] for r in proj["layers"] if not r["passed"]]
    n_fused = sum(1 for r in proj["layers"] if r.get("fused"))
    t.add_row("1", "projections", _mark(proj["passed"]),
              f"{len(proj['layers']) - n_fused} linears + {n_fused} fused groups: x W^T at M={proj['batch_sizes']}, "
              f"g W at M={proj.get('batch_sizes_t')}; worst rel. error {worst:.2e} (bound {proj['bound']:.0e})"
              + (f"; failing: {', '.join(failed[:3])}" if failed else "")
              + (f"; {proj['problem']}" if proj.get("problem") else ""))
    m = report["checks"]["2_model"]
    t.add_row("2", "model logits", _mark(m["passed"]),
              f"{m['tokens']} tokens: max |d| {m['max_abs_diff']:.3e}, mean |d| {m['mean_abs_diff']:.3e}, "
              f"top-1 {m['top1_agreement']:.4f} ({m['criterion']})")
    r = report["checks"]["3_round_trip"]
    t.add_row("3", "round trip", _mark(r["passed"]),
              f"{r['linears_checked']} linears + {r.get('other_tensors_checked', 0)} other tensors"
              + (f"; {r['problems'][0]}" if r["problems"] else ", bit-exact"))
    ui.out.print(t)
    ui.out.print(f"verify: {'[green]PASSED[/]' if report['passed'] else '[bold red]FAILED[/]'}")


def _mark(ok: bool) -> str:
    return "[green]pass[/]" if ok else "[bold red]FAIL[/]"


def verify(packed: str | Path, output: str | Path, against: str | Path | None = None,
           config_file: str | Path | None = None, force: bool = False, progress: bool = True,
           device: str | None = None) -> artifact.Artifact:
    """Verify a packed artifact (against its quant checkpoint); the artifact's ``metrics.passed`` says the verdict."""
    output = Path(output)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = config.load("verify", VerifyConfig, config_file, {"progress": progress, "device": device})
    p = artifact.open_artifact(packed, names.KIND_PACKED)
    if against is None:
        recorded = p.input_of(names.KIND_QUANT)
        if recorded is None:
            raise QerlError(f"{packed} records no quant input; pass --against QUANT.")
        against = recorded[0]
        if not Path(against).exists():  # (a pack moved away from its quant: where the quant was recorded is gone)
            raise QerlError(f"{packed} records its quant input at {against}, which does not exist (a moved pack?); "
                            "pass --against QUANT.")
    q = artifact.open_artifact(against, names.KIND_QUANT)
    lineage_ok = any(i.get(names.K_DIGEST) == q.digest for i in p.inputs)
    backend = backend_name(cfg.device)
    conf = config.as_dict(cfg) | {"backend": backend} | config.result_env()
    if backend == "cuda-kernel":  # (in the key: a changed kernel source or another GPU is a new verify)
        from . import kernel

        conf["kernel_build"] = kernel.build_identity(cfg.device)

    def body(tmp: Path) -> dict:
        from transformers import AutoTokenizer

        ref_tensors = load_checkpoint(q)
        packed_tensors = p.read_tensors(names.MODEL_WEIGHTS)
        index = packed_index(p)
        # the projections run both models on the same inputs: a checkpoint whose linears have other shapes is of
        # another model (a traceback in the first matmul before this), not a failed check (other linear sets are)
        linears = set(quant_linears(ref_tensors)) | set(index["linears"])
        other = sorted(n for n in set(quant_linears(ref_tensors)) & set(index["linears"])
                       if check_linear(ref_tensors, n) != (index["linears"][n]["out_features"],
                                                           index["linears"][n]["in_features"]))
        # ... and so are its other tensors (embeddings, lm_head, norms: another vocabulary crashed the model check)
        other += sorted(n for n in set(ref_tensors) & set(packed_tensors) if n.rsplit(".", 1)[0] not in linears
                        and ref_tensors[n].shape != packed_tensors[n].shape)
        if other:
            raise QerlError(f"{q.path} is a checkpoint of another model than {p.path} (the shape of {other[0]} "
                            "differs); verify a pack against the quant checkpoint it was made from.")
        round_trip = check_round_trip(packed_tensors, index, ref_tensors, lineage_ok)
        act_dtype = torch.bfloat16 if cfg.device.startswith("cuda") else torch.float32
        pmodel = load_packed_model(p, act_dtype, cfg.device, tensors=packed_tensors)
        rows = check_projections(pmodel, ref_tensors, cfg)
        rmodel = load_dequantized_model(ref_tensors, q.path, torch.float32, cfg.device)
        tokenizer = AutoTokenizer.from_pretrained(str(p.path))
        model_check = check_model(pmodel, rmodel, tokenizer, cfg)
        bound = cfg.rel_tol_bf16 if act_dtype == torch.bfloat16 else cfg.rel_tol_fp32
        report = {
            "backend": backend, "device": cfg.device,
            "checks": {
                "1_projections": projections_section(rows, cfg.batch_sizes, cfg.batch_sizes_t, bound),
                "2_model": model_check,
                "3_round_trip": round_trip,
            },
        }
        report["passed"] = all(c["passed"] for c in report["checks"].values())
        (tmp / names.VERIFY_REPORT).write_text(json.dumps(report, indent=1) + "\n")
        return {"passed": report["passed"], "backend": backend}

    art = artifact.run_stage(names.KIND_VERIFY, output, conf, [p.as_input(output), q.as_input(output)], body,
                             force=force)
    print_report(json.loads(art.file(names.VERIFY_REPORT).read_text()))
    return art


def _verify_report(v: artifact.Artifact) -> dict:
    """A verify artifact's report (a hashed file: ``open_artifact`` checked it; the manifest's metrics are not
    covered by its digest)."""
    try:
        report = json.loads(v.file(names.VERIFY_REPORT).read_text())
        if not isinstance(report, dict):
            raise ValueError("not a JSON object")
        return report
    except (OSError, ValueError) as e:
        raise QerlError(f"{v.path}: its {names.VERIFY_REPORT} cannot be read ({e}); rerun verify with --force.") from None


def verify_backend(v: artifact.Artifact) -> str:
    """What computed the packed products a verify artifact checked, from its report."""
    return str(_verify_report(v).get("backend", "an unrecorded backend"))


def verify_passed(v: artifact.Artifact) -> bool:
    """The verdict of a verify artifact, from its report, not from the manifest's metrics."""
    return _verify_report(v).get("passed") is True
