"""Generating responses from token-id prompts: the one contract the RLVR trainer and the eval entry points share.

    gen = generation_backends.make_generator(cfg, policy, tokenizer, accelerator, max_model_len)  # cfg picks one
    gen.sync_weights(policy, version=3)        # sample from the policy's current weights from now on
    with gen.generation_context(policy):       # hf: FSDP-sharded weights gathered once for the whole generate
        out = gen.generate(prompt_ids, GenerationConfig(max_new_tokens=256, temperature=1.0, n=4, seed=1))
    out.response_ids[i], out.logprobs[i], out.weight_versions[i], out.texts[i], out.stopped[i], out.prompt_index[i]
    gen.last_sync_seconds, gen.last_sync_bytes  # the last sync's statistics
    gen.close()                                # at the end of the run: stops what the generator started

Callers only see `GenerationConfig`, `GenerationOutput` and the `Generator` protocol below, which every backend keeps
in full (tests/test_architecture.py checks each class against it). This module holds the contract and the in-process
Hugging Face backend; the others (`vllm_generator.VLLMGenerator`, `engine_client.ServerGenerator`) import the
contract from here, and `generation_backends.make_generator` builds the one the config names, so no caller names a
backend or changes when one is added.

Token in, token out: a prompt is the token ids an episode holds so far, which may already include earlier turns
(the model's earlier responses and what the environment answered), so a batch may mix episodes at different turns;
`max_new_tokens` per prompt (`generate(..., max_new_tokens=[...])`) caps each at its remaining budget.

Conventions every backend keeps:
- Responses are ordered prompt by prompt, `n` contiguous rows per prompt: row i belongs to prompt i // n.
- A response ends right after its first stop: the EOS token (kept in `response_ids`) or the token that completes a
  stop string (kept too). Anything generated after that is dropped. `stopped` is False only when the response ran
  into its max_new_tokens without a stop.
- `texts[i]` is exactly `tokenizer.decode(response_ids[i])` minus a trailing EOS token: a stop string stays in the
  text (as the token ids that completed it stay in `response_ids`).
- Sampling is the plain policy distribution: logits / temperature, then the truncation the config asks for, in
  vLLM's order: min-p, top-k, top-p (`models.SamplingTruncation`). No repetition penalty and no truncation the config
  does not set, whatever the model's own generation_config says, so log-probs re-scored with
  `models.response_scores(..., temperature, truncation=...)` describe the sampler.
- `logprobs[i][t]` is the sampler's own log-probability of `response_ids[i][t]` (same length), as the engine
  computed it: the trainer's re-scored log-probs differ from it by kernels, precision and top-p truncation.
- `weight_versions[i][t]` is the version (the `sync_weights` label) of the weights that sampled `response_ids[i][t]`
  (-1 before the first sync).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
from dataclasses import dataclass, field, replace
from typing import Any, ContextManager, Optional, Protocol, Sequence, runtime_checkable

import torch

from open_instruct.batch_math import generation_sequences_per_call
from open_instruct.distributed import full_params
from open_instruct.errors import NonFiniteError
from open_instruct.models import kv_cache_name

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # mixed_precision -> HF generation's weight dtype


@dataclass
class GenerationConfig:
    max_new_tokens: int = 256
    temperature: float = 1.0  # 0 => greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    stop_strings: Optional[list[str]] = None
    n: int = 1  # samples per prompt
    seed: Optional[int] = None  # None: draw from the global torch RNG (seeded by the caller)
    max_batch_size: Optional[int] = None  # hf: sequences per generate call (None: its batch_size); engines ignore it

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.n < 1:
            raise ValueError(f"n (samples per prompt) must be >= 1, got {self.n}")
        if self.stop_strings is not None and any(not s for s in self.stop_strings):
            raise ValueError(f"stop_strings must be non-empty strings, got {self.stop_strings!r}")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class GenerationOutput:
    prompt_ids: list[list[int]]  # one row per prompt, as given
    response_ids: list[list[int]] = field(default_factory=list)  # one row per response, cut after the first stop
    texts: list[str] = field(default_factory=list)  # decoded response, trailing EOS token removed
    stopped: list[bool] = field(default_factory=list)  # True: EOS or a stop string ended it; False: max_new_tokens
    prompt_index: list[int] = field(default_factory=list)  # which prompt each response answers (n contiguous rows)
    # log p(token) of each response token under the distribution the sampler drew it from (after temperature and
    # min-p / top-k / top-p): what truncated importance sampling compares with the trainer's log-probs. Greedy: the
    # raw model's.
    logprobs: list[list[float]] = field(default_factory=list)
    # per response token: the version (sync_weights label) of the weights that sampled it; what the policy lag of
    # an off-policy rollout is measured from
    weight_versions: list[list[int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.response_ids)


@runtime_checkable
class Generator(Protocol):
    """The generation contract: every backend class implements all of it (tests/test_architecture.py)."""

    last_sync_seconds: float  # how long the last sync_weights took
    last_sync_bytes: int  # weight bytes the last sync_weights sent over a transport (0: handed over in-process)
    # True: sync_weights may run while generate() is in flight in another thread, and a response then spans versions
    # (its weight_versions say which token came from which). False: weights change only between generate() calls.
    in_flight_weight_updates: bool

    @classmethod
    def from_config(cls, cfg: Any, policy: Any, tokenizer: Any, accelerator: Any, max_model_len: int) -> "Generator":
        """The backend for a run: `cfg` (RLVRConfig) holds its knobs, `policy` is the prepared (maybe sharded)
        model, `max_model_len` the longest prompt + response it must hold. Collective: every rank builds one."""
        ...

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        config: GenerationConfig,
        max_new_tokens: Optional[Sequence[int]] = None,
    ) -> GenerationOutput:
        """`config.n` responses per prompt. A prompt may already hold earlier turns of its episode (token-in,
        token-out); `max_new_tokens[i]` caps prompt i's responses below `config.max_new_tokens`."""
        ...

    def sync_weights(self, model: Any, version: Optional[int] = None) -> None:
        """Sample from `model`'s current weights from now on, labelled `version` (default: the last + 1) in
        `GenerationOutput.weight_versions`. Collective under FSDP: every rank calls it."""
        ...

    def score_tokens(
        self, prompt_ids: Sequence[Sequence[int]], continuation_ids: Sequence[Sequence[int]], top_k: int = 0
    ) -> dict[str, Any]:
        """The generator's own log-probs of given continuations (temperature 1, no top-p), per engine it serves from:
        {engine name: generation_check.TokenScores} with, when top_k > 0, each position's top-k {id: log-prob}. Run
        inside generation_context. What the launch and post-sync checks (generation_check.py) compare."""
        ...

    def generation_context(self, model: Any) -> ContextManager[Any]:
        """What `generate` must run inside (hf: the FSDP-sharded policy gathered whole; engines: nothing).
        Collective under FSDP: every rank enters it, even one without prompts."""
        ...

    def close(self) -> None:
        """Release what the generator started (engines, threads, folders); called once, when the run is over."""
        ...


def new_token_budgets(
    prompt_ids: Sequence[Sequence[int]], config: GenerationConfig, max_new_tokens: Optional[Sequence[int]]
) -> list[int]:
    """Per prompt, the most tokens its responses may have: `config.max_new_tokens`, or the smaller per-prompt cap."""
    if max_new_tokens is None:
        return [config.max_new_tokens] * len(prompt_ids)
    if len(max_new_tokens) != len(prompt_ids):
        raise ValueError(f"max_new_tokens has {len(max_new_tokens)} entries for {len(prompt_ids)} prompts")
    if any(int(m) < 1 for m in max_new_tokens):
        raise ValueError(f"every max_new_tokens must be >= 1, got {list(max_new_tokens)}")
    return [min(int(m), config.max_new_tokens) for m in max_new_tokens]


def engine_budgets(
    prompt_ids: Sequence[Sequence[int]],
    config: GenerationConfig,
    max_new_tokens: Optional[Sequence[int]],
    max_model_len: int,
) -> list[int]:
    """new_token_budgets for an engine with a context of max_model_len tokens: ValueError for an empty prompt, or
    one whose length + its new-token budget exceeds max_model_len."""
    budgets = new_token_budgets(prompt_ids, config, max_new_tokens)
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token")
    too_long = [i for i, p in enumerate(prompt_ids) if len(p) + budgets[i] > max_model_len]
    if too_long:
        i = too_long[0]
        raise ValueError(
            f"prompt {i} ({len(prompt_ids[i])} tokens) + max_new_tokens {budgets[i]} exceeds the engine's "
            f"max_model_len {max_model_len} ({len(too_long)} prompts do)"
        )
    return budgets


def prompt_seed(base: int, prompt_index: int) -> int:
    """An independent-looking 56-bit seed per prompt. vLLM gives sample j of a prompt seed+j, so seeds spaced
    by 1 (base + i) would hand prompt i+1 the random stream of prompt i's second sample."""
    digest = hashlib.blake2b(f"{base}:{prompt_index}".encode(), digest_size=7).digest()
    return int.from_bytes(digest, "little")


def default_eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """Every token id that ends a response: the tokenizer's EOS and the model's generation_config EOS id(s)."""
    ids: list[int] = []
    candidates: list[Any] = [getattr(tokenizer, "eos_token_id", None)]
    gen_cfg = getattr(model, "generation_config", None)
    if gen_cfg is not None:
        candidates.append(gen_cfg.eos_token_id)
    for c in candidates:
        for i in c if isinstance(c, (list, tuple)) else [c]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    if not ids:
        raise ValueError("neither the tokenizer nor the model's generation_config names an EOS token")
    return ids


def _first_stop_string_cut(ids: Sequence[int], tokenizer: Any, stop_strings: Sequence[str]) -> Optional[int]:
    """Smallest k such that decode(ids[:k]) contains a stop string, or None.

    Binary search over prefixes (a prefix that contains a stop string keeps containing it when extended)."""

    def contains(k: int) -> bool:
        text = tokenizer.decode(list(ids[:k]), skip_special_tokens=False)
        return any(s in text for s in stop_strings)

    if not ids or not contains(len(ids)):
        return None
    lo, hi = 1, len(ids)  # contains(hi) is True
    while lo < hi:
        mid = (lo + hi) // 2
        if contains(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def finalize_response(
    ids: Sequence[int], eos_ids: Sequence[int], tokenizer: Any, stop_strings: Optional[Sequence[str]]
) -> tuple[list[int], str, bool]:
    """Cut raw generated ids right after the first EOS or stop-string completion; return (ids, text, stopped).

    Shared by backends so they all cut the same way."""
    ids = [int(t) for t in ids]
    eos = set(eos_ids)
    cut, stopped = len(ids), False
    for i, t in enumerate(ids):
        if t in eos:
            cut, stopped = i + 1, True
            break
    if stop_strings:
        body = ids[: cut - 1] if stopped else ids[:cut]  # a stop string must end before the EOS to win
        k = _first_stop_string_cut(body, tokenizer, stop_strings)
        if k is not None:
            cut, stopped = k, True
    ids = ids[:cut]
    text_ids = ids[:-1] if ids and ids[-1] in eos else ids
    return ids, tokenizer.decode(text_ids, skip_special_tokens=False), stopped


class _SampledLogprobs:
    """HF logits processor (run after the temperature and top-p warpers) that records the log-probability of each
    sampled token under the final distribution. A step's token is only known at the next call (it is then the last
    input id), so one step's log-softmax is held at a time: memory [batch, vocab], not [steps, batch, vocab]."""

    def __init__(self) -> None:
        self.steps: list[torch.Tensor] = []
        self.pending: Optional[torch.Tensor] = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.pending is not None:
            self.steps.append(self.pending.gather(1, input_ids[:, -1:]).squeeze(1))
        self.pending = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def per_token(self, sequences: torch.Tensor) -> torch.Tensor:
        """[batch, generated] log-probs, given generate's output (whose last id is the last step's token)."""
        if self.pending is not None:
            self.steps.append(self.pending.gather(1, sequences[:, -1:]).squeeze(1))
            self.pending = None
        return torch.stack(self.steps, 1) if self.steps else torch.zeros(len(sequences), 0)


class _OwnSampler:
    """HF logits processor (last, after the log-prob recorder) that draws each step's token with the generator's own
    `torch.Generator` and hands generate a distribution with all its mass on that token, which greedy decoding then
    picks. HF's sampling draws from the process-wide RNG, which another thread may reseed or restore at any moment
    (torch.utils.checkpoint saves and restores it around every recompute in the training thread of an async run);
    its own generator makes a seeded generate independent of whatever else the process does. `generator=None`
    draws from the process-wide RNG (an unseeded generate)."""

    def __init__(self, generator: Optional[torch.Generator]) -> None:
        self.generator = generator
        self.invalid: Optional[torch.Tensor] = None  # [rows], on the logits' device: a step had no distribution

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(scores, dim=-1)  # what HF's own sampling step draws from
        # On a CUDA tensor multinomial turns a NaN, inf or negative probability into a device-side assert, which
        # leaves the process's CUDA context unusable. Such rows are noted on the device (no host sync per token),
        # drawn from a placeholder (uniform) instead, and `raise_if_invalid` reports them after the generate call.
        invalid = ~(torch.isfinite(probs) & (probs >= 0)).all(dim=-1)
        self.invalid = invalid if self.invalid is None else self.invalid | invalid
        probs = probs.masked_fill(invalid[:, None], 1.0)
        chosen = torch.multinomial(probs, num_samples=1, generator=self.generator)
        return torch.full_like(scores, float("-inf")).scatter_(1, chosen, 0.0)

    def raise_if_invalid(self) -> None:
        """After a generate call (one host sync for the whole call): a clear error when any step of any row had NaN,
        inf or negative probabilities; the samples drawn from the placeholder are never returned."""
        invalid, self.invalid = self.invalid, None
        if invalid is not None and bool(invalid.any()):
            rows = invalid.nonzero().flatten().tolist()
            raise NonFiniteError(
                f"generation: the next-token probabilities of {len(rows)} of {len(invalid)} sequences in one generate "
                f"call (rows {rows[:8]}) held NaN, inf or negative values, so no token could be sampled: the "
                "policy's logits are not finite (diverged weights, or an fp16 overflow)"
            )


class _StopOnStrings:
    """Stopping criterion for HF generate: marks a row finished once its new tokens contain a stop string.

    Only saves compute; the exact cut is made afterwards by `finalize_response`. Per decoding step it decodes only
    the rows still running (a row that met a stop string, or whose newest token is an EOS, is never decoded again),
    and of each only a bounded tail: the work per step is at most rows x window tokens, whatever the length so far."""

    def __init__(
        self, tokenizer: Any, stop_strings: Sequence[str], prompt_width: int, eos_ids: Sequence[int] = ()
    ) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = list(stop_strings)
        self.prompt_width = prompt_width
        self.eos_ids = torch.tensor(sorted({int(i) for i in eos_ids}), dtype=torch.long)
        # Every non-special token decodes to at least one character (byte-level BPE may need a few tokens for
        # one character): a tail this long always covers a stop string that the newest token just completed.
        self.window = max(len(s) for s in self.stop_strings) * 4 + 8
        self.done: Optional[torch.Tensor] = None  # [rows] on the CPU: finished rows
        self.rows_decoded = 0  # decoded tails so far (what the per-step work is counted in)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        newest = input_ids[:, -1].cpu()
        if self.done is None:
            self.done = torch.zeros(len(input_ids), dtype=torch.bool)
        self.done |= torch.isin(newest, self.eos_ids)  # generate's own EOS check ends these rows
        running = (~self.done).nonzero().flatten()
        if len(running):
            tails = input_ids[running.to(input_ids.device), self.prompt_width :][:, -self.window :].tolist()
            self.rows_decoded += len(tails)
            texts = self.tokenizer.batch_decode(tails, skip_special_tokens=False)
            hit = torch.tensor([any(s in t for s in self.stop_strings) for t in texts], dtype=torch.bool)
            self.done[running[hit]] = True
        return self.done.to(input_ids.device)


class HFGenerator:
    """Batched generation with a transformers causal LM (`model.generate` with its KV cache).

    Prompts are left-padded and run in chunks of at most `batch_size` sequences (prompts x n), sorted by length
    so a chunk carries little padding; each chunk is one generate call with its own KV cache, so `batch_size` bounds
    that memory. Greedy outputs do not depend on `batch_size`. With `config.seed` set, the same inputs and
    `batch_size` give the same samples (the chunks draw from one seeded stream in turn, so another `batch_size` draws
    other samples) from a `torch.Generator` of the call's own: the process-wide torch RNG (CPU and CUDA) is neither
    read nor advanced, so another thread reseeding or restoring it cannot change them; with `seed=None` the
    process-wide RNG is used (and advanced).
    The generator holds a reference to a policy module, so `sync_weights` only records it and its version (the
    live policy when synchronous, a frozen copy per version under async_steps); under FSDP its
    `generation_context` gathers the sharded weights whole for the generate."""

    last_sync_seconds, last_sync_bytes = 0.0, 0  # nothing is copied: it generates with the module it was given
    in_flight_weight_updates = False

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        batch_size: int = 16,
        device: Optional[Any] = None,
        eos_token_ids: Optional[Sequence[int]] = None,
        compute_dtype: Optional[torch.dtype] = None,
        share_prompts: bool = True,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        # Default: the tokenizer's and the model's EOS. Chat models with several end-of-turn tokens may list them.
        self.eos_ids = [int(i) for i in eos_token_ids] if eos_token_ids else default_eos_token_ids(model, tokenizer)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else self.eos_ids[0]
        self.version = -1
        # bf16/fp16 runs: generate from a copy of the weights in that dtype, made once per weight version (see
        # _compute_dtype_model); None: from the module as it is.
        self.compute_dtype = compute_dtype
        self._cast_copy: Optional[Any] = None
        self.share_prompts = share_prompts
        self.prompt_tokens_shared = 0  # prompt tokens the last generate did not compute again (_shared_prompt_cache)

    @classmethod
    def from_config(cls, cfg: Any, policy: Any, tokenizer: Any, accelerator: Any, max_model_len: int) -> HFGenerator:
        """This rank's prompts x num_samples_per_prompt in generate calls of `generation_sequences_per_call`
        sequences (each call holds one KV cache)."""
        return cls(
            accelerator.unwrap_model(policy),
            tokenizer,
            batch_size=generation_sequences_per_call(cfg, max_model_len),
            compute_dtype=COMPUTE_DTYPES.get(cfg.mixed_precision),
            share_prompts=cfg.shared_prompt_generation,
        )

    def sync_weights(self, model: Any, version: Optional[int] = None) -> None:
        """Generate with `model` from now on: the live policy (synchronous), or a frozen copy of it taken at a
        version (async_steps > 0: rollouts.RolloutSampler hands one over between generate calls)."""
        self.model = model
        self.version = self.version + 1 if version is None else int(version)
        self._cast_copy = None  # new weights: the next generate makes their compute-dtype copy

    @contextlib.contextmanager
    def generation_context(self, model: Any) -> Any:
        """FSDP2: the sharded weights gathered once for the block. The compute-dtype copy made inside it is dropped
        at its end, so it takes memory while generating only (the plan's HF generation phase)."""
        try:
            with full_params(model) as gathered:
                yield gathered
        finally:
            self._cast_copy = None

    def _compute_dtype_model(self) -> Any:
        """The module to generate with. A run in bf16/fp16 without FSDP keeps fp32 weights and computes under
        autocast, whose cast cache dies with each forward: every decoding step would cast every weight again. Here
        the weights are cast once per weight version into a copy (parameters in the compute dtype, buffers such as
        rotary tables shared as they are) that generates in that dtype, like an FSDP2 policy gathered in bf16.
        Memory: the copy, compute bytes x parameters, while generating. A module already in that dtype, or sharded
        by FSDP2 (gathered in the compute dtype by generation_context), is used as it is."""
        import copy

        from torch.distributed.fsdp import FSDPModule

        model, dtype = self.model, self.compute_dtype
        params = list(model.parameters())
        if dtype is None or not params or all(p.dtype == dtype for p in params) or isinstance(model, FSDPModule):
            return model
        if self._cast_copy is None:
            memo: dict[int, Any] = {id(b): b for b in model.buffers()}
            for p in params:  # tied weights are one parameter: cast once
                if id(p) not in memo:
                    cast = p.detach().to(dtype) if p.is_floating_point() else p.detach()
                    memo[id(p)] = torch.nn.Parameter(cast, requires_grad=False)
            cast = copy.deepcopy(model, memo).eval()
            forward = cast.__dict__.get("forward")  # accelerate's autocast wrapper, add_logprob_head: bound methods
            if forward is not None and getattr(forward, "__self__", None) is not cast:
                return model  # a wrapper closed over the original module would run the fp32 weights anyway
            self._cast_copy = cast
        return self._cast_copy

    def score_tokens(
        self, prompt_ids: Sequence[Sequence[int]], continuation_ids: Sequence[Sequence[int]], top_k: int = 0
    ) -> dict[str, Any]:
        from open_instruct.generation_check import forward_scores

        was_training = self.model.training
        self.model.eval()
        try:
            scores = forward_scores(self.model, prompt_ids, continuation_ids, top_k)
        finally:
            self.model.train(was_training)
        scores.full = None  # the trainer's side keeps the whole rows; a generator reports what an engine would
        return {f"hf generator (version {self.version})": scores}

    def close(self) -> None:
        return None

    def _hf_generation_config(self, config: GenerationConfig) -> Any:
        from transformers import GenerationConfig as HFGenerationConfig

        kwargs: dict[str, Any] = dict(
            max_new_tokens=config.max_new_tokens,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            use_cache=True,
            num_beams=1,
            repetition_penalty=1.0,
        )
        # Greedy decoding whatever the config: a sampled run draws its tokens in `_OwnSampler`, and temperature and
        # top-p are applied by `_warpers`, ahead of the log-prob recorder. Greedy decoding ignores the sampling
        # knobs; they are set to the values transformers does not warn about under greedy, so that the model's own
        # generation_config (temperature 0.7, top_k 20, ...) is not merged in to be warned about on every call
        kwargs.update(do_sample=False, temperature=1.0, top_p=1.0, top_k=50)
        return HFGenerationConfig(**kwargs)

    @staticmethod
    def _warpers(config: GenerationConfig) -> list[Any]:
        """Temperature, then min-p, top-k, top-p (HF's own warpers, in vLLM's order rather than transformers' own
        top-k, top-p, min-p: one order for every backend, models.SamplingTruncation), passed as custom processors:
        generate runs custom processors before the warpers it builds itself, so this is how the recorder after them
        sees the final distribution."""
        from transformers.generation.logits_process import (
            MinPLogitsWarper,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        if config.greedy:
            return []
        warpers: list[Any] = [TemperatureLogitsWarper(float(config.temperature))] if config.temperature != 1.0 else []
        warpers += [MinPLogitsWarper(min_p=float(config.min_p))] if config.min_p > 0.0 else []
        warpers += [TopKLogitsWarper(top_k=int(config.top_k))] if config.top_k > 0 else []
        return warpers + ([TopPLogitsWarper(top_p=float(config.top_p))] if config.top_p < 1.0 else [])

    def _generate_chunk(
        self, rows: list[list[int]], config: GenerationConfig, hf_config: Any, sampler: list[Any]
    ) -> tuple[list[list[int]], list[list[float]]]:
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            if r:
                input_ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
                attention_mask[i, width - len(r) :] = 1
        from transformers import LogitsProcessorList, StoppingCriteriaList

        extra: dict[str, Any] = {}
        if config.stop_strings:
            extra["stopping_criteria"] = StoppingCriteriaList(
                [_StopOnStrings(self.tokenizer, config.stop_strings, width, self.eos_ids)]
            )
        recorder = _SampledLogprobs()  # after the warpers: it sees the distribution the token is drawn from
        model = self._compute_dtype_model()
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        if self.share_prompts:
            extra.update(self._shared_prompt_cache(model, rows, input_ids, attention_mask))
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=hf_config,
            logits_processor=LogitsProcessorList([*self._warpers(config), recorder, *sampler]),
            **extra,
        )
        for own_sampler in sampler:
            own_sampler.raise_if_invalid()
        return out[:, width:].tolist(), recorder.per_token(out).tolist()

    def _shared_prompt_cache(
        self, model: Any, rows: list[list[int]], input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> dict[str, Any]:
        """The key/value cache of a chunk's prompts but their last token, each distinct prompt computed once and its
        cache repeated for the rows that sample from it (a GRPO group's n samples), handed to generate, which then
        runs only the last prompt token and the new ones. At 500-token prompts and n = 4 this removes three
        quarters of the prefill, which on a CPU was most of a 128-token generation. The same numbers as the
        unshared prefill within float rounding (the prefix runs at another batch size and the last prompt token one
        step later); greedy tokens equal (tests/test_generation.py). {} (generate prefills every row) when no
        two rows share a prompt, a prompt has one token, the model's generation_config asks for another cache
        (`cache_implementation`), or its forward returns no cache."""
        slot: dict[tuple[int, ...], int] = {}  # prompt -> its index among the distinct ones
        first: list[int] = []  # per distinct prompt: its first row
        owner: list[int] = []  # per row: its distinct prompt
        for j, row in enumerate(rows):
            key = tuple(row)
            if key not in slot:
                slot[key] = len(first)
                first.append(j)
            owner.append(slot[key])
        if len(first) == len(rows) or input_ids.shape[1] < 2:
            return {}
        if getattr(getattr(model, "generation_config", None), "cache_implementation", None) is not None:
            return {}
        mask = attention_mask[first]
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as generate makes them from the mask
        # the prefix's logits are not needed: only the last position's when the model can keep only that (a peft
        # wrapper passes the keyword on to the model it wraps)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(base.forward).parameters else {}
        out = model(
            input_ids=input_ids[first, :-1],
            attention_mask=mask[:, :-1],
            position_ids=positions[:, :-1],
            use_cache=True,
            **keep,
        )
        name = kv_cache_name(out)
        if name is None:
            return {}
        cache = out[name]
        cache.batch_select_indices(torch.tensor(owner, device=input_ids.device))
        self.prompt_tokens_shared += int(attention_mask[:, :-1].sum() - mask[:, :-1].sum())
        return {name: cache}

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        config: GenerationConfig,
        max_new_tokens: Optional[Sequence[int]] = None,
    ) -> GenerationOutput:
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("every prompt needs at least one token")
        budgets = new_token_budgets(prompt_ids, config, max_new_tokens)
        batch_size = config.max_batch_size or self.batch_size
        rows = [list(p) for p in prompt_ids for _ in range(config.n)]
        owner = [i for i in range(len(prompt_ids)) for _ in range(config.n)]
        order = sorted(range(len(rows)), key=lambda j: len(rows[j]))  # stable: the n copies stay together
        hf_config = self._hf_generation_config(replace(config, max_new_tokens=max(budgets, default=1)))
        raw: list[Optional[list[int]]] = [None] * len(rows)
        raw_logprobs: list[list[float]] = [[] for _ in rows]

        was_training = self.model.training
        self.model.eval()
        self.prompt_tokens_shared = 0
        sampler: list[Any] = []
        if not config.greedy:
            generator = None
            if config.seed is not None:  # this call's own stream, on the device the logits are on
                generator = torch.Generator(device=self.device)
                generator.manual_seed(config.seed)
            sampler = [_OwnSampler(generator)]
        try:
            for start in range(0, len(order), batch_size):
                chunk = order[start : start + batch_size]
                ids, logprobs = self._generate_chunk([rows[j] for j in chunk], config, hf_config, sampler)
                for j, gen, lp in zip(chunk, ids, logprobs):
                    raw[j], raw_logprobs[j] = gen, lp
        finally:
            self.model.train(was_training)

        out = GenerationOutput(prompt_ids=[list(p) for p in prompt_ids])
        for j, gen in enumerate(raw):
            # a shorter budget: the first budget tokens of a longer sample are a sample of that budget
            capped = (gen or [])[: budgets[owner[j]]]
            ids, text, stopped = finalize_response(capped, self.eos_ids, self.tokenizer, config.stop_strings)
            out.response_ids.append(ids)
            out.texts.append(text)
            out.stopped.append(stopped)
            out.prompt_index.append(owner[j])
            out.logprobs.append(raw_logprobs[j][: len(ids)])
            out.weight_versions.append([self.version] * len(ids))
        return out
