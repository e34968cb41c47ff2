"""Arguments of the sampling, verification and cache API are never silently coerced: a wrong type is a
TypeError, a wrong value a ValueError, and each message names the argument and says what it takes."""

import numpy as np
import pytest
import torch

from spec_rl.acceptance.dispatch import VerifyOptions, verify_logits
from spec_rl.acceptance.rules import Lenient
from spec_rl.drafts.cache import CacheKey
from spec_rl.sampling.distribution import SamplingSettings, keyed_sample


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(temperature=True), TypeError, "temperature must be a real number, got bool"),
        (dict(temperature="1"), TypeError, "temperature must be a real number, got str"),
        (dict(temperature=float("nan")), ValueError, "temperature must be a finite number > 0, got nan"),
        (dict(temperature=-1), ValueError, "temperature must be a finite number > 0"),
        (dict(temperature=float("inf")), ValueError, "temperature must be a finite number > 0, got inf (greedy"),
        (dict(top_k=float("nan")), TypeError, "top_k must be an integer, got float nan"),
        (dict(top_k=2.5), TypeError, "top_k must be an integer, got float 2.5"),
        (dict(top_k=True), TypeError, "top_k must be an integer, got bool"),
        (dict(top_k="3"), TypeError, "top_k must be an integer, got str"),
        (dict(top_k=-1), ValueError, "top_k must be >= 0, got -1 (use 0 to disable top-k)"),
        (dict(top_p="abc"), TypeError, "top_p must be a real number, got str 'abc'"),
        (dict(top_p=None), TypeError, "top_p must be a real number, got NoneType"),
        (dict(top_p=True), TypeError, "top_p must be a real number, got bool"),
        (dict(top_p=0.0), ValueError, "top_p must be a finite number > 0 and <= 1, got 0.0 (use 1.0 to disable"),
        (dict(top_p=float("nan")), ValueError, "top_p must be a finite number > 0 and <= 1, got nan"),
        (dict(max_tokens=8.7), TypeError, "max_tokens must be an integer, got float 8.7"),
        (dict(max_tokens=None), TypeError, "max_tokens must be an integer, got NoneType"),
        (dict(max_tokens=0), ValueError, "max_tokens must be >= 1, got 0"),
    ],
)
def test_sampling_settings_refuse_bad_values(kwargs, error, words):
    with pytest.raises(error) as info:
        SamplingSettings(**kwargs)
    assert words in str(info.value)


def test_sampling_settings_take_numpy_numbers_as_plain_python_values():
    s = SamplingSettings(temperature=np.float32(0.5), top_p=np.float64(0.9), top_k=np.int64(3), max_tokens=np.int32(8))
    assert s == SamplingSettings(temperature=0.5, top_p=0.9, top_k=3, max_tokens=8)
    assert [type(v) for v in s.to_dict().values()] == [float, float, int, int]  # JSON-serialisable
    assert SamplingSettings(temperature=1) == SamplingSettings(temperature=1.0)


def _verify_inputs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 8, generator=g)
    ids = torch.randint(0, 8, (2, 3), generator=g)
    return ids, torch.full((2, 3), -1.0), logits


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(seed=1.9), TypeError, "seed must be an integer, got float 1.9"),
        (dict(seed="abc"), TypeError, "seed must be an integer, got str 'abc'"),
        (dict(seed=None), TypeError, "seed must be an integer, got NoneType"),
        (dict(seed=float("nan")), TypeError, "seed must be an integer, got float nan"),
        (dict(seed=True), TypeError, "seed must be an integer, got bool"),
        (dict(lengths=[3, 2]), TypeError, "lengths must be a torch.Tensor, got list (e.g. torch.tensor(lengths))"),
        (dict(uids=[0, 1]), TypeError, "uids must be a torch.Tensor, got list (e.g. torch.tensor(uids))"),
        (dict(uids=torch.arange(3)), ValueError, "uids has shape (3,), expected (2,)"),
        (dict(old_logprobs=[[0.0]]), TypeError, "old_logprobs must be a torch.Tensor, got list"),
    ],
)
def test_verify_refuses_bad_arguments(kwargs, error, words):
    ids, old, logits = _verify_inputs()
    with pytest.raises(error) as info:
        verify_logits(**{"draft_ids": ids, "old_logprobs": old, "logits": logits, **kwargs})
    assert words in str(info.value)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (
            dict(mode=None),
            ValueError,
            "mode must be one of vanilla, histspec, spec, exact, coupled, random or l=<lenience>",
        ),
        (dict(mode="vanilla"), ValueError, "mode 'vanilla' reuses no drafts: there is nothing to verify"),
        (dict(backend="gpu"), ValueError, "backend must be one of ('auto', 'reference', 'triton'), got 'gpu'"),
        (dict(sampling=None), TypeError, "sampling must be a SamplingSettings, got NoneType"),
        (dict(return_accept_mask=1), TypeError, "return_accept_mask must be True or False, got 1"),
    ],
)
def test_verify_options_refuse_bad_values(kwargs, error, words):
    with pytest.raises(error) as info:
        VerifyOptions(**kwargs)
    assert words in str(info.value)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(temperature=True), TypeError, "temperature must be a real number, got bool"),
        (dict(top_k=float("nan")), TypeError, "top_k must be an integer"),
        (dict(top_p="abc"), TypeError, "top_p must be a real number"),
    ],
)
def test_verify_sampling_settings_refuse_bad_values(kwargs, error, words):
    with pytest.raises(error) as info:
        VerifyOptions(sampling=SamplingSettings(**kwargs))
    assert words in str(info.value)


def test_verify_takes_numpy_temperature_and_lenience_and_any_integer_seed():
    ids, old, logits = _verify_inputs()
    numpy = VerifyOptions(mode=Lenient(np.float32(2.0)), sampling=SamplingSettings(temperature=np.float32(0.5)))
    plain = VerifyOptions(mode=Lenient(2.0), sampling=SamplingSettings(temperature=float(np.float32(0.5))))
    assert numpy == plain
    a = verify_logits(ids, old, logits, seed=np.int64(3), options=numpy)
    b = verify_logits(ids, old, logits, seed=3, options=plain)
    assert torch.equal(a.accepted_len, b.accepted_len) and torch.equal(a.new_logprobs, b.new_logprobs)
    assert type(VerifyOptions(mode=Lenient(np.float32(2.0))).rule.lenience) is float
    verify_logits(ids, old, logits, seed=-5)  # seeds are taken modulo 2**64
    verify_logits(ids, old, logits, seed=2**80)


def test_verify_refuses_meta_tensors():
    ids, old, logits = _verify_inputs()
    with pytest.raises(ValueError, match="draft_ids is on the meta device"):
        verify_logits(ids.to("meta"), old.to("meta"), logits.to("meta"))
    with pytest.raises(ValueError, match="logits is on the meta device"):
        verify_logits(ids, old, logits.to("meta"))


def test_keyed_sample_checks_settings_and_seed():
    logits = torch.randn(1, 5)
    one = torch.zeros(1, dtype=torch.long)
    with pytest.raises(TypeError, match="settings must be a SamplingSettings, got NoneType"):
        keyed_sample(logits, None, 0, one, one)
    with pytest.raises(TypeError, match="seed must be an integer, got float 1.5"):
        keyed_sample(logits, SamplingSettings(), 1.5, one, one)


@pytest.mark.parametrize(
    "args, error, words",
    [
        (([2**70], 0), ValueError, "prompt_ids must be token ids in [0, 2**63 - 1], got 1180591620717411303424"),
        (([-1, 5], 0), ValueError, "prompt_ids must be token ids in [0, 2**63 - 1], got -1"),
        (([1.5], 0), TypeError, "prompt_ids must hold integers, got float"),
        ((torch.tensor([1.0]), 0), TypeError, "prompt_ids must hold integers, got torch.float32"),
        ((["12"], 0), TypeError, "prompt_ids must be a sequence of ints or a 1-D integer tensor"),
        (([True], 0), TypeError, "prompt_ids must hold integers, got bool True"),
        (([[1, 2]], 0), ValueError, "prompt_ids must be 1-D, got shape (1, 2)"),
        (("abc", 0), TypeError, "prompt_ids must be a sequence of ints or a 1-D integer tensor, got str"),
        (([1], True), TypeError, "slot must be an integer, got bool"),
        (([1], 1.0), TypeError, "slot must be an integer, got float 1.0"),
        (([1], None), TypeError, "slot must be an integer, got NoneType"),
        (([1], -1), ValueError, "slot must be >= 0, got -1"),
        (([1], 0, 7), TypeError, "dataset_id must be a str or None, got int 7"),
    ],
)
def test_cache_key_refuses_bad_arguments(args, error, words):
    with pytest.raises(error) as info:
        CacheKey.make(*args)
    assert words in str(info.value)


def test_cache_key_of_numpy_and_tensor_ids_is_the_key_of_the_list():
    key = CacheKey.make([5, 6, 7], 1, "ds:1")
    assert CacheKey.make(np.array([5, 6, 7], dtype=np.int32), np.int64(1), "ds:1") == key
    assert CacheKey.make(torch.tensor([5, 6, 7], dtype=torch.int32), 1, "ds:1") == key
    assert CacheKey.make([], 0) == CacheKey.make(torch.zeros(0, dtype=torch.long), 0)


def test_cache_keys_are_those_of_earlier_versions():
    # Caches saved before must keep hitting: the digest of valid ids is unchanged.
    assert CacheKey.make([5, 6, 7], 1, "ds:1").digest.hex() == "67298dfffc080c71b0e01a80e9fb42d0"
    assert CacheKey.make([], 0).digest.hex() == "a3f10fd147f028a9a5858ab38b456619"


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(value=float("nan")), ValueError, "x must be a finite number, got nan"),
        (dict(value=float("nan"), finite=False), ValueError, "x must be a number (inf allowed), got nan"),
        (dict(value=float("inf"), low=0.0), ValueError, "x must be a finite number >= 0, got inf"),
        (dict(value=0.0, low=0.0, low_open=True), ValueError, "x must be a finite number > 0, got 0.0"),
        (
            dict(value=1.0, low=0.0, high=1.0, high_open=True),
            ValueError,
            "x must be a finite number >= 0 and < 1, got 1.0",
        ),
        (dict(value=-2, low=-1.0, hint=" (a hint)"), ValueError, "x must be a finite number >= -1, got -2.0 (a hint)"),
        (dict(value=True), TypeError, "x must be a real number, got bool True"),
        (dict(value="1"), TypeError, "x must be a real number, got str '1'"),
    ],
)
def test_check_real_refuses_non_numbers_nan_and_values_out_of_range(kwargs, error, words):
    from spec_rl.util.validation import check_real

    value = kwargs.pop("value")
    with pytest.raises(error) as info:
        check_real("x", value, **kwargs)
    assert str(info.value) == words


def test_check_real_and_check_choice_return_plain_values():
    from spec_rl.util.validation import check_choice, check_real

    assert check_real("x", np.float32(0.5), low=0.0, high=1.0) == 0.5 and type(check_real("x", 1)) is float
    assert check_real("x", float("inf"), low=0.0, finite=False) == float("inf")
    assert check_real("x", 0.0, low=0.0) == 0.0 and check_real("x", 1.0, high=1.0) == 1.0  # closed ends
    assert check_choice("c", "b", ("a", "b")) == "b" and check_choice("c", None, ("a", None)) is None
    for bad in ("z", np.array(["a"]), ["a"], b"a"):  # an array or list would compare element-wise or not at all
        with pytest.raises(ValueError, match=r"c must be one of \('a', 'b'\) \(say which\), got"):
            check_choice("c", bad, ("a", "b"), hint="say which")


def test_check_type_names_the_argument_and_what_it_must_be():
    from spec_rl.util.validation import check_type

    assert check_type("x", "a", str) == "a" and check_type("x", None, (str, type(None))) is None
    with pytest.raises(TypeError, match=r"^x must be a str or a bytes, got int$"):
        check_type("x", 1, (str, bytes))
    with pytest.raises(TypeError, match=r"^x must be a name, got list \(pass one\)$"):
        check_type("x", [], str, "a name", " (pass one)")
