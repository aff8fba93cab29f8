"""The data of the SmolLM2 reasoning-gym demo (demo/smollm2_reasoning_gym.py): training rows, SFT traces and held-out
rows are the package's own rows, every SFT trace is an answer the `reasoning_gym` verifier pays in full, and no
held-out question is a training question. Skipped where reasoning-gym is not installed (pip install '.[envs]')."""

import json

import pytest

reasoning_gym = pytest.importorskip("reasoning_gym")

from demo import smollm2_reasoning_gym as demo  # noqa: E402
from demo.pipeline import DemoError  # noqa: E402
from open_instruct import reasoning_gym_tasks as rg  # noqa: E402
from open_instruct.reasoning_gym_scoring import score_many  # noqa: E402

N_SFT, N_TRAIN, N_EVAL = 3, 12, 10


def read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return demo.write_data(str(tmp_path_factory.mktemp("data")), N_SFT, N_TRAIN, N_EVAL)


def package_entry(row):
    """The row's question and answer straight from reasoning_gym.create_dataset, by the seed and index it names."""
    truth = json.loads(row["ground_truth"])
    data = reasoning_gym.create_dataset(truth["task"], seed=truth["seed"], size=truth["size"], **truth["config"])
    return data[truth["index"]]


def test_training_rows_are_the_packages_train_split(files):
    rows = read(files["rl_train"])
    assert len(rows) == N_TRAIN * len(demo.TASKS)
    for k, task in enumerate(demo.TASKS):
        mine = rows[k * N_TRAIN : (k + 1) * N_TRAIN]
        assert mine == rg.generate(demo.source(task, N_TRAIN), "train")
        for row in mine:
            entry = package_entry(row)
            assert row["messages"][-1]["content"] == entry["question"]
            assert json.loads(row["ground_truth"])["answer"] == entry["answer"]
            assert row["messages"][0]["content"] == reasoning_gym.utils.SYSTEM_PROMPTS[demo.SYSTEM_PROMPT]


def test_sft_traces_are_training_prompts_answered_as_the_verifier_pays(files):
    traces, train = read(files["sft_train"]), read(files["rl_train"])
    assert len(traces) == N_SFT * len(demo.TASKS)
    texts, truths = [], []
    for k in range(len(demo.TASKS)):
        for trace, row in zip(traces[k * N_SFT : (k + 1) * N_SFT], train[k * N_TRAIN : (k + 1) * N_TRAIN]):
            assert trace["messages"][:-1] == row["messages"]
            reply = trace["messages"][-1]
            assert reply == {"role": "assistant", "content": f"<answer>{package_entry(row)['answer']}</answer>"}
            texts += [reply["content"], "<answer>not it</answer>"]
            truths += [row["ground_truth"]] * 2
    scores = [score for score, _ in score_many(texts, truths, timeout=30.0)]  # the verifier's sandboxed scoring
    assert scores[0::2] == [1.0] * (len(texts) // 2) and max(scores[1::2]) < 1.0


def test_held_out_rows_come_from_other_seeds_and_repeat_no_training_question(files):
    train = read(files["rl_train"])
    train_questions = {r["messages"][-1]["content"] for r in train}
    train_seeds = {json.loads(r["ground_truth"])["seed"] for r in train}
    for task in demo.TASKS:
        rows = read(files[task])
        assert len(rows) == N_EVAL
        assert {json.loads(r["ground_truth"])["task"] for r in rows} == {task}
        assert not {json.loads(r["ground_truth"])["seed"] for r in rows} & train_seeds
        assert not {r["messages"][-1]["content"] for r in rows} & train_questions
        for row in rows:
            assert row["messages"][-1]["content"] == package_entry(row)["question"]


def test_a_held_out_row_asking_a_training_question_is_left_out():
    task = next(iter(demo.TASKS))
    test_split = rg.generate(demo.source(task, demo.HELD_OUT_DRAWS * N_EVAL), "test")
    kept = demo.held_out_rows(task, N_EVAL, {test_split[0]["messages"][-1]["content"]})
    assert (
        kept
        == [r for r in test_split if r["messages"][-1]["content"] != test_split[0]["messages"][-1]["content"]][:N_EVAL]
    )
    with pytest.raises(DemoError, match="not training questions"):
        demo.held_out_rows(task, N_EVAL, {r["messages"][-1]["content"] for r in test_split})


def test_more_sft_traces_than_training_rows_is_refused(tmp_path):
    with pytest.raises(DemoError, match="--n_sft 5 > --n_train 4"):
        demo.write_data(str(tmp_path), 5, 4, 2)
