"""spec-rl: speculative rollouts for on-policy RL on LLMs (SPEC-RL, arXiv 2509.23232).

The public names, imported on first use so ``import spec_rl`` stays cheap (no transformers, no trainer); each lives
in the subpackage of its layer (docs/design.md "Layers and module map").
"""

from __future__ import annotations

import importlib

__version__ = "0.6.0"

# Each public name, by the module that defines it.
_MODULES = {
    "spec_rl.sampling.distribution": ("SamplingSettings", "keyed_sample"),
    "spec_rl.acceptance.dispatch": ("verify_logprobs", "verify_logits", "verify_hidden", "VerifyOptions"),
    "spec_rl.acceptance.mode": ("RolloutMode", "MODES"),
    "spec_rl.acceptance.rules": ("Lenient", "Exact", "RandomReuse", "Rule", "register_rule"),
    "spec_rl.acceptance.reference": ("VerifyResult", "VerifyStats"),
    "spec_rl.acceptance.scores": ("DraftScores",),
    "spec_rl.drafts.cache": ("CacheKey", "RolloutCache"),
    "spec_rl.drafts.directory": ("DirectoryDraftStore",),
    "spec_rl.drafts.owner": ("policy_owner", "DraftOwnerError"),
    "spec_rl.drafts.history": ("HistoryIndex",),
    "spec_rl.drafts.validity": ("draft_views",),
    "spec_rl.backends.base": ("Backend", "Job", "Cut", "Scored"),
    "spec_rl.backends.scoring": ("PolicyScorer",),
    "spec_rl.backends.transformers_backend": ("TransformersBackend",),
    "spec_rl.backends.vllm_backend": ("VLLMBackend",),
    "spec_rl.backends.paged": ("PagedEngine",),
    "spec_rl.rollout.types": ("RolloutRequest", "RolloutResult"),
    "spec_rl.rollout.speculative": ("SpeculativeRollout",),
    "spec_rl.rollout.old_policy": ("PolicyVersions",),
    "spec_rl.trainer.config": ("GRPOConfig",),
    "spec_rl.trainer.grpo": ("GRPOTrainer",),
    "spec_rl.trainer.run": ("run_modes", "load_policy"),
}
_PUBLIC = {name: module for module, names in _MODULES.items() for name in names}

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
