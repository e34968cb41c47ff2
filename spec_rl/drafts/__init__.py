"""What is reused: drafts, their stores (in memory, a shared directory), draft validity, the history index.
Layer 4: may import util, ops, sampling, acceptance."""

from .cache import CacheKey, Draft, DraftStore, RolloutCache
from .directory import DirectoryDraftStore
from .history import HistoryIndex
from .validity import DraftView, draft_view, draft_views

__all__ = [
    "CacheKey",
    "DirectoryDraftStore",
    "Draft",
    "DraftStore",
    "DraftView",
    "HistoryIndex",
    "RolloutCache",
    "draft_view",
    "draft_views",
]
