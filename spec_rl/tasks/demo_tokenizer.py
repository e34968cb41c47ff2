"""The demo tokenizer: byte-level BPE with every digit its own token. Digit-by-digit numbers make arithmetic learnable
by a tiny model; byte-level decoding gives back the exact text, so rewards computed on decoded responses are exact."""

from __future__ import annotations

from collections.abc import Sequence

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


def build_demo_tokenizer(texts: Sequence[str], vocab_size: int = 640, model_max_length: int = 384):
    """Train the demo's byte-level BPE tokenizer on ``texts``: GPT-2 byte-level split, then every digit on its own.
    ``vocab_size`` counts 256 byte tokens, 2 specials and the merges. Returns a ``PreTrainedTokenizerFast`` with
    ``eos_token="<|endoftext|>"``, ``pad_token="<|pad|>"``, left padding and no special tokens added on encode;
    ``decode(encode(s)) == s`` for any string."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = pre_tokenizers.Sequence([byte_level, pre_tokenizers.Digits(individual_digits=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        padding_side="left",
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
