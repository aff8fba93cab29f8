"""Helpers shared by the training-script tests: arguments and data, subprocess and torchrun runs, preemption,
metrics and weights."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

import pytest

from open_instruct import runtime


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Tiny models are overhead-bound: on a shared 2-core machine two spinning intra-op threads made these runs
    ~2.5x slower in wall time than one thread. Restored afterwards so other test modules are unaffected."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# A tiny PPO rollout: 4 prompts x 2 completions, 2 mini-batches of 4, one epoch, 8-token responses.
TINY_PPO_ROLLOUTS = "--local_rollout_batch_size 4 --num_samples_per_prompt 2 --per_device_train_batch_size 4".split()
TINY_PPO_ROLLOUTS += ["--num_epochs", "1", "--response_length", "8"]


def bench_script(file_name: str, module_name: Optional[str] = None) -> Any:
    """bench/<file_name> loaded as a module (the bench folder is not a package), registered in sys.modules under
    module_name (default: the file's stem) first, as its dataclasses resolve their annotations through it."""
    import importlib.util

    name = module_name or os.path.splitext(file_name)[0]
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "bench", file_name))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def recipe_inputs(recipe: str, model: str, train: str, eval_data: str) -> list[str]:
    """A recipe from configs/ and the three paths every run reads (for a caller that names the output folder)."""
    recipe_path = os.path.join(REPO, "configs", recipe)
    return [
        recipe_path,
        "--model_name_or_path",
        model,
        "--dataset_name_or_path",
        train,
        "--eval_dataset_name_or_path",
        eval_data,
    ]


def recipe_args(recipe: str, model: str, train: str, eval_data: str, output_dir: Any, *settings: str) -> list[str]:
    """A training script's arguments: a recipe from configs/, the four paths every run names, then `settings`."""
    return [*recipe_inputs(recipe, model, train, eval_data), "--output_dir", str(output_dir), *settings]


def write_rl_files(folder: Any) -> dict[str, str]:
    """The RL script tests' data, written in `folder`: {"train": 64 arithmetic prompts, "eval": 8 held-out ones}."""
    from demo.synthetic import rl_rows, write_jsonl

    return {
        "train": write_jsonl(os.path.join(str(folder), "train.jsonl"), rl_rows(64, 0)),
        "eval": write_jsonl(os.path.join(str(folder), "eval.jsonl"), rl_rows(8, 1)),
    }


def rl_exit_code(argv: list[str]) -> int:
    """rlvr_ppo's exit status for `argv`, as the command line would give it (runtime.run: 2 for a bad setting or
    input)."""
    from open_instruct import rlvr_ppo

    try:
        runtime.run(rlvr_ppo.main, argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    return 0


def noisy_sft_args(data_dir: str, model: str, sft_eval: str, output_dir: Any) -> list[str]:
    """sft.py's arguments for the starting policy of the RL and LoRA tests: 4 epochs on 2000 arithmetic answers of
    which 60% are off by one, so it copies the operands but leaves room for every later stage to learn."""
    from demo import synthetic

    noisy = synthetic.write_jsonl(os.path.join(data_dir, "sft_noisy.jsonl"), synthetic.noisy_sft_rows(2000, 0, 0.6))
    settings = ["--num_train_epochs", "4", "--eval_steps", "1000", "--checkpointing_steps", "1000"]
    return recipe_args("sft_tiny.yaml", model, noisy, sft_eval, output_dir, *settings)


# one-turn chat questions of different lengths: the generation tests' prompts
CHAT_QUESTIONS = [
    "Hi", "What is 2+2? Answer briefly.", "Name a color", "Write one long sentence about the sea and sky."
]  # fmt: skip


def chat_prompts(tokenizer: Any, questions: Sequence[str] = CHAT_QUESTIONS) -> list[list[int]]:
    """Each question as a one-turn chat prompt's token ids, generation prompt included."""
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
           for q in questions]  # fmt: skip
    return [p if isinstance(p, list) else list(p["input_ids"]) for p in ids]


def move_adapter(policy: Any, seed: int) -> None:
    """Seeded values for a peft policy's LoRA factors (B starts at 0, so the adapted model is the base: this gives
    the adapter a real update)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def script_env() -> dict[str, str]:
    """The environment of a script run in a subprocess: this one's, the repo importable, offline, one thread (tiny
    models are overhead-bound; on a shared 2-core machine two OpenMP threads per process can be 10x slower)."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": REPO,
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "offline",
        "TOKENIZERS_PARALLELISM": "false",
    }


def run_script(
    args: list[str], env: Optional[dict[str, str]] = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """`python *args` in the repo folder (env: script_env() as it is now); the test fails with the exit status and
    stderr's tail unless it is 0."""
    env = env or script_env()
    out = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stderr[-4000:]}"
    return out


def torchrun_two_processes(script: Any, env: dict[str, str]) -> None:
    """`script` on 2 processes under torchrun (a free rendezvous port: the suite may run on several workers); the
    test fails with stderr's tail unless both exit 0."""
    from open_instruct.engines import free_port

    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run(
        [torchrun, "--nproc_per_node", "2", "--master_port", str(free_port()), str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]


def read_metrics(output_dir: str) -> list[dict[str, Any]]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


VOLATILE_PREFIXES = ("perf/", "time/")  # wall-clock numbers: differ between any two runs


def comparable(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Log rows without wall-clock numbers (perf/*, time/*), which differ between any two runs."""
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE_PREFIXES)} for r in rows]


def assert_rows_match(a: list[dict[str, Any]], b: list[dict[str, Any]], rel: float = 1e-6) -> None:
    a, b = comparable(a), comparable(b)
    assert len(a) == len(b), f"{len(a)} rows vs {len(b)} rows"
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.keys() == y.keys(), f"row {i}: keys differ: {sorted(x.keys() ^ y.keys())}"
        for k in x:
            if isinstance(x[k], float) or isinstance(y[k], float):
                assert math.isclose(x[k], y[k], rel_tol=rel, abs_tol=1e-9), f"row {i} {k}: {x[k]} vs {y[k]}"
            else:
                assert x[k] == y[k], f"row {i} {k}: {x[k]!r} vs {y[k]!r}"


def load_weights(model_dir: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(os.path.join(model_dir, "model.safetensors"))


def assert_weights_match(a_dir: str, b_dir: str, atol: float = 1e-6) -> None:
    import torch

    a, b = load_weights(a_dir), load_weights(b_dir)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=atol, rtol=0), f"{k}: max diff {(a[k] - b[k]).abs().max().item()}"


@contextmanager
def sigterm_at_step(monkeypatch: Any, step: int) -> Iterator[None]:
    """Deliver a real SIGTERM to this process during optimizer step `step` (just before the loop's preemption
    check), as a cluster scheduler would. The script's own handler must turn it into checkpoint-and-exit."""
    original = runtime.Preemption.should_stop
    calls = {"n": 0}

    def should_stop(self: Any, accelerator: Any) -> bool:
        calls["n"] += 1
        if calls["n"] == step:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before os.kill returns (same thread)
        return original(self, accelerator)

    previous = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(runtime.Preemption, "should_stop", should_stop)
    try:
        yield
    finally:
        monkeypatch.setattr(runtime.Preemption, "should_stop", original)
        signal.signal(signal.SIGTERM, previous)


def preempt_then_resume(main: Any, argv: list[str], monkeypatch: Any, step: int) -> None:
    """`main(argv)` with a SIGTERM in optimizer step `step` (it checkpoints and exits), then the same run resumed from
    that checkpoint to the end."""
    with sigterm_at_step(monkeypatch, step):
        main(argv)
    main([*argv, "--resume_from_checkpoint", "auto"])


def break_checkpoints(output_dir: str, valid_step: int, steps: tuple[int, int]) -> dict[str, str]:
    """Next to the valid checkpoint step_<valid_step>, fake the debris of crashed saves at later steps:
    step_<steps[0]> without COMPLETE (killed before the marker), step_<steps[1]> with a file cut short of its
    manifest size (torn write), and a .tmp_step_* folder (killed before the rename). Returns their paths."""
    import shutil

    from open_instruct.checkpoint import COMPLETE, MANIFEST, checkpoints_dir

    root = checkpoints_dir(output_dir)
    src = os.path.join(root, f"step_{valid_step}")
    no_marker = os.path.join(root, f"step_{steps[0]}")
    shutil.copytree(src, no_marker)
    os.remove(os.path.join(no_marker, COMPLETE))
    truncated = os.path.join(root, f"step_{steps[1]}")
    shutil.copytree(src, truncated)
    with open(os.path.join(truncated, MANIFEST)) as f:
        biggest = max(json.load(f)["files"].items(), key=lambda kv: kv[1]["size"])[0]
    path = os.path.join(truncated, biggest)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    tmp = os.path.join(root, f".tmp_step_{steps[1] + 1}_crashed")
    shutil.copytree(src, tmp)
    return {"no_marker": no_marker, "truncated": truncated, "tmp": tmp}


def write_fake_model(
    folder: str, architectures: tuple[str, ...] = ("LlamaForCausalLM",), keys: tuple[str, ...] = ("w",)
) -> str:
    """A folder that passes the pre-load model checks without being a loadable model: config.json, a tokenizer.json
    and a valid safetensors file holding one float per key (for config tests that must never get as far as
    loading)."""
    import struct

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "architectures": list(architectures)}, f)
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        f.write("{}")
    header = json.dumps(
        {k: {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i, k in enumerate(keys)}
    ).encode()
    with open(os.path.join(folder, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + b"\0" * (4 * len(keys)))
    return folder


# A user-file environment for end-to-end multi-turn runs on any backend (written to a file, named by import path)
TWO_TURNS_ENV = '''
from open_instruct.environments import Environment, StepResult


class TwoTurns(Environment):
    """Every episode has two policy turns: the first is answered with a user turn, the second is verified."""

    def reset(self, example):
        self.turn, self.answer = 0, example["ground_truth"]
        return example["messages"]

    def step(self, action):
        self.turn += 1
        if self.turn == 1:
            return StepResult([{"role": "user", "content": "Say it again."}], 0.0, False, {})
        right = action.strip().endswith(str(self.answer))
        return StepResult(None, float(right), True, {"correct": right})
'''


def environment_config(model: str, spec: str, max_turn_tokens: int, *extra: str) -> Any:
    """The RLVRConfig of an environment run on `spec` (its dataset and its environment): 2 episodes per prompt,
    3 turns of at most `max_turn_tokens`, 400 response tokens; `extra` settings last."""
    from open_instruct.config import RLVRConfig, parse_config

    return parse_config(RLVRConfig, [
        os.path.join(REPO, "configs", "grpo_trl_defaults.yaml"), "--model_name_or_path", model,
        "--dataset_name_or_path", spec, "--environment", spec, "--num_samples_per_prompt", "2",
        "--response_length", "400", "--max_turn_tokens", str(max_turn_tokens), "--max_turns", "3",
        "--total_episodes", "16", "--local_rollout_batch_size", "2", *extra,
    ])  # fmt: skip


def train_environment(folder: Any, model: str, spec: str, max_turn_tokens: int, env: dict[str, str]) -> list[dict]:
    """rlvr_ppo.py on environment `spec` in a subprocess run in `folder` (with `env` added to the environment): 2
    rollouts of 8 episodes (4 prompts x 2), 40 response tokens in turns of `max_turn_tokens`; the training rows of
    its metrics.jsonl."""
    import subprocess
    import sys

    out = os.path.join(str(folder), f"out_{len(os.listdir(folder))}")
    args = [
        os.path.join(REPO, "open_instruct", "rlvr_ppo.py"), os.path.join(REPO, "configs", "grpo_trl_defaults.yaml"),
        "--model_name_or_path", model, "--dataset_name_or_path", spec, "--environment", spec,
        "--output_dir", out, "--total_episodes", "16", "--local_rollout_batch_size", "4",
        "--num_samples_per_prompt", "2", "--per_device_train_batch_size", "8", "--response_length", "40",
        "--max_turn_tokens", str(max_turn_tokens), "--max_turns", "3", "--max_prompt_length", "400",
        "--logging_steps", "1", "--save_final_model", "false", "--num_samples_logged", "0",
    ]  # fmt: skip
    path = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))  # a package's --target install too
    run_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "HF_HUB_OFFLINE": "1",
               "WANDB_MODE": "offline", **env}  # fmt: skip
    proc = subprocess.run([sys.executable, *args], cwd=folder, env=run_env, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [r for r in read_metrics(out) if "loss/policy" in r]
