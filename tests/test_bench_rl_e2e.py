"""bench/bench_rl_e2e.py: the arithmetic of its summary and table on hand-made step stamps, its /proc reading of the
process tree, and its handling of an async depth the trainer refuses (the trainer's own config check, run for real on
the tiny model: the refusal comes before any model loads)."""

import argparse
import os
import subprocess
import sys

import pytest
from training_helpers import bench_script

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bench():
    yield bench_script("bench_rl_e2e.py")
    sys.modules.pop("bench_rl_e2e", None)


def step(t, cpu, tokens, rss=100.0, **phases):
    return {"t": t, "cpu": cpu, "rss_mb": rss, "tokens": tokens, "phases": phases}


def test_parse_stat_counts_fields_after_a_command_name_with_spaces_and_parentheses(bench):
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime cutime cstime ...
    text = "4242 (python (x) y) S 17 1 1 0 -1 4194304 10 0 0 0 300 45 7 3 20 0 1 0 99 0"
    assert bench.parse_stat(text) == (17, 300 + 45 + 7 + 3)


def test_tree_usage_includes_a_live_child(bench):
    """The tree's memory is the sum of its processes' peak RSS, so a live child adds its own VmHWM."""

    def hwm_mb(pid):
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024.0

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            own_cpu = bench.parse_stat(f.read())[1] / os.sysconf("SC_CLK_TCK")
        floor = hwm_mb(os.getpid()) + hwm_mb(child.pid)  # peaks only grow: read before, they bound it from below
        cpu, rss = bench.tree_usage(os.getpid())
        assert rss >= floor > hwm_mb(os.getpid())
        assert cpu >= own_cpu
    finally:
        child.communicate(b"")


def test_summary_over_steps_after_the_first(bench):
    """3 steps of E = 8 episodes; step 1 is warm-up: window = 100 - 10 = 90 s, 16 episodes."""
    steps = [
        step(10.0, 5.0, 999.0, rss=500.0, generation=9.0, training=1.0),  # never counted
        step(40.0, 35.0, 800.0, rss=700.0, generation=12.0, training=15.0, generation_engine=20.0),
        step(100.0, 95.0, 1200.0, rss=600.0, generation=30.0, scoring=3.0, training=24.0, generation_engine=33.0),
    ]
    s = bench.summarize(steps, 8, peak_rss_mb=650.0)
    assert s["episodes_per_second"] == pytest.approx(16 / 90)
    assert s["tokens_per_second"] == pytest.approx(2000 / 90)
    assert s["cpu_seconds_per_episode"] == pytest.approx(90 / 16)
    assert s["seconds_per_step"] == pytest.approx(45.0)
    assert s["mean_response_tokens"] == pytest.approx(2000 / 16)
    assert s["peak_rss_mb"] == 700.0
    assert s["shares"]["generation"] == pytest.approx(42 / 90)
    assert s["shares"]["scoring"] == pytest.approx(3 / 90)
    assert s["shares"]["training"] == pytest.approx(39 / 90)
    assert s["shares"]["inference"] == 0.0 and s["shares"]["weight_sync"] == 0.0
    assert s["shares"]["other"] == pytest.approx(1 - 84 / 90)
    assert s["engine_generation_share"] == pytest.approx(53 / 90)
    with pytest.raises(ValueError, match="at least 2 steps"):
        bench.summarize(steps[:1], 8, 0.0)


def test_table_ratios_against_trl_and_our_sync_mode(bench):
    def run(eps):
        shares = dict.fromkeys((*bench.PHASES, "other"), 0.2)
        return {"episodes_per_second": eps, "tokens_per_second": 100 * eps, "cpu_seconds_per_episode": 3.0,
                "peak_rss_mb": 2048.0, "seconds_per_step": 8 / eps, "mean_response_tokens": 100.0,
                "shares": shares, "engine_generation_share": 0.5}  # fmt: skip

    results = {
        "ours_hf_sync": {"runs": [run(0.5)]},
        "trl": {"runs": [run(0.25), run(0.2), run(0.4)]},  # median 0.25
        "ours_vllm_sync": {"runs": [run(1.0), run(0.8)]},  # even: the lower median, 0.8
        "ours_vllm_async1": {"runs": [run(1.2)]},
        "ours_vllm_async2": {"runs": [], "status": bench.UNSUPPORTED, "reason": "async_steps must be 0 or 1"},
    }
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in bench.table(results).splitlines()[2:]}
    assert rows["ours_hf_sync"][1:5] == ["0.500", "50.0", "2.00", "1.00"]
    assert rows["trl"][1:5] == ["0.250", "25.0", "1.00", "-"]
    assert rows["ours_vllm_sync"][1:5] == ["0.800", "80.0", "3.20", "1.00"]
    assert rows["ours_vllm_async1"][1:5] == ["1.200", "120.0", "4.80", "1.50"]  # vs vLLM sync, not HF sync
    assert rows["ours_vllm_async1"][6] == "2.00"  # peak RSS in GB
    assert rows["ours_vllm_async2"][1] == bench.UNSUPPORTED


def test_names_map_to_depths_and_backends(bench):
    assert [bench.async_steps_of(n) for n in ("ours_hf_sync", "ours_vllm_async1", "ours_vllm_async12")] == [0, 1, 12]
    assert bench.ratio_base("ours_vllm_async3") == "ours_vllm_sync"
    assert bench.ratio_base("ours_hf_sync") == "ours_hf_sync" and bench.ratio_base("trl") is None
    assert bench.ratio_base("ours_hf_async2") == "ours_hf_sync"
    args = argparse.Namespace(variants=["trl", "ours_vllm_async2"], async_steps=[2, 3], async_backends=["vllm", "hf"])
    assert bench.variants_for(args) == [
        "trl", "ours_vllm_async2", "ours_hf_async2", "ours_vllm_async3", "ours_hf_async3"
    ]  # fmt: skip


def test_bad_variant_is_refused_before_any_model_loads(bench, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--variants", "ours_hf_sync", "vllm_fast", "--out", str(tmp_path)])
    assert e.value.code == 2 and "vllm_fast" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "model")


def refused_async_depth(model, data):
    """(depth, message) of the first async depth on the HF backend that this build's trainer config refuses, else
    None (a build with HF async of every depth tried)."""
    from open_instruct.config import RLVRConfig, parse_config
    from open_instruct.errors import ConfigError

    for depth in (1, 2, 1000):
        argv = ["--model_name_or_path", model, "--dataset_name_or_path", data, "--generation_backend", "hf",
                "--async_steps", str(depth), "--output_dir", "unused", "--total_episodes", "64"]  # fmt: skip
        try:
            parse_config(RLVRConfig, argv)
        except ConfigError as e:
            if "async_steps" in str(e):  # refused for its depth, not for something this probe left out
                return depth, str(e)
    return None


def test_a_depth_the_trainer_refuses_is_reported_not_raised(bench, tiny_models, tmp_path):
    """The trainer's own config check (run for real in the child) exits 2 naming async_steps; the bench reports it
    with the trainer's message instead of failing."""
    data = bench.write_prompts(str(tmp_path), 4, seed=0)
    refused = refused_async_depth(tiny_models["causal_lm"], data)
    if refused is None:
        pytest.skip("this build accepts async_steps 1, 2 and 1000 on the HF backend")
    depth, message = refused
    name = f"ours_hf_async{depth}"
    out = bench.spawn(name, bench.PRESETS["smoke"], tiny_models["causal_lm"], data, str(tmp_path / "r"))
    assert out["status"] == bench.UNSUPPORTED
    assert message in out["reason"]


def test_refusal_and_failure_of_a_child_are_told_apart(bench, tmp_path, monkeypatch):
    """A stand-in interpreter: exit 2 with the trainer's async_steps message is "not supported"; another exit is a
    failure naming the log; the bench goes on either way."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "config error: async_steps must be 0 (synchronous) or 1, got 3"\nexit "$CODE"\n')
    fake.chmod(0o755)
    monkeypatch.setattr(bench, "python_for", lambda name: str(fake))
    monkeypatch.setenv("CODE", "2")
    out = bench.spawn("ours_vllm_async3", bench.PRESETS["smoke"], "m", "d", str(tmp_path / "a"))
    assert out == {
        "status": bench.UNSUPPORTED,
        "reason": "config error: async_steps must be 0 (synchronous) or 1, got 3",
    }
    monkeypatch.setenv("CODE", "1")
    out = bench.spawn("ours_vllm_async3", bench.PRESETS["smoke"], "m", "d", str(tmp_path / "b"))
    assert out["status"] == "failed (exit 1)" and str(tmp_path / "b" / "bench.log") in out["reason"]


def test_phase_account_of_hand_made_steps(bench):
    """Two timed steps over a 20 s window (10 s per step): inference 3 and 1 s of which old log-probs 2 and 0.5,
    reference 0.5 and 0; training 4 and 6 s of which optimizer 1 and 1."""
    steps = [
        step(0.0, 0.0, 0.0, generation=99.0),  # warm-up: never counted
        step(
            10.0,
            0.0,
            0.0,
            generation=3.0,
            inference=3.0,
            old_logprobs=2.0,
            reference=0.5,
            training=4.0,
            optimizer=1.0,
            scoring=0.2,
        ),  # fmt: skip
        step(20.0, 0.0, 0.0, generation=2.0, inference=1.0, old_logprobs=0.5, training=6.0, optimizer=1.0),
    ]
    p = bench.summarize(steps, 4, 0.0)["phase_seconds"]
    assert list(p) == [name for name, _ in bench.ACCOUNT]
    assert p["generation"] == pytest.approx(2.5)
    assert p["old log-probs"] == pytest.approx(1.25) and p["reference"] == pytest.approx(0.25)
    assert p["other no-grad"] == pytest.approx(2.0 - 1.25 - 0.25)
    assert p["forward/backward"] == pytest.approx(5.0 - 1.0) and p["optimizer"] == pytest.approx(1.0)
    assert p["scoring"] == pytest.approx(0.1) and p["weight sync"] == 0.0
    assert p["other"] == pytest.approx(10.0 - (2.5 + 2.0 + 0.1 + 5.0))


def test_phase_table_of_a_tiny_run_ours_beside_trl(bench, tiny_models, tmp_path):
    """Both trainers run for real (in this process, the tiny model, 2 steps of 2 x 2 x 8 tokens) and the table is
    built from their own clocks: ours from metrics.jsonl's time/<phase> and time/<part>, TRL's from its profiled
    methods. Each column's phases add up to its step; both generate and train; both are on-policy here (one
    optimizer step per generation), so neither runs an old log-prob or reference pass."""
    w = bench.PRESETS["smoke"]
    data = bench.write_prompts(str(tmp_path), 8, seed=0)
    results = {}
    for name, run in (
        ("ours_hf_sync", lambda: bench.run_ours(w, tiny_models["causal_lm"], data, str(tmp_path / "o"), "hf", 0)),
        ("trl", lambda: bench.run_trl(w, tiny_models["causal_lm"], data, str(tmp_path / "t"), False)),
    ):
        steps = run()
        assert len(steps) == w.steps
        results[name] = {"runs": [bench.summarize(steps, w.episodes_per_step, 0.0)]}
    lines = bench.phase_table(results).splitlines()
    assert lines[0] == "| phase (s/step) | ours_hf_sync | trl |"
    cells = {line.split(" | ")[0].strip("| "): line.strip("| ").split(" | ")[1:] for line in lines[2:]}
    assert list(cells) == [name for name, _ in bench.ACCOUNT] + ["step"]
    for name, entry in results.items():
        r = entry["runs"][0]
        p = r["phase_seconds"]
        assert sum(p.values()) == pytest.approx(r["seconds_per_step"], rel=1e-9)
        assert p["generation"] > 0 and p["forward/backward"] > 0 and p["optimizer"] > 0, name
        assert p["old log-probs"] == 0.0 and p["reference"] == 0.0, name
        column = list(results).index(name)
        assert cells["generation"][column] == f"{p['generation']:.2f} ({p['generation'] / r['seconds_per_step']:.0%})"


def test_long_prompts_fill_up_to_the_token_budget(bench, tiny_models, tmp_path):
    """--prompt_tokens 512: every templated prompt fits in 512 tokens, all start with the same worked examples (other
    problems of demo.synthetic with their answers), and the next example would not have fitted the longest prompt."""
    import json

    from transformers import AutoTokenizer

    from demo.synthetic import broad_rl_rows

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["causal_lm"])

    def tokens(content):
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)  # fmt: skip
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    path = bench.write_prompts(str(tmp_path), 8, seed=1, prompt_tokens=512, tokenizer=tokenizer)
    contents = [json.loads(line)["messages"][-1]["content"] for line in open(path)]
    block = contents[0][: contents[0].rindex("Answer:")]
    block = block[: block.rindex("\n\n") + 2]  # the instructions and examples, up to the problem
    assert block.startswith("Solve the problem at the end. Worked examples:\n\n")
    assert all(c.startswith(block) and c.endswith(bench.SUFFIX) for c in contents)
    lengths = [tokens(c) for c in contents]
    assert max(lengths) <= 512
    used = block.count("Problem:")
    nxt = broad_rl_rows(used + 1, 2, "train")[used]  # seed + 1: where the examples come from
    longest = contents[lengths.index(max(lengths))]
    problem = longest[len(block) :]
    assert (
        tokens(block + f"Problem: {nxt['messages'][0]['content']}\nAnswer: {nxt['ground_truth']}\n\n" + problem) > 512
    )
    with pytest.raises(ValueError, match="needs the tokenizer"):
        bench.write_prompts(str(tmp_path), 8, seed=1, prompt_tokens=512)


def test_calculator_task_prompts_tool_and_trainer_settings(bench, tiny_models, tmp_path):
    """The multi-turn tool task (--task calculator): the model folder gets the tool chat template beside the same
    weights; every prompt is the system prompt, the same worked calculator conversations and its own question, within
    the token budget, and one more conversation would not have fitted; TRL's calculator tool renders the schema ours
    renders and computes what ours computes; our trainer plays the tool environment with max_turns - 1 calls."""
    import json

    from transformers import AutoTokenizer

    from demo.synthetic import tool_sft_rows
    from open_instruct.environments import CALCULATOR_SCHEMA, calculate

    model = bench.prepare_tool_model(str(tmp_path), tiny_models["causal_lm"])
    for name in ("model.safetensors", "config.json"):  # the same bytes (hard links where the file system allows)
        with open(os.path.join(model, name), "rb") as a, open(os.path.join(tiny_models["causal_lm"], name), "rb") as b:
            assert a.read() == b.read()
    tokenizer = AutoTokenizer.from_pretrained(model)
    assert "<tool_call>" in tokenizer.chat_template and "tools" in tokenizer.chat_template

    def tokens(messages, tools):
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    system = {"role": "system", "content": bench.TOOL_SYSTEM_PROMPT}
    shots = [m for example in tool_sft_rows(64, 2, direct_fraction=0.0) for m in example["messages"]]  # seed + 1
    question = {"role": "user", "content": "What is 1000+1000?"}
    bare = tokens([system, question], [CALCULATOR_SCHEMA])
    budget = bare + (tokens([system, *shots[:4], question], [CALCULATOR_SCHEMA]) - bare) * 5 // 2  # ~2 conversations
    with pytest.raises(ValueError, match="not even one worked conversation fits"):
        bench.write_tool_prompts(str(tmp_path), 8, seed=1, prompt_tokens=bare, tokenizer=tokenizer)
    path = bench.write_tool_prompts(str(tmp_path), 8, seed=1, prompt_tokens=budget, tokenizer=tokenizer)
    rows = [json.loads(line) for line in open(path)]
    head = rows[0]["messages"][:-1]
    assert head[0] == system
    used = len(head) - 1
    assert (
        used % 4 == 0 and used >= 4 and head[1:] == shots[:used]
    )  # whole conversations: question, call, result, answer
    assert all(r["messages"][:-1] == head and r["messages"][-1]["role"] == "user" for r in rows)
    assert all(r["dataset"] == "arithmetic" and r["ground_truth"] for r in rows)
    lengths = [tokens(r["messages"], [CALCULATOR_SCHEMA]) for r in rows]
    assert max(lengths) <= budget
    longest = rows[lengths.index(max(lengths))]["messages"]
    assert tokens(head + shots[used : used + 4] + longest[-1:], [CALCULATOR_SCHEMA]) > budget

    tool = bench.calculator_tool()
    assert tool("(1234 * 5678) - 9") == calculate("(1234 * 5678) - 9") == str(1234 * 5678 - 9)
    assert tokens(longest, [tool]) == tokens(longest, [CALCULATOR_SCHEMA])
    w = bench.PRESETS["tools_r128"]
    argv = bench.ours_argv(w, model, path, str(tmp_path / "o"), "hf", 0)
    settings = dict(zip(argv[::2], argv[1::2]))
    assert settings["--environment"] == "tool" and settings["--tool_call_format"] == "hermes"
    assert settings["--max_turns"] == str(w.max_turns) and settings["--max_tool_calls"] == str(w.max_turns - 1)
