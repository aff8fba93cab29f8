# Shared by scripts/*.sh (sourced, not run): builds one `accelerate launch` command and runs it, or with DRY_RUN=1
# prints it and the plan for that layout (no GPU, no model download).
#
# Environment (defaults describe one node):
#   NUM_MACHINES       machines in the training job (1)
#   MACHINE_RANK       this machine's rank, 0..NUM_MACHINES-1 (0); SLURM: $SLURM_NODEID
#   MAIN_PROCESS_IP    address of machine rank 0 (127.0.0.1); SLURM: first host of $SLURM_JOB_NODELIST
#   MAIN_PROCESS_PORT  rendezvous port on it (29500)
#   NUM_PROCESSES      training processes over all machines (default: the script's per-node count x NUM_MACHINES)
#   ACCELERATE_CONFIG  accelerate config file (default: the script's, or configs/accelerate/fsdp_multinode.yaml
#                      when NUM_MACHINES > 1)
#   PYTHON             interpreter (default: .venv/bin/python if present, else python3)
#   GPUS_PER_NODE      GPUs per node, passed to the plan (8): engines the trainer starts must fit beside it
#   DRY_RUN=1          print the command and `python -m open_instruct.plan` for this world size, then exit
# Arguments after the script name are recipe overrides, passed through: --learning_rate 1e-6 --output_dir ...

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

# The interpreter: $PYTHON, else the repo's .venv, else python3.
launcher_python() {
  if [[ -n "${PYTHON:-}" ]]; then
    echo "$PYTHON"
  elif [[ -x "$REPO/.venv/bin/python" ]]; then
    echo "$REPO/.venv/bin/python"
  else
    echo python3
  fi
}

# show_engine_dry_run DEVICES ENGINE_COMMAND...: what `python -m open_instruct.engines ... --dry_run` would start
# (the `vllm serve` command lines), or a note where that module is not installed in this checkout.
show_engine_dry_run() {
  local devices=$1
  shift
  if [[ -f "$REPO/open_instruct/engines.py" ]]; then
    CUDA_VISIBLE_DEVICES=$devices "$@" --dry_run | sed 's/^/#   /'
  else
    echo "#   (open_instruct/engines.py is not in this checkout: its --dry_run prints one \`vllm serve\` line per engine)"
  fi
}

# launch SCRIPT RECIPE PROCESSES_PER_NODE DEFAULT_CONFIG [overrides...]
launch() {
  local script=$1 recipe=$2 per_node=$3 default_config=$4
  shift 4
  local python
  python=$(launcher_python)
  local num_machines=${NUM_MACHINES:-1}
  local machine_rank=${MACHINE_RANK:-0}
  local main_ip=${MAIN_PROCESS_IP:-127.0.0.1}
  local main_port=${MAIN_PROCESS_PORT:-29500}
  local num_processes=${NUM_PROCESSES:-$((per_node * num_machines))}
  local config=${ACCELERATE_CONFIG:-$default_config}
  if [[ -z "${ACCELERATE_CONFIG:-}" && "$num_machines" -gt 1 && "$default_config" == configs/accelerate/fsdp_8gpu.yaml ]]; then
    config=configs/accelerate/fsdp_multinode.yaml
  fi
  if ! [[ "$num_machines" =~ ^[1-9][0-9]*$ && "$num_processes" =~ ^[1-9][0-9]*$ && "$machine_rank" =~ ^[0-9]+$ ]]; then
    echo "error: NUM_MACHINES ($num_machines) and NUM_PROCESSES ($num_processes) must be positive integers, MACHINE_RANK ($machine_rank) >= 0" >&2
    return 2
  fi
  if (( machine_rank >= num_machines )); then
    echo "error: MACHINE_RANK $machine_rank must be below NUM_MACHINES $num_machines" >&2
    return 2
  fi
  if (( num_processes % num_machines != 0 )); then
    echo "error: NUM_PROCESSES $num_processes is not divisible by NUM_MACHINES $num_machines (accelerate starts the same number on every machine)" >&2
    return 2
  fi
  local cmd=(accelerate launch --config_file "$config"
    --num_machines "$num_machines" --machine_rank "$machine_rank"
    --main_process_ip "$main_ip" --main_process_port "$main_port"
    --num_processes "$num_processes"
    "$script" "$recipe" "$@")
  if [[ "${DRY_RUN:-0}" != 0 ]]; then
    echo "# machine $machine_rank of $num_machines: $((num_processes / num_machines)) training processes here, $num_processes in all"
    printf '%q ' "${cmd[@]}"
    echo
    echo
    local plan_args=(--num_processes "$num_processes")
    [[ -n "${GPUS_PER_NODE:-}" ]] && plan_args+=(--gpus_per_node "$GPUS_PER_NODE")
    "$python" -m open_instruct.plan "$recipe" "${plan_args[@]}" "$@"
    return $?
  fi
  local accelerate_bin
  accelerate_bin="$(dirname "$python")/accelerate"
  [[ -x "$accelerate_bin" ]] || accelerate_bin=accelerate
  cmd[0]=$accelerate_bin
  exec "${cmd[@]}"
}
