"""One process of a 2-process TRL GRPO run with SpecRLRollout (started by torchrun from
tests/integrations/test_trl_processes.py). Usage: trl_ranks_worker.py OUT_DIR EPOCHS [RESUME_CHECKPOINT]

Writes OUT_DIR/calls.rank<k>.json: per training rollout call, the global step, this process's samples
(prompt ids, slot, dataset id), whether each found its draft, and the process count.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny_models

import torch.distributed  # noqa: E402
from datasets import Dataset  # noqa: E402
from tiny_models import tiny_model  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from spec_rl.integrations.trl import SpecRLRollout  # noqa: E402
from spec_rl.tasks.demo_data import demo_train_set  # noqa: E402
from spec_rl.tasks.demo_policy import build_demo_tokenizer  # noqa: E402

GROUP, PER_DEVICE, PROMPTS = 4, 2, 6  # G = 4 samples per prompt, 2 per process: every group straddles the ranks


class RecordingRollout(SpecRLRollout):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls: list[dict] = []

    def __call__(self, prompts, trainer):
        out = super().__call__(prompts, trainer)
        if trainer.model.training:
            self.calls.append(
                {
                    "step": int(trainer.state.global_step),
                    "samples": [[r.prompt_ids, r.slot, r.dataset_id] for r in self.last_requests],
                    "found": list(self.last_result.draft_found),
                }
            )
        return out


def main(out: str, epochs: int, resume: str | None) -> None:
    examples = demo_train_set()[:PROMPTS]
    tok = build_demo_tokenizer([e.prompt for e in examples] * 3, vocab_size=300, model_max_length=256)
    model = tiny_model(vocab_size=len(tok), eos=(tok.eos_token_id,), seed=0, bias_eos=4.0)  # same weights everywhere
    data = Dataset.from_dict({"prompt": [e.prompt for e in examples], "id": [e.uid for e in examples]})
    args = GRPOConfig(
        output_dir=out,
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=PER_DEVICE,
        num_generations=GROUP,
        max_completion_length=8,
        num_train_epochs=epochs,
        learning_rate=1e-9,
        temperature=1.0,
        save_strategy="epoch",
        report_to=[],
        seed=0,
        logging_steps=1,
        disable_dropout=True,
        dataloader_num_workers=0,
    )
    spec = RecordingRollout(mode="spec", dataset_id_column="id")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
        args=args,
        train_dataset=data,
        processing_class=tok,
        rollout_func=spec,
    )
    spec.attach(trainer)
    trainer.train(resume_from_checkpoint=resume)
    rank = trainer.accelerator.process_index
    record = {"rank": rank, "processes": trainer.accelerator.num_processes, "calls": spec.calls}
    Path(out, f"calls.rank{rank}.json").write_text(json.dumps(record))
    # Tear the gloo group down before the interpreter exits: left to process teardown, its C++ threads
    # are destroyed while joinable and the process aborts ("terminate called without an active exception").
    trainer.accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # results are written and the group is gone: skip teardown of library threads (see above)
