#!/usr/bin/env bash
# Tulu 3 70B RLVR with PPO (configs/rlvr_70b.yaml): 6 nodes x 8 GPUs = 48 GPUs.
#   training:   machines 0-4, one accelerate job of 40 FSDP2 processes (5 x 8; 40 x 16 = 640 completions per step)
#   generation: machine 5, the recipe's vLLM engines (vllm_server: 2 engines x TP 4 = its 8 GPUs), started with
#               `python -m open_instruct.engines configs/rlvr_70b.yaml`, engine i answering on ENGINE_PORT+i; the
#               trainer is given their --vllm_server_urls and broadcasts the weights to them after every rollout
# Run the same command on every node of the allocation:
#   NUM_MACHINES=6 MACHINE_RANK=$SLURM_NODEID MAIN_PROCESS_IP=<machine 0> GENERATION_HOSTS=<machine 5> \
#     bash scripts/rlvr_70b.sh [--key value ...]
#   DRY_RUN=1 bash scripts/rlvr_70b.sh     # machine 0's training command, machine 5's engine command and the plan
#
# Environment:
#   NUM_MACHINES       machines in the allocation (6): the training machines first, then the generation machine(s)
#   MACHINE_RANK       this machine, 0..NUM_MACHINES-1 (0; SLURM: $SLURM_NODEID); ranks >= NUM_PROCESSES /
#                      GPUS_PER_NODE start the engines, the others train
#   MAIN_PROCESS_IP    address of machine 0, the training job's rendezvous (127.0.0.1); MAIN_PROCESS_PORT (29500)
#   NUM_PROCESSES      training processes (40), whole nodes of GPUS_PER_NODE
#   GPUS_PER_NODE      GPUs per machine (8)
#   GENERATION_HOSTS   addresses of the generation machines, in rank order, comma or space separated. Default under
#                      SLURM: the last NUM_MACHINES - NUM_PROCESSES/GPUS_PER_NODE hosts of $SLURM_JOB_NODELIST;
#                      otherwise required (DRY_RUN shows placeholders)
#   ENGINE_PORT        port of the first engine on each generation machine (8000); engine i answers on ENGINE_PORT+i
#   PYTHON, ACCELERATE_CONFIG, DRY_RUN   see scripts/_launch.sh
# The recipe's vllm_num_engines (after overrides) are spread evenly over the generation machines; each splits its
# CUDA_VISIBLE_DEVICES (default: 0..engines x TP - 1) into groups of vllm_tensor_parallel_size. The trainer waits up
# to vllm_engine_start_timeout for them. NUM_MACHINES is the whole allocation; the accelerate job is only the
# training machines (--num_machines 5 --num_processes 40: accelerate starts the same number of processes on every
# machine it launches, so a machine with another role cannot be part of the job).
set -euo pipefail
source "$(dirname "$0")/_launch.sh"
recipe=configs/rlvr_70b.yaml
total_machines=${NUM_MACHINES:-6}
per_node=${GPUS_PER_NODE:-8}
train_processes=${NUM_PROCESSES:-40}
rank=${MACHINE_RANK:-0}
engine_port=${ENGINE_PORT:-8000}
for pair in "NUM_MACHINES=$total_machines" "GPUS_PER_NODE=$per_node" "NUM_PROCESSES=$train_processes" \
  "ENGINE_PORT=$engine_port"; do
  if ! [[ "${pair#*=}" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: ${pair%%=*} must be a positive integer, got '${pair#*=}'" >&2
    exit 2
  fi
done
if ! [[ "$rank" =~ ^[0-9]+$ ]]; then
  echo "error: MACHINE_RANK must be an integer >= 0, got '$rank'" >&2
  exit 2
fi
if (( train_processes % per_node != 0 )); then
  echo "error: NUM_PROCESSES $train_processes must fill whole nodes of GPUS_PER_NODE $per_node" >&2
  exit 2
fi
train_machines=$((train_processes / per_node))
gen_machines=$((total_machines - train_machines))
if (( gen_machines < 1 )); then
  echo "error: NUM_MACHINES $total_machines leaves no generation node: $train_processes training processes take $train_machines machines of $per_node GPUs" >&2
  exit 2
fi
if (( rank >= total_machines )); then
  echo "error: MACHINE_RANK $rank must be below NUM_MACHINES $total_machines" >&2
  exit 2
fi
python=$(launcher_python)

# The engines, from the recipe and the overrides: how many on each generation machine, and their URLs.
layout=$("$python" -m open_instruct.plan "$recipe" --engine_layout "$@") || exit 2
read -r backend engines tp _ <<<"$layout"
if [[ "$backend" != vllm_server ]]; then
  echo "error: the 70B layout generates on machines of their own: generation_backend must be vllm_server, got $backend" >&2
  exit 2
fi
if (( engines % gen_machines != 0 )); then
  echo "error: vllm_num_engines $engines does not spread evenly over the $gen_machines generation machine(s) (NUM_MACHINES $total_machines - $train_machines training)" >&2
  exit 2
fi
per_host=$((engines / gen_machines))
if (( per_host * tp > per_node )); then
  echo "error: $per_host engine(s) x vllm_tensor_parallel_size $tp = $((per_host * tp)) GPUs per generation machine > GPUS_PER_NODE $per_node" >&2
  exit 2
fi
hosts_list=${GENERATION_HOSTS:-}
placeholder=0
if [[ -z "$hosts_list" && -n "${SLURM_JOB_NODELIST:-}" ]] && command -v scontrol >/dev/null; then
  hosts_list=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | tail -n "$gen_machines" | tr '\n' ' ')
fi
if [[ -z "$hosts_list" ]]; then
  if [[ "${DRY_RUN:-0}" == 0 ]]; then
    echo "error: GENERATION_HOSTS must name the $gen_machines generation machine(s) (machines $train_machines-$((total_machines - 1))), or run under SLURM" >&2
    exit 2
  fi
  placeholder=1
  for ((i = train_machines; i < total_machines; i++)); do hosts_list+="machine-$i "; done
fi
read -r -a hosts <<<"${hosts_list//,/ }"
if (( ${#hosts[@]} != gen_machines )); then
  echo "error: GENERATION_HOSTS names ${#hosts[@]} host(s) (${hosts[*]}), the layout has $gen_machines generation machine(s)" >&2
  exit 2
fi
urls=()
for host in "${hosts[@]}"; do
  for ((i = 0; i < per_host; i++)); do urls+=("http://$host:$((engine_port + i))"); done
done
gen_names="machine $train_machines"
(( gen_machines > 1 )) && gen_names="machines $train_machines-$((total_machines - 1))"
devices=${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((per_host * tp - 1)))}
engine_args=(-m open_instruct.engines "$recipe" "$@" --vllm_num_engines "$per_host" --host 0.0.0.0 --port "$engine_port")

if [[ "${DRY_RUN:-0}" != 0 ]]; then
  echo "# layout: $total_machines machines x $per_node GPUs; machines 0-$((train_machines - 1)) train ($train_processes processes), $gen_names: generation ($engines engine(s) x TP $tp, $per_host per machine)"
  (( placeholder )) && echo "# GENERATION_HOSTS unset: placeholder host names below"
  echo "# $gen_names (${hosts[*]}), each:"
  echo "CUDA_VISIBLE_DEVICES=$devices python $(printf '%q ' "${engine_args[@]}")"
  show_engine_dry_run "$devices" "$python" "${engine_args[@]}"
  echo
  (( rank >= train_machines )) && rank=0  # a generation machine's dry run shows machine 0's training command too
elif (( rank >= train_machines )); then
  if [[ ! -f "$REPO/open_instruct/engines.py" ]]; then
    echo "error: machine $rank is a generation machine, but open_instruct/engines.py is not in this checkout" >&2
    exit 3
  fi
  echo "machine $rank of $total_machines: generation, $per_host engine(s) x TP $tp on devices $devices, ports $engine_port-$((engine_port + per_host - 1))" >&2
  CUDA_VISIBLE_DEVICES=$devices exec "$python" "${engine_args[@]}"
fi
# The engines' URLs come before the user's overrides, so a --vllm_server_urls of one's own wins.
NUM_MACHINES=$train_machines NUM_PROCESSES=$train_processes MACHINE_RANK=$rank GPUS_PER_NODE=$per_node \
  launch open_instruct/rlvr_ppo.py "$recipe" "$per_node" configs/accelerate/fsdp_multinode.yaml \
  --vllm_server_urls "${urls[@]}" "$@"
