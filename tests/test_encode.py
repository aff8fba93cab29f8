"""Tokenization at scale (open_instruct/encode.py, chat_render.py, data.encode_rows) gives exactly what the old
per-row path gave: one `apply_chat_template(..., tokenize=True)` call per conversation prefix (data.chat_ids,
data.tokenize_sft_messages), row by row, for SFT, DPO / reward-model pairs and RL prompts, on a sample with
multi-turn chats, system prompts, special-token text inside contents, unicode and over-long rows; in one process and
in two; on the tests' character tokenizer, a byte-level BPE, a tokenizer whose merges cross the reply boundary
(where the shortcut must not be taken) and templates without skeletons (llama-3 trims contents; one that is not
prefix-stable)."""

from __future__ import annotations

import os
import random

import pytest

from demo.tiny import SPECIAL_TOKENS, build_tokenizer
from open_instruct import chat_render, data, encode
from open_instruct.chat_templates import CHATML, NAMED_TEMPLATES
from open_instruct.config import DPOConfig, RewardModelConfig, RLVRConfig, SFTConfig
from open_instruct.errors import DataError

MAX_LEN = {"llama3": 400}  # default 120; some rows are longer: truncated or dropped by both paths alike


def chat_sample(n: int = 48, seed: int = 0) -> list[list[dict[str, str]]]:
    """Conversations: 1 to 3 exchanges, a system turn in one of three, contents with newlines, spaces at the ends,
    an EOS marker typed by the user, non-ASCII text, an empty reply, and one in six far over the length limit."""
    rng = random.Random(seed)
    words = ["sum", "of", "7", "and", "12", "is", "19.", "Yes", " spaced ", "line\nbreak", "<|end|>", "café", "x" * 9]
    chats = []
    for i in range(n):
        msgs = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
        for _ in range(1 + i % 3):
            msgs.append({"role": "user", "content": " ".join(rng.choice(words) for _ in range(rng.randint(1, 6)))})
            reply = " ".join(rng.choice(words) for _ in range(rng.randint(1, 5)))
            msgs.append({"role": "assistant", "content": "" if i % 17 == 5 else reply})
        if i % 6 == 1:
            msgs[-1]["content"] = " ".join(str(rng.randint(0, 10**6)) for _ in range(40))
        chats.append(msgs)
    return chats


def rows_of(values: list[dict]) -> list[data.Row]:
    return [data.Row("mem.jsonl", i, i + 1, v) for i, v in enumerate(values)]


def bpe_tokenizer():
    """A byte-level BPE (GPT-2 style pre-tokenizer, as Llama 3 / Qwen) trained on the sample, ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([m["content"] for c in chat_sample() for m in c] + ["user assistant system"], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def merging_tokenizer():
    """The character tokenizer plus one merge, newline + 'l' -> one token, and no pre-tokenizer: the generation
    prompt ends with a newline, so a reply starting with 'l' tokenizes across the boundary, and the prefix's own
    tokens are not a prefix of the conversation's (the old path's error; the shortcut must not hide it)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    base = build_tokenizer()
    vocab = dict(base.backend_tokenizer.get_vocab())
    vocab["\nl"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("\n", "l")], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<|end|>", unk_token="<unk>",
        additional_special_tokens=SPECIAL_TOKENS[2:],
    )  # fmt: skip
    fast.chat_template = base.chat_template
    return fast


NOT_PREFIX_STABLE = (  # a later user turn loses its end-of-turn marker when the generation prompt follows it
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] }}"
    "{% if not (loop.last and add_generation_prompt and loop.index > 2) %}{{ '<|end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


READS_CONTENTS = (  # edits each content: no skeleton, every conversation through apply_chat_template
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'].replace('\t', ' ') }}"
    "{{ '<|end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
TESTS_EMPTY = (  # only tests whether a content is empty: a skeleton for non-empty contents, the rest rendered
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + (m['content'] if m['content'] else '(none)') }}"
    "{{ '<|end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def tokenizers_under_test():
    templates = {
        "llama3": NAMED_TEMPLATES["llama-3"],
        "unstable": NOT_PREFIX_STABLE,
        "reads": READS_CONTENTS,
        "tests_empty": TESTS_EMPTY,
    }
    out = {"tiny": build_tokenizer(), "bpe": bpe_tokenizer(), "merging": merging_tokenizer()}
    for name, template in templates.items():
        out[name] = build_tokenizer()
        out[name].chat_template = template
    return out


TOKENIZERS = tokenizers_under_test()


# ---------------------------------------------------------------------------------------------------------------------
# The old per-row path, with the scripts' length rules


def old_sft(tokenizer, chats, max_len=120):
    """(examples, bad rows' messages) the old loop made: tokenize_sft_messages per row, then truncation."""
    examples, errors = [], []
    for i, msgs in enumerate(chats):
        try:
            ids, labels = data.tokenize_sft_messages(tokenizer, msgs, f"mem.jsonl line {i + 1}")
        except DataError as e:
            errors.append(str(e))
            continue
        ids, labels = ids[:max_len], labels[:max_len]
        if any(lab != -100 for lab in labels[1:]):
            examples.append({"input_ids": ids, "labels": labels, "row": i})
    return examples, errors


def old_pairs(tokenizer, pairs, max_len):
    examples, errors = [], []
    for i, (chosen, rejected) in enumerate(pairs):
        prompt = data.chat_ids(tokenizer, chosen[:-1], add_generation_prompt=True)
        c, r = data.chat_ids(tokenizer, chosen), data.chat_ids(tokenizer, rejected)
        if c[: len(prompt)] != prompt or r[: len(prompt)] != prompt:
            errors.append(f"mem.jsonl line {i + 1}: {encode.NOT_PREFIX}")
        elif max(len(c), len(r)) <= max_len or len(prompt) < max_len:
            examples.append(
                {"chosen_ids": c[:max_len], "rejected_ids": r[:max_len], "prompt_len": len(prompt), "row": i}
            )
    return examples, errors


def old_prompts(tokenizer, chats, max_len):
    return [data.chat_ids(tokenizer, msgs, add_generation_prompt=True)[-max_len:] for msgs in chats]


def kept(examples, keys):
    return [{k: e[k] for k in keys} for e in examples]


@pytest.mark.parametrize("name", list(TOKENIZERS))
@pytest.mark.parametrize("num_proc", [1, 2])
def test_sft_dpo_rm_rl_examples_equal_the_old_per_row_path(name, num_proc):
    tokenizer, max_len = TOKENIZERS[name], MAX_LEN.get(name, 120)
    chats = chat_sample()
    common = {"model_name_or_path": "m", "dataset_name_or_path": "mem.jsonl", "skip_bad_rows": True}
    common["dataset_num_proc"] = num_proc

    cfg = SFTConfig(max_seq_length=max_len, overlong="truncate", **common)
    new, stats = data.tokenize_sft(rows_of([{"messages": c} for c in chats]), tokenizer, cfg)
    expected, errors = old_sft(tokenizer, chats, max_len)
    assert kept(new, ("input_ids", "labels", "row")) == expected
    assert stats.bad_rows == len(errors) and stats.first_errors == errors[:5] and stats.processes == num_proc
    assert len(expected) >= 10 and (stats.truncated > 0 or name == "unstable")  # its long rows are its bad ones

    pairs = [(c, c[:-1] + [{"role": "assistant", "content": c[-1]["content"] + " no"}]) for c in chats]
    for config in (DPOConfig, RewardModelConfig):
        cfg = config(max_seq_length=max_len, overlong="truncate", **common)
        new, stats = data.tokenize_preferences(
            rows_of([{"chosen": c, "rejected": r} for c, r in pairs]), tokenizer, cfg
        )
        expected, errors = old_pairs(tokenizer, pairs, max_len)
        assert kept(new, ("chosen_ids", "rejected_ids", "prompt_len", "row")) == expected
        assert stats.bad_rows == len(errors) and stats.first_errors == errors[:5]

    prompts = [c[:-1] for c in chats]
    cfg = RLVRConfig(total_episodes=8, max_prompt_length=max_len, overlong="truncate", **common)
    rows = rows_of([{"messages": p, "ground_truth": "19", "dataset": "arithmetic"} for p in prompts])
    new, stats = data.tokenize_prompts(rows, tokenizer, cfg)
    assert [e["prompt_ids"] for e in new] == old_prompts(tokenizer, prompts, max_len)


def test_the_sample_meets_every_case():
    """The equality test above covers what it claims: each tokenizer renders with or without skeletons as
    expected, and the reply-boundary merge and the unstable template make the old path refuse some rows."""
    roles = ("system", "user", "assistant")
    have = {name: chat_render.make_skeleton(t, roles, False) is not None for name, t in TOKENIZERS.items()}
    assert have == {
        "tiny": True,
        "bpe": True,
        "merging": True,
        "llama3": True,
        "unstable": True,
        "reads": False,
        "tests_empty": True,
    }
    assert chat_render.make_skeleton(TOKENIZERS["tests_empty"], roles, False).nonempty_only
    assert any(not m["content"] for c in chat_sample() for m in c)  # the sample has empty contents to fall back on
    chats = chat_sample()
    assert sum(c[-1]["content"].startswith("l") for c in chats) > 0
    assert old_sft(TOKENIZERS["merging"], chats)[1] and old_sft(TOKENIZERS["unstable"], chats)[1]
    assert not old_sft(TOKENIZERS["tiny"], chats)[1] and not old_sft(TOKENIZERS["bpe"], chats)[1]


def test_prefix_tokens_come_from_the_whole_conversation(monkeypatch):
    """On the character tokenizer (and with the boundary merge, whose refusals the equality test checks) no
    conversation prefix is tokenized again: every reply's start and end come from the whole conversation's tokens
    (PrefixTokens). Without a skeleton, with no added token in the skeleton's end (llama-3's headers are plain text
    to this tokenizer), or with an added token that strips spaces, every prefix is."""
    tokenized: list[str] = []
    real = encode.token_ids

    def spy(tokenizer, texts, add_special_tokens):
        tokenized.extend(texts)
        return real(tokenizer, texts, add_special_tokens)

    monkeypatch.setattr(encode, "token_ids", spy)
    # conversations whose contents are all non-empty (the tiny template tests for an empty content: a conversation
    # with one is rendered by the template, and its prefixes tokenized, as the equality test checks)
    chats = [(c, 0) for c in chat_sample() if all(m["content"] for m in c)]
    prefixes = sum(2 * sum(m["role"] == "assistant" for m in c) - 1 for c, _ in chats)  # before and through
    for name in ("tiny", "merging", "reads", "llama3"):
        tokenized.clear()
        encode.encode_chats(TOKENIZERS[name], chats)
        assert len(tokenized) == (prefixes if name in ("reads", "llama3") else 0), name
    tokenized.clear()
    encode.encode_chats(TOKENIZERS["tiny"], [(c, 0) for c in chat_sample() if not all(m["content"] for m in c)])
    assert tokenized
    stripping = build_tokenizer()
    from tokenizers import AddedToken

    stripping.backend_tokenizer.add_special_tokens([AddedToken("<|end|>", special=True, rstrip=True)])
    tokenized.clear()
    encode.encode_chats(stripping, chats)
    assert len(tokenized) == prefixes


# ---------------------------------------------------------------------------------------------------------------------
# Skeletons


@pytest.mark.parametrize(
    "template",
    [
        "{% for m in messages %}{{ ('<' + m['content']) | trim }}{% endfor %}",  # trim of more than a content
        "{% for m in messages %}{{ m['content'] | trim('x') }}{% endfor %}",  # trim of other characters
        "{% for m in messages %}{{ m['content'].split('</think>')[-1] }}{% endfor %}",  # Qwen 3's reasoning cut
        "{% for m in messages %}{{ ('[' + m['content']) | replace('<think>', '') }}{% endfor %}",  # after a +
        "{{ messages | tojson }}",  # escaped, not written verbatim
        "{% for m in messages %}{{ m['content'] | length }}{% endfor %}",
    ],
)
def test_a_template_that_reads_contents_has_no_skeleton(template):
    tokenizer = build_tokenizer()
    tokenizer.chat_template = template
    assert chat_render.make_skeleton(tokenizer, ("user", "assistant"), False) is None
    msgs = [{"role": "user", "content": " <think>a</think> b "}, {"role": "assistant", "content": ""}]
    rendered = chat_render.ChatRenderer(tokenizer).render([msgs], False)  # still right: apply_chat_template
    assert rendered == [tokenizer.apply_chat_template(msgs, tokenize=False)]


def test_skeletons_fill_to_the_template_output():
    """Every named template and the tests' have skeletons, and a filled skeleton is what the template renders, for
    contents a template could trip on (braces, markers, backslashes, the probe's own characters, spaces that
    llama-3's trim removes)."""
    tokenizer = build_tokenizer()
    contents = ["{{ x }}", "<|end|>", "a\\nb", chat_render.MARK_OPEN + "0" + chat_render.MARK_CLOSE, "", "  t  "]
    for template in [tokenizer.chat_template, *NAMED_TEMPLATES.values()]:
        tokenizer.chat_template = template
        for roles in [("user", "assistant"), ("system", "user", "assistant", "user")]:
            for generation in (False, True):
                skeleton = chat_render.make_skeleton(tokenizer, roles, generation)
                assert skeleton is not None
                for shift in range(len(contents)):
                    msgs = [{"role": r, "content": contents[(i + shift) % len(contents)]} for i, r in enumerate(roles)]
                    expected = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation)
                    assert skeleton.fill(msgs) == expected


def test_the_tiny_tokenizer_gives_the_ids_of_its_earlier_definition():
    """demo/tiny.py's tokenizer is a BPE without merges now (3x faster); tiny models saved before carry the
    earlier one (a WordLevel model behind a one-character Split pre-tokenizer): same ids, offsets and decoding."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    new = build_tokenizer().backend_tokenizer
    old = Tokenizer(models.WordLevel(vocab=new.get_vocab(), unk_token="<unk>"))
    old.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    old.decoder = decoders.Fuse()
    old.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS + ["<unk>"]])
    rng = random.Random(0)
    alphabet = "ab Z9\n\t.{}" + "é漢😀\r\x0b" + "".join(SPECIAL_TOKENS) + "<unk>"
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) for _ in range(300)] + ["", "x" * 3000]
    a, b = old.encode_batch(texts, add_special_tokens=False), new.encode_batch(texts, add_special_tokens=False)
    assert [e.ids for e in a] == [e.ids for e in b] and [e.offsets for e in a] == [e.offsets for e in b]
    assert all(old.decode(e.ids) == new.decode(e.ids) for e in a)
    assert new.encode("ab\n<|end|>é", add_special_tokens=False).ids == [72, 73, 6, 1, 102]  # a, b, newline, EOS, unk


def test_a_second_start_reads_the_cache_and_tokenizes_nothing(tmp_path, monkeypatch):
    """A first start in two processes writes the cache entry (pyarrow files); a second start reads back the same
    examples without tokenizing a row (encode_rows would raise)."""
    import json

    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chat_sample()))
    cfg = SFTConfig(
        model_name_or_path="m",
        dataset_name_or_path=str(path),
        max_seq_length=4096,
        dataset_num_proc=2,
        dataset_cache_dir=str(tmp_path / "cache"),
        eval_fraction=0.25,
    )
    train, evals, stats = data.load_train_eval(cfg, TOKENIZERS["tiny"], data.tokenize_sft)
    assert "2 tokenizing processes; tokenized data written to the cache" in stats.inputs
    folder = stats.inputs.rsplit(" ", 1)[1]
    assert sorted(os.listdir(folder)) == ["eval.arrow", "meta.json", "train.arrow"]

    def refuse(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(data, "encode_rows", refuse)
    train2, evals2, stats2 = data.load_train_eval(cfg, TOKENIZERS["tiny"], data.tokenize_sft)
    assert (train2, evals2) == (train, evals) and len(train) + len(evals) == 48 and len(evals) == 12
    assert stats2.inputs == f"format messages; tokenized data read from the cache {folder}"


def test_a_template_that_tests_for_an_empty_content_renders_empty_ones_itself():
    """`{% if content %}` (templates that also render tool calls): a skeleton for non-empty contents; a conversation
    with an empty content, or a message with more than role and content, is rendered by the template."""
    tokenizer = build_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<{% if m['content'] %}{{ m['content'] }}{% else %}-{% endif %}>{% endfor %}"
    )
    renderer = chat_render.ChatRenderer(tokenizer)
    assert chat_render.make_skeleton(tokenizer, ("user", "assistant"), False).nonempty_only
    full = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    empty = [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]
    extra = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "name": "x"}]
    assert renderer.skeleton_for(full, False) is not None
    assert renderer.skeleton_for(empty, False) is None and renderer.skeleton_for(extra, False) is None
    assert renderer.render([full, empty], False) == ["<a><b>", "<a><->"]


# A template that writes the tool schemas into a system block, as Qwen2.5's does (`tools | tojson` per line).
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|end|>\n{% endif %}"
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def test_sft_rows_carry_their_tools_to_the_chat_template():
    """An SFT row's `tools` column (schemas, or their JSON as a string) is rendered by the template with that row,
    rows with different tool lists in one batch each get their own, a row without tools gets none; the trained
    tokens are exactly each assistant turn's (the per-row reference computed with the same tools). A `tools` value
    that is not a list of schemas is a bad row naming the file, the row and the column."""
    import json

    tokenizer = build_tokenizer()
    tokenizer.chat_template = TOOLS_TEMPLATE
    calc = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}
    search = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
    chat = [{"role": "user", "content": "12*34?"}, {"role": "assistant", "content": "408"}]
    values = [
        {"messages": chat, "tools": [calc]},
        {"messages": chat, "tools": json.dumps([calc, search])},
        {"messages": chat},
        {"messages": chat, "tools": []},
        {"messages": chat, "tools": ["calculator"]},
        {"messages": chat, "tools": "{not json"},
    ]
    cfg = SFTConfig(model_name_or_path="m", dataset_name_or_path="mem.jsonl", skip_bad_rows=True, max_seq_length=400)
    examples, stats = data.tokenize_sft(rows_of(values), tokenizer, cfg)
    assert [e["row"] for e in examples] == [0, 1, 2, 3]
    for example, tools in zip(examples, [[calc], [calc, search], None, None]):
        whole = data.chat_ids(tokenizer, chat) if tools is None else list(
            tokenizer.apply_chat_template(chat, tools=tools, tokenize=True, return_dict=False)
        )  # fmt: skip
        prompt = list(tokenizer.apply_chat_template(chat[:1], tools=tools, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False))  # fmt: skip
        assert example["input_ids"] == whole
        assert example["labels"] == [-100] * len(prompt) + whole[len(prompt) :]
        text = tokenizer.decode(example["input_ids"])
        assert ('"name": "calculator"' in text) == (tools is not None)
        assert ('"name": "search"' in text) == (tools is not None and len(tools) == 2)
    assert tokenizer.decode([t for t in examples[0]["labels"] if t != -100]) == "408<|end|>\n"
    assert stats.bad_rows == 2
    assert "mem.jsonl" in stats.first_errors[0] and "'tools' must be a list of tool schemas" in stats.first_errors[0]
    assert "'tools' is a string but not JSON" in stats.first_errors[1]
