"""Directory draft store: RolloutCache semantics, atomic files, sharing across processes."""

from __future__ import annotations

import multiprocessing as mp
import warnings

import pytest
import torch

from spec_rl.drafts.cache import CacheKey, RolloutCache
from spec_rl.drafts.directory import DirectoryDraftStore
from spec_rl.sampling.distribution import SamplingSettings

S = SamplingSettings(temperature=1.0, max_tokens=16)


def test_store_and_lookup_match_rollout_cache(tmp_path):
    store, mem = DirectoryDraftStore(tmp_path / "d"), RolloutCache()
    keys = [CacheKey.make([5, 6, 7], slot) for slot in range(3)]
    for i, k in enumerate(keys):
        ids, lps = list(range(i + 1)), [-0.5 * (j + 1) for j in range(i + 1)]
        store.store(k, ids, lps, "eos" if i else "length", 4 + i, S)
        mem.store(k, ids, lps, "eos" if i else "length", 4 + i, S)
    assert len(store) == 3
    for k in keys:
        a, b = store.lookup(k, S), mem.lookup(k, S)
        assert torch.equal(a.token_ids, b.token_ids) and a.token_ids.dtype == torch.int32
        assert torch.equal(a.logprobs, b.logprobs) and a.logprobs.dtype == torch.float32
        assert (a.finish_reason, a.version, a.settings) == (b.finish_reason, b.version, b.settings)
    assert store.lookup(CacheKey.make([5, 6, 7], 9), S) is None
    assert (store.hits, store.misses) == (3, 1)
    # a second store object on the same directory (another worker) sees the same drafts
    other = DirectoryDraftStore(tmp_path / "d")
    assert other.lookup(keys[2], S).token_ids.tolist() == [0, 1, 2]


def test_replace_and_settings_mismatch_is_a_miss(tmp_path):
    store = DirectoryDraftStore(tmp_path)
    k = CacheKey.make([1, 2], 0, "gsm8k:3")
    store.store(k, [3, 4], [-1.0, -2.0], "eos", 1, S)
    store.store(k, [9], [-0.25], "length", 2, S)
    d = store.lookup(k, S)
    assert d.token_ids.tolist() == [9] and d.version == 2 and d.finish_reason == "length"
    with pytest.warns(UserWarning, match="treating it as a miss"):
        assert store.lookup(k, SamplingSettings(temperature=0.7, max_tokens=16)) is None
    assert store.settings_mismatches == 1
    # no temporary files are left behind
    assert not list(tmp_path.glob("**/*.tmp"))


def test_bad_input_is_refused(tmp_path):
    store = DirectoryDraftStore(tmp_path / "s")
    k = CacheKey.make([1], 0)
    with pytest.raises(ValueError, match="same length"):
        store.store(k, [1, 2], [-1.0], "eos", 0, S)
    with pytest.raises(ValueError, match="finish_reason"):
        store.store(k, [1], [-1.0], "stop", 0, S)
    with pytest.raises(ValueError, match="log-probabilities"):
        store.store(k, [1], [0.5], "eos", 0, S)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="not a spec-rl draft store"):
        DirectoryDraftStore(tmp_path / "other")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        DirectoryDraftStore(tmp_path / "afile")


def test_damaged_file_is_a_miss_with_warning(tmp_path):
    store = DirectoryDraftStore(tmp_path)
    k = CacheKey.make([1, 2, 3], 1)
    store.store(k, [4], [-1.0], "eos", 0, S)
    store.path_for(k).write_bytes(b"garbage")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert store.lookup(k, S) is None
    assert any("cannot read" in str(x.message) for x in w)


def _writer(root: str, writer: int, rounds: int) -> None:
    store = DirectoryDraftStore(root, fsync=False)
    for r in range(rounds):
        for p in range(8):  # keys 0..7 are written by both processes
            n = 1 + (p + r + writer) % 5
            # every token id encodes (writer, n), so a torn or mixed file would show
            store.store(CacheKey.make([p, 100], 0), [writer * 10 + n] * n, [-(writer + 1.0)] * n, "eos", r, S)


def test_two_processes_share_one_directory(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), w, 6)) for w in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    store = DirectoryDraftStore(tmp_path)
    assert len(store) == 8
    for p in range(8):
        d = store.lookup(CacheKey.make([p, 100], 0), S)
        writer, n = divmod(int(d.token_ids[0]), 10)
        assert writer in (0, 1) and len(d) == n
        assert d.token_ids.tolist() == [writer * 10 + n] * n
        assert d.logprobs.tolist() == [-(writer + 1.0)] * n
        assert d.version == 5
    assert not list(tmp_path.glob("**/*.tmp"))


def test_a_writer_killed_mid_write_leaves_the_old_draft_and_clear_removes_its_temporary(tmp_path):
    store = DirectoryDraftStore(tmp_path)
    key = CacheKey.make([3, 4], 1)
    store.store(key, [7, 8], [-0.1, -0.2], "eos", 1, S)
    path = store.path_for(key)
    # what a SIGKILL between writing and renaming leaves: a temporary beside the target, the target untouched
    leftover = path.parent / f".{path.name}.k1ll3d.tmp"
    leftover.write_bytes(b"\x00" * 17)  # a partial write
    got = store.lookup(key, S)
    assert got.token_ids.tolist() == [7, 8] and got.version == 1 and len(store) == 1
    store.clear()
    assert not leftover.exists() and len(store) == 0 and store.lookup(key, S) is None


def _tokenizer(words):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


def test_drafts_of_another_tokenizer_or_model_are_refused(tmp_path):
    from types import SimpleNamespace

    from spec_rl.drafts.owner import DraftOwnerError, policy_owner

    words = ["<pad>", "<eos>", "<unk>", "a", "b"]
    mine = policy_owner(_tokenizer(words), SimpleNamespace(model_type="llama", vocab_size=5, hidden_size=8))
    assert mine.startswith("llama-v5-h8-lNone-tok") and mine == policy_owner(
        _tokenizer(words), {"model_type": "llama", "vocab_size": 5, "hidden_size": 8}
    )
    other_tok = policy_owner(_tokenizer(["<pad>", "<eos>", "<unk>", "b", "a"]), {"model_type": "llama"})
    other_model = policy_owner(_tokenizer(words), {"model_type": "qwen2", "vocab_size": 5, "hidden_size": 8})
    assert len({mine, other_tok, other_model, policy_owner(_tokenizer(words))}) == 4
    with pytest.raises(TypeError, match="tokenizer must be a transformers tokenizer"):
        policy_owner(object())

    # the in-memory cache, saved and loaded
    cache = RolloutCache()
    cache.claim(mine)
    cache.store(CacheKey.make([3, 4], 0), [3, 1], [-0.5, -0.1], "eos", 0, SamplingSettings())
    path = cache.save(tmp_path / "cache.safetensors")
    loaded = RolloutCache.load(path)
    assert loaded.owner == mine and len(loaded) == 1
    loaded.claim(mine)  # the same policy (e.g. after training steps) keeps it
    refused = rf"rollout cache .* holds drafts of another policy \({mine}\).*new draft"
    with pytest.raises(DraftOwnerError, match=refused):
        RolloutCache.load(path).claim(other_tok, f"rollout cache {path}")
    fresh = RolloutCache()
    fresh.claim(other_model)
    with pytest.raises(ValueError, match="the cache merged in holds drafts of another policy"):
        fresh.update(RolloutCache.load(path))
    assert len(fresh) == 0

    # the shared directory: the owner lives in its marker, for every worker
    DirectoryDraftStore(tmp_path / "drafts").claim(mine)
    DirectoryDraftStore(tmp_path / "drafts").claim(mine)
    with pytest.raises(DraftOwnerError, match=r"draft directory .*drafts holds drafts of another policy"):
        DirectoryDraftStore(tmp_path / "drafts").claim(other_model)
    with pytest.raises(TypeError, match="owner must be a non-empty str"):
        RolloutCache().claim("")
