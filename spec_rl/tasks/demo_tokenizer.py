"""The demo tokenizer: byte-level BPE with every digit its own token.

Numbers are spelled digit by digit, so arithmetic is learnable by a tiny
model, and byte-level decoding gives back the exact input text, so rewards
computed on decoded responses are exact.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["EOS_TOKEN", "PAD_TOKEN", "build_demo_tokenizer"]

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


def build_demo_tokenizer(texts: Sequence[str], vocab_size: int = 640, model_max_length: int = 384):
    """Train the demo's byte-level BPE tokenizer on ``texts``.

    Pre-tokenization: GPT-2 byte-level split, then every digit split into its
    own token (``tokenizers.pre_tokenizers.Digits(individual_digits=True)``).
    Decoding is byte-level, so ``decode(encode(s)) == s`` for any string.

    Parameters
    ----------
    texts : sequence of str
        Training text (prompts and responses).
    vocab_size : int
        Target vocabulary size (256 byte tokens + 2 specials + merges).
    model_max_length : int
        The tokenizer's ``model_max_length`` (tokens).

    Returns
    -------
    transformers.PreTrainedTokenizerFast
        With ``eos_token="<|endoftext|>"``, ``pad_token="<|pad|>"``,
        ``padding_side="left"`` (for generation), and no special tokens added
        on encode.

    Example
    -------
    >>> tok = build_demo_tokenizer(["Tom has 12 apples."] * 4, vocab_size=300)
    >>> tok.decode(tok("12 + 3", add_special_tokens=False)["input_ids"])
    '12 + 3'
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            pre_tokenizers.Digits(individual_digits=True),
        ]
    )
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
