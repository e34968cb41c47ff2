"""Which policy a draft store belongs to: drafts are token ids and log-probs of one tokenizer and one model, and are
never verified under another (docs/design.md "The rule", step 1)."""

from __future__ import annotations

import hashlib
import json

#: Model config fields that name an architecture; trained weights of the same model keep them.
_ARCH_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers")


class DraftOwnerError(ValueError):
    """Drafts recorded by one policy offered to another (another tokenizer or model)."""


def policy_owner(tokenizer, config=None) -> str:
    """The owner tag of drafts of a policy, e.g. ``"llama-v49152-h576-l30-tok3f2a9c1e04b7"``: its architecture
    (``config``: a transformers config or dict, optional; :func:`model_owner`) and a digest of the tokenizer's
    vocabulary and special tokens. Fine-tuning keeps the tag; another tokenizer or model changes it. TypeError for a
    tokenizer without a vocabulary (``get_vocab``)."""
    if not callable(getattr(tokenizer, "get_vocab", None)):
        raise TypeError(f"tokenizer must be a transformers tokenizer (with get_vocab), got {type(tokenizer).__name__}")
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = sorted(int(i) for i in getattr(tokenizer, "all_special_ids", []) or [])
    digest = hashlib.blake2b(json.dumps([vocab, special]).encode("utf-8"), digest_size=6).hexdigest()
    return _join(model_owner(config) if config is not None else None, f"tok{digest}")


def model_owner(config) -> str:
    """The architecture part of an owner tag, e.g. ``"llama-v49152-h576-l30"``, from a model config (or dict): what
    a backend knows of its policy without the tokenizer."""
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    model_type, vocab_size, hidden, layers = (get(k) for k in _ARCH_FIELDS)
    return f"{model_type}-v{vocab_size}-h{hidden}-l{layers}"


def _split(tag: str) -> tuple[str | None, str | None]:
    """(architecture, tokenizer digest) of a tag; None where the tag does not say."""
    if tag.startswith("tok"):
        return None, tag
    arch, sep, tok = tag.partition("-tok")
    return arch, ("tok" + tok) if sep else None


def _join(arch: str | None, tok: str | None) -> str:
    return "-".join(part for part in (arch, tok) if part)


def merged_owner(stored: str | None, owner: str, where: str) -> str:
    """The tag that says all of ``stored`` and ``owner`` (one may know only the architecture or the tokenizer);
    DraftOwnerError when they disagree on either: drafts of ``where`` were recorded by another policy."""
    if stored is None:
        return owner
    (a1, t1), (a2, t2) = _split(stored), _split(owner)
    if (a1 and a2 and a1 != a2) or (t1 and t2 and t1 != t2):
        raise DraftOwnerError(
            f"{where} holds drafts of another policy ({stored}); this run's policy is {owner}. Drafts are token ids "
            "and log-probs of one tokenizer and model: start from an empty cache or a new draft directory"
        )
    return _join(a1 or a2, t1 or t2)
