"""spec-rl: speculative rollouts for on-policy RL on LLMs (SPEC-RL, arXiv 2509.23232).

The public names, imported on first use so ``import spec_rl`` stays cheap (no transformers, no trainer); each lives
in the subpackage of its layer (docs/design.md "Layers and module map").
"""

from __future__ import annotations

import importlib

__version__ = "0.3.0"

_PUBLIC = {
    "SamplingSettings": "spec_rl.sampling.distribution",
    "keyed_sample": "spec_rl.sampling.distribution",
    "verify_logprobs": "spec_rl.acceptance.dispatch",
    "verify_logits": "spec_rl.acceptance.dispatch",
    "verify_hidden": "spec_rl.acceptance.dispatch",
    "VerifyOptions": "spec_rl.acceptance.dispatch",
    "RolloutMode": "spec_rl.acceptance.mode",
    "MODES": "spec_rl.acceptance.mode",
    "Lenient": "spec_rl.acceptance.rules",
    "Exact": "spec_rl.acceptance.rules",
    "RandomReuse": "spec_rl.acceptance.rules",
    "Rule": "spec_rl.acceptance.rules",
    "register_rule": "spec_rl.acceptance.rules",
    "VerifyResult": "spec_rl.acceptance.reference",
    "VerifyStats": "spec_rl.acceptance.reference",
    "DraftScores": "spec_rl.acceptance.scores",
    "CacheKey": "spec_rl.drafts.cache",
    "RolloutCache": "spec_rl.drafts.cache",
    "DirectoryDraftStore": "spec_rl.drafts.directory",
    "policy_owner": "spec_rl.drafts.owner",
    "DraftOwnerError": "spec_rl.drafts.owner",
    "HistoryIndex": "spec_rl.drafts.history",
    "draft_views": "spec_rl.drafts.validity",
    "Backend": "spec_rl.backends.base",
    "Job": "spec_rl.backends.base",
    "Cut": "spec_rl.backends.base",
    "Scored": "spec_rl.backends.base",
    "PolicyScorer": "spec_rl.backends.scoring",
    "TransformersBackend": "spec_rl.backends.transformers_backend",
    "VLLMBackend": "spec_rl.backends.vllm_backend",
    "PagedEngine": "spec_rl.backends.paged",
    "RolloutRequest": "spec_rl.rollout.types",
    "RolloutResult": "spec_rl.rollout.types",
    "SpeculativeRollout": "spec_rl.rollout.speculative",
    "GRPOConfig": "spec_rl.trainer.config",
    "GRPOTrainer": "spec_rl.trainer.grpo",
    "run_modes": "spec_rl.trainer.run",
    "load_policy": "spec_rl.trainer.run",
}

__all__ = sorted(_PUBLIC) + ["__version__"]


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'spec_rl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
