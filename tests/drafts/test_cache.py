"""RolloutCache: keying, settings mismatch, atomic save/load."""

import warnings

import pytest
import torch

from spec_rl.drafts.cache import CacheKey, RolloutCache
from spec_rl.sampling.distribution import SamplingSettings

S = SamplingSettings(temperature=1.0, max_tokens=64)


def _fill(cache, n=5):
    keys = []
    for i in range(n):
        k = CacheKey.make([1, 2, 3, i], slot=i % 2, dataset_id=f"ds:{i}")
        cache.store(
            k, list(range(i + 1)), [-0.5 * j for j in range(i + 1)], "eos" if i % 2 else "length", version=i, settings=S
        )
        keys.append(k)
    return keys


def test_keys_are_token_ids_slot_and_dataset_id():
    base = CacheKey.make([5, 6, 7], 0)
    assert CacheKey.make(torch.tensor([5, 6, 7]), 0) == base
    assert CacheKey.make([5, 6, 7], 1) != base
    assert CacheKey.make([5, 67], 0) != base  # no collision through concatenation
    assert CacheKey.make([5, 6, 7], 0, dataset_id="a") != base
    assert CacheKey.make([5, 6, 7], 0, dataset_id="a") != CacheKey.make([5, 6, 7], 0, dataset_id="b")
    assert 0 <= base.uid < 2**63
    with pytest.raises(ValueError, match="slot"):
        CacheKey.make([1], -1)


def test_store_lookup_and_shuffle_independence():
    cache = RolloutCache()
    keys = _fill(cache)
    order = [3, 0, 4, 1, 2]
    for i in order:
        d = cache.lookup(keys[i], S)
        assert d.token_ids.dtype == torch.int32 and d.logprobs.dtype == torch.float32
        assert d.token_ids.tolist() == list(range(i + 1))
        assert d.version == i
    assert cache.lookup(CacheKey.make([9], 0), S) is None
    assert cache.hits == 5 and cache.misses == 1


def test_settings_mismatch_is_a_miss_with_one_warning():
    cache = RolloutCache()
    keys = _fill(cache, 2)
    other = SamplingSettings(temperature=0.7, max_tokens=64)
    with pytest.warns(UserWarning, match="treating it as a miss"):
        assert cache.lookup(keys[0], other) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.lookup(keys[1], other) is None  # same pair: no second warning
    assert cache.settings_mismatches == 2
    assert cache.lookup(keys[0], S) is not None


def test_another_budget_is_still_a_hit_and_the_rollout_decides_validity():
    # A budget changes no log-prob: the draft is found, and draft_validity says what part of it is valid.
    cache = RolloutCache()
    ended = CacheKey.make([1, 2], 0)
    cut = CacheKey.make([1, 3], 0)
    cache.store(ended, [4, 5, 6], [-0.1, -0.2, -0.3], "eos", version=1, settings=S)
    cache.store(cut, list(range(64)), [-0.5] * 64, "length", version=1, settings=S)
    longer, shorter = SamplingSettings(max_tokens=128), SamplingSettings(max_tokens=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for key in (ended, cut):
            for settings in (longer, shorter):
                assert cache.lookup(key, settings) is not None
    assert cache.settings_mismatches == 0
    with pytest.warns(UserWarning, match="different sampling distributions"):
        assert cache.lookup(ended, SamplingSettings(top_k=5, max_tokens=64)) is None


def test_round_trip_to_disk(tmp_path):
    cache = RolloutCache()
    keys = _fill(cache)
    other = SamplingSettings(temperature=0.6, top_p=0.9, top_k=5, max_tokens=10)
    k = CacheKey.make([42], 3)
    cache.store(k, [], [], "length", 7, other)
    path = cache.save(tmp_path / "c.safetensors")
    loaded = RolloutCache.load(path)
    assert len(loaded) == 6
    for _i, key in enumerate(keys):
        a, b = cache.lookup(key, S), loaded.lookup(key, S)
        assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.logprobs, b.logprobs)
        assert (a.finish_reason, a.version, a.settings) == (b.finish_reason, b.version, b.settings)
    d = loaded.lookup(k, other)
    assert len(d) == 0 and d.settings == other and d.version == 7
    empty = RolloutCache().save(tmp_path / "empty.safetensors")
    assert len(RolloutCache.load(empty)) == 0


def test_interrupted_save_keeps_previous_file(tmp_path, monkeypatch):
    cache = RolloutCache()
    _fill(cache)
    path = cache.save(tmp_path / "c.safetensors")
    before = path.read_bytes()
    cache.store(CacheKey.make([8, 8], 0), [1], [-0.1], "eos", 9, S)

    import safetensors.torch

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("simulated crash mid-write")

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        cache.save(path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]  # no temp file left behind
    assert len(RolloutCache.load(path)) == 5


def test_bad_input(tmp_path):
    cache = RolloutCache()
    k = CacheKey.make([1], 0)
    with pytest.raises(ValueError, match="same length"):
        cache.store(k, [1, 2], [-1.0], "eos", 0, S)
    with pytest.raises(ValueError, match="finish_reason"):
        cache.store(k, [1], [-1.0], "stop", 0, S)
    with pytest.raises(ValueError, match="log-probabilities"):
        cache.store(k, [1], [0.5], "eos", 0, S)
    with pytest.raises(FileNotFoundError):
        RolloutCache.load(tmp_path / "missing.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="safetensors"):
        RolloutCache.load(junk)
    with pytest.raises(ValueError, match="temperature"):
        SamplingSettings(temperature=0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingSettings(top_k=-1)


@pytest.mark.parametrize(
    "change, error, words",
    [
        (dict(token_ids=[1.7, 2.2]), TypeError, "token_ids must hold integers, got float"),
        (dict(token_ids=torch.tensor([1.0, 2.0])), TypeError, "token_ids must hold integers, got torch.float32"),
        (dict(token_ids=torch.tensor([[1, 2]])), ValueError, "token_ids must be 1-D, got shape (1, 2)"),
        (dict(token_ids=[True, False]), TypeError, "token_ids must hold integers, got bool True"),
        (dict(token_ids=["1", "2"]), TypeError, "token_ids must be a sequence of ints or a 1-D integer tensor"),
        (dict(token_ids=[2**31, 1]), ValueError, "token_ids must be token ids in [0, 2**31 - 1], got 2147483648"),
        (dict(token_ids=[2**70, 1]), ValueError, "token_ids must be token ids in [0, 2**31 - 1]"),
        (dict(token_ids=[-3, 1]), ValueError, "token_ids must be token ids in [0, 2**31 - 1], got -3"),
        (dict(logprobs=[[-0.1, -0.2]]), ValueError, "logprobs must be 1-D, got shape (1, 2)"),
        (dict(logprobs=["x", "y"]), TypeError, "logprobs must be a sequence of floats or a 1-D float tensor"),
        (dict(logprobs=[-0.1, float("nan")]), ValueError, "logprobs must be log-probabilities (<= 0, not NaN)"),
        (dict(settings={"temperature": 1.0}), TypeError, "settings must be a SamplingSettings, got dict"),
        (dict(settings=None), TypeError, "settings must be a SamplingSettings, got NoneType"),
        (dict(version=1.9), TypeError, "version must be an integer, got float 1.9"),
        (dict(version=True), TypeError, "version must be an integer, got bool"),
        (dict(version="3"), TypeError, "version must be an integer, got str"),
        (dict(version=-1), ValueError, "version must be >= 0, got -1"),
        (dict(finish_reason=None), ValueError, "finish_reason must be one of ('eos', 'length'), got None"),
        (
            dict(key=b"abc"),
            TypeError,
            "key must be a CacheKey (CacheKey.make(prompt_ids, slot, dataset_id)), got bytes",
        ),
    ],
)
def test_store_refuses_bad_drafts_at_store_time(tmp_path, change, error, words):
    from spec_rl.drafts.directory import DirectoryDraftStore

    args = dict(
        key=CacheKey.make([1], 0), token_ids=[1, 2], logprobs=[-0.1, -0.2], finish_reason="eos", version=0, settings=S
    )
    args.update(change)
    for store in (RolloutCache(), DirectoryDraftStore(tmp_path / "d")):
        with pytest.raises(error) as info:
            store.store(**args)
        assert words in str(info.value)
        assert len(store) == 0  # nothing half-stored


def test_lookup_refuses_bad_arguments():
    cache = RolloutCache()
    with pytest.raises(TypeError, match="settings must be a SamplingSettings, got NoneType"):
        cache.lookup(CacheKey.make([1], 0), None)
    with pytest.raises(TypeError, match="key must be a CacheKey"):
        cache.lookup("abc", S)


def test_store_takes_numpy_and_int32_tensors_unchanged():
    import numpy as np

    cache = RolloutCache()
    k = CacheKey.make([1], 0)
    cache.store(k, np.array([4, 5], dtype=np.int64), np.array([-0.5, -1.0]), "eos", np.int64(3), S)
    d = cache.lookup(k, S)
    assert d.token_ids.tolist() == [4, 5] and d.logprobs.tolist() == [-0.5, -1.0] and d.version == 3
    assert type(d.version) is int
    cache.store(k, torch.tensor([7], dtype=torch.int32), torch.tensor([-0.25]), "length", 4, S)
    assert cache.lookup(k, S).token_ids.tolist() == [7]
