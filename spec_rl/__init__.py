"""spec-rl: speculative rollouts for on-policy RL on LLMs (SPEC-RL, arXiv 2509.23232)."""

from .acceptance import VerifyResult, VerifyStats
from .sampling import SamplingSettings
from .verify import verify

__version__ = "0.1.0"

__all__ = ["SamplingSettings", "VerifyResult", "VerifyStats", "verify", "__version__"]
