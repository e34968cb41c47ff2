"""Keyed randomness and the sampling distribution. Layer 2: may import util and ops."""

from .distribution import SamplingSettings, keyed_sample, sampling_log_softmax, token_logprobs
from .philox import mix_seed, philox_uniform

__all__ = ["SamplingSettings", "keyed_sample", "mix_seed", "philox_uniform", "sampling_log_softmax", "token_logprobs"]
