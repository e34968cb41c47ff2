"""The paged generation engine: block manager, scheduler, model runner, keyed sampler, PagedEngine (a backend).
Layer 6: may import util, ops, sampling, acceptance, drafts, backends (docs/design.md "Paged KV cache").

* :mod:`.blocks` -- :class:`BlockManager`, :class:`OutOfBlocks`: refcounted KV blocks, block tables, copy-on-write.
* :mod:`.sequence` -- :class:`PrefillGroup`, :class:`SequenceState`, :class:`SpliceHandle`: sequence state.
* :mod:`.scheduler` -- :class:`Scheduler`: admission with worst-case block reservation, eviction, group split.
* :mod:`.model_runner` -- :class:`ModelRunner`, :class:`EngineStats`: KV tensors, packed forward, prefill, decode.
* :mod:`.sampler` -- :class:`KeyedSampler`: keyed sampling, history proposals and their lossless acceptance.
* :mod:`.attention` -- paged attention plugged into transformers' ``AttentionInterface``.
* :mod:`.engine` -- :class:`PagedEngine`: a :class:`~spec_rl.backends.protocol.GenerationBackend` with
  :meth:`~PagedEngine.score_drafts` / :meth:`~PagedEngine.continue_from` for speculative
  rollouts without re-prefill.
"""

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
