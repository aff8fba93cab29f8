"""Bad rows and bad column names give clear errors naming the file and the row (open_instruct/data.py), or are
skipped and counted with skip_bad_rows; over-long rows are dropped or truncated and counted."""

import json
import os

import pytest

from open_instruct import data
from open_instruct.config import RewardModelConfig, SFTConfig
from open_instruct.data import DataError


def chat(user="What is 2+2?", reply="4"):
    return [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]


def pair(i, user="Hi", chosen="good", rejected="bad"):
    return {"id": i, "chosen": chat(user, chosen), "rejected": chat(user, rejected)}


def write_lines(path, lines):
    with open(path, "wb") as f:
        for line in lines:
            f.write(line if isinstance(line, bytes) else (json.dumps(line) + "\n").encode())
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    from open_instruct.models import load_tokenizer

    return load_tokenizer(tiny_models["causal_lm"])


def sft_cfg(path, **kw):
    return SFTConfig(model_name_or_path="m", dataset_name_or_path=path, **{"max_seq_length": 256, **kw})


def rm_cfg(path, **kw):
    return RewardModelConfig(model_name_or_path="m", dataset_name_or_path=path, **{"max_seq_length": 256, **kw})


def sft_error(tmp_path, tokenizer, lines, **kw):
    path = write_lines(tmp_path / "sft.jsonl", lines)
    with pytest.raises(DataError) as e:
        data.tokenize_sft(data.load_rows(path), tokenizer, sft_cfg(path, **kw))
    return path, str(e.value)


def rm_error(tmp_path, tokenizer, lines, **kw):
    path = write_lines(tmp_path / "prefs.jsonl", lines)
    with pytest.raises(DataError) as e:
        data.tokenize_preferences(data.load_rows(path), tokenizer, rm_cfg(path, **kw))
    return path, str(e.value)


# --- file-level errors ------------------------------------------------------------------------------------------------


def test_non_utf8_bytes_name_file_and_line(tmp_path):
    path = write_lines(tmp_path / "bad.jsonl", [{"messages": chat()}, b'{"messages": "caf\xe9"}\n'])
    with pytest.raises(DataError, match=rf"^{path} line 2: not valid UTF-8 \(invalid continuation byte at byte 17\)$"):
        data.load_rows(path)


def test_invalid_json_and_non_object_lines(tmp_path):
    path = write_lines(tmp_path / "bad.jsonl", [{"messages": chat()}, b"\n", b'{"messages": [\n'])
    with pytest.raises(DataError, match=rf"^{path} line 3: not valid JSON"):
        data.load_rows(path)
    path = write_lines(tmp_path / "list.jsonl", [[1, 2]])
    with pytest.raises(DataError, match=rf"^{path} line 1: expected a JSON object, got list$"):
        data.load_rows(path)


def test_empty_and_missing_files(tmp_path):
    empty = write_lines(tmp_path / "empty.jsonl", [b"\n", b"  \n"])
    with pytest.raises(DataError, match=rf"dataset '{empty}' \(split 'train'\) is empty"):
        data.load_rows(empty)
    with pytest.raises(DataError, match="does not exist"):
        data.load_rows(str(tmp_path / "nope.jsonl"))


# --- column names and row contents
# --------------------------------------------------------------------------------------


def test_wrong_column_name_is_reported_with_the_columns_present(tmp_path, tokenizer):
    path, msg = sft_error(tmp_path, tokenizer, [{"conversation": chat()}])
    assert msg == (
        f"{path} line 1: columns ['conversation'] match no sft data format. Accepted: 'messages' (a conversation); "
        "'prompt' + 'completion' (strings or messages); 'text' (a string). Set messages_column in the recipe if "
        "your columns have other names (docs/data.md#data-formats-tokenization-and-the-cache)."
    )
    # ... and the configured name is the one looked up
    ok = write_lines(tmp_path / "renamed.jsonl", [{"conversation": chat()}])
    examples, _ = data.tokenize_sft(data.load_rows(ok), tokenizer, sft_cfg(ok, messages_column="conversation"))
    assert len(examples) == 1


def test_missing_column_in_a_later_row(tmp_path, tokenizer):
    path, msg = rm_error(tmp_path, tokenizer, [pair(1), pair(2), {"id": 3, "chosen": chat()}])
    assert msg == f"{path} line 3: missing column 'rejected' (columns: ['chosen', 'id'])"


def test_wrong_types(tmp_path, tokenizer):
    path, msg = sft_error(tmp_path, tokenizer, [{"messages": chat()}, {"messages": "hello"}])
    assert msg == f"{path} line 2: column 'messages' must be a list of messages, got str"
    path, msg = sft_error(tmp_path, tokenizer, [{"messages": [{"role": "user", "content": 5}]}])
    assert msg.startswith(f"{path} line 1: messages[0] must be an object with string 'role' and 'content'")
    path, msg = rm_error(tmp_path, tokenizer, [{"prompt": "Hi", "chosen": "a", "rejected": 7}])
    assert msg == f"{path} line 1: column 'rejected' must be a string in prompt/chosen/rejected rows, got int"


def test_empty_conversation_and_structural_problems(tmp_path, tokenizer):
    path, msg = sft_error(tmp_path, tokenizer, [{"messages": chat()}, {"messages": []}])
    assert msg == f"{path} line 2: column 'messages' is an empty conversation"
    path, msg = sft_error(tmp_path, tokenizer, [{"messages": chat()[:1]}])
    assert msg == f"{path} line 1: the last message of 'messages' must be from the assistant, got 'user'"
    path, msg = rm_error(tmp_path, tokenizer, [{"chosen": chat("A"), "rejected": chat("B")}])
    assert msg == f"{path} line 1: 'chosen' and 'rejected' must share the same prompt turns"
    path, msg = rm_error(tmp_path, tokenizer, [{"prompt": "Hi", "chosen": " ", "rejected": "no"}])
    assert msg == f"{path} line 1: column 'chosen' is empty"


def test_duplicate_ids_error_or_skip_and_count(tmp_path, tokenizer):
    lines = [pair("a"), pair("b"), pair("a", chosen="other")]
    path, msg = rm_error(tmp_path, tokenizer, lines)
    assert msg == f"{path} line 3: duplicate id 'a' (first at {path} line 1); set skip_bad_rows to skip repeats"
    examples, stats = data.tokenize_preferences(data.load_rows(path), tokenizer, rm_cfg(path, skip_bad_rows=True))
    assert (stats.rows, stats.kept, stats.duplicate_ids, stats.bad_rows) == (3, 2, 1, 0)
    assert [e["row"] for e in examples] == [0, 1]


def test_skip_bad_rows_counts_and_keeps_the_first_errors(tmp_path, tokenizer):
    lines = [
        {"messages": chat()},
        {"messages": []},
        {"messages": "x"},
        {"messages": chat(reply="5")},
        {"messages": chat()[:1]},
    ]
    path = write_lines(tmp_path / "mixed.jsonl", lines)
    examples, stats = data.tokenize_sft(data.load_rows(path), tokenizer, sft_cfg(path, skip_bad_rows=True))
    assert (stats.rows, stats.kept, stats.bad_rows) == (5, 2, 3)
    assert [e["row"] for e in examples] == [0, 3]
    assert [m.split(":")[0] for m in stats.first_errors] == [f"{path} line {n}" for n in (2, 3, 5)]
    assert stats.summary() == "2/5 rows kept: 3 bad, 0 dropped as over-long, 0 truncated, 0 duplicate ids"
    # every row bad: an error, not an empty training run
    path = write_lines(tmp_path / "allbad.jsonl", [{"messages": []}, {"messages": "x"}])
    with pytest.raises(DataError, match="no usable rows"):
        data.tokenize_sft(data.load_rows(path), tokenizer, sft_cfg(path, skip_bad_rows=True))


def test_overlong_rows_dropped_or_truncated_and_counted(tmp_path, tokenizer):
    short, long_reply = chat("Hi", "ok"), chat("Hi", "x" * 100)
    full_len = len(data.chat_ids(tokenizer, long_reply))
    assert full_len > 60 > len(data.chat_ids(tokenizer, short))
    path = write_lines(tmp_path / "sft.jsonl", [{"messages": short}, {"messages": long_reply}])

    examples, stats = data.tokenize_sft(data.load_rows(path), tokenizer, sft_cfg(path, max_seq_length=60))
    assert (stats.kept, stats.dropped_overlong, stats.truncated) == (1, 1, 0)

    examples, stats = data.tokenize_sft(
        data.load_rows(path), tokenizer, sft_cfg(path, max_seq_length=60, overlong="truncate")
    )
    assert (stats.kept, stats.dropped_overlong, stats.truncated) == (2, 0, 1)
    assert len(examples[1]["input_ids"]) == len(examples[1]["labels"]) == 60
    assert stats.as_log()["data/truncated"] == 1

    # preferences: truncation keeps the pair only if some response survives (the prompt fits)
    ppath = write_lines(tmp_path / "p.jsonl", [pair(1), pair(2, chosen="y" * 100), pair(3, user="q" * 100)])
    examples, stats = data.tokenize_preferences(
        data.load_rows(ppath), tokenizer, rm_cfg(ppath, max_seq_length=60, overlong="truncate")
    )
    assert (stats.kept, stats.truncated, stats.dropped_overlong) == (2, 1, 1)
    assert len(examples[1]["chosen_ids"]) == 60 and examples[1]["prompt_len"] < 60


def test_preference_tokens_and_collate(tokenizer, tmp_path):
    """chosen rows first, then rejected rows, right-padded, loss_mask on response tokens only."""
    path = write_lines(tmp_path / "p.jsonl", [pair(1, chosen="yes"), pair(2, chosen="a longer reply", rejected="n")])
    examples, _ = data.tokenize_preferences(data.load_rows(path), tokenizer, rm_cfg(path))
    batch = data.collate_preferences(examples, tokenizer.pad_token_id)
    lengths = [
        len(examples[0]["chosen_ids"]),
        len(examples[1]["chosen_ids"]),
        len(examples[0]["rejected_ids"]),
        len(examples[1]["rejected_ids"]),
    ]
    assert batch["attention_mask"].sum(1).tolist() == lengths
    assert batch["input_ids"][1, : lengths[1]].tolist() == examples[1]["chosen_ids"]
    assert batch["input_ids"][3, : lengths[3]].tolist() == examples[1]["rejected_ids"]
    response = tokenizer.decode(batch["input_ids"][1][batch["loss_mask"][1].bool()])
    assert response == "a longer reply<|end|>\n"


def test_script_exits_nonzero_naming_file_and_row(tiny_models, tmp_path, capsys):
    """End to end through the script's entry point (runtime.run(main), what `python open_instruct/reward_model.py`
    runs): exit status 2 and one line naming file and row, before any model loads. In-process: a subprocess would
    only add ~10 s of imports."""
    from open_instruct import reward_model, runtime

    path = write_lines(tmp_path / "prefs.jsonl", [pair(1), pair(2), {"id": 3, "chosen": chat(), "rejected": []}])
    argv = [
        "--model_name_or_path",
        tiny_models["seq_cls"],
        "--dataset_name_or_path",
        path,
        "--output_dir",
        str(tmp_path / "out"),
    ]
    with pytest.raises(SystemExit) as e:
        runtime.run(reward_model.main, argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == f"DataError: {path} line 3: column 'rejected' is an empty conversation"
    assert "Traceback" not in err
    assert not os.path.exists(tmp_path / "out" / "metrics.jsonl")
