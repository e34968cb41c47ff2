"""The speculative rollout checks its inputs up front and everything its backend returns.

A backend that breaks the :class:`~spec_rl.backends.base.Backend` contract (more tokens than the budget, ids outside
the vocabulary, finish reasons that contradict the tokens, a wrong number of continuations, bad log-probs) gets a
:class:`~spec_rl.backends.contract.BackendContractError` that names the backend class; bad requests and stored drafts
get a ValueError naming the request.
"""

import math

import pytest
import torch
from tiny_models import WORDS, tiny_model

from spec_rl.acceptance.mode import MODES, RolloutMode
from spec_rl.acceptance.rules import Exact, Lenient
from spec_rl.backends import BackendContractError
from spec_rl.backends.base import Backend, BackendStats, Continuation, Cut, Job
from spec_rl.backends.transformers_backend import TransformersBackend
from spec_rl.drafts.cache import CacheKey, RolloutCache
from spec_rl.rollout.speculative import RolloutRequest, SpeculativeRollout
from spec_rl.sampling.distribution import SamplingSettings

VOCAB = len(WORDS)
PROMPTS = [[3, 11, 12, 13], [3, 15, 16], [3, 17, 18, 19, 20]]


class Tampered(TransformersBackend):
    """A TransformersBackend whose continuations (or scores) pass through ``tamper`` (a broken backend)."""

    def __init__(self, model, tamper=lambda outs: outs, tamper_scores=lambda scores: scores):
        super().__init__(model, {1}, pad_id=0)
        self.tamper, self.tamper_scores = tamper, tamper_scores
        self.released = 0

    def score(self, prompts, drafts, logprobs=None):
        scored = super().score(prompts, drafts, logprobs)
        scored.scores = self.tamper_scores(scored.scores)
        return scored

    def release(self, handle):
        self.released += 1
        super().release(handle)

    def generate(self, *args, **kwargs):
        return self.tamper(super().generate(*args, **kwargs))

    def continue_from(self, *args, **kwargs):
        return self.tamper(super().continue_from(*args, **kwargs))


def _lenient(lenience: float = math.exp(0.5)) -> RolloutMode:
    """The lenient rule at ``lenience``, without tail speculation."""
    return RolloutMode(Lenient(lenience), tail=0)


def _rollout(backend, max_tokens=4, max_model_len=64, mode=None, **kw):
    settings = SamplingSettings(max_tokens=max_tokens)
    return SpeculativeRollout(
        backend, RolloutCache(), settings, eos_ids=[1], max_model_len=max_model_len, mode=mode or _lenient(), **kw
    )


def _requests(group=2):
    return [RolloutRequest(p, s, dataset_id=f"p{i}") for i, p in enumerate(PROMPTS) for s in range(group)]


def _first(outs, pred):
    """Index of the first continuation that satisfies ``pred``."""
    return next(i for i, c in enumerate(outs) if pred(c))


def _edit(pred, change):
    """A tamper function: apply ``change`` to the first continuation with ``pred``."""

    def tamper(outs):
        outs = list(outs)
        i = _first(outs, pred)
        outs[i] = change(outs[i])
        return outs

    return tamper


LENGTH = lambda c: c.finish_reason == "length" and len(c.token_ids) > 1  # noqa: E731
EOS = lambda c: c.finish_reason == "eos"  # noqa: E731

BROKEN = {
    "too few continuations (R01)": (lambda outs: list(outs)[:-1], "returned 5 continuations for 6 rows"),
    "too many continuations (R01)": (lambda outs: list(outs) + [outs[0]], "returned 7 continuations for 6 rows"),
    "more tokens than the budget (R02)": (
        _edit(LENGTH, lambda c: Continuation(c.token_ids + [5], c.logprobs + [-1.0], "length")),
        "5 tokens but its budget is 4",
    ),
    "id >= vocab (R08)": (
        _edit(LENGTH, lambda c: Continuation([VOCAB + 5] + c.token_ids[1:], c.logprobs, "length")),
        f"token id {VOCAB + 5} outside [0, {VOCAB})",
    ),
    "negative id (R08)": (
        _edit(LENGTH, lambda c: Continuation([-1] + c.token_ids[1:], c.logprobs, "length")),
        f"token id -1 outside [0, {VOCAB})",
    ),
    "float ids": (
        _edit(LENGTH, lambda c: Continuation([float(t) for t in c.token_ids], c.logprobs, "length")),
        "token ids must be integers",
    ),
    "eos without an EOS token (R09)": (
        _edit(LENGTH, lambda c: Continuation(c.token_ids, c.logprobs, "eos")),
        "finish_reason 'eos' but its last token",
    ),
    "length short of the budget (R10)": (
        _edit(LENGTH, lambda c: Continuation(c.token_ids[:-1], c.logprobs[:-1], "length")),
        "finish_reason 'length' with 3 tokens, fewer than its budget of 4",
    ),
    "tokens after an EOS (R10)": (
        _edit(LENGTH, lambda c: Continuation([1] + c.token_ids[1:], c.logprobs, "length")),
        "tokens after an EOS",
    ),
    "unknown finish reason": (
        _edit(LENGTH, lambda c: Continuation(c.token_ids, c.logprobs, "stop")),
        "finish_reason must be 'eos' or 'length'",
    ),
    "logprobs length mismatch": (
        _edit(LENGTH, lambda c: Continuation(c.token_ids, c.logprobs[:-1], "length")),
        "3 logprobs for 4 tokens",
    ),
    "NaN logprob": (
        _edit(LENGTH, lambda c: Continuation(c.token_ids, [math.nan] + c.logprobs[1:], "length")),
        "logprobs must be finite and <= 0",
    ),
    "positive logprob": (
        _edit(LENGTH, lambda c: Continuation(c.token_ids, [0.5] + c.logprobs[1:], "length")),
        "logprobs must be finite and <= 0",
    ),
    "not a Continuation": (_edit(LENGTH, lambda c: (c.token_ids, c.logprobs)), "not a Continuation"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_backend_that_breaks_the_contract_is_named(case):
    tamper, message = BROKEN[case]
    backend = Tampered(tiny_model(seed=1, bias_eos=-4.0), tamper)  # EOS is rare: most rows end by "length"
    with pytest.raises(BackendContractError, match=r"Tampered\.generate") as err:
        _rollout(backend, mode=MODES["vanilla"]).run(_requests(), step=0)
    assert message in str(err.value)


def test_eos_continuations_are_checked_on_the_continue_from_path():
    """Drafts found: the continuation comes from continue_from, checked the same way."""
    model = tiny_model(seed=2, bias_eos=1.5)
    plain = _rollout(TransformersBackend(model, {1}, pad_id=0), max_tokens=12, mode=_lenient(1e-30))
    plain.run(_requests(), step=0)
    change = lambda c: Continuation(c.token_ids + [5], c.logprobs + [-1.0], "eos")  # noqa: E731
    broken = Tampered(model, _edit(EOS, change))
    rollout = SpeculativeRollout(broken, plain.cache, plain.settings, [1], 64, mode=_lenient(1e-30))
    with pytest.raises(BackendContractError, match=r"Tampered\.continue_from") as err:
        rollout.run(_requests(), step=1)
    assert "invalid continuation for row" in str(err.value) and "tokens after an EOS id" in str(err.value)


def test_scores_for_the_wrong_rows_are_refused_and_the_handle_released():
    from spec_rl.acceptance.scores import DraftScores

    model = tiny_model(seed=2)
    plain = _rollout(TransformersBackend(model, {1}, pad_id=0), max_tokens=6, mode=_lenient(1.0))
    plain.run(_requests(), step=0)
    drop_row = lambda s: DraftScores(hidden_states=s.hidden_states[1:], lm_head_weight=s.lm_head_weight)  # noqa: E731
    broken = Tampered(model, tamper_scores=drop_row)
    rollout = SpeculativeRollout(broken, plain.cache, plain.settings, [1], 64, mode=_lenient(1.0))
    with pytest.raises(
        BackendContractError,
        match=r"Tampered\.score returned hidden_states of shape \[5, 6, 32\]; expected .* \[6, 6, \.\.\.\]",
    ):
        rollout.run(_requests(), step=1)
    assert broken.released == 1


_SAME_AS_CORRUPTIONS = {  # form errors, then entries that name a position with another prefix or column
    "out of range": lambda s: s.same_as + s.same_as.numel(),
    "wrong shape": lambda s: s.same_as[:, :-1],
    "float": lambda s: s.same_as.double(),
    "all zeros": lambda s: torch.zeros_like(s.same_as),
    "rows rolled": lambda s: s.same_as.roll(2, dims=0),
    "columns flipped": lambda s: s.same_as.flip(1),
    "last slot": lambda s: torch.full_like(s.same_as, s.same_as.numel() - 1),
    "a twin that differs": lambda s: _point_first_entry_at_another_row(s.same_as),
}


def _point_first_entry_at_another_row(same):
    out = same.clone()
    out[2, 1] = 1  # draft 2's token 1 "scored like" draft 0's token 1, a draft of another prompt
    return out


@pytest.mark.parametrize("bad", list(_SAME_AS_CORRUPTIONS))
def test_a_bad_same_as_is_refused(bad):
    import dataclasses

    model = tiny_model(seed=2)
    plain = _rollout(TransformersBackend(model, {1}, pad_id=0), max_tokens=6, mode=_lenient(1.0))
    plain.run(_requests(), step=0)
    corrupt = _SAME_AS_CORRUPTIONS[bad]
    broken = Tampered(model, tamper_scores=lambda s: dataclasses.replace(s, same_as=corrupt(s)))
    rollout = SpeculativeRollout(broken, plain.cache, plain.settings, [1], 64, mode=_lenient(1.0))
    match = (
        "expected None or int64 \\[6, 6\\]|indices outside"
        if bad in ("out of range", "wrong shape", "float")
        else "does not name a position scored by the same output"
    )
    with pytest.raises(BackendContractError, match=r"Tampered\.score returned same_as.*(" + match + ")"):
        rollout.run(_requests(), step=1)
    assert broken.released == 1


def test_valid_backends_pass_every_check():
    model = tiny_model(seed=3, bias_eos=1.0)
    rollout = _rollout(TransformersBackend(model, {1}, pad_id=0), max_tokens=10, mode=_lenient(1.0))
    first = rollout.run(_requests(), step=0)
    second = rollout.run(_requests(), step=1)
    assert {"eos", "length"} >= set(first.finish_reasons + second.finish_reasons)
    assert second.stats.drafts_found == 6


# ------------------------------------------------------------------ requests and stored drafts


@pytest.mark.parametrize(
    "prompt, error, message",
    [
        ([3, VOCAB + 7], ValueError, rf"requests\[1\]\.prompt_ids\[1\] = {VOCAB + 7} is outside \[0, {VOCAB}\)"),
        ([3, -2], ValueError, r"requests\[1\]\.prompt_ids\[1\] = -2 is outside \[0, "),
        ([3, 2**70], ValueError, r"requests\[1\]\.prompt_ids\[1\] = 1180591620717411303424 is outside"),
        ([1.7, 2.2], TypeError, r"requests\[1\]\.prompt_ids\[0\] must be an integer token id, got 1.7"),
        (["3", "4"], TypeError, r"requests\[1\]\.prompt_ids\[0\] must be an integer token id, got '3'"),
        ("34", TypeError, r"requests\[1\]\.prompt_ids must be a 1-D integer tensor or a sequence of token ids"),
    ],
)
def test_prompt_ids_are_range_checked_before_any_work(prompt, error, message):
    backend = TransformersBackend(tiny_model(seed=4), {1}, pad_id=0)
    rollout = _rollout(backend)
    with pytest.raises(error, match=message):
        rollout.run([RolloutRequest(PROMPTS[0], 0), RolloutRequest(prompt, 0)], step=0)
    assert len(rollout.cache) == 0 and backend.stats.decode_steps == 0


def test_a_stored_draft_outside_the_vocabulary_names_its_request():
    backend = TransformersBackend(tiny_model(seed=5), {1}, pad_id=0)
    rollout = _rollout(backend)
    requests = _requests(1)
    rollout.cache.store(CacheKey.make(PROMPTS[2], 0, "p2"), [4, VOCAB + 1], [-1.0, -1.0], "length", 0, rollout.settings)
    with pytest.raises(
        ValueError, match=rf"stored draft of requests\[2\] holds token id {VOCAB + 1} outside \[0, {VOCAB}\)"
    ):
        rollout.run(requests, step=1)
    assert backend.stats.decode_steps == 0


def test_duplicate_requests_are_refused_with_both_indices():
    rollout = _rollout(TransformersBackend(tiny_model(seed=6), {1}, pad_id=0))
    requests = _requests(2) + [RolloutRequest(PROMPTS[1], 1, dataset_id="p1")]
    with pytest.raises(ValueError, match=r"requests\[3\] and requests\[6\] are the same sample") as err:
        rollout.run(requests, step=0)
    assert "slot" in str(err.value) and "dataset_id" in str(err.value)
    # the same prompt under another dataset id or slot is a different sample
    rollout.run(_requests(2) + [RolloutRequest(PROMPTS[1], 0, dataset_id="other")], step=0)


# ------------------------------------------------------------------ constructor arguments


def test_max_model_len_past_the_models_positions_is_refused():
    backend = TransformersBackend(tiny_model(seed=7), {1}, pad_id=0)  # max_position_embeddings = 128
    assert backend.max_positions == 128 and backend.vocab_size == VOCAB
    with pytest.raises(ValueError, match=r"max_model_len=100000 exceeds .*max_position_embeddings=128") as err:
        _rollout(backend, max_model_len=100000)
    assert "TransformersBackend" in str(err.value)
    _rollout(backend, max_model_len=128)  # the limit itself is fine


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(backend=None), TypeError, "backend must be a Backend .* got NoneType"),
        (dict(backend=object()), TypeError, "backend must be a Backend .* got object"),
        (dict(settings=None), TypeError, "settings must be a SamplingSettings, got NoneType"),
        (dict(settings={"max_tokens": 4}), TypeError, "settings must be a SamplingSettings, got dict"),
        (dict(cache=None), TypeError, "cache must be a DraftStore"),
        (dict(max_model_len=8.7), TypeError, "max_model_len must be an integer, got float 8.7"),
        (dict(max_model_len=True), TypeError, "max_model_len must be an integer, got bool True"),
        (dict(seed=1.9), TypeError, "seed must be an integer, got float 1.9"),
        (dict(seed="abc"), TypeError, "seed must be an integer, got str 'abc'"),
        (dict(seed=None), TypeError, "seed must be an integer, got NoneType"),
        (dict(eos_ids=[1.5]), TypeError, r"eos_ids\[0\] must be an integer token id, got 1.5"),
        (dict(eos_ids=[VOCAB]), ValueError, rf"eos_ids\[0\] = {VOCAB} is outside \[0, {VOCAB}\)"),
        (
            dict(mode="fast"),
            ValueError,
            r"mode must be one of vanilla, histspec, spec, exact, coupled, random or l=<lenience>",
        ),
        (dict(verify_backend="gpu"), ValueError, r"verify_backend must be one of \('auto', 'reference', 'triton'\)"),
    ],
)
def test_bad_constructor_arguments_name_themselves(kwargs, error, message):
    args = dict(
        backend=TransformersBackend(tiny_model(seed=8), {1}, pad_id=0),
        cache=RolloutCache(),
        settings=SamplingSettings(max_tokens=4),
        eos_ids=[1],
        max_model_len=64,
    )
    args.update(kwargs)
    with pytest.raises(error, match=message):
        SpeculativeRollout(**args)


def test_bad_run_arguments_name_themselves():
    rollout = _rollout(TransformersBackend(tiny_model(seed=9), {1}, pad_id=0))
    with pytest.raises(TypeError, match="step must be an integer, got float 1.5"):
        rollout.run(_requests(), step=1.5)
    with pytest.raises(ValueError, match=r"step must be >= 0, got -1 \(the training step"):
        rollout.run(_requests(), step=-1)
    with pytest.raises(TypeError, match="model must be a transformers causal LM .* got NoneType"):
        TransformersBackend(None, {1}, pad_id=0)
    with pytest.raises(TypeError, match="seed must be an integer, got float 2.5"):
        rollout.run(_requests(), step=1, seed=2.5)
    with pytest.raises(TypeError, match=r"requests\[0\] must be a RolloutRequest, got list"):
        rollout.run([[3, 4]], step=1)


# ------------------------------------------------------------------ no autograd graph


@pytest.mark.parametrize("lenient", [True, False])
def test_run_builds_no_autograd_graph_even_when_the_caller_has_grad_on(monkeypatch, lenient):
    model = tiny_model(seed=10)
    assert model.lm_head.weight.requires_grad  # the LM head reaches verify as a Parameter
    seen = []
    import spec_rl.acceptance.prefixes as prefixes  # where the rollout verifies with its rule

    real_verify = prefixes.verify_scores

    def spy(*args, **kwargs):
        result = real_verify(*args, **kwargs)
        seen.append((torch.is_grad_enabled(), result.new_logprobs.requires_grad))
        return result

    monkeypatch.setattr(prefixes, "verify_scores", spy)
    mode = _lenient(1.0) if lenient else RolloutMode(Exact(), tail=0)
    rollout = _rollout(TransformersBackend(model, {1}, pad_id=0), max_tokens=8, mode=mode)
    rollout.run(_requests(), step=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    assert torch.is_grad_enabled()
    result = rollout.run(_requests(), step=1)
    assert torch.is_grad_enabled()  # restored for the caller
    if lenient:
        assert seen == [(False, False)]
    for draft in rollout.cache.drafts():
        assert not draft.logprobs.requires_grad and not draft.token_ids.requires_grad
    assert all(isinstance(x, float) for lp in result.logprobs for x in lp)


@pytest.mark.parametrize("make", ["splice", "reprefill", "engine"])
@pytest.mark.parametrize(
    "jobs, error, match",
    [
        ([Job(2, cut=Cut(7, 1, 4))], ValueError, r"jobs\[0\]\.cut\.row must be <= 1, got 7 \(a row of scored\)"),
        ([Job(2, cut=Cut(1, 3, 4))], ValueError, r"jobs\[0\]\.cut\.n must be <= 2, got 3"),
        ([Job(2, cut=Cut(0, -1, 4))], ValueError, r"jobs\[0\]\.cut\.n must be >= 0, got -1"),
        ([Job(2, cut=Cut(0, 1, VOCAB))], ValueError, r"jobs\[0\]\.cut\.token = 33 is outside \[0, 33\)"),
        ([Job(-1, cut=Cut(0, 1, 4))], ValueError, r"jobs\[0\]\.budget must be >= 0, got -1"),
        ([Job(2, context=[3, 4], cut=Cut(0, 1, 4))], ValueError, r"jobs\[0\] needs exactly one of context"),
        ([Job(2, context=[3, -3])], ValueError, r"jobs\[0\]\.context\[1\] = -3 is outside"),
        ([(2, [3])], TypeError, r"jobs\[0\] must be a Job, got tuple"),
    ],
)
def test_every_backend_checks_its_jobs_and_frees_what_it_scored(make, jobs, error, match):
    from spec_rl.backends.paged import PagedEngine

    model = tiny_model(seed=3)
    if make == "engine":
        backend = PagedEngine(model, {1}, pad_id=0, block_size=4, num_blocks=64)
    else:
        backend = TransformersBackend(model, {1}, pad_id=0, splice=make == "splice")
    scored = backend.score([[5, 6, 7], [9, 10]], [[11, 12, 13], [30, 31]])
    with pytest.raises(error, match=match):
        backend.continue_from(scored, jobs, SamplingSettings(), 0)
    assert scored.used
    if make == "engine":
        assert backend.blocks.num_free == backend.blocks.num_blocks
    with pytest.raises(ValueError, match="continued once"):
        backend.continue_from(scored, [Job(2, cut=Cut(0, 1, 4))], SamplingSettings(), 0)
    with pytest.raises(ValueError, match=r"jobs\[0\] continues a cut; generate\(\) takes fresh contexts only"):
        backend.generate([Job(2, cut=Cut(0, 1, 4))], SamplingSettings(), 0)


class _Minimal:
    """A backend's members without the Backend base class."""

    def __init__(self):
        self.stats = BackendStats()

    @property
    def device(self):
        return torch.device("cpu")

    def generate(self, jobs, settings, seed):
        return [Continuation([1], [-0.5], "eos") for _ in jobs]


def test_a_backend_subclasses_the_base_class():
    settings = SamplingSettings(max_tokens=4)
    with pytest.raises(TypeError, match="backend must be a Backend .*your own subclass of spec_rl.backends.Backend"):
        SpeculativeRollout(_Minimal(), RolloutCache(), settings, eos_ids=[1], max_model_len=64)

    class Subclassed(_Minimal, Backend):
        pass

    backend = Subclassed()
    assert (backend.vocab_size, backend.max_positions) == (None, None) and backend.sync_weights() is None
    rollout = SpeculativeRollout(backend, RolloutCache(), settings, eos_ids=[1], max_model_len=64)
    result = rollout.run(_requests(1), step=0)  # no drafts yet: plain generation through the backend
    assert result.response_ids == [[1]] * 3 and rollout.vocab_size is None


def test_a_cache_of_another_model_is_refused_before_any_work():
    from spec_rl.drafts.owner import DraftOwnerError, model_owner

    backend = TransformersBackend(tiny_model(seed=11), {1}, pad_id=0)
    assert backend.owner == model_owner(backend.model.config) == "qwen2-v33-h32-l2"
    foreign = RolloutCache()
    foreign.claim("llama-v49152-h576-l30-tok3f2a9c1e04b7")  # e.g. loaded from SmolLM2's run
    foreign.store(
        CacheKey.make(PROMPTS[0], 0, "p0"), [4, 5, 6], [-1.0] * 3, "length", 0, SamplingSettings(max_tokens=4)
    )
    rollout = _rollout(backend)
    with pytest.raises(DraftOwnerError, match=r"the cache given to the rollout \(RolloutCache\) holds drafts of"):
        rollout.run(_requests(), step=1, cache=foreign)
    assert backend.stats.decode_steps == 0 and backend.stats.prefill_tokens == 0
    mine = RolloutCache()
    mine.claim("qwen2-v33-h32-l2-tok0123456789ab")  # the same model with its tokenizer's digest: taken
    _rollout(backend).run(_requests(), step=0, cache=mine)
    assert mine.owner == "qwen2-v33-h32-l2-tok0123456789ab"
    fresh = RolloutCache()
    with pytest.raises(ValueError, match=r"requests\[0\] has \d+ tokens: max_model_len="):  # refused: not claimed
        _rollout(backend).run([RolloutRequest(list(range(2, 30)) * 8, 0)], step=0, cache=fresh)
    with pytest.raises(TypeError, match="requests must be a list of RolloutRequest, got NoneType"):
        _rollout(backend).run(None, step=0, cache=fresh)
    assert fresh.owner is None and len(fresh) == 0
    _rollout(backend).run(_requests(), step=0, cache=fresh)
    assert fresh.owner == "qwen2-v33-h32-l2"  # a store without an owner is claimed for this model
    with pytest.raises(DraftOwnerError):
        fresh.claim("llama-v33-h32-l2-tokabc")


def test_a_cache_of_another_tokenizer_on_the_same_model_is_refused_where_the_backend_knows_its_tokenizer():
    from tiny_models import tiny_tokenizer

    from spec_rl.backends.base import Policy
    from spec_rl.drafts.owner import DraftOwnerError, policy_owner

    model, tokenizer = tiny_model(seed=11), tiny_tokenizer()
    backend = TransformersBackend.for_policy(Policy(model, tokenizer, [1], 0, 64, None))
    assert backend.owner == policy_owner(tokenizer, model.config) and "-tok" in backend.owner
    other = RolloutCache()
    other.claim(backend.owner.rsplit("-tok", 1)[0] + "-tok0123456789ab")  # the same architecture, another vocabulary
    other.store(CacheKey.make(PROMPTS[0], 0, "p0"), [4, 5, 6], [-1.0] * 3, "length", 0, SamplingSettings(max_tokens=4))
    with pytest.raises(DraftOwnerError, match="holds drafts of another policy"):
        _rollout(backend).run(_requests(), step=1, cache=other)
    mine = RolloutCache()
    _rollout(backend).run(_requests(), step=0, cache=mine)
    assert mine.owner == backend.owner
