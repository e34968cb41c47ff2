"""Stored drafts are checked when read: a damaged rollout cache or history index is one ValueError naming
the file and what is wrong; a damaged file of the directory draft store is a warning and a miss."""

import json
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from spec_rl.drafts.cache import CacheKey, RolloutCache
from spec_rl.drafts.directory import DirectoryDraftStore
from spec_rl.drafts.history import HistoryIndex
from spec_rl.sampling.distribution import SamplingSettings

S = SamplingSettings(max_tokens=16)


def _read(path):
    with safe_open(str(path), "pt") as f:
        return f.metadata(), {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture
def cache_file(tmp_path):
    cache = RolloutCache()
    cache.store(CacheKey.make([1, 2], 0), [3, 4, 5], [-0.1, -0.2, -0.3], "eos", 1, S)
    cache.store(CacheKey.make([1, 2], 1), [6], [-0.5], "length", 2, S)
    return cache.save(tmp_path / "cache.safetensors")


def _damage(path, tensors=None, meta=None, drop=(), drop_meta=()):
    m, t = _read(path)
    t = {k: v for k, v in t.items() if k not in drop} | (tensors or {})
    m = {k: v for k, v in m.items() if k not in drop_meta} | (meta or {})
    save_file(t, str(path), metadata=m)
    return path


CACHE_DAMAGE = [
    ("C08 no settings", dict(drop_meta=("settings",)), "metadata 'settings' is missing"),
    ("C09 settings not JSON", dict(meta={"settings": "{not json"}), "metadata 'settings' is not valid JSON"),
    (
        "C10 unknown settings field",
        dict(meta={"settings": json.dumps([{"temp": 1}])}),
        "settings[0] has unknown fields ['temp']",
    ),
    (
        "C10 settings not a list",
        dict(meta={"settings": json.dumps({"temperature": 1})}),
        "metadata 'settings' must be a JSON list",
    ),
    (
        "C10 bad settings value",
        dict(meta={"settings": json.dumps([{"temperature": -1}])}),
        "settings[0]: temperature must be",
    ),
    ("C11 no keys tensor", dict(drop=("keys",)), "tensor 'keys' is missing"),
    ("C11 no logprobs tensor", dict(drop=("logprobs",)), "tensor 'logprobs' is missing"),
    ("C12 finish index 7", dict(tensors={"finish": torch.tensor([0, 7], dtype=torch.uint8)}), "'finish' holds 7"),
    (
        "C13 settings index 3",
        dict(tensors={"settings_index": torch.tensor([0, 3], dtype=torch.int32)}),
        "'settings_index' holds 3",
    ),
    (
        "C18 float token ids",
        dict(tensors={"token_ids": torch.tensor([3.0, 4, 5, 6])}),
        "'token_ids' has dtype torch.float32, expected torch.int32",
    ),
    (
        "C18 keys of 8 bytes",
        dict(tensors={"keys": torch.zeros(2, 8, dtype=torch.uint8)}),
        "'keys' has shape (2, 8), expected (2, 16)",
    ),
    (
        "C18 one version for two drafts",
        dict(tensors={"versions": torch.tensor([1])}),
        "'versions' has shape (1,), expected (2,)",
    ),
    ("C18 2-D logprobs", dict(tensors={"logprobs": torch.zeros(1, 4)}), "'logprobs' has shape (1, 4), expected (4,)"),
    (
        "C14 fewer logprobs than ids",
        dict(tensors={"logprobs": torch.tensor([-0.1, -0.2, -0.3])}),
        "'logprobs' has shape (3,), expected (4,)",
    ),
    (
        "C15 NaN logprob",
        dict(tensors={"logprobs": torch.tensor([-0.1, float("nan"), -0.3, -0.5])}),
        "log-probabilities (<= 0, not NaN)",
    ),
    (
        "C15 positive logprob",
        dict(tensors={"logprobs": torch.tensor([-0.1, 0.7, -0.3, -0.5])}),
        "log-probabilities (<= 0, not NaN)",
    ),
    (
        "C16 negative id",
        dict(tensors={"token_ids": torch.tensor([3, -4, 5, 6], dtype=torch.int32)}),
        "'token_ids' holds -4",
    ),
    (
        "C17 offsets not monotonic",
        dict(tensors={"offsets": torch.tensor([0, 5, 4])}),
        "'offsets' must rise from 0 to 4",
    ),
    (
        "C17 offsets do not start at 0",
        dict(tensors={"offsets": torch.tensor([1, 3, 4])}),
        "'offsets' must rise from 0 to 4",
    ),
    (
        "C17 offsets past the tokens",
        dict(tensors={"offsets": torch.tensor([0, 3, 9])}),
        "'offsets' must rise from 0 to 4",
    ),
    ("duplicate key", dict(tensors={"keys": torch.zeros(2, 16, dtype=torch.uint8)}), "'keys' holds the same key twice"),
    ("negative version", dict(tensors={"versions": torch.tensor([1, -2])}), "'versions' holds -2"),
]


@pytest.mark.parametrize("damage, words", [c[1:] for c in CACHE_DAMAGE], ids=[c[0] for c in CACHE_DAMAGE])
def test_damaged_rollout_cache_is_one_value_error_naming_the_file(cache_file, damage, words):
    _assert_refused(RolloutCache.load, cache_file, damage, words)


def _assert_refused(load, path, damage: dict, words: str) -> None:
    """Damage the file at ``path``; ``load`` must raise one ValueError naming the file, the problem and the fix."""
    _damage(path, **damage)
    with pytest.raises(ValueError) as info:
        load(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: ") and words in msg, msg
    assert "delete the file or restore a backup" in msg, msg


def test_rollout_cache_ids_are_checked_against_the_vocabulary(cache_file):
    assert len(RolloutCache.load(cache_file, vocab_size=7)) == 2
    with pytest.raises(ValueError, match=r"'token_ids' holds 6, outside \[0, 6\) \(vocab_size=6\)"):
        RolloutCache.load(cache_file, vocab_size=6)
    with pytest.raises(TypeError, match="vocab_size must be an integer"):
        RolloutCache.load(cache_file, vocab_size=6.5)


# ------------------------------------------------------------------ history index
@pytest.fixture
def history_file(tmp_path):
    idx = HistoryIndex()
    idx.add(b"ab", [1, 2, 3])
    idx.add(b"ab", [4])
    return idx.save(tmp_path / "history.safetensors")


HISTORY_DAMAGE = [
    ("negative token", dict(tensors={"tokens": torch.tensor([1, -2, 3, 4])}), "'tokens' holds -2"),
    ("token past int32", dict(tensors={"tokens": torch.tensor([1, 2**40, 3, 4])}), "'tokens' holds 1099511627776"),
    ("negative length", dict(tensors={"lengths": torch.tensor([5, -1])}), "'lengths' holds -1"),
    (
        "float tokens",
        dict(tensors={"tokens": torch.tensor([1.5, 2, 3, 4])}),
        "'tokens' has dtype torch.float32, expected torch.int64",
    ),
    ("2-D counts", dict(tensors={"counts": torch.tensor([[2]])}), "'counts' has shape (1, 1), expected (1,)"),
    ("keys not hex", dict(meta={"keys": json.dumps(["zz"])}), "metadata 'keys' must be a JSON list of hex strings"),
    (
        "keys not a list",
        dict(meta={"keys": json.dumps({"a": 1})}),
        "metadata 'keys' must be a JSON list of hex strings",
    ),
    ("keys missing", dict(drop_meta=("keys",)), "metadata 'keys' is missing"),
    ("no tokens tensor", dict(drop=("tokens",)), "tensor 'tokens' is missing"),
    (
        "duplicate keys",
        dict(tensors={"counts": torch.tensor([1, 1])}, meta={"keys": json.dumps(["6162", "6162"])}),
        "same key twice",
    ),
    ("counts do not add up", dict(tensors={"counts": torch.tensor([3])}), "response counts and lengths do not match"),
]


@pytest.mark.parametrize("damage, words", [c[1:] for c in HISTORY_DAMAGE], ids=[c[0] for c in HISTORY_DAMAGE])
def test_damaged_history_index_is_one_value_error_naming_the_file(history_file, damage, words):
    _assert_refused(HistoryIndex.load, history_file, damage, words)


def test_history_ids_are_checked_against_the_vocabulary_and_on_add(history_file):
    assert HistoryIndex.load(history_file, vocab_size=5).num_tokens() == 4
    with pytest.raises(ValueError, match=r"'tokens' holds 4, outside \[0, 4\)"):
        HistoryIndex.load(history_file, vocab_size=4)
    idx = HistoryIndex()
    with pytest.raises(ValueError, match=r"response must be token ids in \[0, 2\*\*31 - 1\], got -1"):
        idx.add(b"p", [1, -1])  # -1 is the separator: it would splice two responses together
    with pytest.raises(TypeError, match="response must hold integers, got float"):
        idx.add(b"p", [1.5])
    assert len(idx) == 0


# ------------------------------------------------------------------ directory draft store
STORE_DAMAGE = [
    ("S06 unknown finish reason", dict(meta={"finish_reason": "stop"}), "finish_reason must be one of"),
    (
        "S07 version not a number",
        dict(meta={"version": "x"}),
        "metadata 'version' must be a decimal integer >= 0, got 'x'",
    ),
    (
        "S07 negative version",
        dict(meta={"version": "-1"}),
        "metadata 'version' must be a decimal integer >= 0, got '-1'",
    ),
    ("S08 settings not JSON", dict(meta={"settings": "{"}), "metadata 'settings' is not valid JSON"),
    (
        "S09 unknown settings field",
        dict(meta={"settings": json.dumps({"temp": 1})}),
        "settings has unknown fields ['temp']",
    ),
    ("S09 settings missing", dict(drop_meta=("settings",)), "metadata 'settings' is missing"),
    (
        "S10 NaN logprob",
        dict(tensors={"logprobs": torch.tensor([float("nan"), -0.2])}),
        "log-probabilities (<= 0, not NaN)",
    ),
    (
        "S10 positive logprob",
        dict(tensors={"logprobs": torch.tensor([0.5, -0.2])}),
        "log-probabilities (<= 0, not NaN)",
    ),
    (
        "S11 length mismatch",
        dict(tensors={"logprobs": torch.tensor([-0.2])}),
        "'logprobs' has shape (1,), expected (2,)",
    ),
    (
        "S11 float token ids",
        dict(tensors={"token_ids": torch.tensor([3.0, 4.0])}),
        "'token_ids' has dtype torch.float32",
    ),
    (
        "S11 negative token id",
        dict(tensors={"token_ids": torch.tensor([-3, 4], dtype=torch.int32)}),
        "token_ids must be token ids in [0, 2**31 - 1], got -3",
    ),
    (
        "S14 2-D token ids",
        dict(tensors={"token_ids": torch.tensor([[3, 4]], dtype=torch.int32)}),
        "'token_ids' has shape (1, 2)",
    ),
    ("S14 no logprobs tensor", dict(drop=("logprobs",)), "tensor 'logprobs' is missing"),
]


@pytest.mark.parametrize("damage, words", [c[1:] for c in STORE_DAMAGE], ids=[c[0] for c in STORE_DAMAGE])
def test_damaged_draft_file_is_a_warning_and_a_miss(tmp_path, damage, words):
    store = DirectoryDraftStore(tmp_path / "store")
    key = CacheKey.make([9, 9], 0)
    store.store(key, [3, 4], [-0.1, -0.2], "eos", 1, S)
    path = store.path_for(key)
    _damage(path, **damage)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert store.lookup(key, S) is None
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and f"draft store: {path} is damaged" in messages[0] and words in messages[0], messages
    assert "treating it as a miss" in messages[0]
    assert (store.hits, store.misses) == (0, 1)
    store.store(key, [5], [-0.5], "length", 2, S)  # the next store replaces the damaged file
    assert store.lookup(key, S).token_ids.tolist() == [5]


def test_draft_store_files_written_before_still_read(tmp_path):
    store = DirectoryDraftStore(tmp_path / "store")
    key = CacheKey.make([9], 3, "ds")
    store.store(key, [3, 4], [-0.1, -0.2], "eos", 7, SamplingSettings(temperature=0.7, top_k=4, max_tokens=9))
    tensors = load_file(str(store.path_for(key)))
    assert tensors["token_ids"].dtype == torch.int32 and tensors["logprobs"].dtype == torch.float32
    d = DirectoryDraftStore(tmp_path / "store").lookup(key, SamplingSettings(temperature=0.7, top_k=4, max_tokens=9))
    assert (d.token_ids.tolist(), d.version, d.finish_reason) == ([3, 4], 7, "eos")
