"""A stand-in for a vLLM/SGLang rollout server, on a tiny model, for the integration tests.

It follows the behaviour the adapters rely on (read in verl 0.9.1's vLLM
server and vLLM's docs): ``max_tokens`` must lie in [1, max_model_len -
len(prompt)]; sampled-token log-probs are of the processed distribution
(temperature/top-k/top-p applied, vLLM ``processed_logprobs``); prompt
log-probs are *raw* (log_softmax of unscaled logits) and come as one row per
prompt position 1..L-1 plus a dummy last row, each a one-element list, with
the scored token ids alongside (verl's ``extract_prompt_logprobs`` layout).
Without ``max_tokens`` the budget is min(response_length, room), as verl's
server does. A ``seed`` (vLLM) or ``sampling_seed`` (SGLang) parameter seeds the
request's sampler, as on those servers. Every call is recorded.
"""

from __future__ import annotations

import hashlib

import torch

from spec_rl.sampling.distribution import sampling_log_softmax


class TinyServer:
    def __init__(self, model, eos_ids, max_model_len: int, step: int | None = 1, response_length: int | None = None):
        self.model = model
        self.response_length = response_length
        self.eos_ids = set(eos_ids)
        self.max_model_len = max_model_len
        self.step = step
        self.calls: list[dict] = []

    def _logits(self, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.model(input_ids=torch.tensor([ids])).logits[0].float()

    @staticmethod
    def _seed(request_id: str, prompt_ids: list[int], params: dict) -> int:
        """A request's sampling seed: its ``seed`` (vLLM) or ``sampling_seed`` (SGLang) parameter, as those
        servers seed a per-request generator with it; otherwise one derived from the request's content,
        so results do not depend on call order."""
        seed = params.get("seed", params.get("sampling_seed"))
        if seed is not None:
            return int(seed) & ((1 << 63) - 1)
        digest = hashlib.blake2b(repr((request_id, prompt_ids)).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1

    def run(self, request_id: str, prompt_ids: list[int], params: dict) -> dict:
        """Returns token_ids, log_probs (or None), prompt_logprobs rows / ids (or None), finish_reason."""
        prompt_ids = [int(t) for t in prompt_ids]
        max_tokens = params.get("max_tokens")
        room = self.max_model_len - len(prompt_ids)
        if max_tokens is None and self.response_length is not None:  # verl's server default
            max_tokens = min(self.response_length, room)
        if max_tokens is None or not 1 <= max_tokens <= room:
            raise AssertionError(f"max_tokens={max_tokens} outside [1, {room}] (vLLM would reject it)")
        self.calls.append({"request_id": request_id, "prompt_ids": prompt_ids, "params": dict(params)})
        temperature = float(params.get("temperature", 1.0))
        top_k = int(params.get("top_k", -1) or 0)
        top_p = float(params.get("top_p", 1.0))
        rows = row_ids = None
        if params.get("prompt_logprobs") is not None:
            raw = torch.log_softmax(self._logits(prompt_ids), -1)
            rows = [[float(raw[j - 1, prompt_ids[j]])] for j in range(1, len(prompt_ids))] + [[0.0]]
            row_ids = [[prompt_ids[j]] for j in range(1, len(prompt_ids))] + [[0]]
        gen = torch.Generator().manual_seed(self._seed(request_id, prompt_ids, params))
        ctx, out, lps = list(prompt_ids), [], []
        finish = "length"
        min_tokens = int(params.get("min_tokens") or 0)
        for _ in range(max_tokens):
            last = self._logits(ctx)[-1]
            if len(out) < min_tokens:  # vLLM's min_tokens: EOS masked before sampling, counted per request
                last = last.clone()
                last[sorted(self.eos_ids)] = float("-inf")
            if temperature == 0:
                tok = int(last.argmax())
                lp = float(torch.log_softmax(last, -1)[tok])
            else:
                logp = sampling_log_softmax(last, temperature, 0 if top_k < 0 else top_k, top_p)
                tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
                lp = float(logp[tok])
            out.append(tok)
            lps.append(lp)
            ctx.append(tok)
            if tok in self.eos_ids:
                finish = "stop"
                break
        return {
            "token_ids": out,
            "log_probs": lps if params.get("logprobs") else None,
            "prompt_logprobs": rows,
            "prompt_ids": row_ids,
            "finish_reason": finish,
        }


class FixedServer(TinyServer):
    """A server whose next-token distribution is ``probs`` after any context (no model).

    Prompt tokens outside the support get log-prob -inf; only the draft rows are read.
    """

    def __init__(
        self, probs: torch.Tensor, eos_ids, max_model_len: int, step: int | None = 1, response_length: int | None = None
    ):
        super().__init__(None, eos_ids, max_model_len, step=step, response_length=response_length)
        self.log_probs = torch.log(probs.double()).float()

    def _logits(self, ids: list[int]) -> torch.Tensor:
        return self.log_probs.expand(len(ids), -1)
