"""Rollouts of a real checkpoint over several epochs with real GRPO updates between them, per mode and engine
(`make bench-real`; stage 8 of the GPU check, docs/gpu-check.md).

The same demo prompts (chat template when the tokenizer has one), T = 1, are rolled out every epoch by each mode on
each engine (the in-process transformers backend; the paged engine, which decodes ``--max-batch`` rows at once and
admits waiting samples as rows finish; spec-rl's vLLM backend when vLLM is installed), each mode with its own drafts.
Between epochs the policy takes one GRPO step (AdamW on a float32 master copy, under bf16 autocast when the
rollouts are in bf16, the rollout copy refreshed from it) on the first in-process engine's vanilla rollout (timed:
a full step is a rollout plus that update), rewarded by ``math+format``: every mode sees the same policies. vLLM's
own n-gram (and suffix, when offered) speculation run as peers.

Per row and epoch: generated tokens, decode steps, accepted share of draft tokens, responses reused whole,
rollout and scoring seconds, ratios to vanilla on the same engine, and the mean NLL of the row's samples under the
rollout model with a 95% bootstrap interval over sequences (a wrong sampler scores worse). After the last epoch, per
engine: scoring the drafts against prefilling the same tokens, exact's overhead over vanilla, and every mode's time
over the no-waste bound (scoring seconds + generated tokens x vanilla's seconds per generated token).
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402

from spec_rl.acceptance.mode import MODES, VANILLA, RolloutMode  # noqa: E402
from spec_rl.backends import eos_token_ids, fresh_jobs  # noqa: E402
from spec_rl.backends.paged import PagedEngine  # noqa: E402
from spec_rl.backends.scoring import response_logprobs  # noqa: E402
from spec_rl.backends.transformers_backend import TransformersBackend  # noqa: E402
from spec_rl.drafts.cache import RolloutCache  # noqa: E402
from spec_rl.drafts.history import HistoryIndex  # noqa: E402
from spec_rl.rollout.speculative import RolloutRequest, SpeculativeRollout  # noqa: E402
from spec_rl.sampling.distribution import SamplingSettings  # noqa: E402
from spec_rl.tasks.data import PromptFormat  # noqa: E402
from spec_rl.tasks.demo_data import demo_train_set  # noqa: E402
from spec_rl.tasks.rewards import get_reward_fn  # noqa: E402
from spec_rl.trainer import clipped_policy_loss, group_advantages, load_policy  # noqa: E402

#: The rows by default: mode names, each meaning what it means everywhere (any name RolloutMode.parse reads runs).
BENCH_MODES = ("vanilla", "l=1", "spec", "exact", "histspec")
#: vLLM's own speculation as peers (plain vLLM generation is the vllm engine's vanilla row).
PEERS = {
    "vllm ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
    "vllm suffix": {"method": "suffix", "num_speculative_tokens": 4},
}


def bootstrap_nll(nll_rows: list[torch.Tensor], resamples: int = 1000, seed: int = 0) -> tuple[float, float, float]:
    """Token-weighted mean NLL of the sequences and its 95% percentile bootstrap interval over sequences."""
    sums = torch.tensor([float(r.sum()) for r in nll_rows], dtype=torch.float64)
    counts = torch.tensor([r.numel() for r in nll_rows], dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    pick = torch.randint(len(nll_rows), (resamples, len(nll_rows)), generator=gen)
    means = sums[pick].sum(1) / counts[pick].sum(1).clamp(min=1)
    lo, hi = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return float(sums.sum() / counts.sum().clamp(min=1)), lo, hi


def sample_nll(model, prompts, responses, pad: int, settings: SamplingSettings, memo: dict) -> list[torch.Tensor]:
    """Per response, the negative sampling log-probs [len] float64 of its tokens under ``model``; ``memo`` holds
    those of the (prompt, response) pairs already scored under the same weights (rows that sampled alike, e.g.
    exact and histspec beside vanilla, are scored once)."""
    keys = [(tuple(p), tuple(r)) for p, r in zip(prompts, responses)]
    todo = list(dict.fromkeys(k for k in keys if k not in memo))
    with torch.no_grad():
        for start in range(0, len(todo), MICRO_BATCH):
            chunk = todo[start : start + MICRO_BATCH]
            lps = response_logprobs(model, [k[0] for k in chunk], [k[1] for k in chunk], pad, settings).double()
            memo.update({k: -lps[b, : len(k[1])].cpu() for b, k in enumerate(chunk)})
    return [memo[k] for k in keys]


def grpo_update(policy, optimizer, result, rewards, group: int, pad: int, settings: SamplingSettings) -> None:
    """One AdamW step of the clipped policy loss on ``result``'s responses with group advantages, accumulated over
    micro-batches of :data:`MICRO_BATCH` rows (the [rows, length, V] logits of a whole batch would not fit)."""
    device = next(policy.parameters()).device
    advantages = group_advantages(torch.tensor(rewards), group).to(device)
    padded = result.padded(pad, device)
    old, mask = padded["logprobs"], padded["response_mask"]
    total = int(mask.sum())
    policy.train()
    optimizer.zero_grad(set_to_none=True)
    for start in range(0, len(result.response_ids), MICRO_BATCH):
        rows = slice(start, start + MICRO_BATCH)
        responses = result.response_ids[rows]
        logprobs = response_logprobs(policy, result.prompt_ids[rows], responses, pad, settings)
        width = logprobs.shape[1]
        loss, _ = clipped_policy_loss(
            logprobs, old[rows, :width], advantages[rows], mask[rows, :width], num_tokens=total
        )
        loss.backward()
    optimizer.step()
    policy.eval()


#: Engines in this process: the first one's vanilla rollout drives the GRPO updates.
IN_PROCESS = ("transformers", "paged")

#: Rows per forward of the GRPO update.
MICRO_BATCH = 8


class Row:
    """One (engine, mode) of the benchmark: its backend, drafts and history, and its per-epoch records."""

    def __init__(self, name: str, engine: str, backend, mode, settings, eos: list[int], max_len: int):
        self.name, self.engine, self.backend, self.records, self.error = name, engine, backend, [], None
        mode = RolloutMode.parse(mode)
        history = HistoryIndex() if mode.tail else None
        self.rollout = SpeculativeRollout(
            backend, RolloutCache(), settings, eos, max_len, mode, seed=0, history=history
        )

    def run(self, requests, epoch: int):
        before = getattr(self.backend.stats, "capture_seconds", 0.0)
        t0 = time.perf_counter()
        result = self.rollout.run(requests, epoch)
        captured = getattr(self.backend.stats, "capture_seconds", 0.0) - before  # CUDA-graph captures: not rollout
        seconds = time.perf_counter() - t0 - captured
        s = result.stats
        self.records.append(
            {
                "epoch": epoch + 1,  # 1-based, as printed
                "generated_tokens": s.tokens_generated,
                "decode_steps": s.decode_steps,
                "draft_tokens": s.draft_tokens,
                "accepted_share": s.accepted_tokens / s.draft_tokens if s.draft_tokens else None,
                "reused_whole": s.full_reuse_count / s.num_samples,
                # mean |lp_new - lp_old| over reused tokens: how far the policy moved (the exact rule measures none)
                "drift": s.reused_drift,
                "rollout_seconds": seconds,
                "scoring_seconds": s.scoring_seconds,
                "capture_seconds_excluded": captured,
                "graph_steps": getattr(self.backend.stats, "graph_steps", None),
            }
        )
        return result


def warm_up(engines: dict, peers: dict, prompts, settings: SamplingSettings, tokens: int = 1) -> None:
    """``tokens`` untimed tokens per prompt and engine, at start (enough to decode: kernels compile and the batch's
    CUDA graphs are captured) and one after every weight reload (vLLM's prefix cache, reset by a reload, would
    otherwise serve the prompts to every mode but the one timed first)."""
    warm = SamplingSettings(temperature=settings.temperature, max_tokens=tokens)
    for name, backend in list(engines.items()) + list(peers.items()):
        try:
            backend.generate(fresh_jobs(prompts, [tokens] * len(prompts)), warm, 0)
        except Exception:
            if name in engines:
                raise  # a peer that fails is reported when its row runs


def resolve_dtype(name: str) -> torch.dtype:
    if name == "fp32":
        return torch.float32
    if name == "bf16":
        return torch.bfloat16
    cpu_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    return torch.bfloat16 if torch.cuda.is_available() or cpu_bf16 else torch.float32


def make_engines(args, rollout_model, tokenizer, eos, pad, max_len, workdir: Path) -> tuple[dict, dict]:
    """{engine name: backend} for the modes and {peer name: backend}; start seconds per engine in the record."""
    engines, peers, starts = {}, {}, {}
    for name in args.engines:
        t0 = time.perf_counter()
        if name == "transformers":
            engines[name] = TransformersBackend(rollout_model, set(eos), pad)
        elif name == "paged":  # continuous batching: more rows than --max-batch wait for freed ones
            engines[name] = PagedEngine(rollout_model, set(eos), pad, max_batch_size=args.max_batch)
        else:
            from spec_rl.backends.vllm_backend import VLLMBackend

            dtype = "bfloat16" if rollout_model.dtype == torch.bfloat16 else "float32"
            engines[name] = VLLMBackend(rollout_model, tokenizer, eos, pad, workdir / name, max_len, dtype=dtype)
            starts[name] = time.perf_counter() - t0
            for peer, spec in PEERS.items() if args.peers else ():
                t1 = time.perf_counter()
                try:
                    peers[peer] = VLLMBackend(
                        rollout_model,
                        tokenizer,
                        eos,
                        pad,
                        workdir / peer.replace(" ", "-"),
                        max_len,
                        dtype=dtype,
                        speculative_config=spec,
                    )
                    starts[peer] = time.perf_counter() - t1
                except Exception as err:  # a method this vLLM does not offer: reported, not fatal
                    starts[peer] = f"not available: {H.error_text(err, 120)}"
        starts.setdefault(name, time.perf_counter() - t0)
    return engines, peers, starts


def summarize(rows: list[Row], peers: list[Row], update_seconds: float = 0.0) -> list[dict]:
    """Per row, epochs 2+ summed: the ratios to vanilla on the same engine (the peers: to vllm vanilla); a full
    step is the rollout plus the mean GRPO update (``update_seconds``), the same for every mode."""
    by = {(r.engine, r.name): r for r in rows}
    out = []
    for r in rows + [p for p in peers if p.records]:
        later = r.records[1:] or r.records
        ref = by[(r.engine, VANILLA)].records
        ref_later = ref[1:] or ref
        tot = {k: sum(x[k] for x in later) for k in ("generated_tokens", "decode_steps", "rollout_seconds")}
        ref_tot = {k: sum(x[k] for x in ref_later) for k in tot}
        drafts = sum(x["draft_tokens"] for x in later)
        accepted = sum((x["accepted_share"] or 0) * x["draft_tokens"] for x in later)
        scoring = sum(x["scoring_seconds"] for x in later)
        per_token = ref_tot["rollout_seconds"] / max(ref_tot["generated_tokens"], 1)
        bound = scoring + tot["generated_tokens"] * per_token
        update = update_seconds * len(later)
        full = (
            (tot["rollout_seconds"] + update) / (ref_tot["rollout_seconds"] + update)
            if ref_tot["rollout_seconds"]
            else None
        )
        out.append(
            {
                "row": r.name,
                "engine": r.engine,
                **{f"{k}_ratio": tot[k] / ref_tot[k] if ref_tot[k] else None for k in tot},
                **tot,
                "accepted_share": accepted / drafts if drafts else None,
                "reused_whole": sum(x["reused_whole"] for x in later) / len(later),
                "scoring_seconds": scoring,
                "drift": _mean([x.get("drift") for x in later if x["draft_tokens"] and x.get("drift") is not None]),
                "over_no_waste_bound": tot["rollout_seconds"] / bound if bound else None,
                "full_step_seconds_ratio": full,
                "nll": r.nll,
            }
        )
    return out


def _mean(values: list) -> float | None:
    return sum(values) / len(values) if values else None


def _starts(starts: dict) -> str:
    """Engine start seconds (or why a peer did not start), one comma-separated line."""
    return ", ".join(f"{k} {v:.1f} s" if isinstance(v, float) else f"{k} {v}" for k, v in starts.items())


def prefill_seconds(backend, result, settings) -> float:
    """Seconds the engine takes to prefill [prompt, response without its last token] of every row of ``result`` and
    sample one token (the same positions as scoring the response, within the model length)."""
    contexts = [list(p) + list(r[:-1]) for p, r in zip(result.prompt_ids, result.response_ids)]
    t0 = time.perf_counter()
    one = SamplingSettings(temperature=settings.temperature, max_tokens=1)
    backend.generate(fresh_jobs(contexts, [1] * len(contexts)), one, 0)
    return time.perf_counter() - t0


def report(rec: dict) -> list[str]:
    """Epochs 2+ per engine and row (ratios to vanilla on the same engine), then the benchmark's own checks."""
    args = rec.get("args", {})
    starts = rec.get("engine_start_seconds", {})

    def nll(s):
        return s["nll"] and f"{s['nll'][0]:.3f} [{s['nll'][1]:.3f}, {s['nll'][2]:.3f}]"

    columns = [
        ("engine", "engine", "{}"),
        ("row", "row", "{}"),
        ("tokens x", "generated_tokens_ratio", "{:.3f}"),
        ("steps x", "decode_steps_ratio", "{:.3f}"),
        ("time x", "rollout_seconds_ratio", "{:.3f}"),
        ("full step x", "full_step_seconds_ratio", "{:.3f}"),
        ("accepted %", lambda s: s.get("accepted_share") and 100 * s["accepted_share"], "{:.1f}"),
        ("over bound", "over_no_waste_bound", "{:.3f}"),
        ("NLL [95%]", nll, "{}"),
    ]
    body = [
        f"Model {rec.get('model')} ({rec.get('dtype')}), {args.get('prompts')} prompts x G={args.get('group')}, "
        f"{args.get('max_tokens')} tokens, {args.get('epochs')} epochs, lr {args.get('lr')}, paged engine rows "
        f"{args.get('max_batch')}; engine starts: " + _starts(starts),
        "",
        *H.rows_table(columns, rec.get("summary", [])),
        "",
        "The targets (docs: scoring <= 1.1x prefill, a rejected mode <= 1.02x vanilla, <= 1.05x the no-waste bound):",
    ]
    body += [f"- {k}: {H.cell(v, '{:.3f}')}" for k, v in rec.get("targets", {}).items()]
    return H.section("Real-model rollouts (stage 8, bench_real_model.py)", rec, body)


def parse_args(argv):
    ap = H.arguments(__doc__, "real_model_rollout.json")
    ap.set_defaults(json=H.default_json_path("real_model_rollout.json") or "runs/real_model_rollout.json")
    ap.add_argument("--model", help="a local transformers checkpoint (default: SmolLM2-135M-Instruct, built offline)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=4, help="samples per prompt G")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--modes", default=",".join(BENCH_MODES), help="mode names (vanilla first; default: %(default)s)")
    ap.add_argument("--no-tail", action="store_true", help="no tail speculation in any row (every decode step static)")
    ap.add_argument(
        "--engines", default=None, help="transformers,paged,vllm (default: transformers and paged, vllm when installed)"
    )
    ap.add_argument("--max-batch", type=int, default=256, help="rows the paged engine decodes at once")
    ap.add_argument("--no-peers", dest="peers", action="store_false", help="no vLLM peer rows")
    ap.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto", help="auto: bf16 where supported")
    args = ap.parse_args(argv)
    H.positive(ap, args, "prompts", "group", "max_tokens", "epochs", "max_batch")
    H.positive(ap, args, "lr", low=0)
    args.modes = list(dict.fromkeys(m.strip() for m in args.modes.split(",") if m.strip()))
    args.modes.sort(key=lambda m: m != VANILLA)
    try:
        modes = {m: RolloutMode.parse(m) for m in args.modes}
    except ValueError as err:
        ap.error(f"--modes: {err}")
    if VANILLA not in modes:
        ap.error(f"--modes must include vanilla (every ratio is to it), got {args.modes}")
    args.modes = {m: dataclasses.replace(mode, tail=0) if args.no_tail else mode for m, mode in modes.items()}
    if args.engines is None:
        import importlib.util

        args.engines = ["transformers", "paged"] + (["vllm"] if importlib.util.find_spec("vllm") else [])
    else:
        args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
        if not args.engines or any(e not in IN_PROCESS + ("vllm",) for e in args.engines):
            ap.error(f"--engines takes transformers, paged and/or vllm, got {args.engines}")
    if not any(e in IN_PROCESS for e in args.engines):
        ap.error("--engines must include transformers or paged (an in-process vanilla rollout drives the updates)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.model is None:
        import real_model

        args.model = str(real_model.build())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        policy, tokenizer = load_policy(args.model, device)
    except FileNotFoundError as err:
        raise SystemExit(f"bench_real_model.py: --model: {err}") from None
    policy = policy.float().eval()  # the float32 master the optimizer steps; rollouts use a copy in --dtype
    dtype = resolve_dtype(args.dtype)
    rollout_model = copy.deepcopy(policy).to(dtype).eval()
    examples = demo_train_set()[: args.prompts]
    prompts = PromptFormat().encode(tokenizer, examples)
    eos = sorted(eos_token_ids(policy, tokenizer))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    settings = SamplingSettings(temperature=1.0, max_tokens=args.max_tokens)
    max_len = max(len(p) for p in prompts) + args.max_tokens
    requests = [RolloutRequest(p, s, dataset_id=e.uid) for p, e in zip(prompts, examples) for s in range(args.group)]
    reward_fn = get_reward_fn("math+format")
    golds = [e.answer for e in examples for _ in range(args.group)]
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    record = {
        "provenance": H.provenance(device),
        "model": args.model,
        "dtype": str(dtype).replace("torch.", ""),
        "settings": settings.to_dict(),
        "args": {k: v for k, v in vars(args).items() if k not in ("json", "modes")},
        "modes": {m: mode.to_dict() for m, mode in args.modes.items()},
        "timing": "rollout seconds exclude CUDA-graph captures (subtracted) and follow a warm-up that decodes",
    }
    run = H.RunRecord(args.json, record, report)
    with tempfile.TemporaryDirectory(prefix="bench-real-") as work:
        engines, peer_backends, starts = make_engines(args, rollout_model, tokenizer, eos, pad, max_len, Path(work))
        record["engine_start_seconds"], record["engines"] = starts, list(engines)
        print(
            f"model {args.model} ({record['dtype']}), {len(requests)} samples x {args.max_tokens} tokens, lr "
            f"{args.lr:g}; engine starts: " + _starts(starts)
        )
        rows = [
            Row(m, e, b, mode, settings, eos, max_len) for e, b in engines.items() for m, mode in args.modes.items()
        ]
        peers = [Row(p, "vllm", b, MODES["vanilla"], settings, eos, max_len) for p, b in peer_backends.items()]
        nll = {id(r): [] for r in rows + peers}
        warm_up(engines, peer_backends, prompts, settings, tokens=min(16, args.max_tokens))
        last = {}
        for epoch in range(args.epochs):
            results, scored = {}, {}
            for r in rows + [p for p in peers if p.error is None]:
                try:
                    results[id(r)] = result = r.run(requests, epoch)
                except Exception as err:  # a peer engine that fails mid-run is reported, not fatal
                    if r in rows:
                        raise
                    r.error = H.error_text(err, 160)
                    print(f"peer {r.name} failed: {r.error}", flush=True)
                    continue
                nlls = sample_nll(rollout_model, result.prompt_ids, result.response_ids, pad, settings, scored)
                nll[id(r)] += nlls
                rec = r.records[-1]
                rec["nll"] = bootstrap_nll(nlls)[0]
                ref = next(x for x in rows if x.engine == r.engine and x.name == VANILLA).records[-1]
                ratio = rec["rollout_seconds"] / ref["rollout_seconds"] if r.name != VANILLA else 1.0
                acc = "-" if rec["accepted_share"] is None else f"{rec['accepted_share']:.1%}"
                print(
                    f"epoch {epoch + 1} {r.engine if r in rows else 'vllm (peer)'} {r.name}: "
                    f"{rec['generated_tokens']} tokens, {rec['decode_steps']} steps, {rec['rollout_seconds']:.2f} s "
                    f"({ratio:.3f}x), accepted {acc}, scoring {rec['scoring_seconds']:.2f} s, NLL {rec['nll']:.3f}",
                    flush=True,
                )
            last = results
            record["rows"] = {
                f"{r.engine}/{r.name}" if r in rows else f"peer/{r.name}": r.records for r in rows + peers
            }
            run.save()  # an epoch's records are kept even if a later epoch fails
            if epoch + 1 < args.epochs:
                driver = next(r for r in rows if r.engine in IN_PROCESS and r.name == VANILLA)
                res = results[id(driver)]
                t0 = time.perf_counter()
                rewards = [
                    reward_fn(tokenizer.decode(t, skip_special_tokens=True), g) for t, g in zip(res.response_ids, golds)
                ]
                with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                    grpo_update(policy, optimizer, res, rewards, args.group, pad, settings)
                with torch.no_grad():
                    for dst, src in zip(rollout_model.parameters(), policy.parameters()):
                        dst.copy_(src)
                if device == "cuda":
                    torch.cuda.synchronize()
                record.setdefault("update_seconds", []).append(time.perf_counter() - t0)
                for b in list(engines.values()) + list(peer_backends.values()):
                    b.sync_weights()
                warm_up(engines, peer_backends, prompts, settings)
        for r in rows + peers:
            r.nll = bootstrap_nll(nll[id(r)]) if nll[id(r)] else None
        record["peer_errors"] = {p.name: p.error for p in peers if p.error}
        updates = record.get("update_seconds", [])
        record["summary"] = summarize(rows, peers, sum(updates) / len(updates) if updates else 0.0)
        targets = {}
        for engine, backend in engines.items():
            # the scoring pass of a rule that reads every draft position (lenient), against a prefill of its tokens
            rules = {r.name: args.modes[r.name].rule for r in rows}
            full = (r for r in rows if r.engine == engine and rules[r.name] and not rules[r.name].keyed_walk)
            spec_row = next(full, None)
            if spec_row is not None and args.epochs > 1:
                drafted = last[id(spec_row)]
                scoring = spec_row.records[-1]["scoring_seconds"]
                key = f"{engine}: scoring / prefill of the same tokens"
                try:
                    targets[key] = scoring / prefill_seconds(backend, drafted, settings)
                except Exception as err:  # reported, not fatal: the epochs' records are what matters
                    targets[key] = f"failed: {H.error_text(err, 160)}"
            for s in record["summary"]:  # lossless rules: what the responses of vanilla cost
                if s["engine"] == engine and rules.get(s["row"]) is not None and rules[s["row"]].lossless:
                    targets[f"{engine}: {s['row']} / vanilla rollout time"] = s["rollout_seconds_ratio"]
            for s in record["summary"]:
                if s["engine"] == engine and s["row"] in args.modes:
                    targets[f"{engine}: {s['row']} over the no-waste bound"] = s["over_no_waste_bound"]
        record["targets"] = targets
        for b in list(engines.values()) + [b for b in peer_backends.values() if b not in engines.values()]:
            close = getattr(b, "close", None)
            if close is not None:
                close()
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
