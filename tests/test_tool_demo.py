"""The tool-use demo's data path: synthetic calculator traces render Hermes tool calls and train only assistant
tokens; the SFT rendering of a trace is token for token the episode the RL environment plays; SFT trains on them;
and the demo's orchestration end to end on a tiny budget (slow)."""

from __future__ import annotations

import json
import os
import random
import re
import string
from types import SimpleNamespace

import pytest
from training_helpers import one_torch_thread  # noqa: F401  (autouse fixture)

from demo.synthetic import TOOL_RANGES, calculator_call, tool_problem, tool_rl_rows, tool_sft_rows, write_jsonl
from demo.tiny import build_tokenizer
from open_instruct.data import Row, tokenize_sft
from open_instruct.environments import ToolEnvironment
from open_instruct.episodes import EpisodeBudget, EpisodeTokenizer, rollout_episodes
from open_instruct.errors import DataError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def sft_cfg(**overrides):
    cfg = dict(messages_column="messages", max_seq_length=512, overlong="drop", skip_bad_rows=False,
               string_rows="chat", dataset_num_proc=1)  # fmt: skip
    cfg.update(overrides)
    return SimpleNamespace(**cfg)


def encode_rows(rows, tokenizer, **cfg):
    return tokenize_sft([Row("traces.jsonl", i, i + 1, r) for i, r in enumerate(rows)], tokenizer, sft_cfg(**cfg))[0]


def trace(question: str, expression: str, result: str) -> list[dict]:
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [calculator_call(expression)]},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": result},
    ]


def trained_text(tokenizer, example) -> list[str]:
    """The trained tokens decoded, one string per run of consecutive trained positions."""
    runs, current = [], []
    for token, label in zip(example["input_ids"], example["labels"]):
        if label != -100:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(r, skip_special_tokens=False) for r in runs]


def test_synthetic_traces_call_the_calculator_and_answer_right():
    rows = tool_sft_rows(400, 0, direct_fraction=0.25, wrong_fraction=0.5)
    with_tool = [r for r in rows if len(r["messages"]) == 4]
    direct = [r for r in rows if len(r["messages"]) == 2]
    assert len(with_tool) + len(direct) == 400
    assert 0.20 <= len(direct) / 400 <= 0.30  # 25% asked for (binomial sd 2.2 points)
    wrong = 0
    for r in rows:
        a, op, b = re.search(r"(\d+) ?([-+*]) ?(\d+)", r["messages"][0]["content"]).groups()
        truth = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        low, high = TOOL_RANGES["train"][op]
        assert low <= int(a) <= high and low <= int(b) <= high
        final = r["messages"][-1]["content"]
        if len(r["messages"]) == 4:
            call = r["messages"][1]["tool_calls"][0]["function"]
            assert call == {"name": "calculator", "arguments": {"expression": f"{a}{op}{b}"}}
            assert r["messages"][2] == {"role": "tool", "content": str(truth)} and final == str(truth)
        else:
            wrong += final != str(truth)
    assert 0.3 <= wrong / len(direct) <= 0.7  # half of the direct answers are wrong


def test_direct_answers_only_for_the_chosen_operations_on_the_same_problems():
    """The demo's setting: 70% of sums and differences answered at once, every product through the calculator;
    the questions are the same ones whatever operations answer at once."""
    every_op = tool_sft_rows(600, 5, direct_fraction=0.7, direct_ops="+-*")
    sums_only = tool_sft_rows(600, 5, direct_fraction=0.7, direct_ops="+-")
    assert [r["messages"][0] for r in every_op] == [r["messages"][0] for r in sums_only]
    by_op: dict[str, list[bool]] = {"+": [], "-": [], "*": []}
    for r in sums_only:
        op = re.search(r"\d ?([-+*]) ?\d", r["messages"][0]["content"]).group(1)
        by_op[op].append(len(r["messages"]) == 2)
    assert not any(by_op["*"]) and len(by_op["*"]) > 150
    for op in "+-":
        assert 0.6 <= sum(by_op[op]) / len(by_op[op]) <= 0.8  # 70% asked for (binomial sd ~3.2 points)
    with pytest.raises(ValueError, match="direct_ops must be"):
        tool_sft_rows(4, 0, direct_ops="/")


def test_out_of_range_held_out_problems_have_one_digit_more():
    rng = random.Random(0)
    for _ in range(200):
        p, q = tool_problem(rng, "train"), tool_problem(rng, "out_of_range", "held_out")
        for problem, widths in ((p, {"+": 4, "-": 4, "*": 3}), (q, {"+": 5, "-": 5, "*": 4})):
            a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)", problem["expression"]).groups()
            assert len(a) == len(b) == widths[op]
    rows = tool_rl_rows(3, 1, "out_of_range")
    assert [r["dataset"] for r in rows] == ["arithmetic"] * 3 and all(r["ground_truth"].lstrip("-").isdigit()
                                                                      for r in rows)  # fmt: skip


def test_tool_trace_trains_only_the_assistant_turns(tok):
    """Hand-worked: the trained tokens are exactly the call turn and the answer turn, each with its end-of-turn
    token and the newline the template puts after it; the question and the tool result are not trained."""
    (example,) = encode_rows([{"messages": trace("Compute 7890-1663.", "7890-1663", "6227")}], tok)
    call = CALL % "7890-1663"
    assert trained_text(tok, example) == [call + "<|end|>\n", "6227<|end|>\n"]
    # character-level: one token per character, <|end|> one token
    assert sum(label != -100 for label in example["labels"]) == len(call) + 2 + len("6227") + 2
    full = tok.decode(example["input_ids"], skip_special_tokens=False)
    assert full == (f"<|user|>\nCompute 7890-1663.<|end|>\n<|assistant|>\n{call}<|end|>\n<|tool|>\n6227<|end|>\n"
                    "<|assistant|>\n6227<|end|>\n")  # fmt: skip


def test_json_string_arguments_and_flat_calls_render_the_same_call(tok):
    rows = [
        {"messages": trace("Compute 12+34.", "12+34", "46")},
        {"messages": trace("Compute 12+34.", "12+34", "46")},
        {"messages": trace("Compute 12+34.", "12+34", "46")},
    ]
    rows[1]["messages"][1]["tool_calls"] = [
        {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "12+34"}'}}
    ]  # OpenAI's wire form: arguments as a JSON string
    rows[2]["messages"][1]["tool_calls"] = [{"name": "calculator", "arguments": {"expression": "12+34"}}]
    a, b, c = encode_rows(rows, tok)
    assert a["input_ids"] == b["input_ids"] == c["input_ids"] and a["labels"] == b["labels"] == c["labels"]


@pytest.mark.parametrize(
    "calls, complaint",
    [
        ([{"function": {"arguments": {"expression": "1+1"}}}], "tool_calls[0] needs a string 'name'"),
        ([{"function": {"name": "calculator", "arguments": "{not json"}}], "tool_calls[0] needs a string 'name'"),
        ("calculator(1+1)", "'tool_calls' must be a non-empty list"),
    ],
)
def test_a_bad_tool_call_is_refused_naming_file_row_and_message(tok, calls, complaint):
    rows = [{"messages": trace("Compute 1+1.", "1+1", "2")}, {"messages": trace("Compute 1+1.", "1+1", "2")}]
    rows[1]["messages"][1]["tool_calls"] = calls
    with pytest.raises(DataError, match=re.escape("traces.jsonl line 2: messages[1]: ")) as e:
        encode_rows(rows, tok)
    assert complaint in str(e.value)


def chatml_char_tokenizer():
    """A character tokenizer with ChatML's role markers as tokens, carrying SmolLM2's kind of template (ChatML
    without tool syntax): the SmolLM2 demo's setting without its 100 MB download."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from open_instruct.chat_templates import CHATML

    specials = ["<pad>", "<|im_end|>", "<|im_start|>"]
    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    model = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + chars + ["<unk>"])}, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    model.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=model, pad_token="<pad>", eos_token="<|im_end|>",
                                   unk_token="<unk>", additional_special_tokens=specials[2:])  # fmt: skip
    fast.chat_template = CHATML
    return fast


@pytest.mark.parametrize("setting", ["tiny template, tool_calls", "ChatML, calls as text + system prompt"])
def test_sft_rendering_is_the_rl_episode_token_for_token(setting):
    """An SFT trace and the episode the `tool` environment plays when the policy writes the trace's assistant
    turns: the same ids (the episode stops at the final end-of-turn token; the SFT row also has the template's
    newline after it), and the episode's policy tokens are exactly the SFT row's trained tokens except each
    newline after an end-of-turn token, which the policy never generates (it stops at its end token) and the
    episode counts as the observation's first token, and each call turn's end-of-turn token: a call turn ends at
    its `</tool_call>`, and the environment's observation closes it. Both demos' settings: the tiny template
    rendering `tool_calls`, and SmolLM2's (a template without tool syntax; calls as text, a system prompt), with
    two-step traces that chain two calls."""
    from demo.smollm2_tools import SYSTEM_PROMPT, as_text_calls
    from demo.word_problems import calculator_traces

    if setting.startswith("tiny"):
        tok, n_prompt = build_tokenizer(), 1
        rows = tool_sft_rows(40, 3, direct_fraction=0.25)
    else:
        tok, n_prompt = chatml_char_tokenizer(), 2
        traces = calculator_traces(20, 3, "symbolic") + calculator_traces(20, 3, "word", chain=True, two_step_share=0.5)
        rows = as_text_calls(traces, SYSTEM_PROMPT)
    examples = encode_rows(rows, tok, max_seq_length=1024)
    tokens = EpisodeTokenizer(tok)
    env_rows, scripts = [], []
    for row, example in zip(rows, examples):
        env_rows.append({"messages": row["messages"][:n_prompt], "ground_truth": row["messages"][-1]["content"],
                         "verifier": "arithmetic"})  # fmt: skip
        # the policy's turns: the SFT row's trained runs, less the newline after each end-of-turn token
        turns, current = [], []
        for token, label in zip(example["input_ids"], example["labels"]):
            if label != -100:
                current.append(token)
            elif current:
                turns.append(current)
                current = []
        turns.append(current) if current else None
        scripts.append([t[:-1] for t in turns])
        assert all(t[-1] == tok.convert_tokens_to_ids("\n") and t[-2] == tok.eos_token_id for t in turns)
    episodes = []
    for env_row, script in zip(env_rows, scripts):  # one episode at a time: the policy replays its row's turns
        turns = iter(script)
        env = ToolEnvironment(tokenizer=tok, tool_output_max_tokens=32)
        (episode,) = rollout_episodes(
            [env], [env_row], lambda prompts, caps: [(t, [0.0] * len(t)) for t in [next(turns)]], tokens,
            EpisodeBudget(3, 96, 400),
        )  # fmt: skip
        episodes.append(episode)
    newline = tok.convert_tokens_to_ids("\n")
    n_tool = 0
    for row, example, episode in zip(rows, examples, episodes):
        ids, labels = example["input_ids"], example["labels"]
        tool_messages = [m["content"] for m in row["messages"] if m["role"] == "tool"]
        assert episode.end_reason == "done" and len(episode.turns) == len(tool_messages) + 1
        assert episode.ids == ids[:-1]  # the SFT row's last token is the newline after the final <|end|>
        trained = [int(label != -100) for label in labels[len(episode.prompt_ids) : -1]]
        separators = [i for i, t in enumerate(episode.response_ids[1:], 1)
                      if t == newline and episode.response_ids[i - 1] == tok.eos_token_id]  # fmt: skip
        call_ends = [turn.policy_end for turn in episode.turns[:-1]]
        assert all(episode.response_ids[i] == tok.eos_token_id and not turn.closed
                   for i, turn in zip(call_ends, episode.turns))  # fmt: skip
        expected = [0 if i in separators or i in call_ends else m for i, m in enumerate(trained)]
        assert episode.loss_mask == expected
        n_tool += episode.tool_calls
        for result in tool_messages:  # the calculator's own answers are the trace's tool messages
            assert re.search(r"tool(\|>)?\n" + result + r"<\|", tok.decode(ids, skip_special_tokens=False))
    assert n_tool == sum(m["role"] == "tool" for r in rows for m in r["messages"]) > 20
    chained = [r for r in rows if sum(m["role"] == "tool" for m in r["messages"]) == 2]
    assert len(chained) >= (0 if setting.startswith("tiny") else 5)  # 20 word traces, half two-step: chained


@pytest.mark.parametrize("recipe", ["sft_tools.yaml", "rlvr_tools.yaml"])
def test_demo_recipes_parse(recipe):
    from open_instruct.config import RLVRConfig, SFTConfig, parse_config

    cfg = parse_config(SFTConfig if recipe.startswith("sft") else RLVRConfig,
                       [os.path.join(REPO, "configs", "demo", recipe)])  # fmt: skip
    if recipe.startswith("rlvr"):
        assert cfg.environment == "tool" and cfg.tools == ["calculator"] and cfg.tool_call_format == "hermes"
        plan = cfg.batch_plan(1, None)
        assert plan.num_training_steps == 40


def test_sft_on_tool_traces_trains_a_step(tiny_models, tmp_path):
    """Two optimizer steps of the demo's SFT recipe on tool traces: the loss starts at ln(vocab) (random init
    spreads its mass evenly: a 0.08M-parameter model's logits are near zero) and the weights move."""
    import math

    import torch
    from training_helpers import load_weights, read_metrics

    from open_instruct import sft

    data = write_jsonl(str(tmp_path / "traces.jsonl"), tool_sft_rows(16, 0))
    out = tmp_path / "sft"
    sft.main([os.path.join(REPO, "configs", "demo", "sft_tools.yaml"), "--model_name_or_path",
              tiny_models["causal_lm"], "--dataset_name_or_path", data, "--eval_dataset_name_or_path", "null",
              "--output_dir", str(out), "--total_episodes", "16", "--per_device_train_batch_size", "8",
              "--logging_steps", "1", "--eval_steps", "null", "--best_metric", "null"])  # fmt: skip
    rows = [r for r in read_metrics(str(out)) if "train/loss" in r]
    assert len(rows) == 2
    vocab = len(build_tokenizer())
    assert rows[0]["train/loss"] == pytest.approx(math.log(vocab), abs=0.1)
    before, after = load_weights(tiny_models["causal_lm"]), load_weights(str(out / "final_model"))
    assert any(not torch.equal(before[k], after[k]) for k in before)


# ---------------------------------------------------------------------------------------------------------------------
# The demo end to end, on a tiny budget


@pytest.mark.slow
def test_tool_demo_runs_every_stage_and_reports_paired_numbers(tmp_path):
    from demo import tools as demo_tools

    out = tmp_path / "demo"
    summary = demo_tools.main(["--output_dir", str(out), "--quick", "--quiet", "--hidden_size", "32",
                               "--num_layers", "2", "--sft_total_episodes", "64", "--n_test", "6",
                               "--total_episodes", "64",
                               "--local_rollout_batch_size", "4", "--per_device_train_batch_size", "16",
                               "--eval_steps", "1"])  # fmt: skip
    for name in ("sft", "rlvr_tools", "rlvr_no_tools"):
        assert os.path.isfile(out / name / "final_model" / "config.json"), name
    log = (out / "logs" / "rlvr_no_tools.log").read_text().splitlines()[0]
    assert "configs/demo/rlvr_tools.yaml" in log and "--environment null" in log
    for key, result in summary["held_out"].items():
        preds = [json.loads(line) for line in open(out / "eval" / key.replace("|", "-") / "predictions.jsonl")]
        assert len(preds) == result["total"] == 6
        assert result["correct"] == sum(p["correct"] for p in preds)
        assert result["tool_calls_per_episode"] == sum(p["tool_calls"] for p in preds) / 6
        if "|no_tools|" in key:
            assert result["tool_calls_per_episode"] == 0  # nothing is run without the environment
    for arm in ("tools", "no_tools"):
        for held_out in ("in_range", "out_of_range"):
            c = summary["paired_vs_sft"][f"{arm}|{held_out}"]
            before = summary["held_out"][f"sft|{arm}|{held_out}"]["correct"]
            after = summary["held_out"][f"rlvr_{arm}|{arm}|{held_out}"]["correct"]
            assert after - before == c["fixed"] - c["broken"]
    trainer = summary["trainer_eval"]
    assert trainer["tools"]["first"]["rollout_step"] == 0 and "eval/tool_calls_per_episode" in trainer["tools"]["last"]
    assert "eval/correct_rate" in trainer["no_tools"]["last"]
    md = (out / "summary.md").read_text()
    assert "with calculator" in md and "without tools" in md and "CPU-minutes" in md


def test_distillation_curve_reads_cpu_minutes_and_finds_the_first_point_at_the_teachers_level(tmp_path):
    from demo.pipeline import DemoError
    from demo.smollm2_tools_distill import cpu_minutes_at, first_at

    rows = [{"rollout_step": 1, "perf/process_cpu_minutes": 2.5}, {"rollout_step": 2, "perf/process_cpu_minutes": 4.75},
            {"rollout_step": 3}]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cpu_minutes_at(str(tmp_path), 2) == 4.75
    with pytest.raises(DemoError, match="no perf/process_cpu_minutes for rollout 3"):
        cpu_minutes_at(str(tmp_path), 3)
    curve = [{"rollout": 0, "mean": 0.3}, {"rollout": 2, "mean": 0.55}, {"rollout": 4, "mean": 0.6}]
    assert first_at(curve, 0.55)["rollout"] == 2  # reached: at least the level
    assert first_at(curve, 0.61) is None


def test_distillation_train_only_needs_no_rl_checkpoints_and_runs_rls_batch_and_order(tmp_path, monkeypatch):
    """RL's checkpoints are needed for its curve only: `--train_only` distills from a demo folder whose RL run kept
    none (a finished run's teacher), with the RL run's prompt order and the overrides passed through."""
    import demo.smollm2_tools_distill as distill
    from demo.pipeline import DemoError

    for path in ("sft/final_model", "rlvr/final_model"):
        (tmp_path / path).mkdir(parents=True)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "rl_train.jsonl").write_text("")
    (tmp_path / "rlvr" / "config.yaml").write_text("train_order: as_written\n")
    calls = []
    monkeypatch.setattr(distill, "run_script", lambda cmd, log, env, echo: calls.append(cmd) or (0, 90.0))
    with pytest.raises(DemoError, match="has no checkpoints"):
        distill.main(["--demo_dir", str(tmp_path), "--num_threads", "0"])
    assert calls == []  # stopped before any training
    summary = distill.main(["--demo_dir", str(tmp_path), "--num_threads", "0", "--train_only", "--distill_loss",
                            "reverse_kl", "--rollouts", "4", "--temperature", "1.0"])  # fmt: skip
    assert summary == {"cpu_seconds": {"reverse_kl": 90.0}} and len(calls) == 1
    cmd = calls[0]
    value = lambda flag: cmd[cmd.index(flag) + 1]  # noqa: E731
    assert value("--teacher_model_name_or_path") == str(tmp_path / "rlvr" / "final_model")
    assert value("--model_name_or_path") == str(tmp_path / "sft" / "final_model")
    assert value("--train_order") == "as_written" and value("--temperature") == "1.0"
    assert value("--total_episodes") == str(4 * distill.EPISODES_PER_ROLLOUT)
