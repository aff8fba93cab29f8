"""FSDP2 on 2 CPU processes (gloo), launched like a GPU run: `accelerate launch --config_file
configs/accelerate/fsdp_cpu_2proc.yaml open_instruct/X.py ...` with OPEN_INSTRUCT_CPU_FSDP=1 (the CPU work-around in
open_instruct/distributed.py; GPU runs never take it).

What is proved, from inside the training processes and from their outputs:
- sharding is real: at every checkpoint each rank dumps what it holds (OPEN_INSTRUCT_SHARD_REPORT); every trained
  parameter is a DTensor sharded on dim 0 and each rank holds its torch.chunk share (half, up to one row), and so
  is the Adam state;
- SFT, the reward model and DPO on 2 sharded processes log the same per-step losses and end with the same weights
  (final_model/, loadable with from_pretrained) as one process with the same global batch;
- RLVR (PPO: policy + value model trained, reference frozen; GRPO: policy + reference), all sharded, matches
  2-process DDP: sampling is seeded per rank, so only a run with the same ranks draws the same completions;
- a run checkpointed on 2 processes resumes on 1, and the reverse, consuming the same examples (same per-step
  losses, which differ from step to step, same final weights);
- generation from sharded weights (full_params) with ranks stopping at different lengths, and a frozen sharded
  model (prepare_frozen), give the unsharded model's outputs (tests/_fsdp_worker.py);
- the chunked log-prob head runs chunked under FSDP2, where accelerate makes lm_head its own unit (an FSDPLinear),
  and gives the unsharded model's log-probs, entropies and gradients (tests/_fsdp_head_worker.py);
- without the work-around, the FSDP config on CPU stops with a clear error instead of silently training unsharded.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
ACCELERATE = os.path.join(os.path.dirname(PY), "accelerate")
CPU_CONFIG = os.path.join(REPO, "configs", "accelerate", "fsdp_cpu_2proc.yaml")
STEPS = 4  # optimizer steps of each supervised run: 32 examples / global batch 8
TIMEOUT = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_", "OPEN_INSTRUCT_"))}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(
        PYTHONPATH=REPO, HF_HUB_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1"
    )
    return env


def command(script: str, args: list[str], mode: str, shard_dir: str | None = None) -> tuple[list[str], dict[str, str]]:
    """mode: 'single' (python X.py), 'fsdp' (accelerate launch, 2 sharded processes), 'ddp' (torchrun, 2 replicas)."""
    env = base_env()
    path = os.path.join(REPO, script)
    if mode == "single":
        return [PY, path, *args], env
    if mode == "fsdp":
        env["OPEN_INSTRUCT_CPU_FSDP"] = "1"
        if shard_dir:
            env["OPEN_INSTRUCT_SHARD_REPORT"] = shard_dir
        return [
            ACCELERATE,
            "launch",
            "--config_file",
            CPU_CONFIG,
            "--main_process_port",
            str(free_port()),
            path,
            *args,
        ], env
    assert mode == "ddp"
    env["ACCELERATE_USE_CPU"] = "true"  # accelerate's MULTI_CPU: DDP over gloo
    return [
        PY,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        path,
        *args,
    ], env


def run_all(jobs: list[tuple[list[str], dict[str, str], str]], parallel: int = 2) -> None:
    """Run (cmd, env, log_path) jobs, `parallel` at a time (2 cores); fail with the log tail of any failure."""
    pending, running, failures = list(jobs), [], []
    while pending or running:
        while pending and len(running) < parallel:
            cmd, env, log = pending.pop(0)
            f = open(log, "w")
            running.append(
                (subprocess.Popen(cmd, env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT), f, log, time.time())
            )
        time.sleep(0.2)
        for item in list(running):
            proc, f, log, t0 = item
            if proc.poll() is None and time.time() - t0 < TIMEOUT:
                continue
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            f.close()
            running.remove(item)
            if proc.returncode != 0:
                with open(log) as fh:
                    failures.append(f"{log} (exit {proc.returncode}):\n" + "".join(fh.readlines()[-25:]))
    assert not failures, "\n\n".join(failures)


def metrics(output_dir: str) -> list[dict]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def train_rows(output_dir: str, key: str = "train/loss") -> list[dict]:
    return [r for r in metrics(output_dir) if key in r]


def weights(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(model_dir, "model.safetensors"))


def assert_same_weights(a_dir: str, b_dir: str, atol: float = 2e-5) -> None:
    a, b = weights(a_dir), weights(b_dir)
    assert a.keys() == b.keys()
    for k in a:
        diff = (a[k] - b[k]).abs().max().item()
        assert diff <= atol, f"{k}: max |diff| {diff:.3g} between {a_dir} and {b_dir}"


def assert_same_losses(a: list[dict], b: list[dict], keys: tuple[str, ...], rel: float = 1e-5) -> None:
    assert [r["optimizer_step"] for r in a] == [r["optimizer_step"] for r in b]
    assert [r["episode"] for r in a] == [r["episode"] for r in b]
    for x, y in zip(a, b):
        for k in keys:
            assert x[k] == pytest.approx(y[k], rel=rel, abs=1e-6), f"step {x['optimizer_step']} {k}: {x[k]} vs {y[k]}"


def assert_really_sharded(shard_dir: str, tag: str, model_names: tuple[str, ...] = ("policy",)) -> None:
    """Every trained parameter is a DTensor sharded on dim 0; each rank holds torch.chunk's share of it (half,
    up to one row); the ranks' shares add up to the whole; the Adam moments are sharded the same way."""
    reports = []
    for rank in (0, 1):
        with open(os.path.join(shard_dir, f"{tag}_rank{rank}.json")) as f:
            reports.append(json.load(f))
    for rank, rep in enumerate(reports):
        assert rep["world_size"] == 2 and rep["distributed_type"] == "DistributedType.FSDP", rep["distributed_type"]
    for name in model_names:
        params = [r["models"][name]["params"] for r in reports]
        assert params[0].keys() == params[1].keys() and len(params[0]) > 0
        held, total = [0, 0], 0
        for pname in params[0]:
            g = params[0][pname]["global_numel"]
            for rank in (0, 1):
                p = params[rank][pname]
                assert p["dtensor"] and p["placements"] == ["S(0)"], f"{name}.{pname} on rank {rank}: {p}"
                held[rank] += p["local_numel"]
            assert params[0][pname]["local_numel"] + params[1][pname]["local_numel"] == g, pname
            assert params[0][pname]["local_numel"] >= params[1][pname]["local_numel"]  # chunk: rank 0 takes the odd row
            total += g
        assert held[0] + held[1] == total
        for rank in (0, 1):
            assert abs(held[rank] - total / 2) <= 0.01 * total, f"{name} rank {rank} holds {held[rank]} of {total}"
        opt = [r["models"][name]["optimizer"] for r in reports]
        assert opt[0]["plain_states"] == 0 and opt[0]["dtensor_states"] == 2 * len(params[0])  # exp_avg, exp_avg_sq
        assert opt[0]["local_numel"] + opt[1]["local_numel"] == opt[0]["global_numel"] == 2 * total


# ---------------------------------------------------------------------------------------------------------------------
# Fixtures: data, then each script's runs (1 process vs 2 sharded processes, in parallel on the 2 cores)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from demo.synthetic import write_task_files

    return write_task_files(str(tmp_path_factory.mktemp("fsdp_data")), n_train=64, n_eval=9, seed=3)


def supervised_args(model: str, train: str, output_dir: str, world: int, extra: list[str]) -> list[str]:
    """Global batch 8 either way: 4 x 2 accumulation on 1 process, 4 x 1 on each of 2."""
    return [
        "--model_name_or_path",
        model,
        "--dataset_name_or_path",
        train,
        "--output_dir",
        output_dir,
        "--total_episodes",
        str(8 * STEPS),
        "--per_device_train_batch_size",
        "4",
        "--gradient_accumulation_steps",
        str(2 // world),
        "--max_seq_length",
        "128",
        "--learning_rate",
        "3e-3",
        "--lr_scheduler_type",
        "linear",
        "--warmup_ratio",
        "0.25",
        "--max_grad_norm",
        "1.0",
        "--logging_steps",
        "1",
        "--checkpointing_steps",
        "2",
        "--keep_last_n_checkpoints",
        "5",
        "--seed",
        "5",
        *extra,
    ]


def run_pair(
    tmp, script: str, recipe: str, model: str, train: str, extra: list[str], extra_by_mode: dict | None = None
) -> dict[str, str]:
    """The same recipe on 1 process and on 2 sharded processes, side by side."""
    out = {"single": str(tmp / "single"), "fsdp": str(tmp / "fsdp"), "shards": str(tmp / "shards")}
    jobs = []
    for mode, world in (("single", 1), ("fsdp", 2)):
        more = (extra_by_mode or {}).get(mode, [])
        args = [os.path.join(REPO, "configs", recipe), *supervised_args(model, train, out[mode], world, extra + more)]
        cmd, env = command(script, args, mode, out["shards"])
        jobs.append((cmd, env, str(tmp / f"{mode}.log")))
    run_all(jobs)
    return out


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory, tiny_models, task):
    tmp = tmp_path_factory.mktemp("fsdp_sft")
    # 9 held-out examples in batches of 4: rank 0 gets 2 batches and rank 1 one (+ a padding batch): an eval loop
    # that let the ranks run different numbers of forwards would hang under FSDP.
    extra = ["--eval_dataset_name_or_path", task["sft_eval"], "--eval_steps", "2", "--per_device_eval_batch_size", "4"]
    out = run_pair(tmp, "open_instruct/sft.py", "sft_tiny.yaml", tiny_models["causal_lm"], task["sft_train"], extra)
    # Resume on the other world size from each run's step-2 checkpoint.
    jobs = []
    for src, mode, world in (("fsdp", "single", 1), ("single", "fsdp", 2)):
        name = f"resume_{src}_to_{mode}"
        out[name] = str(tmp / name)
        ckpt = os.path.join(out[src], "checkpoints", "step_2")
        args = [
            os.path.join(REPO, "configs", "sft_tiny.yaml"),
            *supervised_args(tiny_models["causal_lm"], task["sft_train"], out[name], world, extra),
            "--resume_from_checkpoint",
            ckpt,
        ]
        cmd, env = command("open_instruct/sft.py", args, mode)
        jobs.append((cmd, env, str(tmp / f"{name}.log")))
    run_all(jobs)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# SFT


@pytest.mark.slow
def test_sft_two_sharded_processes_match_one(sft_runs):
    assert_really_sharded(sft_runs["shards"], "step_2")
    assert_really_sharded(sft_runs["shards"], "step_4")
    with open(os.path.join(os.path.dirname(sft_runs["fsdp"]), "fsdp.log")) as f:
        assert "returned a view tensor" not in f.read()  # torch's FSDP2 warning, once printed on every step
    single, fsdp = train_rows(sft_runs["single"]), train_rows(sft_runs["fsdp"])
    assert len(single) == STEPS
    assert single[-1]["train/loss"] < 0.9 * single[0]["train/loss"]  # it learns, so equal losses are not trivial
    assert_same_losses(single, fsdp, ("train/loss", "train/grad_norm", "lr", "train/tokens_trained"))
    assert_same_losses(
        train_rows(sft_runs["single"], "eval/loss"), train_rows(sft_runs["fsdp"], "eval/loss"), ("eval/loss",)
    )
    assert_same_weights(os.path.join(sft_runs["single"], "final_model"), os.path.join(sft_runs["fsdp"], "final_model"))
    # The checkpoint is written in shards, one file per rank, each about half of the single-process file.
    state = os.path.join(sft_runs["fsdp"], "checkpoints", "step_2", "state")
    shards = sorted(f for f in os.listdir(state) if f.endswith(".distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]
    whole = os.path.getsize(os.path.join(sft_runs["single"], "checkpoints", "step_2", "state", "__0_0.distcp"))
    assert all(os.path.getsize(os.path.join(state, f)) < 0.7 * whole for f in shards)
    print(
        f"SFT loss {single[0]['train/loss']:.4f} -> {single[-1]['train/loss']:.4f}, 1 vs 2 sharded processes: "
        f"max |loss diff| {max(abs(a['train/loss'] - b['train/loss']) for a, b in zip(single, fsdp)):.2g}"
    )


@pytest.mark.slow
def test_sft_gathered_final_model_loads_and_equals_single_process_model(sft_runs):
    from transformers import AutoModelForCausalLM

    fsdp_model = AutoModelForCausalLM.from_pretrained(os.path.join(sft_runs["fsdp"], "final_model"))
    single = weights(os.path.join(sft_runs["single"], "final_model"))
    state = fsdp_model.state_dict()
    assert set(single) <= set(state)
    for k, v in single.items():
        assert state[k].shape == v.shape  # full tensors, not rank 0's shard
        assert (state[k] - v).abs().max().item() <= 2e-5, k
    ids = torch.tensor([[5, 17, 23, 9]])
    logits = fsdp_model(input_ids=ids).logits
    assert torch.isfinite(logits).all()


@pytest.mark.slow
def test_sharded_checkpoint_exports_on_one_process(sft_runs, tmp_path):
    """The last checkpoint of the 2-process run (DCP shards written by both ranks) exports, in this single process,
    to the same model as the gathered final_model."""
    from open_instruct.export import export_checkpoint

    with open(os.path.join(sft_runs["fsdp"], "checkpoints", f"step_{STEPS}", "trainer_state.json")) as f:
        assert json.load(f)["world_size"] == 2
    out = export_checkpoint(os.path.join(sft_runs["fsdp"], "checkpoints", f"step_{STEPS}"), str(tmp_path / "exported"))
    assert_same_weights(out, os.path.join(sft_runs["fsdp"], "final_model"), atol=0.0)


@pytest.mark.slow
@pytest.mark.parametrize("direction", ["fsdp_to_single", "single_to_fsdp"])
def test_sft_resume_on_another_world_size_consumes_the_same_examples(sft_runs, direction):
    src, dst = direction.split("_to_")
    resumed = train_rows(sft_runs[f"resume_{src}_to_{dst}"])
    reference = train_rows(sft_runs["single"])
    with open(os.path.join(sft_runs[src], "checkpoints", "step_2", "trainer_state.json")) as f:
        saved = json.load(f)
    assert saved["world_size"] == (2 if src == "fsdp" else 1)
    assert saved["counters"]["episode"] == 16  # the data position, in episodes (examples), not per-rank batches
    # The resumed run logs steps 3..4 only, with the uninterrupted run's episodes and losses. Each step's loss is
    # far from every other step's, so a window shifted by one batch (a skipped or repeated example set) would show.
    assert [r["optimizer_step"] for r in resumed] == [3, 4]
    assert_same_losses(resumed, reference[2:], ("train/loss", "train/grad_norm", "lr"))
    losses = [r["train/loss"] for r in reference]
    assert min(abs(a - b) for i, a in enumerate(losses) for b in losses[i + 1 :]) > 1e-3
    assert_same_weights(
        os.path.join(sft_runs[f"resume_{src}_to_{dst}"], "final_model"), os.path.join(sft_runs["single"], "final_model")
    )


def test_episode_stream_order_is_world_size_independent():
    """The data position is a count of episodes: any sequence of world sizes, switched at any step, reads the same
    global order; each epoch is a permutation (nothing skipped or repeated)."""
    from open_instruct.data import EpisodeStream

    n, batch = 37, 12
    stream = EpisodeStream(n, seed=7)
    uninterrupted = stream.take(0, 10 * batch)
    for worlds in ([1] * 10, [2] * 10, [2, 2, 2, 1, 1, 4, 4, 3, 1, 2], [4, 1] * 5):
        consumed, episode = [], 0
        for world in worlds:  # one optimizer step each; a fresh stream stands for a restarted job
            idx = EpisodeStream(n, seed=7).take(episode, batch)
            for rank in range(world):
                consumed += EpisodeStream.local_slice(idx, rank, world)
            episode += batch
        assert consumed == uninterrupted
    first_epochs = uninterrupted[: 3 * n]
    for e in range(3):
        assert sorted(first_epochs[e * n : (e + 1) * n]) == list(range(n))
    assert uninterrupted[:n] != uninterrupted[n : 2 * n]  # epochs are reshuffled


# ---------------------------------------------------------------------------------------------------------------------
# Reward model and DPO


@pytest.mark.slow
def test_reward_model_two_sharded_processes_match_one(tmp_path_factory, tiny_models, task):
    tmp = tmp_path_factory.mktemp("fsdp_rm")
    # Eval every 2 steps in batches of 4 (ranks with unequal real batches) and best_model kept by eval/accuracy.
    extra = ["--eval_dataset_name_or_path", task["pref_eval"], "--eval_steps", "2", "--per_device_eval_batch_size", "4"]
    out = run_pair(
        tmp, "open_instruct/reward_model.py", "rm_tiny.yaml", tiny_models["seq_cls"], task["pref_train"], extra
    )
    assert_really_sharded(out["shards"], "step_4")
    single, fsdp = train_rows(out["single"]), train_rows(out["fsdp"])
    assert len(single) == STEPS
    assert_same_losses(single, fsdp, ("train/loss", "train/accuracy", "train/grad_norm"))
    assert_same_losses(
        train_rows(out["single"], "eval/loss"), train_rows(out["fsdp"], "eval/loss"), ("eval/loss", "eval/accuracy")
    )
    assert_same_weights(os.path.join(out["single"], "best_model"), os.path.join(out["fsdp"], "best_model"))
    assert_same_weights(os.path.join(out["single"], "final_model"), os.path.join(out["fsdp"], "final_model"))


@pytest.mark.slow
def test_dpo_two_sharded_processes_match_one(tmp_path_factory, tiny_models, task):
    if not os.path.exists(os.path.join(REPO, "open_instruct", "dpo.py")):
        pytest.skip("open_instruct/dpo.py not written yet")
    tmp = tmp_path_factory.mktemp("fsdp_dpo")
    # Each run computes the reference log-probs itself (separate caches): the sharded reference pass is tested too.
    caches = {mode: ["--reference_cache_dir", str(tmp / f"ref_{mode}")] for mode in ("single", "fsdp")}
    out = run_pair(
        tmp,
        "open_instruct/dpo.py",
        "dpo_tiny.yaml",
        tiny_models["causal_lm"],
        task["pref_train"],
        [
            "--eval_dataset_name_or_path",
            task["pref_eval"],
            "--eval_steps",
            "2",
            "--per_device_eval_batch_size",
            "4",
            "--beta",
            "0.5",
        ],
        caches,
    )
    assert_really_sharded(out["shards"], "step_4")
    single, fsdp = train_rows(out["single"]), train_rows(out["fsdp"])
    assert len(single) == STEPS
    assert single[0]["train/loss"] == pytest.approx(0.6931, abs=1e-3)  # log 2: policy == reference at step 1
    stats = [k for k in single[0] if k.endswith(("rewards/margin", "logps/chosen"))]  # named with or without "train/"
    assert len(stats) == 2, sorted(single[0])
    assert_same_losses(single, fsdp, ("train/loss", "train/grad_norm", *stats))
    assert_same_losses(
        train_rows(out["single"], "eval/loss"),
        train_rows(out["fsdp"], "eval/loss"),
        ("eval/loss", "eval/rewards/accuracy"),
    )
    assert_same_weights(os.path.join(out["single"], "final_model"), os.path.join(out["fsdp"], "final_model"))
    # The sharded reference pass wrote the same numbers as the single-process one.
    from safetensors.torch import load_file

    (a,), (b,) = [
        [os.path.join(tmp / f"ref_{m}", f) for f in os.listdir(tmp / f"ref_{m}") if f.endswith(".safetensors")]
        for m in ("single", "fsdp")
    ]
    ta, tb = load_file(a), load_file(b)
    for k in ta:
        assert torch.allclose(ta[k].double(), tb[k].double(), atol=1e-4), k


# ---------------------------------------------------------------------------------------------------------------------
# RLVR: policy + value model trained, reference frozen, all sharded


@pytest.fixture(scope="module")
def rlvr_runs(tmp_path_factory, tiny_models, task):
    if not os.path.exists(os.path.join(REPO, "open_instruct", "rlvr_ppo.py")):
        pytest.skip("open_instruct/rlvr_ppo.py not written yet")
    tmp = tmp_path_factory.mktemp("fsdp_rlvr")
    # grpo drops flat groups: ranks then keep different numbers of rows and run dummies to stay in step. On-policy
    # (1 epoch of 1 mini-batch) the reference also scores only the kept rows, with dummies of its own.
    grpo = ["--algo", "grpo", "--kl_estimator", "k3", "--filter_zero_std_groups", "true"]
    algos = {"ppo": ["--num_epochs", "2"], "grpo": [*grpo, "--num_epochs", "2"],
             "grpo_on_policy": [*grpo, "--num_epochs", "1"],
             # PPO-ptx's demonstration forwards (dummies included) and per-answer rates, whose keys the ranks share
             "grpo_ptx": [*grpo, "--num_epochs", "1", "--ptx_dataset", task["sft_train"], "--ptx_coef", "0.5",
                          "--correct_rate_by", "ground_truth"]}  # fmt: skip
    out, jobs = {}, []
    for algo, extra in algos.items():
        for mode in ("ddp", "fsdp"):
            out[algo, mode] = str(tmp / f"{algo}_{mode}")
            # 2 rollouts of 2 ranks x 4 prompts x 2 samples = 16 completions, 2 epochs (1 on-policy) of 1
            # mini-batch: 4 optimizer steps (2).
            args = [
                os.path.join(REPO, "configs", "rlvr_tiny.yaml"),
                "--model_name_or_path",
                tiny_models["causal_lm"],
                "--dataset_name_or_path",
                task["rl_train"],
                "--eval_dataset_name_or_path",
                task["rl_eval"],
                "--eval_steps",
                "2",
                "--best_metric",
                "eval/correct_rate",
                "--output_dir",
                out[algo, mode],
                "--total_episodes",
                "32",
                "--local_rollout_batch_size",
                "4",
                "--num_samples_per_prompt",
                "2",
                "--per_device_train_batch_size",
                "4",
                "--gradient_accumulation_steps",
                "2",
                "--response_length",
                "8",
                "--per_device_eval_batch_size",
                "8",
                "--checkpointing_steps",
                "2",
                "--learning_rate",
                "1e-3",
                *extra,
            ]
            cmd, env = command("open_instruct/rlvr_ppo.py", args, mode, str(tmp / f"{algo}_shards"))
            jobs.append((cmd, env, str(tmp / f"{algo}_{mode}.log")))
        out[algo, "shards"] = str(tmp / f"{algo}_shards")
    run_all(jobs)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["ppo", "grpo", "grpo_on_policy", "grpo_ptx"])
def test_rlvr_sharded_matches_ddp(rlvr_runs, tiny_models, algo):
    """Policy (+ PPO's value model) trained and the reference frozen, all sharded: every logged number and the final
    policy equal 2-process DDP's (same ranks, so the same sampled completions). grpo_ptx: loss/ptx and the
    per-answer correct rates are among them, the groups' completions adding up to the rollout's 16."""
    steps = [2, 4] if algo in ("ppo", "grpo") else [1, 2]  # 2 rollouts x 2 or 1 epochs x 1 mini-batch
    models = ("policy", "value") if algo == "ppo" else ("policy",)
    assert_really_sharded(rlvr_runs[algo, "shards"], f"step_{steps[-1]}", models)
    ddp, fsdp = metrics(rlvr_runs[algo, "ddp"]), metrics(rlvr_runs[algo, "fsdp"])
    assert len(ddp) == len(fsdp)
    train = [r for r in ddp if "loss/policy" in r]
    assert [r["optimizer_step"] for r in train] == steps
    assert all(("loss/value" in r) == (algo == "ppo") for r in train)  # PPO trains a value model, GRPO none
    if algo != "ppo":  # some groups dropped, some kept: the ranks trained (and scored) different numbers of rows
        assert any(0 < r["train/filtered_groups_fraction"] < 1 for r in train)
    if algo == "grpo_ptx":  # a rollout whose groups were all dropped has no update, its demonstrations neither
        assert all((r["loss/ptx"] > 0) == (r["train/empty_updates"] == 0) for r in train)
        assert any(r["train/empty_updates"] == 0 for r in train)
        assert all(sum(v for k, v in r.items() if k.startswith("train/completions/")) == 16 for r in train)
    compared = 0
    for x, y in zip(ddp, fsdp):
        assert x.keys() == y.keys()
        for k in x:
            if isinstance(x[k], (int, float)) and not k.startswith(("perf/", "time/")):
                assert x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-5), (
                    f"rollout {x.get('rollout_step')} {k}: {x[k]} vs {y[k]}"
                )
                compared += 1
    assert compared >= 30
    final = os.path.join(rlvr_runs[algo, "fsdp"], "final_model")
    assert_same_weights(os.path.join(rlvr_runs[algo, "ddp"], "final_model"), final, atol=1e-4)
    start = weights(tiny_models["causal_lm"])
    assert max((weights(final)[k] - start[k]).abs().max().item() for k in start) > 1e-3  # the policy did train


# ---------------------------------------------------------------------------------------------------------------------
# Generation from sharded weights, frozen sharded models; the silent-fallback guard


@pytest.mark.slow
def test_generation_and_frozen_models_under_fsdp(tmp_path, tiny_models):
    cmd, env = command("tests/_fsdp_worker.py", [tiny_models["causal_lm"], str(tmp_path)], "fsdp")
    run_all([(cmd, env, str(tmp_path / "worker.log"))])
    for rank in (0, 1):
        with open(tmp_path / f"worker_rank{rank}.json") as f:
            r = json.load(f)
        here, total, all_dtensor = r["policy_sharding_before"]
        assert all_dtensor and here < 0.51 * total
        assert r["frozen_sharding"][2] and r["frozen_sharding"][0] < 0.51 * total and not r["frozen_requires_grad"]
        assert r["policy_sharding_inside_full_params"] == [total, total, False]  # whole weights while generating
        assert r["policy_sharding_after"] == r["policy_sharding_before"]  # sharded again afterwards
        assert r["frozen_logits_max_diff"] == 0.0 and r["policy_logits_max_diff"] == 0.0
        assert r["new_tokens"] == (4 if rank == 0 else 11)  # ranks generated different lengths, no deadlock
        assert r["generated"] == r["expected"] and r["generated_frozen"] == r["expected"]
        assert r["after_step_logits_max_diff"] <= 1e-5 and r["step_moved_logits_by"] > 1e-3


@pytest.mark.slow
def test_chunked_logprob_head_under_fsdp(tmp_path, tiny_models):
    """accelerate makes lm_head its own FSDP unit (FSDPLinear); the log-prob head still runs chunked there (no
    full-logits fallback): RL's log-probs/entropies and SFT/DPO's sums, forward and backward, make no tensor of more
    than one chunk (2) of vocabulary-wide rows, and equal the unsharded model's full-logit numbers and gradients."""
    from tolerances import chain_atol, decoder_reduction_lengths
    from transformers import AutoConfig

    cmd, env = command("tests/_fsdp_head_worker.py", [tiny_models["causal_lm"], str(tmp_path)], "fsdp")
    run_all([(cmd, env, str(tmp_path / "worker.log"))])
    lengths = decoder_reduction_lengths(AutoConfig.from_pretrained(tiny_models["causal_lm"]), 7)
    for rank in (0, 1):
        with open(tmp_path / f"head_rank{rank}.json") as f:
            r = json.load(f)
        assert r["head_class"] == "FSDPLinear" and r["head_is_fsdp_unit"] and r["head_sharded"] and r["head_is_chunked"]
        assert r["chunked_calls_rl"] == 1 and r["chunked_calls_sft"] == 1  # one head call per forward, chunked inside
        assert r["vocab_rows_rl"] <= 2 and r["vocab_rows_sft"] <= 2 < r["full_logits_rows"]
        # two evaluation orders of the decoder (tests/tolerances.py); a log-prob or entropy is two logit-sized terms,
        # a sum up to 6 of them; a gradient runs the chain forward and back
        value_bound = 2 * chain_atol(lengths, r["logits_max"])
        assert r["rl_logp_max_diff"] <= value_bound and r["rl_entropy_max_diff"] <= value_bound
        assert r["sft_sums_max_diff"] <= 6 * value_bound and r["sft_sums_vs_unsharded_head"] <= 6 * value_bound
        assert r["rl_grad_max_diff"] <= chain_atol(2 * lengths, r["rl_grad_max"])
        assert r["sft_grad_max_diff"] <= chain_atol(2 * lengths, r["sft_grad_max"])


@pytest.mark.slow
def test_fsdp_config_on_cpu_without_the_workaround_stops_instead_of_training_unsharded(tmp_path, tiny_models, task):
    args = [
        os.path.join(REPO, "configs", "sft_tiny.yaml"),
        *supervised_args(tiny_models["causal_lm"], task["sft_train"], str(tmp_path / "out"), 2, []),
        "--eval_dataset_name_or_path",  # the recipe's eval file is not built here (missing files now stop at start)
        task["sft_train"],
    ]
    cmd, env = command("open_instruct/sft.py", args, "fsdp")
    env.pop("OPEN_INSTRUCT_CPU_FSDP")
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode != 0
    assert "accelerate formed a group of 1" in proc.stderr and "OPEN_INSTRUCT_CPU_FSDP=1" in proc.stderr
    assert not os.path.exists(tmp_path / "out" / "metrics.jsonl")  # stopped before training


# ---------------------------------------------------------------------------------------------------------------------
# Launch scripts (no GPU: DRY_RUN prints the command and the plan; the RL layouts: tests/test_layouts.py)


def dry_run(target: str, env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    """`make <target>` (a Makefile recipe target) or `bash scripts/<target>` with DRY_RUN=1."""
    env = {**base_env(), "DRY_RUN": "1", "PYTHON": PY, **env_extra}
    cmd = ["bash", os.path.join(REPO, "scripts", target)] if target.endswith(".sh") else ["make", "-s", target]
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_rlvr_8b_dry_run_prints_the_7_process_command_and_the_224_plan():
    proc = dry_run("rlvr-8b", {})  # DRY_RUN=1 make rlvr-8b
    assert proc.returncode == 0, proc.stderr
    assert "accelerate launch --config_file configs/accelerate/fsdp_7gpu.yaml" in proc.stdout
    assert "--num_processes 7 open_instruct/rlvr_ppo.py configs/rlvr_8b.yaml" in proc.stdout
    rows = {
        line.split()[0]: line.split()[1]
        for line in proc.stdout.splitlines()
        if line.startswith("  ") and len(line.split()) > 1
    }
    assert rows["world_size"] == "7" and rows["mini_batch_size"] == "224" and rows["rollout_batch_size"] == "224"


def test_multinode_dry_run_passes_the_launcher_values_through():
    proc = dry_run("sft_8b.sh", {"NUM_MACHINES": "2", "MACHINE_RANK": "1", "MAIN_PROCESS_IP": "head-node"})
    assert proc.returncode == 0, proc.stderr
    assert (
        "--config_file configs/accelerate/fsdp_multinode.yaml --num_machines 2 --machine_rank 1 "
        "--main_process_ip head-node --main_process_port 29500 --num_processes 16"
    ) in proc.stdout
    rows = {
        line.split()[0]: line.split()[1]
        for line in proc.stdout.splitlines()
        if line.startswith("  ") and len(line.split()) > 1
    }
    assert rows["world_size"] == "16" and rows["mini_batch_size"] == "256"  # 1 x 16 x 16: the plan shows the change
    bad = dry_run("sft_8b.sh", {"NUM_MACHINES": "2", "MACHINE_RANK": "2"})
    assert bad.returncode == 2 and "MACHINE_RANK 2 must be below NUM_MACHINES 2" in bad.stderr
