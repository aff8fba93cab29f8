"""LLM-as-judge rewards (open_instruct/judge.py): a fake OpenAI-compatible judge server started here on loopback
and a tiny local judge model; the rendered prompts, the parsed scores, batching, retries, the deadline, the cache
(in memory and on disk) and parse failures are counted and checked; in a tiny RLVR run the judge adds to the
verifier's reward by its weight and its counters are logged."""

import importlib.util
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch
from test_reward_functions_trl import command, run
from tolerances import elementwise_atol

from open_instruct.errors import ConfigError
from open_instruct.judge import PROBES, Judge

RUBRIC = "Rate [[{completion}]] for {prompt} (reference: {reference}). Keep {braces}. Reply 'Score: N', N from 0 to 10."
SLACK = 5.0  # seconds of scheduling slack on a shared 2-core machine, added to a deadline when checking it


class FakeJudge:
    """An OpenAI-compatible /chat/completions on 127.0.0.1: replies `Score: <len(completion) % 11>`; a completion
    containing GARBAGE gets a reply without a score, FLAKY gets HTTP 503 on its first request, SLOW is held until
    the test releases it. Every request's prompt is recorded."""

    def __init__(self) -> None:
        self.prompts: list[str] = []
        self.flaky_seen: set[str] = set()
        self.release = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                assert self.path == "/v1/chat/completions" and body["model"] == "fake-judge"
                prompt = body["messages"][0]["content"]
                fake.prompts.append(prompt)
                completion = prompt.split("Rate [[", 1)[1].rsplit("]] for ", 1)[0]
                if "FLAKY" in completion and completion not in fake.flaky_seen:
                    fake.flaky_seen.add(completion)
                    self.send_response(503)
                    self.end_headers()
                    return
                if "SLOW" in completion:
                    fake.release.wait()
                reply = "I cannot rate this." if "GARBAGE" in completion else f"Fine. Score: {len(completion) % 11}"
                data = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]}).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # a SLOW reply after the judge's deadline gave up
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_judge():
    server = FakeJudge()
    yield server
    server.close()


def judge_for(server: FakeJudge, **kw) -> Judge:
    """A judge without probes (the probe tests below give them), so that every prompt the server saw is a row's."""
    return Judge(RUBRIC, url=server.url, model="fake-judge", **{"probes": [], **kw})


def expected(completion: str) -> float:
    return (len(completion) % 11) / 10  # Score: N on 0..10 -> N / 10


pytestmark = pytest.mark.concurrency


def test_scores_rendering_batching_and_the_cache(fake_judge, tmp_path):
    completions = ["four", "a longer answer", "x" * 10, "seven!!"]
    judge = judge_for(fake_judge, batch_size=2, timeout=60.0, cache_path=str(tmp_path / "cache.jsonl"))
    prompts = ["Q1", [{"role": "user", "content": "Q2"}], "Q3", "Q4"]
    values = judge(prompts=prompts, completions=completions, ground_truth=["r1", "r2", "r3", "r4"])
    assert list(values) == [expected(c) for c in completions]
    assert sorted(fake_judge.prompts) == sorted(
        RUBRIC.replace("{completion}", c).replace("{prompt}", p).replace("{reference}", r)
        for c, p, r in zip(completions, ["Q1", "user: Q2", "Q3", "Q4"], ["r1", "r2", "r3", "r4"])
    )  # every placeholder filled, the rubric's other braces kept
    assert {k: v for k, v in values.counters.items() if k != "seconds"} == {
        "calls": 4, "cache_hits": 0, "parse_failures": 0, "timeouts": 0, "retries": 0, "probes": 0
    }  # fmt: skip
    again = judge(prompts=prompts, completions=completions, ground_truth=["r1", "r2", "r3", "r4"])
    assert list(again) == list(values) and again.counters["cache_hits"] == 4 and len(fake_judge.prompts) == 4
    # a new judge (a resumed run) reads the cache file: nothing is asked again
    resumed = judge_for(fake_judge, cache_path=str(tmp_path / "cache.jsonl"))
    assert list(resumed(prompts=prompts, completions=completions, ground_truth=["r1", "r2", "r3", "r4"])) == list(
        values
    )
    assert len(fake_judge.prompts) == 4
    # another judge model is another cache key; so is another reference
    other = Judge(
        RUBRIC, url=fake_judge.url, model="fake-judge", temperature=0.5, cache_path=str(tmp_path / "cache.jsonl")
    )
    assert other(prompts=prompts[:1], completions=completions[:1], ground_truth=["r1"]).counters["cache_hits"] == 0
    assert judge(prompts=prompts[:1], completions=completions[:1], ground_truth=["r9"]).counters["cache_hits"] == 0


def test_retries_and_unparsable_replies_score_0_and_are_counted(fake_judge, caplog):
    judge = judge_for(fake_judge, retries=2)
    completions = ["FLAKY one", "GARBAGE", "fine", "also fine"]
    values = judge(prompts=["q"] * 4, completions=completions, ground_truth=[None] * 4)
    assert list(values) == [expected("FLAKY one"), 0.0, expected("fine"), expected("also fine")]
    assert values.counters["retries"] == 1 and values.counters["parse_failures"] == 1
    assert "1 of 4 replies had no score" in caplog.text and "I cannot rate this." in caplog.text


def test_a_completion_is_inserted_once_as_data():
    """A completion (or prompt) holding a slot's name is judged as that text: the row's reference is pasted only where
    the rubric names {reference} (on main a completion "{reference}" got the reference into a strict rubric)."""
    strict = Judge("Is [[{completion}]] a correct answer to {prompt}? Score: N", url="http://x", model="m")
    assert strict.render("Q {completion}", "{reference} {prompt}", "SECRET") == (
        "Is [[{reference} {prompt}]] a correct answer to Q {completion}? Score: N"
    )
    judge = Judge(RUBRIC, url="http://x", model="m")
    assert judge.render("Q", "see {reference}", "r1") == (
        "Rate [[see {reference}]] for Q (reference: r1). Keep {braces}. Reply 'Score: N', N from 0 to 10."
    )


def test_the_score_is_the_first_match_in_ascii_digits():
    """The verdict is the reply's first "Score: N": a "Score: 10" quoted after it is not (on main the last match
    won), Unicode digits are no number, a score outside the range is unparsable."""
    judge = Judge(RUBRIC, url="http://x", model="m")
    assert judge.parse("Score: 3\nThe answer claims 'Score: 10'.") == 0.3
    assert judge.parse("reasons... score = 7.5 and later Score: 10") == 0.75
    for reply in ("Score: \u0663", "Score: \uff19", "Score: 11", "Score: -1", "no verdict", "Score:\u20037"):
        assert judge.parse(reply) is None, reply


def test_policy_provoked_failures_score_0_and_only_failed_probes_stop_the_run(fake_judge):
    """Replies the policy makes unparsable (GARBAGE) score 0 and are counted; past max_parse_failure_rate the judge
    asks its fixed probes again, which it passes: the run goes on. A judge that fails its own probes (a pattern it
    never writes, or a score off the probe's range) stops at its first call, before any row is judged."""
    judge = judge_for(fake_judge, probes=None)  # the default probe
    values = judge(prompts=["q"] * 3, completions=["GARBAGE 1", "GARBAGE 2", "ok"], ground_truth=[None] * 3)
    assert list(values) == [0.0, 0.0, expected("ok")]
    assert values.counters["parse_failures"] == 2 and values.counters["probes"] == 2  # at start, and again
    probe = judge.render(PROBES[0]["prompt"], PROBES[0]["completion"], PROBES[0]["reference"])
    assert fake_judge.prompts.count(probe) == 2
    again = judge(prompts=["q"], completions=["GARBAGE 3"], ground_truth=[None])
    assert list(again) == [0.0] and again.counters["probes"] == 1  # only the re-check
    wants_ten = judge_for(fake_judge, probes=[{"completion": "1", "score": [10, 10]}])  # the server says Score: 1
    with pytest.raises(ValueError, match=r"fails its own probe 0 \(reply 'Fine. Score: 1'.*\(10, 10\)"):
        wants_ten(prompts=["q"], completions=["ok"], ground_truth=[None])
    blind = judge_for(fake_judge, probes=None, score_pattern=r"Grade=(\d+)")
    asked = len(fake_judge.prompts)
    with pytest.raises(ValueError, match="fails its own probe 0 .*fix the judge, the rubric or score_pattern"):
        blind(prompts=["q"], completions=["ok"], ground_truth=[None])
    assert len(fake_judge.prompts) == asked + 1  # the probe only


def test_the_deadline_holds_and_counts_timeouts(fake_judge):
    judge = judge_for(fake_judge, timeout=0.5, retries=3, batch_size=4)
    values = judge(prompts=["q"] * 3, completions=["SLOW a", "SLOW b", "SLOW c"], ground_truth=[None] * 3)
    assert list(values) == [None, None, None]  # unanswered: no value (left out of the mean)
    assert values.counters["timeouts"] == 3 and values.counters["parse_failures"] == 0
    assert values.counters["seconds"] < 0.5 + SLACK


def test_bad_settings_name_what_is_wrong():
    for kwargs, message in [
        ({}, "give exactly one of url= .* local_model= .* and serve_model=.* got none"),
        ({"url": "http://x"}, "needs model="),
        ({"url": "http://x", "model": "m", "score_pattern": "score"}, "needs a group around the number"),
        ({"url": "http://x", "model": "m", "score_range": (5, 1)}, "low < high"),
        ({"url": "http://x", "model": "m", "batch_size": 0}, "batch_size must be an integer >= 1"),
    ]:
        with pytest.raises(ConfigError, match=message):
            Judge(RUBRIC, **kwargs)
    with pytest.raises(ConfigError, match="must contain {completion}"):
        Judge("no placeholder", url="http://x", model="m")


def test_bad_engine_judge_settings_fail_before_anything_starts(monkeypatch):
    """Judges on vLLM engines (serve_model, url='run'): a bad combination is a ConfigError when the judge is built
    (its module is imported before any model loads), never an engine started."""
    from open_instruct import engines

    monkeypatch.setattr(engines.LocalEngines, "__init__", lambda *a, **k: pytest.fail("an engine was started"))
    for kwargs, message in [
        ({"url": "http://x", "model": "m", "serve_model": "m"}, r"exactly one .* got \['serve_model', 'url'\]"),
        ({"local_model": "f", "serve_model": "m"}, r"got \['local_model', 'serve_model'\]"),
        ({"url": "http://x", "model": "m", "serve_engines": 2}, r"\['serve_engines'\] configure engines started for "),
        ({"serve_model": "m", "serve_gpus": [0]}, r"unknown argument\(s\) \['serve_gpus'\]; the serving options"),
        ({"serve_model": "m", "model": "m"}, "serve_model= takes no model= or api_key_env="),
        ({"serve_model": "m", "serve_engines": 0}, "serve_engines must be an integer >= 1, got 0"),
        ({"serve_model": "m", "serve_engines": 2, "serve_devices": [3]}, r"serve_devices \[3\] must list 2 distinct"),
        ({"serve_model": "m", "serve_devices": [1, 1], "serve_engines": 2}, "must list 2 distinct GPU ids"),
        ({"url": "run", "model": "m"}, r"url='run' takes no model= \(.*read from their /v1/models"),
        ({"url": "run", "cache_path": "c.jsonl"}, "url='run' takes no cache_path= .*weights change every step"),
        ({"url": "run", "api_key_env": "K"}, "url='run' takes no api_key_env="),
    ]:
        with pytest.raises(ConfigError, match=message):
            Judge(RUBRIC, **kwargs)
    with pytest.raises(ConfigError, match=r"Judge\(url='run'\) is resolved when the run's vLLM engines start"):
        Judge(RUBRIC, url="run")(prompts=["q"], completions=["a"])  # used outside a run, never resolved
    if importlib.util.find_spec("vllm") is None:  # the main venv: a served judge names what it lacks
        with pytest.raises(ConfigError, match="serve_model 'm' needs vLLM in this Python environment"):
            Judge(RUBRIC, serve_model="m")(prompts=["q"], completions=["a"])
    assert Judge(RUBRIC, url="run").starts_with_run and Judge(RUBRIC, serve_model="m").starts_with_run
    assert not Judge(RUBRIC, url="http://x", model="m").starts_with_run


SELF_JUDGE_FILE = """
from open_instruct.judge import Judge

judge = Judge("Rate {completion}. Score: N", url="run")
"""


def test_a_self_judge_without_vllm_engines_is_refused_before_loading(tiny_models, tmp_path, no_model_loads, capsys):
    """url='run' in a run that generates with HF: exit 2 naming the backend, before any model loads; the probe did
    not call the judge (it would have said it was never resolved)."""
    judge_file = tmp_path / "self_judge.py"
    judge_file.write_text(SELF_JUDGE_FILE)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "What is 1 + 1?", "ground_truth": "2", "dataset": "gsm8k"}) + "\n")
    argv = command(tiny_models["causal_lm"], str(rows), tmp_path / "out", "--reward_functions", f"{judge_file}:judge",
                   "--generation_backend", "hf")  # fmt: skip
    with pytest.raises(ConfigError, match="judges with the run's own vLLM engines, but generation_backend is hf"):
        from open_instruct.judge import check_run_judges

        check_run_judges(SimpleNamespace(reward_functions=[f"{judge_file}:judge"], generation_backend="hf"))
    assert run(argv) == 2
    assert "but generation_backend is hf (no engine with an OpenAI-compatible route)" in capsys.readouterr().err


def test_served_judges_take_the_gpus_the_run_leaves_free(monkeypatch, tmp_path):
    """start_run_judges on rank 0 of a one-process run on a 5-GPU node whose own engine took GPU 1: a served judge
    gets the GPUs after the training process's (0) and the engine's (1), in order; one that needs more than are left,
    or names a taken GPU, is refused naming the layout. (The engines themselves are not started here.)"""
    from open_instruct import judge as judge_module
    from open_instruct.engines import EngineSpec

    started = []

    def fake_start(self, devices=None, log_dir=None):
        started.append((self.serve_model, devices, log_dir))
        return [f"http://127.0.0.1:{9000 + len(started)}/v1"]

    monkeypatch.setattr(judge_module, "_cuda_devices", lambda: 5)
    monkeypatch.setattr(Judge, "start", fake_start)
    generator = SimpleNamespace(urls=["http://127.0.0.1:8000"], local_engines=SimpleNamespace(
        specs=[EngineSpec(0, "127.0.0.1", 8000, [1])]))  # fmt: skip
    accelerator = SimpleNamespace(num_processes=1, is_main_process=True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")

    def judges(*lines):
        path = tmp_path / f"judges_{len(list(tmp_path.iterdir()))}.py"
        path.write_text("from open_instruct.judge import Judge\n" + "\n".join(lines) + "\n")
        names = [line.split(" = ")[0] for line in lines]
        return SimpleNamespace(reward_functions=[f"{path}:{n}" for n in names], output_dir=str(tmp_path / "out"))

    cfg = judges(
        "a = Judge('{completion}', serve_model='A', serve_engines=2)", "b = Judge('{completion}', serve_model='B')"
    )
    assert len(judge_module.start_run_judges(cfg, generator, accelerator)) == 2
    log_dirs = [os.path.join(tmp_path, "out", f"judge_engine_logs_{i}") for i in range(2)]
    assert started == [("A", [2, 3], log_dirs[0]), ("B", [4], log_dirs[1])]
    cfg = judges("c = Judge('{completion}', serve_model='C', serve_engines=4)")
    with pytest.raises(
        ConfigError, match=r"needs 4 GPU\(s\) the run leaves free: training and generation take \[0, 1\] of 5"
    ):
        judge_module.start_run_judges(cfg, generator, accelerator)
    cfg = judges("d = Judge('{completion}', serve_model='D', serve_devices=[1])")
    with pytest.raises(ConfigError, match=r"take \[0, 1\] of 5, serve_devices \[1\]"):
        judge_module.start_run_judges(cfg, generator, accelerator)


def test_engines_of_a_run_with_a_self_judge_serve_the_whole_context(tiny_models, tmp_path):
    """A self-judge's prompts hold a prompt, its completion and the rubric: the run's engines then serve the policy's
    max_position_embeddings (1024 for the tiny model), not the run's longest prompt + response; a served judge or
    none leaves them at the run's."""
    from open_instruct.engines import engine_context

    (tmp_path / "judges.py").write_text(SELF_JUDGE_FILE + "served = Judge('{completion}', serve_model='m')\n")
    base = {"model_name_or_path": tiny_models["causal_lm"], "trust_remote_code": False, "gguf_file": None}
    with_self = SimpleNamespace(reward_functions=[f"{tmp_path / 'judges.py'}:judge"], **base)
    served_only = SimpleNamespace(reward_functions=[f"{tmp_path / 'judges.py'}:served"], **base)
    assert engine_context(with_self, 100) == 1024 and engine_context(with_self, 2000) == 2000
    assert engine_context(served_only, 100) == 100 and engine_context(SimpleNamespace(reward_functions=None), 7) == 7


def test_a_tiny_local_judge_scores_its_own_greedy_replies(tiny_models):
    """The local backend's values are the parse of the model's own greedy reply to each rendered rubric (worked out
    here with generate), batched in twos."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny_models["causal_lm"]
    judge = Judge("Rate: {completion}", local_model=folder, score_pattern=r"(\d)", score_range=(0, 9),
                  batch_size=2, max_new_tokens=12, probes=[])  # fmt: skip
    completions = ["12", "hello", "a much longer answer", "7"]
    values = judge(prompts=["q"] * 4, completions=completions)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    replies = []
    for c in completions:  # one at a time, no padding: the batched replies must be the same
        text = "Rate: " + c
        if tokenizer.chat_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)  # fmt: skip
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=not tokenizer.chat_template)
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        replies.append(tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True))
    digits = [[ch for ch in r if ch in "0123456789"] for r in replies]
    assert list(values) == [int(d[0]) / 9 if d else 0.0 for d in digits]  # the first ASCII digit; none: 0
    assert values.counters["parse_failures"] == sum(not d for d in digits)
    assert values.counters["calls"] == 4 and values.counters["timeouts"] == 0


JUDGE_FILE = """
import os
from open_instruct.judge import Judge

rubric = "Rate [[{completion}]] for {prompt} (reference: {reference}). Keep {braces}."
judge = Judge(rubric, url=os.environ["JUDGE_URL"], model="fake-judge", batch_size=4, timeout=60.0)
"""


def judge_run_files(tmp_path, fake_judge, monkeypatch, addend):
    """The user's judge file (reaching the fake judge) and 4 gsm8k rows 'What is i + addend?'."""
    judge_file = tmp_path / "my_judge.py"
    judge_file.write_text(JUDGE_FILE)
    monkeypatch.setenv("JUDGE_URL", fake_judge.url)
    rows = tmp_path / "rows.jsonl"
    with open(rows, "w") as f:
        for i in range(4):
            row = {"prompt": f"What is {i} + {addend}?", "ground_truth": str(i + addend), "dataset": "gsm8k"}
            f.write(json.dumps(row) + "\n")
    return judge_file, rows


@pytest.mark.parametrize("async_steps", [0, 1])
def test_judge_in_a_run_adds_by_its_weight_and_logs_its_counters(
    async_steps, fake_judge, tiny_models, tmp_path, monkeypatch
):
    judge_file, rows = judge_run_files(tmp_path, fake_judge, monkeypatch, addend=1)
    out = tmp_path / "out"
    argv = command(tiny_models["causal_lm"], str(rows), out, "--reward_functions", f"{judge_file}:judge",
                   "--reward_function_weights", "0.5", "--num_samples_logged", "8",
                   "--async_steps", str(async_steps))  # fmt: skip
    assert run(argv) == 0
    (train,) = [r for r in map(json.loads, open(out / "metrics.jsonl")) if "loss/policy" in r]
    samples = [json.loads(line) for line in open(out / "samples.jsonl")]
    assert len(samples) == 8
    assert train["reward/judge/calls"] == 8 and train["reward/judge/parse_failures"] == 0
    # asked: the judge's own probe and 4 for the probe before loading (empty completions), then each rollout
    # completion not in the cache
    assert len(fake_judge.prompts) - 5 + train["reward/judge/cache_hits"] == 8
    for s in samples:  # score = verifier (1.0 x correct) + 0.5 x judge
        completion = s["response"]
        assert s["rewards"]["judge"] == pytest.approx(expected(completion), abs=0)
        verifier = s["score"] - 0.5 * s["rewards"]["judge"]
        tol = elementwise_atol(2, 1.5)  # the score is a float32 of at most 1.5: the sum and the cast round
        assert verifier == pytest.approx(0.0, abs=tol) or verifier == pytest.approx(1.0, abs=tol)
    mean = sum(s["rewards"]["judge"] for s in samples) / 8
    assert train["reward/judge/mean"] == pytest.approx(mean, rel=1e-12)
    assert train["reward/judge/seconds"] > 0


def test_a_run_with_a_judge_resumes_bit_exactly(fake_judge, tiny_models, tmp_path, monkeypatch):
    """SIGTERM during rollout 2 of 3 (checkpoint, exit 0), resume: every metric row equals the uninterrupted run's,
    the judge's values and counters included (its cache hits and wall time aside: this process's judge object
    keeps its cache across the runs)."""
    from training_helpers import sigterm_at_step

    judge_file, rows = judge_run_files(tmp_path, fake_judge, monkeypatch, addend=2)

    def argv(out, *more):
        return command(tiny_models["causal_lm"], str(rows), out, "--reward_functions", f"{judge_file}:judge",
                       "--reward_function_weights", "0.5", "--total_episodes", "24", "--checkpointing_steps", "100",
                       *more)  # fmt: skip

    def comparable(out):
        skip = ("time/", "perf/", "reward/judge/cache_hits", "reward/judge/seconds")
        return [
            {k: v for k, v in r.items() if not k.startswith(skip)} for r in map(json.loads, open(out / "metrics.jsonl"))
        ]

    full, cut = tmp_path / "full", tmp_path / "cut"
    assert run(argv(full)) == 0
    with sigterm_at_step(monkeypatch, 2):
        assert run(argv(cut)) == 0
    assert max(r["rollout_step"] for r in comparable(cut)) == 2
    assert run(argv(cut, "--resume_from_checkpoint", "auto")) == 0
    full_rows = comparable(full)
    assert [r["rollout_step"] for r in full_rows if "reward/judge/mean" in r] == [1, 2, 3]
    assert comparable(cut) == full_rows


# ---- issue 69: a judge that cannot work is refused at start, naming what is wrong ------------------------------------
REFERENCE_JUDGE_FILE = """
from open_instruct.judge import Judge

judge = Judge("Rate {completion} against {reference}. Score: N", url="http://127.0.0.1:9/v1", model="m")
"""


def test_a_rubric_slot_whose_column_the_rows_lack_is_refused_at_start(tiny_models, tmp_path, no_model_loads, capsys):
    """{reference} reads ground_truth (reference_column's default); rows without it would give the judge an empty
    reference on every call: the dry run and the real start exit 2 naming the slot, the column and the file, before
    any model loads (the judge's url answers nothing: it is never asked)."""
    judge_file = tmp_path / "reference_judge.py"
    judge_file.write_text(REFERENCE_JUDGE_FILE)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "What is 1 + 1?", "solution": "2"}) + "\n")
    argv = command(tiny_models["causal_lm"], str(rows), tmp_path / "out", "--reward_functions", f"{judge_file}:judge")
    for extra in (["--dry_run", "true"], []):
        assert run([*argv, *extra]) == 2
        err = capsys.readouterr().err
        assert f"the rubric's slot {{reference}} reads column 'ground_truth', which the rows of {rows} line 1 lack " \
            "(columns: ['prompt', 'solution'])" in err, err  # fmt: skip
    assert not os.path.exists(tmp_path / "out" / "run.json")


def test_a_missing_judge_folder_is_named_as_a_missing_folder(tmp_path):
    missing = str(tmp_path / "judges" / "qwen")
    with pytest.raises(ConfigError, match=f"Judge: local_model folder '{missing}' does not exist"):
        Judge(RUBRIC, local_model=missing)
    with pytest.raises(ConfigError, match="Judge: local_model folder 'judge_model' does not exist"):
        Judge(RUBRIC, local_model="judge_model")  # a bare name is a folder here too (hub ids: serve_model=)
    with pytest.raises(ConfigError, match=f"Judge: serve_model folder '{missing}' does not exist"):
        Judge(RUBRIC, serve_model=missing)
    assert Judge(RUBRIC, serve_model="Qwen/Qwen3-8B").serve_model == "Qwen/Qwen3-8B"  # a hub id stays one
