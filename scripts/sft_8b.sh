#!/usr/bin/env bash
# Tulu 3 8B SFT (configs/sft_8b.yaml): FSDP2, 8 training processes per node, global batch 128 on 8 GPUs.
#   bash scripts/sft_8b.sh [--key value ...]                   # one 8-GPU node
#   NUM_MACHINES=2 MACHINE_RANK=$SLURM_NODEID MAIN_PROCESS_IP=$HEAD bash scripts/sft_8b.sh   # on every node
#   DRY_RUN=1 bash scripts/sft_8b.sh                           # print the command and the plan; no GPU needed
# More machines shrink gradient_accumulation_steps to keep the published global batch: 2 nodes -> --gradient_accumulation_steps 8.
set -euo pipefail
source "$(dirname "$0")/_launch.sh"
launch open_instruct/sft.py configs/sft_8b.yaml 8 configs/accelerate/fsdp_8gpu.yaml "$@"
