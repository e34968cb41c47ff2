"""The verl agent loop against the real verl package and a fake rollout server on a tiny model.

Needs verl (0.9.x) installed: ``make test-vllm`` runs it in .venv-vllm. In an environment without verl these
tests are skipped, unless SPEC_RL_REQUIRE=1 is set (then a broken install fails).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import types

import pytest
import torch
from optional import require

pytestmark = [pytest.mark.engines]
require("verl.experimental.agent_loop.agent_loop")

import hydra  # noqa: E402
from _stats import assert_fits  # noqa: E402
from fake_server import FixedServer, TinyServer  # noqa: E402
from hydra.errors import InstantiationException  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from tiny_models import full_forward_logprobs, tiny_model, tiny_tokenizer  # noqa: E402
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, _agent_loop_registry  # noqa: E402
from verl.workers.rollout.replica import TokenOutput  # noqa: E402

import spec_rl.integrations.verl as sv  # noqa: E402
from spec_rl.acceptance.dispatch import VerifyOptions, verify_logprobs  # noqa: E402
from spec_rl.acceptance.mode import RolloutMode  # noqa: E402
from spec_rl.acceptance.rules import Exact, Lenient
from spec_rl.drafts.cache import CacheKey, RolloutCache  # noqa: E402
from spec_rl.drafts.directory import DirectoryDraftStore  # noqa: E402
from spec_rl.integrations.exact import residual_seeds  # noqa: E402
from spec_rl.sampling.philox import mix_seed  # noqa: E402

PROMPT_LEN, RESPONSE_LEN, N = 12, 8, 2
PROMPTS = ["Tom has 3 apples", "Ann buys 4 more apples", "how many apples now"]


class VerlServer:
    """verl's ``server_manager.generate`` contract over :class:`TinyServer`."""

    def __init__(self, core: TinyServer):
        self.core = core

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs) -> TokenOutput:
        r = self.core.run(request_id, prompt_ids, sampling_params)
        extra = {"global_steps": self.core.step}
        if r["prompt_logprobs"] is not None:
            extra.update(prompt_logprobs=r["prompt_logprobs"], prompt_ids=r["prompt_ids"])
        return TokenOutput(
            token_ids=r["token_ids"], log_probs=r["log_probs"], stop_reason="completed", extra_fields=extra
        )


def make_config(**rollout):
    base = dict(
        prompt_length=PROMPT_LEN,
        response_length=RESPONSE_LEN,
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        n=N,
        max_model_len=None,
        name="vllm",
        logprobs_mode="processed_logprobs",
        repetition_penalty=1.0,
        calculate_log_probs=False,
    )
    base.update(rollout)
    return OmegaConf.create({"actor_rollout_ref": {"rollout": base, "model": {}}, "data": {}})


@pytest.fixture(scope="module")
def tok():
    t = tiny_tokenizer()
    t.chat_template = (
        "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}Answer:{% endif %}"
    )
    return t


def new_loop(cfg, server, tok, **loop_kwargs):
    """Instantiate the loop the way verl's AgentLoopWorker does (registry entry + hydra)."""
    entry = {**_agent_loop_registry[sv.AGENT_NAME], **loop_kwargs}
    return hydra.utils.instantiate(
        config=entry,
        trainer_config=DictConfigWrap(cfg),
        server_manager=server,
        tokenizer=tok,
        processor=None,
        dataset_cls=None,
        data_config=DictConfigWrap(cfg.data),
        hf_model_type=None,
    )


def rows():
    """Rows as verl's trainer builds them: each prompt repeated N times (interleaved), index 0 everywhere."""
    out = []
    for p, text in enumerate(PROMPTS):
        for s in range(N):
            out.append(
                {
                    "raw_prompt": [{"role": "user", "content": text}],
                    "priority": p * N + s,
                    "index": 0,
                    "data_source": "toy",
                    "extra_info": {"index": 0},
                }
            )
    return out


def run_epoch(cfg, server, tok, sampling=None, **loop_kwargs):
    params = sampling or dict(temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=False)

    async def go():
        loops = [new_loop(cfg, server, tok, **loop_kwargs) for _ in rows()]  # verl builds one loop per sample
        return await asyncio.gather(*[lp.run(dict(params), **row) for lp, row in zip(loops, rows())])

    return asyncio.run(go())


@pytest.fixture()
def setup(tmp_path, tok, monkeypatch):
    sv._STORES.clear()
    # The server seeds a request without a seed from its id, a uuid4: counted ids make the samples reproducible
    ids = itertools.count()
    monkeypatch.setattr(sv, "uuid4", lambda: types.SimpleNamespace(hex=f"{next(ids):032x}"))
    model = tiny_model(eos=(1,), bias_eos=1.5)
    server = VerlServer(
        TinyServer(model, {1}, max_model_len=PROMPT_LEN + RESPONSE_LEN, step=1, response_length=RESPONSE_LEN)
    )
    return dict(cfg=make_config(), server=server, tok=tok, cache_dir=str(tmp_path / "drafts"), model=model)


def test_registered_and_epoch2_reuses_drafts(setup):
    cfg, server, tok, d = setup["cfg"], setup["server"], setup["tok"], setup["cache_dir"]
    assert _agent_loop_registry[sv.AGENT_NAME]["_target_"] == "spec_rl.integrations.verl.SpecRLAgentLoop"
    ep1 = run_epoch(cfg, server, tok, cache_dir=d)
    calls1 = server.core.calls
    assert len(calls1) == len(rows()) and all(c["params"].get("prompt_logprobs") is None for c in calls1)
    # epoch 1: plain generation with the full budget min(response_length, max_model_len - P)
    assert sorted(c["prompt_ids"] for c in calls1) == sorted(o.prompt_ids for o in ep1)
    for call in calls1:
        assert call["params"]["max_tokens"] == min(RESPONSE_LEN, PROMPT_LEN + RESPONSE_LEN - len(call["prompt_ids"]))
    for out in ep1:
        assert out.response_mask == [1] * len(out.response_ids) and 1 <= len(out.response_ids) <= RESPONSE_LEN
        ref = full_forward_logprobs(setup["model"], out.prompt_ids, out.response_ids)
        torch.testing.assert_close(torch.tensor(out.response_logprobs, dtype=torch.float64), ref, atol=1e-5, rtol=0)
        assert out.extra_fields["spec_rl/draft_found"] is False
    # index is 0 for every row: keys still differ by prompt ids and slot
    assert len(DirectoryDraftStore(d)) == len(rows())

    server.core.calls = []
    server.core.step = 2
    ep2 = run_epoch(cfg, server, tok, cache_dir=d)
    # same weights, l = e^0.5: every draft is reused whole; only scoring requests are sent
    assert len(server.core.calls) == len(rows())
    scored = [c["prompt_ids"] for c in server.core.calls]
    assert all(c["params"]["prompt_logprobs"] == 0 and c["params"]["max_tokens"] == 1 for c in server.core.calls)
    for a, b in zip(ep1, ep2):
        assert a.prompt_ids + a.response_ids in scored
        assert b.response_ids == a.response_ids
        assert b.extra_fields["spec_rl/full_reuse"] is True
        assert b.extra_fields["spec_rl/verified_prefix_len"] == len(a.response_ids)
        assert b.extra_fields["spec_rl/tokens_generated"] == 0
        torch.testing.assert_close(
            torch.tensor(b.response_logprobs), torch.tensor(a.response_logprobs), atol=1e-5, rtol=0
        )
    # slots of one prompt kept their own drafts (a collapsed key would give both the same response)
    assert any(ep1[2 * p].response_ids != ep1[2 * p + 1].response_ids for p in range(len(PROMPTS)))
    store = DirectoryDraftStore(d)
    key = CacheKey.make(ep2[0].prompt_ids, 0, "toy:0")
    assert store.lookup(key, sv.settings_from_rollout_config(cfg.actor_rollout_ref.rollout)).version == 2


def test_changed_policy_budgets_and_assembly(setup):
    cfg, server, tok, d = setup["cfg"], setup["server"], setup["tok"], setup["cache_dir"]
    ep1 = run_epoch(cfg, server, tok, cache_dir=d, mode="l=0.3")
    new_model = tiny_model(eos=(1,), bias_eos=1.5, seed=7)  # the "updated" policy
    server.core.model, server.core.step, server.core.calls = new_model, 5, []
    ep2 = run_epoch(cfg, server, tok, cache_dir=d, mode="l=0.3")
    calls = server.core.calls
    seen_partial = 0
    for i, (a, b) in enumerate(zip(ep1, ep2)):
        p, draft = a.prompt_ids, a.response_ids
        scoring = [c for c in calls if c["prompt_ids"] == p + draft and c["params"].get("prompt_logprobs") == 0]
        assert scoring  # (two slots may hold the same draft, e.g. a lone EOS)
        n = b.extra_fields["spec_rl/verified_prefix_len"]
        # n is what the rule gives on float64 reference log-probs of the new policy
        lp_new = full_forward_logprobs(new_model, p, draft)
        slot, key = i % N, CacheKey.make(p, i % N, "toy:0")
        expect = verify_logprobs(
            torch.tensor([draft]),
            torch.tensor([a.response_logprobs]),
            lp_new.float()[None],
            seed=mix_seed(0, 5),
            uids=torch.tensor([key.uid]),
            options=VerifyOptions(mode=Lenient(0.3), backend="reference"),
        )
        assert n == int(expect.accepted_len[0]), slot
        assert b.response_ids[:n] == draft[:n]
        # a kept token's rollout log-prob is its behaviour log-prob: drafted (epoch 1's sample) and kept by the test
        old = torch.tensor(a.response_logprobs[:n], dtype=torch.float64)
        kept = old + (math.log(0.3) + lp_new[:n] - old).clamp(max=0.0)
        torch.testing.assert_close(torch.tensor(b.response_logprobs[:n], dtype=torch.float64), kept, atol=1e-5, rtol=0)
        if n == len(draft):
            assert b.response_ids == draft
            continue
        seen_partial += 1
        conts = [c for c in calls if c["prompt_ids"] == p + draft[:n] and c["params"].get("prompt_logprobs") is None]
        budget = min(RESPONSE_LEN, PROMPT_LEN + RESPONSE_LEN - len(p))
        assert conts and all(c["params"]["max_tokens"] == budget - n for c in conts)
        # scoring and continuation share a request id: verl routes both to one server (prefix-cache hit)
        # (another slot may continue from the same context, e.g. the bare prompt when n = 0)
        assert {c["request_id"] for c in conts} & {c["request_id"] for c in scoring}
        tail = b.response_ids[n:]
        assert 1 <= len(tail) <= budget - n
        # the new part's log-probs are the new policy's sampling log-probs
        ref_tail = full_forward_logprobs(new_model, p + draft[:n], tail)
        torch.testing.assert_close(
            torch.tensor(b.response_logprobs[n:], dtype=torch.float64), ref_tail, atol=1e-5, rtol=0
        )
        assert b.extra_fields["spec_rl/tokens_generated"] == len(tail)
    assert seen_partial >= 1  # a different random policy must reject somewhere
    # the assembled responses are the next drafts, stored with version 5
    store = DirectoryDraftStore(d)
    s = sv.settings_from_rollout_config(cfg.actor_rollout_ref.rollout)
    for i, b in enumerate(ep2):
        got = store.lookup(CacheKey.make(b.prompt_ids, i % N, "toy:0"), s)
        assert got.token_ids.tolist() == b.response_ids and got.version == 5


def test_two_workers_share_one_cache_directory(setup):
    cfg, tok, d = setup["cfg"], setup["tok"], setup["cache_dir"]
    core = setup["server"].core
    ep1 = run_epoch(cfg, VerlServer(core), tok, cache_dir=d)  # "worker A"
    sv._STORES.clear()  # "worker B": another process would start with no store objects
    core.calls, core.step = [], 2
    ep2 = run_epoch(cfg, VerlServer(core), tok, cache_dir=d)
    assert [o.response_ids for o in ep2] == [o.response_ids for o in ep1]
    assert all(c["params"].get("prompt_logprobs") == 0 for c in core.calls)


def test_drafts_that_no_longer_fit_are_cut_or_continued(setup):
    # Epoch 1 under response_length=3; epoch 2 under 8 with the same weights (l = e^0.5 accepts every
    # token): a draft the old budget cut is a prefix only and is continued, never returned as finished.
    cfg, server, tok, d = setup["cfg"], setup["server"], setup["tok"], setup["cache_dir"]
    ep1 = run_epoch(make_config(response_length=3), server, tok, cache_dir=d)
    short = [i for i, o in enumerate(ep1) if len(o.response_ids) == 3 and o.response_ids[-1] != 1 and i > 0]
    assert short
    # and one draft with an EOS inside (a user-filled store or an EOS set that grew): cut after the EOS
    settings = sv.settings_from_rollout_config(cfg.actor_rollout_ref.rollout)
    key0 = CacheKey.make(ep1[0].prompt_ids, 0, "toy:0")
    inside = [5, 1, 6, 7]
    DirectoryDraftStore(d).store(
        key0, inside, full_forward_logprobs(setup["model"], ep1[0].prompt_ids, inside).float(), "length", 1, settings
    )
    server.core.calls, server.core.step = [], 2
    ep2 = run_epoch(cfg, server, tok, cache_dir=d)
    assert ep2[0].response_ids == [5, 1] and ep2[0].extra_fields["spec_rl/full_reuse"] is True
    for i in short:
        a, b = ep1[i], ep2[i]
        assert b.response_ids[:3] == a.response_ids and len(b.response_ids) > 3
        assert b.extra_fields["spec_rl/full_reuse"] is False
        assert b.extra_fields["spec_rl/verified_prefix_len"] == 3
    for b in ep2:
        assert 1 not in b.response_ids[:-1] and b.response_mask == [1] * len(b.response_ids)
        assert b.response_ids[-1] == 1 or len(b.response_ids) == RESPONSE_LEN


def test_slot_and_dataset_id():
    assert [sv.slot_of({"priority": p}, 4) for p in range(9)] == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    assert sv.slot_of({"priority": 5, "spec_rl_slot": 3}, 4) == 3
    with pytest.raises(ValueError, match="spec_rl_slot"):
        sv.slot_of({}, 2)
    assert sv.dataset_id_of({"data_source": "gsm8k", "extra_info": {"index": 7}}) == "gsm8k:7"
    assert sv.dataset_id_of({}) == ":0"


def test_validation_requests_bypass_the_cache(setup):
    cfg, server, tok, d = setup["cfg"], setup["server"], setup["tok"], setup["cache_dir"]
    greedy = dict(temperature=0, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True)
    outs = run_epoch(cfg, server, tok, sampling=greedy, cache_dir=d)
    assert len(DirectoryDraftStore(d)) == 0
    assert len(server.core.calls) == len(rows())
    assert all("prompt_logprobs" not in c["params"] and c["params"]["temperature"] == 0 for c in server.core.calls)
    assert all(o.response_logprobs is not None for o in outs)


@pytest.mark.parametrize(
    "rollout,match",
    [
        (dict(temperature=0.7), "temperature=0.7"),
        (dict(top_k=20), "top_k=20"),
        (dict(top_p=0.9), "top_p=0.9"),
        (dict(repetition_penalty=1.1), "repetition_penalty"),
        (dict(logprobs_mode="raw_logits"), "logprobs_mode"),
    ],
)
def test_bad_config_raises_at_start(setup, rollout, match):
    cfg = make_config(**rollout)

    async def build():
        return new_loop(cfg, setup["server"], setup["tok"], cache_dir=setup["cache_dir"])

    # verl builds loops through hydra, which wraps the ValueError; the message reaches the user unchanged
    with pytest.raises(InstantiationException, match=match) as info:
        asyncio.run(build())
    assert isinstance(info.value.__cause__, ValueError)


def test_processed_mode_allows_temperature_and_missing_dir_raises(setup, monkeypatch):
    cfg = make_config(temperature=0.7)

    async def build(**kw):
        return new_loop(cfg, setup["server"], setup["tok"], **kw)

    loop = asyncio.run(build(cache_dir=setup["cache_dir"], prompt_logprobs_mode="processed"))
    assert loop.settings.temperature == 0.7 and math.isclose(loop.builder.mode.rule.lenience, math.exp(0.5))
    assert loop.builder.mode == RolloutMode(Lenient(), tail=0)  # the paper's rule; no tail speculation on a server
    monkeypatch.delenv(sv.CACHE_DIR_ENV, raising=False)
    with pytest.raises(InstantiationException, match="SPEC_RL_DRAFT_DIR") as info:
        asyncio.run(build())
    assert isinstance(info.value.__cause__, ValueError)


# ---------------------------------------------------------------- exact acceptance
SUPPORT = [21, 22, 23, 1]  # "apples", "has", "buys", EOS
SUPPORT_P = [0.6, 0.25, 0.1, 0.05]


def fixed_probs(vocab: int) -> torch.Tensor:
    p = torch.zeros(vocab)
    p[SUPPORT] = torch.tensor(SUPPORT_P)
    return p


def exact_setup(tmp_path, tok, response_length=RESPONSE_LEN, store=None):
    sv._STORES.clear()
    d = str(tmp_path / "drafts")
    # many small drafts: skip the fsyncs, or keep them in memory (any DraftStore serves the loop)
    sv._STORES[os.path.abspath(d)] = store if store is not None else DirectoryDraftStore(d, fsync=False)
    core = FixedServer(
        fixed_probs(len(tok)), {1}, max_model_len=PROMPT_LEN + response_length, step=1, response_length=response_length
    )
    return make_config(response_length=response_length), VerlServer(core), d


def many_rows(count):
    """One sample each of ``count`` dataset rows with the same prompt (distinct ids, so distinct uids)."""
    return [
        {
            "raw_prompt": [{"role": "user", "content": PROMPTS[0]}],
            "priority": 0,
            "data_source": "toy",
            "extra_info": {"index": i},
        }
        for i in range(count)
    ]


def run_rows(cfg, server, tok, rows_, **loop_kwargs):
    params = dict(temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=False)

    async def go():
        loop = new_loop(cfg, server, tok, **loop_kwargs)  # stateless per sample: one serves every row
        return await asyncio.gather(*[loop.run(dict(params), **row) for row in rows_])

    return asyncio.run(go())


def test_exact_mode_resamples_the_rejected_token(tmp_path, tok):
    cfg, server, d = exact_setup(tmp_path, tok)
    rows_ = many_rows(40)
    ep1 = run_rows(cfg, server, tok, rows_, cache_dir=d, mode="exact")  # no drafts yet: plain sampling
    assert all("seed" not in c["params"] for c in server.core.calls)
    server.core.calls, server.core.step = [], 2
    ep2 = run_rows(cfg, server, tok, rows_, cache_dir=d, mode="exact")
    log_p = torch.log(fixed_probs(len(tok)))
    resampled = 0
    for i, (a, b) in enumerate(zip(ep1, ep2)):
        draft, resp, fields = a.response_ids, b.response_ids, b.extra_fields
        assert fields["spec_rl/exact_acceptance"] is True
        n = fields["spec_rl/verified_prefix_len"]
        uid = CacheKey.make(a.prompt_ids, 0, f"toy:{i}").uid
        expect = verify_logprobs(
            torch.tensor([draft]),
            None,
            log_p[draft][None],
            seed=mix_seed(0, 2),
            uids=torch.tensor([uid]),
            options=VerifyOptions(mode="exact", backend="reference"),
        )
        assert n == int(expect.accepted_len[0]) and resp[:n] == draft[:n]
        torch.testing.assert_close(torch.tensor(b.response_logprobs), log_p[resp], atol=1e-5, rtol=0)
        if n == fields["spec_rl/draft_len"]:  # no rejection among the scored tokens
            continue
        assert resp[n] != draft[n]  # the token at the rejection comes from the residual
        conts = [
            c
            for c in server.core.calls
            if c["prompt_ids"] == a.prompt_ids + draft[:n] and c["params"].get("prompt_logprobs") is None
        ]
        mine = [c for c in conts if c["params"]["seed"] in set(residual_seeds(mix_seed(0, 2), uid))]
        assert len(mine) == fields["spec_rl/resamples"] + 1 and len({c["params"]["seed"] for c in mine}) == len(mine)
        resampled += fields["spec_rl/resamples"]
    assert resampled >= 1


def _apples_drafts(tmp_path, tok, count, old_logprob, **loop_kwargs):
    """``count`` samples whose stored drafts are [apples, apples] (each with ``old_logprob``), through the loop:
    (outputs, first tokens, first tokens of the rows rejected at 0), tokens as indices into SUPPORT."""
    store = RolloutCache()
    cfg, server, d = exact_setup(tmp_path, tok, response_length=2, store=store)
    rows_ = many_rows(count)
    prompt = asyncio.run(_prompt_ids(cfg, server, tok, d))
    settings = sv.settings_from_rollout_config(cfg.actor_rollout_ref.rollout)
    for i in range(len(rows_)):
        store.store(CacheKey.make(prompt, 0, f"toy:{i}"), [21, 21], [old_logprob] * 2, "length", 0, settings)
    out = run_rows(cfg, server, tok, rows_, cache_dir=d, **loop_kwargs)
    bins = {t: k for k, t in enumerate(SUPPORT)}
    first = torch.tensor([bins[o.response_ids[0]] for o in out])
    at_rejection = torch.tensor(
        [bins[o.response_ids[0]] for o in out if o.extra_fields["spec_rl/verified_prefix_len"] == 0]
    )
    return out, first, at_rejection


def test_exact_mode_token_at_the_rejection_follows_the_residual(tmp_path, tok):
    # Every draft is [apples, apples]: accepted with probability 0.6 at each position, otherwise the token
    # comes from the residual (SUPPORT_P without "apples", renormalised); the marginal stays SUPPORT_P.
    # 16 attempts (the default) fail with probability 0.6 ** 16 per rejection: about once in 5000 samples here
    out, first, at_rejection = _apples_drafts(tmp_path, tok, 5000, -0.5, mode="exact", max_resample_attempts=64)
    p = torch.tensor(SUPPORT_P)
    assert_fits(torch.bincount(first, minlength=4), p)
    residual = torch.cat([torch.zeros(1), p[1:] / p[1:].sum()])
    assert_fits(torch.bincount(at_rejection, minlength=4), residual)
    assert sum(o.extra_fields["spec_rl/resamples"] for o in out) > 100


def test_without_draft_draw_token_at_a_lenient_rejection_is_never_the_draft_token(tmp_path, tok):
    # Drafts [apples, apples] stored with q = 0.9 each; the server gives "apples" 0.6, so at l = 1 a draft
    # token is kept with probability 2/3. At a rejection the continuation is resent until it does not begin
    # with "apples": the token there follows SUPPORT_P without "apples", renormalised.
    out, _, at_rejection = _apples_drafts(tmp_path, tok, 1500, math.log(0.9), mode="l=1-excl", max_resample_attempts=64)
    assert len(at_rejection) > 300
    p = torch.tensor(SUPPORT_P)
    assert_fits(torch.bincount(at_rejection, minlength=4), torch.cat([torch.zeros(1), p[1:] / p[1:].sum()]))
    assert sum(o.extra_fields["spec_rl/resamples"] for o in out) > 0


def test_without_draft_draw_that_runs_out_of_attempts_keeps_the_last_and_counts_it(tmp_path, tok):
    # One attempt: when it begins with "apples" it is kept (not a RuntimeError that would stop the run), so the
    # token at a rejection is the server's own draw, SUPPORT_P (the paper's rule), and each keep is counted.
    with pytest.warns(RuntimeWarning, match="kept a continuation"):
        out, _, at_rejection = _apples_drafts(
            tmp_path, tok, 1200, math.log(0.9), mode="l=1-excl", max_resample_attempts=1
        )
    assert len(at_rejection) > 250
    assert_fits(torch.bincount(at_rejection, minlength=4), torch.tensor(SUPPORT_P))
    kept = [o for o in out if o.extra_fields["spec_rl/draw_fallbacks"]]
    assert len(kept) > 50 and all(o.extra_fields["spec_rl/resamples"] == 0 for o in out)
    n_of = [o.extra_fields["spec_rl/verified_prefix_len"] for o in out]  # a keep: the token at n is the draft's
    assert sum(int(o.response_ids[n] == 21) for o, n in zip(out, n_of) if n < 2) == len(kept)


async def _prompt_ids(cfg, server, tok, d):
    loop = new_loop(cfg, server, tok, cache_dir=d)
    return await loop.ct_build_initial_tokens(many_rows(1)[0]["raw_prompt"])


def test_exact_mode_options(setup):
    async def build(**kw):
        return new_loop(setup["cfg"], setup["server"], setup["tok"], cache_dir=setup["cache_dir"], **kw)

    with pytest.raises(InstantiationException, match="mode must be one of"):
        asyncio.run(build(mode="exact-l=1.6"))
    with pytest.raises(InstantiationException, match="needs lenience >= 1"):
        asyncio.run(build(mode="l=0.5-excl"))
    with pytest.raises(InstantiationException, match="mode must be one of"):
        asyncio.run(build(mode="random-ref"))
    with pytest.raises(InstantiationException, match="lenience"):  # one option: the mode
        asyncio.run(build(lenience=1.6))
    drawn = asyncio.run(build(mode="l=1-excl")).builder.mode
    assert drawn == RolloutMode(Lenient(1.0, "without-draft"), tail=0)
    exact = asyncio.run(build(mode="exact")).builder
    assert exact.seed_param == "seed" and exact.mode == RolloutMode(Exact(), tail=0)
    sglang = make_config(name="sglang")
    loop = asyncio.run(_build_with(sglang, setup, mode="exact"))
    assert loop.builder.seed_param == "sampling_seed" and loop.builder.mode.rule == Exact()


async def _build_with(cfg, setup, **kw):
    return new_loop(cfg, setup["server"], setup["tok"], cache_dir=setup["cache_dir"], **kw)


# ---------------------------------------------------------------- reuse off (mode vanilla) and the agent-loop YAML
def test_vanilla_mode_generates_everything_and_stores_it(setup):
    cfg, server, tok, d = setup["cfg"], setup["server"], setup["tok"], setup["cache_dir"]
    run_epoch(cfg, server, tok, cache_dir=d)  # drafts exist
    server.core.calls, server.core.step = [], 2
    ep2 = run_epoch(cfg, server, tok, cache_dir=d, mode="vanilla")
    # no draft read or scored: one plain generation per sample with the full budget
    assert len(server.core.calls) == len(rows()) and all(
        "prompt_logprobs" not in c["params"] for c in server.core.calls
    )
    for call in server.core.calls:
        assert call["params"]["max_tokens"] == min(RESPONSE_LEN, PROMPT_LEN + RESPONSE_LEN - len(call["prompt_ids"]))
    for i, out in enumerate(ep2):
        f = out.extra_fields
        assert f["spec_rl/draft_found"] is False and f["spec_rl/verified_prefix_len"] == 0
        assert f["spec_rl/tokens_generated"] == f["spec_rl/response_len"] == len(out.response_ids)
        # ... and stored, as spec-rl's own rollout does with reuse off
        stored = DirectoryDraftStore(d).lookup(
            CacheKey.make(out.prompt_ids, i % N, "toy:0"),
            sv.settings_from_rollout_config(cfg.actor_rollout_ref.rollout),
        )
        assert stored.token_ids.tolist() == out.response_ids and stored.version == 2


def test_a_configured_entry_survives_the_import(setup):
    """verl loads the agent-loop YAML into its registry before it imports our module (at the first
    instantiation); the import must not replace that entry, or every later sample loses its arguments."""
    import importlib

    saved = dict(_agent_loop_registry)
    try:
        entry = OmegaConf.create(
            {
                "name": sv.AGENT_NAME,
                "_target_": "spec_rl.integrations.verl.SpecRLAgentLoop",
                "cache_dir": setup["cache_dir"],
                "lenience": 1.25,
            }
        )
        _agent_loop_registry[sv.AGENT_NAME] = entry
        importlib.reload(sv)
        assert _agent_loop_registry[sv.AGENT_NAME] is entry
        del _agent_loop_registry[sv.AGENT_NAME]
        importlib.reload(sv)  # nothing configured: the import registers the loop by name
        assert _agent_loop_registry[sv.AGENT_NAME] == {"_target_": "spec_rl.integrations.verl.SpecRLAgentLoop"}
    finally:
        _agent_loop_registry.clear()
        _agent_loop_registry.update(saved)


@pytest.mark.real_model
def test_agent_loop_on_a_real_instruct_model(real_model_path, tmp_path):
    """SmolLM2-135M-Instruct's tokenizer and chat template: prompts built by verl from chat messages, responses that
    end at <|im_end|>, full reuse under unchanged weights, log-probs of the real model; and a draft directory of
    another tokenizer is refused."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spec_rl.drafts.owner import DraftOwnerError

    sv._STORES.clear()
    tok = AutoTokenizer.from_pretrained(real_model_path)
    model = AutoModelForCausalLM.from_pretrained(real_model_path, dtype=torch.float32).eval()
    prompt_len, response_len = 64, 6
    server = VerlServer(TinyServer(model, {2}, prompt_len + response_len, step=1, response_length=response_len))
    cfg = make_config(prompt_length=prompt_len, response_length=response_len)
    d = str(tmp_path / "drafts")
    ep1 = run_epoch(cfg, server, tok, cache_dir=d)
    for out, row in zip(ep1, rows()):
        want = tok.apply_chat_template(row["raw_prompt"], add_generation_prompt=True, tokenize=True)
        assert out.prompt_ids == list(want["input_ids"] if hasattr(want, "keys") else want)
        assert 2 not in out.response_ids[:-1] and 1 <= len(out.response_ids) <= response_len
        ref = full_forward_logprobs(model, out.prompt_ids, out.response_ids)
        torch.testing.assert_close(torch.tensor(out.response_logprobs, dtype=torch.float64), ref, atol=1e-4, rtol=0)
    server.core.step = 2
    ep2 = run_epoch(cfg, server, tok, cache_dir=d)
    assert [o.response_ids for o in ep2] == [o.response_ids for o in ep1]
    assert all(o.extra_fields["spec_rl/full_reuse"] for o in ep2)

    sv._STORES.clear()
    other = tiny_tokenizer()
    with pytest.raises(Exception, match=r"draft directory .* holds drafts of another policy") as info:
        run_epoch(make_config(), server, other, cache_dir=d)
    # verl builds the agent loop through hydra, which wraps the error: it is the cause
    assert isinstance(info.value, DraftOwnerError) or isinstance(info.value.__cause__, DraftOwnerError)
