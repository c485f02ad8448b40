"""``qerl calibrate``: activation-aware (AWQ) scales searched under the NVFP4 quantizer, layer by layer.

For each decoder layer, one forward pass over the calibration tokens (in batches) captures the inputs of the
four smoothing groups — ``input_layernorm → q/k/v``, ``v → o`` (only without grouped-query attention, where
v's outputs map one-to-one onto o's inputs), ``post_attention_layernorm → gate/up``, ``up → down`` — as
per-channel mean |x| over every token plus a fixed-seed token subset for the error. The search itself is
:mod:`qerl_cli.awq` (pure math). A consumer group (o, down) is searched first, jointly with the error its fold
causes in its producer group (q/k/v, gate/up); the producer is then searched on the folded weights with that
error still measured in the unfolded model's units (``row_scale``). Scales are folded in the same order by
``quantize --calib``; only one layer's activations are held at a time, plus the running hidden states.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.table import Table
from safetensors.torch import save_file

from . import artifact, awq, config, data, modelio, names, nvfp4, ui
from .errors import QerlError

SEARCH_VERSION = "qerl.awq/3"  # bump when the search's results change for the same inputs and config


@dataclass
class CalibrateConfig:
    samples: int
    seq_len: int
    field: str
    split: str
    seed: int
    n_grid: int
    clip_search: bool
    clip_ratios: tuple[float, ...]
    max_tokens: int
    batch_size: int
    progress: bool
    device: str = "cpu"

    def __post_init__(self):
        problems = []
        if self.samples < 1:
            problems.append("samples must be >= 1")
        if self.seq_len < 2:
            problems.append("seq_len must be >= 2")
        if self.batch_size < 1:
            problems.append("batch_size must be >= 1")
        if not self.field.strip():
            problems.append("field must name a column")
        problems += config.seed_problems(seed=self.seed)
        try:
            self.awq_config()
        except ValueError as e:
            problems.append(str(e))
        config.validate(problems)

    def awq_config(self) -> awq.AWQConfig:
        return awq.AWQConfig(n_grid=self.n_grid, clip_search=self.clip_search, clip_ratios=self.clip_ratios,
                             max_tokens=self.max_tokens, seed=self.seed)


@dataclass(frozen=True)
class Group:
    """A smoothing group: ``prev`` produces the input of ``linears`` (names relative to a decoder layer)."""

    name: str
    prev: str
    prev_is_norm: bool
    linears: tuple[str, ...]


# Search (and folding) order. A linear-output fold rescales the rows of a linear that another group
# quantizes (v -> o rescales v of q/k/v; up -> down rescales up of gate/up), so those groups go first: the
# q/k/v and gate/up searches then see the weights that will really be quantized, shared global scale included,
# and weigh each divided row's error by its scale squared (awq's row_scale), so that they, their clip search
# and the reported errors measure the unfolded model's output error, as the consumer's coupled search did.
GROUPS = (
    Group("o", "self_attn.v_proj", False, ("self_attn.o_proj",)),
    Group("qkv", "input_layernorm", True, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    Group("down", "mlp.up_proj", False, ("mlp.down_proj",)),
    Group("gate_up", "post_attention_layernorm", True, ("mlp.gate_proj", "mlp.up_proj")),
)


#: Model types whose decoder layers fold exactly: pre-norm, ``input_layernorm`` feeding q/k/v and
#: ``post_attention_layernorm`` feeding gate/up, both weight-only RMSNorm ``x_hat * w`` (dividing ``w`` by s
#: divides the norm's output by s). Not Gemma (``x_hat * (1 + w)``; in Gemma 2/3 ``post_attention_layernorm``
#: normalizes the attention output, not the MLP input), StableLM / Cohere (LayerNorm with bias), OLMo 2
#: (post-norm) or Phi-3 (fused qkv_proj).
FOLDABLE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def check_foldable(model_type: str | None, what: str) -> None:
    """Refuse AWQ folding on a model type outside :data:`FOLDABLE_MODEL_TYPES` (``what``: the model, for the
    message)."""
    if model_type not in FOLDABLE_MODEL_TYPES:
        raise QerlError(f"AWQ calibration folds its scales into pre-norm weight-only RMSNorm weights, which is exact "
                        f"only for {', '.join(FOLDABLE_MODEL_TYPES)} models, and {what} is a '{model_type}' model: "
                        f"quantize it without --calib (round-to-nearest) instead.")


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layers of a model whose AWQ scales fold exactly (:func:`check_foldable`)."""
    check_foldable(getattr(model.config, "model_type", None), "this")
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise QerlError("calibrate supports decoder-only models with model.layers (Llama, Qwen2, Mistral, ...).")
    return layers


def active_groups(layer) -> list[Group]:
    """The groups a layer supports (v → o only when v's outputs map one-to-one onto o's inputs)."""
    out = []
    for g in GROUPS:
        try:
            prev = layer.get_submodule(g.prev)
            mods = [layer.get_submodule(n) for n in g.linears]
        except AttributeError:
            raise QerlError(f"calibrate needs Llama-style layers with {g.prev} and {', '.join(g.linears)}.") from None
        if g.prev_is_norm and getattr(prev, "bias", None) is not None:
            raise QerlError(f"{g.prev} has a bias: AWQ folding needs weight-only RMSNorm layers.")
        if not g.prev_is_norm and prev.weight.shape[0] != mods[0].in_features:
            continue  # grouped-query attention: v has fewer outputs than o has inputs
        if not g.prev_is_norm and g.name == "o":
            attn = layer.self_attn
            heads = getattr(attn.config, "num_attention_heads", None)
            kv = getattr(attn.config, "num_key_value_heads", heads)
            if heads != kv:
                continue
        out.append(g)
    return out


def build_samples(records: data.Records, tokenizer, cfg: CalibrateConfig) -> tuple[torch.Tensor, dict]:
    """``[samples, seq_len]`` token ids from rows in a seeded order, concatenated with eos between rows."""
    if not records.rows:
        raise QerlError(f"the calibration data {records.origin['spec']} hold no rows.")
    fields = [f.strip() for f in cfg.field.split(",")]
    order = list(range(len(records.rows)))
    random.Random(cfg.seed).shuffle(order)
    need = cfg.samples * cfg.seq_len
    ids: list[int] = []
    used, lengths = [], []
    chat = False
    eos = tokenizer.eos_token_id
    for i in ui.track(order, "tokenizing calibration rows", enabled=cfg.progress):
        text = data.row_text(records.rows[i], fields, tokenizer)
        toks = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not toks:
            continue
        ids.extend(toks + ([eos] if eos is not None else []))
        used.append(i)
        lengths.append(len(toks))
        chat |= data.is_chat_row(records.rows[i], fields)
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise QerlError(f"the calibration data hold {len(ids)} tokens, fewer than {cfg.samples} sequences of "
                        f"{cfg.seq_len} tokens need ({need}); lower --samples or --seq-len.")
    tokens = torch.tensor(ids[:need]).reshape(cfg.samples, cfg.seq_len)
    return tokens, {"row_indices": used, "row_token_lengths": lengths, "tokens": need, "chat_shaped": chat}


class _Capture:
    """Per-channel sum |x| over all tokens plus the rows of a fixed token subset, for one linear's input."""

    def __init__(self, keep: torch.Tensor):
        self.keep = keep  # sorted global token indices to keep
        self.abs_sum = None
        self.count = 0
        self.rows: list[torch.Tensor] = []
        self.offset = 0

    def __call__(self, module, args):
        x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
        s = x.abs().sum(0)
        self.abs_sum = s if self.abs_sum is None else self.abs_sum + s
        lo, hi = self.offset, self.offset + x.shape[0]
        sel = self.keep[(self.keep >= lo) & (self.keep < hi)] - lo
        if sel.numel():
            self.rows.append(x[sel].clone())
        self.count += x.shape[0]
        self.offset = hi

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat(self.rows), self.abs_sum / self.count


#: Attention implementations that take the explicit additive mask of :func:`causal_mask` (calibrate loads
#: models with "sdpa" whatever their config asks for).
MASKED_ATTENTION = ("sdpa", "eager")


def causal_mask(seq: int, window: int | None, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive ``[1, 1, seq, seq]`` mask: query i sees keys j <= i (and i - j < window for a sliding-window
    layer), as the model's own forward masks them; the rest get the dtype's lowest value."""
    i = torch.arange(seq, device=device).unsqueeze(1)
    j = torch.arange(seq, device=device).unsqueeze(0)
    allowed = j <= i
    if window is not None:
        allowed &= (i - j) < window
    mask = torch.zeros(seq, seq, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def _sliding_window(attn) -> int | None:
    if hasattr(attn, "sliding_window"):  # Qwen2/Qwen3: per layer (None on full-attention layers)
        return attn.sliding_window
    return getattr(attn.config, "sliding_window", None)  # Mistral: every layer


def _run_layer(layer, hidden: torch.Tensor, rotary, batch_size: int) -> torch.Tensor:
    """One decoder layer over ``hidden [B, T, H]`` in batches, causal (an explicit mask: with ``attention_mask``
    None, eager attention would be bidirectional)."""
    attn = layer.self_attn
    impl = getattr(attn.config, "_attn_implementation", None)
    if impl not in MASKED_ATTENTION:
        raise QerlError(f"calibrate runs layers with {' or '.join(MASKED_ATTENTION)} attention, not '{impl}'.")
    out = torch.empty_like(hidden)
    seq = hidden.shape[1]
    pos = torch.arange(seq, device=hidden.device).unsqueeze(0)
    mask = causal_mask(seq, _sliding_window(attn), hidden.dtype, hidden.device)
    for b in range(0, hidden.shape[0], batch_size):
        h = hidden[b: b + batch_size]
        pe = rotary(h, pos.expand(h.shape[0], -1))
        r = layer(h, attention_mask=mask.expand(h.shape[0], -1, -1, -1), position_ids=pos.expand(h.shape[0], -1),
                  position_embeddings=pe)
        out[b: b + batch_size] = r[0] if isinstance(r, tuple) else r
    return out


def fold_group(layer, group: Group, s: torch.Tensor) -> None:
    """Fold scales ``s`` into a layer in place: ``prev`` divided by s, consumers' input columns times s."""
    with torch.no_grad():
        prev = layer.get_submodule(group.prev)
        if group.prev_is_norm:
            prev.weight.copy_(awq.fold_into_norm(prev.weight, s).to(prev.weight.dtype))
        else:
            prev.weight.copy_(awq.fold_into_linear_output(prev.weight, s).to(prev.weight.dtype))
            if prev.bias is not None:
                prev.bias.copy_((prev.bias.float() / s).to(prev.bias.dtype))
        for name in group.linears:
            lin = layer.get_submodule(name)
            lin.weight.copy_(awq.apply_scales_to_weights([lin.weight], s)[0].to(lin.weight.dtype))


def _owner(groups: list[Group], g: Group) -> Group | None:
    """For a linear-output group, the group that quantizes its ``prev`` linear (its producer)."""
    if g.prev_is_norm:
        return None
    return next((o for o in groups if g.prev in o.linears), None)


def _producer(groups: list[Group], g: Group, captures: dict, layer,
              row_scale: dict[str, torch.Tensor]) -> "awq.Producer | None":
    """For a linear-output group, the (not yet searched) group that holds its ``prev`` linear, with the row
    scales earlier folds divided its members by."""
    owner = _owner(groups, g)
    if owner is None:
        return None
    x, _ = captures[owner.name].result()
    return awq.Producer(x, [layer.get_submodule(n).weight.detach().float() for n in owner.linears],
                        owner.linears.index(g.prev), [row_scale.get(n) for n in owner.linears])


def search_layer(layer, hidden: torch.Tensor, rotary, keep: torch.Tensor, cfg: CalibrateConfig, where: str = "a layer"
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[dict], dict[str, float]]:
    """Search and fold one layer; returns (next hidden, scales per group, report rows, clip ratios).

    Every error and output power is measured in the units of the unfolded layer's function (mean squared
    output error over the same tokens): a group whose output rows an earlier consumer's fold divided by
    ``s_c`` (up_proj by down's scales, v_proj by o's) has those rows' errors weighted by ``s_c^2``. Each row
    holds ``error_rtn`` / ``ref_power_rtn`` (round-to-nearest of the original weights), ``error_alpha0`` (the
    group's alpha = 0 candidate: round-to-nearest of its weights as the earlier folds left them; equals
    ``error_rtn`` unless a fold divided its rows), ``error_awq`` / ``ref_power_awq`` (the final weights, scale
    and clip ratios applied; ``ref_power_awq`` equals ``ref_power_rtn`` up to rounding) and, for a group
    searched with its producer, ``producer`` and ``producer_error`` (the producer's error at the chosen scale,
    which is the producer's ``error_alpha0``)."""
    groups = active_groups(layer)
    captures = {g.name: _Capture(keep) for g in groups}
    handles = [layer.get_submodule(g.linears[0]).register_forward_pre_hook(captures[g.name]) for g in groups]
    try:
        with torch.no_grad():
            nxt = _run_layer(layer, hidden, rotary, cfg.batch_size)
    finally:
        for h in handles:
            h.remove()
    # (the search refuses non-finite inputs with a ValueError: name the layer instead; abs_sum covers every token)
    if not torch.isfinite(nxt).all() or not all(torch.isfinite(c.abs_sum).all() for c in captures.values()):
        raise QerlError(f"{where} produced NaN or infinite activations on the calibration data.")
    acfg = cfg.awq_config()
    # the RTN baseline: the layer's weights before any fold (copies: the folds work in place)
    original = {n: layer.get_submodule(n).weight.detach().float().clone() for g in groups for n in g.linears}
    scales: dict[str, torch.Tensor] = {}
    xs: dict[str, torch.Tensor] = {}
    rows: list[dict] = []
    # linear name -> the factors a consumer's fold divided its output rows by (the consumer multiplies them back)
    row_scale: dict[str, torch.Tensor] = {}
    for g in groups:  # scales, folded in order (a later group sees the earlier folds, as quantize applies them)
        x, stats = captures[g.name].result()
        weights = [layer.get_submodule(n).weight.detach().float().clone() for n in g.linears]
        rs = [row_scale.get(n) for n in g.linears]
        producer = _producer(groups, g, captures, layer, row_scale)
        if producer is None:
            res = awq.search_scales(x, weights, acfg, stats=stats, row_scale=rs)
        else:  # v -> o, up -> down: also weigh what the fold does to the group that produces x
            res = awq.search_scales_coupled(x, weights, producer, acfg, stats=stats, row_scale=rs)
        fold_group(layer, g, res.scales)
        if not g.prev_is_norm:
            row_scale[g.prev] = res.scales if g.prev not in row_scale else row_scale[g.prev] * res.scales
        scales[g.name] = res.scales
        xs[g.name] = x
        xe = awq.subsample_tokens(x, acfg.max_tokens, acfg.seed)
        orig = [original[n] for n in g.linears]
        row = {"group": g.name, "alpha": res.alpha, "error_rtn": awq.group_error(xe, orig),
               "ref_power_rtn": awq.output_power(xe, orig), "error_alpha0": res.error_rtn}
        if producer is not None:
            row |= {"producer": _owner(groups, g).name, "producer_error": res.producer_error}
        rows.append(row)
    clip: dict[str, float] = {}
    for g, row in zip(groups, rows):  # clip ratios under the final (all folds applied) weights
        x = awq.subsample_tokens(xs[g.name] / scales[g.name], acfg.max_tokens, acfg.seed)
        weights = [layer.get_submodule(n).weight.detach().float() for n in g.linears]
        rs = [row_scale.get(n) for n in g.linears]
        ratios = [1.0] * len(weights)
        if cfg.clip_search:  # ratio 1.0 is a candidate and reproduces the unclipped error: never worse
            ratios = [float(r) for r in awq.search_clip(x, weights, None, acfg, row_scale=rs).ratios]
        row["clip_ratios"] = dict(zip(g.linears, ratios))
        row["error_awq"] = awq.group_error(x, weights, None, ratios, row_scale=rs)
        # the unfolded output power again, from the final weights (the row scales undo a producer fold)
        row["ref_power_awq"] = awq.output_power(x, weights, row_scale=rs)
        for n, r in zip(g.linears, ratios):
            clip[n] = r
    return nxt, scales, rows, clip


def calibrate(model: str, data_spec: str, output: str | Path, samples: int | None = None, seq_len: int | None = None,
              field: str | None = None, seed: int | None = None, config_file: str | Path | None = None,
              force: bool = False, progress: bool = True, device: str | None = None) -> artifact.Artifact:
    """Search AWQ scales (and clip ratios) for MODEL on calibration text; write a ``calib`` artifact.

    ``device`` (default: CUDA where available): where each layer's forward and search run, in fp32; the model
    stays on the CPU and one layer at a time moves to the device."""
    output = Path(output)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cpu" and not (device.split(":")[0] == "cuda" and torch.cuda.is_available()):
        raise QerlError(f"calibrate --device must be 'cpu' or 'cuda' on a machine with CUDA; got '{device}'"
                        f"{'' if torch.cuda.is_available() else ' and no CUDA device is available'}.")
    if device != "cpu":  # 'cuda:N': N one of this machine's GPUs (else a torch traceback inside the stage)
        index = device.partition(":")[2]
        if ":" in device and not (index.isdigit() and int(index) < torch.cuda.device_count()):
            raise QerlError(f"calibrate --device '{device}' is not one of this machine's "
                            f"{torch.cuda.device_count()} CUDA device(s) (cuda, cuda:0, ...).")
    cfg = config.load("calibrate", CalibrateConfig, config_file,
                      {"samples": samples, "seq_len": seq_len, "field": field, "seed": seed, "progress": progress,
                       "device": device})
    source = modelio.resolve(model)
    if source.gguf_file is None:  # (a GGUF's type is known once loaded: decoder_layers checks it then)
        check_foldable(modelio.config_model_type(source.directory), model)
    records = data.load_records(data_spec, cfg.split)
    data_input = artifact.Input("data", data_spec, records.origin.get("sha256") or
                                artifact.sha256_json(records.origin))
    inputs = [source.as_input(), data_input]

    def body(tmp: Path) -> dict:
        with ui.status(f"loading {model}", cfg.progress):
            net, tokenizer = modelio.load(source, torch.float32, attn_implementation="sdpa")
        tokens, sample_info = build_samples(records, tokenizer, cfg)
        layers = decoder_layers(net)
        for i, layer in enumerate(layers):  # (before any forward: the search quantizes every group's weights)
            for grp in active_groups(layer):
                for n in grp.linears:
                    nvfp4.check_in_features(f"model.layers.{i}.{n}", layer.get_submodule(n).in_features)
        total = tokens.numel()
        g = torch.Generator().manual_seed(cfg.seed)
        dev = torch.device(cfg.device)
        keep = torch.randperm(total, generator=g)[: min(cfg.max_tokens, total)].sort().values.to(dev)
        with torch.no_grad():
            hidden = net.model.embed_tokens(tokens).float().to(dev)
        rotary = net.model.rotary_emb.to(dev)
        all_scales: dict[str, torch.Tensor] = {}
        report: list[dict] = []
        clip: dict[str, float] = {}
        for i in ui.track(range(len(layers)), "calibrating layers", total=len(layers), enabled=cfg.progress):
            prefix = f"model.layers.{i}"
            layers[i].to(dev)
            hidden, scales, rows, layer_clip = search_layer(layers[i], hidden, rotary, keep, cfg, where=f"layer {i}")
            layers[i].to("cpu")
            for gname, s in scales.items():
                all_scales[f"{prefix}.{gname}"] = s.cpu().contiguous()
            for r in rows:
                report.append({"layer": i, **r, "clip_ratios": {f"{prefix}.{k}": v for k, v in r["clip_ratios"].items()}})
            clip.update({f"{prefix}.{k}": v for k, v in layer_clip.items()})
            if not torch.isfinite(hidden).all():
                raise QerlError(f"layer {i} produced NaN or infinite activations on the calibration data.")
        save_file(all_scales, str(tmp / names.CALIB_SCALES), metadata={"format": "pt"})
        (tmp / names.CALIB_REPORT).write_text(json.dumps({"groups": report, "clip_ratios": clip}, indent=1) + "\n")
        (tmp / names.CALIB_SAMPLES).write_text(json.dumps(
            {"data": records.origin, "field": cfg.field, "seed": cfg.seed, "samples": cfg.samples,
             "seq_len": cfg.seq_len, **sample_info}, indent=1) + "\n")
        modelio.write_lineage(tmp, modelio.config_dict(net), tokenizer, net.generation_config)
        by_type: dict[str, list[tuple[float, float]]] = {}
        for r in report:
            by_type.setdefault(r["group"], []).append((r["error_rtn"], r["error_awq"]))
        return {"groups": len(report), "mean_error_rtn": {k: sum(a for a, _ in v) / len(v) for k, v in by_type.items()},
                "mean_error_awq": {k: sum(b for _, b in v) / len(v) for k, v in by_type.items()}}

    # the search's version is part of the key: a calib from an earlier search (non-causal layers under eager
    # attention, coupled errors in the producer's units, a producer group searched and reported in its folded
    # units) is recomputed, not served from the cache
    run_config = config.as_dict(cfg) | {"search": SEARCH_VERSION}
    if records.origin.get("type") == "file":  # a local file has no splits (load_records ignores it): not in the key
        run_config["split"] = None
    if not cfg.clip_search:  # the clip ratios are never read without the clip search
        run_config["clip_ratios"] = None
    art = artifact.run_stage(names.KIND_CALIB, output, run_config, inputs, body, force=force)
    print_summary(art.read_json(names.CALIB_REPORT))
    return art


def relative_errors(row: dict) -> tuple[float, float]:
    """(RTN, AWQ) output MSE of a group relative to its output power (original weights for RTN, final ones
    for AWQ), both in the unfolded model's units."""
    return (row["error_rtn"] / max(row["ref_power_rtn"], 1e-30), row["error_awq"] / max(row["ref_power_awq"], 1e-30))


def print_summary(report: dict) -> None:
    t = Table(title="qerl calibrate — output MSE per group (RTN vs AWQ, relative to output power)",
              caption="in the unfolded model's units; one group of a pair (o and q/k/v, down and gate/up, searched "
                      "jointly) may lose a little to RTN where the other gains more, never the pair's sum")
    for c in ("layer", "group", "alpha", "clip", "RTN rel. err", "AWQ rel. err", "gain"):
        t.add_column(c, justify="right")
    for r in report["groups"]:
        rel_rtn, rel_awq = relative_errors(r)
        clips = ",".join(f"{v:g}" for v in r["clip_ratios"].values())
        gain = rel_rtn / rel_awq if rel_awq > 0 else float("inf")
        t.add_row(str(r["layer"]), r["group"], f"{r['alpha']:.2f}", clips, f"{rel_rtn:.3e}", f"{rel_awq:.3e}",
                  f"{gain:.2f}x")
    ui.out.print(t)


def apply_calibration(model, calib: artifact.Artifact) -> tuple[dict[str, float], dict[str, torch.Tensor], dict]:
    """Fold a calib artifact's scales into ``model`` (float function unchanged); return (clip ratios per
    linear, folding factors per folded module, summary). The folding factor ``s`` of a norm means its weight
    was divided by ``s``; the rollout engine divides each AQN draw by it, so sigma keeps its meaning on the
    unfolded scales."""
    scales = calib.read_tensors(names.CALIB_SCALES)  # (one sentence for a damaged file, not a traceback)
    report = calib.read_json(names.CALIB_REPORT)
    layers = decoder_layers(model)
    folds: dict[str, torch.Tensor] = {}
    for key, s in scales.items():
        prefix, _, gname = key.rpartition(".")
        try:
            i = int(prefix.rsplit(".", 1)[-1])
            layer = layers[i]
        except (ValueError, IndexError):
            raise QerlError(f"{calib.path} has scales for {key}, which this model does not have.") from None
        group = next((g for g in GROUPS if g.name == gname), None)
        if group is None:
            raise QerlError(f"{calib.path} has scales of an unknown group '{gname}'.")
        if s.shape != (layer.get_submodule(group.linears[0]).in_features,) or not torch.isfinite(s).all():
            raise QerlError(f"{calib.path} holds scales {key} of the wrong shape or with NaNs for this model.")
    for i, layer in enumerate(layers):  # same order as the search
        for g in GROUPS:
            s = scales.get(f"model.layers.{i}.{g.name}")
            if s is not None:
                fold_group(layer, g, s)
                folds[f"model.layers.{i}.{g.prev}"] = s
    return report["clip_ratios"], folds, {"groups": len(scales)}
