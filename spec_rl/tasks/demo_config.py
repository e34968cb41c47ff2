"""What determines the demo checkpoint: :class:`DemoConfig` and its cache key."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from .arithmetic import TASK_VERSION
from .demo_data import _EVAL_N, _TRAIN_N, DEMO_TASK_OPTIONS, EVAL_SEED, TRAIN_SEED

__all__ = ["DemoConfig", "RECIPE_VERSION"]

#: Bumped whenever the recipe (tokenizer, model, SFT) changes in a way the config hash would not see.
RECIPE_VERSION = 1


@dataclass(frozen=True)
class DemoConfig:
    """Everything that determines the demo checkpoint; :meth:`cache_key` names its cache folder. Model (Qwen2):
    ``num_heads``/``num_kv_heads`` (grouped-query attention), ``intermediate_size`` (MLP width),
    ``max_position_embeddings`` (tokens). Tokenizer: ``vocab_size`` (256 bytes + 2 specials + merges), trained on
    ``tokenizer_corpus`` problems. SFT: ``sft_examples`` problems (seed ``sft_seed``) with slips at ``slip_prob`` per
    written result and "k boxes with m in each" worked as k + m at ``misconception_prob``; ``sft_steps`` optimizer steps
    of ``batch_size`` sequences, peak ``lr`` after ``warmup_steps``, cosine decay to ``lr * min_lr_ratio``. ``seed``
    seeds model init and batch order."""

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 512
    max_position_embeddings: int = 384
    vocab_size: int = 640
    tokenizer_corpus: int = 2000
    sft_examples: int = 8192
    sft_seed: int = 42
    slip_prob: float = 0.2
    misconception_prob: float = 0.6
    sft_steps: int = 700
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    seed: int = 0

    @classmethod
    def tiny(cls, **overrides: Any) -> DemoConfig:
        """A seconds-to-build config for tests (an untrained-quality policy)."""
        base = dict(
            hidden_size=32,
            num_layers=1,
            num_heads=2,
            num_kv_heads=1,
            intermediate_size=64,
            vocab_size=400,
            tokenizer_corpus=200,
            sft_examples=64,
            sft_steps=3,
            batch_size=8,
            warmup_steps=1,
        )
        base.update(overrides)
        return cls(**base)

    def cache_key(self) -> str:
        """12 hex digits of sha256 over the config, the task options and versions."""
        payload = {
            "config": dataclasses.asdict(self),
            "task": dict(DEMO_TASK_OPTIONS),
            "task_version": TASK_VERSION,
            "recipe_version": RECIPE_VERSION,
            "train_seed": TRAIN_SEED,
            "eval_seed": EVAL_SEED,
            # The SFT set excludes the train and held-out questions, so their sizes change the policy.
            "train_n": _TRAIN_N,
            "eval_n": _EVAL_N,
        }
        blob = json.dumps(payload, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]
