"""The paged KV engine (docs/design.md "Paged KV cache"): block manager, scheduler, model runner, keyed sampler, the
static-shape decode step and :class:`PagedEngine`, a backend."""

from .blocks import BlockManager, OutOfBlocks
from .engine import PagedEngine
from .model_runner import EngineStats, ModelRunner
from .sampler import KeyedSampler
from .scheduler import Scheduler
from .sequence import PrefillGroup, ScoredSequences, SequenceState
from .static_decode import DecodeConfig

__all__ = [
    "BlockManager",
    "DecodeConfig",
    "EngineStats",
    "KeyedSampler",
    "ModelRunner",
    "OutOfBlocks",
    "PagedEngine",
    "PrefillGroup",
    "Scheduler",
    "ScoredSequences",
    "SequenceState",
]
