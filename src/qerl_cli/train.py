"""``qerl train``: GRPO/DAPO with LoRA on the frozen NVFP4 backbone, under the AQN noise schedule.

One step (DESIGN §4): the AQN sigma of this step (``grpo.aqn_sigma``) → rollout of ``prompts_per_step``
prompts x ``group`` samples with the current adapter through our engine (one noise draw per engine call of
``batch_prompts`` prompts, or per prompt with ``noise_scope = "group"``; each draw's seed derived from
(seed, step, round, prompt position) and recorded by its derivation) → rewards (answer check + optional
format reward + optional overlong penalty) → group advantages → optional dynamic sampling (drop all-equal
groups, draw more prompts, at most ``max_sampling_rounds`` rounds) → ``num_iterations`` passes over
``minibatches`` minibatches: teacher-forced log-probs through LoRA, clipped surrogate against the **recorded
behaviour log-probs**, gradient all-reduce, clipping, AdamW at the step's learning rate.

Objective for AQN (``objective``): ``clean`` (default) trains the clean policy (no noise in the training
forward) on data sampled by the noisy one; ``replay`` redraws each rollout call's noise exactly (same seed,
scope and rows) so the training forward is the conditional noisy policy that sampled the data.

The run directory is a ``run`` artifact written **incrementally**, which the atomic-artifact contract
(DESIGN §2) accommodates this way:

* ``train_config.json`` (resolved config, inputs, cache key, policy, definitions) is written first;
  ``metrics.jsonl`` gets one line per completed step.
* each checkpoint ``step-00000050/`` (PEFT adapter, ``optimizer.safetensors``, ``rng.safetensors``,
  ``trainer_state.json`` with the step and the data cursor, and last ``checkpoint_hashes.json``: the sha256 and
  size of each of those files) is written into a temporary sibling and renamed: a step dir that exists is
  complete, and ``--resume`` checks its hashes before loading it (a step dir without them is incomplete).
* ``manifest.json`` is written last (atomically), when every step is done: only then is the directory a
  complete, cacheable artifact (rerunning the same command is a cache hit). A directory without a manifest
  is an unfinished run: ``--resume`` continues from its last complete step dir (``metrics.jsonl`` is cut back
  to that step) and gives the same metrics and adapter as an uninterrupted run; without ``--resume`` it is
  refused (``--force`` starts over).

Data parallel: under ``torchrun --nproc-per-node N`` each rank samples its shard of every step's prompts
(``prompts_per_step / N``), group statistics stay within groups (a group never spans ranks), loss
denominators and metrics are summed over ranks, LoRA gradients are all-reduced (sum of per-rank sums over
the global denominator), and rank 0 writes. Dynamic sampling keeps the first informative groups of the global
draw, as one process does, so the ranks may train different numbers of groups. With ``minibatches = 1`` and
``batch_prompts`` dividing the shard, N ranks compute the same update as one process on the same global batch (up
to float rounding).
"""

from __future__ import annotations

import collections
import contextlib
import datetime as _dt
import json
import math
import os
import random
import resource
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.markup import escape
from safetensors.torch import load_file, save_file

from . import artifact, config, grpo, lora, modelio, names, rollout, stats, tasks, ui
from .adapter import model_folding
from .engine import Engine, SamplingConfig, check_positions, derive_seed
from .errors import QerlError

MAX_EPS_HIGH = 1e6  # (a ratio clamped at 1 + 1e39 overflows fp32: an upper clip that large is off anyway)
NONDETERMINISTIC_METRICS = ("time_", "tokens_per_s", "peak_")
ENTROPY_DEFINITION = ("entropy: Monte Carlo estimate of the per-token entropy of the sampling distribution, "
                      "-mean(behaviour log-prob) over generated tokens")
GAP_DEFINITION = ("logprob_gap_abs / logprob_gap_mean: mean |logp_train - logp_behaviour| and mean "
                  "(logp_train - logp_behaviour) over the generated tokens of the step's first minibatch (all of "
                  "its data when minibatches = 1), evaluated before any optimizer step, so the gap is the "
                  "sampler/trainer mismatch (noise, kernels, truncation) and never the update's own drift")
NOISE_SEEDS_DEFINITION = ("noise_seeds in metrics.jsonl: one per engine call of the step (rounds in order, then "
                          "by the call's first prompt position over all ranks), each int.from_bytes(sha256("
                          "f'{seed}:noise:{step - 1}:{round}:{first prompt position}').digest()[:8], 'little') >> 1 "
                          "(step as logged, counting from 1; empty when sigma = 0)")

SAMPLING_SEEDS_DEFINITION = ("each engine call's sampling seed: int.from_bytes(sha256(f'{seed}:sample:{step - 1}:"
                             "{round}:{first prompt position}').digest()[:8], 'little') >> 1 (step as logged, "
                             "counting from 1)")


@dataclass
class TrainConfig:
    task: str
    num_problems: int
    steps: int
    prompts_per_step: int
    group: int
    batch_prompts: int
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    num_iterations: int
    minibatches: int
    lr: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    warmup_steps: int
    min_lr_ratio: float
    max_grad_norm: float
    lora_rank: int
    lora_alpha: float
    lora_targets: tuple[str, ...]
    eps_low: float
    eps_high: float
    loss_aggregation: str
    adv_scale: str
    adv_eps: float
    mask_truncated: bool
    overlong_buffer: int
    overlong_penalty: float
    format_reward: float
    dynamic_sampling: bool
    max_sampling_rounds: int
    sigma_start: float
    sigma_end: float
    sigma_stages: int
    noise_scope: str
    noise_final_norm: bool
    objective: str
    save_every: int
    seed: int
    autocast: bool
    cuda_graph: bool
    gradient_checkpointing: bool
    time_budget_s: float
    eval_every: int
    eval_task: str
    eval_problems: int
    eval_temperature: float
    progress: bool
    skip_verify: bool = False
    device: str = "cpu"
    world_size: int = 1

    def __post_init__(self):
        self.lora_targets = tuple(str(t) for t in self.lora_targets)
        p = []
        for name in ("steps", "prompts_per_step", "group", "batch_prompts", "max_new_tokens", "num_iterations",
                     "minibatches", "lora_rank", "sigma_stages", "save_every", "max_sampling_rounds"):
            if getattr(self, name) < 1:
                p.append(f"{name} must be >= 1")
        if self.group < 2:
            p.append("group (G) must be >= 2: a group of one has no advantage")
        if self.prompts_per_step % self.world_size:
            p.append(f"prompts_per_step ({self.prompts_per_step}) must be a multiple of the number of ranks "
                     f"({self.world_size})")
        if self.loss_aggregation not in grpo.AGGREGATIONS:
            p.append(f"loss_aggregation must be one of {list(grpo.AGGREGATIONS)}")
        if self.adv_scale not in grpo.ADV_SCALES:
            p.append(f"adv_scale must be one of {list(grpo.ADV_SCALES)}")
        if self.noise_scope not in ("batch", "group"):
            p.append("noise_scope must be 'batch' or 'group'")
        p += config.seed_problems(seed=self.seed)
        if self.objective not in ("clean", "replay"):
            p.append("objective must be 'clean' or 'replay'")
        if not (0 < self.lr < math.inf and 0 <= self.eps_low < 1 and 0 <= self.eps_high <= MAX_EPS_HIGH
                and 0 <= self.max_grad_norm < math.inf):
            p.append(f"lr must be finite and > 0, eps_low in [0, 1) (at 1 or above the lower clip 1 - eps_low is gone), "
                     f"eps_high in [0, {MAX_EPS_HIGH:g}] (that large already leaves the upper clip off) and "
                     f"max_grad_norm finite and >= 0")  # (NaN fails too)
        if not (0 <= self.adv_eps < math.inf and 0 <= self.overlong_penalty < math.inf):
            p.append("adv_eps and overlong_penalty must be finite and >= 0 (a negative adv_eps can divide by zero; a "
                     "negative overlong_penalty turns the penalty into a bonus)")
        if not (0 <= self.sigma_start < math.inf and 0 <= self.sigma_end < math.inf):  # (NaN fails too)
            p.append("sigma_start and sigma_end must be finite and >= 0")
        if not 0 < self.lora_alpha < math.inf:
            p.append("lora_alpha must be finite and > 0 (at 0 the adapter's update is scaled to nothing: training "
                     "would change no token)")
        if not -math.inf < self.format_reward < math.inf:
            p.append("format_reward must be a finite number")
        noisy = self.sigma_stages >= 2 and (self.sigma_start > 0 or self.sigma_end > 0)
        if noisy and (self.sigma_start == 0) != (self.sigma_end == 0):
            p.append("an AQN schedule needs sigma_start and sigma_end both > 0 (or both 0 for no noise)")
        elif noisy and self.sigma_stages == 2 and self.sigma_start != self.sigma_end:
            p.append("sigma_stages = 2 has a single noisy stage, so sigma_end must equal sigma_start (or use >= 3 "
                     "stages for a geometric schedule)")
        if noisy and self.steps < self.sigma_stages:
            p.append(f"steps ({self.steps}) must be >= sigma_stages ({self.sigma_stages}) so that every AQN stage, "
                     "sigma_start and sigma_end included, gets a step (lower sigma_stages, or turn AQN off with "
                     "sigma_start = sigma_end = 0)")
        if not (0 <= self.time_budget_s < math.inf and self.eval_every >= 0 and self.eval_problems >= 1
                and 0 <= self.eval_temperature < math.inf):  # (NaN fails too)
            p.append("time_budget_s and eval_temperature must be finite and >= 0, eval_every >= 0 and eval_problems "
                     ">= 1")
        if self.eval_every and not self.eval_task and not tasks.is_generated(self.task):
            p.append("eval_every needs eval_task (a held-out dataset) when the task is not the arith generator")
        if self.warmup_steps < 0 or not 0 <= self.min_lr_ratio <= 1 or self.overlong_buffer < 0:
            p.append("warmup_steps and overlong_buffer must be >= 0 and min_lr_ratio in [0, 1]")
        if self.overlong_buffer > self.max_new_tokens:
            p.append(f"overlong_buffer ({self.overlong_buffer}) must be <= max_new_tokens ({self.max_new_tokens}): the "
                     "penalty starts at max_new_tokens - overlong_buffer, so a larger buffer penalises every completion")
        if not self.lora_targets:
            p.append("lora_targets must name at least one projection")
        if self.top_k != 0 or self.top_p != 1:
            p.append("top_k and top_p must be off (0 and 1.0) for training: a truncated draw's behaviour log-probs "
                     "come from the renormalised top-k / nucleus, while the policy trained is the whole tempered "
                     "softmax, so every importance ratio would start below 1 and the clipped objective would "
                     "shrink or drop the updates")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1 and 0 <= self.weight_decay < math.inf):
            p.append("adam_beta1 and adam_beta2 must be in [0, 1) and weight_decay finite and >= 0")
        if self.num_problems < 0:
            p.append("num_problems must be >= 0 (0 = all)")
        if self.temperature == 0:
            p.append("temperature must be > 0 for training: greedy samples of a group are identical (no advantage) "
                     "and have no sampling distribution for the importance ratio")
        try:
            self.sampling()
        except ValueError as e:
            p.append(str(e))
        config.validate(p)

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_p, self.top_k, self.max_new_tokens)

    def eval_sampling(self) -> SamplingConfig:
        return SamplingConfig(self.eval_temperature, self.top_p, self.top_k, self.max_new_tokens)

    def sigma(self, step: int) -> float:
        if self.sigma_start == 0 and self.sigma_end == 0:
            return 0.0
        return grpo.aqn_sigma(step, self.steps, self.sigma_start, self.sigma_end, self.sigma_stages)


# ------------------------------------------------------------------------------------------ helpers


def check_diverged(adapter_norm: float, step: int, lr: float) -> None:
    """A clear stop when the adapter is no longer finite (a learning rate far too high): the run stays unfinished,
    its checkpoints before this step intact, instead of sampling from NaN weights on the next step."""
    if not math.isfinite(adapter_norm):
        raise QerlError(f"training diverged at step {step}: the adapter's weights are no longer finite (lr {lr:g}); "
                        "start the run over with --force and a lower lr.")


class PromptStream:
    """Problem indices in a seeded order, reshuffled every epoch; ``cursor`` = prompts consumed so far."""

    def __init__(self, n: int, seed: int, cursor: int = 0):
        self.n, self.seed, self.cursor = n, seed, cursor

    def _order(self, epoch: int) -> list[int]:
        return random.Random(f"{self.seed}:{epoch}").sample(range(self.n), self.n)

    def take(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            epoch, at = divmod(self.cursor, self.n)
            m = min(k - len(out), self.n - at)  # the rest of this epoch's order, shuffled once
            out.extend(self._order(epoch)[at: at + m])
            self.cursor += m
        return out


class _Dist:
    """torch.distributed when launched by torchrun (WORLD_SIZE > 1); no-ops otherwise."""

    def __init__(self, device: str):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.enabled = self.world > 1
        self.device = torch.device(device)
        if self.enabled:
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.enabled:
            import torch.distributed as dist

            x = t.to(self.device)
            dist.all_reduce(x, {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op])
            t.copy_(x.to(t.device))
        return t

    def sums(self, values: dict[str, float], op: str = "sum") -> dict[str, float]:
        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
        self.all_reduce(t, op)
        return dict(zip(keys, t.tolist()))

    def barrier(self) -> None:
        if self.enabled:
            import torch.distributed as dist

            dist.barrier()


@dataclass
class Group:
    """One prompt's G samples, as sampled (CPU tensors)."""

    prompt: list[int]
    completion_ids: torch.Tensor  # [G, T]
    completion_mask: torch.Tensor  # [G, T] bool
    behaviour_logprobs: torch.Tensor  # [G, T]
    rewards: torch.Tensor  # [G] (shaped: + format reward + overlong penalty)
    truncated: torch.Tensor  # [G] bool
    statuses: list[str]
    noise_key: tuple  # (noise seed, scope, prompts in the call, this prompt's index in the call)


def _pad_cat(ts: list[torch.Tensor], value=0) -> torch.Tensor:
    t = max(x.shape[1] for x in ts)
    return torch.cat([torch.nn.functional.pad(x, (0, t - x.shape[1]), value=value) for x in ts])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------ run directory
def _step_dirs(out: Path) -> list[Path]:
    return sorted(p for p in out.glob(names.STEP_DIR_GLOB) if p.is_dir())


def _resume_metrics(output: Path, start: int, eval_every: int) -> list[dict]:
    """The metrics records a run resumed after step ``start`` keeps: one per step up to ``start`` (and step 0's
    evaluation); a deleted or cut metrics.jsonl would finish the run without part of its history, so it is refused."""
    path = output / names.RUN_METRICS
    if not start:
        return []
    if not path.is_file():
        raise QerlError(f"{path} is missing, so the run's history before step {start} is lost; it cannot be "
                        "resumed: start it over with --force.")
    kept = [r for r in _metrics_lines(path) if r["step"] <= start]
    if [r["step"] for r in kept] != ([0] if eval_every else []) + list(range(1, start + 1)):
        raise QerlError(f"{path} does not hold one record for each step up to the checkpoint at step {start}; the "
                        "run cannot be resumed: start it over with --force.")
    return kept


class _Replaced:
    """The run directory that --force replaces: moved aside, not deleted, until the new run has saved its first
    checkpoint (or ended); a new run that fails or is interrupted before that gets it back (``restore``)."""

    def __init__(self):
        self.out: Path | None = None
        self.old: Path | None = None

    def move_aside(self, out: Path) -> None:
        self.out, self.old = out, out.parent / f".{out.name}.replaced-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.rename(out, self.old)

    def drop(self) -> None:
        if self.old is not None:
            shutil.rmtree(self.old, ignore_errors=True)
            self.old = None

    def restore(self) -> None:
        if self.old is not None and self.old.exists():
            if self.out.exists():
                shutil.rmtree(self.out, ignore_errors=True)
            os.rename(self.old, self.out)
            self.old = None


def _prepare_output(out: Path, key: str, resume: bool, force: bool, replaced: _Replaced | None = None) -> str:
    """'cached' (a complete run with this key), 'resume' or 'fresh'; what --force replaces goes aside into
    ``replaced`` (or is deleted without one)."""

    def clear() -> str:
        if replaced is not None:
            replaced.move_aside(out)
        else:
            shutil.rmtree(out)
        return "fresh"

    if out.exists() and not out.is_dir():
        raise QerlError(f"output path {out} exists and is not a directory.")
    if not out.exists():
        return "fresh"
    mf, rc = out / names.MANIFEST, out / names.RUN_CONFIG
    if mf.is_file():
        try:
            manifest = artifact.read_manifest(out)
        except QerlError:
            manifest = None
            if not artifact.is_qerl_manifest(out):
                raise artifact.foreign_manifest_error(out) from None
        if manifest is not None and manifest[names.K_KEY] == key and not force:
            problem = artifact.verify_files(out, manifest)
            if problem is None:
                return "cached"
            raise QerlError(f"{out} holds this run but {problem}; rerun with --force to recompute it.")
        if not force:
            what = f"a different '{manifest[names.K_KIND]}' artifact" if manifest else "an unreadable artifact"
            raise QerlError(f"{out} already holds {what}; pass --force to replace it or choose another output.")
        return clear()
    if rc.is_file():
        if force:
            return clear()
        try:
            old_key = json.loads(rc.read_text()).get(names.K_KEY)
        except (ValueError, AttributeError):  # (not JSON, or JSON that is not an object)
            old_key = None
        if not resume:
            raise QerlError(f"{out} holds an unfinished run; pass --resume to continue it or --force to start over.")
        if old_key is None:  # (unreadable: whether it is the same run cannot be told)
            raise QerlError(f"{out} holds an unfinished run whose {names.RUN_CONFIG} is not a readable run config, so "
                            "it cannot be resumed; pass --force to start over.")
        if old_key != key:
            raise QerlError(f"{out} holds an unfinished run with a different config or inputs; --resume needs the "
                            "same command (and number of ranks), or pass --force to start over.")
        return "resume"
    if any(out.iterdir()):
        raise QerlError(f"{out} is a non-empty directory that is not a qerl run; choose another output.")
    return "fresh"


def _metrics_lines(path: Path) -> list[dict]:
    """The records of a run's metrics.jsonl; a last line cut short (a run killed while writing it) is dropped,
    any other bad line is a clear error."""
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    out = []
    for i, ln in enumerate(lines):
        try:
            rec = json.loads(ln)
            if not isinstance(rec, dict) or "step" not in rec:
                raise ValueError("not a metrics record")
        except ValueError as e:
            if i == len(lines) - 1:
                break
            raise QerlError(f"{path} line {i + 1} is not a metrics record ({e}); the run cannot be resumed, "
                            "start it over with --force.") from None
        out.append(rec)
    return out


def _write_json_atomic(path: Path, obj) -> None:
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def _save_step(out: Path, step: int, pm, opt, cursor: int, world: int) -> Path:
    """Write checkpoint ``step`` into a temporary sibling, its file hashes last, and rename it into place."""
    final = out / names.STEP_DIR.format(step)
    tmp = out / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    lora.save_adapter(pm, tmp)
    sd = opt.state_dict()
    tensors = {f"state.{i}.{k}": (v if torch.is_tensor(v) else torch.tensor(v)).detach().cpu().contiguous()
               for i, st in sd["state"].items() for k, v in st.items()}
    if model_folding(pm.get_base_model()):  # the factors as trained: the adapter file holds them unfolded, and a
        from peft import get_peft_model_state_dict  # resume from that alone would differ by a rounding

        tensors |= {f"param.{k}": v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(pm).items()}
    save_file(tensors, str(tmp / names.OPTIMIZER_STATE))
    rng = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["torch_cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    save_file(rng, str(tmp / names.RNG_STATE))
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    state = {"step": step, "data_cursor": cursor, "world_size": world, "param_groups": groups,
             "python_random": None}
    (tmp / names.TRAINER_STATE).write_text(json.dumps(state, indent=1) + "\n")
    hashes = {names.K_FILES: artifact.list_files(tmp, skip=names.STEP_HASHES)}
    (tmp / names.STEP_HASHES).write_text(json.dumps(hashes, indent=1) + "\n")
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    return final


def _check_step(d: Path) -> None:
    """A clear error unless every file of checkpoint ``d`` matches the hashes written with it."""
    what = "delete it to resume from the checkpoint before it, or start over with --force."
    f = d / names.STEP_HASHES
    if not f.is_file():
        raise QerlError(f"the checkpoint {d} is incomplete: it lacks {names.STEP_HASHES}, which qerl writes last (it "
                        "was cut short or altered, or an older qerl that did not hash checkpoints wrote it), so it "
                        f"cannot be resumed safely; {what}")
    try:
        files = json.loads(f.read_text())[names.K_FILES]
        if not (isinstance(files, list) and files and all(isinstance(e, dict) for e in files)):
            raise ValueError("not a list of file entries")
    except (OSError, ValueError, TypeError, KeyError) as e:  # (UnicodeDecodeError is a ValueError)
        raise QerlError(f"the checkpoint {d} is damaged: its {names.STEP_HASHES} cannot be read "
                        f"({type(e).__name__}: {e}); {what}") from None
    problem = artifact.check_files(d, files, listing=names.STEP_HASHES)
    if problem is not None:
        raise QerlError(f"the checkpoint {d} is damaged: {problem}; {what}")


def _load_step(d: Path, pm, opt) -> dict:
    """Restore checkpoint ``d`` (its hashes checked first) into ``pm`` and ``opt`` and the RNGs; its state."""
    _check_step(d)
    state = json.loads((d / names.TRAINER_STATE).read_text())
    flat = load_file(str(d / names.OPTIMIZER_STATE))
    lora.load_adapter_weights(pm, d, exact={k[len("param."):]: v for k, v in flat.items() if k.startswith("param.")})
    st: dict[int, dict] = {}
    for k, v in flat.items():
        if not k.startswith("state."):
            continue
        _, i, name = k.split(".", 2)
        st.setdefault(int(i), {})[name] = v
    groups = []
    for g in state["param_groups"]:
        g = dict(g)
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    opt.load_state_dict({"state": st, "param_groups": groups})
    rng = load_file(str(d / names.RNG_STATE))
    torch.set_rng_state(rng["torch_cpu"])
    if "torch_cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(rng["torch_cuda"]))
    return state


def _write_manifest(out: Path, cfg_dict: dict, inputs: list[artifact.Input], key: str, metrics: dict) -> artifact.Artifact:
    return artifact.write_manifest(out, names.KIND_RUN, cfg_dict, inputs, key, metrics)


def _key_config(cfg: TrainConfig, n_problems: int) -> dict:
    """The config a run is keyed and recorded by: ``num_problems`` as the count selected (0 = all and the set's
    size are one run; the task input holds the problems), the held-out settings only when evaluations run, the
    answer checker that scores the rollouts (rewards differ between checkers; as in rollout and evaluate), the
    prompt format (``tasks.prompt_format``: another system hint prompts other completions) and the switches that
    change what CUDA computes (``config.result_env``: another sampler draws other tokens)."""
    d = config.as_dict(cfg) | {"num_problems": n_problems, "verifier": tasks.verifier(),
                              "prompt_format": tasks.prompt_format()} | config.result_env()
    if not cfg.eval_every:  # (no evaluation runs: its settings change nothing)
        d |= {"eval_task": None, "eval_problems": None, "eval_temperature": None}
    return d


def heldout_problems(cfg: TrainConfig) -> list[tasks.Problem]:
    """The held-out evaluation problems: ``eval_task`` (a file, or an HF dataset's test split), or the arith
    generator's held-out split (seed 0, the same set for every training seed, disjoint from every training
    split; also for an ``eval_task`` of ``arith[:N]``)."""
    if cfg.eval_task and not tasks.is_generated(cfg.eval_task):
        probs = tasks.load_problems(cfg.eval_task, 0, cfg.eval_problems, split="test")  # HF specs: the test split
    else:  # "arith[:N]" means its held-out split here, never training problems
        probs = tasks.arithmetic_problems(cfg.eval_problems, 0, "heldout")
    if not probs:
        raise QerlError(f"the held-out evaluation set {cfg.eval_task or 'arith (heldout)'} holds no problems.")
    return probs[: cfg.eval_problems]


# ------------------------------------------------------------------------------------------ the trainer
class Trainer:
    def __init__(self, cfg: TrainConfig, pm, tok, problems: list[tasks.Problem], dist: _Dist, device: str,
                 heldout: list[tasks.Problem]):
        self.cfg, self.pm, self.tok, self.problems, self.dist = cfg, pm, tok, problems, dist
        self.device = torch.device(device)
        self.engine = Engine(pm.get_base_model(), self.device, cuda_graph=cfg.cuda_graph,
                             grad_checkpoint=cfg.gradient_checkpointing)
        self.eos = rollout.eos_ids(pm.get_base_model(), tok)
        self.pad = tok.pad_token_id
        self.prompt_ids = [tasks.chat_prompt(tok, p.question) for p in problems]
        self.params = [p for _, p in lora.trainable(pm)]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                     weight_decay=cfg.weight_decay)
        self.stream = PromptStream(len(problems), cfg.seed)
        self.heldout = heldout
        self.heldout_ids = [tasks.chat_prompt(tok, p.question) for p in self.heldout]
        # the engine refuses a sampling call past the model's positions, but only at its first rollout, after the
        # run's directory is written: refuse here, before anything is (review, session 19)
        check_positions(pm.get_base_model().config, max(map(len, self.prompt_ids + self.heldout_ids), default=0),
                        cfg.max_new_tokens)

    def autocast(self):
        if self.device.type == "cuda" and self.cfg.autocast:
            return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)
        return contextlib.nullcontext()

    # ---------------------------------------------------------------- rollout
    def sample(self, step: int, sigma: float) -> tuple[list[Group], list[Group], int]:
        cfg, dist = self.cfg, self.dist
        per_rank = cfg.prompts_per_step // dist.world
        kept: list[Group] = []
        sampled: list[Group] = []
        rounds = cfg.max_sampling_rounds if cfg.dynamic_sampling else 1
        done_rounds = 0
        n_kept = 0  # kept groups on all ranks
        for rnd in range(rounds):
            idx = self.stream.take(cfg.prompts_per_step)  # the same global draw on every rank
            base = dist.rank * per_rank
            shard = idx[base: base + per_rank]
            new: list[Group] = []
            for c in range(0, len(shard), cfg.batch_prompts):
                chunk = shard[c: c + cfg.batch_prompts]
                nseed = derive_seed(cfg.seed, "noise", step, rnd, base + c)
                self.engine.set_noise(sigma, nseed, cfg.noise_scope, len(chunk), cfg.group, cfg.noise_final_norm)
                with self.autocast():
                    b = self.engine.generate([self.prompt_ids[i] for i in chunk], cfg.group, cfg.sampling(),
                                             derive_seed(cfg.seed, "sample", step, rnd, base + c), self.eos, self.pad)
                rows = rollout.score_batch(b, self.tok, [self.problems[i] for i in chunk], cfg.format_reward)
                rewards = torch.tensor([r["reward"] for r in rows], dtype=torch.float32)
                rewards += grpo.overlong_penalty(b.lengths(), cfg.max_new_tokens, cfg.overlong_buffer,
                                                 cfg.overlong_penalty)
                trunc = torch.tensor([f == "length" for f in b.finish_reason])
                g = cfg.group
                for j, i in enumerate(chunk):
                    sl = slice(j * g, (j + 1) * g)
                    new.append(Group(self.prompt_ids[i], b.completion_ids[sl], b.completion_mask[sl],
                                     b.behaviour_logprobs[sl], rewards[sl], trunc[sl],
                                     [r["status"] for r in rows[sl]], (nseed, cfg.noise_scope, len(chunk), j)))
            sampled += new
            done_rounds = rnd + 1
            if not cfg.dynamic_sampling:
                kept = new
                break
            # the first informative groups of the global draw, as one process keeps them: every rank's flags in
            # draw order, then each rank keeps its own of the chosen (a rank may train more groups than another)
            flags = torch.zeros(cfg.prompts_per_step, dtype=torch.float64)
            flags[base: base + per_rank] = torch.tensor(
                [float(grpo.informative_groups(x.rewards, cfg.group)[0]) for x in new], dtype=torch.float64)
            chosen = torch.nonzero(dist.all_reduce(flags) > 0.5).flatten()[: cfg.prompts_per_step - n_kept].tolist()
            kept += [new[p - base] for p in chosen if base <= p < base + per_rank]
            n_kept += len(chosen)
            if n_kept >= cfg.prompts_per_step:
                break
        return kept, sampled, done_rounds

    def noise_seeds(self, step: int, rounds: int) -> list[int]:
        """The noise seed of every engine call of ``step`` on every rank (NOISE_SEEDS_DEFINITION), as sample() draws
        them: round by round, then by the call's first prompt position."""
        per_rank = self.cfg.prompts_per_step // self.dist.world
        starts = [k * per_rank + c for k in range(self.dist.world) for c in range(0, per_rank, self.cfg.batch_prompts)]
        return [derive_seed(self.cfg.seed, "noise", step, rnd, p) for rnd in range(rounds) for p in starts]

    # ---------------------------------------------------------------- training forward
    def logprobs(self, part: list[Group], sigma: float) -> torch.Tensor:
        cfg, eng = self.cfg, self.engine
        if cfg.objective == "clean" or sigma == 0:
            eng.set_noise(0.0, 0)
            comp = _pad_cat([x.completion_ids for x in part], self.pad)
            mask = _pad_cat([x.completion_mask for x in part], False)
            with self.autocast():
                return eng.sequence_logprobs([x.prompt for x in part], comp, mask, cfg.temperature, self.pad,
                                             cfg.group).float()
        # replay: redraw each rollout call's noise, forward the groups of that call together
        order: dict[tuple, list[int]] = {}
        for k, x in enumerate(part):
            order.setdefault(x.noise_key[:3], []).append(k)
        t_max = max(x.completion_ids.shape[1] for x in part)
        out: list[torch.Tensor | None] = [None] * len(part)
        for (nseed, scope, n_call), ks in order.items():
            eng.set_noise(sigma, nseed, scope, n_call, cfg.group, cfg.noise_final_norm)
            if scope == "group":  # keep the rows of the groups in this part
                rows = torch.cat([torch.arange(part[k].noise_key[3] * cfg.group, (part[k].noise_key[3] + 1) * cfg.group)
                                  for k in ks]).to(self.device)
                eng.select_noise_rows(rows)
            sub = [part[k] for k in ks]
            comp = _pad_cat([x.completion_ids for x in sub], self.pad)
            mask = _pad_cat([x.completion_mask for x in sub], False)
            with self.autocast():
                lp = eng.sequence_logprobs([x.prompt for x in sub], comp, mask, cfg.temperature, self.pad,
                                           cfg.group).float()
            lp = torch.nn.functional.pad(lp, (0, t_max - lp.shape[1]))
            for j, k in enumerate(ks):
                out[k] = lp[j * cfg.group: (j + 1) * cfg.group]
        eng.set_noise(0.0, 0)
        return torch.cat(out)

    # ---------------------------------------------------------------- held-out evaluation
    def evaluate_heldout(self) -> dict:
        """Accuracy of the deployment policy (adapter on, AQN off, T = eval_temperature, one sample per problem) on
        the held-out problems; the same problems and sampling seed every time. Ranks split the problems."""
        cfg, dist = self.cfg, self.dist
        _sync(self.device)
        t0 = time.perf_counter()
        n = len(self.heldout)
        counts = {"n": 0, "correct": 0, "unparsable": 0, "truncated": 0}
        # right answers per distinct question (a repeated question is one cluster of the interval, not new trials)
        qkey = {q: f"q{j:06d}" for j, q in enumerate(dict.fromkeys(p.question for p in self.heldout))}
        counts |= dict.fromkeys(qkey.values(), 0)
        chunk = max(cfg.batch_prompts * cfg.group, 1)  # as many rows per engine call as a training rollout
        self.engine.set_noise(0.0, 0)
        # global chunks dealt round-robin to the ranks, each sampled with its own seed: the same calls and the
        # same accuracy whatever the number of ranks
        for k, c in enumerate(range(0, n, chunk)):
            if k % dist.world != dist.rank:
                continue
            idx = list(range(c, min(c + chunk, n)))
            with self.autocast(), torch.no_grad():
                b = self.engine.generate([self.heldout_ids[i] for i in idx], 1, cfg.eval_sampling(),
                                         derive_seed(cfg.seed, "heldout", c), self.eos, self.pad)
            rows = rollout.score_batch(b, self.tok, [self.heldout[i] for i in idx], 0.0)
            counts["n"] += len(rows)
            counts["correct"] += sum(r["status"] == tasks.CORRECT for r in rows)
            for i, r in zip(idx, rows):
                counts[qkey[self.heldout[i].question]] += r["status"] == tasks.CORRECT
            counts["unparsable"] += sum(r["status"] == tasks.UNPARSABLE for r in rows)
            counts["truncated"] += sum(f == "length" for f in b.finish_reason)
        self.engine.release_graph()
        c = dist.sums(counts)
        _sync(self.device)
        acc = c["correct"] / max(c["n"], 1)
        # one-digit arithmetic repeats its questions: each distinct question is one cluster of the interval
        asked = collections.Counter(p.question for p in self.heldout)
        n_eff = stats.cluster_effective_size([c[qkey[q]] for q in qkey], [asked[q] for q in qkey])
        lo_ci, hi_ci = stats.wilson(acc * n_eff, n_eff)
        return {"heldout_accuracy": acc, "heldout_ci95": [lo_ci, hi_ci], "heldout_n": int(c["n"]),
                "heldout_distinct_questions": len(qkey), "heldout_n_eff": n_eff,
                "heldout_parse_failure_rate": c["unparsable"] / max(c["n"], 1),
                "heldout_truncation_rate": c["truncated"] / max(c["n"], 1),
                "time_eval_s": time.perf_counter() - t0}

    # ---------------------------------------------------------------- one step
    def step(self, step: int) -> dict:
        cfg, dist, dev = self.cfg, self.dist, self.device
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        t_step = time.perf_counter()
        sigma = cfg.sigma(step)
        lr = grpo.lr_at(step, cfg.steps, cfg.lr, cfg.warmup_steps, cfg.min_lr_ratio)
        for g in self.opt.param_groups:
            g["lr"] = lr
        _sync(dev)
        t0 = time.perf_counter()
        kept, sampled, rounds = self.sample(step, sigma)
        # the step's rollout calls shared one decode graph and KV cache (Engine.keep_graph); free them for the
        # training forward and backward, as before the engine kept them (the next step captures anew)
        self.engine.release_graph()
        _sync(dev)
        time_rollout = time.perf_counter() - t0

        # statistics of everything sampled this step (every round), summed over ranks
        G = cfg.group
        rew = torch.cat([x.rewards for x in sampled])
        gen_mask = torch.cat([x.completion_mask.sum(1) for x in sampled]).float()
        blp_sum = sum(float((x.behaviour_logprobs * x.completion_mask).sum()) for x in sampled)
        statuses = [s for x in sampled for s in x.statuses]
        s = dist.sums({
            "rows": len(rew), "groups": len(sampled), "r": float(rew.sum()), "r2": float((rew.double() ** 2).sum()),
            "correct": statuses.count(tasks.CORRECT), "unparsable": statuses.count(tasks.UNPARSABLE),
            "wrong": statuses.count(tasks.WRONG),
            "truncated": sum(int(x.truncated.sum()) for x in sampled), "tokens": float(gen_mask.sum()),
            "neg_blp": -blp_sum,
            "informative": sum(bool(grpo.mixed_outcome_groups(
                torch.tensor([st == tasks.CORRECT for st in x.statuses]), G)[0]) for x in sampled),
            "reward_varied": sum(bool(grpo.informative_groups(x.rewards, G)[0]) for x in sampled),
            "kept": len(kept), "kept_rows": len(kept) * G,
            "kept_r": float(sum(x.rewards.sum() for x in kept)) if kept else 0.0,
            "kept_r2": float(sum((x.rewards.double() ** 2).sum() for x in kept)) if kept else 0.0,
        })
        batch_std = None
        if cfg.adv_scale == "batch" and s["kept_rows"]:
            mean = s["kept_r"] / s["kept_rows"]
            batch_std = math.sqrt(max(s["kept_r2"] / s["kept_rows"] - mean ** 2, 0.0))

        # minibatches: contiguous parts of this rank's groups; global loss denominators per part
        nmb = cfg.minibatches
        parts = [kept[i * len(kept) // nmb: (i + 1) * len(kept) // nmb] for i in range(nmb)]
        adv = [grpo.group_advantages(torch.cat([x.rewards for x in p]), G, cfg.adv_scale, cfg.adv_eps, batch_std)
               if p else None for p in parts]
        lmasks = [grpo.loss_mask(_pad_cat([x.completion_mask for x in p], False),
                                 torch.cat([x.truncated for x in p]), cfg.mask_truncated) if p else None
                  for p in parts]
        local_den = {str(i): (grpo.denominator(m, cfg.loss_aggregation) if m is not None else 0.0)
                     for i, m in enumerate(lmasks)}
        den = dist.sums(local_den)

        acc = {"ratio_sum": 0.0, "ratio_tokens": 0, "clip_low": 0, "clip_high": 0, "gap_abs": 0.0,
               "gap": 0.0, "gap_tokens": 0, "loss": 0.0}
        rmin, rmax = math.inf, -math.inf
        t_lp = t_bw = t_opt = t_sync = 0.0
        grad_norms = []
        for it in range(cfg.num_iterations):
            for i, part in enumerate(parts):
                if den[str(i)] == 0:
                    continue  # no loss token anywhere (e.g. every completion truncated and masked)
                for p in self.params:
                    p.grad = torch.zeros_like(p) if p.grad is None else p.grad.zero_()
                loss_val = 0.0
                if part:
                    _sync(dev)
                    t0 = time.perf_counter()
                    logp = self.logprobs(part, sigma)
                    _sync(dev)
                    t_lp += time.perf_counter() - t0
                    blp = _pad_cat([x.behaviour_logprobs for x in part]).to(logp.device)
                    cmask = _pad_cat([x.completion_mask for x in part], False).to(logp.device)
                    lm = lmasks[i].to(logp.device)
                    loss, st = grpo.clipped_surrogate(logp, blp, adv[i].to(logp.device), lm, cfg.eps_low,
                                                      cfg.eps_high, cfg.loss_aggregation, den[str(i)])
                    t0 = time.perf_counter()
                    loss.backward()
                    _sync(dev)
                    t_bw += time.perf_counter() - t0
                    loss_val = float(loss.detach())
                    acc["ratio_sum"] += st["ratio_sum"]
                    acc["ratio_tokens"] += st["tokens"]
                    acc["clip_low"] += st["clip_low"]
                    acc["clip_high"] += st["clip_high"]
                    if st["tokens"]:
                        rmin, rmax = min(rmin, st["ratio_min"]), max(rmax, st["ratio_max"])
                    if not grad_norms:  # before the first optimizer step of this step
                        d = (logp.detach() - blp)[cmask]
                        acc["gap_abs"] += float(d.abs().sum())
                        acc["gap"] += float(d.sum())
                        acc["gap_tokens"] += int(cmask.sum())
                t0 = time.perf_counter()
                if dist.enabled:
                    flat = torch.cat([p.grad.reshape(-1) for p in self.params])
                    dist.all_reduce(flat)
                    o = 0
                    for p in self.params:
                        p.grad.copy_(flat[o: o + p.numel()].view_as(p))
                        o += p.numel()
                acc["loss"] += loss_val  # local share (global denominator); summed over ranks below
                t_sync += time.perf_counter() - t0
                t0 = time.perf_counter()
                gn = torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf)
                grad_norms.append(float(gn))
                self.opt.step()
                _sync(dev)
                t_opt += time.perf_counter() - t0
        r = dist.sums({k: v for k, v in acc.items()})
        ext = dist.sums({"min": rmin if math.isfinite(rmin) else math.inf}, "min")
        ext_max = dist.sums({"max": rmax if math.isfinite(rmax) else -math.inf}, "max")
        n, tok = max(s["rows"], 1), max(s["tokens"], 1)
        rmean = s["r"] / n
        anorm = lora.source_norm(self.pm)  # (the saved file's coordinates: comparable between AWQ and RTN packs)
        check_diverged(anorm, step + 1, lr)
        time_step = time.perf_counter() - t_step
        m = {
            "step": step + 1, "sigma": sigma, "lr": lr, "noise_seeds": self.noise_seeds(step, rounds) if sigma else [],
            "reward_mean": rmean, "reward_std": math.sqrt(max(s["r2"] / n - rmean ** 2, 0.0)),
            "accuracy": s["correct"] / n, "informative_fraction": s["informative"] / max(s["groups"], 1),
            "reward_varied_fraction": s["reward_varied"] / max(s["groups"], 1),
            "groups_sampled": int(s["groups"]), "groups_trained": int(s["kept"]), "sampling_rounds": rounds,
            "response_length_mean": s["tokens"] / n, "truncation_rate": s["truncated"] / n,
            "parse_failure_rate": s["unparsable"] / n, "wrong_rate": s["wrong"] / n,
            "entropy": s["neg_blp"] / tok,
            "loss": r["loss"] / max(len(grad_norms), 1),
            "ratio_min": ext["min"] if math.isfinite(ext["min"]) else None,
            "ratio_mean": r["ratio_sum"] / r["ratio_tokens"] if r["ratio_tokens"] else None,
            "ratio_max": ext_max["max"] if math.isfinite(ext_max["max"]) else None,
            "clip_frac_low": r["clip_low"] / max(r["ratio_tokens"], 1),
            "clip_frac_high": r["clip_high"] / max(r["ratio_tokens"], 1),
            "logprob_gap_abs": r["gap_abs"] / max(r["gap_tokens"], 1),
            "logprob_gap_mean": r["gap"] / max(r["gap_tokens"], 1),
            "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else 0.0,
            "optimizer_steps": len(grad_norms), "adapter_norm": anorm, "data_cursor": self.stream.cursor,
            "time_rollout_s": time_rollout, "time_logprobs_s": t_lp, "time_backward_s": t_bw,
            "time_optimizer_s": t_opt, "time_sync_s": t_sync, "time_step_s": time_step,
            "tokens_per_s": s["tokens"] / max(time_rollout, 1e-9),
            "peak_mem_allocated_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0,
            "peak_mem_reserved_bytes": torch.cuda.max_memory_reserved(dev) if dev.type == "cuda" else 0,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
        return m


def _live(m: dict, steps: int) -> None:
    held = (f"  held-out {m['heldout_accuracy']:.3f} [{m['heldout_ci95'][0]:.2f}, {m['heldout_ci95'][1]:.2f}]"
            if "heldout_accuracy" in m else "")
    if "time_step_s" not in m:  # the evaluation before the first step
        ui.info(f"step 0/{steps}{held}")
        return
    mem = m["peak_mem_allocated_bytes"] or m["peak_rss_bytes"]
    ui.info(f"step {m['step']}/{steps}  reward {m['reward_mean']:.3f}  acc {m['accuracy']:.3f}  "
            f"σ {m['sigma']:.2e}  informative {m['informative_fraction']:.2f}  loss {m['loss']:+.4f}  "
            f"tok/s {m['tokens_per_s']:.0f}  mem {mem / 2**30:.2f} GiB  {m['time_step_s']:.1f}s{held}")


# ------------------------------------------------------------------------------------------ the stage
def train(*args, **kwargs) -> artifact.Artifact | None:
    """Train a LoRA adapter on ``source`` (a verified packed artifact, or a model for the bf16 baseline); the
    arguments are ``_train``'s.

    Returns the ``run`` artifact, or None when ``stop_after`` steps were run before the end (the run stays
    unfinished; continue it with ``resume=True``). A run that --force replaces is restored if the new one fails
    or is interrupted before its first checkpoint."""
    replaced = _Replaced()
    try:
        result = _train(*args, replaced=replaced, **kwargs)
    except BaseException:
        replaced.restore()
        raise
    replaced.drop()
    return result


def _train(source: str | Path, output: str | Path, task: str | None = None, steps: int | None = None,
          prompts_per_step: int | None = None, group: int | None = None, max_new_tokens: int | None = None,
          lr: float | None = None, sigma_start: float | None = None, sigma_end: float | None = None,
          sigma_stages: int | None = None, objective: str | None = None, seed: int | None = None,
          save_every: int | None = None, verify_dir: str | Path | None = None, skip_verify: bool = False,
          resume: bool = False, stop_after: int | None = None, config_file: str | Path | None = None,
          force: bool = False, progress: bool = True, device: str | None = None,
          overrides: dict | None = None, replaced: _Replaced | None = None) -> artifact.Artifact | None:
    """``train``'s work; ``replaced`` receives the run directory that --force moves aside."""
    output = Path(output)
    if stop_after is not None and stop_after < 1:
        raise QerlError(f"--stop-after must be at least 1 step, got {stop_after}.")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if device == "cuda" and world > 1:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    cfg = config.load("train", TrainConfig, config_file, {
        "task": task, "steps": steps, "prompts_per_step": prompts_per_step, "group": group,
        "max_new_tokens": max_new_tokens, "lr": lr, "sigma_start": sigma_start, "sigma_end": sigma_end,
        "sigma_stages": sigma_stages, "objective": objective, "seed": seed, "save_every": save_every,
        "progress": progress, "skip_verify": skip_verify, "device": device.split(":")[0], "world_size": world,
        **(overrides or {})})
    dist = _Dist(device)
    if device.startswith("cuda:"):
        torch.cuda.set_device(torch.device(device))

    tok, input_arts, info, load_model = rollout.resolve_policy(source, device, verify_dir=verify_dir,
                                                               skip_verify=skip_verify)
    modelio.fix_tokenizer(tok)
    problems = tasks.load_problems(cfg.task, cfg.seed, cfg.num_problems or None)
    if len(problems) < 1:
        raise QerlError(f"{cfg.task} holds no problems.")
    heldout = heldout_problems(cfg) if cfg.eval_every else []
    inputs = [a.as_input(output) if isinstance(a, artifact.Artifact) else a for a in input_arts]
    inputs.append(artifact.Input("task", cfg.task, artifact.sha256_json([[p.question, p.answer] for p in problems])))
    if heldout:  # its held-out accuracy is part of the run's results: an edited held-out file is another run
        inputs.append(artifact.Input("heldout", cfg.eval_task or "arith (heldout)",
                                     artifact.sha256_json([[p.question, p.answer] for p in heldout])))
    cfg_dict = _key_config(cfg, len(problems))
    key = artifact.cache_key(names.KIND_RUN, cfg_dict, inputs)

    if dist.main:
        artifact.check_output_apart(output, inputs)
    state = _prepare_output(output, key, resume, force, replaced) if dist.main else None
    dist.barrier()
    if not dist.main:
        state = _prepare_output(output, key, True, False) if (output / names.RUN_CONFIG).is_file() or \
            (output / names.MANIFEST).is_file() else "fresh"
    if state == "cached":
        ui.info(f"[green]train[/]: {escape(str(output))} is up to date (cached); nothing to do. Use --force to recompute.")
        return artifact.open_artifact(output, names.KIND_RUN)

    if state == "resume" and dist.main and _step_dirs(output):  # (before the model loads: a file says it)
        _resume_metrics(output, int(_step_dirs(output)[-1].name.rsplit("-", 1)[-1]), cfg.eval_every)
    model = load_model()  # (after the cache check: a cached rerun reads no weights)
    pm = lora.wrap(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, cfg.seed)
    trainer = Trainer(cfg, pm, tok, problems, dist, device, heldout)
    start = 0
    steps_done = _step_dirs(output) if state == "resume" else []
    if steps_done:
        try:
            st = _load_step(steps_done[-1], pm, trainer.opt)
        except QerlError:
            raise
        except Exception as e:  # hashes match but it does not load (e.g. written by another qerl version)
            raise QerlError(f"the checkpoint {steps_done[-1]} cannot be loaded ({type(e).__name__}: {e}); delete it to "
                            "resume from the one before, or start over with --force.") from None
        if st["world_size"] != dist.world:
            raise QerlError(f"{output} was trained with {st['world_size']} ranks; resume it with the same number.")
        start, trainer.stream.cursor = st["step"], st["data_cursor"]
    elif state == "resume" and dist.main:
        ui.info(f"train: {escape(str(output))} holds no complete checkpoint yet; resuming from step 0.")
    if dist.main:
        output.mkdir(parents=True, exist_ok=True)
        for p in output.glob(".step-*.tmp-*"):
            shutil.rmtree(p, ignore_errors=True)
        metrics_path = output / names.RUN_METRICS
        if state == "resume" and metrics_path.is_file():  # cut back to the last complete checkpoint
            # (without one, nothing is kept: the step-0 evaluation is redone)
            lines = [json.dumps(r) for r in _resume_metrics(output, start, cfg.eval_every)]
            tmp = output / f".{names.RUN_METRICS}.tmp-{os.getpid()}"
            tmp.write_text("".join(ln + "\n" for ln in lines))
            os.replace(tmp, metrics_path)
        else:
            metrics_path.write_text("")
            _write_json_atomic(output / names.RUN_CONFIG, {
                names.K_KEY: key, names.K_CONFIG: cfg_dict, names.K_INPUTS: [i.as_dict() for i in inputs],
                "policy": info | {"lora": "peft", "trainable_parameters": sum(p.numel() for p in trainer.params)},
                "sigma_schedule": [cfg.sigma(s) for s in range(cfg.steps)],
                "definitions": {"behaviour_logprobs": rollout.LOGPROB_DEFINITION, "entropy": ENTROPY_DEFINITION,
                                "logprob_gap": GAP_DEFINITION,
                                "objective": {"clean": "training forward without noise (deployment policy)",
                                              "replay": "training forward redraws the rollout's noise"}[cfg.objective],
                                "noise_seeds": NOISE_SEEDS_DEFINITION,
                                "sampling_seeds": SAMPLING_SEEDS_DEFINITION},
                "started": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            })
    dist.barrier()
    if start:
        ui.info(f"train: resuming {escape(str(output))} after step {start}")
    # training time so far (summed step times of the kept metrics lines; evaluations not counted)
    elapsed = sum(r.get("time_step_s", 0.0) for r in _metrics_lines(output / names.RUN_METRICS)) \
        if state == "resume" else 0.0

    def emit(m: dict) -> None:
        if dist.main:
            with open(output / names.RUN_METRICS, "a") as f:
                f.write(json.dumps(m) + "\n")
            _live(m, cfg.steps)

    if cfg.eval_every and start == 0:
        emit({"step": 0, "time_elapsed_s": 0.0} | trainer.evaluate_heldout())
    t0 = time.perf_counter()

    def spent(e: float) -> bool:  # decided on the slowest rank's clock, so every rank stops at the same step
        return cfg.time_budget_s > 0 and dist.sums({"e": e}, "max")["e"] >= cfg.time_budget_s

    stopped_by, last = "steps", start
    if start and spent(elapsed):  # a budget run that stopped after its final checkpoint, before the manifest
        stopped_by = "time_budget"
    for s in range(start, cfg.steps if stopped_by == "steps" else start):
        if stop_after is not None and s - start >= stop_after:
            ui.info(f"train: stopped after step {s} (unfinished; continue with --resume)")
            return None
        m = trainer.step(s)
        elapsed += m["time_step_s"]
        m["time_elapsed_s"] = elapsed
        over = spent(elapsed)
        final = over or s + 1 == cfg.steps
        if cfg.eval_every and ((s + 1) % cfg.eval_every == 0 or final):
            m |= trainer.evaluate_heldout()
        emit(m)
        last = s + 1
        stopping = stop_after is not None and s + 1 - start >= stop_after  # (--resume continues from here)
        if (s + 1) % cfg.save_every == 0 or final or stopping:
            if dist.main:
                _save_step(output, s + 1, pm, trainer.opt, trainer.stream.cursor, dist.world)
                if replaced is not None:  # the new run has a checkpoint: the replaced one goes
                    replaced.drop()
            dist.barrier()
        if over:
            stopped_by = "time_budget"
            ui.info(f"train: time budget of {cfg.time_budget_s:g} s reached after step {s + 1} of {cfg.steps}")
            break
    art = None
    if dist.main:
        lines = [json.loads(ln) for ln in (output / names.RUN_METRICS).read_text().splitlines() if ln.strip()]
        held = [x for x in lines if "heldout_accuracy" in x]
        lines = [x for x in lines if "time_step_s" in x]  # training steps (not the step-0 evaluation)
        summary = {"wall_s": round(time.perf_counter() - t0, 4), "steps": last, "planned_steps": cfg.steps,
                   "stopped_by": stopped_by, "train_time_s": round(elapsed, 4),
                   "final_reward_mean": lines[-1]["reward_mean"] if lines else None,
                   "final_accuracy": lines[-1]["accuracy"] if lines else None,
                   "first_accuracy": lines[0]["accuracy"] if lines else None,
                   "heldout_accuracy_first": held[0]["heldout_accuracy"] if held else None,
                   "heldout_accuracy_final": held[-1]["heldout_accuracy"] if held else None,
                   "peak_cuda_bytes": max((x["peak_mem_allocated_bytes"] for x in lines), default=0),
                   "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        art = _write_manifest(output, cfg_dict, inputs, key, summary)
        ui.info(f"[green]train[/]: {last} steps done; adapter in {escape(str(output / names.STEP_DIR.format(last)))}")
    dist.barrier()
    if art is None:
        art = artifact.Artifact(output, artifact.read_manifest(output))
    return art
