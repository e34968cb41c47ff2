"""GRPO with TRL, rollouts by spec-rl: a complete, runnable script (offline; CPU is enough).

    python examples/trl_grpo.py                      # the demo policy (built once, ~1.5 min, cached)
    python examples/trl_grpo.py --model PATH         # a local transformers checkpoint (with its tokenizer)
    python examples/trl_grpo.py --model tiny         # a tiny random model: seconds, for a smoke test
    python examples/trl_grpo.py --mode vanilla       # the same decoder with reuse off: the fair baseline
    python examples/trl_grpo.py --mode l=1-excl      # l = 1, the without-draft draw: the demo trainer's SPEC-RL rule
    python examples/trl_grpo.py --mode exact         # lossless reuse

Trains ``--epochs`` epochs over ``--prompts`` problems of the embedded arithmetic task (GSM8K format)
and prints, per epoch, how many completion tokens were reused from last epoch's drafts and how many
were generated. TRL's ``rollout_func`` hook is marked experimental by TRL (set
TRL_EXPERIMENTAL_SILENCE=1 to hide its warning); spec-rl is tested with trl 1.0-1.16.

TRL's logged ``reward`` is the rollout's reward, biased upward under reuse (reused completions lean
towards ones that were already correct); compare runs on an ``eval_dataset`` instead (fresh samples).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def load_policy(name: str):
    """(model, tokenizer) for ``--model``: "demo", "tiny" or a local checkpoint directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name == "tiny":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        from spec_rl.tasks.demo_data import demo_train_set
        from spec_rl.tasks.demo_tokenizer import build_demo_tokenizer

        tok = build_demo_tokenizer([e.prompt for e in demo_train_set()[:64]], vocab_size=300, model_max_length=256)
        cfg = Qwen2Config(
            vocab_size=len(tok),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            tie_word_embeddings=False,
        )
        return Qwen2ForCausalLM(cfg), tok
    if name == "demo":
        from spec_rl.tasks.demo_policy import build_demo_policy

        name = str(build_demo_policy())
    if not Path(name).is_dir():
        raise SystemExit(f"--model must be 'demo', 'tiny' or a local checkpoint directory; {name!r} is not a directory")
    return AutoModelForCausalLM.from_pretrained(name), AutoTokenizer.from_pretrained(name)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help="'demo' (default), 'tiny' or a local checkpoint directory")
    p.add_argument("--out", default="runs/trl-grpo", help="TRL output_dir (checkpoints, the rollout cache)")
    p.add_argument("--prompts", type=int, default=32, help="training problems (default 32)")
    p.add_argument("--epochs", type=int, default=3, help="epochs over them (default 3)")
    p.add_argument("--num-generations", type=int, default=4, help="GRPO group size (default 4)")
    p.add_argument("--max-completion-length", type=int, default=96, help="response budget in tokens (default 96)")
    p.add_argument(
        "--mode",
        default="spec",
        help="spec: SPEC-RL at the paper's e^0.5 (default); vanilla: no reuse, same decoder; exact: lossless reuse; "
        "random: random reuse; l=<lenience>[-excl]: the lenient rule at that l (-excl: the without-draft draw)",
    )
    args = p.parse_args(argv)
    if args.prompts < 1 or args.epochs < 1 or args.num_generations < 2:
        p.error("--prompts and --epochs must be >= 1 and --num-generations >= 2")

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from spec_rl.integrations.trl import SpecRLRollout, check_trainer_args
    from spec_rl.tasks.demo_data import demo_train_set
    from spec_rl.tasks.rewards import math_reward

    try:  # the adapter's own checks (e.g. an unknown mode), as one usage line
        spec = SpecRLRollout(args.mode, dataset_id_column="id", cache_path=Path(args.out) / "spec_rl_cache.safetensors")
    except ValueError as exc:
        p.error(str(exc))
    model, tok = load_policy(args.model)
    problems = demo_train_set()[: args.prompts]
    data = Dataset.from_dict(
        {
            "prompt": [e.prompt for e in problems],
            "answer": [e.answer for e in problems],
            "id": [e.uid for e in problems],
        }
    )

    def reward(completions, answer, **kwargs):  # TRL passes dataset columns by name
        return [math_reward(c, a) for c, a in zip(completions, answer)]

    config = GRPOConfig(
        output_dir=args.out,
        use_cpu=True,
        bf16=False,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        per_device_train_batch_size=2 * args.num_generations,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        num_train_epochs=args.epochs,
        learning_rate=1e-5,
        temperature=1.0,
        seed=0,
        disable_dropout=True,
        dataloader_num_workers=0,
    )
    check_trainer_args(config)  # our clear error (e.g. for use_vllm=True) before TRL's own checks
    trainer = GRPOTrainer(
        model=model, args=config, train_dataset=data, reward_funcs=reward, processing_class=tok, rollout_func=spec
    )
    spec.attach(trainer)
    trainer.train()

    steps_per_epoch = math.ceil(len(problems) * args.num_generations / config.per_device_train_batch_size)
    logs = [r for r in trainer.state.log_history if "spec_rl/tokens_generated" in r]
    epochs = []
    for e in range(args.epochs):
        part = logs[e * steps_per_epoch : (e + 1) * steps_per_epoch]
        epochs.append(
            {
                "epoch": e + 1,
                "tokens_generated": sum(r["spec_rl/tokens_generated"] for r in part),
                "reused_tokens": sum(r["spec_rl/reused_tokens"] for r in part),
                "rollout_seconds": round(sum(r["spec_rl/rollout_seconds"] for r in part), 3),
            }
        )
        print(
            f"epoch {e + 1}: generated {epochs[-1]['tokens_generated']:.0f} tokens, "
            f"reused {epochs[-1]['reused_tokens']:.0f}, rollout {epochs[-1]['rollout_seconds']:.1f} s"
        )
    print(json.dumps({**spec.mode.to_dict(), "epochs": epochs}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
