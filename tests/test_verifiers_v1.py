"""`verifiers.v1` environments (verifiers 0.4: open_instruct/verifiers_v1.py and verifiers_v1_play.py): a single-turn
and a multi-turn environment defined here (a Taskset with weighted @reward functions and a @metric, and a harness
that asks the model through verifiers' interception server), their tasks as rows, episodes played by their harness
against the run's loopback generate endpoint: the trained ids are the ids the generator sampled (token-in/token-out),
the user turns between them masked, the score the trace's weighted rewards and each reward/metric logged; tiny GRPO
runs of both (2 rollouts each). Skipped where verifiers 0.4 is not installed (an optional extra; `make install`
installs it)."""

from __future__ import annotations

import json
import os

import pytest

vf = pytest.importorskip("verifiers", reason="verifiers 0.4 (verifiers.v1) is not installed")
if not str(getattr(vf, "__version__", "")).startswith("0.4"):
    pytest.skip(f"verifiers {vf.__version__} is not 0.4 (verifiers.v1 only)", allow_module_level=True)

from training_helpers import environment_config, train_environment  # noqa: E402

from open_instruct.errors import ConfigError  # noqa: E402
from open_instruct.generation import GenerationConfig, GenerationOutput  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The harness both environments share: it asks the model through the interception endpoint (as any v1 harness
# program does), `turns` times, a user turn between answers; every reward function logs what it returned.
HARNESS = """
import asyncio, json, os
import httpx
import verifiers.v1 as vf


def replies(trace):  # each model call's answer, in order
    return [trace.nodes[c.node].message.content or "" for c in trace.calls if c.node is not None]


def log(fn, value, texts):
    if os.environ.get("VF_TEST_LOG"):
        with open(os.environ["VF_TEST_LOG"], "a") as f:
            f.write(json.dumps({"fn": fn, "value": value, "texts": texts}) + "\\n")
    return value


class AskConfig(vf.HarnessConfig):
    turns: int = 1


class Ask(vf.Harness[AskConfig]):
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data):
        if data.hang:  # a harness stuck in its own work (a tool, a sandbox) before asking the model
            await asyncio.Event().wait()
        messages = [{"role": "user", "content": data.prompt}]
        async with httpx.AsyncClient(timeout=None) as client:
            for turn in range(data.turns):
                reply = await client.post(endpoint.rstrip("/") + "/chat/completions",
                                          json={"model": ctx.model, "messages": messages},
                                          headers={"Authorization": f"Bearer {secret}"})
                reply.raise_for_status()
                content = reply.json()["choices"][0]["message"]["content"]
                if data.rewrite:  # a harness that edits its history before sending it back
                    content = content.upper() + " (edited)"
                messages.append({"role": "assistant", "content": content})
                if turn + 1 < data.turns:
                    messages.append({"role": "user", "content": f"once more ({turn + 1})"})
        return vf.ProgramResult(0, "", "")


class AskData(vf.TaskData):
    answer: str = ""
    turns: int = 1
    hang: bool = False
    rewrite: bool = False


class AskTask(vf.Task[AskData]):
    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        texts = replies(trace)
        return log("exact", float(bool(texts) and texts[-1].strip() == self.data.answer), texts)

    @vf.reward(weight=0.5)
    async def brevity(self, trace: vf.Trace) -> float:
        texts = replies(trace)
        return log("brevity", 1.0 / (1 + sum(map(len, texts))), texts)

    @vf.metric
    async def answers(self, trace: vf.Trace) -> float:
        texts = replies(trace)
        return log("answers", float(len(texts)), texts)


class AskTasksetConfig(vf.TasksetConfig):
    num_tasks: int = 4
    turns: int = 1
    hang: bool = False
    rewrite: bool = False


class AskTaskset(vf.Taskset[AskTask, AskTasksetConfig]):
    def load(self):
        answers = ["yes", "no"]
        return [AskTask(AskData(prompt=f"say {answers[i % 2]}", answer=answers[i % 2], turns=self.config.turns,
                                        hang=self.config.hang and i == 1, rewrite=self.config.rewrite),
                        self.config.task) for i in range(self.config.num_tasks)]


__all__ = ["AskTaskset", "Ask"]
"""
WEIGHTS = {"exact": 1.0, "brevity": 0.5}

# A tool environment: no harness of its own (the run's offline chat harness plays it: verifiers' own chat loop), a
# tool server the task launches per rollout (`python -m tool_env`, so the module is importable by name).
TOOL_ENV = '''
import verifiers.v1 as vf


class Calc(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)


class SumData(vf.TaskData):
    answer: str = ""


class SumTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class SumTask(vf.Task[SumData, vf.State, SumTaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [Calc(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float((trace.nodes[trace.calls[-1].node].message.content or "").strip() == self.data.answer)

    @vf.metric
    async def calls(self, trace: vf.Trace) -> float:
        return float(len(trace.calls))


class SumTasksetConfig(vf.TasksetConfig):
    num_tasks: int = 2
    task: SumTaskConfig = SumTaskConfig()


class SumTaskset(vf.Taskset[SumTask, SumTasksetConfig]):
    def load(self):
        return [SumTask(SumData(prompt=f"add 2 and {3 + i} with the tool", answer=str(5 + i)), self.config.task)
                for i in range(self.config.num_tasks)]


__all__ = ["SumTaskset"]

if __name__ == "__main__":
    Calc.run()
'''


@pytest.fixture
def env_folder(tmp_path, monkeypatch):
    (tmp_path / "ask_env.py").write_text(HARNESS)
    (tmp_path / "tool_env.py").write_text(TOOL_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))  # the tool server runs as `python -m tool_env`: importable by name
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VF_TEST_LOG", str(tmp_path / "values.jsonl"))
    return tmp_path


class CharGenerator:
    """The Generator contract's generate(): round k's i-th request gets scripts[k][i] spelled one token per
    character + the end-of-turn id; it records the prompts it got and the ids and log-probs it returned."""

    def __init__(self, tokenizer, scripts):
        self.tokenizer, self.scripts, self.round, self.prompts, self.sampled = tokenizer, scripts, 0, [], []

    def encode(self, text):
        return [self.tokenizer.convert_tokens_to_ids(c) for c in text]

    def generate(self, prompt_ids, config, max_new_tokens=None):
        texts = self.scripts[self.round]
        self.round += 1
        assert len(texts) == len(prompt_ids) and config.n == 1
        ids = [(self.encode(t) + [self.tokenizer.eos_token_id])[:cap] for t, cap in zip(texts, max_new_tokens)]
        logprobs = [[-0.01 * (len(self.sampled) + 1) * (j + 1) for j in range(len(r))] for r in ids]
        self.prompts.append([list(p) for p in prompt_ids])
        self.sampled.append((ids, logprobs))
        return GenerationOutput(
            prompt_ids=[list(p) for p in prompt_ids], response_ids=ids, texts=list(texts), stopped=[True] * len(ids),
            prompt_index=list(range(len(ids))), logprobs=logprobs, weight_versions=[[3] * len(r) for r in ids],
        )  # fmt: skip


class TextGenerator(CharGenerator):
    """Each script encoded by the tokenizer instead (so `<tool_call>` is its one special token)."""

    def encode(self, text):
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def config(tiny_models, spec, *extra):
    return environment_config(tiny_models["causal_lm"], spec, 60, *extra)


def play(cfg, tokenizer, spec, scripts, rows_used, generator_class=None):
    from open_instruct import verifiers_v1
    from open_instruct.rollouts import environment_run

    environments = environment_run(cfg, tokenizer)
    rows = []
    for i, row in enumerate(verifiers_v1.generate(spec, "train")[:rows_used]):
        example = {**row, "verifier": row["dataset"]}
        r = {"ground_truth": row["ground_truth"], "verifier": row["dataset"], "where": f"row {i}", "example": example}
        rows.append({**r, "prompt_ids": environments.prompt_ids(r)})
    generator = (generator_class or CharGenerator)(tokenizer, scripts)
    return rows, environments.play(generator, rows, GenerationConfig(n=2, seed=5)), generator


def values_logged(path):
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def test_single_turn_episodes_train_the_sampled_ids_and_score_with_the_tasks_rewards(env_folder, tiny_models):
    from open_instruct.models import load_tokenizer
    from open_instruct.verifiers_v1_play import V1Run

    spec = "verifiers:ask_env.py?num_tasks=2"
    tokenizer = load_tokenizer(tiny_models["causal_lm"])
    cfg = config(tiny_models, spec)
    # task 0 (answer "yes"): "yes" and "yes!"; task 1 ("no"): "no" and "maybe"
    rows, out, generator = play(cfg, tokenizer, spec, [["yes", "yes!", "no", "maybe"]], rows_used=2)
    environments = out  # the EpisodeOutput
    assert isinstance(environments.episodes[0], object) and generator.round == 1
    ids, logprobs = generator.sampled[0]
    for i, episode in enumerate(out.episodes):
        # token-in/token-out: the whole response is the policy's, exactly the ids (and log-probs) it sampled
        assert episode.response_ids == ids[i] and episode.loss_mask == [1] * len(ids[i])
        assert episode.sampler_logprobs == pytest.approx(logprobs[i], abs=1e-12)
        assert episode.weight_versions == [3] * len(ids[i])
        # the prompt the episode trains on is the prompt the generator got, and the one the length checks measured
        assert episode.prompt_ids == generator.prompts[0][i] == rows[i // 2]["prompt_ids"]
    texts = ["yes", "yes!", "no", "maybe"]
    answers = ["yes", "yes", "no", "no"]
    for episode, text, answer in zip(out.episodes, texts, answers):
        exact, brevity = float(text == answer), 1.0 / (1 + len(text))
        assert episode.turns[-1].reward == pytest.approx(exact + 0.5 * brevity, abs=1e-12)
        assert episode.turns[-1].info["metrics"] == pytest.approx({"exact": exact, "brevity": brevity, "answers": 1.0})
        assert episode.end_reason == "done"
    assert out.prompt_index == [0, 0, 1, 1] and out.stopped == [True] * 4
    assert isinstance(V1Run, type)


def test_multi_turn_episodes_mask_the_user_turns_between_the_sampled_ones(env_folder, tiny_models):
    from open_instruct.models import load_tokenizer

    spec = "verifiers:ask_env.py?num_tasks=1&turns=3"
    tokenizer = load_tokenizer(tiny_models["causal_lm"])
    cfg = config(tiny_models, spec)
    scripts = [["a", "b"], ["cc", "d"], ["yes", "no"]]  # three rounds, both episodes answering together
    rows, out, generator = play(cfg, tokenizer, spec, scripts, rows_used=1)
    assert generator.round == 3  # every round held both episodes' requests (one generate call per turn)
    for i, episode in enumerate(out.episodes):
        sampled = [generator.sampled[k][0][i] for k in range(3)]
        segments = [episode.response_ids[t.policy_start : t.policy_end] for t in episode.turns]
        assert segments == sampled  # each turn's trained ids are that round's sampled ids
        for k, turn in enumerate(episode.turns):
            assert episode.loss_mask[turn.policy_start : turn.policy_end] == [1] * len(sampled[k])
            observation = episode.response_ids[turn.policy_end : turn.observation_end]
            assert episode.loss_mask[turn.policy_end : turn.observation_end] == [0] * len(observation)
            if k < 2:  # the user turn between answers, as the renderer rendered it, masked
                assert f"once more ({k + 1})" in tokenizer.decode(observation)
                # what the generator got next is exactly the episode so far (prompt + response up to here)
                assert generator.prompts[k + 1][i] == episode.prompt_ids + episode.response_ids[: turn.observation_end]
        exact = float(["yes", "no"][i] == "yes")  # task 0's answer is "yes"
        brevity = 1.0 / (1 + len(scripts[0][i]) + len(scripts[1][i]) + len(scripts[2][i]))
        assert episode.turns[-1].reward == pytest.approx(exact + 0.5 * brevity, abs=1e-12)
        assert episode.turns[-1].info["metrics"]["answers"] == 3.0


class SpecialTokenGenerator(CharGenerator):
    """Each answer sampled with a special token after its first character (as a tiny model samples them), which the
    renderer's text drops: the re-rendered history re-tokenizes differently from the sampled ids."""

    def encode(self, text):
        ids = super().encode(text)
        return ids[:1] + [self.tokenizer.convert_tokens_to_ids("<|system|>")] + ids[1:]


def test_answers_that_re_tokenize_differently_are_generated_from_and_trained_as_sampled(env_folder, tiny_models):
    """The client re-renders the history from its text every turn, which drops a sampled special token: the next
    request is generated from the history as sampled (not as the client sent it), and every answer is one trained
    turn of one stream."""
    from open_instruct.models import load_tokenizer

    spec = "verifiers:ask_env.py?num_tasks=1&turns=3"
    tokenizer = load_tokenizer(tiny_models["causal_lm"])
    cfg = config(tiny_models, spec)
    scripts = [["ab", "cd"], ["ef", "gh"], ["yes", "no"]]
    rows, out, generator = play(cfg, tokenizer, spec, scripts, rows_used=1, generator_class=SpecialTokenGenerator)
    assert generator.round == 3
    special = tokenizer.convert_tokens_to_ids("<|system|>")
    for i, episode in enumerate(out.episodes):
        sampled = [generator.sampled[k][0][i] for k in range(3)]
        assert all(special in ids for ids in sampled)
        assert [episode.response_ids[t.policy_start : t.policy_end] for t in episode.turns] == sampled
        assert episode.truncations["untrained_turns"] == 0
        for k, turn in enumerate(episode.turns[:2]):
            history = episode.prompt_ids + episode.response_ids[: turn.observation_end]
            assert generator.prompts[k + 1][i] == history  # the model saw what is trained: the sampled ids
            assert f"once more ({k + 1})" in tokenizer.decode(
                episode.response_ids[turn.policy_end : turn.observation_end]
            )
        assert episode.turns[-1].info["metrics"]["answers"] == 3.0


def test_a_harness_that_rewrites_its_history_leaves_that_turn_untrained_and_counted(env_folder, tiny_models):
    """A harness that sends back an edited answer: that request is generated as sent (the recorded ids only stand
    in for an answer re-rendered with the sampled text), so the episode's stream ends at the first answer and the
    second is counted in untrained_turns."""
    from open_instruct.models import load_tokenizer

    spec = "verifiers:ask_env.py?num_tasks=1&turns=2&rewrite=true"
    tokenizer = load_tokenizer(tiny_models["causal_lm"])
    cfg = config(tiny_models, spec)
    rows, out, generator = play(cfg, tokenizer, spec, [["a", "b"], ["c", "d"]], rows_used=1)
    for i, episode in enumerate(out.episodes):
        assert [episode.response_ids[t.policy_start : t.policy_end] for t in episode.turns] == [
            generator.sampled[0][0][i]
        ]
        assert episode.truncations["untrained_turns"] == 1
        assert "(edited)" in tokenizer.decode(generator.prompts[1][i])  # generated from what the harness sent


def test_the_run_budgets_cut_the_episode_at_the_endpoint(env_folder, tiny_models):
    from open_instruct.models import load_tokenizer

    spec = "verifiers:ask_env.py?num_tasks=1&turns=3"
    tokenizer = load_tokenizer(tiny_models["causal_lm"])
    cfg = config(tiny_models, spec, "--max_turns", "2", "--max_turn_tokens", "3")
    rows, out, generator = play(cfg, tokenizer, spec, [["abcdef", "xy"], ["pqrs", "z"]], rows_used=1)
    assert generator.round == 2  # the third call is past max_turns: answered with no tokens, no generation
    for i, episode in enumerate(out.episodes):
        assert [episode.response_ids[t.policy_start : t.policy_end] for t in episode.turns] == [
            generator.sampled[k][0][i] for k in range(2)
        ]
        assert all(len(generator.sampled[k][0][i]) <= 3 for k in range(2))  # max_turn_tokens
        assert episode.end_reason == "max_turns"
    assert out.stopped == [False, False]


@pytest.fixture
def tool_model(tiny_models, tmp_path):
    """The tiny model's folder with `<tool_call>` and `</tool_call>` as special tokens (Hermes calls, as the
    renderer's qwen3 tool parser reads them); only the tokenizer is used (the generator is scripted)."""
    import shutil

    from transformers import AutoTokenizer

    folder = tmp_path / "tool_model"
    shutil.copytree(tiny_models["causal_lm"], folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    tokenizer.save_pretrained(folder)
    return {"causal_lm": str(folder)}


def test_a_tool_environment_runs_its_tool_server_and_masks_the_result(env_folder, tool_model):
    from open_instruct.models import load_tokenizer

    spec = "verifiers:tool_env?num_tasks=1&renderer.tool_parser=qwen3"
    tokenizer = load_tokenizer(tool_model["causal_lm"])
    cfg = config(tool_model, spec)
    call = '<tool_call>{"name": "calc_add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    rows, out, generator = play(cfg, tokenizer, spec, [[call, call], ["5", "6"]], 1, TextGenerator)
    assert generator.round == 2
    for i, episode in enumerate(out.episodes):
        turns = [episode.response_ids[t.policy_start : t.policy_end] for t in episode.turns]
        assert turns == [generator.sampled[0][0][i], generator.sampled[1][0][i]]
        first = episode.turns[0]
        observation = episode.response_ids[first.policy_end : first.observation_end]
        assert episode.loss_mask[first.policy_end : first.observation_end] == [0] * len(observation)
        assert "5" in tokenizer.decode(observation)  # the tool server's answer, masked
        assert generator.prompts[1][i] == episode.prompt_ids + episode.response_ids[: first.observation_end]
        assert episode.turns[-1].reward == float(i == 0)  # "5" is right, "6" is not
        assert episode.turns[-1].info["metrics"] == {"correct": float(i == 0), "calls": 2.0}


def test_an_environment_past_its_deadline_stops_the_run(env_folder, tiny_models):
    """Task 1's harness never asks the model: after environment_timeout with no request and no episode ending, the
    run stops saying so (task 0's episodes wait for the round that would hold task 1's requests)."""
    from open_instruct.models import load_tokenizer

    spec = "verifiers:ask_env.py?num_tasks=2&hang=true"
    tokenizer = load_tokenizer(tiny_models["causal_lm"])
    cfg = config(tiny_models, spec, "--environment_timeout", "1")
    with pytest.raises(ConfigError, match=r"no episode asked the model or ended within 1 s \(environment_timeout\)"):
        play(cfg, tokenizer, spec, [["yes"] * 4], rows_used=2)


def test_bad_specs_are_refused_before_any_model_loads(env_folder):
    from open_instruct import verifiers_v1

    (env_folder / "no_taskset.py").write_text("x = 1\n")
    with pytest.raises(ConfigError, match="exports no verifiers.v1 Taskset"):
        verifiers_v1.load("verifiers:no_taskset.py")
    with pytest.raises(ConfigError, match="runs here are offline"):
        verifiers_v1.load("verifiers:ask_env.py?agent.runtime.type=prime")
    with pytest.raises(ConfigError, match="uv over the network"):
        verifiers_v1.load("verifiers:tool_env?agent.harness.id=bash")
    with pytest.raises(ConfigError, match="loading the env raised"):
        verifiers_v1.load("verifiers:ask_env.py?no_such_field=1")


def test_an_env_file_in_a_folder_with_capitals_loads(env_folder):
    """verifiers.v1 imports a taskset by its id lower-cased: a file under a path with capitals (a clone in
    /home/Alice/..., CI's mktemp folder) loads, and two files whose paths differ only in case stay two modules."""
    from open_instruct import verifiers_v1
    from open_instruct.user_code import module_name_of_file

    for folder in ("CamelCase", "camelcase"):
        (env_folder / folder).mkdir()
        (env_folder / folder / "ask_env.py").write_text(HARNESS)
    source = verifiers_v1.load("verifiers:CamelCase/ask_env.py?num_tasks=3")
    assert len(source.tasks) == 3
    upper, lower = module_name_of_file("CamelCase/ask_env.py"), module_name_of_file("camelcase/ask_env.py")
    assert upper == upper.lower() and upper != lower


def test_the_start_checks_load_the_env_before_any_model_loads(env_folder, tiny_models, no_model_loads):
    from open_instruct.config import RLVRConfig, parse_config
    from open_instruct.preflight import check_inputs

    (env_folder / "no_taskset.py").write_text("x = 1\n")
    spec = "verifiers:ask_env.py"
    recipe = [os.path.join(REPO, "configs", "grpo_trl_defaults.yaml"), "--model_name_or_path", tiny_models["causal_lm"],
              "--total_episodes", "8"]  # fmt: skip
    check_inputs(parse_config(RLVRConfig, [*recipe, "--dataset_name_or_path", spec, "--environment", spec]))
    with pytest.raises(ConfigError, match="dataset_name_or_path 'verifiers:no_taskset.py': no_taskset.py exports no"):
        check_inputs(parse_config(RLVRConfig, [*recipe, "--dataset_name_or_path", "verifiers:no_taskset.py",
                                               "--environment", spec]))  # fmt: skip
    with pytest.raises(ConfigError, match="agent.runtime.type modal: runs here are offline"):
        bad = "verifiers:ask_env.py?agent.runtime.type=modal"
        check_inputs(parse_config(RLVRConfig, [*recipe, "--dataset_name_or_path", bad, "--environment", bad]))


def run_training(env_folder, tiny_models, spec):
    return train_environment(env_folder, tiny_models["causal_lm"], spec, 8, {})


def test_a_tool_environment_trains(env_folder, tiny_models):
    """The tool environment under the offline chat harness, its tool servers launched per rollout (the tiny
    tokenizer has no `<tool_call>` token, so the model answers without calling: the episodes are single turns)."""
    train = run_training(env_folder, tiny_models, "verifiers:tool_env?num_tasks=4&renderer.tool_parser=qwen3")
    assert [r["rollout_step"] for r in train] == [1, 2]
    for row in train:
        assert row["train/metric_calls"] == row["train/turns_per_episode"] == 1.0
        assert row["train/score_mean"] == pytest.approx(row["train/metric_correct"], abs=1e-9)  # weight 1


@pytest.mark.parametrize("turns", [1, 2])
def test_a_tiny_grpo_run_trains_and_logs_the_rewards(env_folder, tiny_models, turns):
    """Two rollouts of 8 episodes (single-turn, then two turns): every logged metric_<name> is the mean of what the
    task's functions returned (logged by the functions themselves) and the score their weighted sum."""
    train = run_training(env_folder, tiny_models, f"verifiers:ask_env.py?num_tasks=4&turns={turns}")
    assert [r["rollout_step"] for r in train] == [1, 2]
    values = values_logged(env_folder / "values.jsonl")
    by_fn = {name: [v for v in values if v["fn"] == name] for name in [*WEIGHTS, "answers"]}
    assert all(len(v) == 16 for v in by_fn.values())  # 16 episodes, each scored once
    for step, row in enumerate(train):
        for name, logged in by_fn.items():
            mine = logged[8 * step : 8 * step + 8]
            assert row[f"train/metric_{name}"] == pytest.approx(sum(v["value"] for v in mine) / 8, abs=1e-9)
        expected = sum(WEIGHTS[n] * v["value"] for n in WEIGHTS for v in by_fn[n][8 * step : 8 * step + 8]) / 8
        assert row["train/score_mean"] == pytest.approx(expected, abs=1e-6)  # verification_reward 1
        assert row["train/metric_answers"] == turns  # every episode asked the model `turns` times
        # every answer is a trained turn: the default renderer re-renders the history from its text each turn (the
        # tiny model's sampled ids re-tokenize differently), and the endpoint generates from the sampled ids instead
        assert row.get("train/truncated_untrained_turns", 0.0) == 0.0
        assert row["train/turns_per_episode"] == turns


EARLIER_API_ENV = """
import verifiers as vf
from datasets import Dataset


def load_environment(num_examples: int = 4):
    dataset = Dataset.from_list([{"question": "say yes", "answer": "yes"}] * num_examples)
    return vf.SingleTurnEnv(dataset=dataset, rubric=vf.Rubric(funcs=[lambda completion, answer, **kw: 1.0]))
"""
PORT_HINT = ("install verifiers==0.3.1 for this style, or port it to v1 "
             "(docs/environments.md#porting-an-earlier-api-environment-to-v1)")  # fmt: skip


def test_an_earlier_api_file_is_answered_with_the_release_that_runs_it_or_the_port(env_folder, tiny_models):
    """An environment in the earlier style (load_environment + SingleTurnEnv) under 0.4: the start refuses it (exit 2,
    before any model loads) naming verifiers==0.3.1 and the docs' porting section; so does one that touches the
    earlier API's names at import (`from verifiers import SingleTurnEnv`)."""
    import re
    import subprocess
    import sys

    from open_instruct import verifiers_v1

    (env_folder / "old_env.py").write_text(EARLIER_API_ENV)
    (env_folder / "old_import_env.py").write_text("from verifiers import SingleTurnEnv\n" + EARLIER_API_ENV)
    with pytest.raises(
        ConfigError, match="old_env.py is an environment in verifiers' earlier API .*" + re.escape(PORT_HINT)
    ):
        verifiers_v1.load("verifiers:old_env.py")
    with pytest.raises(
        ConfigError, match="cannot import name 'SingleTurnEnv' from 'verifiers'.*" + re.escape(PORT_HINT)
    ):
        verifiers_v1.load("verifiers:old_import_env.py")
    spec = "verifiers:old_env.py"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "open_instruct", "rlvr_ppo.py"),
         os.path.join(REPO, "configs", "grpo_trl_defaults.yaml"), "--model_name_or_path", tiny_models["causal_lm"],
         "--dataset_name_or_path", spec, "--environment", spec, "--output_dir", str(env_folder / "out"),
         "--total_episodes", "8"],
        cwd=env_folder, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([REPO, str(env_folder)]), "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert PORT_HINT in proc.stderr and "Loading checkpoint" not in proc.stderr


def test_the_docs_v1_example_runs_as_shown(tmp_path, tiny_models):
    """docs/environments.md shows docs/examples/add_env.py verbatim, and that file trains through the trainer on the
    tiny model (2 rollouts of 8 episodes under the offline chat harness): the logged score is its reward's mean and
    no sampled turn goes untrained."""
    example = os.path.join(REPO, "docs", "examples", "add_env.py")
    text = open(example).read()
    assert text in open(os.path.join(REPO, "docs", "environments.md")).read()
    train = train_environment(tmp_path, tiny_models["causal_lm"], f"verifiers:{example}?num_tasks=4", 8, {})
    assert [r["rollout_step"] for r in train] == [1, 2]
    for row in train:
        assert row["train/score_mean"] == pytest.approx(row["train/metric_correct"], abs=1e-9)  # weight 1
        assert row["train/turns_per_episode"] == 1.0 and row.get("train/truncated_untrained_turns", 0.0) == 0.0
        assert 0.0 <= row["train/metric_reply_chars"]
