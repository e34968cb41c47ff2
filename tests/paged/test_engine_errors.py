"""Every failed engine call leaves the paged cache as it found it, and bad arguments get clear errors.

Token ids are range-checked against the model's vocabulary before any block is taken; a failure
inside a forward (here: a model that raises) frees every block the call took. ``num_free`` is
compared before and after each failed call, and the block manager's invariants must hold.
"""

import warnings

import pytest
from backend_jobs import continue_rows, generate
from block_checks import check_invariants, sequences
from engine_models import tiny_family_model
from tiny_models import WORDS

from spec_rl.backends.paged import BlockManager, PagedEngine
from spec_rl.backends.transformers_backend import TransformersBackend
from spec_rl.sampling.distribution import SamplingSettings

warnings.filterwarnings("ignore", message="spec_rl._C is not built")

VOCAB = len(WORDS)
PROMPTS = [[3, 11, 12, 13, 14], [3, 15, 16], [3, 17, 18, 19, 20]]
DRAFTS = [[4, 5, 6, 7], [7, 8, 9], [8, 9, 10, 2]]
SETTINGS = SamplingSettings(temperature=1.0, max_tokens=16)


def _engine(**kw):
    model = tiny_family_model("qwen2", seed=kw.pop("seed", 1))  # 128 positions
    kw = {"block_size": 4, "num_blocks": 64, **kw}
    return PagedEngine(model, eos_ids={1}, pad_id=0, **kw)


def _assert_untouched(engine, free_before):
    assert engine.blocks.num_free == free_before == engine.blocks.num_blocks
    assert sequences(engine.blocks) == []
    check_invariants(engine.blocks)


class Boom(RuntimeError):
    pass


def _explode_after(engine, calls):
    """Make the model's forward raise after ``calls`` successful forwards."""
    real = engine.runner.head.states
    count = {"n": 0}

    def states(*args, **kwargs):
        count["n"] += 1
        if count["n"] > calls:
            raise Boom("forward failed")
        return real(*args, **kwargs)

    engine.runner.head.states = states


# ------------------------------------------------------------------ token ids


@pytest.mark.parametrize(
    "bad, message", [(VOCAB + 3, rf"= {VOCAB + 3} is outside \[0, {VOCAB}\)"), (-1, "= -1 is outside")]
)
def test_generate_range_checks_contexts_and_frees_nothing(bad, message):
    engine = _engine()
    free = engine.blocks.num_free
    with pytest.raises(ValueError, match=r"jobs\[1\]\.context\[2\] " + message):
        generate(engine, [PROMPTS[0], [3, 4, bad]], [4, 4], SETTINGS, seed=0)
    _assert_untouched(engine, free)


def test_generate_refuses_float_ids():
    engine = _engine()
    with pytest.raises(TypeError, match=r"jobs\[0\]\.context\[1\] must be an integer token id, got 1.7"):
        generate(engine, [[3, 1.7]], [4], SETTINGS, seed=0)


def test_score_range_checks_prompts_and_drafts():
    engine = _engine()
    free = engine.blocks.num_free
    with pytest.raises(ValueError, match=rf"drafts\[2\]\[0\] = {VOCAB} is outside \[0, {VOCAB}\)"):
        engine.score(PROMPTS, DRAFTS[:2] + [[VOCAB]])
    with pytest.raises(ValueError, match=r"prompts\[0\]\[0\] = -4 is outside"):
        engine.score([[-4]] + PROMPTS[1:], DRAFTS)
    _assert_untouched(engine, free)


def test_continue_from_range_checks_first_tokens_and_extra_contexts_and_frees_the_handle():
    engine = _engine()
    free = engine.blocks.num_free
    handle = engine.score(PROMPTS, DRAFTS)
    with pytest.raises(ValueError, match=rf"jobs\[1\]\.cut\.token = {VOCAB + 1} is outside \[0, {VOCAB}\)"):
        continue_rows(engine, handle, [1, 1, 1], [5, VOCAB + 1, 5], [4, 4, 4], SETTINGS, seed=0)
    _assert_untouched(engine, free)
    handle = engine.score(PROMPTS, DRAFTS)
    with pytest.raises(ValueError, match=r"jobs\[3\]\.context\[1\] = -3 is outside"):
        continue_rows(
            engine,
            handle,
            [1, 1, 1],
            [5, 5, 5],
            [4, 4, 4],
            SETTINGS,
            seed=0,
            extra_contexts=[[3, -3]],
            extra_budgets=[4],
        )
    _assert_untouched(engine, free)


# ------------------------------------------------------------------ failures inside a forward


@pytest.mark.parametrize("calls", [0, 1, 3])
def test_a_failed_forward_in_generate_frees_every_block(calls):
    engine = _engine()
    free = engine.blocks.num_free
    _explode_after(engine, calls)  # 0: the prefill fails; later: a decode step
    with pytest.raises(Boom):
        generate(engine, [PROMPTS[0]] * 3 + PROMPTS[1:], [8] * 5, SETTINGS, seed=0)
    _assert_untouched(engine, free)


def test_a_failed_scoring_forward_frees_every_block():
    engine = _engine(max_tokens_per_forward=8)  # several scoring waves
    free = engine.blocks.num_free
    _explode_after(engine, 1)
    with pytest.raises(Boom):
        engine.score(PROMPTS, DRAFTS)
    _assert_untouched(engine, free)


@pytest.mark.parametrize("calls", [1, 2, 4])
def test_a_failed_forward_in_continue_from_frees_every_block(calls):
    engine = _engine()
    free = engine.blocks.num_free
    _explode_after(engine, calls)  # the scoring pass is forward 1
    handle = engine.score(PROMPTS, DRAFTS)
    with pytest.raises(Boom):
        continue_rows(
            engine,
            handle,
            [2, 0, 3],
            [5, 6, 7],
            [8, 8, 8],
            SETTINGS,
            seed=0,
            sources=[0, 1, 2],
            extra_contexts=[PROMPTS[0]],
            extra_budgets=[8],
        )
    _assert_untouched(engine, free)


def test_the_engine_works_normally_after_failures():
    engine = _engine()
    _explode_after(engine, 0)
    with pytest.raises(Boom):
        generate(engine, PROMPTS, [6] * 3, SETTINGS, seed=0)
    del engine.runner.head.states  # the class method again
    outs = generate(engine, PROMPTS, [6] * 3, SETTINGS, seed=0)
    assert all(1 <= len(o.token_ids) <= 6 for o in outs)
    _assert_untouched(engine, engine.blocks.num_blocks)


# ------------------------------------------------------------------ positions


def test_sequences_never_pass_the_models_positions():
    engine = _engine()  # max_position_embeddings = 128
    assert engine.max_positions == 128 and engine.vocab_size == VOCAB
    with pytest.raises(
        ValueError, match=r"jobs\[0\]\.context .*120 tokens \+ a budget of 10\).*max_position_embeddings=128"
    ):
        generate(engine, [[3] * 120], [10], SETTINGS, seed=0)
    with pytest.raises(ValueError, match=r"prompts\[0\] \+ drafts\[0\] .*129 tokens.*max_position_embeddings=128"):
        engine.score([[3] * 120], [[4] * 9])
    handle = engine.score([[3] * 120], [[4] * 4])
    with pytest.raises(ValueError, match=r"jobs\[0\] needs 130 positions .*max_position_embeddings=128"):
        continue_rows(engine, handle, [2], [5], [7], SETTINGS, seed=0)  # 120 + 2 + 1 + 7
    generate(engine, [[3] * 120], [8], SETTINGS, seed=0)  # exactly 128 positions is fine
    _assert_untouched(engine, engine.blocks.num_blocks)


def test_transformers_backend_checks_ids_and_positions_too():
    model = tiny_family_model("llama", seed=2)
    backend = TransformersBackend(model, {1}, pad_id=0)
    with pytest.raises(ValueError, match=rf"jobs\[0\]\.context\[1\] = {VOCAB} is outside \[0, {VOCAB}\)"):
        generate(backend, [[3, VOCAB]], [4], SETTINGS, seed=0)
    with pytest.raises(ValueError, match=r"drafts\[0\]\[0\] = -1 is outside"):
        backend.score([[3]], [[-1]])
    with pytest.raises(ValueError, match=r"jobs\[0\]\.context .*max_position_embeddings=256"):
        generate(backend, [[3] * 200], [60], SETTINGS, seed=0)
    handle = backend.score(PROMPTS, DRAFTS)
    assert handle.state is not None  # the spliced path: the scoring K/V are kept
    with pytest.raises(ValueError, match=rf"jobs\[2\]\.cut\.token = {VOCAB} is outside \[0, {VOCAB}\)"):
        continue_rows(backend, handle, [1, 1, 1], [5, 5, VOCAB], [4, 4, 4], SETTINGS, seed=0)
    assert handle.used and handle.state is None  # released on the error


# ------------------------------------------------------------------ block manager and sizes


def test_allocate_with_a_fractional_token_count_leaves_no_state():
    mgr = BlockManager(num_blocks=8, block_size=4)
    with pytest.raises(TypeError, match="num_tokens must be an integer, got float 2.5"):
        mgr.allocate("s", 2.5)
    assert not mgr.has("s") and mgr.num_free == 8
    check_invariants(mgr)
    mgr.allocate("s", 3)
    for call, arg in ((mgr.append_slots, 1.5), (mgr.truncate, 0.5)):
        with pytest.raises(TypeError, match="must be an integer"):
            call("s", arg)
    with pytest.raises(TypeError, match="length must be an integer"):
        mgr.fork("s", "t", 1.5)
    assert mgr.length("s") == 3 and not mgr.has("t")
    check_invariants(mgr)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(block_size=0, num_blocks=None), ValueError, "block_size must be >= 1, got 0"),
        (dict(block_size=2.5, num_blocks=None), TypeError, "block_size must be an integer, got float 2.5"),
        (dict(num_blocks=None, kv_cache_bytes=0), ValueError, "kv_cache_bytes must be >= 1, got 0"),
        (dict(num_blocks=None, kv_cache_bytes=-5), ValueError, "kv_cache_bytes must be >= 1, got -5"),
        (dict(num_blocks=None, kv_cache_bytes=100), ValueError, r"kv_cache_bytes=100 holds no KV block \(1024 bytes"),
        (dict(num_blocks=0), ValueError, "num_blocks must be >= 1, got 0"),
    ],
)
def test_bad_cache_sizes_are_refused_clearly(kwargs, error, message):
    with pytest.raises(error, match=message):
        _engine(**kwargs)
