#!/usr/bin/env bash
# GRPO on verl 0.9 with SPEC-RL speculative rollouts (spec_rl_agent over vLLM async servers).
#
# These are the settings that switch spec-rl on; everything about your cluster and model size
# (GPUs, batch sizes, FSDP/Megatron, learning rate, ...) goes after them as ordinary verl overrides:
#
#   MODEL=/models/Qwen3-1.7B TRAIN_FILES=/data/train.parquet VAL_FILES=/data/test.parquet \
#   RUN_DIR=/mnt/shared/runs/grpo-spec \
#   bash examples/verl/grpo_spec_rl.sh trainer.nnodes=2 trainer.n_gpus_per_node=8 data.train_batch_size=512 ...
#
# RUN_DIR holds the agent-loop file and the drafts (DRAFT_DIR, one file per (prompt, sample slot)).
# When the job spans nodes it must be on a filesystem every node mounts at the same path, with
# atomic rename within a directory (NFS, Lustre, ...): see docs/integrations.md, "verl".
set -euo pipefail

: "${MODEL:?set MODEL to a Hugging Face checkpoint directory}"
: "${TRAIN_FILES:?set TRAIN_FILES to a verl RL parquet (prompt, data_source, reward_model, extra_info)}"
VAL_FILES=${VAL_FILES:-$TRAIN_FILES}
PYTHON=${PYTHON:-python}
RUN_DIR=$(realpath -m "${RUN_DIR:-runs/verl-grpo-spec-rl}")
DRAFT_DIR=$(realpath -m "${DRAFT_DIR:-$RUN_DIR/drafts}")  # absolute: agent-loop workers run elsewhere
MODE=${MODE:-spec}                  # spec (the paper's rule at e^0.5) | exact (lossless) | vanilla (same loop, no
                                    # reuse: the fair baseline) | random (ablation) | l=<lenience> (e.g. l=e^0.3 PPO)
SEED=${SEED:-0}                     # run seed of the acceptance uniforms
GROUP=${GROUP:-8}                   # responses per prompt (GRPO group size)

mkdir -p "$RUN_DIR"
AGENT_YAML=$RUN_DIR/spec_rl_agent.yaml
{
    echo "- name: spec_rl_agent"
    echo "  _target_: spec_rl.integrations.verl.SpecRLAgentLoop"
    echo "  cache_dir: \"$DRAFT_DIR\""
    echo "  mode: \"$MODE\""
    echo "  seed: $SEED"
} > "$AGENT_YAML"

# vLLM returns raw prompt log-probs, so the rollout samples at temperature 1 without top-k/top-p
# (spec_rl_agent refuses other settings); calculate_log_probs keeps the rollout log-probs in the batch.
exec "$PYTHON" -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="$TRAIN_FILES" \
    data.val_files="$VAL_FILES" \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.mode=async \
    actor_rollout_ref.rollout.n="$GROUP" \
    actor_rollout_ref.rollout.temperature=1.0 \
    actor_rollout_ref.rollout.top_k=-1 \
    actor_rollout_ref.rollout.top_p=1.0 \
    actor_rollout_ref.rollout.calculate_log_probs=True \
    actor_rollout_ref.rollout.agent.agent_loop_config_path="$AGENT_YAML" \
    actor_rollout_ref.rollout.agent.default_agent_loop=spec_rl_agent \
    +actor_rollout_ref.rollout.agent.agent_loop_manager_class=spec_rl.integrations.verl_metrics.SpecRLAgentLoopManager \
    "$@"
