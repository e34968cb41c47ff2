"""Who generates (docs/design.md "Module map"): the backend contract (base.py), the rollout's checks of a backend's
answers (contract.py), the scoring pass and one file per engine. Layer 5: may import util, ops, sampling, acceptance,
drafts. A new backend is one file holding a :class:`Backend` subclass and one line in :data:`BACKENDS`."""

from __future__ import annotations

import importlib

from .base import Backend, BackendStats, Continuation, Cut, Job, Policy, Scored, eos_token_ids, fresh_jobs
from .contract import BackendContractError

#: The backends a trainer and ``--backend`` build by name: name -> "module:class" (imported when built).
BACKENDS = {
    "transformers": "spec_rl.backends.transformers_backend:TransformersBackend",
    "paged": "spec_rl.backends.paged:PagedEngine",
    "vllm": "spec_rl.backends.vllm_backend:VLLMBackend",
}


def backend_class(name: str) -> type[Backend]:
    """The class registered as ``name``; ValueError naming the choices."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)} (or auto), got {name!r}")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def build_backend(name: str, policy: Policy) -> Backend:
    """The backend ``name`` for ``policy``; "auto": vLLM for a model on CUDA when vLLM is installed, else
    transformers."""
    if name == "auto":
        on_cuda = next(policy.model.parameters()).device.type == "cuda"
        name = "vllm" if on_cuda and importlib.util.find_spec("vllm") is not None else "transformers"
    return backend_class(name).for_policy(policy)


__all__ = [
    "BACKENDS",
    "Backend",
    "BackendContractError",
    "BackendStats",
    "Continuation",
    "Cut",
    "Job",
    "Policy",
    "Scored",
    "backend_class",
    "build_backend",
    "eos_token_ids",
    "fresh_jobs",
]
