"""reasoning-gym tasks as data and verifier (open_instruct/reasoning_gym_tasks.py): the rows are the package's own
rows, every score is the package's own score_answer, scoring runs in the sandbox (refusing, containing and paying
nothing for the red team's answers) under the verifier timeout, and the sources work in a mixture and a tiny RLVR
run. Skipped where reasoning-gym is not installed (an
optional extra: pip install '.[envs]')."""

import json
import os

import pytest

reasoning_gym = pytest.importorskip("reasoning_gym")

from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer  # noqa: E402
from test_reward_functions_trl import command, run  # noqa: E402

from open_instruct import data, mixture, rewards  # noqa: E402
from open_instruct import reasoning_gym_scoring as scoring  # noqa: E402
from open_instruct import reasoning_gym_tasks as rg  # noqa: E402
from open_instruct.errors import ConfigError, DataError  # noqa: E402

# Tasks with different scorers: exact match (leg_counting), the package's default partial credit (spell_backward),
# numeric parsing (basic_arithmetic), sympy's parse_expr on the answer (puzzle24, countdown), eval of the problem
# (bitwise_arithmetic).
TASKS = {
    "leg_counting": "size=30&seed=11",
    "spell_backward": "size=30&seed=12",
    "basic_arithmetic": "size=30&seed=13&min_terms=2&max_terms=3",
    "puzzle24": "size=8&seed=14",
    "countdown": "size=10&seed=15",
    "bitwise_arithmetic": "size=4&seed=5",  # its scorer evals the row's own problem (guarded as integer arithmetic)
}
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(rg.__file__)))
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


def test_rows_and_scores_equal_the_packages_own():
    """Every covered task's rows are the package's, and every score (scored in the sandbox, all tasks in one batch)
    is the package's own score_answer of the same text, clipped."""
    texts, truths, expected, per_task = [], [], [], {}
    for task in sorted(TASKS):
        source = f"reasoning_gym:{task}?{TASKS[task]}"
        rows = rg.generate(source, "train")
        settings = dict(item.split("=") for item in TASKS[task].split("&"))
        config = {k: json.loads(v) for k, v in settings.items()}
        theirs = reasoning_gym.create_dataset(task, **config)
        assert len(rows) == len(theirs) == config["size"]
        per_task[task] = (len(expected), len(rows))
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
                expected.append(min(max(float(theirs_score), 0.0), 1.0))
                texts.append(after_thinking)
                truths.append(row["ground_truth"])
    scored = scoring.score_many(texts, truths, timeout=TIMEOUT, workers=2)
    assert scored == [(score, "ok") for score in expected]
    for task, (first, n) in per_task.items():
        scores = [s for s, _ in scored[first : first + 6 * n]]
        assert scores[0::6] == [1.0] * n, task  # the right answer in tags always scores 1.0
        assert max(scores[3::6]) < 1.0  # no <answer> tag: the package scores None (0, or countdown's 0.01)
        assert max(scores[1::6]) < 1.0  # a wrong answer never scores 1.0


class Listener:
    """A TCP listener on 127.0.0.1 (the trainer's loopback): counts the connections that reached it."""

    def __init__(self) -> None:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]

    def connections(self) -> int:
        count = 0
        while True:
            try:
                self.sock.accept()[0].close()
                count += 1
            except BlockingIOError:
                return count


def test_the_red_teams_answers_are_refused_contained_and_pay_nothing(tmp_path):
    """The issue's escapes, in one batch: exec through countdown's parse_expr and string_insertion's eval (write the
    checkout, read /etc/shadow, connect to a listener on 127.0.0.1, leave a daemon, allocate 1.7 GB), patching the
    scorer from one answer (later wrong answers still score as the package scores them), and countdown's frame read
    of the target through inspect.stack() (only the given numbers as digits). Each scores what the package gives a
    text it cannot read (countdown 0.01, string_insertion 0), so its reward is 0; nothing reached the host."""
    countdown = rg.generate("reasoning_gym:countdown?size=1&seed=15", "train")[0]
    insertion = rg.generate("reasoning_gym:string_insertion?size=1&seed=3", "train")[0]
    numbers = rg.entry_of(countdown["ground_truth"])[1]["metadata"]["numbers"]
    listener, marker = Listener(), os.path.join(CHECKOUT, "PWNED_BY_AN_ANSWER")
    payloads = [
        f"open({marker!r}, 'w').write('x')",
        f"open({str(tmp_path / 'shadow')!r}, 'w').write(open('/etc/shadow').read())",
        f"__import__('socket').create_connection(('127.0.0.1', {listener.port}))",
        "__import__('os').fork() or __import__('time').sleep(60)",
        "bytearray(1700 << 20)",
        "setattr(__import__('sys').modules['oi_reasoning_gym_scoring'], 'clipped', lambda s: 1.0)",
    ]
    inner = ("(lambda e: e['metadata']['target'] - sum(e['metadata']['numbers']))(next(f.frame.f_locals['entry'] "
             "for f in __import__('inspect').stack() if 'entry' in f.frame.f_locals))")  # fmt: skip
    frame_read = "+".join(str(n) for n in numbers) + f"+__import__('builtins').eval({inner!r})"  # 1.0 on main
    texts, truths, wanted = [], [], []
    for payload in payloads:
        texts.append(f"<answer>__import__('builtins').exec({payload!r})</answer>")
        truths.append(countdown["ground_truth"])
        wanted.append(0.01)
        texts.append(f"<answer>__import__('builtins').exec({payload!r}) or ['x']</answer>")
        truths.append(insertion["ground_truth"])
        wanted.append(0.0)
    texts += [f"<answer>{frame_read}</answer>", "<answer>wrong</answer>", "<answer>1 + 1</answer>"]
    truths += [countdown["ground_truth"], insertion["ground_truth"], countdown["ground_truth"]]
    wanted += [0.01, 0.0, 0.05]  # the later wrong answers: as the package scores them
    assert scoring.score_many(texts, truths, timeout=TIMEOUT, workers=2) == [(w, "ok") for w in wanted]
    assert not os.path.exists(marker) and not (tmp_path / "shadow").exists()
    assert listener.connections() == 0
    from open_instruct.sandbox import sandbox_processes

    assert sandbox_processes() == []


def test_the_tripwire_ends_the_scoring_process_before_text_runs_as_code():
    """An evaluator no guard covers (a future scorer's eval, exec, compile or unpickling): the audit hook ends the
    process with TRIPPED before the compiled text runs; the guards pass only their grammar."""
    import subprocess
    import sys

    for evaluator in ("eval('print(7)')", "exec('print(7)')", "compile('7', 's', 'eval')",
                      "__import__('pickle').loads(__import__('pickle').dumps(len))"):  # fmt: skip
        program = (f"import sys; from open_instruct import reasoning_gym_scoring as s; sys.addaudithook(s._tripwire);"
                   f" s._armed = True; {evaluator}; print('ran')")  # fmt: skip
        done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": CHECKOUT})  # fmt: skip
        assert (done.returncode, done.stdout) == (scoring.TRIPPED, ""), evaluator
    assert scoring.math_text_allowed("(8 - 2) * 4 + 100 / 5") and scoring.math_text_allowed("3*x**2 + sin(x) + C")
    for text in ("__import__('os')", "inspect.stack()", "x.func", "exec(1)", "lambda: 1", "a[0]", "x = 1", "1; 2"):
        assert not scoring.math_text_allowed(text), text
    assert scoring.literal_allowed("['A', 'B']") and scoring.literal_allowed("[[1, -2], [3, 4]]")
    for text in ("[x for x in 'ab']", "list('ab')", "'a' * 10**9", "().__class__", "[1] + [2]"):
        assert not scoring.literal_allowed(text), text


def test_the_trainers_cost_of_the_worst_answers_is_bounded():
    """2 MB of unclosed <answer> tags (the package's lazy regex: quadratic) and a tower of powers: both end at the
    CPU limit in the sandbox (timeouts, 0); the trainer spends under 0.5 s of CPU and 64 MB of memory on them."""
    import resource

    row = rg.generate("reasoning_gym:puzzle24?size=1&seed=3", "train")[0]
    texts = ["<answer>" * 250_000, "<answer>9**9**9**9</answer>"]
    scoring.score_many(["<answer>1</answer>"], [row["ground_truth"]], timeout=TIMEOUT)  # imports and caches, once
    before_cpu = resource.getrusage(resource.RUSAGE_SELF)
    before_rss = before_cpu.ru_maxrss
    scored = scoring.score_many(texts, [row["ground_truth"]] * 2, timeout=1.0, workers=2)
    after = resource.getrusage(resource.RUSAGE_SELF)
    assert scored == [(0.0, "timeout"), (0.0, "timeout")]
    cpu = after.ru_utime + after.ru_stime - before_cpu.ru_utime - before_cpu.ru_stime
    assert cpu < 0.5 and (after.ru_maxrss - before_rss) < 64 << 10, (cpu, after.ru_maxrss - before_rss)


def test_a_scorer_past_the_timeout_scores_0_and_counts(monkeypatch):
    """The verifier's time limit holds for a reasoning-gym scorer: a parse_expr of a huge power (puzzle24) runs
    long; the sandbox's CPU limit (the verifier timeout) stops it."""
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


def test_a_misspelt_task_names_the_installed_release():
    """The installed distribution's version (0.1.25 as pinned), not the package's stale __version__ (0.1.19)."""
    from importlib.metadata import version

    with pytest.raises(ConfigError) as e:
        rg.parse("reasoning_gym:leg_countin", "train")
    assert f"'leg_countin' is not a reasoning-gym {version('reasoning-gym')} task; did you mean leg_counting" in str(
        e.value
    )


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
