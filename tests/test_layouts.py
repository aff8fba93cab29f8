"""Generation layouts of the RL recipes: what the plan reads from them (engines x TP, dedicated, async overlap), the
time model's rollout arithmetic, the layouts it refuses, and the launch scripts' dry runs (no GPU)."""

import json
import os
import subprocess
import sys

import pytest

from open_instruct.plan import main as plan_main
from open_instruct.plan import rollout_seconds

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
URLS_70B = ["--vllm_server_urls", "http://gen:8000", "http://gen:8001"]


def plan_json(capsys, recipe: str, *args: str) -> dict:
    assert plan_main([os.path.join(REPO, "configs", recipe), *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def plan_error(capsys, recipe: str, *args: str) -> str:
    assert plan_main([os.path.join(REPO, "configs", recipe), *args]) == 2
    return capsys.readouterr().err


def dry_run(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CUDA_VISIBLE"))}
    environment.update({"PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1", "PYTHON": sys.executable, "DRY_RUN": "1", **env})
    return subprocess.run(
        ["bash", os.path.join(REPO, "scripts", script), *args],
        env=environment,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_rlvr_8b_plan_shows_7_training_plus_1_engine(capsys):
    p = plan_json(capsys, "rlvr_8b.yaml", "--num_processes", "7")
    assert (p["generation_backend"], p["generation_engines"], p["generation_tensor_parallel"]) == ("vllm_server", 1, 1)
    assert (p["world_size"], p["generation_gpus"], p["total_gpus"]) == (7, 1, 8)
    assert p["generation_dedicated"] and not p["generation_remote"]
    assert p["async_steps"] == 1 and p["policy_lag_optimizer_steps"] == 4  # 4 epochs x 1 mini-batch per rollout
    # weight sync: 8e9 parameters x 2 bytes over the node's 150 GB/s to the engine on GPU 7
    assert p["weight_sync_seconds_per_rollout"] == pytest.approx(16e9 / 150e9)
    assert plan_main([os.path.join(REPO, "configs", "rlvr_8b.yaml"), "--num_processes", "7"]) == 0
    text = capsys.readouterr().out
    assert "vllm_server: 1 engine(s) x TP 1 = 1 dedicated GPU(s), started by the trainer on its node" in text
    assert "7 training + 1 generation = 8 GPUs" in text
    assert "policy lag 1 rollout(s) = 4 optimizer steps" in text


def test_rlvr_70b_plan_shows_40_training_plus_a_generation_node(capsys):
    p = plan_json(capsys, "rlvr_70b.yaml", "--num_processes", "40", *URLS_70B)
    assert (p["generation_engines"], p["generation_tensor_parallel"], p["generation_gpus"]) == (2, 4, 8)
    assert (p["world_size"], p["total_gpus"]) == (40, 48)
    assert p["generation_dedicated"] and p["generation_remote"]
    # 70e9 x 2 bytes of bf16 weights to the other node at --network_gb_s 25: 5.6 s per rollout
    assert p["weight_sync_seconds_per_rollout"] == pytest.approx(5.6)
    assert p["weight_sync_hours"] == pytest.approx(625 * 5.6 / 3600)
    # the published layout, one engine x TP 4: twice the generation time per rollout, 44 GPUs busy
    one = plan_json(capsys, "rlvr_70b.yaml", "--num_processes", "40", "--vllm_server_urls", "http://gen:8000")
    assert (one["generation_engines"], one["generation_gpus"], one["total_gpus"]) == (1, 4, 44)
    assert one["generation_seconds_per_rollout"] == pytest.approx(2 * p["generation_seconds_per_rollout"], rel=0.05)


def test_rollout_time_sync_and_async_worked_example():
    # generation G = 100 s, training T = 300 s, weight sync S = 5 s per rollout
    assert rollout_seconds(100, 300, 5, overlap=False) == 405  # G + T + S
    assert rollout_seconds(100, 300, 5, overlap=True) == 305  # max(G, T) + S: generation hidden behind training
    assert rollout_seconds(300, 100, 5, overlap=True) == 305  # training hidden behind generation
    assert rollout_seconds(300, 100, 5, overlap=False) == 405


@pytest.mark.parametrize(
    "recipe, args",
    [("rlvr_8b.yaml", ["--num_processes", "7"]), ("rlvr_70b.yaml", ["--num_processes", "40", *URLS_70B])],
)
def test_async_overlap_takes_the_faster_phase_off_every_rollout(capsys, recipe, args):
    a = plan_json(capsys, recipe, *args)  # async_steps 1 (the recipes)
    s = plan_json(capsys, recipe, *args, "--async_steps", "0")
    g, t = a["generation_seconds_per_rollout"], a["training_seconds_per_rollout"]
    # the weight sync and the post-sync generation check (trusted generation) happen between rollouts either way
    w = a["weight_sync_seconds_per_rollout"] + a["generation_check_seconds_per_rollout"]
    assert a["generation_check_seconds_per_rollout"] > 0
    assert (s["generation_seconds_per_rollout"], s["training_seconds_per_rollout"]) == (g, t)
    assert s["seconds_per_step"] == pytest.approx(g + t + w)
    assert a["seconds_per_step"] == pytest.approx(max(g, t) + w)
    # whole run: every rollout plus the first step's extra (first_step_factor 3 - 1 = 2 rollouts) saves min(G, T)
    rollouts = a["planned_steps"]
    saved = (rollouts + 2) * min(g, t) / 3600
    assert s["estimated_hours"] - a["estimated_hours"] == pytest.approx(saved)
    assert a["phase_hours"]["generation"] == pytest.approx(rollouts * max(0.0, g - t) / 3600)  # what is not hidden
    assert a["generation_hidden_hours"] == pytest.approx(rollouts * min(g, t) / 3600)


def test_planned_hours_of_the_published_layouts(capsys):
    # 8B: G 71.6 s < T 191.2 s per rollout; 70B: G 111.6 s < T 387.7 s: training-bound, generation hidden when async;
    # the post-sync generation check adds 0.10 s (8B) and 0.94 s (70B) per rollout
    eight = [
        plan_json(capsys, "rlvr_8b.yaml", "--num_processes", "7", "--stop_at_episode", "300000", *x)
        for x in ([], ["--async_steps", "0"])
    ]
    assert [p["estimated_hours"] for p in eight] == pytest.approx([71.35, 98.05], abs=0.01)
    seventy = [
        plan_json(capsys, "rlvr_70b.yaml", "--num_processes", "40", *URLS_70B, *x) for x in ([], ["--async_steps", "0"])
    ]
    assert [p["estimated_hours"] for p in seventy] == pytest.approx([68.78, 88.21], abs=0.01)


def test_layout_flags_override_the_recipe(capsys):
    p = plan_json(capsys, "rlvr_8b.yaml", "--num_processes", "6", "--generation_gpus", "2", "--async_steps", "0")
    assert (p["generation_engines"], p["total_gpus"], p["async_steps"]) == (2, 8, 0)
    p = plan_json(capsys, "rlvr_8b.yaml", "--num_processes", "7", "--async_steps", "0", "--overlap_generation")
    assert p["async_steps"] == 1 and p["seconds_per_step"] == pytest.approx(p["rollout_seconds_async"])
    # colocated: the engine's share (0.9 in the recipe, meant for a GPU of its own) beside the trainer must fit
    colocated = ["--generation_backend", "vllm", "--vllm_gpu_memory_utilization", "0.5", "--gpu_memory_gb", "141"]
    p = plan_json(capsys, "rlvr_8b.yaml", "--num_processes", "7", *colocated, "--async_steps", "0")
    assert (
        not p["generation_dedicated"]
        and p["total_gpus"] == 7
        and p["seconds_per_step"] == pytest.approx(p["rollout_seconds_sync"])
    )


def test_layouts_that_cannot_start_are_refused_with_the_numbers(capsys):
    err = plan_error(capsys, "rlvr_8b.yaml", "--num_processes", "7", "--vllm_tensor_parallel_size", "3")
    assert "vllm_tensor_parallel_size 3 does not split the attention heads" in err
    assert "32 query heads, 8 key/value heads" in err and "1, 2, 4, 8, 16, 32" in err
    err = plan_error(capsys, "rlvr_8b.yaml", "--num_processes", "8")  # all 8 GPUs train: no room for the engine
    assert "8 + 1 = 9 > --gpus_per_node 8" in err and "vllm_num_engines 1 x vllm_tensor_parallel_size 1" in err
    err = plan_error(capsys, "rlvr_8b.yaml", "--num_processes", "7", "--vllm_num_engines", "2")
    assert "7 + 2 = 9 > --gpus_per_node 8" in err
    err = plan_error(capsys, "rlvr_70b.yaml", "--num_processes", "40")  # no URLs: engines on the trainer's full node
    assert "8 + 8 = 16 > --gpus_per_node 8" in err and "--vllm_server_urls" in err
    err = plan_error(capsys, "rlvr_70b.yaml", "--num_processes", "40", *URLS_70B, "--vllm_tensor_parallel_size", "1")
    assert "140 GB of bf16 weights" in err and "80 GB" in err
    err = plan_error(capsys, "rlvr_70b.yaml", "--num_processes", "40", *URLS_70B, "--vllm_tensor_parallel_size", "16")
    assert "vllm_tensor_parallel_size 16 > --gpus_per_node 8" in err
    err = plan_error(
        capsys,
        "rlvr_8b.yaml",
        "--num_processes",
        "7",
        "--generation_backend",
        "vllm",
        "--async_steps",
        "0",
        "--overlap_generation",
    )
    assert "--overlap_generation needs dedicated engines" in err


def test_rlvr_8b_dry_run_prints_the_training_and_engine_commands_and_the_plan():
    proc = dry_run("rlvr_8b.sh")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "--num_processes 7 open_instruct/rlvr_ppo.py configs/rlvr_8b.yaml" in out
    assert "CUDA_VISIBLE_DEVICES=7 python -m open_instruct.engines configs/rlvr_8b.yaml" in out
    # the engine command the line above starts names the same GPU (it printed CUDA_VISIBLE_DEVICES=0: a child's mask
    # names physical GPUs, not the parent's renumbered ones)
    engine_lines = [line for line in out.splitlines() if "api_server.entry" in line]
    assert len(engine_lines) == 1 and " CUDA_VISIBLE_DEVICES=7 " in engine_lines[0], engine_lines
    assert "7 training + 1 generation = 8 GPUs" in out and "Estimated wall clock" in out
    assert out.index("open_instruct.engines") < out.index("accelerate launch") < out.index("Generation layout")


def test_engine_devices_are_named_as_the_parent_sees_them(monkeypatch):
    from open_instruct.engines import engine_specs, visible_device_names

    def masks(devices):
        specs = engine_specs(
            "m", num_engines=2, tensor_parallel_size=2, max_model_len=64, dtype="bfloat16", seed=1, transfer="nccl",
            gpu_memory_utilization=0.9, devices=devices,
        )  # fmt: skip
        return [s.env["CUDA_VISIBLE_DEVICES"] for s in specs]

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert masks([4, 5, 6, 7]) == ["4,5", "6,7"]  # every GPU visible: an index is its own name
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,GPU-aa,6,7")
    assert masks([1, 2, 3, 4]) == ["3,GPU-aa", "6,7"]  # local i -> the i-th entry of this process's mask
    with pytest.raises(Exception, match=r"CUDA device\(s\) \[5\] are not among the 5"):
        visible_device_names([5])


def test_rlvr_70b_dry_run_prints_both_machines_commands_and_the_plan():
    proc = dry_run("rlvr_70b.sh", GENERATION_HOSTS="gen-node")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert (
        "--config_file configs/accelerate/fsdp_multinode.yaml --num_machines 5 --machine_rank 0 "
        "--main_process_ip 127.0.0.1 --main_process_port 29500 --num_processes 40 open_instruct/rlvr_ppo.py "
        "configs/rlvr_70b.yaml --vllm_server_urls http://gen-node:8000 http://gen-node:8001"
    ) in out
    assert (
        "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 python -m open_instruct.engines configs/rlvr_70b.yaml "
        "--vllm_num_engines 2 --host 0.0.0.0 --port 8000"
    ) in out
    assert "40 training + 8 generation = 48 GPUs" in out and "2 engine(s) x TP 4" in out
    rows = {
        line.split()[0]: line.split()[1] for line in out.splitlines() if line.startswith("  ") and len(line.split()) > 1
    }
    assert rows["world_size"] == "40" and rows["mini_batch_size"] == "640"
    # the generation machine's dry run shows the same two commands; overrides reach both
    gen = dry_run(
        "rlvr_70b.sh", "--vllm_num_engines", "1", MACHINE_RANK="5", GENERATION_HOSTS="gen-node", ENGINE_PORT="9000"
    )
    assert gen.returncode == 0, gen.stderr
    assert (
        "--vllm_num_engines 1 --host 0.0.0.0 --port 9000" in gen.stdout
        and "CUDA_VISIBLE_DEVICES=0,1,2,3 " in gen.stdout
    )
    assert (
        "--machine_rank 0" in gen.stdout
        and "--vllm_server_urls http://gen-node:9000 --vllm_num_engines 1" in gen.stdout
    )
    # two generation machines: the engines are spread, one per machine
    two = dry_run("rlvr_70b.sh", NUM_MACHINES="7", GENERATION_HOSTS="g1,g2")
    assert two.returncode == 0, two.stderr
    assert "--vllm_server_urls http://g1:8000 http://g2:8000" in two.stdout and "--vllm_num_engines 1 " in two.stdout
    # without GENERATION_HOSTS or SLURM, a dry run shows placeholder names
    assert "http://machine-5:8000 http://machine-5:8001" in dry_run("rlvr_70b.sh").stdout


def test_rlvr_70b_takes_the_generation_host_from_slurm(tmp_path):
    scontrol = tmp_path / "scontrol"  # what `scontrol show hostnames node[01-06]` prints
    scontrol.write_text("#!/bin/sh\nfor i in 1 2 3 4 5 6; do echo node0$i; done\n")
    scontrol.chmod(0o755)
    path = f"{tmp_path}:{os.environ['PATH']}"
    proc = dry_run("rlvr_70b.sh", SLURM_JOB_NODELIST="node[01-06]", PATH=path, MACHINE_RANK="3")
    assert proc.returncode == 0, proc.stderr
    assert (
        "--machine_rank 3" in proc.stdout and "--vllm_server_urls http://node06:8000 http://node06:8001" in proc.stdout
    )


def test_launch_scripts_refuse_bad_layouts_before_starting_anything():
    bad = dry_run("rlvr_70b.sh", MACHINE_RANK="6")
    assert bad.returncode == 2 and "MACHINE_RANK 6 must be below NUM_MACHINES 6" in bad.stderr
    bad = dry_run("rlvr_70b.sh", NUM_MACHINES="5")
    assert bad.returncode == 2 and "leaves no generation node" in bad.stderr
    bad = dry_run("rlvr_70b.sh", NUM_PROCESSES="36")
    assert bad.returncode == 2 and "must fill whole nodes" in bad.stderr
    bad = dry_run("rlvr_70b.sh", NUM_MACHINES="8", GENERATION_HOSTS="a b c")
    assert (
        bad.returncode == 2
        and "vllm_num_engines 2 does not spread evenly over the 3 generation machine(s)" in bad.stderr
    )
    bad = dry_run("rlvr_70b.sh", GENERATION_HOSTS="a,b")
    assert bad.returncode == 2 and "names 2 host(s)" in bad.stderr
    bad = dry_run("rlvr_70b.sh", DRY_RUN="0")  # a real run needs the generation hosts
    assert bad.returncode == 2 and "GENERATION_HOSTS must name the 1 generation machine(s)" in bad.stderr
    bad = dry_run("rlvr_70b.sh", "--vllm_tensor_parallel_size", "3", DRY_RUN="0", GENERATION_HOSTS="g")
    assert bad.returncode == 2 and "vllm_tensor_parallel_size 3 does not split the attention heads" in bad.stderr
    # 8B: a real run (DRY_RUN=0) with an engine that does not fit stops before accelerate starts
    bad = dry_run("rlvr_8b.sh", DRY_RUN="0", NUM_PROCESSES="8")
    assert bad.returncode == 2 and "8 + 1 = 9 > --gpus_per_node 8" in bad.stderr
    assert "accelerate" not in bad.stdout
