"""Does vLLM's own speculative decoding (no draft model) keep the sampling distribution? (run in .venv-vllm)

    .venv-vllm/bin/python benchmarks/check_vllm_spec_decode.py          # ~1.5 min on 2 CPU cores

Why it matters: tail speculation from the prompt's history must not change the rollout distribution
(docs/design.md "Speculation past the first rejection"). vLLM offers draft-model-free proposers, its
``ngram`` method and a ``custom_class`` hook (vllm/v1/spec_decode/custom_class_proposer.py), through
which our history index could draft inside the engine. This script checks them the simplest way: a
random tiny Qwen2 samples 400 x 30 tokens at temperature 1 from one prompt, plainly and with each
proposer, and compares P(token == previous token), which a lossless speculative decoder leaves
unchanged whatever it proposes. ``RepeatLast`` proposes the previous token k times (the hardest case
for a biased verifier). A two-proportion z-test against the plain run is printed per proposer (it treats
the pairs of one sequence as independent, so it overstates z somewhat; the requests are not seeded, so the
counts move from run to run).
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from pathlib import Path

N_REQUESTS, N_TOKENS, K = 400, 30, 4


class RepeatLast:
    """vLLM custom proposer: drafts the sequence's last token K times (loaded by module path in the worker)."""

    def __init__(self, vllm_config):
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)

    def load_model(self, *args, **kwargs) -> None:  # no draft model
        pass

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        return [
            [int(token_ids_cpu[i, int(num_tokens_no_spec[i]) - 1])] * self.k if s else []
            for i, s in enumerate(sampled_token_ids)
        ]


def _checkpoint(path: Path) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(path, safe_serialization=True)


def repeat_rate(path: Path, speculative_config) -> tuple[int, int]:
    """(repeats, pairs) over N_REQUESTS samples of N_TOKENS tokens."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=str(path),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=72,
        block_size=32,
        enforce_eager=True,
        seed=0,
        gpu_memory_utilization=0.2,
        enable_chunked_prefill=False,
        max_num_batched_tokens=8192,
        speculative_config=speculative_config,
    )
    params = SamplingParams(max_tokens=N_TOKENS, temperature=1.0, ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=[3, 4, 5, 6, 7, 8])] * N_REQUESTS, params, use_tqdm=False)
    seqs = [list(o.outputs[0].token_ids) for o in outs]
    return sum(a == b for t in seqs for a, b in zip(t, t[1:])), sum(len(t) - 1 for t in seqs)


def main() -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = here + os.pathsep + os.environ.get("PYTHONPATH", "")  # the worker imports RepeatLast
    sys.path.insert(0, here)
    mode = sys.argv[1] if len(sys.argv) > 1 else None
    configs = {
        "plain": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
        "repeat-last": {
            "method": "custom_class",
            "model": "check_vllm_spec_decode.RepeatLast",
            "num_speculative_tokens": K,
        },
    }
    if mode is not None:  # one engine per process: a child run per configuration
        path = Path(sys.argv[2])
        print("RATE", *repeat_rate(path, configs[mode]), flush=True)
        return 0
    import subprocess

    with tempfile.TemporaryDirectory() as tmp:
        _checkpoint(Path(tmp))
        rates = {}
        for name in configs:
            out = subprocess.run(
                [sys.executable, __file__, name, tmp], capture_output=True, text=True, check=True
            ).stdout
            rep, pairs = map(int, next(line for line in out.splitlines() if line.startswith("RATE")).split()[1:])
            rates[name] = (rep, pairs)
    base_rep, base_n = rates["plain"]
    print(f"P(token == previous token), {N_REQUESTS} samples x {N_TOKENS} tokens at temperature 1, ", end="")
    print(f"vLLM {_vllm_version()}:")
    for name, (rep, n) in rates.items():
        p, p0 = rep / n, base_rep / base_n
        pooled = (rep + base_rep) / (n + base_n)
        z = (p - p0) / math.sqrt(pooled * (1 - pooled) * (1 / n + 1 / base_n)) if name != "plain" else 0.0
        print(f"  {name:12s} {p:.4f} ({rep}/{n})" + ("" if name == "plain" else f"  z = {z:+.1f} vs plain"))
    return 0


def _vllm_version() -> str:
    import importlib.metadata as md

    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {md.version(dist)}"
        except md.PackageNotFoundError:
            continue
    return "?"


if __name__ == "__main__":
    raise SystemExit(main())
