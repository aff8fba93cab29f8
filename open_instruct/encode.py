"""Batched tokenization: many conversations rendered with the chat template in one call and many texts tokenized
in one call (the fast tokenizer's batch encoder), instead of a few tokenizer calls per row.

Inputs are already validated (data.py converts and checks rows); the functions here return, per item, its token
ids or an error text (data.py adds the file and row). Two conventions:

- chat: a conversation rendered with the tokenizer's chat template, no special tokens added by the tokenizer (the
  template writes them). A reply's tokens are those between the conversation before it (with the generation
  prompt) and the conversation including it, which needs a prefix-stable template (checked, per row).
- raw (TRL's convention for string rows): prompt and prompt + completion tokenized as written, with the
  tokenizer's special tokens (e.g. BOS) and the EOS token appended to the completion unless already there; the
  completion starts where the two token lists diverge.
"""

from __future__ import annotations

from typing import Any, Sequence, Union

Messages = list[dict[str, Any]]  # {role, content}, tool_calls on assistant turns of tool use
NOT_PREFIX = (
    "the chat template does not render the conversation prefix as a prefix of the full conversation, so response "
    "tokens cannot be located"
)


def render(tokenizer: Any, conversations: Sequence[Messages], add_generation_prompt: bool) -> list[str]:
    """The chat template applied to every conversation, in one call."""
    if not conversations:
        return []
    out = tokenizer.apply_chat_template(
        list(conversations), tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return list(out)


def token_ids(tokenizer: Any, texts: Sequence[str], add_special_tokens: bool) -> list[list[int]]:
    """Every text tokenized in one batch call: the fast tokenizer's own batch encoder when it gives what
    `tokenizer(text)` gives (checked on the first text: transformers' per-call wrapping costs ~20% here), else
    `tokenizer(texts)`."""
    if not texts:
        return []
    texts = list(texts)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        encodings = backend.encode_batch(texts, add_special_tokens=add_special_tokens)
        if encodings[0].ids == tokenizer(texts[0], add_special_tokens=add_special_tokens)["input_ids"]:
            return [e.ids for e in encodings]
    return [list(x) for x in tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]]


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def with_eos(text: str, eos: str) -> str:
    return text if not eos or text.endswith(eos) else text + eos


def encode_chats(
    tokenizer: Any, chats: Sequence[tuple[Messages, int]]
) -> list[Union[tuple[list[int], list[int]], str]]:
    """(input_ids, labels) per (conversation, first trained turn): labels are -100 except on the tokens of each
    assistant turn at or after `first trained turn` (the template's end-of-turn tokens included)."""
    # Requests: every conversation in full, and per trained turn i the conversation up to i with the generation
    # prompt and the conversation through i (the full one when i is the last turn).
    full = render(tokenizer, [m for m, _ in chats], False)
    starts_req: list[Messages] = []
    ends_req: list[Messages] = []
    turns: list[list[tuple[int, int]]] = []  # per chat: (start request or -1, end request or -1 = full)
    for messages, first in chats:
        mine = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant" or i < first:
                continue
            start = -1
            if i > 0:
                starts_req.append(messages[:i])
                start = len(starts_req) - 1
            end = -1
            if i < len(messages) - 1:
                ends_req.append(messages[: i + 1])
                end = len(ends_req) - 1
            mine.append((start, end))
        turns.append(mine)
    starts = render(tokenizer, starts_req, True)
    ends = render(tokenizer, ends_req, False)
    texts = full + starts + ends
    ids = token_ids(tokenizer, texts, add_special_tokens=False)
    n_full, n_starts = len(full), len(starts)
    full_ids, start_ids, end_ids = ids[:n_full], ids[n_full : n_full + n_starts], ids[n_full + n_starts :]

    out: list[Union[tuple[list[int], list[int]], str]] = []
    for k, mine in enumerate(turns):
        seq = full_ids[k]
        labels = [-100] * len(seq)
        error = ""
        for start, end in mine:
            s = start_ids[start] if start >= 0 else []
            e = end_ids[end] if end >= 0 else seq
            if e[: len(s)] != s or seq[: len(e)] != e:
                error = NOT_PREFIX
                break
            labels[len(s) : len(e)] = seq[len(s) : len(e)]
        out.append(error or (seq, labels))
    return out


def encode_raw_completions(tokenizer: Any, pairs: Sequence[tuple[str, str]]) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) per (prompt, completion) string pair, TRL's raw convention (module docstring): labels
    -100 on the prompt's tokens. An empty prompt (a `text` row) trains every token."""
    eos = tokenizer.eos_token or ""
    prompts = token_ids(tokenizer, [p for p, _ in pairs], add_special_tokens=True)
    fulls = token_ids(tokenizer, [p + with_eos(c, eos) for p, c in pairs], add_special_tokens=True)
    out = []
    for p, seq in zip(prompts, fulls):
        n = common_prefix_length(p, seq)
        out.append((seq, [-100] * n + seq[n:]))
    return out


def encode_chat_pairs(
    tokenizer: Any, triples: Sequence[tuple[Messages, Messages, Messages]]
) -> list[Union[tuple[list[int], list[int], int], str]]:
    """(chosen_ids, rejected_ids, prompt_len) per (prompt, chosen conversation, rejected conversation): the prompt
    rendered with the generation prompt must be a token prefix of both."""
    prompts = render(tokenizer, [p for p, _, _ in triples], True)
    convs = render(tokenizer, [c for _, c, _ in triples] + [r for _, _, r in triples], False)
    ids = token_ids(tokenizer, prompts + convs, add_special_tokens=False)
    n = len(triples)
    out: list[Union[tuple[list[int], list[int], int], str]] = []
    for k in range(n):
        p, c, r = ids[k], ids[n + k], ids[2 * n + k]
        out.append(NOT_PREFIX if c[: len(p)] != p or r[: len(p)] != p else (c, r, len(p)))
    return out


def encode_raw_pairs(tokenizer: Any, triples: Sequence[tuple[str, str, str]]) -> list[tuple[list[int], list[int], int]]:
    """(chosen_ids, rejected_ids, prompt_len) per (prompt, chosen, rejected) strings, TRL's raw convention: the
    replies start where the prompt's tokens and the prompt + reply tokens first differ."""
    eos = tokenizer.eos_token or ""
    n = len(triples)
    texts = [p for p, _, _ in triples]
    texts += [p + with_eos(c, eos) for p, c, _ in triples] + [p + with_eos(r, eos) for p, _, r in triples]
    ids = token_ids(tokenizer, texts, add_special_tokens=True)
    out = []
    for k in range(n):
        p, c, r = ids[k], ids[n + k], ids[2 * n + k]
        out.append((c, r, min(common_prefix_length(p, c), common_prefix_length(p, r))))
    return out


def encode_chat_prompts(tokenizer: Any, prompts: Sequence[Messages]) -> list[list[int]]:
    """RL prompts: each conversation with the generation prompt."""
    return token_ids(tokenizer, render(tokenizer, prompts, True), add_special_tokens=False)


def encode_raw_prompts(tokenizer: Any, prompts: Sequence[str]) -> list[list[int]]:
    """RL prompts given as strings (TRL's standard prompt-only rows): tokenized as written."""
    return token_ids(tokenizer, prompts, add_special_tokens=True)
