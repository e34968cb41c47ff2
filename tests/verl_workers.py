"""What the Ray actors of tests/integrations/test_verl_workers.py import (tests/ is on their PYTHONPATH).

* :class:`WorkerTaggedLoop`: ``spec_rl_agent`` that also records which agent-loop worker ran the
  sample (its Ray actor id, in ``extra_fields["worker"]``), so the test can tell where a draft
  was written and where it was read.
* :class:`FakeRolloutServer`: one Ray actor holding :class:`fake_server.TinyServer` on a saved tiny
  Qwen2 checkpoint, shared by every worker; each request waits ``delay_s`` first, so the samples
  of a batch are in flight together and their draft writes overlap.
* :class:`FakeLLMClient`: verl's ``LLMServerClient`` contract (``generate(request_id, *,
  prompt_ids, sampling_params) -> TokenOutput``) over that actor; verl pickles it into each worker.
"""

from __future__ import annotations

import asyncio

import ray
from verl.workers.rollout.replica import TokenOutput

from spec_rl.integrations.verl import SpecRLAgentLoop


class WorkerTaggedLoop(SpecRLAgentLoop):
    async def run(self, sampling_params, **kwargs):
        out = await super().run(sampling_params, **kwargs)
        out.extra_fields["worker"] = ray.get_runtime_context().get_actor_id()
        return out


@ray.remote(num_cpus=0)
class FakeRolloutServer:
    def __init__(self, model_dir: str, eos_id: int, max_model_len: int, response_length: int, delay_s: float):
        import torch
        from fake_server import TinyServer
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.core = TinyServer(model, {eos_id}, max_model_len=max_model_len, step=1, response_length=response_length)
        self.delay_s = delay_s

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict) -> dict:
        await asyncio.sleep(self.delay_s)
        out = self.core.run(request_id, prompt_ids, sampling_params)
        out["step"] = self.core.step
        return out

    def set_step(self, step: int) -> None:
        self.core.step = step

    def num_calls(self) -> int:
        return len(self.core.calls)


class FakeLLMClient:
    def __init__(self, server):
        self.server = server

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs) -> TokenOutput:
        out = await self.server.generate.remote(request_id, [int(t) for t in prompt_ids], dict(sampling_params))
        extra = {"global_steps": out["step"]}
        if out["prompt_logprobs"] is not None:
            extra.update(prompt_logprobs=out["prompt_logprobs"], prompt_ids=out["prompt_ids"])
        return TokenOutput(
            token_ids=out["token_ids"], log_probs=out["log_probs"], stop_reason="completed", extra_fields=extra
        )
