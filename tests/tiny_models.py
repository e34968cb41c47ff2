"""Tiny randomly initialised models and an in-process tokenizer for tests."""

from __future__ import annotations

import torch

WORDS = (
    ["<pad>", "<eos>", "<unk>", "Question:", "Answer:", "####", "+", "-", "*", "=", "."]
    + [str(d) for d in range(10)]
    + ["apples", "has", "buys", "more", "how", "many", "now", "Tom", "Ann", "sells", "the", "a"]
)


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(individual_digits=True)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    return fast


def tiny_model(
    vocab_size: int = len(WORDS),
    eos=(1,),
    seed: int = 0,
    layers: int = 2,
    hidden: int = 32,
    bias_eos: float = 0.0,
    tie_word_embeddings: bool = False,
):
    """A Qwen2-architecture model with ~30k parameters; optional LM-head bias pushing EOS ids."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=list(eos) if len(eos) > 1 else eos[0],
        pad_token_id=0,
        tie_word_embeddings=tie_word_embeddings,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    if bias_eos:
        head = torch.nn.Linear(hidden, vocab_size, bias=True)
        with torch.no_grad():
            head.weight.copy_(model.lm_head.weight)
            head.bias.zero_()
            head.bias[list(eos)] = bias_eos
        model.lm_head = head
    return model


def full_forward_logprobs(model, prompt, response, temperature=1.0):
    """Sampling log-probs of ``response`` after ``prompt`` from one plain forward (float64)."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(response)] / temperature
    return torch.log_softmax(rows, -1).gather(-1, torch.tensor(response).unsqueeze(-1)).squeeze(-1)


def tiny_demo_config(**overrides):
    """A seconds-to-build demo policy config (an untrained-quality policy)."""
    from spec_rl.tasks.demo_sft import DemoConfig

    base = dict(
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        vocab_size=400,
        tokenizer_corpus=200,
        sft_examples=64,
        sft_steps=3,
        batch_size=8,
        warmup_steps=1,
    )
    return DemoConfig(**(base | overrides))
