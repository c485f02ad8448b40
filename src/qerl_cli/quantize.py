"""``qerl quantize``: NVFP4 weights written as a compressed-tensors ``nvfp4-pack-quantized`` checkpoint."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.markup import escape
from safetensors.torch import save_file

from . import artifact, config, modelio, names, nvfp4, ui
from .errors import QerlError


@dataclass
class QuantizeConfig:
    targets: tuple[str, ...]
    fused_groups: tuple[str, ...]
    progress: bool
    method: str = "rtn"  # set by the stage: "rtn" (round-to-nearest) or "awq" (with --calib)

    def __post_init__(self):
        problems = []
        if not self.targets:
            problems.append("targets must name at least one projection")
        grouped: set[str] = set()
        for grp in self.fused_groups:
            unknown = [m for m in grp.split(",") if m not in self.targets]
            if unknown:
                problems.append(f"fused group '{grp}' names {unknown}, which are not in targets")
            # (a name in two groups would be quantized twice, the second scale overwriting the first)
            problems += [f"'{m}' is in more than one fused group" for m in dict.fromkeys(grp.split(",")) if m in grouped]
            grouped.update(grp.split(","))
        if self.method not in ("rtn", "awq"):
            problems.append(f"method must be 'rtn' or 'awq', got '{self.method}'")
        config.validate(problems)


def quantization_config(ignore: list[str]) -> dict:
    """The ``quantization_config`` block of ``config.json`` that compressed-tensors / vLLM read. Its one group
    targets every ``Linear``, so ``ignore`` must name each Linear left dense (:func:`unquantized_linears`):
    a Linear not ignored is read as NVFP4 (transformers then finds no weight for it)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "format": "nvfp4-pack-quantized",
                "weights": {
                    "num_bits": 4, "type": "float", "symmetric": True, "group_size": nvfp4.GROUP_SIZE,
                    "strategy": "tensor_group", "block_structure": None, "dynamic": False, "actorder": None,
                    "scale_dtype": "torch.float8_e4m3fn", "zp_dtype": None, "observer": None, "observer_kwargs": {},
                },
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


def quantized_linears(model, targets: tuple[str, ...]) -> list[tuple[str, torch.nn.Linear]]:
    """(qualified name, module) of every Linear whose last name component is a target (lm_head never)."""
    found = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets and name != "lm_head":
            found.append((name, mod))
    if not found:
        raise QerlError(f"the model has no Linear layers named {list(targets)}; nothing to quantize.")
    # a target that names nothing (a misspelling left those layers dense, silently) is refused, but for the
    # usual projection names of the default targets, which models of other families (Phi's qkv_proj) lack
    unmatched = sorted(set(targets) - {n.rsplit(".", 1)[-1] for n, _ in found} - set(names.PROJECTIONS))
    if unmatched:
        leaves = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise QerlError(f"targets {unmatched} name no Linear layer of the model that is quantized (its Linear "
                        f"layers: {leaves}; lm_head is never quantized).")
    return found


def unquantized_linears(model, targets: tuple[str, ...]) -> list[str]:
    """Exact module names of every ``nn.Linear`` that :func:`quantized_linears` leaves dense (``lm_head``, and
    any Linear whose name is not a target), in module order: the ``ignore`` list. compressed-tensors (0.19)
    and vLLM read an entry without a ``re:`` prefix as an exact module name."""
    quantized = {n for n, _ in quantized_linears(model, targets)}
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in quantized]


def fused_sets(linears: list[tuple[str, torch.nn.Linear]], fused_groups: tuple[str, ...]) -> list[list[str]]:
    """Group linear names that share a global scale: siblings (same parent) named by one fused group."""
    by_name = dict(linears)
    groups: list[list[str]] = []
    seen: set[str] = set()
    for name, _ in linears:
        if name in seen:
            continue
        parent, _, leaf = name.rpartition(".")
        members = [name]
        for grp in fused_groups:
            leaves = grp.split(",")
            if leaf in leaves:
                members = [f"{parent}.{m}" if parent else m for m in leaves]
                members = [m for m in members if m in by_name]
                break
        groups.append(members)
        seen.update(members)
    return groups


def quantize_state(model, cfg: QuantizeConfig, clip_ratios: dict[str, float] | None = None,
                   progress: bool = True) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """The checkpoint's tensors (NVFP4 linears + bf16 rest) and a per-layer report."""
    linears = quantized_linears(model, cfg.targets)
    for name, mod in linears:
        nvfp4.check_in_features(name, mod.in_features)
        if mod.bias is not None and not torch.isfinite(mod.bias).all():
            raise QerlError(f"{name}.bias holds NaN or infinite values.")
    by_name = dict(linears)
    tensors: dict[str, torch.Tensor] = {}
    report = []
    for group in ui.track(fused_sets(linears, cfg.fused_groups), "quantizing", enabled=progress):
        weights = [by_name[n].weight.detach() for n in group]
        for n, w in zip(group, weights):
            if not torch.isfinite(w).all():
                raise QerlError(f"{n}.weight holds NaN or infinite values; refusing to quantize.")
        g = nvfp4.fused_global_scale(weights)
        for n, w in zip(group, weights):
            ratio = (clip_ratios or {}).get(n, 1.0)
            if ratio != 1.0:
                from . import awq  # clip-aware quantizer; ratio 1.0 is plain NVFP4

                q = awq.clipped_quantize_weight(w, g, ratio)
            else:
                q = nvfp4.quantize_weight(w, g)
            for suffix, t in ((names.CT_PACKED, q["weight_packed"]), (names.CT_SCALE, q["weight_scale"]),
                              (names.CT_GLOBAL, q["weight_global_scale"])):
                tensors[f"{n}.{suffix}"] = t.contiguous()
            deq = nvfp4.dequantize(nvfp4.unpack_nibbles(q["weight_packed"]), q["weight_scale"], q["weight_global_scale"])
            err = (deq - w.float()).norm() / w.float().norm().clamp(min=1e-30)
            report.append({"name": n, "shape": list(w.shape), "global_scale": float(g),
                           "fused_with": [m for m in group if m != n], "clip_ratio": ratio,
                           "rel_error": float(err)})
            if by_name[n].bias is not None:
                tensors[f"{n}.bias"] = by_name[n].bias.detach().to(torch.bfloat16).contiguous()
    quantized = {f"{n}.weight" for n, _ in linears} | {f"{n}.bias" for n, _ in linears}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for key, t in model.state_dict().items():
        if key in quantized or (tied and key == "lm_head.weight"):
            continue
        if not torch.isfinite(t).all():
            raise QerlError(f"{key} holds NaN or infinite values; refusing to quantize.")
        tensors[key] = t.detach().to(torch.bfloat16).contiguous()
    return tensors, report


def quantize(model: str, output: str | Path, calib: str | Path | None = None, config_file: str | Path | None = None,
             force: bool = False, progress: bool = True) -> artifact.Artifact:
    """Quantize MODEL to NVFP4 (round-to-nearest, or AWQ with ``calib``) into a compressed-tensors checkpoint."""
    output = Path(output)
    cfg = config.load("quantize", QuantizeConfig, config_file,
                      {"progress": progress, "method": "awq" if calib else "rtn"})
    source = modelio.resolve(model)
    inputs = [source.as_input()]
    calib_art = None
    if calib is not None:
        calib_art = artifact.open_artifact(calib, names.KIND_CALIB)
        from .calibrate import check_foldable

        check_foldable(modelio.config_model_type(calib_art.path), str(model))
        inputs.append(calib_art.as_input(output))
        calib_models = [i.get(names.K_DIGEST) for i in calib_art.inputs if i.get(names.K_KIND) == names.KIND_MODEL]
        if calib_models and inputs[0].digest not in calib_models:
            raise QerlError(f"{calib} was calibrated on a different model than {model}.")

    def body(tmp: Path) -> dict:
        with ui.status(f"loading {model}", cfg.progress):
            net, tokenizer = modelio.load(source, torch.float32)
        clip = None
        fold_report = None
        if calib_art is not None:
            from . import calibrate

            clip, folds, fold_report = calibrate.apply_calibration(net, calib_art)
            save_file({k: v.float().contiguous() for k, v in folds.items()}, str(tmp / names.FOLDING),
                      metadata={"format": "pt", "meaning": "module weight was divided by this per-channel s"})
        tensors, report = quantize_state(net, cfg, clip, cfg.progress)
        save_file(tensors, str(tmp / names.MODEL_WEIGHTS), metadata={"format": "pt"})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (tmp / names.MODEL_INDEX).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": {k: names.MODEL_WEIGHTS for k in sorted(tensors)}},
            indent=1) + "\n")
        conf = modelio.config_dict(net)
        conf["quantization_config"] = quantization_config(unquantized_linears(net, cfg.targets))
        modelio.write_lineage(tmp, conf, tokenizer, net.generation_config)
        summary = {"method": cfg.method, "layers": report}
        if fold_report is not None:
            summary["folding"] = fold_report
        (tmp / names.QUANT_REPORT).write_text(json.dumps(summary, indent=1) + "\n")
        q_weights = sum(r["shape"][0] * r["shape"][1] for r in report)
        return {"method": cfg.method, "quantized_weights": q_weights,
                "mean_rel_error": sum(r["rel_error"] for r in report) / len(report)}

    art = artifact.run_stage(names.KIND_QUANT, output, config.as_dict(cfg), inputs, body,
                             force=force)
    ui.info(f"quant: {escape(str(art.path))} ({art.metrics.get('method', cfg.method)}, "
            f"mean relative weight error {art.metrics.get('mean_rel_error', float('nan')):.4f})")
    return art
