"""Who generates: the backend protocol and its checks, the scoring pass, the transformers and vLLM backends. Layer 5:
may import util, ops, sampling, acceptance, drafts."""

from .checks import BackendContractError
from .protocol import BackendStats, Continuation, GenerationBackend, eos_token_ids
from .reprefill import ReprefillBackend
from .scoring import PolicyScorer
from .transformers_backend import TransformersBackend
from .vllm_backend import VLLMBackend

__all__ = [
    "BackendContractError",
    "BackendStats",
    "Continuation",
    "GenerationBackend",
    "PolicyScorer",
    "ReprefillBackend",
    "TransformersBackend",
    "VLLMBackend",
    "eos_token_ids",
]
