"""A `verifiers` environment's own cost per rollout, the earlier API (verifiers 0.3.1) beside verifiers.v1 (0.4) on
the same task: 8 single-turn episodes per rollout (4 prompts x 2), "say yes" scored 1 for "yes", played by the run's
environment adapter (verifiers_env.py / verifiers_v1_play.py; v1 with the run's offline chat harness) against a
scripted generator, so only the environments' and adapters' work is timed (the model's generation, the same on both
paths, comes on top of either).

    make bench-verifiers [ARGS="--rollouts 8"]     (installs 0.3.1 into output/verifiers-0.3.1 once)
    python bench/bench_verifiers.py [--rollouts 8] [--earlier_api_path DIR]

The installed verifiers (the extra's pin, 0.4) runs the v1 path. The earlier API needs verifiers 0.3.1, which this
venv does not hold beside 0.4; `--earlier_api_path DIR` runs the same rollouts a second time with DIR first on the
path, DIR holding 0.3.1 and what it needs that the venv lacks:

    .venv/bin/pip install --no-deps --target DIR verifiers==0.3.1 aiolimiter anthropic gepa loguru openai-agents \
        msgpack pyzmq setproctitle uvloop docstring-parser jiter griffe

Each path runs in its own subprocess, one after the other, on the tiny test model's tokenizer (demo/tiny.py).
Reported per path: the median wall and CPU seconds (the process's, all threads) of rollouts 2..N (the first pays
imports and the renderer's load), with the min-max spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

EARLIER_API_ENV = """
import verifiers as vf
from datasets import Dataset


def exact(completion, answer) -> float:
    return float((completion[-1]["content"] if isinstance(completion, list) else completion).strip() == answer)


def load_environment(num_examples: int = 4):
    dataset = Dataset.from_list([{"question": "say yes", "answer": "yes"}] * num_examples)
    return vf.SingleTurnEnv(dataset=dataset, rubric=vf.Rubric(funcs=[exact]))
"""

V1_ENV = """
import verifiers.v1 as vf


class SayData(vf.TaskData):
    answer: str = ""


class SayTask(vf.Task[SayData]):
    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        return float((trace.nodes[trace.calls[-1].node].message.content or "").strip() == self.data.answer)


class SayTasksetConfig(vf.TasksetConfig):
    num_examples: int = 4


class SayTaskset(vf.Taskset[SayTask, SayTasksetConfig]):
    def load(self):
        return [SayTask(SayData(prompt="say yes", answer="yes"), self.config.task)
                for _ in range(self.config.num_examples)]


__all__ = ["SayTaskset"]
"""


class ScriptedGenerator:
    """Every request answered "yes" + the end-of-turn id at once (no model): the Generator contract's generate()."""

    def __init__(self, tokenizer):
        self.answer = tokenizer("yes", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    def generate(self, prompt_ids, config, max_new_tokens=None):
        from open_instruct.generation import GenerationOutput

        count = len(prompt_ids) * config.n
        return GenerationOutput(
            prompt_ids=[list(p) for p in prompt_ids for _ in range(config.n)],
            response_ids=[list(self.answer)] * count, texts=["yes"] * count, stopped=[True] * count,
            prompt_index=[i for i in range(len(prompt_ids)) for _ in range(config.n)],
            logprobs=[[-0.1] * len(self.answer)] * count, weight_versions=[[0] * len(self.answer)] * count,
        )  # fmt: skip


def measure(folder: str, rollouts: int) -> dict:
    """This process's verifiers: rollouts of 8 episodes through the run's environment adapter; per-rollout times."""
    from importlib.metadata import version

    from demo.tiny import save_tiny_models
    from open_instruct import integrations, verifiers_env
    from open_instruct.config import RLVRConfig, parse_config
    from open_instruct.generation import GenerationConfig
    from open_instruct.models import load_tokenizer
    from open_instruct.rollouts import environment_run

    v1 = verifiers_env.v1_installed()
    with open(os.path.join(folder, "say_env.py"), "w") as f:
        f.write(V1_ENV if v1 else EARLIER_API_ENV)
    os.chdir(folder)  # the spec names its file relative to the working directory
    model = save_tiny_models(os.path.join(folder, "tiny"))["causal_lm"]
    spec = "verifiers:say_env.py"
    cfg = parse_config(RLVRConfig, [
        os.path.join(REPO, "configs", "grpo_trl_defaults.yaml"), "--model_name_or_path", model,
        "--dataset_name_or_path", spec, "--environment", spec, "--num_samples_per_prompt", "2",
        "--response_length", "64", "--max_turn_tokens", "16", "--max_turns", "1", "--total_episodes", "16",
        "--local_rollout_batch_size", "4",
    ])  # fmt: skip
    tokenizer = load_tokenizer(model)
    environments = environment_run(cfg, tokenizer)
    rows = []
    for i, row in enumerate(integrations.find(spec).generate(spec, "train")[:4]):
        r = {"ground_truth": row["ground_truth"], "verifier": row["dataset"], "where": f"row {i}",
             "example": {**row, "verifier": row["dataset"]}}  # fmt: skip
        rows.append({**r, "prompt_ids": environments.prompt_ids(r)})
    generator, walls, cpus, scores = ScriptedGenerator(tokenizer), [], [], []
    for k in range(rollouts):
        wall, cpu = time.perf_counter(), time.process_time()
        out = environments.play(generator, rows, GenerationConfig(n=2, seed=k, max_new_tokens=16))
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        scores.append(sum(e.turns[-1].reward for e in out.episodes) / len(out.episodes))
    return {"verifiers": version("verifiers"), "api": "verifiers.v1" if v1 else "earlier API",
            "episodes": len(rows) * 2, "walls": walls, "cpus": cpus, "scores": scores}  # fmt: skip


def run_path(rollouts: int, extra_path: str | None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [extra_path, REPO, env.get("PYTHONPATH")] if p)
    with tempfile.TemporaryDirectory() as folder:
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--_measure", folder, "--rollouts", str(rollouts)],
            env=env, capture_output=True, text=True, timeout=1800,
        )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(
            f"the {'earlier API' if extra_path else 'installed verifiers'} path failed:\n{proc.stderr[-3000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summary(result: dict) -> str:
    walls, cpus = result["walls"][1:], result["cpus"][1:]
    return (f"| {result['api']} | {result['verifiers']} | {result['episodes']} | {statistics.median(walls):.3f} "
            f"({min(walls):.3f}-{max(walls):.3f}) | {statistics.median(cpus):.3f} ({min(cpus):.3f}-{max(cpus):.3f}) "
            f"| {statistics.mean(result['scores']):.2f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--earlier_api_path", default=None, help="a folder holding verifiers 0.3.1 (module docstring)")
    parser.add_argument("--_measure", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._measure:
        print(json.dumps(measure(args._measure, args.rollouts)))
        return
    results = [run_path(args.rollouts, None)]
    if args.earlier_api_path:
        results.append(run_path(args.rollouts, os.path.abspath(args.earlier_api_path)))
    print("| path | verifiers | episodes/rollout | wall s/rollout (spread) | CPU s/rollout (spread) | mean score |")
    print("| --- | --- | --- | --- | --- | --- |")
    for result in results:
        print(summary(result))
    if len(results) == 2:
        ratio = statistics.median(results[0]["walls"][1:]) / statistics.median(results[1]["walls"][1:])
        print(f"\nverifiers.v1 / earlier API, wall per rollout: {ratio:.1f}x")


if __name__ == "__main__":
    main()
