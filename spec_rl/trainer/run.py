"""Run one or several trainer modes from the same starting checkpoint and report them."""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .config import MODE_PRESETS, GRPOConfig
from .grpo import CHECKPOINT_DIR, GRPOTrainer, resolve_device
from .report import format_row, header_row, write_report


def load_policy(path: str | Path, device: torch.device | str = "cpu"):
    """Load a transformers causal LM and its tokenizer from a local directory.

    Raises:
        FileNotFoundError: ``path`` is not a directory with a config.json.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} is not a transformers checkpoint directory (no config.json); pass --model a local model folder"
        )
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32 if torch.device(device).type == "cpu" else "auto")
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device).eval(), tokenizer


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
) -> dict[str, list[dict]]:
    """Train each mode from ``model_path`` with identical seeds; write the report.

    ``modes`` are labels of :data:`~spec_rl.trainer.config.MODE_PRESETS` ("vanilla", "spec",
    "exact", "random", "histspec"); each runs in ``out_dir/<label>/`` (metrics.jsonl, checkpoint/,
    rollout cache); ``out_dir`` gets summary.json, report.md, report.png.

    Returns:
        {label: [per-epoch record, ...]}.

    Raises:
        ValueError: an unknown mode label.
    """
    bad = [m for m in modes if m not in MODE_PRESETS]
    if bad:
        raise ValueError(f"unknown mode(s) {bad}; choose from {list(MODE_PRESETS)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = resolve_device(config.device)
    summary: dict[str, list[dict]] = {}
    if resume and (out_dir / "summary.json").is_file():
        # Keep the records of modes this call does not rerun.
        summary = {m: r for m, r in json.loads((out_dir / "summary.json").read_text()).items() if m not in modes}
        previous_summary = json.loads((out_dir / "summary.json").read_text())
    else:
        previous_summary = {}
    log(header_row())
    for mode in modes:
        cfg = dataclasses.replace(config, **MODE_PRESETS[mode])
        mode_dir = out_dir / mode
        start_path = model_path
        if resume and (mode_dir / CHECKPOINT_DIR / "config.json").is_file():
            start_path = mode_dir / CHECKPOINT_DIR
        elif not resume and (mode_dir / "metrics.jsonl").exists():
            (mode_dir / "metrics.jsonl").unlink()
        torch.manual_seed(cfg.seed)
        model, tokenizer = load_policy(start_path, device)
        trainer = GRPOTrainer(model, tokenizer, train_examples, reward_fn, cfg, mode_dir, progress=progress, log=log, label=mode)
        if resume and trainer.resume():
            log(f"[{mode}] resumed at epoch {trainer.start_epoch + 1} with {len(trainer.cache)} cached drafts")
        records = list(previous_summary.get(mode, []))[: trainer.start_epoch] if resume else []

        def on_epoch(rec: dict, _mode: str = mode) -> None:
            log(format_row(_mode, rec))

        records += trainer.train(on_epoch=on_epoch)
        summary[mode] = records
        info = {
            "model": str(model_path),
            "device": str(device),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "lenience": config.lenience,
            "log_lenience": math.log(config.lenience) if config.lenience > 0 else float("-inf"),
            "config": config.to_dict(),
            "modes": list(modes),
            "train_prompts": len(train_examples),
        }
        write_report(out_dir, summary, info)
        del trainer, model
    return summary
