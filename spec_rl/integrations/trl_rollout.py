"""The speculative rollouts behind :class:`~spec_rl.integrations.trl.SpecRLRollout`.

Evaluation samples without drafts into a throw-away cache and only reads the history (:class:`ReadOnlyHistory`):
history drafts are verified with "sample == proposal", so they save decode steps without changing a token."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..acceptance.mode import TAIL_WIDTH, RolloutMode
from ..backends.transformers_backend import TransformersBackend
from ..drafts.cache import RolloutCache
from ..drafts.history import HistoryIndex, SuffixProposer
from ..rollout.speculative import RolloutRequest, RolloutResult, SpeculativeRollout
from ..sampling.distribution import SamplingSettings
from ..sampling.philox import mix_seed
from .trl_batch import generation_tokens
from .trl_checks import UnsupportedTrainerConfig


class ReadOnlyHistory:
    """A :class:`~spec_rl.drafts.history.HistoryIndex` view that proposes drafts and ignores ``add``."""

    def __init__(self, index: HistoryIndex):
        self.index = index

    def __len__(self) -> int:
        return len(self.index)

    def proposer(
        self, key: bytes, prefix: Sequence[int] = (), max_k: int = TAIL_WIDTH, vocab_size: int | None = None
    ) -> SuffixProposer | None:
        return self.index.proposer(key, prefix, max_k=max_k, vocab_size=vocab_size)

    def add(self, key: bytes, response: Sequence[int]) -> None:
        """Evaluation responses are not indexed."""


@dataclass(frozen=True)
class RolloutOptions:
    """The adapter's rollout options (see :class:`~spec_rl.integrations.trl.SpecRLRollout`)."""

    mode: RolloutMode
    verify_backend: str
    max_model_len: int | None
    seed: int | None


class TrainerRollouts:
    """The training and evaluation rollouts of one model over one backend (:func:`trainer_backend`); raises
    UnsupportedTrainerConfig without ``max_model_len`` and none in the model config."""

    def __init__(
        self,
        model,
        trainer,
        settings: SamplingSettings,
        cache: RolloutCache,
        history: HistoryIndex | None,
        options: RolloutOptions,
    ):
        eos, pad = generation_tokens(model, trainer)
        max_len = options.max_model_len or getattr(model.config.get_text_config(), "max_position_embeddings", None)
        if max_len is None:
            raise UnsupportedTrainerConfig("the model config has no max_position_embeddings; pass max_model_len=...")
        self.seed = options.seed if options.seed is not None else int(getattr(trainer.args, "seed", 0))
        common = dict(
            backend=trainer_backend(model, trainer, eos, pad),
            settings=settings,
            eos_ids=eos,
            max_model_len=int(max_len),
            seed=self.seed,
            verify_backend=options.verify_backend,
        )
        self.train = SpeculativeRollout(cache=cache, mode=options.mode, history=history, **common)
        view = ReadOnlyHistory(history) if history is not None else None
        plain = RolloutMode(None, tail=options.mode.tail if view is not None else 0)
        self.eval = SpeculativeRollout(cache=RolloutCache(), mode=plain, history=view, **common)

    def run(
        self, requests: list[RolloutRequest], training: bool, step: int, salt: int, cache: RolloutCache
    ) -> RolloutResult:
        """One rollout call; evaluation samples plainly into a fresh throw-away cache."""
        if training:
            return self.train.run(requests, step=step, seed=self.seed ^ salt, cache=cache)
        return self.eval.run(requests, step=step, seed=self.seed ^ salt, cache=RolloutCache())


def trainer_backend(model, trainer, eos_ids, pad_id: int):
    """The trainer's colocated vLLM engine when it has one (drafts still scored by its model, no tail speculation),
    else a TransformersBackend on its model. Raises UnsupportedTrainerConfig in colocate mode without a vLLM engine."""
    args = trainer.args
    if getattr(args, "use_vllm", False) and getattr(args, "vllm_mode", "colocate") == "colocate":
        from ..backends.vllm_backend import VLLMBackend

        llm = getattr(getattr(trainer, "vllm_generation", None), "llm", None) or getattr(trainer, "llm", None)
        if llm is None:
            raise UnsupportedTrainerConfig(
                "use_vllm=True with vllm_mode='colocate' but the trainer has no vLLM engine "
                "(trainer.vllm_generation.llm); is this trl >= 1.0?"
            )
        backend = VLLMBackend.on_engine(llm, model, eos_ids, pad_id)
    else:
        backend = TransformersBackend(model, eos_ids=eos_ids, pad_id=pad_id)
    # the owner tag then names the tokenizer: drafts of another one are refused
    backend.tokenizer = getattr(trainer, "_tokenizer", None) or getattr(trainer, "processing_class", None)
    return backend


class CallSeeds:
    """Seed salt of each ``rollout_func`` call: the process index and the call's count within its step (several
    generation batches may share one), or on a negative axis the evaluation call's count."""

    def __init__(self) -> None:
        self._last_step: int | None = None
        self._calls_at_step = 0
        self._eval_calls = 0

    def salt(self, training: bool, step: int, process_index: int) -> int:
        if training:
            self._calls_at_step = self._calls_at_step + 1 if step == self._last_step else 0
            self._last_step = step
            return mix_seed(process_index, self._calls_at_step)
        self._eval_calls += 1
        return mix_seed(process_index, -self._eval_calls)
