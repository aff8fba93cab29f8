"""The dataset row formats the scripts accept, recognised from a dataset's columns (its first row).

TRL's names (https://huggingface.co/docs/trl/dataset_formats): a *standard* row holds strings, a *conversational*
row lists of {role, content} messages. Column names in `code` are the defaults; the `*_column` keys rename them.

- sft / messages: `messages`, a conversation; every assistant turn is trained.
- sft / prompt_completion: `prompt` + `completion`, strings or message lists; the completion is trained.
- sft / text: `text`, a string; every token is trained (language modelling).
- preference / implicit_prompt: `chosen` + `rejected`, conversations sharing their prompt turns, or strings
  (the prompt is their common prefix).
- preference / explicit_prompt: `prompt` + `chosen` + `rejected`, strings, or a prompt message list and the
  replies as message lists (assistant turns).
- prompt (RL) / messages: `messages` + `ground_truth` + `dataset` (the verifier: a name, or a one-name list as in
  open-instruct's RLVR rows).
- prompt (RL) / prompt: `prompt` (a string or a message list) + `ground_truth` + `dataset`.

data.py converts each row of the recognised format into one internal shape (message lists, or raw strings) and
validates it there. This module only recognises: it imports nothing but the errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from open_instruct.errors import DataError

SFT, PREFERENCE, PROMPT = "sft", "preference", "prompt"


@dataclass(frozen=True)
class Format:
    kind: str  # SFT, PREFERENCE or PROMPT
    name: str
    columns: tuple[str, ...]  # the columns it needs (after the *_column renames)
    describe: str  # for the accepted-formats list of an error


def candidate_formats(kind: str, cfg: Any) -> list[Format]:
    """The formats of a kind, in the order they are tried (the first whose columns are all present wins)."""
    if kind == SFT:
        messages = getattr(cfg, "messages_column", "messages")
        return [
            Format(SFT, "messages", (messages,), f"{messages!r} (a conversation)"),
            Format(SFT, "prompt_completion", ("prompt", "completion"), "'prompt' + 'completion' (strings or messages)"),
            Format(SFT, "text", ("text",), "'text' (a string)"),
        ]
    if kind == PREFERENCE:
        chosen, rejected = cfg.chosen_column, cfg.rejected_column
        prompt = getattr(cfg, "prompt_column", "prompt")
        return [
            Format(
                PREFERENCE,
                "explicit_prompt",
                (prompt, chosen, rejected),
                f"{prompt!r} + {chosen!r} + {rejected!r} (strings, or a prompt message list and reply lists)",
            ),
            Format(
                PREFERENCE,
                "implicit_prompt",
                (chosen, rejected),
                f"{chosen!r} + {rejected!r} (conversations sharing their prompt turns, or strings)",
            ),
        ]
    if kind == PROMPT:
        messages, truth, verifier = cfg.messages_column, cfg.ground_truth_column, cfg.verifier_column
        return [
            Format(PROMPT, "messages", (messages,), f"{messages!r} (messages) + {truth!r} + {verifier!r}"),
            Format(PROMPT, "prompt", ("prompt",), f"'prompt' (a string or messages) + {truth!r} + {verifier!r}"),
        ]
    raise ValueError(f"unknown data kind {kind!r}")


def detect_format(kind: str, columns: Iterable[str], cfg: Any, where: str) -> Format:
    """The format a dataset is in, from the columns of its first row; DataError naming the columns found and the
    formats accepted when none fits."""
    present = set(columns)
    candidates = candidate_formats(kind, cfg)
    for fmt in candidates:
        if all(c in present for c in fmt.columns):
            return fmt
    accepted = "; ".join(f.describe for f in candidates)
    keys = {SFT: "messages_column", PREFERENCE: "chosen_column/rejected_column/prompt_column"}.get(
        kind, "messages_column/ground_truth_column/verifier_column"
    )
    raise DataError(
        f"{where}: columns {sorted(present)} match no {kind} data format. Accepted: {accepted}. "
        f"Set {keys} in the recipe if your columns have other names "
        "(docs/data.md#data-formats-tokenization-and-the-cache)."
    )


def is_conversation(value: Any) -> bool:
    """A list (of messages) rather than a string: what decides a value's standard or conversational form."""
    return isinstance(value, list)


def common_prefix_split(chosen: str, rejected: str) -> tuple[str, str, str]:
    """(prompt, chosen reply, rejected reply) of an implicit-prompt string pair: the prompt is the longest common
    prefix, less a trailing space, which starts both replies (TRL's extract_prompt does the same)."""
    n = 0
    limit = min(len(chosen), len(rejected))
    while n < limit and chosen[n] == rejected[n]:
        n += 1
    if 0 < n and chosen[n - 1] == " ":
        n -= 1
    return chosen[:n], chosen[n:], rejected[n:]


def single_verifier(verifier: Any, ground_truth: Any, column: str, where: str) -> tuple[Any, Any]:
    """open-instruct's RLVR rows may name the verifier as a one-element list (`dataset: ["gsm8k"]`), its ground
    truth then a one-element list too: both unwrapped. Several verifiers per row are refused."""
    if not isinstance(verifier, list):
        return verifier, ground_truth
    if len(verifier) != 1:
        raise DataError(
            f"{where}: column {column!r} lists {len(verifier)} verifiers {verifier!r:.80}; one per row is supported"
        )
    if isinstance(ground_truth, list) and len(ground_truth) == 1:
        ground_truth = ground_truth[0]
    return verifier[0], ground_truth
