"""The ``qerl`` command: one subcommand per working stage; each calls that stage's public function."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
import typer.core
from rich.markup import escape

from . import __version__, ui
from .errors import QerlError

_click_errors = sys.modules[typer.BadParameter.__module__]  # click's exceptions (vendored by recent typer)


class _Stage(typer.core.TyperCommand):
    """A stage's command. Click's parser raises some usage errors (an option without its value, a flag given
    one) without the command's context, so the one-line error named ``qerl --help``: here they get it, and the
    line names ``qerl STAGE --help``."""

    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, args)
        except _click_errors.UsageError as e:
            if e.ctx is None:
                e.ctx = ctx
            raise


app = typer.Typer(
    name="qerl",
    help="Quantization-enhanced RL of LLMs: NVFP4 backbone, LoRA adapters, adaptive quantization noise.\n\n"
    "Stages read and write versioned artifact directories (each with a manifest.json), so they chain in a "
    "Makefile and a rerun on cached artifacts does no work.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)

Output = Annotated[Path, typer.Option("--output", "-o", help="Artifact directory to write.")]
ConfigFile = Annotated[Optional[Path], typer.Option("--config", help="TOML file overriding the stage defaults (see stages/).")]
Force = Annotated[bool, typer.Option("--force", help="Recompute even if the output is cached; replace what is there.")]
# (None unless given: then the --config file's `progress`, else the shipped default, decides)
Progress = Annotated[Optional[bool], typer.Option("--progress/--no-progress", show_default=False,
                                                  help="Progress bars on a terminal (default: the config's `progress`, true).")]


def _version(value: bool) -> None:
    if value:
        print(f"qerl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False) -> None:
    pass


@app.command("calibrate", cls=_Stage)
def calibrate_cmd(
    model: Annotated[str, typer.Argument(help="HF model directory, .gguf file, or 'smollm2-135m-instruct'.")],
    output: Output,
    data: Annotated[str, typer.Option("--data", help="Calibration text: a .jsonl/.json/.parquet/.txt file, or hf:NAME[:CONFIG].")],
    samples: Annotated[Optional[int], typer.Option("--samples", help="Number of calibration sequences.")] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", help="Tokens per sequence.")] = None,
    field: Annotated[Optional[str], typer.Option("--field", help="Text column(s), comma-separated, or 'messages' for chat rows.")] = None,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Seed of the row order and error subset.")] = None,
    device: Annotated[Optional[str], typer.Option("--device", help="'cuda' or 'cpu' (default: cuda where available); one layer at a time on it.")] = None,
    config: ConfigFile = None,
    force: Force = False,
    progress: Progress = None,
) -> None:
    """Search activation-aware (AWQ) scales and clip ratios under the NVFP4 quantizer (a `calib` artifact).

    Layer by layer: per smoothing group (input_layernorm -> q/k/v, v -> o, post_attention_layernorm ->
    gate/up, up -> down) the scale exponent minimizing the group's output error after NVFP4 fake-quantization.

    Examples:

        qerl calibrate smollm2-135m-instruct --data ../shared/data/gsm8k/train.jsonl --field question,answer --samples 128 --seq-len 512 -o out/calib

        qerl quantize smollm2-135m-instruct --calib out/calib -o out/quant-awq
    """
    from .calibrate import calibrate

    calibrate(model, data, output, samples=samples, seq_len=seq_len, field=field, seed=seed, config_file=config,
              force=force, progress=progress, device=device)


@app.command("quantize", cls=_Stage)
def quantize_cmd(
    model: Annotated[str, typer.Argument(help="HF model directory, .gguf file, or 'smollm2-135m-instruct'.")],
    output: Output,
    calib: Annotated[Optional[Path], typer.Option("--calib", help="calib artifact (AWQ scales) to fold in first.")] = None,
    config: ConfigFile = None,
    force: Force = False,
    progress: Progress = None,
) -> None:
    """NVFP4-quantize MODEL into a compressed-tensors checkpoint (a `quant` artifact).

    E2M1 codes, an e4m3 scale per 16 weights and an fp32 tensor scale shared by q/k/v and by gate/up;
    embeddings, norms and lm_head stay bf16. vLLM and transformers (with compressed-tensors) load the result.

    Examples:

        qerl quantize smollm2-135m-instruct -o out/quant

        qerl quantize ./Qwen2.5-7B-Instruct --calib out/calib -o out/quant-awq
    """
    from .quantize import quantize

    quantize(model, output, calib=calib, config_file=config, force=force, progress=progress)


@app.command("pack", cls=_Stage)
def pack_cmd(
    quant: Annotated[Path, typer.Argument(help="quant artifact directory (from `qerl quantize`).")],
    output: Output,
    config: ConfigFile = None,
    force: Force = False,
    progress: Progress = None,
) -> None:
    """Re-lay a quant checkpoint's codes and scales into the packed layout our CUDA kernel reads.

    Example:

        qerl pack out/quant -o out/packed
    """
    from .pack import pack

    pack(quant, output, config_file=config, force=force, progress=progress)


@app.command("verify", cls=_Stage)
def verify_cmd(
    packed: Annotated[Path, typer.Argument(help="packed artifact directory (from `qerl pack`).")],
    output: Output,
    against: Annotated[Optional[Path], typer.Option("--against", help="quant artifact to check the round trip against (default: the pack's own input).")] = None,
    config: ConfigFile = None,
    force: Force = False,
    progress: Progress = None,
) -> None:
    """Check the packed model against dequantized references; exit 1 if any check fails.

    (a) every projection at several batch sizes, (b) whole-model logits, (c) packed bytes round-trip to the
    quant checkpoint. Writes a `verify` artifact with report.json either way.

    Example:

        qerl verify out/packed -o out/verify
    """
    from .verify import verify, verify_passed

    art = verify(packed, output, against=against, config_file=config, force=force, progress=progress)
    if not verify_passed(art):  # (the hashed report's verdict, also for a cached artifact)
        raise typer.Exit(1)


# Third-party tqdm bars (GGUF conversion, weight loading) would interleave with ours: rich draws the progress.
os.environ.setdefault("TQDM_DISABLE", "1")


@app.command("rollout", cls=_Stage)
def rollout_cmd(
    source: Annotated[str, typer.Argument(help="packed artifact (NVFP4), or a model (HF dir, .gguf, 'smollm2-135m-instruct') for the bf16 baseline.")],
    output: Output,
    prompts: Annotated[str, typer.Option("--prompts", help="jsonl/json/parquet with question+answer fields (scored: rewards) or a prompt field, a .txt file (one prompt per blank-line-separated block; not scored), or arith:N.")],
    group: Annotated[Optional[int], typer.Option("--group", "-G", help="Completions per prompt.")] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens", help="Token limit per completion.")] = None,
    adapter: Annotated[Optional[Path], typer.Option("--adapter", help="LoRA adapter directory (PEFT format).")] = None,
    sigma: Annotated[Optional[float], typer.Option("--sigma", help="AQN noise std on the RMSNorm scales (0 = off).")] = None,
    noise_scope: Annotated[Optional[str], typer.Option("--noise-scope", help="'batch' or 'group'.")] = None,
    noise_final_norm: Annotated[Optional[bool], typer.Option("--noise-final-norm/--no-noise-final-norm", help="AQN on the final norm too (default: off, as in the paper).")] = None,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Sampling and noise seed.")] = None,
    prompt_seed: Annotated[Optional[int], typer.Option("--prompt-seed", help="Seed of generated prompts (arith:N); apart from --seed.")] = None,
    temperature: Annotated[Optional[float], typer.Option("--temperature", help="0 = greedy.")] = None,
    top_p: Annotated[Optional[float], typer.Option("--top-p")] = None,
    top_k: Annotated[Optional[int], typer.Option("--top-k")] = None,
    num_prompts: Annotated[Optional[int], typer.Option("--num-prompts", help="Use the first N prompts (0 = all).")] = None,
    engine: Annotated[str, typer.Option("--engine", help="'ours', 'hf' (transformers generate, reference: same noise draw, adapter and sampling) or 'vllm'.")] = "ours",
    verify_dir: Annotated[Optional[Path], typer.Option("--verify", help="verify artifact of the pack (default: PACKED/../verify).")] = None,
    skip_verify: Annotated[bool, typer.Option("--skip-verify", help="Sample from an unverified pack (recorded).")] = False,
    config: ConfigFile = None,
    force: Force = False,
    progress: Progress = None,
) -> None:
    """Sample G completions per prompt with AQN, recording tokens, masks and behaviour log-probs (a `rollout` artifact).

    Examples:

        qerl rollout out/packed --prompts arith:64 --group 8 --max-new-tokens 64 --sigma 0.01 -o out/rollout

        qerl rollout smollm2-135m-instruct --prompts ../shared/data/gsm8k/test.jsonl --num-prompts 16 -G 4 -o out/rollout-bf16
    """
    from .rollout import rollout

    rollout(source, prompts, output, group=group, max_new_tokens=max_new_tokens, adapter=adapter, sigma=sigma,
            seed=seed, temperature=temperature, top_p=top_p, top_k=top_k, num_prompts=num_prompts,
            noise_scope=noise_scope, prompt_seed=prompt_seed, noise_final_norm=noise_final_norm, engine=engine,
            verify_dir=verify_dir, skip_verify=skip_verify, config_file=config, force=force, progress=progress)


@app.command("train", cls=_Stage)
def train_cmd(
    source: Annotated[str, typer.Argument(help="packed artifact (NVFP4, must be verified), or a model (HF dir, .gguf, 'smollm2-135m-instruct') for the bf16 LoRA baseline.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Run directory to write (a `run` artifact).")],
    task: Annotated[Optional[str], typer.Option("--task", help="arith[:N] or a GSM8K-style jsonl/json/parquet (question + answer with '#### x').")] = None,
    steps: Annotated[Optional[int], typer.Option("--steps", help="Planned steps (AQN and lr schedules span them).")] = None,
    prompts_per_step: Annotated[Optional[int], typer.Option("--prompts-per-step", help="Prompts per step over all ranks.")] = None,
    group: Annotated[Optional[int], typer.Option("--group", "-G", help="Completions per prompt.")] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens", help="Token limit per completion.")] = None,
    lr: Annotated[Optional[float], typer.Option("--lr", help="Peak learning rate (AdamW on the LoRA factors).")] = None,
    sigma_start: Annotated[Optional[float], typer.Option("--sigma-start", help="AQN sigma of the first noisy stage.")] = None,
    sigma_end: Annotated[Optional[float], typer.Option("--sigma-end", help="AQN sigma of the last stage.")] = None,
    sigma_stages: Annotated[Optional[int], typer.Option("--sigma-stages", help="AQN stages K (stage 0 has no noise).")] = None,
    objective: Annotated[Optional[str], typer.Option("--objective", help="'clean' (training forward without noise) or 'replay' (redraw the rollout's noise).")] = None,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Seed of LoRA init, prompt order, sampling and noise.")] = None,
    save_every: Annotated[Optional[int], typer.Option("--save-every", help="Checkpoint every N steps (and at the end).")] = None,
    verify_dir: Annotated[Optional[Path], typer.Option("--verify", help="verify artifact of the pack (default: PACKED/../verify).")] = None,
    skip_verify: Annotated[bool, typer.Option("--skip-verify", help="Train on an unverified pack (recorded in the run).")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="Continue an unfinished run from its last complete step dir.")] = False,
    stop_after: Annotated[Optional[int], typer.Option("--stop-after", help="Stop after N steps of this invocation, checkpointing the last one, leaving the run unfinished (time-boxed jobs; continue with --resume).")] = None,
    temperature: Annotated[Optional[float], typer.Option("--temperature", help="Sampling temperature of the rollouts (and of the training log-probs).")] = None,
    time_budget: Annotated[Optional[float], typer.Option("--time-budget", help="Finish the run after this many seconds of training (held-out evaluations not counted); 0 = none.")] = None,
    eval_every: Annotated[Optional[int], typer.Option("--eval-every", help="Held-out accuracy (adapter on, AQN off) before step 1 and every N steps; 0 = off.")] = None,
    eval_task: Annotated[Optional[str], typer.Option("--eval-task", help="Held-out dataset (default: the arith task's held-out split).")] = None,
    gradient_checkpointing: Annotated[Optional[bool], typer.Option("--gradient-checkpointing/--no-gradient-checkpointing", help="Recompute layers in the backward pass (less memory).")] = None,
    config: ConfigFile = None,
    force: Force = False,
    progress: Progress = None,
) -> None:
    """GRPO/DAPO with LoRA on the frozen NVFP4 backbone under the AQN noise schedule (a `run` artifact).

    Writes train_config.json, metrics.jsonl (one line per step) and step-XXXXXXXX/ checkpoints (PEFT adapter,
    optimizer, RNG, data cursor); manifest.json when the run is complete. Data parallel with torchrun.

    Examples:

        qerl train out/packed --task arith:4096 --steps 100 -G 8 --prompts-per-step 32 --max-new-tokens 64 -o out/run

        qerl train out/packed --task arith --steps 2 --prompts-per-step 2 -G 2 --max-new-tokens 16 -o out/run-cpu

        qerl train out/packed --steps 300 --time-budget 360 --eval-every 10 -o out/run-6min

        torchrun --nproc-per-node 2 -m qerl_cli.cli train out/packed --task arith --steps 100 -o out/run-dp

        qerl rollout out/packed --prompts arith:64 --adapter out/run/step-00000100 -o out/rollout-trained
    """
    from .train import train

    train(source, output, task=task, steps=steps, prompts_per_step=prompts_per_step, group=group,
          max_new_tokens=max_new_tokens, lr=lr, sigma_start=sigma_start, sigma_end=sigma_end,
          sigma_stages=sigma_stages, objective=objective, seed=seed, save_every=save_every, verify_dir=verify_dir,
          skip_verify=skip_verify, resume=resume, stop_after=stop_after, config_file=config, force=force,
          progress=progress, overrides={"temperature": temperature, "time_budget_s": time_budget, "eval_every": eval_every,
                                        "eval_task": eval_task, "gradient_checkpointing": gradient_checkpointing})


@app.command("evaluate", cls=_Stage)
def evaluate_cmd(
    source: Annotated[str, typer.Argument(help="packed or quant artifact, or a model (HF dir, .gguf, 'smollm2-135m-instruct').")],
    output: Output,
    data: Annotated[str, typer.Option("--data", help="GSM8K-style jsonl (question/answer), a HF dataset, or arith:N (held-out split).")],
    adapter: Annotated[Optional[Path], typer.Option("--adapter", help="LoRA adapter directory (PEFT format).")] = None,
    num_examples: Annotated[Optional[int], typer.Option("--num-examples", "-n", help="First N problems (0 = all).")] = None,
    samples: Annotated[Optional[int], typer.Option("--samples", "-k", help="Completions per problem (mean@k, pass@k).")] = None,
    temperature: Annotated[Optional[float], typer.Option("--temperature", help="0 = greedy.")] = None,
    top_p: Annotated[Optional[float], typer.Option("--top-p")] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens")] = None,
    sigma: Annotated[Optional[float], typer.Option("--sigma", help="AQN at evaluation (off unless given).")] = None,
    seed: Annotated[Optional[int], typer.Option("--seed")] = None,
    verify_dir: Annotated[Optional[Path], typer.Option("--verify", help="verify artifact of a pack (default: PACKED/../verify).")] = None,
    skip_verify: Annotated[bool, typer.Option("--skip-verify", help="Evaluate an unverified pack (recorded).")] = False,
    config: ConfigFile = None,
    force: Force = False,
    progress: Progress = None,
) -> None:
    """Accuracy of a declared deployment policy, per example, with a 95% Wilson interval (an `eval` artifact);
    with -k > 1 (mean@k) the Wilson interval is taken at the effective sample size p(1-p)n/s^2 of the
    per-example scores, clamped to [n, nk] (n when p is 0 or 1), as the k samples of a problem are correlated.

    Examples:

        qerl evaluate smollm2-135m-instruct --data ../shared/data/gsm8k/test.jsonl -n 200 -o out/eval-bf16

        qerl evaluate out/packed --adapter out/run/step-00000100 --data arith:500 -o out/eval-run
    """
    from .evaluate import evaluate

    evaluate(source, data, output, adapter=adapter, num_examples=num_examples, samples=samples,
             temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, sigma=sigma, seed=seed,
             verify_dir=verify_dir, skip_verify=skip_verify, config_file=config, force=force, progress=progress)


@app.command("report", cls=_Stage)
def report_cmd(
    artifacts: Annotated[list[Path], typer.Argument(help="eval artifacts (the first is the baseline of the paired tests) and/or train runs.")],
    output: Output,
    target_accuracy: Annotated[Optional[float], typer.Option("--target-accuracy", help="For runs: report the training time to reach this accuracy: held-out accuracy where the run evaluated it (--eval-every), else the accuracy of its training samples; the metric is named.")] = None,
    force: Force = False,
) -> None:
    """Compare eval artifacts (accuracy ± CI, exact McNemar and paired bootstrap on shared examples, time,
    tokens, memory) and train runs (curves.png, quality-vs-time-vs-memory table). report.md + report.json.

    Examples:

        qerl report out/eval-bf16 out/eval-rtn out/eval-awq -o out/report

        qerl report out/run-nvfp4-aqn out/run-nvfp4 out/run-bf16 --target-accuracy 0.6 -o out/report-runs
    """
    from .report import report

    report(artifacts, output, force=force, target_accuracy=target_accuracy)


class Interrupted(BaseException):
    """SIGINT or SIGTERM, as an exception that unwinds the stages (so temporaries are cleaned up and a replaced
    output is restored) and that typer does not turn into a silent exit, as it does a KeyboardInterrupt."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


OUT_OF_MEMORY = ("out of {where} memory; outputs that were complete before are unchanged: lower the batch, group, "
                 "sequence or token settings (--config), or use a machine with more memory.")


def _on_signal(signum, frame):
    # the first signal unwinds the stages (their cleanup runs); another one during that cleanup ends the process
    # at once with one line, rather than a traceback from wherever the cleanup was: what it leaves (a temporary, a
    # replaced output between its two renames) the next run of that stage sweeps up or puts back
    signal.signal(signal.SIGTERM, _on_second_signal)
    signal.signal(signal.SIGINT, _on_second_signal)
    raise Interrupted(signum)


def _on_second_signal(signum, frame):
    try:
        ui.console.print("[bold red]interrupted again:[/] stopped before the cleanup finished; hidden .NAME.tmp-*, "
                         ".NAME.old-* or .NAME.replaced-* folders may remain beside the output (the next run of a "
                         "stage to it puts an .old-* one back or removes it).", soft_wrap=True)
    finally:
        os._exit(128 + signum)


def main() -> None:
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        code = app(prog_name="qerl", standalone_mode=False)  # (usage errors come here: one line, not a box)
    except getattr(_click_errors, "NoArgsIsHelpError", ()) as e:  # the help is already on stdout
        sys.exit(e.exit_code)
    except _click_errors.ClickException as e:  # a bad, missing or unknown option or argument
        msg = " ".join(e.format_message().split()).rstrip(".")
        cmd = e.ctx.command_path if getattr(e, "ctx", None) is not None else "qerl"
        ui.console.print(f"[bold red]error:[/] {escape(msg)}; see `{escape(cmd)} --help`.", soft_wrap=True)
        sys.exit(e.exit_code)
    except typer.Abort:  # end of input at a prompt
        ui.console.print("[bold red]error:[/] aborted.", soft_wrap=True)
        sys.exit(1)
    except QerlError as e:
        ui.console.print(f"[bold red]error:[/] {escape(str(e))}", soft_wrap=True)
        sys.exit(1)
    except OSError as e:  # a path that cannot be created or written (permissions, a file where a folder must be)
        where = f" ({e.filename})" if e.filename else ""
        ui.console.print(f"[bold red]error:[/] {escape((e.strerror or str(e)) + where)}.", soft_wrap=True)
        sys.exit(1)
    except MemoryError:
        ui.console.print(f"[bold red]error:[/] {OUT_OF_MEMORY.format(where='host')}", soft_wrap=True)
        sys.exit(1)
    except RuntimeError as e:  # torch's out-of-memory errors (its own type on CUDA, a message on CPU)
        if not (type(e).__name__ == "OutOfMemoryError" or "can't allocate memory" in str(e)):
            raise
        where = "GPU" if type(e).__name__ == "OutOfMemoryError" else "host"
        ui.console.print(f"[bold red]error:[/] {OUT_OF_MEMORY.format(where=where)}", soft_wrap=True)
        sys.exit(1)
    except (Interrupted, KeyboardInterrupt) as e:
        ui.console.print("[bold red]interrupted:[/] outputs that were complete before are unchanged; an interrupted "
                         "train run continues with --resume.", soft_wrap=True)
        sys.exit(128 + getattr(e, "signum", signal.SIGINT))
    sys.exit(code if isinstance(code, int) else 0)  # (typer.Exit(n) of a command, e.g. a failed verify)


if __name__ == "__main__":
    main()
