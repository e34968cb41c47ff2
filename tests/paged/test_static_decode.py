"""The static-shape decode step (CUDA's step, run eagerly on the CPU): the packed step's tokens, log-probs and block
bookkeeping, through padding buckets, continuous batching, forks and continuations, with no host sync inside a step."""

import pytest
import torch
from backend_jobs import continue_rows, generate
from block_checks import check_invariants
from engine_models import FAMILIES, tiny_family_model

from spec_rl.backends.paged import PagedEngine
from spec_rl.backends.paged import static_decode as static_module
from spec_rl.backends.paged.static_decode import DecodeConfig, bucket_of
from spec_rl.backends.transformers_backend import TransformersBackend
from spec_rl.sampling.distribution import SamplingSettings, philox_gumbel_argmax

CONTEXTS = [[3, 4, 5], [6, 7, 8, 9, 10, 11, 12], [3, 4, 5], [13], [14, 15, 16, 17, 18] * 4, [19, 20]]
BUDGETS = [10, 25, 40, 1, 17, 30]
SETTINGS = [
    SamplingSettings(temperature=1.0, max_tokens=64),
    SamplingSettings(temperature=0.7, top_k=12, top_p=0.9, max_tokens=64),
]


def _engine(model, decode, **kw):
    kw = {"block_size": 4, "num_blocks": 96, "max_batch_size": 4, **kw}
    return PagedEngine(model, eos_ids={1}, pad_id=0, decode=decode, **kw)


def _assert_same(a, b):
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]
    for x, y in zip(a, b):
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("settings", SETTINGS)
def test_static_step_gives_the_packed_steps_tokens(family, settings):
    # 6 jobs through 4 rows (continuous batching), buckets of 1-4 rows with padding, a shared context (a fork and a
    # copy-on-write block), a budget of 1, EOS and length finishes.
    model = tiny_family_model(family, seed=7, vocab_size=40)
    packed = _engine(model, DecodeConfig(static=False))
    want = generate(packed, CONTEXTS, BUDGETS, settings, seed=5)
    assert {o.finish_reason for o in want} == {"eos", "length"}
    for sync_every in (1, 3, 8):
        engine = _engine(model, DecodeConfig(static=True, sync_every=sync_every))
        got = generate(engine, CONTEXTS, BUDGETS, settings, seed=5)
        _assert_same(got, want)
        assert engine.blocks.num_free == engine.blocks.num_blocks
        check_invariants(engine.blocks)
        assert engine.stats.decode_tokens == packed.stats.decode_tokens
        assert engine.stats.graph_steps == 0  # a CPU runs the step eagerly
        if sync_every == 1:  # longer chunks idle finished rows and admit new ones later: other step counts
            assert engine.stats.decode_steps == packed.stats.decode_steps


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("settings", SETTINGS)
def test_static_step_continues_scored_rows_and_a_tight_cache(family, settings):
    # continue_from resumes cut rows (forks of one scored row, a cut inside a block); 20 blocks: waits for blocks.
    model = tiny_family_model(family, seed=8, vocab_size=40)
    prompts, drafts = [[3, 4, 5, 6, 7], [8, 9]], [[10, 11, 12, 13, 14, 15], [16, 17, 18]]

    def run(engine):
        scored = engine.score(prompts, drafts)
        return continue_rows(
            engine, scored, [3, 0, 5], [20, 21, 22], [12, 20, 9], settings, 3, [[23, 24]], [15], sources=[0, 1, 0]
        )

    want = run(_engine(model, DecodeConfig(static=False)))
    for num_blocks in (96, 20):
        engine = _engine(model, DecodeConfig(static=True, sync_every=4), num_blocks=num_blocks)
        _assert_same(run(engine), want)
        assert engine.blocks.num_free == num_blocks
        check_invariants(engine.blocks)


def test_steps_with_a_proposer_stay_on_the_packed_step():
    class Echo:  # proposes nothing, hears every token; falsy (an empty history), still a proposer
        max_k = 2

        def __len__(self):
            return 0

        def __init__(self):
            self.heard = 0

        def propose(self, limit, fill=0):
            return []

        def update(self, proposal, tokens):
            self.heard += len(tokens)

    model = tiny_family_model("llama", seed=9, vocab_size=40)
    settings = SETTINGS[0]
    want = generate(_engine(model, DecodeConfig(static=False)), CONTEXTS[:3], BUDGETS[:3], settings, seed=2)
    proposers = [Echo(), None, None]
    got = generate(
        _engine(model, DecodeConfig(static=True)), CONTEXTS[:3], BUDGETS[:3], settings, 2, proposers=proposers
    )
    _assert_same(got, want)
    assert proposers[0].heard == len(got[0].token_ids)  # the static step would not tell it


def test_a_static_step_holds_nothing_a_cuda_graph_cannot(monkeypatch):
    # The captured function runs CUDA's code path: the Triton paged decode kernel (interpreted here; one device op)
    # and the torch reference of the Gumbel kernel; nothing in it reads a value, makes a tensor from a Python value
    # or a scalar tensor, or prints (5b34606's step made its Philox stream constant with torch.tensor: lift_fresh).
    from capture_guard import HostData

    from spec_rl.kernels.paged_attention import paged_decode_attention

    monkeypatch.setattr(static_module, "gumbel_race", philox_gumbel_argmax)
    seen, step, steps = HostData(), static_module.StaticDecoder._step, []

    def watched(self, buf, settings):
        self.runner.decode_kernel = seen.opaque(paged_decode_attention)
        with seen:
            step(self, buf, settings)
        self.runner.decode_kernel = None
        steps.append(1)

    monkeypatch.setattr(static_module.StaticDecoder, "_step", watched)
    for family, settings in zip(FAMILIES, [SETTINGS[0], SETTINGS[1], SETTINGS[1]]):
        model = tiny_family_model(family, seed=10, vocab_size=40)
        generate(_engine(model, DecodeConfig(static=True, sync_every=4)), CONTEXTS, BUDGETS, settings, seed=1)
    assert len(steps) > 30 and seen.ops == []
    with seen:  # the detector itself sees each kind
        x = torch.ones(3)
        x.sum().item()
        x[x > 0]
        torch.tensor([1, 2])
        torch.where(x > 0, x, 2.0)
        x.tolist()
        f"{x}"
    assert seen.ops[:6] == [  # printing reads more after __format__
        "_local_scalar_dense.default",
        "index.Tensor",
        "lift_fresh.default",
        "scalar_tensor.default",
        "tolist",
        "__format__",
    ]


def test_the_static_step_is_the_only_captured_function():
    # the detector above runs over every function a CUDA graph captures: keep that list whole
    import re

    from repo_paths import REPO_ROOT as ROOT

    sites = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "spec_rl").rglob("*.py")
        for _ in re.finditer(r"torch\.cuda\.graph\(", path.read_text())
    ]
    assert sites == ["spec_rl/backends/paged/static_decode.py"]


def test_invalid_logits_in_a_static_step_name_the_row():
    model = tiny_family_model("qwen2", seed=11, vocab_size=40)
    engine = _engine(model, DecodeConfig(static=True, sync_every=2))

    def poison(module, args, out):  # the decode steps' forwards only (4 rows), not the prefill
        return torch.full_like(out, float("nan")) if out.shape[1] == 4 else out

    hook = model.lm_head.register_forward_hook(poison)
    try:
        with pytest.raises(
            ValueError,
            match=r"logits uid 0 \(positions 4-5\), uid 2 \(positions 4-5\), uid 1 \(positions 8-9\) have no sampling",
        ):
            generate(engine, CONTEXTS[:3], [5, 5, 5], SETTINGS[0], seed=0)
    finally:
        hook.remove()
    assert engine.blocks.num_free == engine.blocks.num_blocks  # the failed call freed every block


def test_buckets_and_config_checks():
    assert [bucket_of(n, 48) for n in (1, 2, 3, 5, 16, 17, 33, 48)] == [1, 2, 4, 8, 16, 32, 48, 48]
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not DecodeConfig().uses_static(cpu) and DecodeConfig().uses_static(cuda)
    assert DecodeConfig(static=True).uses_static(cpu) and not DecodeConfig(static=False).uses_static(cuda)
    assert (DecodeConfig().steps_per_sync(cpu), DecodeConfig().steps_per_sync(cuda)) == (1, 8)
    with pytest.raises(ValueError, match="sync_every"):
        DecodeConfig(sync_every=0)
    with pytest.raises(ValueError, match="sync_every must be <= 256"):
        DecodeConfig(sync_every=10**6)  # its [rows, sync_every] token buffers would not fit
    model = tiny_family_model("qwen2")
    engine = _engine(model, DecodeConfig(static=True))
    for backend in (engine, TransformersBackend(model, eos_ids={1}, pad_id=0)):
        for seed in (1.5, "7", None):
            with pytest.raises(TypeError, match="seed must be an integer"):
                generate(backend, CONTEXTS[:2], BUDGETS[:2], SETTINGS[0], seed=seed)
    assert engine.blocks.num_free == engine.blocks.num_blocks
    with pytest.raises(TypeError, match="DecodeConfig.static"):
        DecodeConfig(static="yes")
    with pytest.raises(TypeError, match="decode must be a DecodeConfig"):
        PagedEngine(tiny_family_model("qwen2"), eos_ids={1}, pad_id=0, decode={"static": True})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_steps_give_the_eager_steps_tokens():
    model = tiny_family_model("qwen3", seed=12, vocab_size=40).cuda()
    settings = SETTINGS[1]
    want = generate(_engine(model, DecodeConfig(static=True, cuda_graphs=False)), CONTEXTS, BUDGETS, settings, 4)
    engine = _engine(model, DecodeConfig(static=True))
    _assert_same(generate(engine, CONTEXTS, BUDGETS, settings, 4), want)
    assert engine.stats.graph_steps > 0
    packed = generate(_engine(model, DecodeConfig(static=False)), CONTEXTS, BUDGETS, settings, 4)
    _assert_same(packed, want)  # CUDA's packed step samples by the same device rule


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("settings", SETTINGS)
def test_a_reusing_rollout_continues_on_the_static_step_with_the_packed_steps_tokens(family, settings, monkeypatch):
    # A reusing mode without tail speculation and vanilla decode on the same (static) path: they differ by reuse only.
    from spec_rl.acceptance.mode import RolloutMode
    from spec_rl.acceptance.rules import Lenient
    from spec_rl.drafts.cache import RolloutCache
    from spec_rl.rollout.speculative import RolloutRequest, SpeculativeRollout

    model = tiny_family_model(family, seed=12, vocab_size=40)
    requests = [RolloutRequest(c, s, dataset_id=f"p{i}") for i, c in enumerate(CONTEXTS[:4]) for s in range(2)]
    static_calls = []
    decode = static_module.StaticDecoder.decode
    monkeypatch.setattr(
        static_module.StaticDecoder, "decode", lambda self, *a: static_calls.append(1) or decode(self, *a)
    )

    def epochs(config):
        engine = _engine(model, config, max_batch_size=8)
        ro = SpeculativeRollout(engine, RolloutCache(), settings, [1], 64, mode=RolloutMode(Lenient(1.0), tail=0))
        first = ro.run(requests, step=0)
        nudge = torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(0)) * 0.03
        with torch.no_grad():
            model.lm_head.weight.add_(nudge)
        second = ro.run(requests, step=1)
        with torch.no_grad():
            model.lm_head.weight.sub_(nudge)
        return first, second

    want = epochs(DecodeConfig(static=False))
    assert not static_calls
    got = epochs(DecodeConfig(static=True, sync_every=3))
    assert static_calls  # the continuations after the verified prefixes decoded on the static step
    for a, b in zip(got, want):
        assert a.response_ids == b.response_ids and a.verified_prefix_len == b.verified_prefix_len
    assert 0 < got[1].stats.accepted_tokens < got[1].stats.draft_tokens
