"""What one ``rollout_func`` call reads from a TRL ``GRPOTrainer``: prompt ids, slots, the model, special tokens."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence

import torch

from ..backends.base import eos_token_ids
from ..rollout.speculative import RolloutRequest
from .trl_checks import UnsupportedTrainerConfig


def tokenize_prompts(prompts: list, trainer) -> list[list[int]]:
    """Token ids of each prompt (string or chat message list), as TRL tokenises them for generation;
    UnsupportedTrainerConfig for multimodal prompts."""
    tokenize = getattr(trainer, "_tokenize_prompts", None)
    if tokenize is not None:
        prompt_ids, images, multimodal = tokenize(prompts)
        if images is not None or multimodal:
            raise UnsupportedTrainerConfig(
                "multimodal prompts: the scoring pass and decode loop are text-only; use text or chat prompts"
            )
    else:  # older TRL: the same as its text path
        prompt_ids = trainer.processing_class(text=prompts)["input_ids"]
    return [[int(t) for t in (p.tolist() if isinstance(p, torch.Tensor) else p)] for p in prompt_ids]


def group_size(trainer) -> int:
    """Samples per prompt: ``num_generations`` in training, ``num_generations_eval`` (if set) in evaluation."""
    if bool(trainer.model.training):
        return trainer.num_generations
    return getattr(trainer, "num_generations_eval", None) or trainer.num_generations


def batch_requests(
    prompt_ids: Sequence[Sequence[int]], dataset_ids: Sequence[str | None], group: int, offset: int
) -> list[RolloutRequest]:
    """One request per sample; sample i is slot ``(offset + i) % group`` of its group.

    ``prompt_ids`` holds this process's prompts, each repeated ``group`` times in a row (TRL's RepeatSampler);
    ``offset`` is the index of its first sample in the global batch (``process_index * len(prompt_ids)``).
    Raises RuntimeError when one group has different prompts or dataset ids (slots would be wrong)."""
    requests = []
    first_of_group: dict[int, int] = {}
    for i, (p, did) in enumerate(zip(prompt_ids, dataset_ids)):
        g = (offset + i) // group
        j = first_of_group.setdefault(g, i)
        if list(prompt_ids[j]) != list(p) or dataset_ids[j] != did:
            raise RuntimeError(
                f"samples {j} and {i} fall in the same group of num_generations={group} but have different prompts; "
                "the batch is not laid out by TRL's RepeatSampler (each prompt repeated num_generations times in a "
                "row), so sample slots cannot be derived"
            )
        requests.append(RolloutRequest(prompt_ids=list(p), slot=(offset + i) % group, dataset_id=did))
    return requests


def unwrapped_model(trainer):
    """Context manager yielding the trainer's model ready for generation (ZeRO-3 weights gathered)."""
    try:
        from trl.models.utils import unwrap_model_for_generation
    except ImportError:  # pragma: no cover - older layouts
        return contextlib.nullcontext(trainer.accelerator.unwrap_model(trainer.model))
    args = trainer.args
    kwargs = {
        "gather_deepspeed3_params": getattr(args, "ds3_gather_for_generation", True),
        "gradient_checkpointing_kwargs": getattr(args, "gradient_checkpointing_kwargs", None),
    }
    # Older trl 1.x releases take fewer keyword arguments here.
    accepted = inspect.signature(unwrap_model_for_generation).parameters
    kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    return unwrap_model_for_generation(getattr(trainer, "model_wrapped", trainer.model), trainer.accelerator, **kwargs)


def generation_tokens(model, trainer) -> tuple[set[int], int]:
    """The full EOS set (TRL's list, the model's generation config, the tokenizer) and the pad id;
    UnsupportedTrainerConfig when neither model nor tokenizer declares an EOS id."""
    tok = getattr(trainer, "_tokenizer", None) or trainer.processing_class
    eos = eos_token_ids(model, tok) | {int(x) for x in (getattr(trainer, "eos_token_ids", None) or [])}
    if not eos:
        raise UnsupportedTrainerConfig(
            "neither the model nor the tokenizer declares an EOS id; set tokenizer.eos_token"
        )
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos)
    return eos, pad


def hook_dataset_ids(trainer, column: str, set_ids: Callable[[list[str] | None], None]) -> None:
    """Wrap ``trainer._generate_and_score_completions`` so that ``set_ids`` gets the batch rows' ``column`` (str, in
    order) before the call, for the rollout_func inside, and None after it.

    Raises UnsupportedTrainerConfig when TRL has no ``_generate_and_score_completions``, and at a call KeyError
    for rows without ``column``."""
    original = getattr(trainer, "_generate_and_score_completions", None)
    if original is None:
        raise UnsupportedTrainerConfig(
            "this TRL version has no GRPOTrainer._generate_and_score_completions to read the dataset-id column "
            "from; use dataset_id_fn=... instead (trl>=1.16 tested)"
        )

    def with_ids(inputs, *a, **kw):
        missing = [i for i, row in enumerate(inputs) if column not in row]
        if missing:
            raise KeyError(
                f"dataset_id_column={column!r} is missing from batch rows {missing[:5]}; add that column to the "
                "dataset (a stable id per row) or drop dataset_id_column"
            )
        set_ids([str(row[column]) for row in inputs])
        try:
            return original(inputs, *a, **kw)
        finally:
            set_ids(None)

    trainer._generate_and_score_completions = with_ids
    trainer._spec_rl_id_hook = True


def trainer_owner(trainer) -> str | None:
    """The owner tag of the trainer's policy (:func:`~spec_rl.drafts.owner.policy_owner`); None when its processing
    class has no vocabulary to fingerprint."""
    from ..drafts.owner import policy_owner

    tokenizer = getattr(trainer, "processing_class", None)
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a multimodal processor wraps its tokenizer
    if not callable(getattr(tokenizer, "get_vocab", None)):
        return None
    model = getattr(trainer, "model", None)
    return policy_owner(tokenizer, getattr(getattr(model, "module", model), "config", None))
