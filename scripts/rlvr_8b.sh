#!/usr/bin/env bash
# Tulu 3 8B RLVR with PPO (configs/rlvr_8b.yaml) on one 8-GPU node, the published layout:
#   training:   7 FSDP2 processes on GPUs 0-6 (7 x local_mini_batch_size 32 = 224 completions per optimizer step)
#   generation: 1 vLLM engine (vllm_server, TP 1) on GPU 7, started by the trainer's rank 0 (vllm_server_urls unset)
#               as `python -m open_instruct.engines configs/rlvr_8b.yaml` on the devices after its training processes;
#               weights are broadcast to it after every rollout's updates; async_steps 1 generates the next rollout
#               while the trainer updates (--async_steps 0: synchronous)
#   bash scripts/rlvr_8b.sh [--key value ...]
#   DRY_RUN=1 bash scripts/rlvr_8b.sh          # the training command, the engine command and the plan; no GPU needed
# Environment: _launch.sh's (NUM_PROCESSES, default 7; PYTHON; DRY_RUN; ACCELERATE_CONFIG), plus
#   GPUS_PER_NODE   GPUs on this node (8): training processes + engines x TP must fit on it
# The recipe's batch sizes are per process, so another NUM_PROCESSES changes the batch per step (the plan shows it).
# Engines running elsewhere: pass --vllm_server_urls http://HOST:PORT ...; then all 8 GPUs can train, 28 prompts and
# 28 accumulated micro-batches per process keeping 224 per step (tests/test_published_layouts.py plans this line):
#   NUM_PROCESSES=8 bash scripts/rlvr_8b.sh --vllm_server_urls http://gen:8000 --local_rollout_batch_size 28 \
#     --gradient_accumulation_steps 28
set -euo pipefail
source "$(dirname "$0")/_launch.sh"
if [[ "${NUM_MACHINES:-1}" != 1 ]]; then
  echo "error: the 8B RLVR layout is one node (7 training GPUs + 1 for generation); got NUM_MACHINES=$NUM_MACHINES" >&2
  exit 2
fi
recipe=configs/rlvr_8b.yaml
train_processes=${NUM_PROCESSES:-7}
per_node=${GPUS_PER_NODE:-8}
python=$(launcher_python)
# The engines from the recipe and the overrides; exit 2 before anything starts if they cannot (TP vs the model's
# heads, or more GPUs than the node has beside the training processes).
layout=$("$python" -m open_instruct.plan "$recipe" --engine_layout --num_processes "$train_processes" \
  --gpus_per_node "$per_node" "$@") || exit 2
read -r backend engines tp where <<<"$layout"
if [[ "${DRY_RUN:-0}" != 0 && "$backend" == vllm_server && "$where" == local ]]; then
  devices=$(seq -s, "$train_processes" $((train_processes + engines * tp - 1)))
  echo "# generation: $engines engine(s) x TP $tp on GPU(s) $devices, started by the trainer's rank 0 (vllm_server_urls unset) as:"
  engine_args=(-m open_instruct.engines "$recipe" "$@")
  echo "CUDA_VISIBLE_DEVICES=$devices python $(printf '%q ' "${engine_args[@]}")"
  show_engine_dry_run "$devices" "$python" "${engine_args[@]}"
  echo
fi
GPUS_PER_NODE=$per_node launch open_instruct/rlvr_ppo.py "$recipe" "$train_processes" configs/accelerate/fsdp_7gpu.yaml "$@"
