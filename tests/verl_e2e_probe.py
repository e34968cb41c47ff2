"""What tests/integrations/test_verl_e2e.py hands verl's trainer to look at its batches.

:class:`RecordingAgentLoopManager` is ``SpecRLAgentLoopManager`` (verl's ``AgentLoopManager`` plus the
step metrics) that also saves every training batch it returns to verl's trainer, the DataProto
``RayPPOTrainer.fit`` goes on to train on, as ``record/gen-<k>.pt`` under the working directory of the run
(the test starts each run in its own folder; verl's processes keep that directory): the response
tensors (token ids, masks, rollout log-probs), the prompt's dataset index and the ``spec_rl/*``
columns. The test selects it with
``actor_rollout_ref.rollout.agent.agent_loop_manager_class=verl_e2e_probe.RecordingAgentLoopManager``
and puts tests/ on the PYTHONPATH of verl's processes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from verl.utils.ray_utils import auto_await

from spec_rl.integrations.verl_metrics import PREFIX, SpecRLAgentLoopManager

#: The folder, under the run's working directory, of the recorded batches.
RECORD_DIR = "record"
TENSORS = ("prompts", "responses", "response_mask", "attention_mask", "rollout_log_probs")


class RecordingAgentLoopManager(SpecRLAgentLoopManager):
    @auto_await
    async def generate_sequences(self, prompts):
        output = await super().generate_sequences(prompts)
        if not prompts.meta_info.get("validate", False):
            folder = Path.cwd() / RECORD_DIR
            folder.mkdir(parents=True, exist_ok=True)
            k = len(list(folder.glob("gen-*.pt")))
            columns = {k: v for k, v in output.non_tensor_batch.items() if k.startswith(PREFIX)}
            index = [int(i) for i in prompts.non_tensor_batch["index"]]  # output rows are the input rows, in order
            record = {name: output.batch[name].clone() for name in TENSORS if name in output.batch.keys()}
            record.update(
                columns={k: np.asarray(v).tolist() for k, v in columns.items()},
                index=index,
                global_steps=prompts.meta_info.get("global_steps"),
                timing={k: float(v) for k, v in output.meta_info.get("timing", {}).items()},
            )
            torch.save(record, folder / f"gen-{k}.pt")
        return output
