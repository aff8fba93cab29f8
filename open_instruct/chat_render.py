"""Chat-template rendering at data-set scale: each distinct sequence of roles is rendered once, as a skeleton, and
every conversation with those roles is the skeleton with its contents filled in (string joins, no Jinja per row).

That is exact only for a template that treats a message's content as opaque text: it may concatenate it and write
it out (and trim it, below), but not test, measure, split, escape or compare it (anything that could make the
output depend on the content other than by inserting it verbatim). Each skeleton is proven so while it is made:

1. The template is rendered (a Jinja environment like transformers') with every content replaced by a `ContentText`
   marker, a str whose every operation other than `+` and being written out is recorded. Any recorded operation
   means the template reads contents: no skeleton, those conversations go through `apply_chat_template`.
2. The same conversation, markers as plain strings, goes through the tokenizer's own `apply_chat_template`; the two
   texts must be equal, but for the tags of trimmed markers (so our environment renders this template as
   transformers does), and every marker must come out verbatim (an escaping filter, `tojson`, would change its
   quote, backslash or newline).
3. A second set of contents is rendered both ways (the tokenizer's, and filled into the skeleton): equal.

With no recorded operation the template's control flow cannot depend on the contents, so the skeleton holds for
every conversation with those roles (messages with more than role and content, e.g. tool calls, are rendered by the
template itself). One operation is modelled rather than refused: `trim` (`strip()` with no argument) of a bare
content, as Llama 3's template does; the slot is then filled with `content.strip()`, which is what `trim` computes.
One test is allowed: whether a content is empty (`{% if message['content'] %}`, as templates that also render tool
calls do); such a skeleton holds for conversations whose contents are all non-empty, the others go through
`apply_chat_template`. The named templates (chat_templates.py) and the tests' template all have skeletons.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Optional, Sequence

Messages = list[dict[str, str]]

MARK_OPEN, MARK_CLOSE = '\ue000"\\\n', "\ue001"  # private-use characters around quote, backslash, newline
MARK_RE = re.compile(re.escape(MARK_OPEN) + r"(\d+)(s?)" + re.escape(MARK_CLOSE))  # s: the content stripped
MAX_SKELETONS = 50_000  # distinct (template, roles) pairs kept; past this the cache is cleared


class ContentText(str):
    """A message's content while a template is probed: `+` (either side) keeps the mark on the result; writing it
    out is what the probe environment's finalize does; `strip()` of a bare content (Jinja's `trim`, as Llama 3's
    template does) gives its stripped marker; every other str operation is logged in `reads`."""

    __slots__ = ()
    reads: list[str] = []

    def strip(self, chars: Any = None) -> Any:
        bare = MARK_RE.fullmatch(self)
        if chars is None and bare is not None and not bare.group(2):
            return ContentText(f"{MARK_OPEN}{bare.group(1)}s{MARK_CLOSE}")
        ContentText.reads.append("strip")
        return str.strip(self, chars)

    def __add__(self, other: Any) -> Any:
        return ContentText(str.__add__(self, other))

    def __bool__(self) -> bool:  # a marker is never empty: the skeleton then holds for non-empty contents only
        ContentText.reads.append("__bool__")
        return True

    def __radd__(self, other: Any) -> Any:
        if not isinstance(other, str):
            return NotImplemented
        return ContentText(str.__add__(other, self))


def _logged(name: str) -> Any:
    method = getattr(str, name)

    def logged(self: ContentText, *args: Any, **kwargs: Any) -> Any:
        ContentText.reads.append(name)
        return method(self, *args, **kwargs)

    return logged


_NOT_READS = {
    "__new__", "__init__", "__getattribute__", "__setattr__", "__delattr__", "__init_subclass__", "__subclasshook__",
    "__class__", "__dir__", "__sizeof__", "__reduce__", "__reduce_ex__", "__getnewargs__", "__getstate__", "__repr__",
    "__add__", "__radd__", "__class_getitem__", "strip", "__bool__",
}  # fmt: skip
for _name, _value in vars(str).items():
    if callable(_value) and _name not in _NOT_READS:
        setattr(ContentText, _name, _logged(_name))


def _written(value: Any) -> Any:
    """The probe environment's finalize: a marked text is written as plain text, without being read."""
    return str.__str__(value) if isinstance(value, ContentText) else value


_ENV: Any = None


def _probe_environment() -> Any:
    """A sandboxed Jinja environment set up as transformers sets up chat templates' (same options, filters and
    globals), plus the finalize that writes marked contents out."""
    global _ENV
    if _ENV is None:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols], finalize=_written
        )
        env.filters["tojson"] = tojson
        env.globals.update(
            raise_exception=raise_exception,
            strftime_now=lambda fmt: datetime.now().strftime(fmt),
            dict=dict,
            namespace=jinja2.utils.Namespace,
        )
        _ENV = env
    return _ENV


_COMPILED: dict[str, Any] = {}


def _compiled(template: str) -> Any:
    if template not in _COMPILED:
        if len(_COMPILED) >= 64:
            _COMPILED.clear()
        _COMPILED[template] = _probe_environment().from_string(template)
    return _COMPILED[template]


@dataclass(frozen=True, eq=False)
class Skeleton:
    """A rendered conversation with holes: pieces[0] + content of message slots[0] (stripped if stripped[0]) +
    pieces[1] + ..."""

    pieces: tuple[str, ...]
    slots: tuple[int, ...]
    stripped: tuple[bool, ...]
    nonempty_only: bool = False  # the template tests whether a content is empty: holds when none is

    def holds_for(self, messages: Sequence[dict[str, str]]) -> bool:
        return not self.nonempty_only or all(m["content"] for m in messages)

    def fill(self, messages: Sequence[dict[str, str]]) -> str:
        parts = [self.pieces[0]]
        if any(self.stripped):
            for slot, strip, piece in zip(self.slots, self.stripped, self.pieces[1:]):
                content = messages[slot]["content"]
                parts.append(content.strip() if strip else content)
                parts.append(piece)
        else:
            for slot, piece in zip(self.slots, self.pieces[1:]):
                parts.append(messages[slot]["content"])
                parts.append(piece)
        return "".join(parts)


def _marker(i: int) -> str:
    return f"{MARK_OPEN}{i}{MARK_CLOSE}"


def make_skeleton(tokenizer: Any, roles: tuple[str, ...], add_generation_prompt: bool) -> Optional[Skeleton]:
    """The skeleton of `roles` under the tokenizer's chat template, or None when the template reads the contents
    (module docstring) or cannot be probed."""
    template = tokenizer.chat_template
    if not isinstance(template, str) or not roles:
        return None
    variables = dict(tokenizer.special_tokens_map)
    try:
        compiled = _compiled(template)
        ContentText.reads = []
        marked = [{"role": r, "content": ContentText(_marker(i))} for i, r in enumerate(roles)]
        probed = compiled.render(
            messages=marked, tools=None, documents=None, add_generation_prompt=add_generation_prompt, **variables
        )
        reads, ContentText.reads = ContentText.reads, []
        nonempty_only = "__bool__" in reads
        if any(r != "__bool__" for r in reads):
            return None
        plain = [{"role": r, "content": _marker(i)} for i, r in enumerate(roles)]
        rendered = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception:  # noqa: BLE001  (any template failure: the plain path renders, and raises, as before)
        ContentText.reads = []
        return None
    if MARK_RE.sub(lambda m: _marker(int(m.group(1))), probed) != rendered:  # stripping leaves a marker as it is
        return None
    parts = MARK_RE.split(probed)  # text, index, "s" or "", text, ...
    skeleton = Skeleton(
        tuple(parts[0::3]), tuple(int(i) for i in parts[1::3]), tuple(s == "s" for s in parts[2::3]), nonempty_only
    )
    if any(slot >= len(roles) for slot in skeleton.slots):
        return None
    other = [{"role": r, "content": f" x{i}\n"} for i, r in enumerate(roles)]
    check = tokenizer.apply_chat_template(other, tokenize=False, add_generation_prompt=add_generation_prompt)
    return skeleton if skeleton.fill(other) == check else None


_SKELETONS: dict[tuple, Optional[Skeleton]] = {}


class ChatRenderer:
    """Renders conversations with the tokenizer's chat template, through skeletons where the template allows it
    (module docstring), else with `apply_chat_template` (one batched call)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        template = tokenizer.chat_template  # a dict of named templates has no skeletons: its text is only a key
        template = template if isinstance(template, str) or template is None else json.dumps(template, default=str)
        self._key = (template, json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str))

    def skeleton(self, roles: tuple[str, ...], add_generation_prompt: bool) -> Optional[Skeleton]:
        key = (self._key, roles, add_generation_prompt)
        if key not in _SKELETONS:
            if len(_SKELETONS) >= MAX_SKELETONS:
                _SKELETONS.clear()
            _SKELETONS[key] = make_skeleton(self.tokenizer, roles, add_generation_prompt)
        return _SKELETONS[key]

    def skeleton_for(
        self, messages: Messages, add_generation_prompt: bool, tools: Optional[list] = None
    ) -> Optional[Skeleton]:
        """The skeleton that renders `messages` exactly, or None: a message with more than role and content (tool
        calls, a name) is left to the template itself, as is an empty content where the template tests for one,
        and a conversation rendered with tool schemas (skeletons are made without them)."""
        if tools or not all(m.keys() <= {"role", "content"} for m in messages):
            return None
        skeleton = self.skeleton(tuple(m["role"] for m in messages), add_generation_prompt)
        return skeleton if skeleton is not None and skeleton.holds_for(messages) else None

    def render(
        self,
        conversations: Sequence[Messages],
        add_generation_prompt: bool,
        tools: Optional[Sequence[Optional[list]]] = None,
    ) -> list[str]:
        """The template's text of each conversation; `tools[k]` (tool schemas, or None) goes to the template with
        conversation k, as apply_chat_template's `tools` (a conversation with tools never uses a skeleton)."""
        out: list[Optional[str]] = [None] * len(conversations)
        plain: dict[str, list[int]] = {}  # conversations for apply_chat_template, by their tools' JSON ("" = none)
        for k, messages in enumerate(conversations):
            row_tools = tools[k] if tools is not None else None
            skeleton = self.skeleton_for(messages, add_generation_prompt, row_tools)
            if skeleton is None:
                plain.setdefault(json.dumps(row_tools, sort_keys=True) if row_tools else "", []).append(k)
            else:
                out[k] = skeleton.fill(messages)
        for key, ks in plain.items():  # one batched call per distinct tool list
            texts = self.tokenizer.apply_chat_template(
                [conversations[k] for k in ks],
                tools=tools[ks[0]] if key else None,  # type: ignore[index]
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
            for k, text in zip(ks, texts):
                out[k] = text
        return out  # type: ignore[return-value]
