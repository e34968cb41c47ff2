"""The paged generation engine: block manager, scheduler, model runner, keyed sampler, PagedEngine (a backend). Layer 6:
may import util, ops, sampling, acceptance, drafts, backends (docs/design.md "Paged KV cache")."""

from .blocks import BlockManager, OutOfBlocks
from .engine import PagedEngine
from .model_runner import EngineStats, ModelRunner
from .sampler import KeyedSampler
from .scheduler import Scheduler
from .sequence import PrefillGroup, SequenceState, SpliceHandle

__all__ = [
    "BlockManager",
    "EngineStats",
    "KeyedSampler",
    "ModelRunner",
    "OutOfBlocks",
    "PagedEngine",
    "PrefillGroup",
    "Scheduler",
    "SequenceState",
    "SpliceHandle",
]
