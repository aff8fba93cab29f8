"""LLM-as-judge rewards: a judge model scores each completion against a rubric, as one of the run's reward functions.

    # my_judge.py
    from open_instruct.judge import Judge
    helpful = Judge(url="http://127.0.0.1:8000/v1", model="Qwen/Qwen3-8B", template=open("rubric.txt").read())

    --reward_functions my_judge.py:helpful --reward_function_weights 0.5     (with the rows' verifiers, or alone)

A `Judge` is a reward function in TRL's shape (rewards.py): called once per batch with the prompts, completions
and the rows' columns, it returns one value per completion in [0, 1] (None where the judge gave no usable score:
that completion gets 0 from it and is left out of `reward/<label>/mean`). Backends: any OpenAI-compatible
`/chat/completions` endpoint (`url`, `model`; the key from the environment variable `api_key_env` if set), or a
local Hugging Face folder (`local_model`), loaded on first use in the trainer's process and run greedily.

Each completion's judge prompt is `template` with `{prompt}`, `{completion}` and `{reference}` replaced (literal
replacement: braces elsewhere in a rubric are kept); `{reference}` is the row's `reference_column` (default
`ground_truth`). The reply's score is the last match of `score_pattern` (group 1, a number), mapped from
`score_range` onto [0, 1]; a reply with no match or a number outside the range is a parse failure.

Limits and failures, counted per call in the values' `counters` and logged as `reward/<label>/<counter>` (summed over
ranks; rewards.reward_function_sums): `calls` (completions judged), `cache_hits`, `parse_failures`, `timeouts`
(requests unanswered when the call's `timeout` ran out, or whose every retry failed), `retries`, `seconds` (the
judge's wall time in this step, also part of the step's `scoring` time). Requests run `batch_size` at a time; a
failed request (connection refused, HTTP 429 or 5xx, a reply without a message) is retried up to `retries` times
within the deadline. A call where more than `max_parse_failure_rate` of the replies fail to parse raises (the run
stops naming the judge and one reply): a rubric or pattern that does not fit the judge is not a reward of 0.

Replies are cached by (the judge's identity: backend, url, model, folder, temperature, max_new_tokens) and the whole
judge prompt, in memory and, with `cache_path`, in a JSON-lines file that a resumed run reads back, so a resume asks
the judge nothing it already answered and gets the same scores.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Sequence

from open_instruct.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_PATTERN = r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)"
PLACEHOLDERS = ("{prompt}", "{completion}", "{reference}")
COUNTERS = ("calls", "cache_hits", "parse_failures", "timeouts", "retries", "seconds")
_RETRY_STATUS = {429, 500, 502, 503, 504}


class JudgeValues(list):
    """A judge call's values (one per completion, None: no usable score) with its `counters` for the logs."""

    def __init__(self, values: Sequence[Optional[float]], counters: dict[str, float]) -> None:
        super().__init__(values)
        self.counters = counters


def _text(value: Any) -> str:
    """A prompt or completion as text: strings as they are, message lists as `role: content` lines."""
    if isinstance(value, list):
        return "\n".join(
            f"{m.get('role', '')}: {m.get('content', '')}" if isinstance(m, dict) else str(m) for m in value
        )
    return "" if value is None else str(value)


class Judge:
    """A judge model as a reward function (module docstring)."""

    def __init__(
        self,
        template: str,
        *,
        url: Optional[str] = None,
        model: Optional[str] = None,
        local_model: Optional[str] = None,
        score_pattern: str = DEFAULT_PATTERN,
        score_range: tuple[float, float] = (0.0, 10.0),
        reference_column: str = "ground_truth",
        batch_size: int = 8,
        timeout: float = 60.0,
        retries: int = 2,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        api_key_env: Optional[str] = None,
        cache_path: Optional[str] = None,
        max_parse_failure_rate: float = 0.5,
    ) -> None:
        if (url is None) == (local_model is None):
            raise ConfigError(
                "Judge: give exactly one of url= (an OpenAI-compatible endpoint) and local_model= (a folder)"
            )
        if url is not None and not model:
            raise ConfigError(f"Judge: url {url!r} needs model= (the judge model's name at that endpoint)")
        if "{completion}" not in template:
            raise ConfigError(f"Judge: the template must contain {{completion}} (placeholders: {PLACEHOLDERS})")
        lo, hi = (float(x) for x in score_range)
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise ConfigError(f"Judge: score_range {score_range!r} must be two finite numbers, low < high")
        try:
            self.pattern = re.compile(score_pattern)
        except re.error as e:
            raise ConfigError(f"Judge: score_pattern {score_pattern!r} is not a regular expression: {e}") from None
        if self.pattern.groups < 1:
            raise ConfigError(f"Judge: score_pattern {score_pattern!r} needs a group around the number")
        for name, value, low in (
            ("batch_size", batch_size, 1),
            ("retries", retries, 0),
            ("max_new_tokens", max_new_tokens, 1),
        ):
            if not isinstance(value, int) or value < low:
                raise ConfigError(f"Judge: {name} must be an integer >= {low}, got {value!r}")
        if not timeout > 0 or not 0.0 <= max_parse_failure_rate <= 1.0:
            raise ConfigError("Judge: timeout must be > 0 and max_parse_failure_rate in [0, 1]")
        self.template, self.url, self.model, self.local_model = template, url, model, local_model
        self.score_range, self.reference_column = (lo, hi), reference_column
        self.batch_size, self.timeout, self.retries = batch_size, float(timeout), retries
        self.max_new_tokens, self.temperature = max_new_tokens, float(temperature)
        self.api_key_env, self.cache_path = api_key_env, cache_path
        self.max_parse_failure_rate = max_parse_failure_rate
        self.identity = json.dumps(
            [url.rstrip("/") if url else None, model, os.path.abspath(local_model) if local_model else None,
             self.temperature, max_new_tokens], sort_keys=True
        )  # fmt: skip
        self._cache: dict[str, str] = {}
        self._lock = threading.Lock()
        self._local: Optional[tuple[Any, Any]] = None
        if cache_path and os.path.exists(cache_path):
            with open(cache_path) as f:
                for line in f:
                    if line.strip():
                        record = json.loads(line)
                        self._cache[record["key"]] = record["reply"]

    # ---- the reward function --------------------------------------------------------------------------------
    def __call__(self, prompts: list, completions: list, **columns: Any) -> JudgeValues:
        start = time.monotonic()
        deadline = start + self.timeout
        references = columns.get(self.reference_column) or [None] * len(completions)
        texts = [self.render(p, c, r) for p, c, r in zip(prompts, completions, references)]
        counters = dict.fromkeys(COUNTERS, 0.0)
        counters["calls"] = float(len(texts))
        keys = [self.cache_key(t) for t in texts]
        replies: list[Optional[str]] = [self._cache.get(k) for k in keys]
        counters["cache_hits"] = float(sum(r is not None for r in replies))
        todo = [j for j, r in enumerate(replies) if r is None]
        asked = self._ask_local(texts, todo, deadline) if self.local_model else self._ask_url(texts, todo, deadline)
        for j, (reply, retried) in asked.items():
            counters["retries"] += retried
            replies[j] = reply
            if reply is not None:
                self._remember(keys[j], reply)
        values: list[Optional[float]] = []
        bad_replies = []
        for j, reply in enumerate(replies):
            if reply is None:
                counters["timeouts"] += 1
                values.append(None)
                continue
            value = self.parse(reply)
            if value is None:
                counters["parse_failures"] += 1
                bad_replies.append(reply)
            values.append(value)
        counters["seconds"] = time.monotonic() - start
        answered = len(texts) - counters["timeouts"]
        if bad_replies:
            logger.warning("judge: %d of %d replies had no score (%s); e.g. %r", len(bad_replies), answered,
                           self.pattern.pattern, bad_replies[0][:300])  # fmt: skip
        if answered and len(bad_replies) > self.max_parse_failure_rate * answered:
            raise ValueError(
                f"{len(bad_replies)} of {int(answered)} judge replies have no score matching {self.pattern.pattern!r} "
                f"in {self.score_range} (max_parse_failure_rate {self.max_parse_failure_rate}); e.g. "
                f"{bad_replies[0][:300]!r}: fix the rubric or score_pattern"
            )
        return JudgeValues(values, counters)

    def render(self, prompt: Any, completion: Any, reference: Any) -> str:
        if isinstance(completion, list):  # TRL's conversational shape: [{"role": "assistant", "content": ...}]
            completion = completion[-1].get("content", "") if completion else ""
        text = self.template
        for placeholder, value in zip(PLACEHOLDERS, (_text(prompt), _text(completion), _text(reference))):
            text = text.replace(placeholder, value)
        return text

    def cache_key(self, text: str) -> str:
        return hashlib.sha256(json.dumps([self.identity, text]).encode()).hexdigest()

    def parse(self, reply: str) -> Optional[float]:
        """The reply's last score mapped onto [0, 1]; None when there is none or it is outside score_range."""
        matches = list(self.pattern.finditer(reply))
        if not matches:
            return None
        try:
            score = float(matches[-1].group(1))
        except (TypeError, ValueError):
            return None
        lo, hi = self.score_range
        if not (math.isfinite(score) and lo <= score <= hi):
            return None
        return (score - lo) / (hi - lo)

    def _remember(self, key: str, reply: str) -> None:
        with self._lock:
            self._cache[key] = reply
            if self.cache_path:
                with open(self.cache_path, "a") as f:
                    f.write(json.dumps({"key": key, "reply": reply}) + "\n")

    # ---- backends: {completion index: (reply or None, retries used)} ---------------------------------------
    def _ask_url(self, texts: list[str], todo: list[int], deadline: float) -> dict[int, tuple[Optional[str], int]]:
        if not todo:
            return {}
        with ThreadPoolExecutor(max_workers=min(self.batch_size, len(todo)), thread_name_prefix="judge") as pool:
            futures = {j: pool.submit(self._request, texts[j], deadline) for j in todo}
            return {j: f.result() for j, f in futures.items()}

    def _request(self, text: str, deadline: float) -> tuple[Optional[str], int]:
        body = json.dumps({
            "model": self.model, "messages": [{"role": "user", "content": text}],
            "temperature": self.temperature, "max_tokens": self.max_new_tokens,
        }).encode()  # fmt: skip
        headers = {"Content-Type": "application/json"}
        if self.api_key_env and os.environ.get(self.api_key_env):
            headers["Authorization"] = f"Bearer {os.environ[self.api_key_env]}"
        for attempt in range(self.retries + 1):
            left = deadline - time.monotonic()
            if left <= 0:
                return None, attempt
            request = urllib.request.Request(self.url.rstrip("/") + "/chat/completions", body, headers)
            try:
                with urllib.request.urlopen(request, timeout=left) as response:
                    reply = json.loads(response.read())["choices"][0]["message"]["content"]
                if isinstance(reply, str):
                    return reply, attempt
            except urllib.error.HTTPError as e:
                if e.code not in _RETRY_STATUS:
                    raise ValueError(f"judge at {self.url} answered HTTP {e.code}: {e.read()[:300]!r}") from None
            except (OSError, ValueError, KeyError, IndexError, TypeError):  # refused, timed out, a malformed reply
                pass
        return None, self.retries

    def _ask_local(self, texts: list[str], todo: list[int], deadline: float) -> dict[int, tuple[Optional[str], int]]:
        """Greedy replies of the local judge, batch_size prompts per generate call; batches that would start
        after the deadline are not run (a generate call cannot be interrupted)."""
        import torch

        model, tokenizer = self._load_local()
        out: dict[int, tuple[Optional[str], int]] = {}
        for begin in range(0, len(todo), self.batch_size):
            chunk = todo[begin : begin + self.batch_size]
            if time.monotonic() >= deadline:
                out.update({j: (None, 0) for j in chunk})
                continue
            if tokenizer.chat_template:
                prompts = [
                    tokenizer.apply_chat_template([{"role": "user", "content": texts[j]}], tokenize=False,
                                                  add_generation_prompt=True) for j in chunk
                ]  # fmt: skip
            else:
                prompts = [texts[j] for j in chunk]
            batch = tokenizer(
                prompts, return_tensors="pt", padding=True, add_special_tokens=not tokenizer.chat_template
            )
            with torch.no_grad():
                generated = model.generate(**batch, max_new_tokens=self.max_new_tokens, do_sample=False,
                                           pad_token_id=tokenizer.pad_token_id)  # fmt: skip
            new = generated[:, batch["input_ids"].shape[1] :]
            for j, ids in zip(chunk, new):
                out[j] = (tokenizer.decode(ids, skip_special_tokens=True), 0)
        return out

    def _load_local(self) -> tuple[Any, Any]:
        with self._lock:
            if self._local is None:
                from transformers import AutoModelForCausalLM, AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self.local_model, padding_side="left")
                if tokenizer.pad_token_id is None:
                    tokenizer.pad_token = tokenizer.eos_token
                model = AutoModelForCausalLM.from_pretrained(self.local_model).eval()
                self._local = (model, tokenizer)
            return self._local
