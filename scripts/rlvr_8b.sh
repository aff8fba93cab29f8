#!/usr/bin/env bash
# Tulu 3 8B RLVR with PPO (configs/rlvr_8b.yaml) on one 8-GPU node: 7 FSDP2 training processes on GPUs 0-6
# (7 x local_mini_batch_size 32 = 224 completions per optimizer step), GPU 7 left to the generation engine.
#   bash scripts/rlvr_8b.sh [--key value ...]
#   DRY_RUN=1 bash scripts/rlvr_8b.sh                          # print the command and the plan; no GPU needed
# The layout is the number of training processes (NUM_PROCESSES, default 7) on a node with one more GPU; the
# recipe's batch sizes are per process, so another count changes the batch per step (the plan shows it).
# Generation: this repo's vLLM backend is colocated (an engine inside each training process, sharing its GPU via
# vllm_gpu_memory_utilization), so with it GPU 7 stays idle. To use all 8 GPUs with the same 224 per step:
#   NUM_PROCESSES=8 bash scripts/rlvr_8b.sh --local_rollout_batch_size 28 --gradient_accumulation_steps 28
set -euo pipefail
source "$(dirname "$0")/_launch.sh"
if [[ "${NUM_MACHINES:-1}" != 1 ]]; then
  echo "error: the 8B RLVR layout is one node (7 training GPUs + 1 for generation); got NUM_MACHINES=$NUM_MACHINES" >&2
  exit 2
fi
launch open_instruct/rlvr_ppo.py configs/rlvr_8b.yaml 7 configs/accelerate/fsdp_7gpu.yaml "$@"
