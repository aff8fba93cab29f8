"""The SmolLM2 calculator demo's word problems (demo/word_problems.py): every problem's expression computes its
answer, held-out sets share no phrasing family, template or distractor sentence with training, held-out-only shapes
never reach training, and the call analysis classifies hand-written episodes as a reader would."""

from __future__ import annotations

import collections
import json
import random
import re

import pytest

from demo.word_problems import (
    HELD_OUT_DISTRACTORS,
    HELD_OUT_FAMILIES,
    MORE_SHAPE_TEMPLATES,
    MORE_TRAIN_FAMILIES,
    SHAPE_OPS,
    SPLITS,
    TRAIN_DISTRACTORS,
    TRAIN_FAMILIES,
    TWO_STEP_HELD_OUT_ONLY,
    TWO_STEP_MORE_TRAINED,
    calculator_traces,
    call_report,
    chained_steps,
    episode_analysis,
    grouped_expression,
    text_order_expression,
    training_split,
    word_problem,
    word_problem_rows,
)
from open_instruct.environments import calculate


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_every_problem_is_consistent(split):
    rng = random.Random(split)
    spec = SPLITS[split]
    for _ in range(500):
        p = word_problem(rng, split)
        assert int(calculate(p["expression"])) == p["answer"] > 0
        assert p["family"] in spec["families"] and p["shape"] in spec["shapes"]
        assert set(p["ops"]) == {c for c in p["expression"] if c in "+-*"} == set(SHAPE_OPS[p["shape"]])
        numbers = [int(t) for t in p["question"].replace(".", " ").replace("?", " ").replace(",", " ").split()
                   if t.isdigit()]  # fmt: skip
        # every operand is in the question, and nothing else but the distractor
        assert sorted(numbers) == sorted(p["operands"] + ([p["distractor"]] if p["distractor"] is not None else []))
        if p["distractor"] is not None:
            assert p["distractor"] not in p["operands"] and p["distractor"] != p["answer"]
            sentences = [s.format(n="", d=p["distractor"]).strip() for s in spec["distractors"]]
            assert any(s.split(str(p["distractor"]))[-1] in p["question"] for s in sentences)
        assert p["question"].endswith("?")  # the question stays last, after any distractor
        written = p["text_order_expression"]
        assert int(calculate(written)) == p["answer"] and sorted(written) == sorted(p["expression"])
        if "-" not in p["ops"]:  # sums and products: the operands as the question states them
            stated = [n for n in numbers if n != p["distractor"]]
            assert [int(t) for t in re.findall(r"\d+", written)] == stated
        elif p["shape"] == "sub":  # a difference keeps its order, whatever the wording
            assert written == p["expression"]


@pytest.mark.parametrize(
    "template, shape, slots, written",
    [
        ("Full trays: {x}. Eggs per tray: {y}. Loose eggs: {c}. Eggs in total?", "mul_add",
         {"x": 5, "y": 43, "c": 207}, "5*43+207"),
        ("{n} had {c} {it}. Then {n} bought {x} boxes with {y} {it} in each box.", "mul_add",
         {"x": 5, "y": 43, "c": 207}, "207+5*43"),
        ("{n} has {y} {it}. {m} has {x} times as many as {n}, and {c} more.", "mul_add",
         {"x": 5, "y": 43, "c": 207}, "43*5+207"),
        ("A shop packs {it} into crates of {y}. How many {it} are in {x} crates?", "mul", {"x": 7, "y": 24}, "24*7"),
        ("Take {b} away from {a}. What is left?", "sub", {"a": 30, "b": 12}, "30-12"),
        ("Necklaces: {x}. Red beads: {a}. Blue beads: {b}.", "add_mul", {"a": 11, "b": 12, "x": 3}, "3*(11+12)"),
        ("Cards: {c}. Packs sold: {x}. Cards per pack: {y}.", "mul_sub", {"x": 4, "y": 20, "c": 500}, "500-4*20"),
        ("{n} bakes {x} batches of {a} {it}, and {b} {it} in each batch burn.", "sub_mul", {"a": 40, "b": 15, "x": 6},
         "6*(40-15)"),
        ("Subtract {b} from {a}, then multiply by {x}.", "sub_mul", {"a": 40, "b": 15, "x": 6}, "(40-15)*6"),
        ("{n} has {y} {it}. {m} has {x} times as many as {n}, and {k} has {c} fewer than {m}.", "mul_less",
         {"x": 5, "y": 43, "c": 100}, "43*5-100"),
    ],
)  # fmt: skip
def test_text_order_expression_worked_by_hand(template, shape, slots, written):
    assert text_order_expression(template, shape, slots) == written


@pytest.mark.parametrize("text_order", [False, True])
def test_chained_steps_of_either_expression_worked_by_hand(text_order):
    problem = {"shape": "mul_add", "expression": "207+5*43", "text_order_expression": "5*43+207", "answer": 422}
    assert chained_steps(problem, text_order) == [("5*43", 215), ("215+207" if text_order else "207+215", 422)]
    problem = {"shape": "add_mul", "expression": "(11+12)*3", "text_order_expression": "3*(11+12)", "answer": 69}
    assert chained_steps(problem, text_order) == [("11+12", 23), ("3*23" if text_order else "23*3", 69)]
    problem = {"shape": "sub_mul", "expression": "(40-15)*6", "text_order_expression": "6*(40-15)", "answer": 150}
    assert chained_steps(problem, text_order) == [("40-15", 25), ("6*25" if text_order else "25*6", 150)]
    problem = {"shape": "mul_less", "expression": "5*43-100", "text_order_expression": "43*5-100", "answer": 115}
    assert chained_steps(problem, text_order) == [("43*5" if text_order else "5*43", 215), ("215-100", 115)]


@pytest.mark.parametrize("text_order", [False, True])
def test_grouped_expression_brackets_the_first_step_worked_by_hand(text_order):
    problem = {"shape": "mul_add", "expression": "207+5*43", "text_order_expression": "5*43+207", "answer": 422}
    assert grouped_expression(problem, text_order) == ("(5*43)+207" if text_order else "207+(5*43)")
    problem = {"shape": "add_sub", "expression": "577+818-753", "text_order_expression": "818+577-753"}
    assert grouped_expression(problem, text_order) == ("(818+577)-753" if text_order else "(577+818)-753")
    problem = {"shape": "mul_less", "expression": "5*43-100", "text_order_expression": "43*5-100"}
    assert grouped_expression(problem, text_order) == ("(43*5)-100" if text_order else "(5*43)-100")
    problem = {"shape": "add_mul", "expression": "(11+12)*3", "text_order_expression": "3*(11+12)"}
    assert grouped_expression(problem, text_order) == ("3*(11+12)" if text_order else "(11+12)*3")  # as it was
    problem = {"shape": "add", "expression": "447+804", "text_order_expression": "804+447"}
    assert grouped_expression(problem, text_order) == ("804+447" if text_order else "447+804")


def test_grouped_traces_differ_from_text_order_ones_by_the_first_steps_brackets_only():
    def call(row: dict) -> str:
        return row["messages"][1]["tool_calls"][0]["function"]["arguments"]["expression"]

    kw = dict(two_step_share=0.5, text_order=True, split="train_varied")
    plain, grouped = (calculator_traces(200, 0, "word", grouped=g, **kw) for g in (False, True))
    two_step = 0
    for a, b in zip(plain, grouped):
        no_call = [[m for m in row["messages"] if "tool_calls" not in m] for row in (a, b)]
        assert no_call[0] == no_call[1]  # the question, the tool's result and the answer
        assert call(b).replace("(", "").replace(")", "") == call(a) and calculate(call(b)) == calculate(call(a))
        if len(re.findall(r"[-+*]", call(a))) == 2:  # a two-step call: its first step, and only that, in brackets
            two_step += 1
            inside = re.fullmatch(r"[^()]*\((\d+[-+*]\d+)\)[^()]*", call(b))
            assert inside, call(b)
            # the product when there is one (c+x*y, x*y-c), else the leading sum (a+b-c)
            assert ("*" in inside.group(1)) if "*" in call(a) else call(b).startswith("(" + inside.group(1))
        else:
            assert call(b) == call(a)
    assert 70 < two_step < 130  # half of 200 two-step: 100, within 4 binomial sd (7.1)
    with pytest.raises(ValueError, match="one-call"):
        calculator_traces(4, 0, "word", chain=True, grouped=True)


def templates(families: dict) -> set[str]:
    return {t for shapes in families.values() for ts in shapes.values() for t in ts}


def test_held_out_shares_no_family_template_or_distractor_with_training():
    assert not (set(TRAIN_FAMILIES) | set(MORE_TRAIN_FAMILIES)) & set(HELD_OUT_FAMILIES)
    train_templates = templates(TRAIN_FAMILIES) | templates(MORE_TRAIN_FAMILIES)
    assert not train_templates & templates(HELD_OUT_FAMILIES)
    assert not set(TRAIN_DISTRACTORS) & set(HELD_OUT_DISTRACTORS)
    shapes = collections.Counter(word_problem(random.Random(i), "train")["shape"] for i in range(3000))
    assert not set(shapes) & set(TWO_STEP_HELD_OUT_ONLY)
    # training draws every family and trained shape; a quarter carry a distractor
    rows = word_problem_rows(2000, 0, "train")
    assert {r["problem"]["family"] for r in rows} == set(TRAIN_FAMILIES)
    share = sum(r["problem"]["distractor"] is not None for r in rows) / len(rows)
    assert 0.2 < share < 0.3  # 0.25 +- 5 binomial standard deviations (sd = 0.0097)
    two_step = word_problem_rows(400, 1000, "two_step")
    assert {r["problem"]["shape"] for r in two_step} >= set(TWO_STEP_HELD_OUT_ONLY)


def test_rows_depend_on_the_seed_only():
    a, b, c = (word_problem_rows(50, s, "one_step", "SYS") for s in (7, 7, 8))
    assert a == b and a != c
    assert a[0]["messages"][0] == {"role": "system", "content": "SYS"}
    assert all(r["ground_truth"] == str(r["problem"]["answer"]) and r["dataset"] == "arithmetic" for r in a)


@pytest.mark.parametrize("task", ["symbolic", "word"])
def test_calculator_traces_call_the_problem_expression(task):
    for row in calculator_traces(60, 0, task):
        user, call, tool, answer = row["messages"]
        expression = call["tool_calls"][0]["function"]["arguments"]["expression"]
        assert tool["content"] == answer["content"] == calculate(expression)
        assert (expression in user["content"]) == (task == "symbolic")


@pytest.mark.parametrize("text_order", [False, True])
@pytest.mark.parametrize("split", ["train", "two_step"])
def test_chained_steps_compute_the_answer_one_step_at_a_time(split, text_order):
    """Each two-step problem: two calls, the first on two of the problem's numbers with one of its operations, the
    second on that call's result and the remaining number with the other; one-step problems: their expression."""
    rng = random.Random(5)
    shapes = collections.Counter()
    for _ in range(300):
        p = word_problem(rng, split)
        steps = chained_steps(p, text_order)
        shapes[p["shape"]] += 1
        assert steps[-1][1] == p["answer"] and all(calculate(e) == str(r) for e, r in steps)
        if len(p["ops"]) == 1:
            assert steps == [(p["text_order_expression" if text_order else "expression"], p["answer"])]
            continue
        (first, inner), (second, _) = steps
        assert sorted(int(t) for t in first.replace("*", " ").replace("+", " ").split()) != sorted(p["operands"])
        assert str(inner) in second.split(second.strip("0123456789")[0])  # the first result is an operand
        assert {ch for ch in first + second if ch in "+-*"} == set(p["ops"])
    assert len(shapes) == (5 if split == "train" else 4)


def test_chained_traces_call_twice_on_two_step_problems():
    rows = calculator_traces(40, 0, "word", chain=True, two_step_share=0.5)
    lengths = collections.Counter(len(r["messages"]) for r in rows)
    assert set(lengths) == {4, 6} and 10 <= lengths[6] <= 30  # 40 draws at 1/2: 20 +- 3.2 sd
    for r in rows:
        calls = [m["tool_calls"][0]["function"]["arguments"]["expression"]
                 for m in r["messages"] if m.get("tool_calls")]  # fmt: skip
        results = [m["content"] for m in r["messages"] if m["role"] == "tool"]
        assert [calculate(e) for e in calls] == results and results[-1] == r["messages"][-1]["content"]
        if len(calls) == 2:
            assert results[0] in calls[1]  # the second call uses the first one's result
    # without `chain` the same problems take one call with the whole expression
    plain = calculator_traces(40, 0, "word", two_step_share=0.5)
    assert [r["messages"][0] for r in plain] == [r["messages"][0] for r in rows]
    assert all(len(r["messages"]) == 4 for r in plain)


def call(expression: str) -> str:
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "</tool_call>"


ADD = {"answer": 1300, "ops": "+", "operands": [512, 788], "distractor": 43}
SUB = {"answer": 436, "ops": "-", "operands": [909, 473], "distractor": None}
TWO = {"answer": 1000, "ops": "+-", "operands": [600, 700, 300], "distractor": None}


@pytest.mark.parametrize(
    "problem, actions, correct, failure, right_operation, two_calls",
    [
        (ADD, [call("512+788"), "1300"], True, None, True, False),
        (ADD, ["1299"], False, "no_call", False, False),
        (ADD, ['<tool_call>{"name": "calculator", "arguments": {"expression": "512+"}}</tool_call>', "5"], False,
         "malformed", False, False),
        (ADD, ["<tool_call>{not json", "5"], False, "malformed", False, False),
        (ADD, [call("512+788"), "1301"], False, "right_call_wrong_answer", True, False),
        (ADD, [call("512+43"), "555"], False, "distractor", True, False),
        (ADD, [call("12*34"), "408"], False, "foreign_number", False, False),
        (ADD, [call("788-512"), "276"], False, "wrong_operation", False, False),
        (ADD, [call("788"), "788"], False, "copied_number", False, False),
        (TWO, [call("600+700"), "1300"], False, "one_step_of_two", False, False),
        (TWO, [call("600+700"), call("1300-300"), "1000"], True, None, True, True),  # a result reused: not foreign
        (TWO, [call("600-700+300"), "200"], False, "other", True, False),
        (ADD, [call("788+788"), "1576"], False, "operand_repeated_or_missing", True, False),
        (SUB, [call("473-909"), "-436"], False, "reversed", True, False),
        (ADD, [call("29 chairs"), "29"], False, "words_in_call", False, False),
    ],
)  # fmt: skip
def test_episode_analysis_classifies_as_a_reader_would(problem, actions, correct, failure, right_operation, two_calls):
    r = episode_analysis(problem, {"correct": correct, "actions": actions})
    assert (r["failure"], r["right_operation"], r["two_calls"]) == (failure, right_operation, two_calls)


def test_a_call_on_an_earlier_result_is_chained():
    chained = episode_analysis(TWO, {"correct": True, "actions": [call("600+700"), call("1300-300"), "1000"]})
    apart = episode_analysis(TWO, {"correct": False, "actions": [call("600+700"), call("700-300"), "400"]})
    assert (chained["chained"], chained["two_calls"]) == (True, True)
    assert (apart["chained"], apart["two_calls"]) == (False, True)
    copied = episode_analysis(TWO, {"correct": False, "actions": [call("600"), call("600+700"), "1300"]})
    assert copied["chained"] is False  # a copied number is no step, though the next call uses "its result"


def test_call_report_counts():
    problems = [ADD, ADD, TWO, ADD]
    predictions = [
        {"row": 0, "correct": True, "actions": [call("512+788"), "1300"]},
        {"row": 1, "correct": False, "actions": ["<tool_call>{bad", "7"]},
        {"row": 2, "correct": True, "actions": [call("600+700"), call("1300-300"), "1000"]},
        {"row": 3, "correct": False, "actions": ["1299"]},
    ]
    r = call_report(problems, predictions)
    assert r["calls_per_episode"] == 4 / 4
    assert r["well_formed_share"] == 3 / 4  # one of the four calls is malformed
    assert r["right_operation_share"] == 2 / 2  # of the episodes with a well-formed call
    assert r["two_call_episodes"] == 1 / 4 and r["chained_episodes"] == 1 / 4  # 1300-300 uses 600+700's 1300
    assert r["failures"] == {"no_call": 1, "malformed": 1}


def test_the_shipped_evaluation_is_reused_only_for_the_same_problems(tmp_path):
    """`--shipped_eval_from`: an earlier run's evaluation is copied (not played again) when its held-out file holds
    the same problems, and refused, naming the folder, when it does not; `--resume` keeps an evaluation already in
    the run's folder."""
    from demo.pipeline import DemoError
    from demo.smollm2_tools import evaluate, write_data
    from open_instruct.data_cache import code_identity

    earlier, now = tmp_path / "earlier", tmp_path / "now"
    files_earlier = write_data(str(earlier / "data"), 0, 4, "symbolic", 4, 3)
    files_now = write_data(str(now / "data"), 5, 4, "word", 4, 3)  # another seed: the same held-out problems
    where = earlier / "eval" / "shipped" / "one_step"
    where.mkdir(parents=True)
    predictions = [{"row": 0, "correct": True, "actions": [call("512+788"), "1300"]},
                   {"row": 1, "correct": False, "actions": ["7"]},
                   {"row": 2, "correct": False, "actions": [call("1"), "1"]}]  # fmt: skip
    (where / "predictions.jsonl").write_text("".join(json.dumps(p) + "\n" for p in predictions))
    (where / "summary.json").write_text(json.dumps({"accuracy": 1 / 3, "correct": 1, "total": 3, "ci95": [0, 1],
                                                    "seconds": 9.0, "cpu_seconds": 8.0}))  # fmt: skip
    (where / "problems.sha256").write_text(code_identity([files_earlier["one-step"]]))
    assert files_earlier["one-step"] != files_now["one-step"]
    res = evaluate("model", None, str(now), "shipped", files_now, ["one-step"], False, str(earlier))["one-step"]
    assert res["accuracy"] == 1 / 3 and res["failures"] == {"no_call": 1, "copied_number": 1}
    assert (now / "eval" / "shipped" / "one_step" / "predictions.jsonl").exists()
    # --resume: the evaluation now in the run's folder is kept (playing it would fail: "model" is no model)
    kept = evaluate("model", None, str(now), "shipped", files_now, ["one-step"], False, None, resume=True)
    assert kept["one-step"]["accuracy"] == 1 / 3
    # a new evaluation drops the digest before it plays: one that dies leaves nothing a later --resume would keep
    with pytest.raises(Exception):
        evaluate("model", None, str(now), "shipped", files_now, ["one-step"], False)
    assert not (now / "eval" / "shipped" / "one_step" / "problems.sha256").exists()
    rows = (now / "data" / "eval_one_step.jsonl").read_text().splitlines()
    (now / "data" / "eval_one_step.jsonl").write_text("\n".join(rows[1:] + rows[:1]) + "\n")  # other order
    with pytest.raises(DemoError, match="no evaluation of the same problems to reuse"):
        evaluate("model", None, str(now), "shipped", files_now, ["one-step"], False, str(earlier))


def test_a_fresh_held_out_draw_is_written_and_evaluated_beside_the_first(tmp_path):
    """`--held_out_seed`: other problems of the same sets, in files and an evaluation folder of their own; the
    training files and the first draw's files and evaluation stay as they were."""
    from demo.smollm2_tools import HELD_OUT_SEED, evaluate, held_out_draw, load_jsonl, write_data

    assert held_out_draw(HELD_OUT_SEED) == "" and held_out_draw(2000) == "_draw2000"
    first = write_data(str(tmp_path / "data"), 0, 8, "word", 8, 20)
    (tmp_path / "eval" / "sft" / "two_step").mkdir(parents=True)
    (tmp_path / "eval" / "sft" / "two_step" / "problems.sha256").write_text("the first evaluation")
    before = {k: open(f).read() for k, f in first.items()}
    fresh = write_data(str(tmp_path / "data"), 0, 8, "word", 8, 20, held_out_seed=2000)
    assert {k: open(f).read() for k, f in first.items()} == before  # nothing of the first draw rewritten
    for name in first:
        assert (fresh[name] == first[name]) == (name in ("sft_train", "rl_train")), name
    assert fresh["two-step"].endswith("eval_two_step_draw2000.jsonl")
    shapes = lambda f: collections.Counter(r["problem"]["shape"] for r in load_jsonl(f))  # noqa: E731
    assert not {r["problem"]["question"] for r in load_jsonl(fresh["two-step"])} & {
        r["problem"]["question"] for r in load_jsonl(first["two-step"])
    }
    assert set(shapes(fresh["two-step"])) == set(shapes(first["two-step"]))  # the same shapes, other numbers
    with pytest.raises(Exception):  # "model" is no model: the fresh draw is played, in its own folder
        evaluate("model", None, str(tmp_path), "sft", fresh, ["two-step"], False, None, True, "eval_draw2000")
    assert (tmp_path / "eval" / "sft" / "two_step" / "problems.sha256").read_text() == "the first evaluation"


def test_two_step_share_sets_the_mix():
    rows = word_problem_rows(2000, 3, "train", two_step_share=0.5)
    share = sum(len(r["problem"]["ops"]) == 2 for r in rows) / len(rows)
    assert 0.45 < share < 0.55  # 0.5 +- 4.5 binomial standard deviations (sd = 0.011)
    assert {r["problem"]["shape"] for r in rows} == {"add", "sub", "mul", "add_sub", "mul_add"}
    default = word_problem_rows(2000, 3, "train")
    default_share = sum(len(r["problem"]["ops"]) == 2 for r in default) / len(default)
    assert 0.2 < default_share < 0.3  # the shape list's 2 in 8


def test_one_step_first_puts_a_one_step_block_before_the_drawn_mix():
    from demo.pipeline import DemoError
    from demo.smollm2_tools import one_step_first_order

    rows = word_problem_rows(400, 5, "train", two_step_share=0.5)
    ordered = one_step_first_order(rows, 24)
    assert sorted(r["id"] for r in ordered) == sorted(r["id"] for r in rows)  # a reordering: nothing lost or repeated
    steps = [len(r["problem"]["ops"]) for r in ordered]
    assert steps[:24] == [1] * 24
    # The moved rows are the last one-step ones, so the rows after the block are the drawn rows in their order.
    assert [r["id"] for r in ordered[24:124]] == [r["id"] for r in rows[:100]]
    assert one_step_first_order(rows, 0) == rows
    with pytest.raises(DemoError, match="--one_step_first 401: the RL prompts hold only"):
        one_step_first_order(rows, 401)


def test_balanced_rollouts_spread_every_shape_over_the_rl_prompts():
    from demo.smollm2_tools import one_step_first_order

    rows = word_problem_rows(400, 5, "train", two_step_share=0.5)
    ordered = one_step_first_order(rows, 24, balanced=True)
    assert sorted(r["id"] for r in ordered) == sorted(r["id"] for r in rows)  # a reordering: nothing lost or repeated
    shapes = [r["problem"]["shape"] for r in ordered]
    # The one-step block: add, sub and mul in turn, so a rollout of 6 prompts holds 2 of each.
    assert shapes[:24] == ["add", "sub", "mul"] * 8
    # After it, every shape's running count stays within one row of its share of the rows so far (its j-th row is
    # placed at (j + 0.5) / n of the list), so a rollout of 6 prompts never holds one shape alone.
    rest = shapes[24:]
    for shape in set(rest):
        share = rest.count(shape) / len(rest)
        assert all(abs(rest[:k].count(shape) - k * share) <= 1 for k in range(1, len(rest) + 1)), shape
    assert all(len(set(rest[k : k + 6])) >= 4 for k in range(0, len(rest) - 5, 6))
    # Without the block the whole list is spread.
    spread = [r["problem"]["shape"] for r in one_step_first_order(rows, 0, balanced=True)]
    assert sorted(spread) == sorted(r["problem"]["shape"] for r in rows) and spread != [
        r["problem"]["shape"] for r in rows
    ]


def test_rl_two_step_share_sets_the_rl_prompts_mix_and_leaves_the_sft_traces(tmp_path):
    from demo.smollm2_tools import load_jsonl, write_data

    kw = dict(two_step_share=0.5, sft_chain=False, one_step_first=24, balanced_rollouts=True)
    same = write_data(str(tmp_path / "same"), 0, 16, "word", 400, 2, **kw)
    more = write_data(str(tmp_path / "more"), 0, 16, "word", 400, 2, rl_two_step_share=0.75, **kw)
    # The cold start is the same, so its SFT model is reused.
    assert load_jsonl(same["sft_train"]) == load_jsonl(more["sft_train"])
    for files, share in ((same, 0.5), (more, 0.75)):
        steps = [len(r["problem"]["ops"]) for r in load_jsonl(files["rl_train"])]
        assert steps[:24] == [1] * 24  # the one-step block is kept
        # Each of the 400 drawn rows is two-step with probability `share`, and all of them land after the block:
        # within 4 binomial sigmas (+-40 and +-35 rows) of 400 * share.
        assert abs(sum(k == 2 for k in steps[24:]) - 400 * share) < 4 * (400 * share * (1 - share)) ** 0.5


def test_block_only_keeps_a_shape_in_the_one_step_block_and_out_of_the_rest():
    from demo.pipeline import DemoError
    from demo.smollm2_tools import one_step_first_order

    rows = word_problem_rows(400, 5, "train", two_step_share=0.5)
    plain = one_step_first_order(rows, 24, balanced=True)
    ordered = one_step_first_order(rows, 24, balanced=True, block_only=["mul"])
    shapes = [r["problem"]["shape"] for r in ordered]
    assert shapes[:24] == ["add", "sub", "mul"] * 8  # the block is unchanged
    assert "mul" not in shapes[24:]
    # Exactly the products after the block are dropped: every other row is kept, once.
    kept = [r["id"] for r in plain[24:] if r["problem"]["shape"] != "mul"]
    assert sorted(r["id"] for r in ordered[24:]) == sorted(kept)
    assert len(ordered) == len(rows) - sum(r["problem"]["shape"] == "mul" for r in plain[24:])
    with pytest.raises(DemoError, match="--block_only mul_add: each one of add, sub, mul"):
        one_step_first_order(rows, 24, block_only=["mul_add"])
    with pytest.raises(DemoError, match="needs a --one_step_first block"):
        one_step_first_order(rows, 0, balanced=True, block_only=["mul"])


def test_sft_text_order_changes_only_the_order_of_the_calls_operands(tmp_path):
    from demo.smollm2_tools import load_jsonl, write_data

    def call(row: dict) -> str:
        return row["messages"][1]["tool_calls"][0]["function"]["arguments"]["expression"]

    canonical, text_order = (calculator_traces(200, 0, "word", two_step_share=0.5, text_order=t) for t in (0, 1))
    reordered = 0
    for a, b in zip(canonical, text_order):
        no_call = [[m for m in row["messages"] if "tool_calls" not in m] for row in (a, b)]
        assert no_call[0] == no_call[1]  # the question, the tool's result and the answer
        assert sorted(call(a)) == sorted(call(b)) and calculate(call(a)) == calculate(call(b))
        reordered += call(a) != call(b)
        if "-" not in call(b):  # a sum or product is written as the question states its numbers
            question = [int(t) for t in re.findall(r"\d+", b["messages"][0]["content"])]
            used = [int(t) for t in re.findall(r"\d+", call(b))]
            assert [n for n in question if n in used] == used
    # Out of canonical order: mul_add in 3 of the 6 training families (one template each) and a third of the mul
    # draws (shop, compare); a trace is mul_add with probability 1/2 * 1/2 and mul with 1/2 * 1/3, so
    # p = 1/4 * 1/2 + 1/6 * 1/3 = 0.181: 36.1 of 200, within 4 binomial sd (5.4).
    assert 15 < reordered < 58
    kw = dict(two_step_share=0.5, sft_chain=False)
    files = [write_data(str(tmp_path / str(t)), 0, 16, "word", 40, 2, sft_text_order=t, **kw) for t in (False, True)]
    assert all(load_jsonl(files[0][k]) == load_jsonl(files[1][k]) for k in files[0] if k != "sft_train")


def test_varied_phrasings_add_two_families_and_change_only_the_training_data(tmp_path):
    from demo.smollm2_tools import load_jsonl, write_data

    # The added families keep away from the held-out families' units, money and "Label: n." layout.
    held_out_words = {"cm", "kg", "km", "liters", "meters", "dollars", "price", "cost", "spent", "leak", "cheaper"}
    for template in templates(MORE_TRAIN_FAMILIES):
        assert ":" not in template and not held_out_words & set(re.findall(r"[a-z]+", template.lower())), template
    assert {shape for shapes in MORE_TRAIN_FAMILIES.values() for shape in shapes} == set(SHAPE_OPS) - set(
        TWO_STEP_HELD_OUT_ONLY
    ) - set(TWO_STEP_MORE_TRAINED)
    rows = word_problem_rows(2000, 0, "train_varied")
    assert {r["problem"]["family"] for r in rows} == set(TRAIN_FAMILIES) | set(MORE_TRAIN_FAMILIES)
    assert not {r["problem"]["shape"] for r in rows} & set(TWO_STEP_HELD_OUT_ONLY)
    # A shape's family is drawn uniformly among the 8 that have it: 2 of 8 subtraction rows are of an added family
    # (p = 0.25, about 2000 / 3 sub rows; within 4 binomial sd).
    sub = [r["problem"]["family"] in MORE_TRAIN_FAMILIES for r in rows if r["problem"]["shape"] == "sub"]
    assert abs(sum(sub) - len(sub) / 4) < 4 * (len(sub) * 0.25 * 0.75) ** 0.5
    kw = dict(two_step_share=0.5, sft_chain=False, sft_text_order=True)
    base, varied = (write_data(str(tmp_path / s), 0, 64, "word", 200, 20, train_split=s, **kw)
                    for s in ("train", "train_varied"))  # fmt: skip
    for name in base:  # the held-out sets are the same problems; the traces and prompts are new draws
        same = load_jsonl(base[name]) == load_jsonl(varied[name])
        assert same == (name not in ("sft_train", "rl_train")), name
    families = {r["problem"]["family"] for r in load_jsonl(varied["rl_train"])}
    assert families & set(MORE_TRAIN_FAMILIES)


def test_more_shapes_reach_training_only_and_leave_the_held_out_sets_alone(tmp_path):
    from demo.smollm2_tools import load_jsonl, write_data

    assert training_split() == "train" and training_split("varied", "more") == "train_varied_more_shapes"
    with pytest.raises(ValueError, match="shapes base or more"):
        training_split("base", "all")
    # every training family phrases both added shapes, in no word that only the held-out families use
    held_out_words = {w for t in templates(HELD_OUT_FAMILIES) for w in re.findall(r"[a-z]+", t.lower())}
    training_words = {w for t in templates(TRAIN_FAMILIES) | templates(MORE_TRAIN_FAMILIES)
                      for w in re.findall(r"[a-z]+", t.lower())}  # fmt: skip
    assert set(MORE_SHAPE_TEMPLATES) == set(TRAIN_FAMILIES) | set(MORE_TRAIN_FAMILIES)
    for family in MORE_SHAPE_TEMPLATES.values():
        assert set(family) == set(TWO_STEP_MORE_TRAINED)
    held_out_only_words = held_out_words - training_words  # "liters", "dollars", "tape", ...
    for template in templates(MORE_SHAPE_TEMPLATES):
        assert ":" not in template and not set(re.findall(r"[a-z]+", template.lower())) & held_out_only_words, template
    assert not templates(MORE_SHAPE_TEMPLATES) & templates(HELD_OUT_FAMILIES)
    # 1 in 4 training problems two-step by default, now over four shapes; the held-out-only shapes never drawn
    rows = word_problem_rows(4000, 0, "train_varied_more_shapes")
    shapes = collections.Counter(r["problem"]["shape"] for r in rows)
    assert set(shapes) == set(SHAPE_OPS) - set(TWO_STEP_HELD_OUT_ONLY)
    two_step = sum(n for s, n in shapes.items() if len(SHAPE_OPS[s]) == 2)
    assert abs(two_step - 1000) < 4 * (4000 * 0.25 * 0.75) ** 0.5  # 4 binomial sd
    assert abs(shapes["sub_mul"] - 250) < 4 * (4000 * 0.0625 * 0.9375) ** 0.5
    kw = dict(two_step_share=0.5, sft_chain=False, sft_text_order=True)
    base, more = (write_data(str(tmp_path / s), 0, 64, "word", 200, 20, train_split=s, **kw)
                  for s in ("train_varied", "train_varied_more_shapes"))  # fmt: skip
    for name in base:  # the held-out sets are the same problems; the traces and prompts are new draws
        assert (load_jsonl(base[name]) == load_jsonl(more[name])) == (name not in ("sft_train", "rl_train")), name
    traces = load_jsonl(more["sft_train"])
    called = [json.loads(re.search(r"<tool_call>(.*?)</tool_call>", m["content"]).group(1))["arguments"]["expression"]
              for t in traces for m in t["messages"] if "<tool_call>" in (m.get("content") or "")]  # fmt: skip
    assert any(re.fullmatch(r"(\d+\*)?\(\d+-\d+\)(\*\d+)?", e) for e in called)  # a (a-b)*x call was trained


def test_demo_refuses_grouped_expressions_on_chained_traces_before_any_work(tmp_path, capsys):
    from demo import smollm2_tools

    with pytest.raises(SystemExit):
        smollm2_tools.main(["--output_dir", str(tmp_path / "run"), "--sft_calls", "chained", "--sft_expression",
                            "grouped"])  # fmt: skip
    assert "--sft_expression grouped" in capsys.readouterr().err and not (tmp_path / "run").exists()
