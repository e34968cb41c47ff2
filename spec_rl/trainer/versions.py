"""The trainer's epoch order, and the weight copies a residual-draw run will hold, checked before it trains
(:mod:`spec_rl.rollout.old_policy`)."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import torch

from ..rollout.old_policy import peak_copies
from ..util import memory

# Seed of an epoch's prompt order: seed * stride + epoch; a prime, so that the (seed, epoch) pairs of nearby runs do
# not collide.
_EPOCH_SEED_STRIDE = 7919
#: The share of the available memory (or free disk) the copies may take when no budget is given.
DEFAULT_SHARE = 0.5
GB = 1e9


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The order of ``n`` prompts in (0-based) ``epoch``: a shuffle keyed by the run's seed and the epoch (the cache
    is keyed by prompt ids, so the order may change every epoch)."""
    order = list(range(n))
    random.Random(seed * _EPOCH_SEED_STRIDE + epoch).shuffle(order)
    return order


def available_bytes(folder: Path | None) -> int:
    """Free disk under ``folder`` (its nearest existing parent), or the memory available to a new allocation."""
    if folder is None:
        return memory.available_bytes(torch.device("cpu"))
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free


def check_version_budget(config, n_prompts: int, copy_bytes: int, folder: Path | None, start_epoch: int = 0) -> int:
    """The most weight copies the residual draw of a run of ``config`` over ``n_prompts`` from ``start_epoch`` holds
    at once (0 when its mode keeps none); ValueError, with the alternatives, when they pass the budget:
    ``config.version_budget_gb``, or half of the available memory (or of the free disk under ``folder``, where the
    versions are files)."""
    rule = config.mode.rule
    if rule is None or not rule.needs_old_policy:
        return 0
    orders = [epoch_order(n_prompts, config.seed, e) for e in range(start_epoch, config.epochs)]
    copies = peak_copies(orders, config.prompts_per_step)
    where = "free disk" if folder is not None else "available memory"
    if config.version_budget_gb is not None:
        budget, what = config.version_budget_gb * GB, f"--version-budget {config.version_budget_gb:g} GB"
    else:
        budget = DEFAULT_SHARE * available_bytes(folder)
        what = f"half of the {where} ({_size(budget * 2)})"
    need = copies * copy_bytes
    if need > budget:
        steps = -(-n_prompts // config.prompts_per_step)
        raise ValueError(
            f"mode {rule.describe()} keeps a copy of the weights ({_size(copy_bytes)}) for every training step "
            f"whose responses are still drafts: {n_prompts} prompts at {config.prompts_per_step} per step are "
            f"{steps} steps an epoch, and this run's shuffled order holds up to {copies} copies at once "
            f"({_size(need)}), more than {what}. Use the coupled keys (--modes coupled: exact samples of the "
            "current policy, no copies), keep the versions on disk under the run directory (--versions-on-disk), "
            "raise --version-budget, or take fewer steps per epoch (--prompts-per-step, --limit)"
        )
    return copies


def _size(nbytes: float) -> str:
    return f"{nbytes / GB:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.2f} MB"
