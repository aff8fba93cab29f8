"""reasoning-gym tasks as data and verifier (open_instruct/reasoning_gym_tasks.py): the rows are the package's own
rows, every score is the package's own score_answer, scoring runs in the verifier worker process under the verifier
timeout, and the sources work in a mixture and a tiny RLVR run. Skipped where reasoning-gym is not installed (an
optional extra: pip install '.[envs]')."""

import json
import os

import pytest

reasoning_gym = pytest.importorskip("reasoning_gym")

from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer  # noqa: E402
from test_reward_functions_trl import command, run  # noqa: E402

from open_instruct import data, mixture, rewards  # noqa: E402
from open_instruct import reasoning_gym_tasks as rg  # noqa: E402
from open_instruct.errors import ConfigError, DataError  # noqa: E402

# Tasks with different scorers: exact match (leg_counting), the package's default partial credit (spell_backward),
# numeric parsing (basic_arithmetic), sympy's parse_expr on the answer (puzzle24, countdown).
TASKS = {
    "leg_counting": "size=30&seed=11",
    "spell_backward": "size=30&seed=12",
    "basic_arithmetic": "size=30&seed=13&min_terms=2&max_terms=3",
    "puzzle24": "size=8&seed=14",
    "countdown": "size=10&seed=15",
}
TIMEOUT = 30.0  # seconds per call: far above a scorer's milliseconds, so no call here times out


def completions_for(entry: dict) -> list[str]:
    """Right, wrong, partly right, untagged, and tagged inside a thinking block (only the text after the last
    </think> is read), so the scores cover 1.0, 0.0 and the package's partial credit."""
    answer = str(entry["answer"])
    return [
        f"Let me think.\n<answer>{answer}</answer>",
        "<answer>definitely not it</answer>",
        f"<answer>{answer} {answer}x</answer>",
        answer,
        f"<think><answer>{answer}</answer></think> so <answer>0</answer>",
        f"<think>hmm</think><answer> {answer} </answer>",
    ]


@pytest.mark.parametrize("task", sorted(TASKS))
def test_rows_and_scores_equal_the_packages_own(task):
    source = f"reasoning_gym:{task}?{TASKS[task]}"
    rows = rg.generate(source, "train")
    settings = dict(item.split("=") for item in TASKS[task].split("&"))
    config = {k: json.loads(v) for k, v in settings.items()}
    theirs = reasoning_gym.create_dataset(task, **config)
    assert len(rows) == len(theirs) == config["size"]
    scores = []
    for index, row in enumerate(rows):
        entry = theirs[index]
        assert row["messages"] == [
            {"role": "system", "content": SYSTEM_PROMPTS["default"]},
            {"role": "user", "content": entry["question"]},
        ]
        assert row["dataset"] == "reasoning_gym" and json.loads(row["ground_truth"])["answer"] == entry["answer"]
        for completion in completions_for(entry):
            after_thinking = completion.rsplit("</think>", 1)[-1]
            theirs_score = theirs.score_answer(extract_answer(after_thinking), entry)
            # clipped into [0, 1]: spell_backward sums 1/n n times (1.0000000000000002 for "<answer> <answer>x")
            expected = min(max(float(theirs_score), 0.0), 1.0)
            score, timed_out = rewards.run_verifier("reasoning_gym", completion, row["ground_truth"], timeout=TIMEOUT)
            assert (score, timed_out) == (expected, False), (index, completion)
            scores.append(score)
    assert scores[0::6] == [1.0] * len(rows)  # the right answer in tags always scores 1.0
    assert max(scores[3::6]) < 1.0  # no <answer> tag: the package scores None (0, or countdown's 0.01)
    assert max(scores[1::6]) < 1.0  # a wrong answer never scores 1.0


def test_scoring_runs_in_the_worker_process_not_the_trainers(tmp_path):
    """puzzle24's score_answer hands the answer to sympy's parse_expr, which evaluates it: model text that writes
    its process id to a file shows where it ran."""
    row = rg.generate("reasoning_gym:puzzle24?size=1&seed=3", "train")[0]
    marker = tmp_path / "pid.txt"
    pid = "__import__('os').getpid().__repr__()"  # sympy turns str() into its own Str
    attack = f"<answer>__import__('pathlib').Path({str(marker)!r}).write_text({pid})</answer>"
    score, timed_out = rewards.run_verifier("reasoning_gym", attack, row["ground_truth"], timeout=TIMEOUT)
    assert score < 1.0 and not timed_out
    assert marker.exists() and int(marker.read_text()) != os.getpid()


def test_a_scorer_past_the_timeout_scores_0_and_counts(monkeypatch):
    """The verifier's time limit holds for a reasoning-gym scorer: a parse_expr of a huge power (puzzle24) runs
    long; the worker's timer stops it."""
    row = rg.generate("reasoning_gym:puzzle24?size=1&seed=3", "train")[0]
    before = rewards.STATS["timeouts"]
    score, timed_out = rewards.run_verifier("reasoning_gym", "<answer>9**9**9**9</answer>", row["ground_truth"],
                                            timeout=0.5)  # fmt: skip
    assert (score, timed_out) == (0.0, True)
    assert rewards.STATS["timeouts"] == before + 1


def test_sources_splits_labels_and_seeds():
    rows = data.load_rows("reasoning_gym:leg_counting?size=5&system_prompt=none,basic_arithmetic?size=3")
    assert [r.label for r in rows] == ["leg_counting"] * 5 + ["basic_arithmetic"] * 3
    assert rows[0].data["messages"][0]["role"] == "user"  # system_prompt=none
    assert rows[5].data["messages"][0] == {"role": "system", "content": SYSTEM_PROMPTS["default"]}
    train = rg.generate("reasoning_gym:leg_counting?size=20", "train")
    test = rg.generate("reasoning_gym:leg_counting?size=20", "test")
    train_seed, test_seed = (json.loads(r[0]["ground_truth"])["seed"] for r in (train, test))
    assert train_seed != test_seed  # no seed given: the split picks it
    assert rg.generate("reasoning_gym:leg_counting?size=20", "train") == train  # and it is the same every time
    assert {r["messages"][1]["content"] for r in train} != {r["messages"][1]["content"] for r in test}
    assert rg.expand_sources("reasoning_gym:a?size=2,b,data/x.jsonl,c") == [
        "reasoning_gym:a?size=2", "reasoning_gym:b", "data/x.jsonl", "c"
    ]  # fmt: skip
    assert mixture.source_labels(["reasoning_gym:leg_counting?size=5"]) == ["leg_counting"]


def test_mixture_weights_tasks_like_any_source():
    mixer = ["reasoning_gym:leg_counting?size=10", "0.5", "reasoning_gym:basic_arithmetic?size=4", "12"]
    rows, per_source = data.load_mixture(mixer, "train", 1, "dataset_mixer_list")
    assert [(s["label"], s["available"], s["rows"]) for s in per_source] == [
        ("leg_counting", 10, 5), ("basic_arithmetic", 4, 12)
    ]  # fmt: skip
    assert len(rows) == 17


@pytest.mark.parametrize(
    "source, message",
    [
        ("reasoning_gym:leg_countin", "not a reasoning-gym .* task; did you mean leg_counting"),
        ("reasoning_gym:leg_counting?max_animal=3", "unknown setting 'max_animal' \\(did you mean 'max_animals'\\?\\)"),
        ("reasoning_gym:leg_counting?size=ten", "size must be an integer, got 'ten'"),
        ("reasoning_gym:leg_counting?size=0", "size must be >= 1"),
        ("reasoning_gym:leg_counting?seed", "'seed' is not key=value"),
        ("reasoning_gym:leg_counting?system_prompt=chatty", "system_prompt 'chatty' is not one of"),
        ("reasoning_gym:leg_counting?min_animals=9&max_animals=2", "the task's config refused these settings"),
    ],
)
def test_bad_specs_name_the_source(source, message):
    with pytest.raises(ConfigError, match=message):
        rg.parse(source, "train")


def test_held_out_set_with_the_train_seed_is_refused():
    rg.check_held_out(["reasoning_gym:leg_counting?seed=1"], ["reasoning_gym:leg_counting?seed=2"], "train", "test")
    rg.check_held_out(["reasoning_gym:leg_counting"], ["reasoning_gym:leg_counting"], "train", "test")
    with pytest.raises(DataError, match="uses the training source's seed 1 and settings"):
        rg.check_held_out(["reasoning_gym:leg_counting?seed=1"], ["reasoning_gym:leg_counting?seed=1"], "train", "test")


def test_a_bad_spec_exits_2_before_any_model_loads(tiny_models, tmp_path, capsys):
    argv = command(tiny_models["causal_lm"], "reasoning_gym:leg_countng", tmp_path / "out")
    assert run(argv) == 2
    assert "did you mean leg_counting" in capsys.readouterr().err


def test_tiny_rlvr_run_on_a_task_mixture_scores_with_the_package(tiny_models, tmp_path):
    """Two tasks mixed 1:2, a held-out split of each (other seeds); every logged sample's reward is the package's
    verdict on the logged completion, and the held-out correct rate is reported per task."""
    out = tmp_path / "out"
    train = ["reasoning_gym:leg_counting?size=4&system_prompt=none", "1.0",
             "reasoning_gym:spell_backward?size=4&system_prompt=none", "8"]  # fmt: skip
    held_out = ["reasoning_gym:leg_counting?size=2&system_prompt=none", "1.0",
                "reasoning_gym:spell_backward?size=2&system_prompt=none", "1.0"]  # fmt: skip
    argv = command(tiny_models["causal_lm"], "", out, "--dataset_mixer_list", *train,
                   "--eval_dataset_mixer_list", *held_out, "--eval_steps", "1", "--max_prompt_length", "400",
                   "--num_samples_logged", "8", "--total_episodes", "16")  # fmt: skip
    assert run(argv) == 0
    samples = [json.loads(line) for line in open(out / "samples.jsonl")]
    assert samples
    for sample in samples:
        data_, entry = rg.entry_of(sample["ground_truth"])
        verdict = data_.score_answer(extract_answer(sample["response"].rsplit("</think>", 1)[-1]), entry)
        assert sample["score"] == (1.0 if verdict >= 1.0 else 0.0)  # verification_reward 1
    metrics = [json.loads(line) for line in open(out / "metrics.jsonl")]
    evals = [m for m in metrics if "eval/leg_counting/correct_rate" in m]
    assert evals and all("eval/spell_backward/correct_rate" in m for m in evals)


def test_the_planner_counts_generated_rows():
    from open_instruct.plan import dataset_size

    size, where = dataset_size("reasoning_gym:leg_counting?size=20,basic_arithmetic?size=30", "train")
    assert (size, where) == (50, "the reasoning_gym sources' sizes")
    assert dataset_size("reasoning_gym:leg_counting", "train")[0] == rg.DEFAULT_SIZE
