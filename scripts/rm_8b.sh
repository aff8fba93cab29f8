#!/usr/bin/env bash
# Tulu 3 8B reward model (configs/rm_8b.yaml): FSDP2, 8 training processes per node, global batch 256 on 8 GPUs.
#   bash scripts/rm_8b.sh [--key value ...]
#   DRY_RUN=1 bash scripts/rm_8b.sh                            # print the command and the plan; no GPU needed
# Multi-node: set NUM_MACHINES, MACHINE_RANK, MAIN_PROCESS_IP on every node (see scripts/_launch.sh).
set -euo pipefail
source "$(dirname "$0")/_launch.sh"
launch open_instruct/reward_model.py configs/rm_8b.yaml 8 configs/accelerate/fsdp_8gpu.yaml "$@"
