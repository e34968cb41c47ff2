"""Run one or several trainer modes from the same starting checkpoint and report them."""

from __future__ import annotations

import dataclasses
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace

import torch

from ..backends.protocol import eos_token_ids
from ..util.atomic import remove_leftovers
from .checkpoint import latest_checkpoint
from .config import LOSSLESS_MODES, MODE_PRESETS, GRPOConfig, log_lenience_of, resolve_device
from .grpo import GRPOTrainer
from .report import format_row, header_row, write_report
from .resume_check import check_resume, run_fingerprint, stored_info
from .rundir import plan_run, read_summary


def load_policy(path: str | Path, device: torch.device | str = "cpu"):
    """Load a transformers causal LM and its tokenizer from a local directory.

    ``path`` is a checkpoint folder (with config.json), or a trainer's run directory (``out/<mode>``),
    whose committed checkpoint (named by its ``LATEST`` file) is loaded.

    Raises:
        FileNotFoundError: ``path`` is neither a directory with a config.json nor a run directory
            with a complete checkpoint.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file() and (ckpt := latest_checkpoint(path)) is not None:
        path = ckpt.path
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} is not a transformers checkpoint directory (no config.json); pass --model a local model folder"
        )
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32 if torch.device(device).type == "cpu" else "auto")
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device).eval(), tokenizer


def count_parameters(path: str | Path) -> int | None:
    """Parameters of the checkpoint at ``path``, from its safetensors headers (no weight is read); None
    when it has no safetensors file."""
    import json
    import struct

    files = sorted(Path(path).glob("*.safetensors"))
    total = 0
    for file in files:
        with open(file, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, entry in header.items():
            if name != "__metadata__":
                n = 1
                for dim in entry["shape"]:
                    n *= int(dim)
                total += n
    return total if files else None


def policy_eos_ids(path: str | Path) -> set[int]:
    """The EOS set of the checkpoint at ``path`` (generation config, model config and tokenizer), without
    loading its weights; the same set :func:`~spec_rl.backends.protocol.eos_token_ids` gives for the loaded model."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    try:
        generation = GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json: transformers derives it from config.json
        generation = None
    holder = SimpleNamespace(generation_config=generation, config=AutoConfig.from_pretrained(path))
    return eos_token_ids(holder, AutoTokenizer.from_pretrained(path))


def mode_configs(config: GRPOConfig, modes: Sequence[str]) -> dict[str, GRPOConfig]:
    """Each label's config: ``config`` with its :data:`MODE_PRESETS` fields; beside vanilla the
    :data:`LOSSLESS_MODES` are evaluated after the last epoch only (their evaluations would repeat vanilla's)."""
    configs = {mode: dataclasses.replace(config, **MODE_PRESETS[mode]) for mode in modes if mode in MODE_PRESETS}
    if "vanilla" in modes:
        configs.update({m: dataclasses.replace(configs[m], eval_every=config.epochs) for m in configs if m in LOSSLESS_MODES})
    return configs


def _run_info(model_path, device, config: GRPOConfig, summary: dict, train_prompts: int, eval_prompts: int) -> dict:
    return {
        "model": str(model_path),
        "device": str(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "lenience": config.lenience,
        "log_lenience": log_lenience_of(config.lenience),
        "config": config.to_dict(),
        "modes": list(summary),
        # each run's own settings: the base config with its MODE_PRESETS fields applied
        "runs": {m: c.to_dict() for m, c in mode_configs(config, list(summary)).items()},
        "train_prompts": train_prompts,
        # held-out evaluation: prompts x config.eval_samples fresh samples + greedy, at epochs 0..E (0: off)
        "eval_prompts": eval_prompts,
    }


def run_modes(
    model_path: str | Path,
    train_examples: Sequence,
    reward_fn: Callable[[str, str], float],
    config: GRPOConfig,
    modes: Sequence[str],
    out_dir: str | Path,
    progress: bool = True,
    resume: bool = False,
    log: Callable[[str], None] = print,
    eval_examples: Sequence | None = None,
    allow_config_change: bool = False,
) -> dict[str, list[dict]]:
    """Train each mode from ``model_path`` with identical seeds; write the report after every epoch.

    ``modes`` are labels of :data:`~spec_rl.trainer.config.MODE_PRESETS` ("vanilla", "spec",
    "exact", "random", "histspec"); each runs in ``out_dir/<label>/`` (metrics.jsonl and checkpoint
    versions, see :mod:`spec_rl.trainer.checkpoint`); ``out_dir`` gets summary.json, run_info.json
    and report.md after every epoch (each written atomically) and report.png when a mode ends.
    With ``resume`` every label continues from its committed checkpoint (a label without one, and
    without finished epochs, starts at epoch 1), and the records of labels not in ``modes`` stay
    in summary.json. With ``eval_examples`` every run is evaluated on them before training and after
    every ``config.eval_every``-th epoch (:mod:`spec_rl.trainer.heldout`; the lossless modes of
    :data:`~spec_rl.trainer.config.LOSSLESS_MODES` beside vanilla only after the last: their responses
    are vanilla's token for token); the warm-start evaluation is computed once and
    shared, since every run starts from the same weights with the same seed. A resume compares the
    run's configuration with the stored one (:mod:`spec_rl.trainer.resume_check`): a change of what a
    response can be or of the training recipe is refused unless ``allow_config_change``, which records it in run_info.json; a
    resume of a run whose every mode finished ``config.epochs`` epochs does nothing.

    Returns:
        {label: [per-epoch record, ...]} (with ``resume``: every label of the run directory).

    Raises:
        ValueError: an unknown mode label.
        RunDirError: ``out_dir`` holds a run and ``resume`` is False, holds none to resume, lacks a
            checkpoint to resume from, or is not writable (see :func:`~spec_rl.trainer.rundir.plan_run`).
        ConfigChangeError: ``resume`` under another configuration of what a response can be, without
            ``allow_config_change``.
    """
    bad = [m for m in modes if m not in MODE_PRESETS]
    if bad:
        raise ValueError(f"unknown mode(s) {bad}; choose from {list(MODE_PRESETS)}")
    configs = mode_configs(config, modes)  # all checked before any trains
    out_dir = Path(out_dir)
    device = resolve_device(config.device)
    plan = plan_run(out_dir, modes, resume)
    for folder in [out_dir, *(out_dir / label for label in MODE_PRESETS)]:
        remove_leftovers(folder)  # temporary files of a killed writer; checkpoint versions: trainer.resume
    summary = read_summary(out_dir) if resume else {}
    num_eval = len(eval_examples) if eval_examples is not None else 0
    fingerprint = run_fingerprint(config, model_path, policy_eos_ids(model_path), train_examples, eval_examples)
    changes = (stored_info(out_dir) or {}).get("config_changes", []) if resume else []
    if resume:  # compared first: a finished run resumed under other settings is refused too
        new_changes = check_resume(out_dir, fingerprint, allow_config_change)
        if all(plan[m] is not None and len(summary.get(m, [])) >= configs[m].epochs for m in modes):
            log(f"--resume: the run in {out_dir} is complete ({config.epochs} epochs of {', '.join(modes)}); nothing to do")
            return summary
        for c in new_changes:
            log(f"--allow-config-change: {c['field']} {c['old']!r} -> {c['new']!r} (recorded in run_info.json)")
        changes = changes + new_changes

    def info() -> dict:
        return {**_run_info(model_path, device, config, summary, len(train_examples), num_eval),
                "fingerprint": fingerprint, "config_changes": changes}  # fmt: skip

    initial = None  # the warm-start evaluation, shared by the runs
    log(header_row())
    for mode in modes:
        cfg = configs[mode]
        mode_dir = out_dir / mode
        ckpt = plan[mode]
        torch.manual_seed(cfg.seed)
        model, tokenizer = load_policy(model_path if ckpt is None else ckpt.path, device)
        # The initial policy (KL reference, diagnostics), also when the trained weights come from a checkpoint.
        needs_initial = cfg.kl_coef > 0 or eval_examples is not None  # KL term, held-out KL to the warm start
        ref = load_policy(model_path, device)[0] if ckpt is not None and needs_initial else None
        trainer = GRPOTrainer(model, tokenizer, train_examples, reward_fn, cfg, mode_dir, progress=progress, log=log,
                              label=mode, ref_model=ref, eval_examples=eval_examples, initial_heldout=initial)  # fmt: skip
        if resume:
            if not trainer.resume():
                log(f"[{mode}] no checkpoint in {mode_dir}; starting at epoch 1")
            elif trainer.start_epoch >= cfg.epochs:
                log(f"[{mode}] finished earlier: all {cfg.epochs} epochs are in {mode_dir}")
            else:
                log(f"[{mode}] resumed at epoch {trainer.start_epoch + 1} with {len(trainer.cache)} cached drafts")

        def on_epoch(rec: dict, _mode: str = mode, _trainer: GRPOTrainer = trainer) -> None:
            log(format_row(_mode, rec))
            summary[_mode] = list(_trainer.records)
            write_report(out_dir, summary, info(), plot_png=False)

        summary[mode] = trainer.train(on_epoch=on_epoch)
        initial = initial or trainer.initial_heldout
        write_report(out_dir, summary, info())
        del trainer, model, ref
    return summary
