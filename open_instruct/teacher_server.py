"""A distillation teacher served by a running vLLM server instead of loaded beside the policy (TRL's
`teacher_server_urls`): `teacher_model_name_or_path` or a `teacher_models` entry given as the server's URL.

    vllm serve path/to/teacher --port 8001                                            # on any machine
    python open_instruct/rlvr_ppo.py recipe.yaml --teacher_models math=http://host:8001 code=path/to/code_teacher

Each completion is scored by one request to the server's OpenAI-compatible `/v1/completions`: the prompt's and the
response's token ids as the prompt, `max_tokens` 1 and `prompt_logprobs` 0; vLLM returns the log-prob of every given
token after those before it, which for the response's tokens is log pi_teacher(y_t | y_<t) (the request TRL's
teacher servers answer). vLLM computes these at temperature 1 whatever the request's temperature or the server's
`--logprobs-mode` (prompt tokens skip the sampling processors: vLLM 0.32's gpu_model_runner), so a run with a
teacher server samples at temperature 1 (config.py refuses another; a loaded teacher takes any). Requests of a
micro-batch run concurrently; vLLM batches them.

Only the sampled tokens' log-probs come back, so a server teacher serves `distill_loss reverse_kl` (the `jsd` term
needs the teacher's whole distribution and is refused with one). The teacher's weights are the server's: the run
records the URL, not a digest of weights it cannot read.

Checked before any model loads (`check_teacher_server`, exit 2): the server answers; it serves sequences as long as
this run's longest (max_prompt_length + response_length + the one token it generates); it tokenizes a probe text as
the student's tokenizer does (the teacher scores the student's token ids, so one id must mean one token in both); and
it returns log-probs (the top ones of a position sum to at most 1), not logits (`--logprobs-mode raw_logits`).
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Sequence

import torch

from open_instruct.engines import served_model_card, served_model_name
from open_instruct.errors import ConfigError

MAX_CONCURRENT_REQUESTS = 64
REQUEST_TIMEOUT_S = 600.0  # a request unanswered this long stops the run (TRL's request_timeout)
# tokenized by the server and by the student's tokenizer at start: letters, digits, spacing, punctuation, accents,
# other scripts and an emoji, where two different vocabularies disagree
PROBE_TEXT = "Teacher check: 12 + 34 = 46.\n\tdef f(x):\n        return x ** 2  # Ünïcödé, 中文, ελληνικά 🙂 </s>"


class TeacherServerError(RuntimeError):
    """The teacher's server refused a request, died, or did not answer in time; the message names it."""


class TeacherServer:
    """One teacher's server: `token_logprobs` scores a micro-batch of completions (see the module docstring)."""

    def __init__(self, name: str, url: str, timeout: float = REQUEST_TIMEOUT_S, model: Optional[str] = None) -> None:
        self.name, self.url, self.timeout = name, url.strip().rstrip("/"), timeout
        if model is None:
            try:
                model = served_model_name(self.url, timeout)
            except (OSError, ValueError, KeyError, IndexError) as e:  # urllib's URLError is an OSError
                raise TeacherServerError(f"the teacher server {self.url} does not answer /v1/models: {e}") from None
        self.model = model
        self.pool = ThreadPoolExecutor(max_workers=MAX_CONCURRENT_REQUESTS, thread_name_prefix="teacher-server")

    def post(self, route: str, payload: dict[str, Any]) -> dict[str, Any]:
        return post_json(self.url, route, payload, self.timeout, f"teacher {self.name}")

    def prompt_logprobs(self, ids: Sequence[int], top: int = 0) -> list[Any]:
        """vLLM's prompt_logprobs of `ids`: per position (the first None) {token id: {"logprob": ...}} of the given
        token and the `top` likeliest."""
        payload = {"model": self.model, "prompt": list(ids), "max_tokens": 1, "prompt_logprobs": top}
        entries = (self.post("/v1/completions", payload).get("choices") or [{}])[0].get("prompt_logprobs")
        if not isinstance(entries, list) or len(entries) != len(ids):
            got = len(entries) if isinstance(entries, list) else type(entries).__name__
            raise TeacherServerError(
                f"teacher {self.name} ({self.url}) returned prompt_logprobs for {got} of {len(ids)} tokens"
            )
        return entries

    def sequence_logprobs(self, ids: Sequence[int], start: int) -> list[float]:
        """log pi_teacher(ids[t] | ids[:t]) for t in [start, len(ids))."""
        entries = self.prompt_logprobs(ids)
        return [logprob_of(entries[t], ids[t], self) for t in range(start, len(ids))]

    def token_logprobs(
        self, prompts: Sequence[Sequence[int]], responses: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """log pi_teacher(y_t) [B, R] of each row's response tokens (responses [B, R]) after its prompt, 0 off
        `mask`; a row is sent up to its last masked token (later tokens cannot change an earlier one's log-prob)."""
        out = torch.zeros(mask.shape, dtype=torch.float32)
        keep = (mask > 0).cpu()
        rows = [i for i in range(len(prompts)) if bool(keep[i].any())]
        ends = {i: int(keep[i].nonzero().max()) + 1 for i in rows}
        tokens = responses.cpu().tolist()
        jobs = {
            i: self.pool.submit(self.sequence_logprobs, [*prompts[i], *tokens[i][: ends[i]]], len(prompts[i]))
            for i in rows
        }
        for i, job in jobs.items():
            out[i, : ends[i]] = torch.tensor(job.result(), dtype=torch.float32)
        return (out * keep).to(mask.device)


def post_json(url: str, route: str, payload: dict[str, Any], timeout: float, who: str) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{url}{route}", data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.load(response)
    except urllib.error.HTTPError as e:
        body = e.read()[:500].decode(errors="replace")
        raise TeacherServerError(f"{who} ({url}) refused {route}: {e.code} {body}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise TeacherServerError(f"{who} ({url}) did not answer {route} (timeout {timeout:.0f}s): {e}") from None


def logprob_of(entry: Any, token: int, server: TeacherServer) -> float:
    """The log-prob of `token` in one position's prompt_logprobs entry ({token id: {"logprob": ...}, ...}; vLLM
    always includes the given token)."""
    found = entry.get(str(token)) if isinstance(entry, dict) else None
    value = found.get("logprob") if isinstance(found, dict) else None
    if not isinstance(value, (int, float)) or math.isnan(value) or value > 0:
        raise TeacherServerError(
            f"teacher {server.name} ({server.url}) gave no log-prob of token {token} in its prompt_logprobs: {entry!r}"
        )
    return float(value)


def check_teacher_server(key: str, url: str, tokenizer: Any, max_len: int) -> None:
    """ConfigError (exit 2, before any model loads) unless the server at `url` can score this run's completions:
    it answers, serves max_len + 1 tokens, tokenizes PROBE_TEXT as `tokenizer` does, and returns log-probs."""
    try:  # one read of /v1/models: the model's name and the length it serves
        card = served_model_card(url.strip().rstrip("/"), 60.0)
        server = TeacherServer(key, url, timeout=60.0, model=str(card["id"]))
        served_len = int(card.get("max_model_len") or 0)
        theirs = server.post("/tokenize", {"model": server.model, "prompt": PROBE_TEXT, "add_special_tokens": False})
    except (TeacherServerError, OSError, ValueError, KeyError, IndexError) as e:
        raise ConfigError(f"{key} {url}: the teacher server cannot be used: {e}") from None
    if served_len and served_len < max_len + 1:
        raise ConfigError(
            f"{key} {url} serves max_model_len {served_len}; this run scores sequences of up to {max_len} tokens "
            f"(max_prompt_length + response_length) plus the one it generates: start it with --max-model-len "
            f"{max_len + 1} or more"
        )
    ours = tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    if theirs.get("tokens") != ours:
        raise ConfigError(
            f"{key} {url} ({server.model}) tokenizes {PROBE_TEXT!r} as {theirs.get('tokens')}, the student's "
            f"tokenizer as {ours}: the teacher must share the student's tokenizer"
        )
    try:  # the given token and the top 5 of a few positions: log-probs sum to at most 1, logits need not
        entries = server.prompt_logprobs(ours[:8], top=5)[1:]
        mass = max(math.fsum(math.exp(v["logprob"]) for v in e.values()) for e in entries)
    except (TeacherServerError, AttributeError, KeyError, TypeError, OverflowError) as e:
        raise ConfigError(f"{key} {url}: the teacher server cannot score tokens: {e}") from None
    if mass > 1.0 + 1e-3:
        raise ConfigError(
            f"{key} {url} returns scores whose top ones sum to {mass:.3g} > 1 as probabilities: logits, not "
            "log-probs; start it without --logprobs-mode raw_logits / processed_logits"
        )
