"""The paged KV engine (docs/design.md "Paged KV cache"): block manager, scheduler, model runner, keyed sampler and
:class:`PagedEngine`, a backend."""

from .blocks import BlockManager, OutOfBlocks
from .engine import PagedEngine
from .model_runner import EngineStats, ModelRunner
from .sampler import KeyedSampler
from .scheduler import Scheduler
from .sequence import PrefillGroup, ScoredSequences, SequenceState

__all__ = [
    "BlockManager",
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
