"""Settings of the small GRPO trainer."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

MODES = ("vanilla", "spec", "random")
GENERATION_BACKENDS = ("auto", "transformers", "paged")
ACCEPTANCE_RULES = ("lenient", "exact")

#: Run labels of ``run_modes``/``--modes`` and the config fields each one sets. Plain "vanilla"
#: is the reference of every ratio; "histspec" is vanilla decoding with history speculation only
#: (the HistoSpec-style baseline), "exact" is SPEC-RL with lossless acceptance.
MODE_PRESETS = {
    "vanilla": dict(mode="vanilla", history_spec=False),
    "histspec": dict(mode="vanilla", history_spec=True),
    "spec": dict(mode="spec"),
    "exact": dict(mode="spec", acceptance="exact"),
    "random": dict(mode="random"),
}


@dataclass
class GRPOConfig:
    """GRPO with optional speculative rollouts.

    Attributes:
        mode: "vanilla" (plain GRPO, no draft reuse), "spec" (SPEC-RL) or
            "random" (random-reuse ablation, paper Table 2).
        lenience: SPEC-RL lenience l (paper default for GRPO: e^0.5, Sec. 4).
        acceptance: "lenient" (the paper's rule) or "exact" (lossless: accept y_i with
            probability pi_t(y_i), residual draw at the rejection; lenience unused).
        history_spec: verify history-drafted tokens in every decode step (tail speculation;
            changes no token, only decode steps). None: on for "spec" and "random", off for "vanilla".
        spec_tokens: most history-drafted tokens per decode step (0 disables tail speculation).
        epochs: passes over the training prompts.
        group_size: G samples per prompt.
        prompts_per_step: prompts per rollout/update step.
        ppo_mini_batches: optimizer steps per rollout batch (1 = fully on-policy).
        micro_batch_size: samples per forward/backward (gradient accumulation).
        lr, weight_decay, max_grad_norm: AdamW and gradient clipping.
        clip_low, clip_high: PPO ratio clip range [1 - low, 1 + high];
            DAPO's clip-higher sets clip_high = 0.28.
        kl_coef: weight of the k3 KL to the frozen initial policy (0 = off).
        scale_adv_by_std: GRPO's std normalisation of group advantages.
        temperature, top_k, top_p, max_response_len: sampling settings.
        max_model_len: context limit (prompt + response); None = the model's
            max_position_embeddings.
        seed: seeds data order, sampling and acceptance uniforms.
        save_checkpoint: write a transformers checkpoint (and the rollout
            cache) after every epoch so a run can resume.
        generation_backend: "paged" (:class:`spec_rl.engine.PagedEngine`: paged
            KV cache, drafts spliced without re-prefill), "transformers"
            (:class:`spec_rl.generation.TransformersBackend`), or "auto": paged
            on CUDA, transformers on CPU (measured: the paged engine decodes
            17-30% slower than the transformers loop for the CPU demo policy,
            whose cost is per-layer Python overhead, not attention).
    """

    mode: str = "spec"
    lenience: float = math.exp(0.5)
    acceptance: str = "lenient"
    history_spec: bool | None = None
    spec_tokens: int = 8
    epochs: int = 5
    group_size: int = 4
    prompts_per_step: int = 64
    ppo_mini_batches: int = 2
    micro_batch_size: int = 64
    lr: float = 1e-5
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    scale_adv_by_std: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_response_len: int = 256
    max_model_len: int | None = None
    seed: int = 0
    save_checkpoint: bool = True
    device: str = "auto"
    generation_backend: str = "auto"

    def __post_init__(self) -> None:
        if self.generation_backend not in GENERATION_BACKENDS:
            raise ValueError(f"generation_backend must be one of {GENERATION_BACKENDS}, got {self.generation_backend!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.acceptance not in ACCEPTANCE_RULES:
            raise ValueError(f"acceptance must be one of {ACCEPTANCE_RULES}, got {self.acceptance!r}")
        if isinstance(self.spec_tokens, bool) or int(self.spec_tokens) != self.spec_tokens or self.spec_tokens < 0:
            raise ValueError(f"spec_tokens must be an integer >= 0 (0 disables tail speculation), got {self.spec_tokens!r}")
        if not (self.lenience >= 0):
            raise ValueError(f"lenience must be >= 0 (0 means vanilla GRPO), got {self.lenience!r}")
        for name in ("epochs", "group_size", "prompts_per_step", "ppo_mini_batches", "micro_batch_size", "max_response_len"):
            value = getattr(self, name)
            if int(value) != value or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.clip_low < 0 or self.clip_high < 0 or self.clip_low >= 1:
            raise ValueError("clip_low must be in [0, 1) and clip_high >= 0")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")

    @property
    def rollout_strategy(self) -> str:
        """The rollout strategy this mode uses ("off" for vanilla and for lenience 0)."""
        if self.mode == "vanilla" or (self.mode == "spec" and self.lenience == 0):
            return "off"
        return "spec" if self.mode == "spec" else "random"

    @property
    def uses_history(self) -> bool:
        """Whether rollouts verify history-drafted tokens (tail speculation)."""
        on = self.mode != "vanilla" if self.history_spec is None else bool(self.history_spec)
        return on and self.spec_tokens > 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["log_lenience"] = math.log(self.lenience) if self.lenience > 0 else float("-inf")
        return d
