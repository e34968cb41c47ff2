"""Where the Triton kernels (``spec_rl.kernels``) run: one place decides, for every caller."""

from __future__ import annotations

import torch


def kernels_for(device: torch.device | str):
    """The ``spec_rl.kernels`` module when its kernels can run on ``device`` (CUDA with Triton; a CPU only under
    TRITON_INTERPRET=1), else None."""
    try:
        from spec_rl import kernels
    except Exception:  # triton missing or broken: the torch paths run
        return None
    return kernels if kernels.is_available(torch.device(device)) else None
