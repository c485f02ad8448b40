"""``qerl verify``: the packed model against dequantized references, before any RL.

Checks (numbered as in the report):

1. **projections** — every packed linear (kernel on CUDA, pure-torch reference elsewhere) against an fp32
   product with the quant checkpoint's dequantized weight, on fixed-seed random inputs at several M.
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
        problems = []
        if not self.batch_sizes or any(m < 1 for m in self.batch_sizes):
            problems.append("batch_sizes must be positive integers")
        for f in ("rel_tol_fp32", "rel_tol_bf16", "logits_max_abs_fp32", "logits_mean_rel_bf16"):
            if not getattr(self, f) > 0:
                problems.append(f"{f} must be positive")
        if not 0 <= self.top1_min_bf16 <= 1:
            problems.append("top1_min_bf16 must be in [0, 1]")
        if not self.prompts:
            problems.append("prompts must hold at least one prompt")
        config.validate(problems)


def _backend_name(device: str) -> str:
    if device == "cpu":
        return "torch-reference"
    try:
        from . import kernel

        return "cuda-kernel" if kernel.available() else "torch-reference"
    except ImportError:
        return "torch-reference"


def check_projections(packed_model, ref_tensors: dict[str, torch.Tensor], cfg: VerifyConfig) -> list[dict]:
    """Check 1: each packed linear against x @ W_ref^T in fp32."""
    from .packed_model import PackedLinear

    dev = torch.device(cfg.device)
    act_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tol = cfg.rel_tol_bf16 if act_dtype == torch.bfloat16 else cfg.rel_tol_fp32
    rows = []
    mods = [(n, m) for n, m in packed_model.named_modules() if isinstance(m, PackedLinear)]
    gen = torch.Generator().manual_seed(cfg.seed)
    for name, mod in ui.track(mods, "checking projections", enabled=cfg.progress):
        key = f"{name}.{names.CT_PACKED}"
        if key not in ref_tensors:
            rows.append({"name": name, "passed": False, "problem": "not in the quant checkpoint"})
            continue
        w = nvfp4.dequantize(nvfp4.unpack_nibbles(ref_tensors[key]), ref_tensors[f"{name}.{names.CT_SCALE}"],
                             ref_tensors[f"{name}.{names.CT_GLOBAL}"]).to(dev)
        worst = 0.0
        nan = False
        for m in cfg.batch_sizes:
            x = torch.randn(m, mod.in_features, generator=gen).to(dev, act_dtype)
            with torch.no_grad():
                y = mod(x).float()
            ref = x.float() @ w.t()
            if mod.bias is not None:
                ref = ref + mod.bias.float()
            nan |= not bool(torch.isfinite(y).all())
            err = float((y - ref).norm() / ref.norm().clamp(min=1e-30))
            worst = max(worst, err if err == err else float("inf"))
        rows.append({"name": name, "shape": [mod.out_features, mod.in_features], "max_rel_error": worst,
                     "bound": tol, "nan": nan, "passed": (not nan) and worst <= tol})
    return rows


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
        finite &= bool(torch.isfinite(a).all())
        d = (a - b).abs()
        maxabs = max(maxabs, float(d.max()))
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
    return {"linears_checked": checked, "problems": problems[:20], "n_problems": len(problems),
            "passed": not problems}


def print_report(report: dict) -> None:
    t = Table(title=f"qerl verify — {report['backend']} on {report['device']}")
    t.add_column("#")
    t.add_column("check")
    t.add_column("result")
    t.add_column("detail")
    proj = report["checks"]["1_projections"]
    worst = max((r.get("max_rel_error", float("inf")) for r in proj["layers"]), default=0.0)
    failed = [r["name"] for r in proj["layers"] if not r["passed"]]
    t.add_row("1", "projections", _mark(proj["passed"]),
              f"{len(proj['layers'])} layers x M={proj['batch_sizes']}; worst rel. error {worst:.2e} "
              f"(bound {proj['bound']:.0e})" + (f"; failing: {', '.join(failed[:3])}" if failed else ""))
    m = report["checks"]["2_model"]
    t.add_row("2", "model logits", _mark(m["passed"]),
              f"{m['tokens']} tokens: max |d| {m['max_abs_diff']:.3e}, mean |d| {m['mean_abs_diff']:.3e}, "
              f"top-1 {m['top1_agreement']:.4f} ({m['criterion']})")
    r = report["checks"]["3_round_trip"]
    t.add_row("3", "round trip", _mark(r["passed"]),
              f"{r['linears_checked']} linears" + (f"; {r['problems'][0]}" if r["problems"] else ", bit-exact"))
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
        quant_inputs = [i for i in p.inputs if i.get(names.K_KIND) == names.KIND_QUANT]
        if not quant_inputs:
            raise QerlError(f"{packed} records no quant input; pass --against QUANT.")
        against = (p.path / quant_inputs[0][names.K_PATH]).resolve()
    q = artifact.open_artifact(against, names.KIND_QUANT)
    lineage_ok = any(i.get(names.K_DIGEST) == q.digest for i in p.inputs)
    backend = _backend_name(cfg.device)
    conf = config.as_dict(cfg) | {"backend": backend}

    def body(tmp: Path) -> dict:
        from safetensors.torch import load_file
        from transformers import AutoTokenizer

        ref_tensors = load_checkpoint(q)
        packed_tensors = load_file(str(p.file(names.MODEL_WEIGHTS)))
        index = packed_index(p)
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
                "1_projections": {"batch_sizes": list(cfg.batch_sizes), "bound": bound,
                                  "passed": all(r["passed"] for r in rows), "layers": rows},
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


def verify_passed(v: artifact.Artifact) -> bool:
    """The verdict of a verify artifact, from its report (a hashed file: ``open_artifact`` checked it), not from
    the manifest's metrics, which its digest does not cover."""
    try:
        return json.loads(v.file(names.VERIFY_REPORT).read_text()).get("passed") is True
    except (OSError, ValueError, AttributeError) as e:
        raise QerlError(f"{v.path}: its {names.VERIFY_REPORT} cannot be read ({e}); rerun verify with --force.") from None
