"""LLM-as-judge rewards: a judge model scores each completion against a rubric, as one of the run's reward functions.

    # my_judge.py
    from open_instruct.judge import Judge
    helpful = Judge(url="http://127.0.0.1:8000/v1", model="Qwen/Qwen3-8B", template=open("rubric.txt").read())

    --reward_functions my_judge.py:helpful --reward_function_weights 0.5     (with the rows' verifiers, or alone)

A `Judge` is a reward function in TRL's shape (rewards.py): called once per batch with the prompts, completions
and the rows' columns, it returns one value per completion in [0, 1] (None where the judge gave no reply, a timeout:
that completion gets 0 from it and is left out of `reward/<label>/mean`; an unparsable reply is 0). Backends: any
OpenAI-compatible `/chat/completions` endpoint (`url`, `model`; the key from the environment variable `api_key_env`
if set), a local Hugging Face folder (`local_model`), loaded on first use in the trainer's process and run greedily,
or vLLM engines asked as the URL backend asks (round-robin, by the name /v1/models gives: no `model=`):

    Judge(RUBRIC, serve_model="Qwen/Qwen3-8B", serve_engines=2)   # engines started for the judge (engines.py)
    Judge(RUBRIC, url="run")                                       # the run's own generation engines (self-judging)

`serve_model`: vLLM OpenAI-compatible servers of that folder or hub id (real weights, none of the trainer's routes),
started by rank 0 when the run's generator is up (start_run_judges) on the GPUs neither the training processes nor
the run's engines took (or `serve_devices`; the CPU without CUDA), every rank asking them; outside a run, on the
first call (or `start()`). They die with the process that started them and are stopped at its exit; one that died
stops the call with an EngineError naming it and its log tail, every engine of the judge stopped first.
`url="run"`: resolved to the run's `vllm_server` engines when the generator is up (use_engines); refused before any
model loads when the run generates with `hf` or `vllm` (check_run_judges, preflight). Its replies are not cached
(the policy's weights change every step). Neither is called by the probe before loading (`starts_with_run`).

Each completion's judge prompt is `template` with its slots `{prompt}`, `{completion}` and `{reference}` filled in
one pass over the template (literal: braces elsewhere in a rubric are kept): a value is inserted as data, never read
again as a template, so a completion containing `{reference}` is judged as that text, and the row's reference is in
the prompt only where the rubric itself names `{reference}` (the row's `reference_column`, default `ground_truth`).

The score is the judge's verdict at one defined place: the FIRST match of `score_pattern` in the reply (default
`Score: N`, N in ASCII digits; the pattern is matched with re.ASCII and its group must be ASCII digits with an
optional sign and decimal part), mapped from `score_range` onto [0, 1]. Write the rubric so the judge gives its score
first ("Reply 'Score: N' on the first line, then your reasons"): a "Score: 10" the judge quotes from the completion
after its verdict is not the verdict. A reply with no match, or a number outside the range, is unparsable: it scores
0 and is counted (`parse_failures`).

A run stops on judge failures only when the judge fails its own fixed probes, never because of what a policy wrote:
`probes` (default PROBES: one neutral question, its right answer and reference) are rendered through the same
template and asked at the judge's first call and again after any call where more than `max_parse_failure_rate` of
the replies were unparsable; a probe whose reply is unparsable, or outside the raw score range the probe names
(`"score": [low, high]`), raises (the rubric, the pattern or the judge is broken). Probes that pass mean the
failures were the policy's: they stay 0 and counted, and the run goes on. `probes=[]`: never stop.

Replies are cached by (the judge's identity: backend, url, model, folder, temperature, max_new_tokens) and the whole
judge prompt, in memory and, with `cache_path`, in a JSON-lines file that a resumed run reads back, so a resume asks
the judge nothing it already answered and gets the same scores. A folder is known by its files' content: one
replaced at the same path is another judge, whose replies are not reused (and a resume is refused for it, like a
teacher's: `weight_folders`, checkpoint.input_identity).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import os
import re
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Sequence

from open_instruct.errors import ConfigError
from open_instruct.file_digests import folder_digest

logger = logging.getLogger(__name__)

DEFAULT_PATTERN = r"(?i)score\s*[:=]\s*(-?[0-9]+(?:\.[0-9]+)?)"
PLACEHOLDERS = ("{prompt}", "{completion}", "{reference}")
_SLOT = re.compile("|".join(re.escape(p) for p in PLACEHOLDERS))
_ASCII_NUMBER = re.compile(r"-?[0-9]+(?:\.[0-9]+)?", re.ASCII)
COUNTERS = ("calls", "cache_hits", "parse_failures", "timeouts", "retries", "probes", "seconds")
# the judge's own fixed probe: a question, its right answer and the reference (no expected score: any rubric may
# rate it; it must only be parsable). Give probes= with "score": [low, high] (raw, in score_range) to check more.
PROBES = ({"prompt": "What is 2 + 2?", "completion": "2 + 2 = 4. The answer is 4.", "reference": "4"},)
_RETRY_STATUS = {429, 500, 502, 503, 504}


class JudgeValues(list):
    """A judge call's values (one per completion, None: no usable score) with its `counters` for the logs and the
    judge's `replies` (None: unanswered)."""

    def __init__(
        self, values: Sequence[Optional[float]], counters: dict[str, float], replies: Sequence[Optional[str]] = ()
    ) -> None:
        super().__init__(values)
        self.counters, self.replies = counters, list(replies)


RUN = "run"  # url=RUN: the run's own generation engines judge (resolved when they start; use_engines)
SERVE_DEFAULTS = {
    "serve_engines": 1, "serve_tensor_parallel_size": 1, "serve_devices": None, "serve_max_model_len": 4096,
    "serve_dtype": "auto", "serve_gpu_memory_utilization": 0.9, "serve_start_timeout": 600.0, "serve_log_dir": None,
}  # fmt: skip


RUN_TAKES = {
    "model": "the engines' served model name is read from their /v1/models",
    "api_key_env": "the run's engines need no key",
    "cache_path": "the policy's weights change every step: its replies are not cached",
}


def _model_id(name: str) -> str:
    """A judge model in the cache identity: a folder by its files' content (one replaced at the same path is another
    judge), a hub id as it is."""
    return folder_digest(name) if os.path.isdir(name) else name


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


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
        serve_model: Optional[str] = None,
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
        probes: Optional[Sequence[dict]] = None,
        **serve: Any,
    ) -> None:
        backends = {"url": url, "local_model": local_model, "serve_model": serve_model}
        if sum(v is not None for v in backends.values()) != 1:
            raise ConfigError(
                "Judge: give exactly one of url= (an OpenAI-compatible endpoint, or 'run': the run's own vLLM "
                "engines), local_model= (a folder) and serve_model= (a folder or hub id served by vLLM engines "
                f"started here); "
                f"got {sorted(k for k, v in backends.items() if v is not None) or 'none'}"
            )
        self._check_serve_options(serve, serve_model)
        _check_folder("local_model", local_model, must_be_local=True)
        _check_folder("serve_model", serve_model, must_be_local=False)
        if url == RUN:
            for name, value in (("model", model), ("api_key_env", api_key_env), ("cache_path", cache_path)):
                if value is not None:
                    raise ConfigError(f"Judge: url='run' takes no {name}= ({RUN_TAKES[name]})")
        elif serve_model is not None:
            if model is not None or api_key_env is not None:
                raise ConfigError(
                    "Judge: serve_model= takes no model= or api_key_env= (the engines started here serve the model "
                    "under its own name and need no key)"
                )
        elif url is not None and not model:
            raise ConfigError(f"Judge: url {url!r} needs model= (the judge model's name at that endpoint)")
        if "{completion}" not in template:
            raise ConfigError(f"Judge: the template must contain {{completion}} (placeholders: {PLACEHOLDERS})")
        lo, hi = (float(x) for x in score_range)
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise ConfigError(f"Judge: score_range {score_range!r} must be two finite numbers, low < high")
        try:
            self.pattern = re.compile(score_pattern, re.ASCII)  # \d and \s: ASCII only
        except (re.error, ValueError) as e:
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
        self.serve_model, self.serve = serve_model, {**SERVE_DEFAULTS, **serve}
        # the endpoints asked, round-robin: url's, or those of the engines started or resolved (use_engines)
        self.urls: list[str] = [url] if url is not None and url != RUN else []
        self.engines: Any = None  # engines.LocalEngines this judge started (serve_model)
        self.score_range, self.reference_column = (lo, hi), reference_column
        self.batch_size, self.timeout, self.retries = batch_size, float(timeout), retries
        self.max_new_tokens, self.temperature = max_new_tokens, float(temperature)
        self.api_key_env, self.cache_path = api_key_env, cache_path
        self.max_parse_failure_rate = max_parse_failure_rate
        # the folders this judge loads, hashed for a resume like the run's own models (checkpoint.input_identity)
        self.weight_folders = [f for f in (local_model, serve_model) if f and os.path.isdir(f)]
        self._identity: Optional[str] = None  # hashed on first use, not at import
        self.probes = self._checked_probes(PROBES if probes is None else probes)
        self._probed = False  # the probes are asked at the first call
        self._cache: dict[str, str] = {}
        self._lock = threading.Lock()
        self._local: Optional[tuple[Any, Any]] = None
        if cache_path and os.path.exists(cache_path):
            with open(cache_path) as f:
                for line in f:
                    if line.strip():
                        record = json.loads(line)
                        self._cache[record["key"]] = record["reply"]

    def _checked_probes(self, probes: Sequence[dict]) -> list[dict]:
        checked = []
        for k, probe in enumerate(probes):
            if not isinstance(probe, dict) or "completion" not in probe or set(probe) - {*self._PROBE_KEYS}:
                raise ConfigError(
                    f"Judge: probe {k} must be a dict with completion (and optionally prompt, reference, score), got "
                    f"{probe!r:.200}"
                )
            if "score" in probe:
                lo, hi = self.score_range
                want = probe["score"]
                if not (isinstance(want, (list, tuple)) and len(want) == 2 and lo <= want[0] <= want[1] <= hi):
                    raise ConfigError(f"Judge: probe {k}'s score must be [low, high] within {self.score_range}")
            checked.append(dict(probe))
        return checked

    _PROBE_KEYS = ("prompt", "completion", "reference", "score")

    @staticmethod
    def _check_serve_options(serve: dict[str, Any], serve_model: Optional[str]) -> None:
        unknown = sorted(set(serve) - set(SERVE_DEFAULTS))
        if unknown:
            raise ConfigError(f"Judge: unknown argument(s) {unknown}; the serving options are {sorted(SERVE_DEFAULTS)}")
        if serve and serve_model is None:
            raise ConfigError(f"Judge: {sorted(serve)} configure engines started for serve_model=, which is not given")
        for name in ("serve_engines", "serve_tensor_parallel_size", "serve_max_model_len"):
            if name in serve and (not isinstance(serve[name], int) or serve[name] < 1):
                raise ConfigError(f"Judge: {name} must be an integer >= 1, got {serve[name]!r}")
        devices = serve.get("serve_devices")
        if devices is not None:
            need = serve.get("serve_engines", 1) * serve.get("serve_tensor_parallel_size", 1)
            if (
                len(set(devices)) != len(devices)
                or len(devices) != need
                or any(not isinstance(d, int) or d < 0 for d in devices)
            ):
                raise ConfigError(
                    f"Judge: serve_devices {devices!r} must list {need} distinct GPU ids (serve_engines x "
                    f"serve_tensor_parallel_size)"
                )

    def check_columns(self, columns: Sequence[str], where: str) -> None:
        """Before any model loads (rewards.probe_reward_functions, every judge, served ones too): the rubric's
        `{reference}` slot reads the rows' `reference_column`; rows without that column would give every judge
        prompt an empty reference."""
        if "{reference}" in self.template and self.reference_column not in columns:
            raise ConfigError(
                f"Judge: the rubric's slot {{reference}} reads column {self.reference_column!r}, which the rows of "
                f"{where} lack (columns: {sorted(columns)}): set reference_column= to the column holding the "
                "reference, or take {reference} out of the rubric"
            )

    @property
    def starts_with_run(self) -> bool:
        """Its model is served by engines that start with the run (serve_model, url='run'): the probe before any
        model loads (rewards.probe_reward_functions) does not call it."""
        return self.serve_model is not None or self.url == RUN

    # ---- the run's hooks (rewards.run_hooks): once per run, for all of its judges --------------------------------
    @classmethod
    def check_run(cls, cfg: Any) -> None:
        check_run_judges(cfg)

    @classmethod
    def start_run(cls, cfg: Any, generator: Any, accelerator: Any) -> list["Judge"]:
        return start_run_judges(cfg, generator, accelerator)

    @property
    def asks_run_engines(self) -> bool:
        """It judges with the run's own engines (url='run'): they serve the policy's whole context
        (engines.engine_context), as its prompts hold a prompt, its completion and the rubric."""
        return self.url == RUN

    # ---- engines: started here (serve_model) or the run's own (url='run') ------------------------------------
    def start(self, devices: Optional[Sequence[int]] = None, log_dir: Optional[str] = None) -> list[str]:
        """Start the serve_model engines (vLLM's OpenAI-compatible server, engines.py), wait until each is healthy,
        and ask them from now on; their URLs. `devices`: GPU ids for them (default: serve_devices, else the first
        of this node's GPUs, else the CPU); they die with this process and are stopped at its exit or by close()."""
        from open_instruct import engines

        if self.serve_model is None:
            raise ConfigError("Judge.start: only a judge with serve_model= starts engines")
        if self.engines is not None:
            return self.urls
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(
                f"Judge: serve_model {self.serve_model!r} needs vLLM in this Python environment ({sys.executable})"
            )
        opts = self.serve
        need = opts["serve_engines"] * opts["serve_tensor_parallel_size"]
        if devices is None:
            devices = opts["serve_devices"]
        if devices is None and _cuda_devices():
            devices = list(range(need))
        specs = engines.engine_specs(
            self.serve_model, num_engines=opts["serve_engines"], max_model_len=opts["serve_max_model_len"],
            tensor_parallel_size=opts["serve_tensor_parallel_size"], dtype=opts["serve_dtype"], seed=0, transfer=None,
            gpu_memory_utilization=opts["serve_gpu_memory_utilization"], devices=devices, port=engines.free_port(),
        )  # fmt: skip
        log_dir = log_dir or opts["serve_log_dir"] or tempfile.mkdtemp(prefix="judge-engines-")
        try:
            self.engines = engines.LocalEngines(specs, log_dir, opts["serve_start_timeout"], repick_ports=True)
        except engines.EngineError as e:
            raise engines.EngineError(f"the judge's {e}") from None
        self.use_engines(self.engines.urls)
        return self.urls

    def use_engines(self, urls: Sequence[str]) -> None:
        """Ask these vLLM servers (base URLs, without /v1), round-robin, by the model name they serve (/v1/models):
        the run's own engines for url='run' (rlvr_ppo calls it with its generator's), or the engines started for
        serve_model (start)."""
        from open_instruct.engines import served_model_name

        if not urls:
            raise ConfigError("Judge.use_engines: no engine URLs")
        urls = [u.rstrip("/") for u in urls]
        try:
            self.model = served_model_name(urls[0])
        except (OSError, ValueError, KeyError, IndexError) as e:
            raise ConfigError(f"Judge: the vLLM engine at {urls[0]} does not answer /v1/models ({e})") from None
        self.urls = [f"{u}/v1" for u in urls]

    def close(self) -> None:
        """Stop the engines this judge started (also done at exit)."""
        if self.engines is not None:
            self.engines.close()
            self.engines = None

    def _check_engines(self) -> None:
        """An engine this judge started that died: every one stopped (no orphan), and an error naming it."""
        from open_instruct.engines import EngineError

        if self.engines is None:
            return
        try:
            self.engines.check_alive()
        except EngineError as e:
            self.close()
            raise EngineError(f"the judge's {e}") from None

    def _ready(self) -> None:
        if self.serve_model is not None and self.engines is None and not self.urls:
            self.start()  # used outside a run (rlvr_ppo starts it with the run: start_run_judges)
        elif self.url == RUN and not self.urls:
            raise ConfigError(
                "Judge(url='run') is resolved when the run's vLLM engines start (rlvr_ppo with generation_backend "
                "vllm_server); elsewhere call judge.use_engines(urls) first"
            )
        self._check_engines()

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
        if todo and not self.local_model:
            self._ready()
        if todo and not self._probed:  # at start: a judge that fails its own probes stops the run here
            counters["probes"] += self.check_probes(deadline)
        asked = self._ask(texts, todo, deadline)
        if any(reply is None for reply, _ in asked.values()):
            self._check_engines()  # unanswered because a served engine died: say so, not "timeouts"
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
            if value is None:  # unparsable: 0, counted (whatever the policy wrote to provoke it)
                counters["parse_failures"] += 1
                bad_replies.append(reply)
                value = 0.0
            values.append(value)
        answered = len(texts) - counters["timeouts"]
        if bad_replies:
            logger.warning("judge: %d of %d replies had no score (%s); scored 0; e.g. %r", len(bad_replies), answered,
                           self.pattern.pattern, bad_replies[0][:300])  # fmt: skip
        if answered and len(bad_replies) > self.max_parse_failure_rate * answered:
            # many failures: the judge's or the policy's? Only the judge's own probes can say (and stop the run)
            counters["probes"] += self.check_probes(time.monotonic() + self.timeout)
        counters["seconds"] = time.monotonic() - start
        return JudgeValues(values, counters, replies)

    def check_probes(self, deadline: float) -> int:
        """Ask the judge its fixed probes (never cached); raise ValueError naming the first one it fails (no reply,
        an unparsable reply, or a score outside the probe's range). Returns how many were asked."""
        self._probed = True
        if not self.probes:
            return 0
        texts = [self.render(p.get("prompt"), p["completion"], p.get("reference")) for p in self.probes]
        asked = self._ask(texts, list(range(len(texts))), deadline)
        lo, hi = self.score_range
        for k, probe in enumerate(self.probes):
            reply = asked[k][0]
            value = None if reply is None else self.parse(reply)
            want = probe.get("score")
            if value is None or (want is not None and not want[0] <= lo + value * (hi - lo) <= want[1]):
                why = "no reply" if reply is None else f"reply {reply[:300]!r}"
                raise ValueError(
                    f"the judge fails its own probe {k} ({why}; wanted a score matching {self.pattern.pattern!r} "
                    f"in {tuple(want) if want is not None else self.score_range}): fix the judge, the rubric or "
                    "score_pattern"
                )
        return len(texts)

    def _ask(self, texts: list[str], todo: list[int], deadline: float) -> dict[int, tuple[Optional[str], int]]:
        if self.local_model:
            return self._ask_local(texts, todo, deadline)
        return self._ask_url(texts, todo, deadline)

    def render(self, prompt: Any, completion: Any, reference: Any) -> str:
        """The template with each slot it names filled, in one pass: the values are data, never scanned for slots."""
        if isinstance(completion, list):  # TRL's conversational shape: [{"role": "assistant", "content": ...}]
            completion = completion[-1].get("content", "") if completion else ""
        values = dict(zip(PLACEHOLDERS, (_text(prompt), _text(completion), _text(reference))))
        return _SLOT.sub(lambda m: values[m.group(0)], self.template)

    @property
    def identity(self) -> str:
        """The judge in its cache keys: backend, url, model, folder (by content), temperature, max_new_tokens."""
        if self._identity is None:
            served = [_model_id(self.serve_model)] if self.serve_model else []  # the model, not the engines' ports
            self._identity = json.dumps(
                [self.url.rstrip("/") if self.url else None, self.model,
                 _model_id(self.local_model) if self.local_model else None, self.temperature, self.max_new_tokens,
                 *served], sort_keys=True
            )  # fmt: skip
        return self._identity

    def cache_key(self, text: str) -> str:
        return hashlib.sha256(json.dumps([self.identity, text]).encode()).hexdigest()

    def parse(self, reply: str) -> Optional[float]:
        """The reply's FIRST match of score_pattern (ASCII digits) mapped onto [0, 1]; None when there is none, its
        number is not ASCII, or it is outside score_range."""
        match = self.pattern.search(reply)
        if match is None or match.group(1) is None or not _ASCII_NUMBER.fullmatch(match.group(1)):
            return None
        score = float(match.group(1))
        lo, hi = self.score_range
        if not (math.isfinite(score) and lo <= score <= hi):
            return None
        return (score - lo) / (hi - lo)

    def _remember(self, key: str, reply: str) -> None:
        if self.url == RUN:  # a self-judge's weights change every step: an older reply is another judge's
            return
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
            futures = {
                j: pool.submit(self._request, self.urls[k % len(self.urls)], texts[j], deadline)
                for k, j in enumerate(todo)
            }
            return {j: f.result() for j, f in futures.items()}

    def _request(self, url: str, text: str, deadline: float) -> tuple[Optional[str], int]:
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
            request = urllib.request.Request(url.rstrip("/") + "/chat/completions", body, headers)
            try:
                with urllib.request.urlopen(request, timeout=left) as response:
                    reply = json.loads(response.read())["choices"][0]["message"]["content"]
                if isinstance(reply, str):
                    return reply, attempt
            except urllib.error.HTTPError as e:
                if e.code not in _RETRY_STATUS:
                    raise ValueError(f"judge at {url} answered HTTP {e.code}: {e.read()[:300]!r}") from None
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


def _check_folder(option: str, name: Optional[str], must_be_local: bool) -> None:
    """A judge's model folder that is not there is named as a missing folder (not as a malformed hub id):
    local_model is always a folder, serve_model when it looks like a path (preflight.looks_local)."""
    from open_instruct.preflight import looks_local

    if name is None or os.path.isdir(name) or not (must_be_local or looks_local(name)):
        return
    what = "is not a folder" if os.path.exists(name) else "does not exist"
    also = "" if not must_be_local else " (local_model= loads a local Hugging Face folder; a hub id: serve_model=)"
    raise ConfigError(f"Judge: {option} folder {name!r} {what}{also}")


# ---- the run's judges (rlvr_ppo) ------------------------------------------------------------------------------------
def run_judges(specs: Sequence[str]) -> list[Judge]:
    """The reward functions among `specs` that are judges served by engines that start with the run."""
    from open_instruct.rewards import load_reward_function

    found = [load_reward_function(spec) for spec in specs]
    return [fn for fn in found if isinstance(fn, Judge) and fn.starts_with_run]


def check_run_judges(cfg: Any) -> None:
    """Before anything starts (preflight): a self-judge (url='run') needs the run's vLLM servers (generation_backend
    vllm_server), and a served judge (serve_model) needs vLLM here and engines on this node (one node)."""
    for judge in run_judges(cfg.reward_functions or ()):
        if judge.url == RUN and cfg.generation_backend != "vllm_server":
            raise ConfigError(
                f"Judge(url='run') judges with the run's own vLLM engines, but generation_backend is "
                f"{cfg.generation_backend} (no engine with an OpenAI-compatible route): use generation_backend "
                f"vllm_server, or give the judge url= and model= (a server of its own) or serve_model="
            )
        if judge.serve_model is not None and importlib.util.find_spec("vllm") is None:
            raise ConfigError(
                f"Judge: serve_model {judge.serve_model!r} needs vLLM in this Python environment ({sys.executable})"
            )


def start_run_judges(cfg: Any, generator: Any, accelerator: Any) -> list[Judge]:
    """At run start, once the generator is up (collective: every rank calls it): each url='run' judge asks the
    generator's engines; rank 0 starts each serve_model judge's engines on the GPUs that neither the training
    processes (local ranks 0..n-1) nor the run's own engines took (or the CPU), and every rank asks them. Returns the
    judges whose engines were started here (close them at the end)."""
    from accelerate.utils import broadcast_object_list

    from open_instruct.engines import EngineError

    judges = run_judges(cfg.reward_functions or ())
    for judge in (j for j in judges if j.url == RUN):
        judge.use_engines(generator.urls)
    served = [j for j in judges if j.serve_model is not None]
    if not served:
        return []
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
    if local_world != accelerator.num_processes:
        raise ConfigError(
            "Judge(serve_model=...) starts its engines on the first node; training spans several nodes: serve the "
            "judge apart (`vllm serve`) and give it url= and model="
        )
    shared: list[Any] = [None]
    if accelerator.is_main_process:
        try:
            taken = set(range(local_world))  # the training processes' GPUs, then the run's own engines'
            for spec in getattr(getattr(generator, "local_engines", None), "specs", None) or []:
                taken.update(spec.devices or [])
            free = [d for d in range(_cuda_devices()) if d not in taken]
            urls = []
            for judge in served:
                need = judge.serve["serve_engines"] * judge.serve["serve_tensor_parallel_size"]
                devices = judge.serve["serve_devices"]
                if _cuda_devices() and devices is None:
                    devices = free[:need]
                if devices is not None and (len(devices) < need or set(devices) & taken):
                    raise ConfigError(
                        f"Judge(serve_model={judge.serve_model!r}) needs {need} GPU(s) the run leaves free: training "
                        f"and generation take {sorted(taken)} of {_cuda_devices()}"
                        + (f", serve_devices {list(devices)}" if judge.serve["serve_devices"] is not None else "")
                    )
                taken.update(devices or [])
                free = [d for d in free if d not in taken]
                log_dir = judge.serve["serve_log_dir"] or os.path.join(cfg.output_dir, f"judge_engine_logs_{len(urls)}")
                urls.append(judge.start(devices, log_dir))
            shared = [urls]
        except Exception as e:  # every rank must leave the broadcast: tell them, then raise here
            shared = [f"{type(e).__name__}: {e}"]
            broadcast_object_list(shared)
            for judge in served:
                judge.close()
            raise
    broadcast_object_list(shared)
    if isinstance(shared[0], str):
        raise EngineError(f"rank 0 could not start the judge's vLLM engines: {shared[0]}")
    if not accelerator.is_main_process:
        for judge, urls in zip(served, shared[0]):
            judge.use_engines([u.removesuffix("/v1") for u in urls])
    return served
