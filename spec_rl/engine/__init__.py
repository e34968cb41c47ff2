"""Paged generation engine: block manager, paged attention for transformers models, splicing API.

* :class:`BlockManager`, :class:`OutOfBlocks` -- refcounted KV blocks, block tables, copy-on-write.
* :class:`PagedEngine` -- a :class:`~spec_rl.generation.GenerationBackend` with
  :meth:`~PagedEngine.score_drafts` / :meth:`~PagedEngine.continue_from` for
  speculative rollouts without re-prefill.
"""

from .blocks import BlockManager, OutOfBlocks
from .engine import EngineStats, PagedEngine, SpliceHandle

__all__ = ["BlockManager", "OutOfBlocks", "EngineStats", "PagedEngine", "SpliceHandle"]
