"""Stage 6 of the GPU check (docs/gpu-check.md): what reuse and tail speculation do to rollout TIME, without
training.

Epoch 1 (empty cache and history: ``FIRST_EPOCH``, each row the fastest of ``E1_REPEATS``), then ``HISTORY_EPOCHS``
vanilla rollouts fill the cache and the history, the policy is perturbed (``--perturb``) and ONE rollout step is
timed per mode of ``MODE_NAMES`` from copies of the same cache and history; lossless rows count the responses that
differ from plain decoding's. The paged engine on CUDA, ``TransformersBackend`` on the CPU. Exit 1 when a mode
raises.
"""

from __future__ import annotations

import copy
import math
import sys

import _harness as H  # benchmarks/ on sys.path
import torch
from _harness import RunRecord, sync

from spec_rl.acceptance.mode import MODES, RolloutMode
from spec_rl.backends.paged import PagedEngine
from spec_rl.backends.transformers_backend import TransformersBackend
from spec_rl.drafts.cache import RolloutCache
from spec_rl.drafts.history import HistoryIndex
from spec_rl.rollout.speculative import RolloutRequest, SpeculativeRollout
from spec_rl.sampling.distribution import SamplingSettings

# name: (prompts, group size, max tokens, dtype)
PRESETS = {"qwen3-0.6b": (64, 8, 512, torch.bfloat16), "tiny": (6, 2, 24, torch.float64)}
#: The measured modes (the trainer's); spec's lenience is ``--lenience``.
MODE_NAMES = ("vanilla", "histspec", "spec", "exact")
#: Vanilla rollouts that fill the cache and the history before the measured step; the rollouts' seed.
HISTORY_EPOCHS, SEED = 2, 0


def modes(lenience: float) -> dict[str, RolloutMode]:
    """The measured modes, name -> RolloutMode, with SPEC-RL's lenient rule at ``lenience``."""
    lenient = {"lenience": lenience}
    return {
        name: MODES[name].with_overrides(**lenient) if "lenience" in MODES[name].settable() else MODES[name]
        for name in MODE_NAMES
    }


def build(preset: str, device: torch.device, n_prompts: int | None = None):
    """(model, prompts as token lists, EOS ids, pad id) for a preset (``n_prompts``: default the preset's)."""
    default_prompts, _, _, dtype = PRESETS[preset]
    n_prompts = n_prompts or default_prompts
    if preset == "qwen3-0.6b":
        model = H.random_model(151936, device, dtype, qwen3=True, tie_word_embeddings=True, eos_token_id=151645)
    else:
        small = dict(hidden_size=32, intermediate_size=64, max_position_embeddings=128, eos_token_id=1)
        model = H.random_model(64, device, dtype, **small)
    with torch.no_grad():  # random weights sample near-uniform text; a sharper head gives text with structure
        model.get_output_embeddings().weight.mul_(4.0)
    cfg = model.config
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(2, cfg.vocab_size, (n_prompts, 32 if preset != "tiny" else 6), generator=gen).tolist()
    return model, prompts, [cfg.eos_token_id], 0


def perturb(model, scale: float, seed: int = 7) -> None:
    """Relative Gaussian noise on every weight: the policy that scores the drafts is not the one that sampled them."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)
            p.add_(noise * p.detach().float().std().to(p.dtype) * scale)


def timed_step(rollout: SpeculativeRollout, requests, step: int, device) -> dict:
    sync(device)
    res = rollout.run(requests, step)
    sync(device)
    s = res.stats
    return {
        "generated_tokens": s.tokens_generated,
        "decode_steps": s.decode_steps,
        "longest": s.longest_continuation,
        "rollout_s": s.rollout_seconds,
        "scoring_s": s.scoring_seconds,
        "decode_s": s.generation_seconds,
        "other_s": s.assembly_seconds,
        "full_reuse": s.full_reuse_ratio,
        "tail_accept": s.tail_accepted / max(s.tail_proposed, 1),
        "positions": s.decode_positions,
        "accepted_per_step": s.tail_accepted / max(s.decode_steps, 1),
        "width": s.decode_positions / max(s.decode_rows, 1),
        RESPONSES: res.response_ids,
    }


#: Key of a row's responses while the run compares them; dropped before the JSON is written.
RESPONSES = "_responses"
#: Rows whose responses must equal their reference's (lossless), compared as ``differs``: how many differ.
#: Under float32 a rounding difference can flip a sample; float64 tests assert 0.
LOSSLESS = {"e1-histspec": "e1-vanilla", "histspec": "vanilla", "exact": "vanilla"}


def count_differences(rows: dict) -> None:
    """Set ``differs`` (responses unlike the reference's) on every lossless row, then drop the responses."""
    for name, ref in LOSSLESS.items():
        if RESPONSES in rows.get(name, {}) and RESPONSES in rows.get(ref, {}):
            rows[name]["differs"] = sum(a != b for a, b in zip(rows[name][RESPONSES], rows[ref][RESPONSES]))
    for row in rows.values():
        row.pop(RESPONSES, None)


#: Epoch-1 rows: name -> mode (no drafts; tail speculation over an empty history or none). ``e1-histspec`` is what
#: every speculative mode does in its first epoch (nothing to draft: it must cost what vanilla costs).
E1_REPEATS = 3
FIRST_EPOCH = {"e1-warmup": MODES["histspec"], "e1-vanilla": MODES["vanilla"], "e1-histspec": MODES["histspec"]}


def first_epoch_rows(backend, requests, settings, eos, max_len, args, device, rec: RunRecord) -> None:
    """Epoch 1 (empty cache, empty history): plain decoding and the speculative modes' first epoch."""
    e1 = rec.record["rows"]
    # One epoch-1 rollout varies by ~10% from run to run on a busy host: the rows are timed in turn
    # ``E1_REPEATS`` times and each keeps its fastest (the decisions are keyed: every repeat is the same).
    for rep in range(E1_REPEATS):
        for name, mode in FIRST_EPOCH.items():
            if name == "e1-warmup" and rep:
                continue
            ro = SpeculativeRollout(backend, RolloutCache(), settings, eos, max_len, mode=mode, seed=SEED)
            row = timed_step(ro, requests, 0, device)
            print(_show(name, row), flush=True)
            if name != "e1-warmup" and (name not in e1 or row["rollout_s"] < e1[name]["rollout_s"]):
                e1[name] = row
                rec.save()


def _show(name: str, r: dict) -> str:
    if "error" in r:
        return f"  {name:<9} {r['error']}"
    return (
        f"  {name:<9} {r['generated_tokens']} tokens, {r['decode_steps']} decode steps, "
        f"{r['rollout_s']:.3f} s (scoring {r['scoring_s']:.3f}, decode {r['decode_s']:.3f})"
    )


def rollout_setup(args, rec: RunRecord):
    """The preset's model and backend (sizes and backend recorded in ``rec``): (backend, requests, sampling
    settings, EOS ids, max_len), the requests being G samples of every prompt."""
    device = torch.device(rec.record["device_type"])
    model, prompts, eos, pad = build(args.preset, device, args.prompts)
    _, group, max_tokens, _ = PRESETS[args.preset]
    group, max_tokens = args.group or group, args.max_tokens or max_tokens
    rec.record.update(prompts=len(prompts), group=group, max_tokens=max_tokens)
    settings = SamplingSettings(temperature=1.0, max_tokens=max_tokens)
    requests = [RolloutRequest(p, s, dataset_id=f"p{i}") for i, p in enumerate(prompts) for s in range(group)]
    max_len = max(len(p) for p in prompts) + max_tokens + 1
    backend = (PagedEngine if device.type == "cuda" else TransformersBackend)(model, eos, pad)
    rec.record["backend"] = type(backend).__name__
    return backend, requests, settings, eos, max_len


def run(args, rec: RunRecord) -> None:
    """Fill the history, perturb the policy, then one timed step per mode into ``rec.record["rows"]``."""
    device = torch.device(rec.record["device_type"])
    backend, requests, settings, eos, max_len = rollout_setup(args, rec)
    first_epoch_rows(backend, requests, settings, eos, max_len, args, device, rec)
    cache, history = RolloutCache(), HistoryIndex()
    filler = SpeculativeRollout(
        backend, cache, settings, eos, max_len, mode=MODES["histspec"], seed=SEED, history=history
    )
    for step in range(HISTORY_EPOCHS):
        filler.run(requests, step)
    perturb(backend.model, args.perturb)
    rows = rec.record["rows"]
    measured = modes(args.lenience)
    for name, mode in [("warm-up", measured["spec"]), *measured.items()]:  # one untimed step first (allocations, JIT)

        def step(mode=mode):
            drafts, hist = copy.deepcopy(cache), copy.deepcopy(history) if mode.tail else None
            ro = SpeculativeRollout(backend, drafts, settings, eos, max_len, mode=mode, seed=SEED, history=hist)
            return timed_step(ro, requests, HISTORY_EPOCHS, device)

        row = H.guarded(rec, f"mode {name}", step)
        print(_show(name, row), flush=True)
        if name != "warm-up":
            rows[name] = row
            rec.save()
    count_differences(rows)
    for name, r in rows.items():  # ratios to vanilla (the epoch-1 rows: to epoch 1's)
        base = rows.get("e1-vanilla" if name.startswith("e1-") else "vanilla", {})
        for k in ("generated_tokens", "decode_steps", "rollout_s"):
            if k in r:
                r[f"{k}_ratio"] = r[k] / base[k] if base.get(k) else float("nan")
    rec.save()


def report(rec: dict) -> list[str]:
    """One rollout step per mode at fixed drafts (the epoch-1 rows first)."""
    columns = [
        ("mode", "name", "{}"),
        ("generated tokens", "generated_tokens", "{}"),
        ("decode steps", "decode_steps", "{}"),
    ]
    columns += [(f"{k} s", f"{k}_s", "{:.3f}") for k in ("rollout", "scoring", "decode", "other")]
    columns += [
        (f"{h} x", f"{k}_ratio", "{:.3f}")
        for h, k in (("tokens", "generated_tokens"), ("steps", "decode_steps"), ("time", "rollout_s"))
    ]
    columns += [
        ("tail acceptance", "tail_accept", "{:.2f}"),
        ("positions", "positions", "{}"),
        ("accepted / step", "accepted_per_step", "{:.2f}"),
        ("width", "width", "{:.2f}"),
        ("differs", "differs", "{}"),
    ]
    head = (
        f"Preset {rec.get('preset')}: {rec.get('prompts')} prompts x G={rec.get('group')}, {rec.get('max_tokens')} "
        f"tokens, {rec.get('backend')}, perturb {rec.get('perturb')}, l = {rec.get('lenience'):.4g}, "
        f"{HISTORY_EPOCHS} history epochs."
    )
    rows = [{"name": name, **r} for name, r in rec.get("rows", {}).items()]
    return H.section("Rollout (stage 6, bench_rollout.py)", rec, [head, ""] + H.rows_table(columns, rows))


def main(argv=None) -> int:
    ap = H.arguments(__doc__, "rollout.json", "default: cuda if available, else cpu")
    ap.add_argument("--preset", choices=list(PRESETS), default="qwen3-0.6b")
    ap.add_argument("--perturb", type=float, default=0.02, help="relative weight noise before the measured step")
    ap.add_argument("--prompts", type=int, default=None, help="prompts (default: the preset's)")
    ap.add_argument("--group", type=int, default=None, help="samples per prompt G (default: the preset's)")
    ap.add_argument("--max-tokens", type=int, default=None, help="response budget (default: the preset's)")
    ap.add_argument("--lenience", type=float, default=math.exp(0.5), help="l of spec's lenient rule (default e^0.5)")
    args = ap.parse_args(argv)
    try:
        modes(args.lenience)
    except ValueError as exc:  # its message starts with the field's name, "lenience"
        ap.error(f"--{exc}")
    H.positive(ap, args, "prompts", "group", "max_tokens")
    H.positive(ap, args, "perturb", low=0)
    device = H.device_arg(ap, args.device)
    if args.preset == "qwen3-0.6b" and device.type != "cuda":
        print("bench_rollout: the qwen3-0.6b preset needs a CUDA device; nothing was measured")
        return 0
    record = {
        "preset": args.preset,
        "perturb": args.perturb,
        "lenience": args.lenience,
        "history_epochs": HISTORY_EPOCHS,
        "device_type": device.type,
        "rows": {},
        **H.provenance(device),
    }
    rec = RunRecord(args.json, record, report)
    return H.run_recorded(rec, lambda: run(args, rec))


if __name__ == "__main__":
    sys.exit(main())
