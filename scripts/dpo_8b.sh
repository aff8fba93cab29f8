#!/usr/bin/env bash
# Tulu 3 8B DPO (configs/dpo_8b.yaml): FSDP2, 8 training processes per node, global batch 128 on 8 GPUs.
# The reference log-probs are computed once by the sharded initial policy and cached (see open_instruct/dpo.py).
#   bash scripts/dpo_8b.sh [--key value ...]
#   DRY_RUN=1 bash scripts/dpo_8b.sh                           # print the command and the plan; no GPU needed
# Multi-node: set NUM_MACHINES, MACHINE_RANK, MAIN_PROCESS_IP on every node (see scripts/_launch.sh).
set -euo pipefail
source "$(dirname "$0")/_launch.sh"
launch open_instruct/dpo.py configs/dpo_8b.yaml 8 configs/accelerate/fsdp_8gpu.yaml "$@"
