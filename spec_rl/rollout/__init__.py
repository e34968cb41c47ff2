"""The speculative rollout, its request / result / stats types, the reward split by origin. Layer 6: may import every
layer below (util .. backends)."""

from .reward_split import ORIGINS, origin_means, response_origins
from .speculative import SpeculativeRollout
from .types import RolloutRequest, RolloutResult, RolloutStats

__all__ = [
    "ORIGINS",
    "RolloutRequest",
    "RolloutResult",
    "RolloutStats",
    "SpeculativeRollout",
    "origin_means",
    "response_origins",
]
