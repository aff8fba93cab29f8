"""Data formats (open_instruct/formats.py, data.py), batched tokenization (encode.py, forked workers), the
tokenized-data cache (data_cache.py) and named chat templates (chat_templates.py).

Token counts are hand-worked on the tests' character tokenizer (demo/tiny.py): one token a character, role markers
and `<|end|>` (EOS) one token each, no BOS; its template renders a turn as `<|role|>\\n` + content + `<|end|>\\n`."""

from __future__ import annotations

import json
import os

import pytest
from training_helpers import one_torch_thread, read_metrics  # noqa: F401  (fixture: one torch thread)

from demo.synthetic import preference_rows, rl_rows, sft_rows, write_jsonl
from open_instruct import data, runtime
from open_instruct.chat_templates import NAMED_TEMPLATES, resolve_chat_template
from open_instruct.config import DPOConfig, RLVRConfig, SFTConfig
from open_instruct.errors import ConfigError, DataError

END = "<|end|>"


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    from open_instruct.models import load_tokenizer

    return load_tokenizer(tiny_models["causal_lm"])


def rows_of(examples: list[dict]) -> list[data.Row]:
    return [data.Row("mem.jsonl", i, i + 1, e) for i, e in enumerate(examples)]


def sft(rows, tokenizer, **kw):
    cfg = SFTConfig(model_name_or_path="m", dataset_name_or_path="mem.jsonl", max_seq_length=512, **kw)
    return data.tokenize_sft(rows_of(rows), tokenizer, cfg)


def prefs(rows, tokenizer, **kw):
    cfg = DPOConfig(model_name_or_path="m", dataset_name_or_path="mem.jsonl", max_seq_length=512, **kw)
    return data.tokenize_preferences(rows_of(rows), tokenizer, cfg)


def prompts(rows, tokenizer, **kw):
    cfg = RLVRConfig(
        model_name_or_path="m", dataset_name_or_path="mem.jsonl", total_episodes=8, max_prompt_length=256, **kw
    )
    return data.tokenize_prompts(rows_of(rows), tokenizer, cfg)


def run_to_the_end(main, argv: list[str]) -> None:
    """The script's entry point in this process; a SystemExit must be status 0."""
    try:
        runtime.run(main, argv)
    except SystemExit as e:
        assert e.code in (0, None), e.code


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def trained(tokenizer, example: dict) -> str:
    return tokenizer.decode([t for t in example["labels"] if t != -100])


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


# ---------------------------------------------------------------------------------------------------------------------
# SFT formats


def test_sft_string_prompt_completion_is_raw_by_default_and_templated_on_request(tokenizer):
    (ex,), stats = sft([{"prompt": "2+2=", "completion": " 4"}], tokenizer)
    assert ex["input_ids"] == ids(tokenizer, "2+2= 4" + END)  # raw: no role markers, EOS appended
    assert ex["labels"] == [-100] * 4 + ex["input_ids"][4:]  # the 4 prompt characters are not trained
    assert (stats.format, stats.raw_string_rows) == ("prompt_completion", 1)
    # an EOS already there is not doubled
    (ex2,), _ = sft([{"prompt": "2+2=", "completion": " 4" + END}], tokenizer)
    assert ex2["input_ids"] == ex["input_ids"]
    # string_rows chat_template: the same example as the conversation user "2+2=", assistant " 4"
    (chat,), stats = sft([{"prompt": "2+2=", "completion": " 4"}], tokenizer, string_rows="chat_template")
    (ref,), _ = sft([{"messages": [user("2+2="), assistant(" 4")]}], tokenizer)
    assert chat["input_ids"] == ref["input_ids"] and chat["labels"] == ref["labels"]
    assert stats.raw_string_rows == 0 and trained(tokenizer, chat) == " 4" + END + "\n"


def test_sft_conversational_prompt_completion_trains_the_completion_only(tokenizer):
    prompt = [user("a"), assistant("b"), user("c")]
    (ex,), stats = sft([{"prompt": prompt, "completion": [assistant("dd")]}], tokenizer)
    assert stats.format == "prompt_completion"
    (full,), _ = sft([{"messages": [*prompt, assistant("dd")]}], tokenizer)
    assert ex["input_ids"] == full["input_ids"]
    assert trained(tokenizer, ex) == "dd" + END + "\n"  # the prompt's assistant turn "b" is context only
    assert trained(tokenizer, full) == "b" + END + "\n" + "dd" + END + "\n"


def test_sft_text_trains_every_token(tokenizer):
    (ex,), stats = sft([{"text": "hello"}], tokenizer)
    assert stats.format == "text"
    assert ex["input_ids"] == ids(tokenizer, "hello" + END) and ex["labels"] == ex["input_ids"]


def test_batched_tokenization_equals_the_per_row_reference(tokenizer):
    """Multi-turn chats with a system turn: the batched path (encode.encode_chats) gives exactly the tokens and
    labels of the per-row reference (data.tokenize_sft_messages, three template calls per assistant turn)."""
    chats = [[{"role": "system", "content": "Be brief."}, user("Hi"), assistant("Hello"), user("2+2?"), assistant("4")]]
    chats += [[user("x" * i), assistant("y" * (i + 1))] * (1 + i % 3) for i in range(1, 6)]
    examples, _ = sft([{"messages": c} for c in chats], tokenizer)
    for c, ex in zip(chats, examples):
        ref_ids, ref_labels = data.tokenize_sft_messages(tokenizer, c, "ref")
        assert ex["input_ids"] == ref_ids and ex["labels"] == ref_labels


# ---------------------------------------------------------------------------------------------------------------------
# Preference formats


def test_preference_formats_convert_to_the_same_pairs(tokenizer):
    q, good, bad = "Sky colour?", "blue", "green"
    implicit = {"chosen": [user(q), assistant(good)], "rejected": [user(q), assistant(bad)]}
    explicit = {"prompt": [user(q)], "chosen": [assistant(good)], "rejected": [assistant(bad)]}  # TRL's shape
    strings = {"prompt": q, "chosen": good, "rejected": bad}
    (a,), sa = prefs([implicit], tokenizer)
    (b,), sb = prefs([explicit], tokenizer)
    (c,), sc = prefs([strings], tokenizer, string_rows="chat_template")
    assert (sa.format, sb.format, sc.format) == ("implicit_prompt", "explicit_prompt", "explicit_prompt")
    for other in (b, c):
        assert {k: other[k] for k in ("chosen_ids", "rejected_ids", "prompt_len")} == {
            k: a[k] for k in ("chosen_ids", "rejected_ids", "prompt_len")
        }
    assert a["prompt_len"] == len(ids(tokenizer, f"<|user|>\n{q}{END}\n<|assistant|>\n"))  # 1+1+11+1+1+1+1 = 17


def test_preference_strings_are_raw_by_default(tokenizer):
    (ex,), stats = prefs([{"prompt": "Q:", "chosen": " yes", "rejected": " no"}], tokenizer)
    assert ex["chosen_ids"] == ids(tokenizer, "Q: yes" + END) and ex["rejected_ids"] == ids(tokenizer, "Q: no" + END)
    assert ex["prompt_len"] == 2 and stats.raw_string_rows == 1
    # implicit prompt strings: the prompt is the common prefix, its trailing space goes to the replies
    (ex,), stats = prefs([{"chosen": "The sky is blue.", "rejected": "The sky is green."}], tokenizer)
    assert stats.format == "implicit_prompt" and ex["prompt_len"] == len("The sky is")
    assert tokenizer.decode(ex["chosen_ids"][ex["prompt_len"] :]) == " blue." + END


# ---------------------------------------------------------------------------------------------------------------------
# RL prompt formats


def test_rl_rows_with_a_verifier_list_and_prompt_columns(tokenizer):
    q = "What is 2+2?"
    (a,), sa = prompts([{"messages": [user(q)], "ground_truth": ["4"], "dataset": ["arithmetic"]}], tokenizer)
    assert (a["verifier"], a["ground_truth"], sa.format) == ("arithmetic", "4", "messages")  # unwrapped
    (b,), sb = prompts([{"prompt": [user(q)], "ground_truth": "4", "dataset": "arithmetic"}], tokenizer)
    assert b["prompt_ids"] == a["prompt_ids"] and sb.format == "prompt"
    assert a["prompt_ids"] == ids(tokenizer, f"<|user|>\n{q}{END}\n<|assistant|>\n")
    (c,), sc = prompts([{"prompt": q, "ground_truth": "4", "dataset": "arithmetic"}], tokenizer)
    assert c["prompt_ids"] == ids(tokenizer, q) and sc.raw_string_rows == 1  # TRL: a string prompt as written
    (d,), _ = prompts(
        [{"prompt": q, "ground_truth": "4", "dataset": "arithmetic"}], tokenizer, string_rows="chat_template"
    )
    assert d["prompt_ids"] == a["prompt_ids"]
    with pytest.raises(DataError, match=r"^mem.jsonl line 1: column 'dataset' lists 2 verifiers"):
        prompts([{"messages": [user(q)], "ground_truth": ["4", "4"], "dataset": ["arithmetic", "math"]}], tokenizer)


# ---------------------------------------------------------------------------------------------------------------------
# Unrecognised formats


@pytest.mark.parametrize(
    "tokenize, row, expected",
    [
        (sft, {"question": "q", "answer": "a"}, "no sft data format. Accepted: 'messages' (a conversation); "),
        (prefs, {"question": "q", "good": "a"}, "no preference data format. Accepted: 'prompt' + 'chosen' + "),
        (prompts, {"question": "q", "ground_truth": "4"}, "no prompt data format. Accepted: 'messages' (messages)"),
    ],
)
def test_unrecognised_format_names_the_columns_and_the_formats(tokenize, row, expected, tokenizer):
    with pytest.raises(DataError) as e:
        tokenize([row], tokenizer)
    assert str(e.value).startswith(f"mem.jsonl line 1: columns {sorted(row)} match ")
    assert expected in str(e.value)


def test_unrecognised_format_exits_2_before_the_model_loads(tiny_models, tmp_path, capsys):
    from open_instruct import sft as sft_script

    path = write_jsonl(str(tmp_path / "qa.jsonl"), [{"question": "q", "answer": "a"}])
    argv = ["--model_name_or_path", tiny_models["causal_lm"], "--dataset_name_or_path", path]
    with pytest.raises(SystemExit) as e:
        runtime.run(sft_script.main, [*argv, "--output_dir", str(tmp_path / "out")])
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"DataError: {path} line 1: columns ['answer', 'question'] match no sft data format")
    assert not os.path.exists(tmp_path / "out" / "metrics.jsonl")


# ---------------------------------------------------------------------------------------------------------------------
# Files and folders


def test_every_file_type_and_saved_folders_load_the_same_rows(tmp_path):
    import datasets

    rows = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(3)]
    paths = {"jsonl": write_jsonl(str(tmp_path / "d.jsonl"), rows)}
    (tmp_path / "d.json").write_text(json.dumps(rows))
    paths["json"] = str(tmp_path / "d.json")
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.to_csv(str(tmp_path / "d.csv"), index=False)
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "saved_dict"))
    paths.update(parquet=str(tmp_path / "d.parquet"), csv=str(tmp_path / "d.csv"), saved=str(tmp_path / "saved"))
    for name, path in {**paths, "saved_dict": str(tmp_path / "saved_dict")}.items():
        assert [r.data for r in data.load_rows(path)] == rows, name
    assert [r.data for r in data.load_rows(str(tmp_path / "saved_dict"), "test")] == rows[:1]
    # the dry-run planner counts them without loading the rows
    from open_instruct.plan import count_local_rows

    assert [count_local_rows(paths[k]) for k in ("jsonl", "json", "parquet", "csv", "saved")] == [3] * 5
    assert count_local_rows(str(tmp_path / "saved_dict"), "test") == 1
    with pytest.raises(
        DataError, match=r"saved DatasetDict .* has no split 'validation' \(splits: \['test', 'train'\]\)"
    ):
        data.load_rows(str(tmp_path / "saved_dict"), "validation")


# ---------------------------------------------------------------------------------------------------------------------
# Parallel tokenization and the cache


def test_parallel_tokenization_matches_and_names_the_bad_line(tokenizer, tmp_path):
    """Two forked worker processes give the same examples as one process; a bad row still stops the run
    naming its file and line."""
    rows = [{"messages": [user(f"q{i}"), assistant("a" * (i % 7 + 1))]} for i in range(60)]
    one, stats1 = sft(rows, tokenizer)
    two, stats2 = sft(rows, tokenizer, dataset_num_proc=2)
    assert two == one and (stats1.processes, stats2.processes) == (1, 2)
    rows[41] = {"messages": [user("no reply")]}
    with pytest.raises(DataError, match=r"^mem.jsonl line 42: the last message of 'messages' must be from the"):
        sft(rows, tokenizer, dataset_num_proc=2)
    pairs = [{"prompt": f"q{i}", "chosen": " yes" * (i % 3 + 1), "rejected": " no"} for i in range(20)]
    assert prefs(pairs, tokenizer, dataset_num_proc=2)[0] == prefs(pairs, tokenizer)[0]
    rl = [{"prompt": f"q{i}", "ground_truth": [["4"], 4, "4"][i % 3], "dataset": "arithmetic"} for i in range(20)]
    assert prompts(rl, tokenizer, dataset_num_proc=2)[0] == prompts(rl, tokenizer)[0]


def test_second_load_reads_the_cache_and_a_change_misses_it(tokenizer, tmp_path):
    path = write_jsonl(str(tmp_path / "rl.jsonl"), rl_rows(6, 0))
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    rows[1]["ground_truth"], rows[2]["ground_truth"] = ["4"], 7  # any JSON ground truth survives the cache
    rows[1]["dataset"] = ["arithmetic"]
    write_jsonl(path, rows)
    cache = str(tmp_path / "cache")

    def load(**kw):
        cfg = RLVRConfig(
            model_name_or_path="m",
            dataset_name_or_path=path,
            total_episodes=8,
            eval_fraction=0.4,
            **{"dataset_cache_dir": cache, **kw},
        )
        return data.load_train_eval(cfg, tokenizer, data.tokenize_prompts)

    train, evals, stats = load()
    assert stats.inputs.startswith("format messages; tokenized data written to the cache ")
    folder = stats.inputs.rsplit(" ", 1)[1]
    assert os.path.isfile(os.path.join(folder, "meta.json")) and os.path.dirname(folder) == cache
    train2, evals2, stats2 = load()
    assert stats2.inputs == f"format messages; tokenized data read from the cache {folder}"
    assert (train2, evals2) == (train, evals) and stats2.summary() != "" and stats2.kept == stats.kept == 6
    assert {repr(e["ground_truth"]) for e in train + evals} >= {"'4'", "7"}
    # another max_prompt_length, or new file contents: another entry
    _, _, stats3 = load(max_prompt_length=64)
    assert "written to the cache" in stats3.inputs and stats3.inputs.rsplit(" ", 1)[1] != folder
    write_jsonl(path, rows[:5])
    _, _, stats4 = load()
    assert "written to the cache" in stats4.inputs and stats4.rows == 5
    _, _, stats5 = load(dataset_cache_dir="none")
    assert stats5.inputs == "format messages; tokenized-data cache off"


# ---------------------------------------------------------------------------------------------------------------------
# Chat templates


def test_named_templates_resolve_and_are_prefix_stable(tiny_models, tmp_path):
    from open_instruct.models import load_tokenizer

    conv = [{"role": "system", "content": "S"}, user("Hi"), assistant("Yo "), user("2+2?"), assistant("4")]
    for name, template in NAMED_TEMPLATES.items():
        assert resolve_chat_template(name) == template
        tokenizer = load_tokenizer(tiny_models["causal_lm"], chat_template=name)
        assert tokenizer.chat_template == template
        whole = tokenizer.apply_chat_template(conv, tokenize=False)
        for cut in (1, 3):  # the conversation before each assistant turn, with the generation prompt
            assert whole.startswith(tokenizer.apply_chat_template(conv[: cut + 1], tokenize=False))
            assert whole.startswith(
                tokenizer.apply_chat_template(conv[: cut + 1], tokenize=False, add_generation_prompt=True)
            ), name
        examples, _ = sft([{"messages": conv}], tokenizer)  # SFT labels: exactly the two replies' tokens
        assert "Yo" in trained(tokenizer, examples[0]) and "2+2" not in trained(tokenizer, examples[0])
    tokenizer.chat_template = NAMED_TEMPLATES["chatml"]
    assert tokenizer.apply_chat_template([user("Hi")], tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert resolve_chat_template("Llama3") == NAMED_TEMPLATES["llama-3"]
    jinja = tmp_path / "mine.jinja"
    jinja.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert resolve_chat_template(str(jinja)) == jinja.read_text()
    assert resolve_chat_template("{{ messages }}") == "{{ messages }}"  # Jinja text, as before
    with pytest.raises(ConfigError) as e:
        resolve_chat_template("tulu3")
    assert str(e.value).startswith("chat_template 'tulu3' is not a template name (tulu, chatml, zephyr, llama-3)")


def test_unknown_template_name_exits_2(tiny_models, tmp_path, capsys):
    from open_instruct import sft as sft_script

    path = write_jsonl(str(tmp_path / "sft.jsonl"), sft_rows(4, 0))
    argv = ["--model_name_or_path", tiny_models["causal_lm"], "--dataset_name_or_path", path]
    with pytest.raises(SystemExit) as e:
        runtime.run(sft_script.main, [*argv, "--output_dir", str(tmp_path / "out"), "--chat_template", "tulu3"])
    assert e.value.code == 2
    assert "chat_template 'tulu3' is not a template name (tulu, chatml, zephyr, llama-3)" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------------
# Every script accepts every format it applies to and trains a step


def _sft_variants(tmp_path) -> dict[str, str]:
    import datasets

    base = sft_rows(4, 0)
    convs = [r["messages"] for r in base]
    out = {
        "messages": write_jsonl(str(tmp_path / "messages.jsonl"), base),
        "prompt_completion_strings": write_jsonl(
            str(tmp_path / "pc.jsonl"),
            [{"prompt": c[0]["content"], "completion": " " + c[1]["content"]} for c in convs],
        ),
        "prompt_completion_messages": write_jsonl(
            str(tmp_path / "pcm.jsonl"), [{"prompt": c[:1], "completion": c[1:]} for c in convs]
        ),
        "text": write_jsonl(
            str(tmp_path / "text.jsonl"), [{"text": f"{c[0]['content']} {c[1]['content']}"} for c in convs]
        ),
    }
    datasets.Dataset.from_list(base).save_to_disk(str(tmp_path / "saved_messages"))
    out["save_to_disk_folder"] = str(tmp_path / "saved_messages")
    return out


def _preference_variants(tmp_path) -> dict[str, str]:
    base = preference_rows(4, 0)
    q = [r["chosen"][:-1] for r in base]
    c, r = [x["chosen"][-1] for x in base], [x["rejected"][-1] for x in base]
    return {
        "implicit_messages": write_jsonl(str(tmp_path / "implicit.jsonl"), base),
        "explicit_messages": write_jsonl(
            str(tmp_path / "explicit.jsonl"),
            [{"prompt": p, "chosen": [a], "rejected": [b]} for p, a, b in zip(q, c, r)],
        ),
        "explicit_strings": write_jsonl(
            str(tmp_path / "strings.jsonl"),
            [
                {"prompt": p[-1]["content"], "chosen": " " + a["content"], "rejected": " " + b["content"]}
                for p, a, b in zip(q, c, r)
            ],
        ),
        "implicit_strings": write_jsonl(
            str(tmp_path / "implicit_strings.jsonl"),
            [
                {"chosen": f"{p[-1]['content']} {a['content']}", "rejected": f"{p[-1]['content']} {b['content']}"}
                for p, a, b in zip(q, c, r)
            ],
        ),
    }


def _rl_variants(tmp_path) -> dict[str, str]:
    base = rl_rows(4, 0)
    return {
        "messages_verifier_list": write_jsonl(
            str(tmp_path / "rl_list.jsonl"),
            [{**x, "dataset": [x["dataset"]], "ground_truth": [x["ground_truth"]]} for x in base],
        ),
        "prompt_messages": write_jsonl(
            str(tmp_path / "rl_prompt.jsonl"),
            [{**{k: v for k, v in x.items() if k != "messages"}, "prompt": x["messages"]} for x in base],
        ),
        "prompt_string": write_jsonl(
            str(tmp_path / "rl_prompt_str.jsonl"),
            [{**{k: v for k, v in x.items() if k != "messages"}, "prompt": x["messages"][-1]["content"]} for x in base],
        ),
    }


ONE_STEP = ["--max_seq_length", "128", "--per_device_train_batch_size", "2", "--total_episodes", "2"]
ONE_STEP += ["--save_final_model", "false", "--logging_steps", "1"]
SCRIPT_FORMATS = [
    ("sft", "causal_lm", _sft_variants, name, [])
    for name in ("messages", "prompt_completion_strings", "prompt_completion_messages", "text", "save_to_disk_folder")
]
SCRIPT_FORMATS += [
    ("reward_model", "seq_cls", _preference_variants, name, [])
    for name in ("implicit_messages", "explicit_messages", "explicit_strings", "implicit_strings")
]
SCRIPT_FORMATS += [
    ("dpo", "causal_lm", _preference_variants, name, []) for name in ("explicit_messages", "implicit_strings")
]
RL_STEP = ["--algo", "grpo", "--local_rollout_batch_size", "2", "--num_samples_per_prompt", "2"]
RL_STEP += ["--response_length", "4", "--max_prompt_length", "96", "--num_epochs", "1", "--total_episodes", "4"]
RL_STEP += ["--per_device_train_batch_size", "4"]
SCRIPT_FORMATS += [
    ("rlvr_ppo", "causal_lm", _rl_variants, name, RL_STEP)
    for name in ("messages_verifier_list", "prompt_messages", "prompt_string")
]


@pytest.mark.parametrize(
    "script, model, variants, name, extra", SCRIPT_FORMATS, ids=[f"{s}-{n}" for s, _, _, n, _ in SCRIPT_FORMATS]
)
def test_script_accepts_the_format_and_trains_a_step(
    script, model, variants, name, extra, tiny_models, tmp_path, capsys
):
    import importlib

    module = importlib.import_module(f"open_instruct.{script}")
    out = tmp_path / "out"
    argv = ["--model_name_or_path", tiny_models[model], "--dataset_name_or_path", variants(tmp_path)[name]]
    argv += ["--output_dir", str(out), *ONE_STEP, *extra]
    if script == "dpo":
        argv += ["--reference_cache_dir", str(tmp_path / "ref_cache")]
    run_to_the_end(module.main, argv)
    rows = read_metrics(str(out))
    assert rows and rows[-1]["optimizer_step"] >= 1
    printed = capsys.readouterr().out
    assert "format " in printed and "tokenized data written to the cache" in printed


def test_a_resumed_run_reads_the_tokenized_data_from_the_cache(tiny_models, tmp_path, capsys, monkeypatch):
    from training_helpers import sigterm_at_step

    from open_instruct import sft as sft_script

    path = write_jsonl(str(tmp_path / "sft.jsonl"), sft_rows(8, 0))
    argv = ["--model_name_or_path", tiny_models["causal_lm"], "--dataset_name_or_path", path]
    argv += ["--output_dir", str(tmp_path / "out"), *ONE_STEP, "--total_episodes", "4"]
    argv += ["--dataset_cache_dir", str(tmp_path / "cache")]
    with sigterm_at_step(monkeypatch, 1):  # preempted: checkpoint at step 1 and exit
        run_to_the_end(sft_script.main, argv)
    first = capsys.readouterr().out
    assert "tokenized data written to the cache" in first
    folder = first.split("written to the cache ")[1].split()[0].rstrip(";")
    run_to_the_end(sft_script.main, [*argv, "--resume_from_checkpoint", "auto"])
    assert f"tokenized data read from the cache {folder}" in capsys.readouterr().out
    assert [r["optimizer_step"] for r in read_metrics(str(tmp_path / "out"))] == [1, 2]


def test_a_header_only_csv_is_an_empty_dataset_named(tmp_path):
    """datasets raises a bare ValueError ('Instruction "train" corresponds to no data!') on a CSV with a header and
    no rows; it is an empty dataset, named as such."""
    path = tmp_path / "header_only.csv"
    path.write_text("messages\n")
    with pytest.raises(DataError, match="header_only.csv.*is empty"):
        data.load_source(str(path), "train")
