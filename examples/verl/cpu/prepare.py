"""Model and data for the offline verl trial: the demo policy and a parquet of the embedded arithmetic task.

    python examples/verl/cpu/prepare.py --out runs/verl-cpu --prompts 8

writes ``<out>/model`` (spec-rl's demo policy, a ~0.5M-parameter Qwen2 warm-started on worked
arithmetic solutions, built once and cached under ``$SPEC_RL_CACHE``; plus a chat template that
renders the prompt text unchanged, because verl's agent loops and dataset build prompts with
``apply_chat_template``), ``<out>/train.parquet`` (the first ``--prompts`` problems of
``spec_rl.tasks.demo_train_set()``) and ``<out>/val.parquet`` (``--val-prompts`` held-out
problems), in the layout verl's own GSM8K preprocessing example writes: ``prompt`` as chat
messages, ``data_source``, ``reward_model.ground_truth`` and ``extra_info.index``. Nothing is
downloaded.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

DATA_SOURCE = "spec_rl/arithmetic"
# The demo policy was trained on the prompt text itself (no chat markup): render it unchanged.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def write_model(out: Path) -> Path:
    """The demo policy (built or taken from the cache) copied to ``out`` with the chat template."""
    from spec_rl.tasks import build_demo_policy

    source = build_demo_policy(progress=False)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(source, out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return out


def rows(examples) -> list[dict]:
    """verl RL-dataset rows for spec-rl Examples (index = position; the uid is kept for reference)."""
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": e.prompt}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": e.answer},
            "extra_info": {"index": i, "uid": e.uid},
        }
        for i, e in enumerate(examples)
    ]


def write_parquet(path: Path, examples) -> Path:
    import pandas as pd

    pd.DataFrame(rows(examples)).to_parquet(path)
    return path


def main(argv: list[str] | None = None) -> None:
    from spec_rl.tasks import demo_eval_set, demo_train_set

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for model/, train.parquet, val.parquet")
    ap.add_argument("--prompts", type=int, default=8, help="training prompts (from demo_train_set)")
    ap.add_argument("--val-prompts", type=int, default=4, help="held-out prompts (from demo_eval_set)")
    args = ap.parse_args(argv)
    train, held_out = demo_train_set(), demo_eval_set()
    if not 1 <= args.prompts <= len(train):
        ap.error(f"--prompts must be in [1, {len(train)}], got {args.prompts}")
    if not 1 <= args.val_prompts <= len(held_out):
        ap.error(f"--val-prompts must be in [1, {len(held_out)}], got {args.val_prompts}")
    args.out.mkdir(parents=True, exist_ok=True)
    write_model(args.out / "model")
    write_parquet(args.out / "train.parquet", train[: args.prompts])
    write_parquet(args.out / "val.parquet", held_out[: args.val_prompts])
    print(f"wrote {args.out}/model, train.parquet ({args.prompts} prompts), val.parquet ({args.val_prompts})")


if __name__ == "__main__":
    main()
