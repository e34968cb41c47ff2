"""What grows with a batch has a bound checked before memory runs out: the transformers backend's K/V (decode batches
and a kept scoring pass) and the trainer's update micro-batches; within the bound the tokens are the same."""

import gc

import pytest
import torch
from tiny_models import tiny_model

from spec_rl.acceptance.mode import RolloutMode
from spec_rl.acceptance.rules import Lenient
from spec_rl.backends.base import Cut, Job, fresh_jobs
from spec_rl.backends.hf_decode import SpeculativeDecoder
from spec_rl.backends.transformers_backend import TransformersBackend
from spec_rl.drafts.cache import RolloutCache
from spec_rl.rollout.speculative import RolloutRequest, SpeculativeRollout
from spec_rl.sampling.distribution import SamplingSettings
from spec_rl.trainer.grpo import micro_batches, update_token_budget

CONTEXTS = [[3, 4, 5], [6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16], [3, 9]]


def test_a_kv_budget_cuts_decode_batches_and_changes_no_token():
    model = tiny_model(seed=2)
    settings = SamplingSettings(max_tokens=12)
    free = TransformersBackend(model, {1}, pad_id=0)
    per_row = free.kv_token_bytes * (max(len(c) for c in CONTEXTS) + 12)
    tight = TransformersBackend(model, {1}, pad_id=0, kv_cache_bytes=2 * per_row)  # two rows a batch
    want = free.generate(fresh_jobs(CONTEXTS, [12] * len(CONTEXTS)), settings, seed=3)
    got = tight.generate(fresh_jobs(CONTEXTS, [12] * len(CONTEXTS)), settings, seed=3)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert tight.stats.decode_steps > free.stats.decode_steps  # three batches one after another


class _WrongGuesses:
    """Proposes every token it may, all one id the sampler rarely draws: a step leaves rolled-back columns."""

    max_k = 4

    def propose(self, limit, fill=0):
        return [2] * limit

    def update(self, proposed, kept):
        pass


def test_a_decode_batch_buffers_stay_within_kv_cache_bytes(monkeypatch):
    """Left padding, rolled-back columns, spare columns, finished rows riding along and a step as wide as the batch's
    widest proposal all count: the buffers of every decode batch fit kv_cache_bytes after every step, and the tokens
    are those of an unbounded backend."""
    model = tiny_model(seed=2, bias_eos=-1.5)
    contexts, budget = [[3 + n % 5] * n for n in (2, 4, 3, 6, 5, 1, 7, 8, 30)], 24
    budgets = [budget] * 8 + [2]  # the longest context ends soon, beside rows whose proposals widen its steps
    settings = SamplingSettings(max_tokens=budget)

    def jobs():
        return [Job(b, i, c, proposer=_WrongGuesses()) for i, (c, b) in enumerate(zip(contexts, budgets))]

    free = TransformersBackend(model, {1}, pad_id=0, adaptive_tail=False)
    want = free.generate(jobs(), settings, seed=4)
    bound = free.kv_token_bytes * 32 * 3  # three rows at 32 positions a batch
    held = []
    real_step = SpeculativeDecoder._step

    def step(self, kv, rows):
        real_step(self, kv, rows)
        layers = kv.cache.layers
        held.append(sum(b.numel() * b.element_size() for ly in layers for b in (ly._key_buffer, ly._value_buffer)))

    monkeypatch.setattr(SpeculativeDecoder, "_step", step)
    tight = TransformersBackend(model, {1}, pad_id=0, adaptive_tail=False, kv_cache_bytes=bound)
    got = tight.generate(jobs(), settings, seed=4)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert {len(o.token_ids) for o in want[:8]} != {budget}  # some rows finished early and rode along
    assert tight.stats.proposed_tokens > tight.stats.accepted_tokens  # columns were rolled back
    assert held and max(held) <= bound


def _live_tensor_bytes() -> int:
    """Bytes of every tensor storage alive in the process (each storage once)."""
    seen, total = set(), 0
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


@pytest.mark.parametrize("progressive", [False, True])
def test_a_continuation_adds_one_batch_to_the_kept_scoring_kv(monkeypatch, progressive):
    """Eight drafts share each long prompt: gathered per draft, the contexts hold each prompt eight times (2.6x the
    bound here). A continuation reads a batch's contexts out of the kept pass when the batch starts, so what it adds
    to the kept pass while it decodes is one batch's buffers (and per-row column indices), and no token moves."""
    model = tiny_model(seed=4, bias_eos=-3.0)
    gen = torch.Generator().manual_seed(5)
    prompts, drafts = [], []
    for g in range(3):
        prompt = torch.randint(3, 30, (40,), generator=gen).tolist()
        for _ in range(8):
            prompts.append(prompt)
            drafts.append([3 + g] + torch.randint(3, 30, (9,), generator=gen).tolist())
    logprobs = [[-0.1] * len(d) for d in drafts] if progressive else None
    jobs = [Job(6, i, cut=Cut(i, 4, 7)) for i in range(len(drafts))]
    jobs += [Job(6, 100 + i, context=[3 + i, 4, 5]) for i in range(8)]  # a batch after the last cut one

    def continued(kv_cache_bytes):
        backend = TransformersBackend(model, {1}, pad_id=0, adaptive_tail=False, kv_cache_bytes=kv_cache_bytes)
        with torch.no_grad():
            scored = backend.score(prompts, drafts, logprobs)
            for chunk in range(len(scored.progressive.chunks) if progressive else 0):
                scored.progressive.open(chunk)  # as the walks do before a continuation
        assert scored.state is not None  # kept: the continuation splices it
        kept, kv = _live_tensor_bytes(), scored.state
        if progressive:
            pairs = [(layer.keys, layer.values) for c in kv.chunks for layer in c.cache.layers]
        else:
            pairs = [pair for _, layers in kv.chunks for pair in layers]
        passed = sum(t.numel() * t.element_size() for pair in pairs for t in pair)  # the kept pass
        del kv, pairs
        outs = backend.continue_from(scored, jobs, SamplingSettings(max_tokens=6), seed=3)
        return [o.token_ids for o in outs], (kept, passed), backend

    want, _, roomy = continued(None)
    bound = roomy.kv_token_bytes * 400  # the kept pass: 3 rows x 112 padded positions; a batch: 8 rows of 50
    held, real_step = [], SpeculativeDecoder._step

    def step(self, kv, rows):
        real_step(self, kv, rows)
        held.append(_live_tensor_bytes())

    monkeypatch.setattr(SpeculativeDecoder, "_step", step)
    got, (kept, passed), tight = continued(bound)
    assert got == want and tight.stats.decode_steps > 12  # more than two batches
    assert sum(len(p) + 4 for p in prompts) * roomy.kv_token_bytes > 2.5 * bound  # every context at once
    assert held and max(held) - kept <= 1.15 * bound, (max(held) - kept) / bound
    assert held[-1] - kept <= 1.15 * bound - passed, (held[-1] - kept + passed) / bound  # the pass went before it


def test_a_scoring_pass_whose_kv_does_not_fit_is_continued_by_a_prefill():
    model = tiny_model(seed=3)
    requests = [RolloutRequest(c, s) for c in CONTEXTS for s in range(2)]

    def rollout(kv_cache_bytes):
        backend = TransformersBackend(model, {1}, pad_id=0, kv_cache_bytes=kv_cache_bytes)
        ro = SpeculativeRollout(
            backend, RolloutCache(), SamplingSettings(max_tokens=10), [1], 64, mode=RolloutMode(Lenient(1.0), tail=0)
        )
        ro.run(requests, step=0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.03)
        out = ro.run(requests, step=1)
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.03)
        return out, backend

    kept, roomy = rollout(None)
    again, tight = rollout(tight_bytes := roomy.kv_token_bytes * 20)
    assert not tight.keeps_kv(tight.scorer.kv_positions(CONTEXTS, [[5] * 10] * len(CONTEXTS))) and tight_bytes > 0
    assert again.response_ids == kept.response_ids
    assert kept.stats.reprefill_tokens == 0 < again.stats.reprefill_tokens


def test_micro_batches_hold_at_most_the_rows_and_tokens_given():
    rows, lengths = list(range(7)), [10, 40, 5, 5, 30, 100, 1]
    cut = micro_batches(rows, lengths, max_rows=3, max_tokens=80)
    assert [r for batch in cut for r in batch] == rows
    for batch in cut:
        assert 1 <= len(batch) <= 3
        assert len(batch) == 1 or len(batch) * max(lengths[r] for r in batch) <= 80
    assert cut == [[0, 1], [2, 3], [4], [5], [6]]  # 2 x 40, then 3 x 30 would pass 80
    assert micro_batches(rows, lengths, max_rows=8, max_tokens=10**9) == [rows]
    assert update_token_budget(tiny_model(), torch.device("cpu")) > 1000


def test_the_update_budget_leaves_room_for_gradients_and_optimizer_moments(monkeypatch):
    model = tiny_model()
    c = model.config
    per_token = 4 * (3 * c.vocab_size + 28 * c.num_hidden_layers * c.hidden_size)
    state = 3 * 4 * sum(p.numel() for p in model.parameters())
    monkeypatch.setattr("spec_rl.trainer.grpo.memory_budget", lambda device, **_: state + 10 * per_token + 5)
    assert update_token_budget(model, torch.device("cpu")) == 10
    monkeypatch.setattr("spec_rl.trainer.grpo.memory_budget", lambda device, **_: state // 2)
    assert update_token_budget(model, torch.device("cpu")) == 1  # one row at a time, never 0 or negative


def test_a_cpu_kv_cache_takes_a_sixteenth_of_available_memory_and_the_update_an_eighth(monkeypatch):
    from spec_rl.util.memory import memory_budget

    monkeypatch.setattr("spec_rl.util.memory.available_bytes", lambda device: 16 << 30)
    cpu, model = torch.device("cpu"), tiny_model()
    assert memory_budget(cpu) == 1 << 30 == TransformersBackend(model, {1}, pad_id=0).kv_cache_bytes
    c = model.config
    per_token = 4 * (3 * c.vocab_size + 28 * c.num_hidden_layers * c.hidden_size)
    state = 3 * 4 * sum(p.numel() for p in model.parameters())
    assert update_token_budget(model, cpu) == ((2 << 30) - state) // per_token
