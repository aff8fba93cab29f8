"""Verifiable rewards for RLVR: one plain function per task, a registry, and time-limited scoring.

A *verifier* is `fn(completion: str, ground_truth) -> float` returning 1.0 (correct) or 0.0. All built-in
verifiers are binary: partial credit would let the policy farm half-right answers, and the RL reward is
`verification_reward if correct else 0` anyway. Built-in verifiers (names are case-insensitive):

    gsm8k       last number in the completion (or the first one after the last "####"), compared exactly
                as a decimal: "$1,000.50" == 1000.5, "-3" == -3, "7.0" == 7
    math        math-verify (LaTeX / \\boxed{} / "the final answer is ...") on the tail of the completion
    arithmetic  last number in the completion must equal the integer ground truth ("3+4=7" -> 7)
    ifeval      instruction constraints, ground truth {"func_name": ..., kwargs...} (JSON string, dict, or a
                list of them: all must hold). See IFEVAL_CONSTRAINTS for the supported func_names.
    code        the program in the completion run against the row's test cases in the sandbox (formats and
                failure reasons in open_instruct/code_verifier.py); 1.0 iff all pass, or the fraction passed
                with `code_reward: fraction` (the one verifier that can give partial credit, opt-in)

Integrations register theirs in their own module, imported when a row names one (open_instruct/integrations.py:
BUILT_IN_VERIFIERS).

Every verifier sees the text after the last "</think>" when a completion contains one (the answer, not the
reasoning). Completions longer than MAX_COMPLETION_CHARS score 0 without being read.

Choosing a verifier per row (`get_verifier` / `normalize_verifier_name`): the name is lowercased and stripped,
anything up to a last "/" is dropped ("allenai/ifeval" -> "ifeval"), then (1) an exact registered name or
alias (ALIASES, exact only) wins, else (2) the longest registered name that is a prefix of it *not followed by
a letter*: "GSM8K_train" -> gsm8k, "MATH-500" / "math500" / "math_minerva" -> math, "ifeval-v2" -> ifeval, but
"mathematics" is unknown. Unknown names raise ValueError listing the known ones.

Time limits (`run_verifier`, `score_completion`, `score_batch`): every call returns within `timeout` seconds.
  * Input size is bounded first: math-verify only sees the last MATH_TAIL_CHARS characters; all the other
    verifiers are linear-time regex/str scans (no backtracking blow-ups) over at most MAX_COMPLETION_CHARS.
  * On the main thread (POSIX) each call runs under a SIGALRM interval timer (`signal.setitimer`, sub-second).
    The handler raises `_Deadline`, a BaseException, so math-verify's and sympy's `except Exception` cannot
    swallow it, and re-fires every _REFIRE_SECONDS in case a bare `except:` does. math-verify's own timeouts
    are disabled: they use `signal.alarm`, which shares the same timer and whole seconds only. An outer
    ITIMER_REAL (e.g. pytest-timeout) is paused and re-armed with its remaining time afterwards.
  * On other threads signals are unavailable, so the math verifier (sympy can hang) runs in a persistent
    child process per calling thread (`python -m open_instruct.rewards --worker`), which applies the same
    SIGALRM timer in its own main thread; if the child does not answer in time (stuck in C code) it is
    killed and replaced. Cost: ~1.5 s to start a child (importing sympy) on the first math call of each
    thread and after each kill (not counted against the call's timeout), ~0.15 ms IPC per call. The cheap
    verifiers run inline on any thread; a call that overruns is scored 0 and counted as a timeout after it
    returns (a thread cannot be pre-empted).
  * Verifiers registered `sandboxed` (a package's scorers that may evaluate the answer text) run in the sandbox,
    like `code`: each answer in a sandboxed run of its own (registered with `batch=`: score_batch hands it all of a
    batch's rows at once, in `sandbox_workers` calls).
  * A timed-out call scores 0 and increments STATS["timeouts"] (and BatchScores.num_timeouts).
  * `code` is the exception: it runs no model text in this process, so no timer applies; its programs run in
    sandboxed subprocesses with their own limits (CodeSettings), `sandbox_workers` at a time across a batch.

Errors: a bad *ground truth or configuration* (unknown verifier, unknown ifeval func_name, missing kwargs,
unparseable ground truth) raises ValueError (GroundTruthError) so the pipeline reports it. Model text never
raises: verifiers are written not to, and any unexpected exception is logged, scored 0 and counted in
STATS["errors"]. In this process model text is never passed to eval/exec/compile/sympify; math-verify is the only
parser (its plain-expression path hands sympy's parser only strings of digits, spaces and + - * / ^ ( ) ., no name:
nothing to call); reasoning-gym's scorers, which do evaluate text, run in the sandbox (docs/sandbox.md lists every
scorer and where it runs).
"""

from __future__ import annotations

import atexit
import collections
import importlib
import inspect
import json
import logging
import math
import numbers
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from decimal import Decimal
from functools import lru_cache
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

from open_instruct import integrations

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------------
# Limits
# --------------------------------------------------------------------------------------------------------
MAX_COMPLETION_CHARS = 2_000_000  # ~500k tokens: far beyond any generation length; guards against runaway input
MATH_TAIL_CHARS = 3_000  # the final answer is at the end; sympy cost grows with what it is shown
MAX_MATH_GOLD_CHARS = 2_000  # a longer reference answer is a data bug, not maths
_TAIL_WINDOW = 4096  # first tail size _last_match scans (grows x4 as needed)
_REFIRE_SECONDS = 0.05  # SIGALRM re-fires this often after the deadline until the call unwinds
_WORKER_START_TIMEOUT = 120.0  # seconds to wait for a fresh worker process to import sympy

VerifierFn = Callable[[str, Any], float]
STATS: collections.Counter = collections.Counter()  # "calls", "timeouts", "errors" since import


class GroundTruthError(ValueError):
    """A malformed ground truth or configuration (never caused by model text). Raised, not scored."""


# --------------------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------------------
VERIFIERS: dict[str, VerifierFn] = {}
_USES_SYMPY: set[str] = set()  # verifiers that can hang in sympy: need a pre-emptible timer
_SANDBOXED: set[str] = set()  # verifiers whose work runs in sandboxed subprocesses, bounded by their own limits
# verifiers that may evaluate model text (a package's scorer calling eval or sympy's parse_expr): always run in the
# worker process, never in the trainer's; the value imports what they need before the first timed call
# verifiers that score many rows in one go, (completions, ground truths, timeout, code settings) -> [(score,
# timed_out)], and check a ground truth without scoring (check_verifiers)
_BATCHED: dict[str, Callable[..., list[tuple[float, bool]]]] = {}
_GROUND_TRUTH_CHECKS: dict[str, Callable[[Any], None]] = {}
ALIASES = {"gsm": "gsm8k", "if": "ifeval", "if_eval": "ifeval", "instruction_following": "ifeval"}


def register_verifier(
    name: str,
    *,
    uses_sympy: bool = False,
    sandboxed: bool = False,
    batch: Optional[Callable[..., list[tuple[float, bool]]]] = None,
    check: Optional[Callable[[Any], None]] = None,
) -> Callable[[VerifierFn], VerifierFn]:
    """Decorator: `@register_verifier("gsm8k")` makes the function available as get_verifier("gsm8k").
    `sandboxed`: its calls are bounded by the sandbox it runs in (`batch`: all of a batch's rows in one call)."""
    key = name.strip().lower()

    def decorator(fn: VerifierFn) -> VerifierFn:
        if key in VERIFIERS:
            raise ValueError(f"verifier {key!r} is already registered (by {VERIFIERS[key].__name__})")
        VERIFIERS[key] = fn
        if uses_sympy:
            _USES_SYMPY.add(key)
        if sandboxed:
            _SANDBOXED.add(key)
        if batch is not None:
            _BATCHED[key] = batch
        if check is not None:
            _GROUND_TRUTH_CHECKS[key] = check
        return fn

    return decorator


def _registered_name(key: str) -> Optional[str]:
    if key in VERIFIERS:
        return key
    if ALIASES.get(key) in VERIFIERS:
        return ALIASES[key]
    # Longest prefix first so a hypothetical "math_hard" verifier would beat "math".
    for prefix in sorted(VERIFIERS, key=len, reverse=True):
        if key.startswith(prefix) and not key[len(prefix)].isalpha():
            return prefix
    return None


def normalize_verifier_name(name: Union[str, Sequence[str]]) -> str:
    """Map a dataset's `dataset`/`verifier` value to a registered verifier name (rule in the module docstring)."""
    if isinstance(name, (list, tuple)) and len(name) == 1:  # some datasets store ["gsm8k"]
        name = name[0]
    if not isinstance(name, str):
        raise ValueError(f"verifier name must be a string, got {name!r}")
    key = name.strip().lower().rsplit("/", 1)[-1]
    found = _registered_name(key)
    if found is None and integrations.load_verifier_module(key):  # an integration's: registered at its import
        found = _registered_name(key)
    if found is not None:
        return found
    raise ValueError(
        f"unknown verifier {name!r}; the known ones: {sorted(set(VERIFIERS) | set(integrations.BUILT_IN_VERIFIERS))} "
        f"(aliases: {sorted(ALIASES)}; names may carry a suffix such as 'gsm8k_train' or 'MATH-500')"
    )


def get_verifier(name: str) -> VerifierFn:
    """The verifier function registered under `name` (lenient about case and suffixes)."""
    return VERIFIERS[normalize_verifier_name(name)]


# --------------------------------------------------------------------------------------------------------
# Small pure helpers
# --------------------------------------------------------------------------------------------------------
# A number: optional sign (ASCII or U+2212), then 1,234,567(.89) or 1234(.5) or .5. The lookbehind (ASCII
# only, so CJK text before a number is fine) rejects digits glued to a word or a decimal point ("x2",
# "1.5.3"); a minus right after a letter/digit is subtraction, not a sign ("10-4" -> 10, 4).
_NUMBER_RE = re.compile(
    r"(?:(?<![A-Za-z0-9_.)])([-\u2212])|(?<![A-Za-z0-9_.]))"  # a sign only where it cannot be a minus operator
    r"(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)",  # 1,234,567.89 | 1234.5 | .5
    re.ASCII,
)
# Characters that cannot be inside a number match: no match spans one, so a scan restarted right after one
# (with `pos`, which lookbehinds still see past) finds the same later matches as a scan from the beginning.
_NUMBER_BREAK_RE = re.compile(r"[^0-9.,\-\u2212]")


def strip_thinking(text: str) -> str:
    """The part after the last '</think>' (the answer), or the text unchanged if there is none."""
    cut = text.rfind("</think>")
    return text[cut + len("</think>") :] if cut >= 0 else text


def _last_match(pattern: re.Pattern, text: str) -> Optional[re.Match]:
    """The last match of `pattern` (a _NUMBER_RE-like pattern) in text, reading only as much of the tail as
    needed: the scan starts just after a break character, so the result equals a full left-to-right scan."""
    window = _TAIL_WINDOW
    while True:
        start = max(0, len(text) - window)
        if start > 0:
            brk = _NUMBER_BREAK_RE.search(text, start)
            if brk is None:  # e.g. a 100k-digit number: look further back
                window *= 4
                continue
            start = brk.end()
        last = None
        for last in pattern.finditer(text, start):
            pass
        if last is not None or start == 0:
            return last
        window *= 4


def _number_token(match: re.Match) -> str:
    """'-1,000.50' -> '-1000.50' (a string Decimal() accepts)."""
    sign = "-" if match.group(1) else ""
    return sign + match.group(2).replace(",", "")


def extract_last_number_str(text: str) -> Optional[str]:
    """The last number in text as a plain decimal string ('$1,000.50' -> '1000.50'), or None."""
    m = _last_match(_NUMBER_RE, text)
    return _number_token(m) if m else None


def extract_last_number(text: str) -> Optional[float]:
    """The last number in text as a float ('x = -3.5.' -> -3.5), or None. Huge numbers become inf."""
    token = extract_last_number_str(text)
    return float(token) if token is not None else None


def extract_last_integer(text: str) -> Optional[int]:
    """The last number in text if it is integral ('3+4=7' -> 7, '7.0' -> 7, '7.5' -> None), else None."""
    token = extract_last_number_str(text)
    if token is None:
        return None
    value = Decimal(token)
    if value != value.to_integral_value() or len(token) > 4000:  # int() refuses > 4300 digits
        return None
    return int(value)


def extract_gsm8k_answer(text: str) -> Optional[str]:
    """GSM8K answer as a decimal string: the first number after the last '####' if present (the dataset's
    own answer marker), else the last number in the text."""
    marker = text.rfind("####")
    if marker >= 0:
        m = _NUMBER_RE.search(text, marker + 4)
        if m and not text[marker + 4 : m.start()].strip(" \t*$:"):  # only spaces/markup between
            return _number_token(m)
    return extract_last_number_str(text)


def _to_decimal(value: Any, what: str) -> Decimal:
    """Ground-truth number -> Decimal; raises GroundTruthError if it is not a number."""
    if isinstance(value, bool):
        raise GroundTruthError(f"{what} ground truth must be a number, got {value!r}")
    if isinstance(value, (int, float)):
        return Decimal(str(value))
    if isinstance(value, str):
        token = extract_gsm8k_answer(value)
        if token is not None:
            return Decimal(token)
    raise GroundTruthError(f"{what} ground truth {str(value)[:200]!r} contains no number")


# --------------------------------------------------------------------------------------------------------
# Verifiers: gsm8k, arithmetic, math
# --------------------------------------------------------------------------------------------------------
@register_verifier("gsm8k")
def verify_gsm8k(completion: str, ground_truth: Any) -> float:
    """1.0 iff the completion's answer (see extract_gsm8k_answer) equals the ground truth number exactly."""
    gold = _to_decimal(ground_truth, "gsm8k")
    token = extract_gsm8k_answer(strip_thinking(completion))
    return 1.0 if token is not None and Decimal(token) == gold else 0.0


@register_verifier("arithmetic")
def verify_arithmetic(completion: str, ground_truth: Any) -> float:
    """1.0 iff the last number in the completion equals the integer ground truth (an int or a string of one)."""
    if isinstance(ground_truth, str) and re.fullmatch(r"\s*[-+]?\d+\s*", ground_truth):
        gold = Decimal(ground_truth.strip())
    elif isinstance(ground_truth, int) and not isinstance(ground_truth, bool):
        gold = Decimal(ground_truth)
    else:
        raise GroundTruthError(f"arithmetic ground truth must be an integer, got {str(ground_truth)[:200]!r}")
    token = extract_last_number_str(strip_thinking(completion))
    return 1.0 if token is not None and Decimal(token) == gold else 0.0


class _DropMathVerifyTimeoutNotice(logging.Filter):
    """math-verify warns once that its own timeout is off; we provide the timeout (see module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


_math_verify = None  # the math_verify module, imported on first use (it pulls in sympy: ~1 s)


def _load_math_verify():
    """Import math-verify and warm its parser *outside* any timer: an import interrupted half-way would
    leave broken modules behind, and the first parse compiles grammars (slow once)."""
    global _math_verify
    if _math_verify is None:
        import math_verify

        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).addFilter(_DropMathVerifyTimeoutNotice())
        gold, pred = math_verify.parse("$1$", parsing_timeout=None), math_verify.parse("1", parsing_timeout=None)
        math_verify.verify(gold, pred, timeout_seconds=None)
        _math_verify = math_verify
    return _math_verify


_UNPARSEABLE_GOLDS: set[str] = set()


@lru_cache(maxsize=8192)
def _parse_math_gold(gold: str) -> tuple:
    # A bare reference answer ("\frac{1}{2}", "x^2+1") is not found by math-verify's LaTeX extractor unless
    # it is delimited, so box it. Cached: with GRPO every prompt is scored many times.
    text = gold if ("\\boxed" in gold or "$" in gold) else "\\boxed{" + gold + "}"
    return tuple(_math_verify.parse(text, parsing_timeout=None))


@register_verifier("math", uses_sympy=True)
def verify_math(completion: str, ground_truth: Any) -> float:
    """1.0 iff math-verify finds the ground truth's value in the completion's final answer. A list ground
    truth means alternative accepted answers (any may match). No internal timeout: call it through
    run_verifier / score_completion, which bound it."""
    mv = _load_math_verify()
    golds = ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth]
    if not golds:
        raise GroundTruthError("math ground truth is an empty list")
    tail = strip_thinking(completion).replace("\x00", "")[-MATH_TAIL_CHARS:]
    pred = None
    for gold in golds:
        if isinstance(gold, bool) or not isinstance(gold, (str, int, float)):
            raise GroundTruthError(f"math ground truth must be a string or number, got {gold!r}")
        gold = str(gold).strip()
        if not gold or len(gold) > MAX_MATH_GOLD_CHARS:
            raise GroundTruthError(f"math ground truth must be 1..{MAX_MATH_GOLD_CHARS} chars, got {len(gold)}")
        parsed_gold = _parse_math_gold(gold)
        if not parsed_gold:
            if gold not in _UNPARSEABLE_GOLDS:  # a data problem worth one line per answer, not per sample
                _UNPARSEABLE_GOLDS.add(gold)
                logger.warning("math-verify cannot parse the ground truth %r; scoring 0", gold[:200])
            continue
        if pred is None:
            pred = mv.parse(tail, parsing_timeout=None)
            if not pred:
                return 0.0
        if mv.verify(list(parsed_gold), pred, timeout_seconds=None):
            return 1.0
    return 0.0


# --------------------------------------------------------------------------------------------------------
# IFEval constraints. Each checker takes the response text and clean, typed keyword arguments; the table
# below maps the public dataset's func_name and kwarg names (N, quantifier, keyword_list, ...) onto them, and
# _KWARG_PARSERS validates the values once, before any text is looked at. All scans are linear-time.
# --------------------------------------------------------------------------------------------------------
_RELATIONS = {
    "at least": ">=",
    "minimum": ">=",
    ">=": ">=",
    "at most": "<=",
    "maximum": "<=",
    "<=": "<=",
    "exactly": "==",
    "equal": "==",
    "equal to": "==",
    "==": "==",
    "less than": "<",
    "fewer than": "<",
    "<": "<",
    "more than": ">",
    "greater than": ">",
    ">": ">",
    "around": "~",
    "about": "~",
    "approximately": "~",
}


def parse_relation(relation: Any) -> str:
    """A quantifier such as 'at least' / 'At_Most' / 'around' -> one of '>=', '<=', '==', '<', '>', '~'."""
    key = relation.strip().lower().replace("_", " ") if isinstance(relation, str) else None
    if key not in _RELATIONS:
        known = sorted(k for k in _RELATIONS if k[0].isalpha())
        raise GroundTruthError(f"unknown ifeval quantifier {relation!r}; known: {known}")
    return _RELATIONS[key]


def compare_count(count: int, n: int, relation: str) -> bool:
    """count <relation> n; relation as returned by parse_relation. '~' (around) means within
    max(1, round(10% of n)) of n."""
    if relation == "~":
        return abs(count - n) <= max(1, round(0.1 * n))
    return {">=": count >= n, "<=": count <= n, "==": count == n, "<": count < n, ">": count > n}[relation]


def _as_int(value: Any, name: str) -> int:
    try:
        if isinstance(value, bool) or float(value) != int(float(value)):
            raise ValueError
        return int(float(value))
    except (TypeError, ValueError, OverflowError):
        raise GroundTruthError(f"ifeval kwarg {name} must be an integer, got {value!r}") from None


def _as_str(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise GroundTruthError(f"ifeval kwarg {name} must be a non-empty string, got {value!r}")
    return value.strip()


def _as_str_list(value: Any, name: str) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise GroundTruthError(f"ifeval kwarg {name} must be a list of strings, got {value!r}")
    return [v.strip() for v in value if v.strip()]


def _as_letter(value: Any, name: str) -> str:
    letter = _as_str(value, name)
    if len(letter) != 1:
        raise GroundTruthError(f"ifeval kwarg {name} must be a single character, got {value!r}")
    return letter


def parse_options(options: Any) -> list[str]:
    """Allowed answers from a list, or from a string such as "('My answer is yes.', 'My answer is no.')"
    (quoted items are read with a regex, never evaluated) or "yes, no, maybe"."""
    if isinstance(options, (list, tuple)):
        items = [str(o) for o in options]
    elif isinstance(options, str):
        quoted = re.findall(r"'([^'\n]+)'|\"([^\"\n]+)\"", options)
        items = [a or b for a, b in quoted] if quoted else options.split(",")
    else:
        items = []
    items = [i.strip() for i in items if i.strip()]
    if not items:
        raise GroundTruthError(f"ifeval kwarg options must list the allowed answers, got {options!r}")
    return items


def _collapse_ws(text: str) -> str:
    return " ".join(text.split())


def _word_pattern(word: str) -> re.Pattern:
    """Case-insensitive match of `word` not glued to other word characters ('cat' not in 'concatenate')."""
    return re.compile(r"(?<!\w)" + re.escape(word) + r"(?!\w)", re.IGNORECASE)


def is_lowercase(text: str) -> bool:
    return text == text.lower()


def is_uppercase(text: str) -> bool:
    return text == text.upper()


def has_no_commas(text: str) -> bool:
    return "," not in text and "\uff0c" not in text  # also the full-width comma


def check_word_count(text: str, n: int, relation: str = ">=") -> bool:
    """Words are whitespace-separated tokens."""
    return compare_count(len(text.split()), n, relation)


def count_sentences(text: str) -> int:
    """Sentences end at . ! ? (a run counts once) followed by whitespace or the end; pieces without a letter
    or digit are not sentences. Abbreviations such as 'Dr. X' over-count: a known, accepted limitation."""
    return sum(1 for part in re.split(r"[.!?]+(?=\s|$)", text) if re.search(r"\w", part))


def check_sentence_count(text: str, n: int, relation: str = ">=") -> bool:
    return compare_count(count_sentences(text), n, relation)


_DIVIDER_LINE = r"(?m)^[ \t]*\*[ \t]*\*[ \t]*\*[ \t*]*$"  # a line of 3+ asterisks: '***', '* * *', '*****'


def check_divider_paragraphs(text: str, n: int) -> bool:
    """Exactly n non-empty paragraphs separated by markdown divider lines (***). An empty paragraph (e.g. a
    leading or doubled divider) fails, as in IFEval."""
    parts = [p.strip() for p in re.split(_DIVIDER_LINE, text)]
    return all(parts) and len(parts) == n


def split_blank_line_paragraphs(text: str) -> list[str]:
    """Paragraphs separated by one or more blank lines."""
    return [p.strip() for p in re.split(r"\n[ \t]*\n", text) if p.strip()]


def _first_word(text: str) -> str:
    m = re.match(r"\W*(\w+)", text)  # skip leading markup/punctuation such as '**' or '"'
    return m.group(1).casefold() if m else ""


def check_paragraphs_first_word(text: str, n: int, nth: int, first_word: str) -> bool:
    """Exactly n blank-line-separated paragraphs, and paragraph `nth` (1-based) starts with first_word
    (case-insensitive)."""
    paragraphs = split_blank_line_paragraphs(text)
    if len(paragraphs) != n or not 1 <= nth <= n:
        return False
    return _first_word(paragraphs[nth - 1]) == _first_word(first_word) != ""


def check_bullet_points(text: str, n: int) -> bool:
    """Exactly n markdown bullets: lines starting with '* ' or '- ' (divider lines like '* * *' excluded)."""
    return len(re.findall(r"(?m)^[ \t]*[*-][ \t]+(?![ \t*-]*$)\S", text)) == n


def check_highlights(text: str, n: int) -> bool:
    """At least n highlighted spans *like this* (markdown emphasis on one line; **bold** counts once)."""
    return len(re.findall(r"\*(?=\S)[^\n*]+(?<=\S)\*", text)) >= n


def check_placeholders(text: str, n: int) -> bool:
    """At least n placeholders in square brackets, e.g. [address]."""
    return sum(1 for p in re.findall(r"\[([^\[\]\n]+)\]", text) if p.strip()) >= n


def has_title(text: str) -> bool:
    """A title wrapped in double angular brackets, e.g. <<poem of joy>>."""
    return any(t.strip() for t in re.findall(r"<<([^\n<>]+)>>", text))


def is_wrapped_in_quotes(text: str) -> bool:
    """The whole response starts and ends with a double quote (straight or curly)."""
    s = text.strip()
    return len(s) >= 2 and ((s[0] == s[-1] == '"') or (s[0] == "\u201c" and s[-1] == "\u201d"))


def ends_with_phrase(text: str, phrase: str) -> bool:
    """The response ends with the phrase (case-insensitive, whitespace runs collapsed)."""
    return _collapse_ws(text).casefold().endswith(_collapse_ws(phrase).casefold())


def repeats_prompt(text: str, prompt: str) -> bool:
    """The response starts by repeating the request verbatim (case-insensitive, whitespace collapsed)."""
    return _collapse_ws(text).casefold().startswith(_collapse_ws(prompt).casefold())


def _reject_json_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def is_json(text: str) -> bool:
    """The whole response is valid JSON, optionally inside one ``` / ```json fence. NaN/Infinity are not JSON."""
    s = text.strip()
    fenced = re.fullmatch(r"```(?:json|JSON)?[ \t]*\n?(.*?)\n?[ \t]*```", s, re.DOTALL)
    if fenced:
        s = fenced.group(1).strip()
    try:
        # parse_int: we only need validity, and int() of a 100k-digit literal raises (or is slow).
        json.loads(s, parse_int=lambda _: 0, parse_constant=_reject_json_constant)
        return True
    except (ValueError, RecursionError):
        return False


def has_postscript(text: str, marker: str = "P.S.") -> bool:
    """The postscript marker appears at the start of the text or after whitespace/markdown (case-insensitive):
    'P.S.' on its own line or inline after a sentence, but not inside a word ('xP.S.') nor 'P.P.S.' for 'P.S.'."""
    return re.search(r"(?:^|(?<=[\s*_>#]))" + re.escape(marker), text, re.IGNORECASE) is not None


def check_sections(text: str, n: int, splitter: str = "Section") -> bool:
    """Exactly n section headers: lines starting with '<splitter> <number>' (case-insensitive, leading
    markdown allowed), e.g. 'SECTION 1', '## Section 2'. A mention mid-line ('see Section 2') is no header."""
    headers = re.findall(r"(?m)^[ \t#*_>]*" + re.escape(splitter) + r"[ \t]*\d+", text, re.IGNORECASE)
    return len(headers) == n


def has_two_responses(text: str) -> bool:
    """Exactly two different non-empty responses separated by six asterisks (******)."""
    parts = [_collapse_ws(p) for p in text.split("******")]
    return len(parts) == 2 and all(parts) and parts[0] != parts[1]


def has_keywords(text: str, keywords: list[str]) -> bool:
    """Every keyword appears (case-insensitive, as a whole word or phrase)."""
    return all(_word_pattern(k).search(text) for k in keywords)


def avoids_forbidden_words(text: str, forbidden_words: list[str]) -> bool:
    """None of the forbidden words appears (case-insensitive, whole words)."""
    return not any(_word_pattern(w).search(text) for w in forbidden_words)


def check_keyword_frequency(text: str, word: str, n: int, relation: str = "==") -> bool:
    """The word appears <relation> n times (whole words, case-insensitive). Default exactly: the dataset's
    prompt reads 'the word X should appear N times'; a quantifier in the ground truth overrides it."""
    return compare_count(len(_word_pattern(word).findall(text)), n, relation)


def check_letter_frequency(text: str, letter: str, n: int, relation: str = "==") -> bool:
    """The letter appears <relation> n times, case-insensitive. Default exactly (see keyword frequency)."""
    return compare_count(text.casefold().count(letter.casefold()), n, relation)


def check_capital_words(text: str, n: int, relation: str = ">=") -> bool:
    """Words written entirely in capitals ('NASA', 'I', 'OK') appear <relation> n times."""
    return compare_count(sum(1 for w in re.findall(r"\w+", text) if w.isupper()), n, relation)


def picks_one_option(text: str, options: list[str]) -> bool:
    """Exactly one of the allowed answers appears in the response (hedging with several fails)."""
    flat = _collapse_ws(text).casefold()
    return sum(1 for o in options if _collapse_ws(o).casefold() in flat) == 1


_LANGUAGE_WARNED = False


def response_language_unsupported(text: str, language: Any = None) -> bool:
    """Language identification needs a model (langdetect/fastText) this repo does not ship: score 0 and say
    so once, rather than crash a run whose data contains a few such rows."""
    global _LANGUAGE_WARNED
    if not _LANGUAGE_WARNED:
        logger.warning("ifeval validate_response_language is not supported (no language detector); scoring 0")
        _LANGUAGE_WARNED = True
    return False


# func_name -> (checker, {dataset kwarg: checker parameter}). Dataset rows carry every kwarg key with null for
# the unused ones; nulls are dropped, so a checker's default applies, and a missing required one is an error.
IFEVAL_CONSTRAINTS: dict[str, tuple[Callable[..., bool], dict[str, str]]] = {
    "validate_lowercase": (is_lowercase, {}),
    "validate_uppercase": (is_uppercase, {}),
    "validate_no_commas": (has_no_commas, {}),
    "validate_word_constraint": (check_word_count, {"N": "n", "quantifier": "relation"}),
    "verify_sentence_constraint": (check_sentence_count, {"N": "n", "quantifier": "relation"}),
    "verify_paragraph_count": (check_divider_paragraphs, {"N": "n"}),
    "validate_paragraphs": (check_paragraphs_first_word, {"N": "n", "i": "nth", "first_word": "first_word"}),
    "verify_bullet_points": (check_bullet_points, {"N": "n"}),
    "validate_highlighted_sections": (check_highlights, {"N": "n"}),
    "validate_placeholders": (check_placeholders, {"N": "n"}),
    "validate_title": (has_title, {}),
    "validate_quotation": (is_wrapped_in_quotes, {}),
    "validate_end": (ends_with_phrase, {"end_phrase": "phrase"}),
    "validate_json_format": (is_json, {}),
    "verify_postscript": (has_postscript, {"postscript_marker": "marker"}),
    "validate_sections": (check_sections, {"N": "n", "section_splitter": "splitter"}),
    "validate_repeat_prompt": (repeats_prompt, {"original_prompt": "prompt"}),
    "validate_two_responses": (has_two_responses, {}),
    "verify_keywords": (has_keywords, {"keyword_list": "keywords"}),
    "validate_forbidden_words": (avoids_forbidden_words, {"forbidden_words": "forbidden_words"}),
    "verify_keyword_frequency": (check_keyword_frequency, {"word": "word", "N": "n", "quantifier": "relation"}),
    "verify_letter_frequency": (check_letter_frequency, {"letter": "letter", "N": "n", "quantifier": "relation"}),
    "validate_frequency_capital_words": (check_capital_words, {"N": "n", "quantifier": "relation"}),
    "validate_choice": (picks_one_option, {"options": "options"}),
    "validate_response_language": (response_language_unsupported, {"language": "language"}),
}

# Checker parameter -> validator/converter, applied to ground-truth values before any text is scored.
_KWARG_PARSERS: dict[str, Callable[[Any, str], Any]] = {
    "n": _as_int,
    "nth": _as_int,
    "relation": lambda v, _: parse_relation(v),
    "phrase": _as_str,
    "prompt": _as_str,
    "marker": _as_str,
    "splitter": _as_str,
    "word": _as_str,
    "first_word": _as_str,
    "letter": _as_letter,
    "keywords": _as_str_list,
    "forbidden_words": _as_str_list,
    "options": lambda v, _: parse_options(v),
    "language": lambda v, _: v,
}


def _constraint_list(ground_truth: Any) -> list[dict]:
    """Ground truth -> list of constraint dicts. Accepts a dict, a JSON string of a dict or list, or a list
    of dicts / JSON strings."""
    if isinstance(ground_truth, str):
        try:
            ground_truth = json.loads(ground_truth)
        except ValueError:
            raise GroundTruthError(f"ifeval ground truth is not JSON: {ground_truth[:200]!r}") from None
    items = ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth]
    if not items:
        raise GroundTruthError("ifeval ground truth is an empty list")
    constraints = []
    for item in items:
        if isinstance(item, str) or isinstance(item, (list, tuple)):
            constraints.extend(_constraint_list(item))
        elif isinstance(item, dict) and "func_name" in item:
            constraints.append(item)
        else:
            raise GroundTruthError(f"ifeval constraint must be a dict with 'func_name', got {str(item)[:200]!r}")
    return constraints


@lru_cache(maxsize=None)
def _required_params(checker: Callable[..., bool]) -> frozenset:
    params = list(inspect.signature(checker).parameters.values())[1:]  # skip the text
    return frozenset(p.name for p in params if p.default is inspect.Parameter.empty)


def _bind_constraint(constraint: dict) -> tuple[Callable[..., bool], dict]:
    """(checker, kwargs) for one constraint dict; raises GroundTruthError for unknown names / missing kwargs."""
    func_name = constraint.get("func_name")
    if func_name not in IFEVAL_CONSTRAINTS:
        raise GroundTruthError(f"unknown ifeval func_name {func_name!r}; supported: {sorted(IFEVAL_CONSTRAINTS)}")
    checker, arg_map = IFEVAL_CONSTRAINTS[func_name]
    kwargs = {param: constraint[key] for key, param in arg_map.items() if constraint.get(key) is not None}
    missing = _required_params(checker) - kwargs.keys()
    if missing:
        keys = sorted(k for k, p in arg_map.items() if p in missing)
        raise GroundTruthError(f"ifeval {func_name} needs {keys}, got {str(constraint)[:300]}")
    dataset_key = {param: key for key, param in arg_map.items()}
    try:
        return checker, {p: _KWARG_PARSERS[p](v, dataset_key[p]) for p, v in kwargs.items()}
    except GroundTruthError as e:
        raise GroundTruthError(f"ifeval {func_name}: {e}") from None


@register_verifier("ifeval")
def verify_ifeval(completion: str, ground_truth: Any) -> float:
    """1.0 iff every constraint in the ground truth holds. An empty (whitespace-only) answer follows no
    instruction: it scores 0 even for 'no commas' or 'all lowercase'."""
    bound = [_bind_constraint(c) for c in _constraint_list(ground_truth)]  # validate before looking at text
    text = strip_thinking(completion)
    if not text.strip():
        return 0.0
    return 1.0 if all(checker(text, **kwargs) for checker, kwargs in bound) else 0.0


# --------------------------------------------------------------------------------------------------------
# Verifier: code (programs run in the sandbox, open_instruct/sandbox.py)
# --------------------------------------------------------------------------------------------------------
def _code_tests(ground_truth: Any, settings: Any = None) -> Any:
    """The row's tests, within the run's limits (code_verifier.check_limits; default CodeSettings)."""
    from open_instruct.code_verifier import CodeSettings, check_limits, parse_cached

    try:
        tests = parse_cached(ground_truth)
        check_limits(tests, settings or CodeSettings())
        return tests
    except ValueError as e:
        raise GroundTruthError(f"code: {e}") from None


@register_verifier("code", sandboxed=True)
def verify_code(completion: str, ground_truth: Any) -> float:
    """1.0 iff the completion's program passes every test of the ground truth (default CodeSettings; score_batch
    passes the run's settings). An empty answer scores 0 without starting a process."""
    from open_instruct.code_verifier import CodeSettings, score_programs

    _code_tests(ground_truth)  # validate before looking at the text
    text = strip_thinking(completion)
    if not text.strip():
        return 0.0
    return score_programs([text], [ground_truth], CodeSettings())[0].score("all")


def _score_code_rows(
    completions: Sequence[str], ground_truths: Sequence[Any], settings: Any
) -> tuple[list[float], collections.Counter]:
    """Scores of a batch's `code` rows, run `settings.workers` at a time, and their test statuses (logged)."""
    from open_instruct.code_verifier import count_statuses, score_programs

    for gt in ground_truths:
        _code_tests(gt, settings)  # (parsed once per row: code_verifier.parse_cached)
    texts = [strip_thinking(c) if len(c) <= MAX_COMPLETION_CHARS else "" for c in completions]  # overlong: no_code
    outcomes = score_programs(texts, ground_truths, settings)
    statuses = count_statuses(outcomes)
    for status, n in statuses.items():
        STATS[f"code_{status}"] += n
    logger.info(
        "code verifier: %d responses, %d all-pass; tests: %s",
        len(outcomes),
        sum(o.score("all") == 1.0 for o in outcomes),
        ", ".join(f"{k} {v}" for k, v in sorted(statuses.items())),
    )
    return [o.score(settings.reward) for o in outcomes], statuses


# --------------------------------------------------------------------------------------------------------
# Time limits
# --------------------------------------------------------------------------------------------------------
class _Deadline(BaseException):
    """Raised by the SIGALRM handler. BaseException so `except Exception` in math-verify/sympy can't eat it."""


_alarm_active = False


def _on_alarm(signum, frame) -> None:
    if _alarm_active:  # a late re-fire after the call finished must do nothing
        raise _Deadline()


def _signals_usable() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


def _call_with_alarm(fn: Callable[[], float], timeout: float) -> tuple[Optional[float], bool]:
    """(fn(), False), or (None, True) if it ran past `timeout` seconds. Main thread only."""
    global _alarm_active
    start = time.monotonic()
    outer_delay, outer_interval = signal.setitimer(signal.ITIMER_REAL, 0)  # pause any outer timer
    old_handler = signal.signal(signal.SIGALRM, _on_alarm)
    try:
        try:
            _alarm_active = True
            signal.setitimer(signal.ITIMER_REAL, min(timeout, outer_delay or timeout), _REFIRE_SECONDS)
            return fn(), False
        except _Deadline:
            return None, True
        finally:
            _alarm_active = False  # first: from here on the handler is a no-op
            signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        signal.signal(signal.SIGALRM, old_handler if old_handler is not None else signal.SIG_DFL)
        if outer_delay > 0:  # give the outer timer back what is left of its time (fire now if none)
            left = outer_delay - (time.monotonic() - start)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-6), outer_interval)


class _Worker:
    """A child process running verifiers in its own main thread, so SIGALRM works even when the caller is
    a worker thread; killed and replaced if it stops answering (stuck in C code)."""

    def __init__(self) -> None:
        repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (repo_root, os.environ.get("PYTHONPATH")) if p))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "open_instruct.rewards", "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            bufsize=0,
        )
        os.set_blocking(self.proc.stdin.fileno(), False)  # a stuck child must not block a large write
        self._buffer = b""
        ready = self._read_line(_WORKER_START_TIMEOUT)
        if ready != b"ready":
            self.kill()
            raise RuntimeError(f"rewards worker failed to start (got {ready!r})")

    def _read_line(self, timeout: float) -> Optional[bytes]:
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # the child died
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def _write_all(self, data: bytes, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        fd = self.proc.stdin.fileno()
        view = memoryview(data)
        while view:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [fd], [], left)[1]:
                return False
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                continue
            except OSError:  # the child died
                return False
        return True

    def call(self, name: str, completion: str, ground_truth: Any, timeout: float) -> tuple[Optional[float], bool]:
        """(score, timed_out); a child that is stuck or dead counts as a timeout and is killed."""
        start = time.monotonic()
        request = {"name": name, "completion": completion, "ground_truth": ground_truth, "timeout": timeout}
        line = None
        if self._write_all(json.dumps(request, default=str).encode() + b"\n", timeout):
            line = self._read_line(timeout - (time.monotonic() - start))
        if line is None:
            self.kill()
            return None, True
        reply = json.loads(line)
        if reply.get("error"):
            raise GroundTruthError(reply["error"])
        return reply["score"], reply["timed_out"]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            stream.close()


_thread_workers = threading.local()
_all_workers: list[_Worker] = []


def _worker_for_this_thread() -> _Worker:
    worker = getattr(_thread_workers, "worker", None)
    if worker is None or not worker.alive():
        _all_workers[:] = [w for w in _all_workers if w.alive()]
        worker = _thread_workers.worker = _Worker()
        _all_workers.append(worker)
    return worker


def _kill_all_workers() -> None:
    for worker in _all_workers:
        try:
            worker.kill()
        except Exception:
            pass


atexit.register(_kill_all_workers)


def _worker_main() -> None:
    """Child side of _Worker: JSON lines in on stdin, JSON lines out on the original stdout."""
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # stray prints from libraries go to stderr, not into the protocol
    _load_math_verify()
    out.write(b"ready\n")
    for line in sys.stdin.buffer:
        request = json.loads(line)
        # Answer a little before the parent's deadline so a timeout normally costs no restart.
        budget = max(0.01, request["timeout"] - min(0.1, request["timeout"] / 4))
        try:
            score, timed_out = _run_inline(request["name"], request["completion"], request["ground_truth"], budget)
            reply = {"score": score, "timed_out": timed_out}
        except GroundTruthError as e:
            reply = {"error": str(e)}
        out.write(json.dumps(reply).encode() + b"\n")


# --------------------------------------------------------------------------------------------------------
# Scoring API
# --------------------------------------------------------------------------------------------------------
def _checked_score(value: Any, name: str) -> float:
    score = float(value)
    if not 0.0 <= score <= 1.0:  # also rejects NaN
        logger.error("verifier %s returned %r, outside [0, 1]; scoring 0", name, value)
        STATS["errors"] += 1
        return 0.0
    return score


def _run_inline(name: str, completion: str, ground_truth: Any, timeout: float) -> tuple[float, bool]:
    """Run verifier `name` in this process under the strongest limit available here."""
    fn = VERIFIERS[name]
    if name in _USES_SYMPY:
        _load_math_verify()  # outside the timer
    start = time.monotonic()
    try:
        if _signals_usable():
            value, timed_out = _call_with_alarm(lambda: fn(completion, ground_truth), timeout)
        else:
            value, timed_out = fn(completion, ground_truth), False
    except _Deadline:  # a re-fire that landed during cleanup
        value, timed_out = None, True
    except GroundTruthError:  # a data/config problem: report it, don't score it
        raise
    except Exception:
        logger.exception("verifier %s raised on a completion; scoring 0", name)
        STATS["errors"] += 1
        return 0.0, False
    if timed_out or time.monotonic() - start > timeout:  # an overrun that could not be pre-empted counts too
        return 0.0, True
    return _checked_score(value, name), False


def run_verifier(
    verifier_name: Union[str, Sequence[str]], completion: str, ground_truth: Any, *, timeout: float = 2.0
) -> tuple[float, bool]:
    """(score in [0, 1], timed_out) for one completion, returning within `timeout` seconds (see module
    docstring). Raises ValueError for an unknown verifier or a malformed ground truth."""
    name = normalize_verifier_name(verifier_name)
    if not timeout or timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    if not isinstance(completion, str):
        raise ValueError(f"completion must be a string, got {type(completion).__name__}")
    STATS["calls"] += 1
    if len(completion) > MAX_COMPLETION_CHARS:
        return 0.0, False
    if name in _BATCHED:  # in the sandbox, under `timeout` seconds of CPU time
        score, timed_out = _BATCHED[name]([completion], [ground_truth], timeout)[0]
        score = _checked_score(score, name)
    elif name in _SANDBOXED:  # bounded by the sandbox's limits, not by a timer in this process
        score, timed_out = _checked_score(VERIFIERS[name](completion, ground_truth), name), False
    elif name in _USES_SYMPY and not _signals_usable() and hasattr(signal, "setitimer"):
        score, timed_out = _worker_for_this_thread().call(name, completion, ground_truth, timeout)
        score = 0.0 if timed_out or score is None else _checked_score(score, name)
    else:
        score, timed_out = _run_inline(name, completion, ground_truth, timeout)
    if timed_out:
        STATS["timeouts"] += 1
    return score, timed_out


def score_completion(
    completion: str,
    ground_truth: Any,
    verifier_name: Union[str, Sequence[str]],
    *,
    verification_reward: float = 10.0,
    timeout: float = 2.0,
) -> tuple[float, bool]:
    """(reward, correct): reward = verification_reward if the verifier scores 1.0 else 0.0. A timeout scores
    0 (and counts in STATS["timeouts"])."""
    score, _ = run_verifier(verifier_name, completion, ground_truth, timeout=timeout)
    correct = score >= 1.0
    return (float(verification_reward) if correct else 0.0), correct


class BatchScores(NamedTuple):
    rewards: list[float]  # verification_reward or 0.0 per completion (code, fraction: verification_reward * fraction)
    correct: list[bool]
    num_timeouts: int
    seconds: float  # wall time spent verifying the batch
    code_statuses: Optional[dict] = None  # `code` rows: tests per status ("pass", "wrong_answer", "timeout", ...)
    # reward functions: each one's values per completion, by its label (reward_function_labels); None: not applicable
    function_values: Optional[dict] = None


def score_batch(
    completions: Sequence[str],
    ground_truths: Sequence[Any],
    verifier_names: Union[str, Sequence[Any]],
    *,
    verification_reward: float = 10.0,
    timeout: float = 2.0,
    code: Any = None,
) -> BatchScores:
    """score_completion over a batch. `verifier_names` is one name for all rows or one per row (the dataset's
    `dataset`/`verifier` column). Sequential: each call is bounded by `timeout`; except the `code` rows, all run
    together in the sandbox pool under `code` (a code_verifier.CodeSettings; default CodeSettings())."""
    if isinstance(verifier_names, str):
        verifier_names = [verifier_names] * len(completions)
    if not len(completions) == len(ground_truths) == len(verifier_names):
        raise ValueError(
            f"batch length mismatch: {len(completions)} completions, {len(ground_truths)} ground truths, "
            f"{len(verifier_names)} verifier names"
        )
    start = time.monotonic()
    rewards, correct, num_timeouts, code_statuses = [], [], 0, None
    names = [None if n is None else normalize_verifier_name(n) for n in verifier_names]  # None: no verifier
    code_rows = [i for i, n in enumerate(names) if n == "code"]
    code_scores: dict[int, float] = {}
    batched: dict[int, tuple[float, bool]] = {}
    for name in {n for n in names if n in _BATCHED}:  # a sandboxed integration: all its rows in one go
        rows = [i for i, n in enumerate(names) if n == name and len(completions[i]) <= MAX_COMPLETION_CHARS]
        STATS["calls"] += len(rows)
        scored = _BATCHED[name]([completions[i] for i in rows], [ground_truths[i] for i in rows], timeout, code)
        batched.update(zip(rows, scored))
    if code_rows:
        from open_instruct.code_verifier import CodeSettings

        settings = code or CodeSettings()
        scores, code_statuses = _score_code_rows(
            [completions[i] for i in code_rows], [ground_truths[i] for i in code_rows], settings
        )
        STATS["calls"] += len(code_rows)
        code_scores = dict(zip(code_rows, scores))
    for i, (completion, gt, name) in enumerate(zip(completions, ground_truths, names)):
        if i in code_scores:  # fraction mode: partial credit, scaled like the binary reward
            score = code_scores[i]
            correct.append(score >= 1.0)
            rewards.append(float(verification_reward) * score)
            continue
        if name is None:  # a row scored by reward functions alone (rollouts.score_texts adds them)
            correct.append(False)
            rewards.append(0.0)
            continue
        if name in _BATCHED:  # scored above (an overlong completion: 0, unread)
            score, timed_out = batched.get(i, (0.0, False))
            score = _checked_score(score, name)
            STATS["timeouts"] += timed_out
        else:
            score, timed_out = run_verifier(name, completion, gt, timeout=timeout)
        num_timeouts += timed_out
        correct.append(score >= 1.0)
        rewards.append(float(verification_reward) if score >= 1.0 else 0.0)
    statuses = dict(code_statuses) if code_statuses is not None else None
    return BatchScores(rewards, correct, num_timeouts, time.monotonic() - start, statuses)


def combine_rewards(
    verifiable: float,
    stopped: bool,
    non_stop_penalty: float,
    rm_score: Optional[float] = None,
    rm_multiplier: float = 0.0,
    non_stop_penalty_mode: str = "add",
) -> float:
    """Total RL reward of one completion:

        reward = verifiable + rm_multiplier * rm_score          (rm term omitted when rm_score is None)
        not stopped, mode add:      reward + non_stop_penalty
        not stopped, mode replace:  non_stop_penalty            (Tulu 3: where(stopped, score, penalty))

    `stopped` means the completion ended with EOS/stop string rather than hitting the length limit.
    non_stop_penalty is signed, as in the recipes (Tulu 3: -10)."""
    if non_stop_penalty_mode not in ("add", "replace"):
        raise ValueError(f"non_stop_penalty_mode must be add or replace, got {non_stop_penalty_mode!r}")
    if not stopped and non_stop_penalty_mode == "replace":
        return float(non_stop_penalty)
    reward = float(verifiable)
    if rm_score is not None:
        reward += rm_multiplier * float(rm_score)
    if not stopped:
        reward += non_stop_penalty
    return reward


# --------------------------------------------------------------------------------------------------------
# Custom reward functions (`reward_functions: [module:function, ...]`)
# --------------------------------------------------------------------------------------------------------
# The keyword arguments every custom reward function receives, one list entry per completion: TRL's reward_funcs
# convention: prompts (as the row gives them: a string, or the messages), completions (strings, or for a
# conversational prompt [{"role": "assistant", "content": text}] each), completion_ids, then every column of the row
# by its name (ground_truth and dataset among them; columns named like these three or prompt/completion excepted).
REWARD_FUNCTION_ARGS = ("prompts", "completions", "completion_ids")
_NOT_COLUMNS = ("prompt", "completion", *REWARD_FUNCTION_ARGS)


def _check_signature(fn: Callable[..., Any], spec: str) -> None:
    """What can be told without the data: a plain (not async) function whose required arguments can be passed by
    name. Whether the data has the columns it requires is checked on real rows (probe_reward_functions)."""
    from open_instruct.errors import ConfigError

    if inspect.iscoroutinefunction(fn):
        raise ConfigError(f"reward function {spec!r} is async; give a plain function")
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return  # a builtin without a readable signature: its first call tells
    positional = [p.name for p in params if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if positional:
        raise ConfigError(
            f"reward function {spec!r} requires {positional} by position; it is called with keyword arguments only "
            "(TRL's reward_funcs convention), e.g. def my_reward(completions, ground_truth, **kwargs) -> list[float]"
        )


@lru_cache(maxsize=None)
def load_reward_function(spec: str) -> Callable[..., Any]:
    """The function a `module:function` spec names: `my_pkg.rewards:fn` (importable, or my_pkg/rewards.py under the
    current folder) or `path/to/file.py:fn`. ConfigError when the spec, the import or the signature is wrong, so
    a run stops before any model loads (preflight)."""
    from open_instruct.errors import ConfigError
    from open_instruct.user_code import load_object

    fn = load_object(spec, "reward function", "my_rewards:length")
    if not callable(fn):
        raise ConfigError(f"reward function {spec!r} is a {type(fn).__name__}, not a function")
    _check_signature(fn, spec)
    return fn


def run_hooks(specs: Sequence[str]) -> list[Any]:
    """The classes of the reward functions among `specs` that set something up with the run (a model served on
    engines the run starts, or on the run's own), one per class: `check_run(cfg)` before anything starts (preflight)
    and `start_run(cfg, generator, accelerator)` once the generator is up (collective; returns what to close at the
    end). A plain function has neither."""
    hooks: list[Any] = []
    for spec in specs:
        owner = type(load_reward_function(spec))
        if hasattr(owner, "start_run") and owner not in hooks:
            hooks.append(owner)
    return hooks


def reward_function_inputs(
    examples: Sequence[dict], texts: Sequence[str], completion_ids: Sequence[Sequence[int]]
) -> dict[str, list[Any]]:
    """TRL's reward_funcs keyword arguments for a batch: prompts and completions in TRL's shape, completion_ids,
    and every column of the rows (a column missing from a row is None there). Rows without `columns` (a run
    without reward functions) give ground_truth and dataset (the verifier name) only."""
    prompts = [e.get("prompt") for e in examples]
    completions = [[{"role": "assistant", "content": t}] if isinstance(p, list) else t for p, t in zip(prompts, texts)]
    inputs: dict[str, list[Any]] = {
        "prompts": prompts,
        "completions": completions,
        "completion_ids": [list(ids) for ids in completion_ids],
    }
    names = dict.fromkeys(k for e in examples for k in e.get("columns", {}) if k not in _NOT_COLUMNS)
    for name in names:
        inputs[name] = [e.get("columns", {}).get(name) for e in examples]
    inputs.setdefault("ground_truth", [e.get("ground_truth") for e in examples])
    inputs.setdefault("dataset", [e.get("verifier") for e in examples])
    return inputs


def _accepted(fn: Callable[..., Any], inputs: dict[str, list[Any]], spec: str) -> dict[str, list[Any]]:
    """The inputs `fn` takes: all of them with **kwargs, else those it names. ConfigError when it requires one the
    rows do not have."""
    from open_instruct.errors import ConfigError

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return inputs
    named = [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    missing = [p.name for p in named if p.default is p.empty and p.name not in inputs]  # with **kwargs too
    if missing:
        raise ConfigError(_missing_columns_message(spec, missing, inputs))
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return inputs
    return {k: v for k, v in inputs.items() if k in {p.name for p in named}}


# ---------------------------------------------------------------------------------------------------------------------
# The user's code under a deadline: reward functions here, environments' reset/step (environments.py)


_GUARD_TASKS: Any = None  # queue of (fn, box, done) for the guard threads
_GUARD_IDLE = [0]  # guard threads waiting for a task
_GUARD_LOCK = threading.Lock()


def _guard_worker() -> None:
    while True:
        fn, box, done = _GUARD_TASKS.get()
        try:
            box["result"] = fn()
        except Exception as e:
            box["result"] = e
        done.set()
        with _GUARD_LOCK:
            _GUARD_IDLE[0] += 1


def call_with_deadline(fn: Callable[[], Any], deadline_s: float) -> tuple[bool, Any]:
    """(finished, result) of fn() on a long-lived daemon thread (reused, so per-thread resources such as the math
    verifier's worker process are too), waiting at most deadline_s; an exception inside fn is the result. A call
    past its deadline is abandoned (its caller stops the run; a daemon thread does not hold the process at exit)."""
    global _GUARD_TASKS
    box: dict[str, Any] = {}
    done = threading.Event()
    with _GUARD_LOCK:
        if _GUARD_TASKS is None:
            import queue

            _GUARD_TASKS = queue.SimpleQueue()
        if _GUARD_IDLE[0] > 0:
            _GUARD_IDLE[0] -= 1
        else:
            threading.Thread(target=_guard_worker, daemon=True, name="user-code").start()
    _GUARD_TASKS.put((fn, box, done))
    if not done.wait(deadline_s):
        return False, None
    return True, box["result"]


def _missing_columns_message(spec: str, missing: list[str], inputs: dict[str, list[Any]]) -> str:
    return (
        f"reward function {spec!r} requires {missing}, which is never passed: it gets prompts, completions, "
        f"completion_ids and the rows' columns {sorted(set(inputs) - set(REWARD_FUNCTION_ARGS))}"
    )


def call_reward_function(
    spec: str, inputs: dict[str, list[Any]], where: Sequence[str], timeout: float
) -> list[Optional[float]]:
    """One reward function on a batch, within `timeout` seconds: its list of float-or-None per completion. A call
    that raises, does not return in time, or returns the wrong number of values or a non-finite / non-numeric one
    is a ConfigError naming the function and the row (`where`: each completion's row)."""
    from open_instruct.errors import ConfigError

    fn = load_reward_function(spec)
    kwargs = _accepted(fn, inputs, spec)
    n = len(inputs["completions"])
    rows = where[0] if n == 1 else f"a batch of {n} rows from {where[0]}"
    finished, values = call_with_deadline(lambda: fn(**kwargs), timeout)
    if not finished:
        raise ConfigError(
            f"reward function {spec!r} did not return within {timeout:g} s (reward_function_timeout) on {rows}"
        )
    if isinstance(values, KeyError) and values.args and isinstance(values.args[0], str):  # kwargs["a_column"]
        if values.args[0] not in inputs:
            raise ConfigError(f"{_missing_columns_message(spec, [values.args[0]], inputs)} (KeyError on {rows})")
    if isinstance(values, Exception):
        raise ConfigError(f"reward function {spec!r} raised {type(values).__name__}: {values} on {rows}")
    listed = isinstance(values, (list, tuple)) or (hasattr(values, "tolist") and getattr(values, "ndim", 0) == 1)
    values = values.tolist() if listed and hasattr(values, "tolist") else values  # numpy / torch vectors too
    if not listed or len(values) != n:
        got = f"{len(values)} values" if listed else type(values).__name__
        raise ConfigError(
            f"reward function {spec!r} must return a list of {n} rewards (one per completion): {got} on {rows}"
        )
    for j, v in enumerate(values):
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v)):
            raise ConfigError(
                f"reward function {spec!r} returned {v!r} for completion {j}: not a finite number ({where[j]})"
            )
    return values


def reward_function_labels(specs: Sequence[str]) -> list[str]:
    """Each reward function's name in the logs (`reward/<label>/mean`): its function name, or the whole spec when
    two specs name functions alike."""
    names = [spec.rsplit(":", 1)[-1] for spec in specs]
    return [name if names.count(name) == 1 else spec for name, spec in zip(names, specs)]


class FunctionValues(dict):
    """Each reward function's values per completion, by label; `counters`: per label, the counts a function reported
    with its values (a list with a `counters` dict, e.g. a grader's calls, cache hits and parse failures), logged as
    `reward/<label>/<counter>` summed over ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.counters: dict[str, dict[str, float]] = {}


def custom_reward_values(
    specs: Sequence[str],
    weights: Optional[Sequence[float]],
    inputs: dict[str, list[Any]],
    where: Optional[Sequence[str]] = None,
    timeout: float = 60.0,
) -> tuple[list[float], dict[str, list[Optional[float]]]]:
    """Sum over the custom reward functions of weight x value, per completion, and each function's own values (by
    reward_function_labels, unweighted, as TRL logs them):

        extra_j = sum_i w_i * f_i(...)[j]            (a None from f_i, "not applicable here", counts 0)

    `inputs`: reward_function_inputs of the batch; `where`: each completion's row, for messages."""
    n = len(inputs["completions"])
    where = list(where) if where is not None else [f"completion {j}" for j in range(n)]
    total = [0.0] * n
    values = FunctionValues()
    for i, (spec, label) in enumerate(zip(specs, reward_function_labels(specs))):
        weight = 1.0 if weights is None else float(weights[i])
        returned = call_reward_function(spec, inputs, where, timeout)
        counters = getattr(returned, "counters", None)  # e.g. a model grader's
        if isinstance(counters, dict):
            values.counters[label] = {str(k): float(v) for k, v in counters.items()}
        values[label] = [None if v is None else float(v) for v in returned]
        for j, v in enumerate(values[label]):
            if v is not None:
                total[j] += weight * v
    return total, values


def custom_rewards(*args: Any, **kwargs: Any) -> list[float]:
    """custom_reward_values' weighted sum alone (same arguments)."""
    return custom_reward_values(*args, **kwargs)[0]


def reward_function_sums(values: dict[str, list[Optional[float]]]) -> dict[str, float]:
    """Per reward function: the sum, sum of squares and count of its values that are not None, to be summed over
    ranks (reward_function_metrics reads them)."""
    sums: dict[str, float] = {}
    for label, vs in values.items():
        real = [v for v in vs if v is not None]
        sums.update({f"reward/{label}/sum": sum(real), f"reward/{label}/sumsq": sum(v * v for v in real)})
        sums[f"reward/{label}/count"] = float(len(real))
    for label, counters in getattr(values, "counters", {}).items():
        sums.update({f"reward/{label}/{name}": value for name, value in counters.items()})
    return sums


def reward_function_metrics(sums: dict[str, float]) -> dict[str, float]:
    """`reward/<label>/mean` and `reward/<label>/std` (population std) of each reward function's values over the
    completions it scored (None excluded, TRL's nanmean), from reward_function_sums summed over ranks, and the
    counters a function reported (`reward/<label>/<counter>`, the sum over ranks)."""
    metrics: dict[str, float] = {}
    for key in sums:
        if key.startswith("reward/") and not key.endswith(("/sum", "/sumsq", "/count")):  # a function's counter
            metrics[key] = sums[key]
        if key.startswith("reward/") and key.endswith("/count"):
            label = key[len("reward/") : -len("/count")]
            count = sums[key]
            if count:
                mean = sums[f"reward/{label}/sum"] / count
                variance = max(sums[f"reward/{label}/sumsq"] / count - mean**2, 0.0)
                metrics.update({f"reward/{label}/mean": mean, f"reward/{label}/std": variance**0.5})
    return metrics


def columns_used(specs: Sequence[str], columns: dict[str, Any]) -> dict[str, Any]:
    """The row's columns the reward functions take (all of them for a function with **kwargs), as JSON values: what
    samples.jsonl shows next to a completion."""
    from open_instruct.errors import ConfigError

    row = {name: [value] for name, value in columns.items() if name not in _NOT_COLUMNS}
    inputs = {**{name: [None] for name in REWARD_FUNCTION_ARGS}, **row}
    used: dict[str, Any] = {}
    for spec in specs:
        try:
            taken = _accepted(load_reward_function(spec), inputs, spec)
        except ConfigError:  # a column this row lacks: the function's own call says so
            continue
        used.update({name: values[0] for name, values in taken.items() if name in row})
    return json.loads(json.dumps(used, default=str))  # a value JSON cannot hold (a date) as its text


PROBE_ROWS = 4  # rows each reward function is tried on before any model loads


def probe_line(specs: Sequence[str], num_rows: int) -> str:
    """The console line that announces the probe, so that a function's first call (empty completions) is no surprise."""
    rows = min(PROBE_ROWS, num_rows)
    return (
        f"reward functions: probing {', '.join(reward_function_labels(specs))} once before any model loads, on the "
        f"first {rows} training rows with {rows} empty completions (a model can answer with nothing)"
    )


def probe_reward_functions(specs: Sequence[str], examples: Sequence[dict], timeout: float) -> None:
    """Call each reward function once on the first training rows, an empty completion standing in for the model's
    (a model can answer with nothing; the function must score it), before any model loads: a function that raises,
    hangs, returns the wrong length or NaN/inf fails now, naming itself and the row (a failing batch is retried row
    by row to find it). A function with `check_columns(columns, where)` (a judge: its rubric's slots) is first
    asked whether the rows' columns are those it reads. A function whose model starts with the run
    (`starts_with_run`: a grader served by vLLM engines the run starts, or the run's own) is not called: its
    arguments were checked when it was built."""
    from open_instruct.errors import ConfigError

    rows = list(examples[:PROBE_ROWS])
    for spec in specs:
        fn = load_reward_function(spec)
        check_columns = getattr(fn, "check_columns", None)  # the columns it reads (a judge's rubric slots)
        if check_columns is not None and rows:
            check_columns(list(rows[0].get("columns", {})), rows[0].get("where", f"row {rows[0].get('row')}"))
        if getattr(fn, "starts_with_run", False):
            continue
        try:
            call_reward_function(spec, reward_function_inputs(rows, [""] * len(rows), [[]] * len(rows)),
                                 [e.get("where", f"row {e.get('row')}") for e in rows], timeout)  # fmt: skip
        except ConfigError as batch_error:
            error = batch_error
            if "did not return within" not in str(error):  # which row: each alone (a hang is not retried)
                for e in rows:
                    try:
                        call_reward_function(
                            spec, reward_function_inputs([e], [""], [[]]), [e.get("where", "")], timeout
                        )
                    except ConfigError as row_error:
                        error = row_error
                        break
            raise ConfigError(f"{error} (probe call before loading, an empty completion)") from None


def check_verifiers(examples: list[dict], what: str, code: Any = None) -> None:
    """Every row's verifier must exist and accept the row's ground truth, checked before any model loads.

    Ground truths are checked by scoring an empty completion (verifiers validate the ground truth first), except for
    `math`, whose check would start sympy for every row (a bad math ground truth is reported when first scored), and
    `code`, checked against the run's code settings `code` (a code_verifier.CodeSettings; default CodeSettings())."""
    from open_instruct.errors import DataError

    names: dict[str, str] = {}
    examples = [ex for ex in examples if ex["verifier"] is not None]  # rows scored by reward functions alone
    for ex in examples:
        try:
            if ex["verifier"] not in names:
                names[ex["verifier"]] = normalize_verifier_name(ex["verifier"])
            name = names[ex["verifier"]]
            if name == "code":
                _code_tests(ex["ground_truth"], code)
            elif name in _GROUND_TRUTH_CHECKS:
                _GROUND_TRUTH_CHECKS[name](ex["ground_truth"])
            elif name != "math":
                VERIFIERS[name]("", ex["ground_truth"])
        except ValueError as e:  # unknown verifier, or GroundTruthError
            where = ex.get("where") or f"{what} row {ex['row']}"
            raise DataError(f"{where}: {e}") from None
    sandboxed = sorted({names[ex["verifier"]] for ex in examples} & _SANDBOXED)
    if sandboxed:
        from open_instruct.errors import ConfigError
        from open_instruct.sandbox import isolation

        try:
            isolation()  # probed now (~0.3 s) so that a machine that cannot run programs fails before training
        except RuntimeError as e:
            used = ", ".join(sandboxed)
            raise ConfigError(f"{what} rows use the {used} verifier (run in the sandbox), but: {e}") from None


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:  # as the imported module: the integrations register their verifiers in its table
        importlib.import_module("open_instruct.rewards")._worker_main()
    elif len(sys.argv) == 4:  # quick manual check: python -m open_instruct.rewards math '\boxed{2}' '2'
        print(run_verifier(sys.argv[1], sys.argv[2], sys.argv[3]))
    else:
        print("usage: python -m open_instruct.rewards VERIFIER COMPLETION GROUND_TRUTH", file=sys.stderr)
        sys.exit(2)
