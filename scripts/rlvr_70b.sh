#!/usr/bin/env bash
# Tulu 3 70B RLVR with PPO (configs/rlvr_70b.yaml): 6 nodes x 8 GPUs = 48 GPUs.
#   training:   40 FSDP2 processes on nodes 0-4 (5 x 8; 40 x local_mini_batch_size 16 = 640 completions per step)
#   generation: node 5 (8 GPUs) for the generation engines
# Run the same command on every node of the allocation:
#   NUM_MACHINES=6 MACHINE_RANK=$SLURM_NODEID MAIN_PROCESS_IP=<node 0> bash scripts/rlvr_70b.sh [--key value ...]
#   DRY_RUN=1 bash scripts/rlvr_70b.sh          # node 0's command and the 40-process plan; no GPU needed
#
# How the layout is expressed: NUM_MACHINES is the whole allocation (6); NUM_PROCESSES (40) training processes at
# GPUS_PER_NODE (8) per node fill the first NUM_PROCESSES / GPUS_PER_NODE = 5 machines, which form the accelerate
# job (--num_machines 5 --num_processes 40: accelerate starts the same number of processes on every machine it
# launches, so a node with a different role cannot be part of the job). Machines 5.. are the generation nodes.
#
# Not runnable yet (stated here so no GPU hours are spent finding out): generation for 70B needs tensor-parallel
# engines on the generation node that the trainer pushes weights to. This repo's vLLM backend is colocated (one
# engine inside each training process, tensor parallel 1: a 70B model does not fit one GPU), and HF generation
# under FSDP gathers the whole model on every GPU (140 GB in bf16). So every node stops with an error before
# launching (DRY_RUN still prints the command and the plan); FORCE=1 launches the training nodes anyway.
set -euo pipefail
source "$(dirname "$0")/_launch.sh"
total_machines=${NUM_MACHINES:-6}
per_node=${GPUS_PER_NODE:-8}
train_processes=${NUM_PROCESSES:-40}
if (( train_processes % per_node != 0 )); then
  echo "error: NUM_PROCESSES $train_processes must fill whole nodes of GPUS_PER_NODE $per_node" >&2
  exit 2
fi
train_machines=$((train_processes / per_node))
if (( total_machines <= train_machines )); then
  echo "error: NUM_MACHINES $total_machines leaves no generation node: $train_processes training processes take $train_machines machines of $per_node GPUs" >&2
  exit 2
fi
rank=${MACHINE_RANK:-0}
if (( rank >= total_machines )); then
  echo "error: MACHINE_RANK $rank must be below NUM_MACHINES $total_machines" >&2
  exit 2
fi
if (( rank >= train_machines )); then
  echo "machine $rank of $total_machines is a generation node (machines 0-$((train_machines - 1)) train)." >&2
  echo "error: a standalone tensor-parallel generation server is not implemented in this repo yet (see the header of $0)" >&2
  exit 3
fi
if [[ "${DRY_RUN:-0}" == 0 && "${FORCE:-0}" == 0 ]]; then
  echo "error: 70B generation is not implemented yet (see the header of $0); nothing launched. FORCE=1 launches the training nodes anyway" >&2
  exit 3
fi
if [[ "${DRY_RUN:-0}" != 0 ]]; then
  echo "# layout: $total_machines machines x $per_node GPUs; machines 0-$((train_machines - 1)) train ($train_processes processes), machines $train_machines-$((total_machines - 1)) generate"
  echo "# NOTE: generation for 70B is not implemented yet (see the header of scripts/rlvr_70b.sh)"
fi
NUM_MACHINES=$train_machines NUM_PROCESSES=$train_processes \
  launch open_instruct/rlvr_ppo.py configs/rlvr_70b.yaml "$per_node" configs/accelerate/fsdp_multinode.yaml "$@"
