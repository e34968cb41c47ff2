"""How much of last epoch's response survives one GRPO step on a real instruct model, per acceptance rule.

SmolLM2-135M-Instruct (benchmarks/real_model.py) samples 16 of the demo's word problems x 4 (chat template,
T = 1, 128 tokens); one GRPO step (reward ``math+format``, AdamW) at each learning rate moves the policy; the
step-0 responses are then verified as drafts under the moved policy with exact acceptance and the lenient rule
at l = 1 and l = e^0.5. Prints the accepted share of draft tokens, the full-reuse share and the mean
|lp_new - lp_old| over draft tokens per (lr, rule); ``--json`` keeps the record.
"""

from __future__ import annotations

import copy
import sys
import tempfile
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402
import real_model  # noqa: E402

from spec_rl.acceptance.dispatch import VerifyOptions, verify_logprobs  # noqa: E402
from spec_rl.acceptance.mode import MODES  # noqa: E402
from spec_rl.backends.scoring import response_logprobs  # noqa: E402
from spec_rl.drafts.cache import CacheKey  # noqa: E402
from spec_rl.sampling.distribution import SamplingSettings  # noqa: E402
from spec_rl.tasks.demo_data import demo_train_set  # noqa: E402
from spec_rl.tasks.rewards import get_reward_fn  # noqa: E402
from spec_rl.trainer import GRPOConfig, GRPOTrainer  # noqa: E402
from spec_rl.trainer.run import load_policy  # noqa: E402

RULES = ("exact", "l=1", "l=e^0.5")


def main(argv=None) -> int:
    ap = H.arguments(__doc__, "real_model_acceptance.json")
    ap.add_argument("--lrs", default="1e-6,1e-5,1e-4", help="comma-separated learning rates of the one GRPO step")
    args = ap.parse_args(argv)
    base, tokenizer = load_policy(real_model.build())
    examples = demo_train_set()[:16]
    settings = SamplingSettings(temperature=1.0, max_tokens=128)
    record = {"provenance": H.provenance("cpu"), "model": "SmolLM2-135M-Instruct", "settings": settings.to_dict()}
    rows = []
    for lr in H.numbers(ap, "--lrs", args.lrs, float):
        config = GRPOConfig(
            mode=MODES["spec"],  # stores the step-0 responses as drafts
            sampling=settings,
            group_size=4,
            prompts_per_step=len(examples),
            lr=lr,
            micro_batch_size=8,
            ppo_mini_batches=1,
            save_checkpoint=False,
            seed=0,
        )
        model = copy.deepcopy(base)
        with tempfile.TemporaryDirectory() as out:
            trainer = GRPOTrainer(model, tokenizer, examples, get_reward_fn("math+format"), config, out, progress=False)
            step = trainer.train_step(range(len(examples)), epoch=0)  # the same step-0 sample for every lr
        samples = [(i, s) for i in range(len(examples)) for s in range(4)]
        keys = [CacheKey.make(trainer.prompt_ids[i], s, examples[i].uid) for i, s in samples]
        drafts = [trainer.cache.lookup(k, settings) for k in keys]
        ids = pad_sequence([d.token_ids.long() for d in drafts], batch_first=True)
        old = pad_sequence([d.logprobs.float() for d in drafts], batch_first=True)
        lengths = torch.tensor([len(d.token_ids) for d in drafts])
        mask = torch.arange(ids.shape[1]) < lengths[:, None]
        prompts = [trainer.prompt_ids[i] for i, _ in samples]
        with torch.no_grad():
            responses = [d.token_ids.tolist() for d in drafts]
            new = response_logprobs(model, prompts, responses, tokenizer.pad_token_id, settings).float().cpu()
        new = new[:, : ids.shape[1]]
        drift = float((new - old)[mask].abs().mean())
        uids = torch.tensor([k.uid for k in keys])
        for name in RULES:
            options = VerifyOptions(mode=name, backend="reference")
            result = verify_logprobs(ids, old, new, lengths, seed=1, uids=uids, options=options)
            rows.append(
                {
                    "lr": lr,
                    "rule": name,
                    "accepted_share": float(result.accepted_len.sum() / lengths.sum()),  # of the draft tokens
                    "full_reuse": float(result.full_reuse.float().mean()),  # drafts reused whole
                    "drift": drift,
                    "groups_with_signal": step["groups"] - step["flat_groups"],
                    "draft_tokens": int(mask.sum()),
                }
            )
    record["rows"] = rows
    columns = [
        ("lr", "lr", "{:g}"),
        ("rule", "rule", "{}"),
        ("accepted share", "accepted_share", "{:.1%}"),
        ("reused whole", "full_reuse", "{:.1%}"),
        ("drift (nats/token)", "drift", "{:.4f}"),
        ("groups with signal", "groups_with_signal", "{}"),
    ]
    print("\n".join(H.rows_table(columns, rows)))
    H.write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
