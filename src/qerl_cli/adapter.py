"""LoRA adapters in PEFT format (``adapter_config.json`` + ``adapter_model.safetensors``), read without peft.

What our engine applies is plain LoRA on the seven projections of each decoder layer (q/k/v/o, gate/up/down):
``y += scaling * (x @ A^T) @ B^T``. peft's per-module ``rank_pattern`` / ``alpha_pattern`` are honoured as
peft does (a pattern key matches a module name ``N`` when ``re.match(rf"(.*\\.)?({key})$", N)``, the first
matching key in the file's order wins; ``scaling = alpha / r`` per module, ``alpha / sqrt(r)`` with
``use_rslora``). Anything else an adapter may carry — LoRA variants such as DoRA, LoRA biases, LoRA or full
copies of other modules (``lm_head``, ``embed_tokens``, ``modules_to_save``), trainable tokens — is refused
with one sentence naming it, never silently dropped. The adapter's digest covers its weights file and the
per-module scalings its config gives.

**Coordinates.** An adapter file holds its factors in the source (unfolded) model's coordinates, whatever base
it was trained on: it loads onto the bf16 model with ``PeftModel.from_pretrained``, onto a round-to-nearest pack
and onto an AWQ pack alike, and means the same policy on each. An AWQ pack's layers compute in folded
coordinates (a group's producer divided by ``s``, its consumers' input columns multiplied by ``s``), so on such
a model :func:`fit_lora` folds the factors (:func:`fold_factors`: ``A * s_in`` for a projection whose input is
folded, ``B / s_out`` for v and up, whose outputs are), and ``lora.save_adapter`` unfolds what was trained there.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file

from . import names
from .artifact import sha256_json
from .engine import PROJECTIONS, LoRA
from .errors import QerlError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# safetensors metadata qerl writes with an adapter (lora.save_adapter): its factors are the source model's
COORDINATES_KEY, SOURCE_COORDINATES = "qerl_coordinates", "source"
# the source model an adapter was trained on ({"spec", "digest"}, JSON), in the weights file's metadata since
# session 31 (``lora.save_adapter``; ``check_base_model``)
BASE_MODEL_KEY = "qerl_base_model"

# adapter_config.json entries that change what the adapter computes beyond plain LoRA (when set / true)
UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "LoRA biases (lora_bias)",
    "modules_to_save": "fully trained module copies (modules_to_save)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
    "layer_replication": "layer replication (layer_replication)",
    "target_parameters": "LoRA on parameters (target_parameters)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "velora_config": "VeLoRA (velora_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "arrow_config": "Arrow routing (arrow_config)",
    "kasa_config": "KaSA (kasa_config)",
}
_PROJECTION = re.compile(r"model\.layers\.\d+\.(" + "|".join(re.escape(p) for p in PROJECTIONS) + r")")


def pattern_key(patterns, name: str) -> str | None:
    """The key of peft's ``rank_pattern`` / ``alpha_pattern`` that applies to module ``name`` (peft's
    ``get_pattern_key``: the first key, in order, that matches the end of the name after a dot), or None."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", name):
            return key
    return name if name in patterns else None  # (peft then looks the name itself up)


PEFT_PREFIX = "base_model.model."  # (PEFT's state-dict keys: this, then the module's name in the base model)
FACTOR_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _unsupported_options(conf: dict) -> list[str]:
    found = [what for k, what in UNSUPPORTED_OPTIONS.items() if conf.get(k)]
    if conf.get("bias", "none") not in ("none", None):
        found.append(f"trained biases (bias = '{conf['bias']}')")
    if str(conf.get("init_lora_weights", "")).lower() == "mica":
        found.append("MiCA (init_lora_weights = 'mica')")
    if conf.get("peft_type", "LORA") not in ("LORA", None):
        found.append(f"a {conf['peft_type']} adapter (peft_type; only LORA is supported)")
    return found


# per projection: the folded module whose factor s scales its input (the group it consumes), and for v and up
# (producers of the o and down groups) the one whose s divides its outputs; keys of an artifact's folding file
_IN_FOLD = {"self_attn.q_proj": "input_layernorm", "self_attn.k_proj": "input_layernorm",
            "self_attn.v_proj": "input_layernorm", "self_attn.o_proj": "self_attn.v_proj",
            "mlp.gate_proj": "post_attention_layernorm", "mlp.up_proj": "post_attention_layernorm",
            "mlp.down_proj": "mlp.up_proj"}
_OUT_FOLD = {"self_attn.v_proj": "self_attn.v_proj", "mlp.up_proj": "mlp.up_proj"}


def model_folding(model) -> dict[str, torch.Tensor]:
    """The AWQ folding factors of ``model`` (module name -> s; empty for an unfolded model)."""
    return getattr(model, "qerl_folding", None) or {}


def fold_factors(factors: dict[str, tuple[torch.Tensor, torch.Tensor]], folds: dict[str, torch.Tensor],
                 to_model: bool = True) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """LoRA factors (name -> (A [r, in], B [out, r])) from the source model's coordinates into those of a model
    folded by ``folds`` (``to_model``), or back. ``B A x`` on the folded input ``x / s_in`` equals ``B (A / s_in)
    x``, and a folded producer's output is the source's divided by ``s_out``: so ``A_model = A_source * s_in``
    (columns) and ``B_model = B_source / s_out`` (rows). Names without a fold pass unchanged (every name when
    ``folds`` is empty); factors keep their dtype."""
    if not folds:
        return factors
    out = {}
    for name, (a, b) in factors.items():
        m = _PROJECTION.search(name)  # (a PEFT key's prefix, e.g. base_model.model., is not in the folds' names)
        if m is not None and m.end() == len(name):
            layer = name[m.start(): m.start(1)]  # "model.layers.N."
            s_in, s_out = folds.get(layer + _IN_FOLD[m.group(1)]), folds.get(layer + _OUT_FOLD.get(m.group(1), "-"))
            if s_in is not None:
                a = (a.float() * s_in.to(a.device) if to_model else a.float() / s_in.to(a.device)).to(a.dtype)
            if s_out is not None:
                b = (b.float() / s_out.to(b.device)[:, None] if to_model
                     else b.float() * s_out.to(b.device)[:, None]).to(b.dtype)
        out[name] = (a, b)
    return out


def load_lora(path: str | Path, model) -> LoRA:
    """Read a PEFT LoRA adapter and check it fits ``model`` (module names and shapes); one clear error for
    anything our engine would not apply exactly. ``model`` None: every check but the fit (``fit_lora`` later: a
    stage reads the adapter, and its digest, before its model loads)."""
    path = Path(path)
    if not (path / ADAPTER_CONFIG).is_file() or not (path / ADAPTER_WEIGHTS).is_file():
        raise QerlError(f"{path} is not a LoRA adapter: it needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}.")
    try:
        conf = json.loads((path / ADAPTER_CONFIG).read_text())
        r = int(conf.get("r", 0))
        alpha = float(conf.get("lora_alpha", 8))  # (peft's LoraConfig default, whatever r is)
        rank_pattern = {str(k): int(v) for k, v in (conf.get("rank_pattern") or {}).items()}
        alpha_pattern = {str(k): float(v) for k, v in (conf.get("alpha_pattern") or {}).items()}
        rslora = bool(conf.get("use_rslora"))
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise QerlError(f"{path / ADAPTER_CONFIG} is not a valid adapter config ({e}).") from None
    if r < 1 or any(v < 1 for v in rank_pattern.values()):
        raise QerlError(f"{path / ADAPTER_CONFIG} has no valid rank r (every rank must be >= 1).")
    if not all(math.isfinite(v) for v in (alpha, *alpha_pattern.values())):
        raise QerlError(f"{path / ADAPTER_CONFIG} has a lora_alpha (or alpha_pattern value) that is not a finite "
                        "number.")
    try:
        tensors = load_file(str(path / ADAPTER_WEIGHTS))
    except Exception as e:  # (safetensors' own error type for a file cut short or not a safetensors file)
        raise QerlError(f"{path / ADAPTER_WEIGHTS} cannot be read ({e}).") from None
    factors: dict[str, list] = {}
    foreign: list[str] = []  # tensors that are not a projection's plain LoRA factor
    magnitudes = False  # DoRA's magnitude vectors
    others: set[str] = set()  # modules outside the projections that carry LoRA factors
    unprefixed: list[str] = []  # keys PEFT's loader would not match (silently dropped there)
    for key, t in tensors.items():
        name = key
        if name.startswith(PEFT_PREFIX):
            name = name[len(PEFT_PREFIX):]
        else:
            unprefixed.append(key)
        m = re.fullmatch(r"(.+)\.lora_(embedding_)?([AB])(\.weight)?", name)
        if re.search(r"\.lora_magnitude_vector(\.weight)?$", name):
            magnitudes = True
        elif m is None:
            foreign.append(name)
        elif m.group(2) or not m.group(4) or not _PROJECTION.fullmatch(m.group(1)):
            others.add(m.group(1))
        else:
            factors.setdefault(m.group(1), [None, None])["AB".index(m.group(3))] = t
    problems = _unsupported_options(conf)
    if magnitudes and not conf.get("use_dora"):
        problems.append("DoRA (lora_magnitude_vector tensors)")
    if others:
        problems.append(f"LoRA on {', '.join(sorted(others)[:3])}{' ...' if len(others) > 3 else ''} (only the "
                        "q/k/v/o/gate/up/down projections of the decoder layers take LoRA)")
    if foreign:
        problems.append(f"tensors other than LoRA factors, such as {', '.join(sorted(foreign)[:2])}")
    if unprefixed:
        problems.append(f"tensor names without PEFT's '{PEFT_PREFIX}' prefix, such as {sorted(unprefixed)[0]} (PEFT "
                        "loads none of them)")
    untargeted = _untargeted(conf, factors)
    if untargeted:
        problems.append(f"factors for modules its config does not target, such as {untargeted[0]} "
                        "(target_modules / exclude_modules / layers_to_transform: PEFT would not apply them)")
    if problems:
        raise QerlError(f"adapter {path} uses what qerl's engine does not apply: {'; '.join(problems)}.")
    if not factors:
        raise QerlError(f"{path / ADAPTER_WEIGHTS} holds no LoRA tensors.")
    out, scalings = {}, {}
    for name, (a, b) in factors.items():
        if a is None or b is None:
            raise QerlError(f"adapter {path} has only one LoRA factor for {name}.")
        try:
            rk, ak = pattern_key(rank_pattern, name), pattern_key(alpha_pattern, name)
        except re.error as e:
            raise QerlError(f"{path / ADAPTER_CONFIG} has a rank_pattern / alpha_pattern key that is not a valid "
                            f"regular expression ({e}).") from None
        r_m = rank_pattern[rk] if rk is not None else r
        alpha_m = alpha_pattern[ak] if ak is not None else alpha
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r_m or b.shape[1] != r_m:
            raise QerlError(f"adapter {path} has {name} factors of shapes {tuple(a.shape)}, {tuple(b.shape)}; its "
                            f"config gives it rank {r_m} ([{r_m}, in] and [out, {r_m}]).")
        if not (a.dtype in FACTOR_DTYPES and b.dtype in FACTOR_DTYPES):
            raise QerlError(f"adapter {path} has {name} factors of type {a.dtype}, {b.dtype}; LoRA factors are "
                            "float16, bfloat16, float32 or float64 (an adapter written wrongly?).")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise QerlError(f"adapter {path} holds NaN or infinite values in {name}.")
        out[name] = (a.float(), b.float())
        scalings[name] = alpha_m / math.sqrt(r_m) if rslora else alpha_m / r_m
    scaling = alpha / math.sqrt(r) if rslora else alpha / r
    if len(set(scalings.values())) > 1:  # per-module scalings: the container has one, the ratio goes into B
        scaling = scaling or 1.0
        out = {n: (a, b if scalings[n] == scaling else b * (scalings[n] / scaling)) for n, (a, b) in out.items()}
    elif scalings:
        scaling = next(iter(scalings.values()))
    # the policy is the factors and their scalings (lora_alpha, r, the patterns, use_rslora): both in the digest,
    # so a changed config is a new adapter to the stages' caches and records (review, session 19)
    # ("coordinates": since session 28 the factors are applied in the source model's coordinates, folded on an
    # AWQ pack: the same file is another policy there than before, so stages keyed on the digest recompute)
    # ("weights": of the tensors, not the file's bytes: safetensors writes its metadata in no fixed order, so one
    # adapter saved twice made two files)
    digest = sha256_json({"weights": tensors_digest(tensors),
                          "scalings": {n: scalings[n] for n in sorted(scalings)}, "coordinates": SOURCE_COORDINATES})
    lora = LoRA(out, scaling, digest)
    lora.unmarked_qerl_checkpoint = _unmarked_qerl_checkpoint(path)
    lora.base_model = _recorded_base_model(path / ADAPTER_WEIGHTS)
    if model is not None:
        fit_lora(lora, model, path)
    return lora


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the tensors' names, dtypes, shapes and bytes, in name order (not over a file's bytes)."""
    h = hashlib.sha256()
    for k in sorted(tensors):
        t = tensors[k].detach().cpu().contiguous()
        h.update(json.dumps([k, str(t.dtype), list(t.shape)]).encode() + b"\0")
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _untargeted(conf: dict, modules) -> list[str]:
    """The factor modules (names in the base model) that PEFT would not give LoRA under the config's
    target_modules, exclude_modules, layers_to_transform and layers_pattern (peft's own matching), sorted. A config
    without target_modules (written by hand: PEFT's own configs always name them) targets what the file holds."""
    targets = conf.get("target_modules")
    if targets is None:
        return []
    from peft.tuners.tuners_utils import _ExcludedModule, check_target_module_exists

    if isinstance(targets, str) and targets.lower() == "all-linear":  # (every linear but the output layer)
        targets = list({n.rsplit(".", 1)[-1] for n in modules})
    rule = SimpleNamespace(target_modules=targets, exclude_modules=conf.get("exclude_modules"),
                           layers_to_transform=conf.get("layers_to_transform"),
                           layers_pattern=conf.get("layers_pattern"), modules_to_save=conf.get("modules_to_save"),
                           target_parameters=None)
    try:
        return sorted(n for n in modules
                      if isinstance(hit := check_target_module_exists(rule, n), _ExcludedModule) or not hit)
    except (re.error, TypeError, ValueError) as e:
        raise QerlError(f"adapter config's target_modules / exclude_modules / layers_to_transform cannot be read "
                        f"({e}).") from None


def _recorded_base_model(weights: Path) -> dict | None:
    """The ``{"spec", "digest"}`` of the model an adapter was trained on, where its file records one."""
    from safetensors import safe_open

    with safe_open(str(weights), "pt") as f:
        raw = (f.metadata() or {}).get(BASE_MODEL_KEY)
    try:
        base = json.loads(raw) if raw else None
    except ValueError:
        return None
    return base if isinstance(base, dict) and isinstance(base.get("digest"), str) else None


def check_base_model(lora: LoRA, base: dict | None, path: str | Path) -> None:
    """One clear error when ``lora`` (read from ``path``) records the model it was trained on and ``base`` (the
    policy's source model, ``rollout.base_model``) is another: the shapes of two fine-tunes of one architecture
    agree, so the fit alone lets it through, and the adapter would run on weights it never saw."""
    trained = getattr(lora, "base_model", None)
    if trained is None or base is None or trained["digest"] == base["digest"]:
        return
    raise QerlError(f"adapter {path} was trained on the model {trained.get('spec')} ({trained['digest'][:19]}), but "
                    f"this policy's weights come from {base['spec']} ({base['digest'][:19]}); give it the model it "
                    "was trained on, or that model's pack.")


def marked_source(weights: str | Path) -> bool:
    """Whether an adapter weights file says it holds the source model's coordinates (``COORDINATES_KEY``, written
    by ``lora.save_adapter`` since session 28)."""
    from safetensors import safe_open

    with safe_open(str(weights), "pt") as f:
        return (f.metadata() or {}).get(COORDINATES_KEY) == SOURCE_COORDINATES


def _unmarked_qerl_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a train checkpoint of a qerl older than session 28, whose factors are in the
    coordinates of the pack it trained on (folded, where that was an AWQ pack), not the source model's. A qerl
    checkpoint has its ``trainer_state.json`` beside an ``optimizer.safetensors`` (``train._save_step``, since the
    first qerl); transformers' and TRL's Trainer also write a ``trainer_state.json`` into their PEFT checkpoints
    (with ``optimizer.pt``): those adapters are third-party ones, in the source model's coordinates."""
    if not ((path / names.TRAINER_STATE).is_file() and (path / names.OPTIMIZER_STATE).is_file()):
        return False
    return not marked_source(path / ADAPTER_WEIGHTS)


def fit_lora(lora: LoRA, model, path: str | Path) -> None:
    """One clear error unless every factor pair of ``lora`` (read from ``path``) fits a projection of ``model``;
    then, on an AWQ-folded model, its factors are folded into the model's coordinates (in place; ``lora.source``
    keeps the file's factors, so fitting it to another model starts from those)."""
    modules = dict(model.named_modules())
    for name, (a, b) in lora.factors.items():
        mod = modules.get(name)
        if mod is None:
            raise QerlError(f"adapter {path} targets {name}, which this model does not have (an adapter for another model?).")
        r_m = a.shape[0]
        if a.shape[1] != mod.in_features or b.shape[0] != mod.out_features:
            raise QerlError(f"adapter {path} has {name} factors of shapes {tuple(a.shape)}, {tuple(b.shape)}; "
                            f"this model needs [{r_m}, {mod.in_features}] and [{mod.out_features}, {r_m}] "
                            "(an adapter for another model?).")
    source = lora.source if lora.source is not None else lora.factors
    folds = model_folding(model)
    if folds and getattr(lora, "unmarked_qerl_checkpoint", False):
        raise QerlError(f"adapter {path} was saved by a qerl before session 28, in the coordinates of the pack it "
                        "trained on, which this AWQ pack cannot tell apart from the source model's; train it again "
                        "with this qerl (its train command with --force: without it, that command is a cache hit "
                        "on the old run).")
    lora.factors = fold_factors(source, folds) if folds else source
    lora.source = source if folds else None
