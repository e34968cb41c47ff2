"""PagedEngine vs plain transformers forwards on tiny fp32 models (CPU).

Greedy decoding is run as top_k=1 sampling (the engine only samples; top_k=1
leaves a single token in the support). References are argmax loops over plain
full forwards and float64 log-softmax of a full forward.
"""

import warnings

import pytest
import torch
from backend_jobs import continue_rows, generate
from block_checks import check_invariants
from engine_models import FAMILIES, greedy_reference, tiny_family_model
from tiny_models import full_forward_logprobs

from spec_rl.backends.paged import OutOfBlocks, PagedEngine
from spec_rl.backends.paged.static_decode import DecodeConfig
from spec_rl.backends.scoring import PolicyScorer
from spec_rl.sampling.distribution import SamplingSettings

warnings.filterwarnings("ignore", message="spec_rl._C is not built")

PROMPTS = [[3, 11, 12, 13, 14], [3, 15, 16], [3, 17, 18, 19, 20, 21, 22, 23, 24, 25], [4]]
GREEDY = SamplingSettings(temperature=1.0, top_k=1, max_tokens=256)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_plain_forward_for_64_steps(family):
    model = tiny_family_model(family, seed=3)
    engine = PagedEngine(model, eos_ids={1}, pad_id=0, block_size=4, num_blocks=128)
    outs = generate(engine, PROMPTS, [70] * len(PROMPTS), GREEDY, seed=0)
    for p, out in zip(PROMPTS, outs):
        ref = greedy_reference(model, p, 70, eos_ids={1})
        assert out.token_ids == ref
        assert out.finish_reason == ("eos" if ref[-1] == 1 else "length")
        assert all(lp == 0.0 for lp in out.logprobs)  # top_k=1: probability one
    assert max(len(o.token_ids) for o in outs) >= 64
    assert engine.blocks.num_free == engine.blocks.num_blocks  # everything released


@pytest.mark.parametrize("family", FAMILIES)
def test_sampled_logprobs_match_full_forward(family):
    model = tiny_family_model(family, seed=4)
    engine = PagedEngine(model, eos_ids={1}, pad_id=0, block_size=4, num_blocks=64)
    settings = SamplingSettings(temperature=0.7, max_tokens=24)
    outs = generate(engine, PROMPTS, [24, 5, 24, 10], settings, seed=11)
    for p, out, budget in zip(PROMPTS, outs, [24, 5, 24, 10]):
        assert 1 <= len(out.token_ids) <= budget
        ref = full_forward_logprobs(model, p, out.token_ids, temperature=0.7)
        assert torch.allclose(torch.tensor(out.logprobs, dtype=torch.float64), ref, atol=1e-4)


def test_plain_forward_unchanged_after_engine_use():
    model = tiny_family_model("qwen2", seed=5)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8], [3, 9, 10, 11, 12, 13]])
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    impl = model.config._attn_implementation
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
    engine = PagedEngine(model, eos_ids={1}, pad_id=0, block_size=4, num_blocks=32)
    generate(engine, PROMPTS, [8] * 4, SamplingSettings(max_tokens=8), seed=0)
    engine.score(PROMPTS[:2], [[5, 6], [7]])  # scored rows left unused must not matter
    assert model.config._attn_implementation == impl
    with torch.no_grad():
        after = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(before, after)


def test_identical_contexts_share_prompt_blocks_and_diverge():
    model = tiny_family_model("llama", seed=6)
    engine = PagedEngine(model, eos_ids={1}, pad_id=0, block_size=4, num_blocks=64)
    ctx = [3, 11, 12, 13, 14, 15]  # 6 tokens: one full block + a shared partial block
    settings = SamplingSettings(temperature=1.5, max_tokens=16)
    outs = generate(engine, [ctx] * 4 + [PROMPTS[1]], [16] * 5, settings, seed=3)
    assert engine.stats.prefill_tokens == len(ctx) + len(PROMPTS[1])  # the group was prefilled once
    assert engine.stats.shared_prefill_tokens == 3 * len(ctx)
    assert engine.stats.cow_copies >= 3  # the shared partial block was copied as members diverged
    assert len({tuple(o.token_ids) for o in outs[:4]}) > 1
    for o, c in zip(outs, [ctx] * 4 + [PROMPTS[1]]):
        ref = full_forward_logprobs(model, c, o.token_ids, temperature=1.5)
        assert torch.allclose(torch.tensor(o.logprobs, dtype=torch.float64), ref, atol=1e-4)
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_out_of_blocks_schedules_the_rest_and_gives_the_same_tokens():
    model = tiny_family_model("qwen2", seed=7)
    prompts = [[3, 11 + i, 12, 13, 14, 15, 16, 17] for i in range(6)]
    big = PagedEngine(model, eos_ids={1}, pad_id=0, block_size=4, num_blocks=256)
    # 8 + 20 tokens need 7 blocks per sequence: with 10 blocks only one runs at a time.
    small = PagedEngine(model, eos_ids={1}, pad_id=0, block_size=4, num_blocks=10, max_batch_size=4)
    settings = SamplingSettings(temperature=1.0, top_k=1, max_tokens=20)
    ref = generate(big, prompts, [20] * 6, settings, seed=0)
    got = generate(small, prompts, [20] * 6, settings, seed=0)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert small.stats.forwards > big.stats.forwards  # it really ran in several waves
    assert small.blocks.num_free == 10
    with pytest.raises(OutOfBlocks, match="num_blocks"):
        generate(small, [list(range(3, 30))], [40], settings, seed=0)  # 66 tokens can never fit in 40 slots
    assert small.blocks.num_free == 10
    check_invariants(small.blocks)


def test_score_drafts_matches_policy_scorer():
    model = tiny_family_model("qwen3", seed=8)
    drafts = [[4, 5, 6], [7], [8, 9, 10, 2, 12, 13], [5, 5]]
    engine = PagedEngine(model, eos_ids={1}, pad_id=0, block_size=4, num_blocks=64)
    handle = engine.score(PROMPTS, drafts)
    scores = handle.scores
    ref = PolicyScorer(model, pad_id=0).score(PROMPTS, drafts)
    for b, d in enumerate(drafts):
        rows = torch.full((len(d),), b)
        cols = torch.arange(len(d))
        assert torch.allclose(scores.logits_at(rows, cols), ref.logits_at(rows, cols), atol=1e-4)
    assert engine.stats.scoring_tokens == sum(len(p) + len(d) for p, d in zip(PROMPTS, drafts))
    engine.release(handle)
    assert engine.blocks.num_free == 64


def test_stats_are_backend_stats_and_count_every_generation_forward():
    from spec_rl.backends.base import Backend, BackendStats

    model = tiny_family_model("qwen2", seed=8)
    engine = PagedEngine(model, eos_ids={1}, pad_id=0, block_size=4, num_blocks=64)
    assert isinstance(engine, Backend) and isinstance(engine.stats, BackendStats)
    generate(engine, PROMPTS, [6] * len(PROMPTS), SamplingSettings(max_tokens=6), seed=0)
    assert engine.stats.decode_steps == engine.stats.forwards  # one prefill wave + the decode steps
    handle = engine.score(PROMPTS, [[5, 6]] * len(PROMPTS))
    assert engine.stats.decode_steps == engine.stats.forwards - 1  # the scoring forward is not a decode step
    engine.release(handle)
    engine.runner.stats = type(engine.stats)()  # counters from here on
    assert engine.stats.to_dict() == dict.fromkeys(engine.stats.to_dict(), 0)


def test_bad_arguments():
    model = tiny_family_model("qwen2")
    with pytest.raises(ValueError, match="eos_ids"):
        PagedEngine(model, eos_ids=set(), pad_id=0)
    engine = PagedEngine(model, eos_ids={1}, pad_id=0, num_blocks=8)
    with pytest.raises(ValueError, match=r"jobs\[0\]\.context is empty"):
        generate(engine, [[]], [3], GREEDY, seed=0)
    with pytest.raises(ValueError, match=r"jobs\[0\]\.budget must be >= 0, got -1"):
        generate(engine, [[3]], [-1], GREEDY, seed=0)
    assert generate(engine, [[3]], [0], GREEDY, seed=0)[0].finish_reason == "length"
    handle = engine.score([[3, 4]], [[5, 6]])
    with pytest.raises(ValueError, match=r"jobs\[0\]\.cut\.n must be <= 2, got 3"):
        continue_rows(engine, handle, [3], [7], [2], GREEDY, seed=0)
    assert engine.blocks.num_free == 8  # the scored rows were released on the error
    handle = engine.score([[3, 4]], [[5, 6]])
    generate(engine, [[3]], [1], GREEDY, seed=0)
    with pytest.raises(ValueError, match="stale"):
        continue_rows(engine, handle, [1], [7], [2], GREEDY, seed=0)
    assert engine.blocks.num_free == 8
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        use_sliding_window=True,
        sliding_window=4,
    )
    with pytest.raises(ValueError, match="sliding-window"):
        PagedEngine(Qwen2ForCausalLM(cfg), eos_ids={1}, pad_id=0)


def paged_kernel_device():
    """(device where spec_rl.kernels' paged decode attention can run here, or None, and why not).

    CPU tensors need the Triton interpreter (the CPU suite's conftest sets TRITON_INTERPRET=1); on a
    CUDA machine the kernels are compiled and take CUDA tensors only, so the test runs there on CUDA.
    """
    try:
        from spec_rl import kernels
    except ImportError as exc:
        return None, f"spec_rl.kernels is not importable ({exc})"
    if not hasattr(kernels, "paged_decode_attention"):
        return None, "spec_rl.kernels has no paged_decode_attention"
    if kernels.is_available("cpu"):
        return "cpu", ""
    if torch.cuda.is_available() and not kernels.INTERPRET:
        return "cuda", ""
    return None, "the Triton kernels run neither here on CPU (no TRITON_INTERPRET=1) nor on a CUDA device"


def test_decode_through_the_triton_paged_kernel_matches_the_gather_path():
    # The engine decodes with spec_rl.kernels.paged_decode_attention on CUDA; the same call runs under the
    # Triton interpreter on CPU, so the GPU wiring (argument order, int32 lengths) is
    # exercised on both. Same model, same seed: the kernel path and the gather + SDPA path agree.
    device, why = paged_kernel_device()
    if device is None:
        pytest.skip(why)
    from spec_rl import kernels

    model = tiny_family_model("qwen3", seed=6).to(device)
    prompts = [[3, 11, 12, 13, 14], [3, 15, 16], [4]]
    settings = SamplingSettings(temperature=0.8, max_tokens=6)
    packed = DecodeConfig(static=False)  # one kernel call per layer and step (on CUDA the static step is the default)
    plain = PagedEngine(model, eos_ids={1}, pad_id=0, block_size=4, num_blocks=32, decode=packed)
    triton = PagedEngine(model, eos_ids={1}, pad_id=0, block_size=4, num_blocks=32, decode=packed)
    calls = []

    def counted(*args, **kwargs):
        calls.append((args[0].device.type, kwargs))
        return kernels.paged_decode_attention(*args, **kwargs)

    plain.runner.decode_kernel = None  # gather + SDPA (on CUDA the engine would pick the kernel itself)
    triton.runner.decode_kernel = counted
    want = generate(plain, prompts, [6, 6, 6], settings, seed=5)
    got = generate(triton, prompts, [6, 6, 6], settings, seed=5)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4)
    # 5 decode steps x 2 layers went through the kernel, on the model's device.
    assert len(calls) == 5 * model.config.num_hidden_layers
    assert all(dev == device for dev, _ in calls)


def test_paged_kernel_test_picks_a_device_the_kernels_run_on(tmp_path):
    """The kernel test above must never hand CPU tensors to compiled kernels (a CUDA machine has no
    TRITON_INTERPRET): run it the way the GPU check does, with the kernels compiled, on this machine."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0"}  # conftest only sets it when unset: the kernels get compiled
    test = f"{__file__}::test_decode_through_the_triton_paged_kernel_matches_the_gather_path"
    # cwd outside the checkout: `python -m` puts the cwd first on sys.path, and the source tree's spec_rl/
    # (without spec_rl.kernels) must not shadow the installed package.
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", test],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    if torch.cuda.is_available():
        assert "1 passed" in out.stdout, out.stdout[-3000:]
    else:
        assert "1 skipped" in out.stdout and "nor on a CUDA device" in out.stdout, out.stdout[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_engine_matches_plain_forward(family):
    # The GPU path: CUDA paged KV ops (spec_rl._C) and the Triton decode kernel.
    model = tiny_family_model(family, seed=3).cuda()
    engine = PagedEngine(model, eos_ids={1}, pad_id=0, block_size=16, num_blocks=64)
    assert engine.runner.decode_kernel is not None
    outs = generate(engine, PROMPTS, [40] * len(PROMPTS), GREEDY, seed=0)
    for p, out in zip(PROMPTS, outs):
        ids, ref = list(p), []
        with torch.no_grad():
            for _ in range(len(out.token_ids)):
                t = int(model(input_ids=torch.tensor([ids], device="cuda")).logits[0, -1].argmax())
                ref.append(t)
                ids.append(t)
        assert out.token_ids == ref
    settings = SamplingSettings(temperature=0.7, max_tokens=24)
    outs = generate(engine, PROMPTS, [24] * len(PROMPTS), settings, seed=11)
    for p, out in zip(PROMPTS, outs):
        ids = torch.tensor([list(p) + out.token_ids], device="cuda")
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].double()
        rows = logits[len(p) - 1 : len(p) - 1 + len(out.token_ids)] / 0.7
        ref = (
            torch.log_softmax(rows, -1).gather(-1, torch.tensor(out.token_ids, device="cuda").unsqueeze(-1)).squeeze(-1)
        )
        assert torch.allclose(torch.tensor(out.logprobs, dtype=torch.float64), ref.cpu(), atol=1e-4)
