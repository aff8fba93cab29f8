"""`verifiers` environments (open_instruct/verifiers_env.py, the earlier API: load_environment() -> SingleTurnEnv /
ToolEnv with a Rubric) as RL environments: environments defined here (a single-turn one with weighted individual
and group-level reward functions, a tool one), their datasets as rows, episodes played token-in/token-out (the
trained ids are the sampled ids, observation ids masked), the rubric's weighted reward as the score and each of its
functions as a metric, equal to the functions' own values on the same completions; two tiny RL runs end to end.
Skipped where verifiers 0.1-0.3 is not installed (an optional extra; 0.4.0 ships only verifiers.v1)."""

from __future__ import annotations

import json
import os

import pytest

vf = pytest.importorskip("verifiers", reason="verifiers (0.1-0.3, the earlier API) is not installed")
if not hasattr(vf, "MultiTurnEnv"):
    pytest.skip(
        f"verifiers {vf.__version__} has only verifiers.v1 (the earlier API is 0.1-0.3)", allow_module_level=True
    )

from training_helpers import environment_config, train_environment  # noqa: E402

from open_instruct import verifiers_env  # noqa: E402
from open_instruct.errors import ConfigError  # noqa: E402
from open_instruct.generation import GenerationConfig, GenerationOutput  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WEIGHTS = {"exact": 1.0, "brevity": 0.5, "distinct": 0.25}

SINGLE_ENV = """
import json, os
import verifiers as vf
from datasets import Dataset

WORDS = ["yes", "no", "red", "blue"]


def _log(name, completions, values):
    if os.environ.get("VF_TEST_LOG"):
        with open(os.environ["VF_TEST_LOG"], "a") as f:
            for c, v in zip(completions, values):
                f.write(json.dumps({"fn": name, "text": c[-1].content or "", "value": v}) + "\\n")


def exact(completion, answer) -> float:
    value = float(answer in (completion[-1].content or ""))
    _log("exact", [completion], [value])
    return value


def brevity(completion) -> float:
    value = 1.0 / (1.0 + len(completion[-1].content or ""))
    _log("brevity", [completion], [value])
    return value


def distinct(completions) -> list[float]:  # group-level: 1 for a completion no other in its group repeats
    texts = [c[-1].content or "" for c in completions]
    values = [float(texts.count(t) == 1) for t in texts]
    _log("distinct", completions, values)
    return values


def load_environment(num_examples: int = 4):
    rows = [{"question": f"Say {w}.", "answer": w} for w in WORDS[:num_examples]]
    rubric = vf.Rubric(funcs=[exact, brevity, distinct], weights=[1.0, 0.5, 0.25])
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), eval_dataset=Dataset.from_list(rows[:1]),
                            system_prompt="Answer in one word.", rubric=rubric)
"""

TOOL_ENV = '''
import asyncio
import verifiers as vf
from datasets import Dataset


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


def correct(completion, answer) -> float:
    last = [m for m in completion if m.role == "assistant"][-1]
    return float(answer in (last.content or ""))


async def wait_forever() -> str:
    """Never returns."""
    await asyncio.Event().wait()


def load_environment(hang: bool = False):
    rows = [{"question": "What is 2+3?", "answer": "5"}, {"question": "What is 10+32?", "answer": "42"}]
    tools = [add, wait_forever] if hang else [add]
    return vf.ToolEnv(dataset=Dataset.from_list(rows), tools=tools, rubric=vf.Rubric(funcs=[correct]), max_turns=3)
'''

GAME_ENV = '''
import verifiers as vf
from datasets import Dataset


class Guess(vf.MultiTurnEnv):
    """Guess the number: a user turn says higher or lower; a right guess ends the game (its own stop condition);
    the third wrong guess gets a final response that ends it."""

    async def setup_state(self, state):
        state["wrong"] = 0
        return state

    @vf.stop
    async def guessed(self, state) -> bool:
        last = state["trajectory"][-1]["completion"][-1] if state["trajectory"] else None
        return last is not None and (last.content or "").strip() == state["answer"]

    async def env_response(self, messages, state, **kwargs):
        text = (messages[-1].content or "").strip()
        state["wrong"] += 1
        if state["wrong"] == 3:
            state["final_env_response"] = [vf.UserMessage(content="Out of guesses.")]
            return state["final_env_response"]
        hint = "higher" if text.isdigit() and int(text) < int(state["answer"]) else "lower"
        return [vf.UserMessage(content=hint)]


def won(completion, answer) -> float:
    return float(any(m.role == "assistant" and (m.content or "").strip() == answer for m in completion))


def speed(state) -> float:
    return 1.0 / len(state["trajectory"])


def fastest(states) -> list[float]:  # group-level: 1 for the group's shortest games
    turns = [len(s["trajectory"]) for s in states]
    return [float(t == min(turns)) for t in turns]


def load_environment():
    rows = [{"question": "Guess my number (1-9).", "answer": "7"}]
    rubric = vf.Rubric(funcs=[won, speed, fastest], weights=[1.0, 0.5, 0.25])
    return Guess(dataset=Dataset.from_list(rows), rubric=rubric, max_turns=4)
'''


@pytest.fixture
def env_folder(tmp_path, monkeypatch):
    (tmp_path / "single_env.py").write_text(SINGLE_ENV)
    (tmp_path / "tool_env.py").write_text(TOOL_ENV)
    (tmp_path / "game_env.py").write_text(GAME_ENV)
    monkeypatch.chdir(tmp_path)
    return tmp_path


class CharGenerator:
    """The Generator contract's generate(): round k's i-th request gets scripts[k][i] spelled ONE TOKEN PER
    CHARACTER (the tiny tokenizer's ids; a special token's text such as "<|user|>" stays characters, which
    decode->encode would merge into the special token) + the end-of-turn id; it records what it returned."""

    def __init__(self, tokenizer, scripts):
        self.tokenizer, self.scripts, self.round, self.sampled = tokenizer, scripts, 0, []

    def char_ids(self, text):
        return [self.tokenizer.convert_tokens_to_ids(c) for c in text]

    def generate(self, prompt_ids, config, max_new_tokens=None):
        texts = self.scripts[self.round]
        self.round += 1
        assert len(texts) == len(prompt_ids) and config.n == 1
        ids = [(self.char_ids(t) + [self.tokenizer.eos_token_id])[:cap] for t, cap in zip(texts, max_new_tokens)]
        self.sampled.append(ids)
        return GenerationOutput(
            prompt_ids=[list(p) for p in prompt_ids], response_ids=ids,
            texts=[self.tokenizer.decode(r, skip_special_tokens=True) for r in ids], stopped=[True] * len(ids),
            prompt_index=list(range(len(ids))), logprobs=[[-0.1 * (j + 1) for j in range(len(r))] for r in ids],
            weight_versions=[[0] * len(r) for r in ids],
        )  # fmt: skip


def verifiers_own_scores(spec, index, scripts):
    """verifiers' own rollout loop and scoring (Environment.run_group) of dataset row `index`, one rollout per
    script, its model client answering each turn with the script's text (parsed as the adapter parses a turn):
    per rollout (reward, metrics), what verifiers itself makes of the same completions."""
    from verifiers.clients.client import Client
    from verifiers.types import Response

    class Scripted(Client):
        def __init__(self):
            super().__init__(None)
            self.left, self.by_rollout = list(scripts), {}

        async def get_response(self, prompt, model, sampling_args, tools=None, **kwargs):
            state = kwargs["state"]
            if state["trajectory_id"] not in self.by_rollout:  # rollouts start in order (asyncio.gather)
                self.by_rollout[state["trajectory_id"]] = self.left.pop(0)
            turn = len(state["trajectory"])
            text = self.by_rollout[state["trajectory_id"]][turn]
            message = verifiers_env.assistant_message(text, bool(tools), turn)
            return Response(id=f"turn-{turn}", created=0, model=model, message=message)

    def unused(*args, **kwargs):
        raise AssertionError("the scripted client answers through get_response only")

    for name in Scripted.__abstractmethods__:
        setattr(Scripted, name, unused)
    Scripted.__abstractmethods__ = frozenset()
    env = verifiers_env.load(spec)
    row = env.get_dataset()[index]
    outputs = verifiers_env.run(env.run_group([row] * len(scripts), Scripted(), "policy", {}))
    return [(o["reward"], o["metrics"]) for o in outputs]


def config(tiny_models, spec, *extra):
    return environment_config(tiny_models["causal_lm"], spec, 120, *extra)


def prompt_rows(spec, tokenizer, environments, split="train"):
    """The rows the trainer gets of a verifiers source (what data.py's prompt encoding leaves for environments)."""
    rows = []
    for i, row in enumerate(verifiers_env.generate(spec, split)):
        example = {**row, "verifier": row["dataset"]}
        r = {"ground_truth": row["ground_truth"], "verifier": row["dataset"], "where": f"row {i}", "example": example}
        rows.append({**r, "prompt_ids": environments.prompt_ids(r)})
    return rows


def play(cfg, tokenizer, spec, scripts, rows_used, split="train", n=2):
    from open_instruct.rollouts import environment_run

    environments = environment_run(cfg, tokenizer)
    rows = prompt_rows(spec, tokenizer, environments, split)[:rows_used]
    generator = CharGenerator(tokenizer, scripts)
    return rows, environments.play(generator, rows, GenerationConfig(n=n, seed=5)), generator


def policy_segments(episode):
    return [episode.response_ids[t.policy_start : t.policy_end] for t in episode.turns]


def test_single_turn_environment_scores_with_its_rubric_and_keeps_the_sampled_tokens(env_folder, tiny_models):
    from open_instruct.episodes import episode_metrics
    from open_instruct.models import load_tokenizer
    from open_instruct.rollouts import score_rollout

    spec = "verifiers:single_env.py?num_examples=2"
    tokenizer = load_tokenizer(tiny_models["causal_lm"])
    cfg = config(tiny_models, spec, "--verification_reward", "2.0")
    # row 0 (answer "yes"): "yes" twice (not distinct); row 1 ("no"): "no <|user|>" and "maybe"
    texts = ["yes", "yes", "no <|user|>", "maybe"]
    rows, out, generator = play(cfg, tokenizer, spec, [texts], rows_used=2)

    assert rows[0]["prompt_ids"] == tokenizer.apply_chat_template(
        [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Say yes."}],
        add_generation_prompt=True, tokenize=True, return_dict=False,
    )  # fmt: skip
    # token-in/token-out: each episode's response is exactly the ids the generator sampled, all trained
    for episode, sampled in zip(out.episodes, generator.sampled[0]):
        assert episode.response_ids == sampled and episode.loss_mask == [1] * len(sampled)
        assert episode.sampler_logprobs == pytest.approx([-0.1 * (j + 1) for j in range(len(sampled))])
    special = out.episodes[2].response_ids
    assert tokenizer(tokenizer.decode(special), add_special_tokens=False)["input_ids"] != special  # not re-encoded

    answers = ["yes", "yes", "no", "no"]
    distinct = [0.0, 0.0, 1.0, 1.0]
    expected = []
    for text, answer, d in zip(texts, answers, distinct):
        values = {"exact": float(answer in text), "brevity": 1 / (1 + len(text)), "distinct": d}
        expected.append(values)
    rewards = [sum(WEIGHTS[k] * v for k, v in values.items()) for values in expected]
    scored = score_rollout(cfg, out, [r["example"] for r in rows for _ in range(2)], tokenizer)
    assert scored.rewards == pytest.approx([2.0 * r for r in rewards], abs=1e-12)  # x verification_reward
    pass_threshold = 0.5  # verifiers' default: correct = reward >= pass_threshold
    assert scored.correct == [r >= pass_threshold for r in rewards]
    for episode, values in zip(out.episodes, expected):
        assert {k: episode.turns[-1].info["metrics"][k] for k in WEIGHTS} == pytest.approx(values, abs=1e-12)
    own = verifiers_own_scores(spec, 0, [[t] for t in texts[:2]]) + verifiers_own_scores(
        spec, 1, [[t] for t in texts[2:]]
    )
    assert [(r, e.turns[-1].info["metrics"]) for r, e in zip(rewards, out.episodes)] == own

    class OneProcess:
        num_processes = 1

    stats = episode_metrics(OneProcess(), out.episodes, "train/")
    for name in WEIGHTS:
        assert stats[f"train/metric_{name}"] == pytest.approx(sum(v[name] for v in expected) / 4, abs=1e-12)
    assert stats["train/metric_num_turns"] == 1.0


def test_tool_environment_runs_its_tools_and_masks_their_output(env_folder, tiny_models):
    from open_instruct.models import load_tokenizer
    from open_instruct.rollouts import score_rollout

    spec = "verifiers:tool_env.py"
    tokenizer = load_tokenizer(tiny_models["causal_lm"])
    cfg = config(tiny_models, spec)
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    bad_call = '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
    # episode 0: a call, then "It is 5." (right); 1: "6" (wrong, no call); 2: a call missing an argument (the
    # environment's own error message comes back), then "42" (right); 3: "42" at once
    scripts = [[call, "6", bad_call, "42"], ["It is 5.", "42"]]
    rows, out, generator = play(cfg, tokenizer, spec, scripts, rows_used=2)
    assert [len(e.turns) for e in out.episodes] == [2, 1, 2, 1]

    first, second = generator.sampled[0][0], generator.sampled[1][0]
    episode = out.episodes[0]
    assert policy_segments(episode) == [first, second]  # the sampled ids, unchanged
    observation = episode.response_ids[len(first) : episode.turns[0].observation_end]
    assert episode.loss_mask == [1] * len(first) + [0] * len(observation) + [1] * len(second)
    # after the turn's end: the template's separator, the tool turn with the tool's answer, the next header; masked
    assert tokenizer.decode(observation) == "\n<|tool|>\n5<|end|>\n<|assistant|>\n"
    assert episode.turns[0].info["tool_calls"] == 1

    error = tokenizer.decode(out.episodes[2].response_ids[len(generator.sampled[0][2]) :])
    assert "missing 1 required positional argument: 'b'" in error  # the environment's own error formatter

    scored = score_rollout(cfg, out, [r["example"] for r in rows for _ in range(2)], tokenizer)
    assert scored.rewards == [1.0, 0.0, 1.0, 1.0]
    metrics = [e.turns[-1].info["metrics"] for e in out.episodes]
    assert [m["total_tool_calls"] for m in metrics] == [1.0, 0.0, 1.0, 0.0]  # ToolEnv's own (weight 0) metrics
    assert [m["num_turns"] for m in metrics] == [2.0, 1.0, 2.0, 1.0]
    own = verifiers_own_scores(spec, 0, [[call, "It is 5."], ["6"]]) + verifiers_own_scores(
        spec, 1, [[bad_call, "42"], ["42"]]
    )
    assert list(zip(scored.rewards, metrics)) == own  # verification_reward 1


def test_multi_turn_environment_with_its_own_stop_and_final_response(env_folder, tiny_models):
    from open_instruct.models import load_tokenizer
    from open_instruct.rollouts import score_rollout

    spec = "verifiers:game_env.py"
    tokenizer = load_tokenizer(tiny_models["causal_lm"])
    cfg = config(tiny_models, spec)
    # episode 0: 3 ("higher"), then 7 (its stop condition); episode 1: 9 ("lower"), 1 ("higher"), 2 (the final
    # response "Out of guesses." ends the game: the policy never sees it)
    scripts = [["3", "9"], ["7", "1"], ["2"]]
    rows, out, generator = play(cfg, tokenizer, spec, scripts, rows_used=1)
    first, second = out.episodes
    assert policy_segments(first) == [generator.sampled[0][0], generator.sampled[1][0]]
    assert policy_segments(second) == [generator.sampled[0][1], generator.sampled[1][1], generator.sampled[2][0]]
    hints = [second.response_ids[t.policy_end : t.observation_end] for t in second.turns]
    assert [tokenizer.decode(h) for h in hints] == ["\n<|user|>\nlower<|end|>\n<|assistant|>\n",
                                                    "\n<|user|>\nhigher<|end|>\n<|assistant|>\n", ""]  # fmt: skip
    assert "Out of guesses" not in tokenizer.decode(second.response_ids)
    assert [e.end_reason for e in out.episodes] == ["done", "done"]

    scored = score_rollout(cfg, out, [r["example"] for r in rows for _ in range(2)], tokenizer)
    assert scored.rewards == [1.0 + 0.5 / 2 + 0.25, 0.5 / 3]
    metrics = [e.turns[-1].info["metrics"] for e in out.episodes]
    assert list(zip(scored.rewards, metrics)) == verifiers_own_scores(spec, 0, [["3", "7"], ["9", "1", "2"]])


ASKS_ENV = """
import verifiers as vf
from datasets import Dataset


class AsksTheModel(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        response = await self.get_model_response(state, messages)  # sampling the policy outside the run's generator
        return [vf.UserMessage(content=response.message.content or "")]


def nothing(completion) -> float:
    return 0.0


def load_environment():
    rows = [{"question": "Hi.", "answer": "x"}]
    return AsksTheModel(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[nothing]), max_turns=3)
"""


def test_an_environment_that_samples_the_model_itself_stops_the_run(env_folder, tiny_models):
    from open_instruct.models import load_tokenizer

    (env_folder / "asks_env.py").write_text(ASKS_ENV)
    spec = "verifiers:asks_env.py"
    tokenizer = load_tokenizer(tiny_models["causal_lm"])
    message = (
        r"Verifiers\[asks_env.py\].step raised ModelCallRefused: this verifiers environment called its model client"
    )
    with pytest.raises(ConfigError, match=message):
        play(config(tiny_models, spec), tokenizer, spec, [["hello"] * 2], rows_used=1)


def test_a_tool_past_the_environment_deadline_stops_the_run(env_folder, tiny_models):
    from open_instruct.models import load_tokenizer

    spec = "verifiers:tool_env.py?hang=true"
    tokenizer = load_tokenizer(tiny_models["causal_lm"])
    cfg = config(tiny_models, spec, "--environment_timeout", "0.5")
    call = '<tool_call>{"name": "wait_forever", "arguments": {}}</tool_call>'
    message = r"environment Verifiers\[tool_env.py\].step did not return within 0.5 s \(environment_timeout\) on row 0"
    with pytest.raises(ConfigError, match=message):
        play(cfg, tokenizer, spec, [[call, "6"]], rows_used=1)


def test_bad_specs_fail_before_any_model_loads(env_folder):
    (env_folder / "no_loader.py").write_text("x = 1\n")
    (env_folder / "raises.py").write_text("def load_environment():\n    raise RuntimeError('no data here')\n")
    with pytest.raises(ConfigError, match="no_loader.py has no load_environment"):
        verifiers_env.load("verifiers:no_loader.py")
    with pytest.raises(ConfigError, match=r"load_environment\(\{\}\) raised RuntimeError: no data here"):
        verifiers_env.load("verifiers:raises.py")
    with pytest.raises(ConfigError, match="does not exist"):
        verifiers_env.load("verifiers:missing.py")
    assert verifiers_env.parse("verifiers:m.py?num_examples=3&name=x") == ("m.py", {"num_examples": 3, "name": "x"})
    with pytest.raises(ConfigError, match="arguments after '\\?' must be key=value"):
        verifiers_env.parse("verifiers:m.py?num_examples")


def test_the_start_checks_load_the_source_and_want_its_environment(env_folder, tiny_models):
    from open_instruct.config import RLVRConfig, parse_config
    from open_instruct.preflight import check_inputs

    spec = "verifiers:single_env.py"
    recipe = [os.path.join(REPO, "configs", "grpo_trl_defaults.yaml"), "--model_name_or_path", tiny_models["causal_lm"],
              "--total_episodes", "8"]  # fmt: skip
    check_inputs(parse_config(RLVRConfig, [*recipe, "--dataset_name_or_path", spec, "--environment", spec]))
    with pytest.raises(ConfigError, match="add --environment verifiers:<the same>"):
        check_inputs(parse_config(RLVRConfig, [*recipe, "--dataset_name_or_path", spec]))
    with pytest.raises(ConfigError, match="dataset_name_or_path 'verifiers:nowhere.py': file 'nowhere.py' does not"):
        check_inputs(parse_config(RLVRConfig, [*recipe, "--dataset_name_or_path", "verifiers:nowhere.py",
                                               "--environment", spec]))  # fmt: skip


def test_held_out_episodes_are_groups_of_one(env_folder, tiny_models):
    """Evaluation plays one episode per held-out prompt: each is its own group (the group-level function sees one
    completion), scored as verifiers scores a group of one."""
    from open_instruct.models import load_tokenizer

    spec = "verifiers:single_env.py"
    tokenizer = load_tokenizer(tiny_models["causal_lm"])
    rows, out, _ = play(config(tiny_models, spec), tokenizer, spec, [["yes"]], rows_used=1, split="test", n=1)
    [episode] = out.episodes
    assert episode.turns[-1].reward == 1.0 + 0.5 / 4 + 0.25 and episode.turns[-1].info["correct"] is True
    assert [(episode.turns[-1].reward, episode.turns[-1].info["metrics"])] == verifiers_own_scores(spec, 0, [["yes"]])


def test_eval_split_is_the_environments_eval_dataset(env_folder):
    train = verifiers_env.generate("verifiers:single_env.py", "train")
    held_out = verifiers_env.generate("verifiers:single_env.py", "test")
    assert len(train) == 4 and len(held_out) == 1
    assert json.loads(held_out[0]["ground_truth"])["answer"] == "yes"
    with pytest.raises(Exception, match="has no eval_dataset"):
        verifiers_env.generate("verifiers:tool_env.py", "test")


def run_training(env_folder, tiny_models, spec, log):
    return train_environment(env_folder, tiny_models["causal_lm"], spec, 12, {"VF_TEST_LOG": str(log)})


def test_a_single_turn_environment_trains_and_logs_its_rubric(env_folder, tiny_models):
    """Two rollouts of 8 episodes: every logged metric_<fn> is the mean of the values the rubric's functions
    returned (logged by the functions themselves), and the score is their weighted sum."""
    log = env_folder / "values.jsonl"
    train = run_training(env_folder, tiny_models, "verifiers:single_env.py", log)
    assert [r["rollout_step"] for r in train] == [1, 2]
    values = [json.loads(line) for line in open(log)]
    by_fn = {name: [v for v in values if v["fn"] == name] for name in WEIGHTS}
    assert all(len(v) == 16 for v in by_fn.values())  # 16 episodes, each scored once, nothing else scored
    for v in by_fn["brevity"]:
        assert v["value"] == 1 / (1 + len(v["text"]))
    for step, row in enumerate(train):
        for name in WEIGHTS:
            mine = by_fn[name][8 * step : 8 * step + 8]
            assert row[f"train/metric_{name}"] == pytest.approx(sum(v["value"] for v in mine) / 8, abs=1e-9)
        expected = sum(WEIGHTS[n] * v["value"] for n in WEIGHTS for v in by_fn[n][8 * step : 8 * step + 8]) / 8
        assert row["train/score_mean"] == pytest.approx(expected, abs=1e-6)  # verification_reward 1


def test_a_tool_environment_trains(env_folder, tiny_models):
    train = run_training(env_folder, tiny_models, "verifiers:tool_env.py", env_folder / "unused.jsonl")
    assert [r["rollout_step"] for r in train] == [1, 2]
    for row in train:
        assert 0.0 <= row["train/metric_correct"] <= 1.0
        assert row["train/score_mean"] == pytest.approx(row["train/metric_correct"], abs=1e-6)  # weight 1
        assert row["train/metric_num_turns"] == pytest.approx(row["train/turns_per_episode"], abs=1e-6)
