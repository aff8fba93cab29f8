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

from typing import Any, Optional, Sequence, Union

from open_instruct.chat_render import ChatRenderer, Skeleton

Messages = list[dict[str, Any]]  # {role, content}, tool_calls on assistant turns of tool use
NOT_PREFIX = (
    "the chat template does not render the conversation prefix as a prefix of the full conversation, so response "
    "tokens cannot be located"
)


def render(tokenizer: Any, conversations: Sequence[Messages], add_generation_prompt: bool) -> list[str]:
    """The chat template applied to every conversation (chat_render.ChatRenderer: skeletons where exact)."""
    return ChatRenderer(tokenizer).render(conversations, add_generation_prompt)


def checked_backend(tokenizer: Any, text: str) -> Any:
    """The fast tokenizer's Rust backend when its `encode` gives what `tokenizer(text)` gives (checked on `text`:
    transformers' per-call wrapping costs ~20% here), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    mine = backend.encode(text, add_special_tokens=False).ids
    return backend if mine == tokenizer(text, add_special_tokens=False)["input_ids"] else None


def token_ids(tokenizer: Any, texts: Sequence[str], add_special_tokens: bool) -> list[list[int]]:
    """Every text tokenized in one batch call: the fast tokenizer's own batch encoder when it gives what
    `tokenizer(text)` gives (checked on the first text), else `tokenizer(texts)`."""
    if not texts:
        return []
    texts = list(texts)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        encodings = backend.encode_batch(texts, add_special_tokens=add_special_tokens)
        if encodings[0].ids == tokenizer(texts[0], add_special_tokens=add_special_tokens)["input_ids"]:
            return [e.ids for e in encodings]
    return [list(x) for x in tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]]


class PrefixTokens:
    """Token ids of a conversation's prefix (the part before a reply, with the generation prompt, or through a
    reply) without tokenizing it again, when that is provably what tokenizing it would give; else None, and the
    caller tokenizes the prefix text.

    A fast tokenizer cuts a text at its added tokens (role markers, EOS) first and tokenizes the pieces between
    them independently. So when the prefix text is a string prefix of the whole conversation and its last added
    token T is where the whole conversation's tokens have T (same id, same characters), the prefix's tokens are the
    whole conversation's tokens through T, then the tokens of the short tail after T (`assistant\\n` in ChatML,
    `\\n` after `<|assistant|>` in Tulu), which are computed once per distinct tail. This needs added tokens that
    match the raw text exactly (not normalized, no lstrip/rstrip/single_word): checked, else always None."""

    def __init__(self, tokenizer: Any, backend: Any):
        self.tokenizer, self.backend = tokenizer, backend
        added = backend.get_added_tokens_decoder() if backend is not None else {}
        plain = all(not (t.normalized or t.lstrip or t.rstrip or t.single_word) for t in added.values())
        self.added = {t.content: i for i, t in added.items()} if plain and added else {}
        self._tails: dict[str, Optional[tuple[int, str, str]]] = {}  # last piece of a skeleton -> (id, T, tail)
        self._tail_ids: dict[tuple[str, str], Optional[list[int]]] = {}

    def split_tail(self, text_end: str) -> Optional[tuple[int, str, str]]:
        """(id, T, tail) for the last added token T in `text_end` (a skeleton's last piece) and the text after it."""
        if text_end not in self._tails:
            best = None
            for content, token_id in self.added.items():
                at = text_end.rfind(content)
                if at >= 0 and (best is None or at + len(content) > best[0]):
                    best = (at + len(content), token_id, content)
            self._tails[text_end] = None if best is None else (best[1], best[2], text_end[best[0] :])
        return self._tails[text_end]

    def tail_ids(self, token: str, tail: str, token_id: int) -> Optional[list[int]]:
        if (token, tail) not in self._tail_ids:
            ids = self.backend.encode(token + tail, add_special_tokens=False).ids
            self._tail_ids[(token, tail)] = ids[1:] if ids and ids[0] == token_id else None
        return self._tail_ids[(token, tail)]

    def ids(
        self, prefix: str, skeleton: Optional[Skeleton], whole: str, encoding: Any, whole_ids: list[int]
    ) -> Optional[list[int]]:
        if not self.added or skeleton is None or encoding is None or not whole.startswith(prefix):
            return None
        split = self.split_tail(skeleton.pieces[-1])
        if split is None:
            return None
        token_id, token, tail = split
        end = len(prefix) - len(tail)  # where T ends in the text
        t = encoding.char_to_token(end - 1)
        if t is None or whole_ids[t] != token_id or encoding.token_to_chars(t) != (end - len(token), end):
            return None
        rest = self.tail_ids(token, tail, token_id)
        return None if rest is None else whole_ids[: t + 1] + rest


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def with_eos(text: str, eos: str) -> str:
    return text if not eos or text.endswith(eos) else text + eos


def prefix_token_ids(
    tokenizer: Any,
    renderer: ChatRenderer,
    wholes: "WholeTokens",
    requests: Sequence[tuple[int, Messages, int, bool]],
    tools: Optional[Sequence[Optional[list]]] = None,
) -> list[list[int]]:
    """Token ids of each requested prefix (k, messages, cut, generation prompt): messages[:cut] rendered (with the
    generation prompt or not, and conversation k's `tools`), conversation k of `wholes` being the whole conversation
    it is a prefix of. From the whole conversation's tokens where PrefixTokens proves them equal, else tokenized (one
    batch call)."""
    request_tools = [None if tools is None else tools[k] for k, _, _, _ in requests]
    skeletons = [renderer.skeleton_for(msgs[:cut], gen, t) for (_, msgs, cut, gen), t in zip(requests, request_tools)]
    texts: list[Optional[str]] = [None if sk is None else sk.fill(r[1]) for sk, r in zip(skeletons, requests)]
    for generation in (True, False):  # templates without skeletons: one apply_chat_template call for each kind
        plain = [j for j, t in enumerate(texts) if t is None and requests[j][3] == generation]
        prefixes = [requests[j][1][: requests[j][2]] for j in plain]
        rendered = renderer.render(prefixes, generation, [request_tools[j] for j in plain]) if plain else []
        for j, text in zip(plain, rendered):
            texts[j] = text
    out: list[Any] = []
    to_tokenize: list[str] = []
    for (k, _, _, _), skeleton, text in zip(requests, skeletons, texts):
        ids = wholes.prefix_ids(text, skeleton, k)  # type: ignore[arg-type]
        if ids is None:
            to_tokenize.append(text)  # type: ignore[arg-type]
            ids = len(to_tokenize) - 1
        out.append(ids)
    tokenized = token_ids(tokenizer, to_tokenize, add_special_tokens=False)
    return [tokenized[x] if isinstance(x, int) else x for x in out]


class WholeTokens:
    """Whole conversations' texts and token ids (with the backend's encodings when it can be used), and the
    PrefixTokens shortcut for their prefixes."""

    def __init__(self, tokenizer: Any, texts: list[str]):
        self.texts = texts
        backend = checked_backend(tokenizer, texts[0]) if texts else None
        self.encodings = backend.encode_batch(texts, add_special_tokens=False) if backend is not None else None
        self.ids = [e.ids for e in self.encodings] if self.encodings is not None else token_ids(tokenizer, texts, False)
        self.prefixes = PrefixTokens(tokenizer, backend)

    def prefix_ids(self, text: str, skeleton: Optional[Skeleton], k: int) -> Optional[list[int]]:
        if self.encodings is None:
            return None
        return self.prefixes.ids(text, skeleton, self.texts[k], self.encodings[k], self.ids[k])


def encode_chats(
    tokenizer: Any, chats: Sequence[tuple[Messages, int]], tools: Optional[Sequence[Optional[list]]] = None
) -> list[Union[tuple[list[int], list[int]], str]]:
    """(input_ids, labels) per (conversation, first trained turn): labels are -100 except on the tokens of each
    assistant turn at or after `first trained turn` (the template's end-of-turn tokens included). `tools[k]` (tool
    schemas or None) is rendered with conversation k by the template (apply_chat_template's `tools`).

    A turn's tokens lie between the tokens of the conversation before it (with the generation prompt) and those of
    the conversation through it (the whole conversation for the last turn); each must be a token prefix of the
    next, as in the per-row reference (data.tokenize_sft_messages). The prefixes' tokens: prefix_token_ids."""
    if not chats:
        return []
    renderer = ChatRenderer(tokenizer)
    wholes = WholeTokens(tokenizer, renderer.render([m for m, _ in chats], False, tools))
    requests: list[tuple[int, Messages, int, bool]] = []
    turns: list[list[tuple[int, int]]] = []  # per chat: (start request or -1 = none, end request or -1 = whole)
    for k, (messages, first) in enumerate(chats):
        mine = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant" or i < first:
                continue
            start = end = -1
            if i > 0:
                requests.append((k, messages, i, True))
                start = len(requests) - 1
            if i < len(messages) - 1:
                requests.append((k, messages, i + 1, False))
                end = len(requests) - 1
            mine.append((start, end))
        turns.append(mine)
    prefix_ids = prefix_token_ids(tokenizer, renderer, wholes, requests, tools)

    out: list[Union[tuple[list[int], list[int]], str]] = []
    for k, mine in enumerate(turns):
        seq = wholes.ids[k]
        labels = [-100] * len(seq)
        error = ""
        for start, end in mine:
            s = prefix_ids[start] if start >= 0 else []
            e = prefix_ids[end] if end >= 0 else seq
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
    rendered with the generation prompt must be a token prefix of both (its tokens: prefix_token_ids, against the
    chosen conversation)."""
    if not triples:
        return []
    renderer = ChatRenderer(tokenizer)
    chosen = WholeTokens(tokenizer, renderer.render([c for _, c, _ in triples], False))
    rejected = token_ids(tokenizer, renderer.render([r for _, _, r in triples], False), add_special_tokens=False)
    prompts = prefix_token_ids(
        tokenizer, renderer, chosen, [(k, p, len(p), True) for k, (p, _, _) in enumerate(triples)]
    )
    out: list[Union[tuple[list[int], list[int], int], str]] = []
    for p, c, r in zip(prompts, chosen.ids, rejected):
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
