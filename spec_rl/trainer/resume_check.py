"""Resuming a run under another configuration: what is compared, refused and recorded.

A resumed run reuses the rollout cache of the run it continues, and a changed response space or training recipe would go
unnoticed. ``--resume`` refuses any changed fingerprint field unless ``--allow-config-change``, which records the change
in run_info.json; stored drafts are then cut or continued (:mod:`spec_rl.drafts.validity`)."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Collection, Sequence
from dataclasses import fields
from pathlib import Path

from .config import GRPOConfig
from .rundir import INFO_FILE, RunDirError

#: GRPOConfig fields that change what a response can be; each run's mode is compared too, without ``tail``
#: (tail speculation changes decode steps, never a token).
RESPONSE_FIELDS = ("sampling", "prompt_format", "max_model_len", "seed")
#: GRPOConfig fields a resume may change: epochs (a resume may extend a run), micro_batch_size and the residual draw's
#: version budget and place (memory only), device and backend (keyed sampling), save_checkpoint; ``mode`` and
#: ``rollout_correction`` are compared per run.
NOT_COMPARED = (
    *("mode", "rollout_correction", "epochs", "micro_batch_size", "save_checkpoint", "device", "generation_backend"),
    *("version_budget_gb", "versions_on_disk"),
)
#: GRPOConfig fields that change how the policy is trained or measured: every other field.
TRAINING_FIELDS = tuple(f.name for f in fields(GRPOConfig) if f.name not in RESPONSE_FIELDS + NOT_COMPARED)


class ConfigChangeError(RunDirError):
    """``--resume`` under another configuration; ``changes``: [(fingerprint field, stored value, new value)]."""

    def __init__(self, out_dir, changes: list[tuple[str, object, object]]):
        self.out_dir, self.changes = out_dir, changes
        super().__init__(self.describe())

    def describe(self, name=lambda field: field) -> str:
        """The message, each changed field shown by ``name(field)`` (e.g. the CLI's flag for it)."""
        shown = "; ".join(f"{name(k)}: {old!r} -> {new!r}" for k, old, new in self.changes)
        return (
            f"--resume: {self.out_dir} was run with another configuration of what a response can be or how the "
            f"policy is trained ({shown}); "
            "start a new run with a fresh --out, or pass --allow-config-change to continue (the change is "
            "recorded in run_info.json, and stored drafts are cut to the new budget and EOS set or continued)"
        )


def data_digest(examples: Sequence, eval_examples: Sequence | None) -> str:
    """A short hash of the train and held-out examples (prompt, answer, uid of each, in order)."""
    h = hashlib.blake2b(digest_size=12)
    for part in (examples, eval_examples or ()):
        for ex in part:
            h.update(json.dumps([ex.prompt, ex.answer, ex.uid]).encode("utf-8"))
        h.update(b"\xff")
    return h.hexdigest()


def run_fingerprint(
    config: GRPOConfig,
    runs: dict[str, GRPOConfig],
    model_path,
    eos_ids: Collection[int],
    examples: Sequence,
    eval_examples,
) -> dict:
    """What the runs' responses and training depend on (``runs``: each run's config), compared by
    :func:`check_resume`."""
    cfg = config.to_dict()
    out = {field: cfg[field] for field in RESPONSE_FIELDS + TRAINING_FIELDS}
    for label, run in runs.items():
        out[f"mode:{label}"] = {k: v for k, v in run.mode.to_dict().items() if k != "tail"}
        if run.rollout_correction is not None:
            out[f"mode:{label}"]["rollout_correction"] = run.rollout_correction.name
    out.update(
        model=str(model_path), eos_ids=sorted(int(e) for e in eos_ids), data=data_digest(examples, eval_examples)
    )
    return out


def stored_info(out_dir: str | Path) -> dict | None:
    """run_info.json of ``out_dir`` (None when there is none or it is not a JSON object)."""
    path = Path(out_dir) / INFO_FILE
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def check_resume(out_dir: str | Path, fingerprint: dict, allow_change: bool) -> list[dict]:
    """The changes of ``fingerprint`` from the stored run's, to record (empty: none); ConfigChangeError when a field
    differs and ``allow_change`` is False."""
    old = (stored_info(out_dir) or {}).get("fingerprint") or {}
    changes = [(k, old[k], v) for k, v in fingerprint.items() if k in old and old[k] != v]
    if not changes:
        return []
    if not allow_change:
        raise ConfigChangeError(out_dir, changes)
    date = time.strftime("%Y-%m-%d %H:%M:%S")
    return [{"date": date, "field": k, "old": old, "new": new} for k, old, new in changes]
