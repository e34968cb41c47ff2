"""The sampling distribution and keyed sampling from it. Drafts must be re-scored under exactly the processing that
sampled them (docs/design.md "The rule", step 1), so backends and the verifier share :func:`sampling_log_softmax`:
divide by the temperature, keep the top-k logits (ties kept), then the fewest most likely tokens whose mass reaches
top_p (the crossing token kept), as transformers and vLLM do; tokens outside the support get log-prob -inf."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch

from ..util.triton import kernels_for
from ..util.validation import check_int, check_real, check_type
from .philox import STREAM_SAMPLE, U24_SCALE, U_FLOOR, philox4x32, philox_keys


@dataclass(frozen=True)
class SamplingSettings:
    """How responses are sampled; drafts are reused only under the same distribution. ``temperature`` > 0 (greedy
    decoding has no usable log-probabilities); ``top_p`` in (0, 1], 1 disables it; ``top_k`` >= 0, 0 disables it;
    ``max_tokens`` >= 1, the response budget in tokens before the model-length cap. TypeError or ValueError for a field
    of the wrong type or out of range (bools and strings are not numbers)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256

    def __post_init__(self) -> None:
        # Stored as plain Python numbers (numpy scalars included), so equal settings compare, hash and
        # serialise equal; bools and strings are refused rather than read as numbers.
        greedy = " (greedy decoding has no usable log-probabilities; use e.g. temperature=0.1)"
        nucleus = " (use 1.0 to disable nucleus sampling)"
        checked = {
            "temperature": check_real("temperature", self.temperature, low=0.0, low_open=True, hint=greedy),
            "top_p": check_real("top_p", self.top_p, low=0.0, low_open=True, high=1.0, hint=nucleus),
            "top_k": check_int("top_k", self.top_k, low=0, hint=" (use 0 to disable top-k)"),
            "max_tokens": check_int("max_tokens", self.max_tokens, low=1, hint=" (the response budget in tokens)"),
        }
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    def same_distribution(self, other: SamplingSettings) -> bool:
        """True when temperature, top_p and top_k are equal: ``max_tokens`` changes where a response is cut, not
        any token's log-prob (:meth:`spec_rl.drafts.cache.DraftStore.lookup`)."""
        return (self.temperature, self.top_p, self.top_k) == (other.temperature, other.top_p, other.top_k)

    @classmethod
    def from_dict(cls, data, name: str = "settings") -> SamplingSettings:
        """Settings from :meth:`to_dict`'s output. ValueError when ``data`` is not a dict or has unknown fields;
        TypeError or ValueError for a bad field, as the constructor."""
        names = [f.name for f in fields(cls)]
        if not isinstance(data, dict):
            raise ValueError(f"{name} must be an object with fields {names}, got {type(data).__name__}")
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ValueError(f"{name} has unknown fields {unknown} (expected {names})")
        return cls(**data)

    def to_dict(self) -> dict:
        return asdict(self)

    def budget(self, prompt_len: int, max_model_len: int, where: str = "the prompt") -> int:
        """Response budget in tokens before reuse: ``min(max_tokens, max_model_len - prompt_len)``; ValueError naming
        ``where`` (the prompt) when that leaves no room for a response."""
        budget = min(int(self.max_tokens), int(max_model_len) - int(prompt_len))
        if budget < 1:
            raise ValueError(
                f"{where} has {prompt_len} tokens: max_model_len={max_model_len} leaves no room for a response; "
                "shorten the prompt or raise max_model_len"
            )
        return budget

    @property
    def is_plain(self) -> bool:
        """True when the distribution is softmax(logits / T) over the full vocabulary."""
        return self.top_k == 0 and self.top_p >= 1.0


def check_settings(settings, name: str = "settings") -> SamplingSettings:
    """``settings`` itself, or a TypeError when it is not a :class:`SamplingSettings` (e.g. a dict or None)."""
    hint = " (build one with SamplingSettings(temperature=..., top_p=..., top_k=..., max_tokens=...))"
    check_type(name, settings, SamplingSettings, hint=hint)
    return settings


def check_seed(seed) -> int:
    """``seed`` as a Python int; TypeError for anything but an integer (a float or a string is not truncated)."""
    return check_int("seed", seed, hint=" (a 64-bit seed, taken modulo 2**64)")


def _raise_if_no_distribution(total: torch.Tensor, labels=None) -> None:
    """ValueError naming the rows whose probability mass ``total`` [N] is NaN or 0; ``labels(r)`` describes row r."""
    bad = ~(total > 0)  # NaN compares False
    if bool(bad.any()):
        rows = torch.nonzero(bad).flatten().tolist()
        raise no_distribution_error([f"row {r}" + (f" ({labels(r)})" if labels else "") for r in rows])


def no_distribution_error(rows: list[str]) -> ValueError:
    """The error for sampled rows (described by ``rows``) whose logits give no sampling distribution."""
    named = ", ".join(rows[:8]) + (", ..." if len(rows) > 8 else "")
    return ValueError(
        f"logits {named} {'has' if len(rows) == 1 else 'have'} no sampling distribution: NaN or +inf logits, or "
        "every token has probability 0 after temperature/top-k/top-p. The policy forward produced invalid "
        "scores: check it for overflow (fp16/bf16) or fully masked rows"
    )


def sampling_log_softmax(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Log-probs [..., V] in ``dtype`` of the sampling distribution of ``logits`` [..., V]; -inf outside the support.
    temperature > 0; top_k: 0 disables, else the k largest are kept (ties too); top_p: 1 disables nucleus filtering;
    ``dtype``: computation and output dtype (float64 for references)."""
    x = logits.to(dtype) / float(temperature)
    if top_k and top_k < x.shape[-1]:
        kth = torch.topk(x, int(top_k), dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0].fill_(False)  # always keep the most likely token (a fill: no tensor made on the host)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.log_softmax(x, dim=-1)


def token_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Log-probs [...] in ``dtype`` of ``token_ids`` [...] under the sampling distribution of ``logits`` [..., V]."""
    logp = sampling_log_softmax(logits, temperature, top_k, top_p, dtype=dtype)
    return logp.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)


def residual_logprobs(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Log-probs [..., V] of the residual max(0, p - q) renormalised, the token at a rejection of speculative sampling
    (with acceptance min(1, p/q) every position is then distributed as p); p itself where p <= q everywhere (a
    rejection there has probability 0). ``logp``, ``logq``: [..., V] log-probs, any float dtype (float64 in the
    references)."""
    diff = (logp.exp() - logq.exp()).clamp_min(0)
    has = diff.sum(-1, keepdim=True) > 0
    return torch.where(has, torch.log(diff / diff.sum(-1, keepdim=True).clamp_min(torch.finfo(diff.dtype).tiny)), logp)


@torch.no_grad()  # sampling is never differentiated: no graph over [N, V]
def keyed_sample(
    logits: torch.Tensor,
    settings: SamplingSettings,
    seed: int,
    uids: torch.Tensor,
    positions: torch.Tensor,
    exclude: torch.Tensor | None = None,
    index: torch.Tensor | None = None,
    residual_of: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row by a keyed exponential race (Gumbel-max; docs/design.md "Randomness"): row r returns argmax
    over tokens of ``log p(token) + G(token)``, with Gumbel noise G = -log(-log u) whose uniforms are keyed by (seed,
    uids[r], positions[r], token): an exact sample of the sampling distribution, a pure function of the key and the
    logits (the same alone or in any batch, one token per decode step or several), and robust to rounding: it changes
    only where two tokens' scores nearly tie.

    ``logits``: [N, V] float, or [U, V] distinct rows with ``index`` [N] int64 (row r samples ``logits[index[r]]``);
    ``uids``, ``positions``: [N] int64 sequence ids and absolute positions; ``exclude``: [N] int64 token removed from
    row r's distribution (renormalised: exact sampling's residual for a point-mass draft; a row whose whole mass is
    on it samples the full distribution), not with ``index``; ``residual_of``: [N, V] logits of a draft's policy q
    (sampled with the same settings): row r samples the residual max(0, p - q) renormalised
    (:func:`residual_logprobs`), not with ``index`` or ``exclude``.

    Returns (token_ids [N] int64, logprobs [N] float32), log-probs under the full sampling distribution. TypeError:
    ``settings`` not a SamplingSettings, a non-integer seed or index tensor. ValueError: a row without a distribution
    (named by uid and position), wrong shapes or lengths, ids outside [0, V) or [0, U), both index and exclude."""
    check_settings(settings)
    seed = check_seed(seed)
    if sum(x is not None for x in (index, exclude, residual_of)) > 1:
        raise ValueError("keyed_sample takes one of index, exclude and residual_of (index logits[index] first)")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        got = list(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must be a [N, V] tensor, got {got}")
    if index is not None:
        index = _index_vector("index", index, None, high=logits.shape[0])
    n = logits.shape[0] if index is None else index.shape[0]  # U = N without index
    if exclude is not None:
        exclude = _index_vector("exclude", exclude, n, high=logits.shape[1])
    uids, positions = _index_vector("uids", uids, n), _index_vector("positions", positions, n)
    logp = sampling_log_softmax(logits, settings.temperature, settings.top_k, settings.top_p)
    if residual_of is not None and residual_of.shape != logits.shape:
        raise ValueError(f"residual_of must have the logits' shape {list(logits.shape)}, got {list(residual_of.shape)}")
    total = logp.exp().sum(-1)
    _raise_if_no_distribution(
        total if index is None else total[index], lambda r: f"uid {int(uids[r])}, position {int(positions[r])}"
    )
    keys = philox_keys(seed, uids, positions, STREAM_SAMPLE).to(logp.device)  # uids may live elsewhere
    ids = torch.empty(n, dtype=torch.int64, device=logp.device)
    step = max(1, _NOISE_ELEMENTS // max(logp.shape[-1], 1))
    for start in range(0, n, step):
        rows = slice(start, start + step)
        lp = logp[rows] if index is None else logp[index[rows]]
        race = lp
        if residual_of is not None:
            q = residual_of[rows].to(lp.device)
            race = residual_logprobs(lp, sampling_log_softmax(q, settings.temperature, settings.top_k, settings.top_p))
        if exclude is not None:
            ex = exclude[rows].unsqueeze(-1)
            others = lp.scatter(-1, ex, float("-inf")).amax(-1) > float("-inf")  # mass left besides the excluded
            race = race.scatter(
                -1, ex, torch.where(others, float("-inf"), race.gather(-1, ex).squeeze(-1)).unsqueeze(-1)
            )
        ids[rows] = gumbel_race(race, keys[rows])
    rows_of = torch.arange(n, device=logp.device) if index is None else index
    return ids, logp[rows_of, ids]


def gumbel_race(race: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Token ids [N] int64: argmax over tokens of ``race`` [N, V] float32 plus Gumbel noise -log(-log u), row r's
    uniforms keyed by ``keys[r]`` (:func:`~spec_rl.sampling.philox.philox_keys`). On a CPU the device's generator
    seeded with the key draws the row's V uniforms; on CUDA they are Philox words of counter (token, 0, 0, 0) under
    the key (:func:`philox_gumbel_argmax`; the Triton kernel when present), drawn on the device with no host sync, so
    a CUDA graph can hold the step. Inputs are trusted (:func:`keyed_sample` checks them)."""
    if race.device.type == "cuda":
        kernels = kernels_for(race.device)
        if kernels is not None:
            return kernels.gumbel_argmax(race, keys)
        return philox_gumbel_argmax(race, keys)
    gen = torch.Generator(device=race.device)
    u = torch.empty(race.shape, dtype=torch.float32, device=race.device)
    for row, key in zip(u, keys.tolist()):  # each row's uniforms from the generator seeded with its key
        gen.manual_seed(key)
        row.uniform_(generator=gen)
    return (race + gumbel_noise(u)).argmax(-1)


def gumbel_noise(u: torch.Tensor) -> torch.Tensor:
    """Gumbel noise -log(-log u) of uniforms ``u`` in [0, 1) (float32, overwritten), u = 0 read as :data:`U_FLOOR`:
    finite for every u, so a token of probability 0 never wins (the CUDA kernel applies the same law)."""
    return u.clamp_(min=U_FLOOR).log_().neg_().log_().neg_()


def philox_gumbel_argmax(race: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The CUDA rule of :func:`gumbel_race` in torch (the Triton kernel's reference): u = (x0 >> 8) * 2**-24 in
    [0, 1) (0 read as :data:`U_FLOOR`), x0 the first Philox4x32-10 word of counter (token, 0, 0, 0) under key
    (keys[r] low, high word)."""
    vocab = race.shape[-1]
    token = torch.arange(vocab, dtype=torch.int64, device=race.device).unsqueeze(0)
    zero = torch.zeros_like(token)
    k = keys.to(torch.int64).unsqueeze(1)
    x0 = philox4x32((token, zero, zero, zero), (k & 0xFFFFFFFF, (k >> 32) & 0xFFFFFFFF))[0]
    u = (x0 >> 8).to(torch.float32) * U24_SCALE
    return (race.float() + gumbel_noise(u)).argmax(-1)


#: Noise values formed at once (rows x vocabulary): bounds the extra memory of a large batch at a large vocabulary.
_NOISE_ELEMENTS = 1 << 22


def _index_vector(name: str, t, n: int | None, high: int | None = None) -> torch.Tensor:
    """``t`` as a 1-D int64 tensor of length ``n`` (None: any), values in [0, high) when given."""
    check_type(name, t, torch.Tensor, "a 1-D integer torch.Tensor")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    if t.dim() != 1 or (n is not None and t.shape[0] != n):
        raise ValueError(
            f"{name} must have shape [{'N' if n is None else n}] (one entry per sample), got {list(t.shape)}"
        )
    if high is not None and t.numel() and (int(t.min()) < 0 or int(t.max()) >= high):
        raise ValueError(f"{name} holds values outside [0, {high}): min {int(t.min())}, max {int(t.max())}")
    return t.long()
