"""Generation you can trust: the generator must serve the trainer's weights and sample from the trainer's distribution.

    checker = GenerationChecker.from_config(cfg, generator, policy, tokenizer, accelerator, max_model_len)
    checker.sync(policy, version)     # every weight sync: under a deadline, then the probe fingerprint (one retry)
    checker.last                      # for the rollout's row: check/ (an engine's fingerprint), time/generation_check
    mismatch_token_sums(...)          # per rollout: sampler-vs-trainer sums behind the mismatch/ metrics

The probe is a few fixed prompts and continuations (token ids of fixed text). Both sides score it: the generator
returns its log-probs of the given continuation tokens (and its top-k per position), the trainer runs its own forward
(its dtype, its autocast). Compared per continuation token: |dlogp| mean and max, and a KL estimate over the
vocabulary: KL(generator || trainer) between the two distributions coarsened to the generator's top-k tokens plus one
bucket for the rest (a lower bound of the full KL, by the data-processing inequality).

- The first sync is the launch check: beyond the limits the run stops before any rollout, naming the numbers and the
  likely cause. `generation_check: warn` logs instead of stopping (the explicit override); `off` skips the checks.
- Every later sync is checked the same way (the fingerprint: the probe's log-probs recomputed on both sides, so a
  tensor not delivered, a corrupted one, an adapter left unmerged or a sync that sent nothing shows as a gap). A
  failed check re-sends the weights once, then stops the run; when the engine's answers match the previous version's
  better than the current one the error says the previous version is still being served.
- Every sync has a deadline (`weight_sync_timeout`): a transfer that does not finish raises, naming the engine(s).

Limits follow from the run's compute dtype and the size of the logits (docs/trusted-generation.md explains them): with
eps the machine epsilon of the precision a matmul may run in (bf16: 2^-7; fp32 and fp16: 2^-10, as GPU fp32 matmuls
may run in TF32) and S the trainer's logit standard deviation on the probe, |dlogp| mean <= 2 eps S, max <= 16 eps S,
KL <= 2 (eps S)^2, each times `generation_check_scale`. A generator with other weights is off by O(S); one computing
in bf16 where the run says fp32 by about eps_bf16 S / 2.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch

# Fixed probe text: ordinary prose, code and arithmetic (whatever the tokenizer, these are in-distribution tokens).
PROBE_TEXTS = (
    "The capital of France is Paris. It lies on the Seine and is known for its museums.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Question: what is 12 times 7? Answer: 12 times 7 is 84.",
    "Once upon a time, a small robot learned to paint the sky at dusk.",
)
PROBE_TOP_K = 20  # generator-side top-k per position for the KL estimate (vLLM's default max_logprobs is 20)
# After a sync, the first probe sequence only: it passes through every layer, so any weight the sync missed moves it;
# the launch check scores all of them (its job is the distribution, where more tokens give a steadier estimate).
POST_SYNC_SEQUENCES = 1
MAX_PROBE_TOKENS = 48  # per sequence: the probe stays a few hundred tokens whatever the tokenizer


class GenerationCheckError(RuntimeError):
    """The generator does not serve what the trainer holds (launch or post-sync check), or a sync missed its
    deadline. The message names the numbers, the limits, the engine and the likely cause."""


@dataclass
class Probe:
    prompts: list[list[int]]
    continuations: list[list[int]]


def make_probe(tokenizer: Any, max_model_len: int) -> Probe:
    """The fixed probe: each text's token ids, the first third the prompt and the rest the scored continuation."""
    prompts, continuations = [], []
    width = min(MAX_PROBE_TOKENS, max_model_len - 1)
    for text in PROBE_TEXTS:
        ids = [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]][:width]
        if len(ids) < 4:
            raise ValueError(f"the generation-check probe {text!r} tokenizes to {len(ids)} tokens (need >= 4)")
        cut = max(1, len(ids) // 3)
        prompts.append(ids[:cut])
        continuations.append(ids[cut:])
    return Probe(prompts, continuations)


@dataclass
class TokenScores:
    """One side's scores of the probe: per sequence, the log-prob of each continuation token, and (where offered)
    per position the top-k {token id: log-prob}; the trainer also keeps the whole log-softmax rows (`full`)."""

    logprobs: list[list[float]]
    top: Optional[list[list[dict[int, float]]]] = None
    full: Optional[list[torch.Tensor]] = None  # per sequence [continuation, vocab] float32 log-probs


def forward_scores(
    model: Any, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]], top_k: int = 0
) -> TokenScores:
    """A causal LM's scores of each continuation after its prompt (one sequence per forward: no padding to differ
    from the engine). Collective under FSDP: every rank calls it with the same probe."""
    device = next(model.parameters()).device
    scores = TokenScores([], [] if top_k else None, [])
    with torch.no_grad():
        for prompt, cont in zip(prompts, continuations):
            ids = torch.tensor([list(prompt) + list(cont)], device=device)
            logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1].float()
            logp = torch.log_softmax(logits, dim=-1).cpu()
            scores.full.append(logp)
            scores.logprobs.append(logp.gather(1, torch.tensor(list(cont))[:, None]).squeeze(1).tolist())
            if top_k:
                values, index = logp.topk(top_k, dim=-1)
                scores.top.append([dict(zip(i.tolist(), v.tolist())) for i, v in zip(index, values)])
    return scores


@dataclass
class Comparison:
    """Generator vs trainer on the probe's continuation tokens."""

    abs_mean: float
    abs_max: float
    kl: Optional[float]  # mean per position of the top-k-coarsened KL(generator || trainer); None without top-k
    tokens: int

    def text(self) -> str:
        kl = "n/a" if self.kl is None else f"{self.kl:.3g}"
        return f"|dlogp| mean {self.abs_mean:.3g}, max {self.abs_max:.3g}, KL {kl} over {self.tokens} tokens"


def coarse_kl(engine_top: dict[int, float], trainer_row: torch.Tensor) -> float:
    """KL(p || q) between p = the generator's distribution and q = the trainer's, both coarsened to the generator's
    top-k tokens plus one bucket for every other token: a lower bound of the full KL (data-processing inequality)."""
    ids = torch.tensor(list(engine_top), dtype=torch.long)
    log_p = torch.tensor(list(engine_top.values()), dtype=torch.float64)
    log_q = trainer_row.double()[ids]
    p, q = log_p.exp(), log_q.exp()
    kl = float((p * (log_p - log_q)).sum())
    rest_p, rest_q = max(1.0 - float(p.sum()), 0.0), max(1.0 - float(q.sum()), 1e-300)
    if rest_p > 0:
        kl += rest_p * math.log(rest_p / rest_q)
    return max(kl, 0.0)


def head(scores: TokenScores, n: int) -> TokenScores:
    """The scores of the first n probe sequences."""
    return TokenScores(
        scores.logprobs[:n],
        None if scores.top is None else scores.top[:n],
        None if scores.full is None else scores.full[:n],
    )


def compare(engine: TokenScores, trainer: TokenScores) -> Comparison:
    gaps = [abs(a - b) for e, t in zip(engine.logprobs, trainer.logprobs) for a, b in zip(e, t)]
    if len(gaps) != sum(len(t) for t in trainer.logprobs) or not all(map(math.isfinite, gaps)):
        return Comparison(math.inf, math.inf, None, len(gaps))  # missing or non-finite scores: no match
    kl = None
    if engine.top is not None and trainer.full is not None:
        kls = [coarse_kl(top, row) for tops, full in zip(engine.top, trainer.full) for top, row in zip(tops, full)]
        kl = sum(kls) / max(len(kls), 1)
    return Comparison(sum(gaps) / len(gaps), max(gaps), kl, len(gaps))


def matmul_eps(dtype: torch.dtype) -> float:
    """Machine epsilon of the precision a matmul in `dtype` may run in: bf16 2^-7, fp16 2^-10, fp32 2^-10 (TF32
    tensor cores keep 10 mantissa bits; a CPU fp32 matmul is more precise, so the limit is loose there)."""
    return {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}.get(dtype, 2.0**-10)


def logit_scale(trainer: TokenScores) -> float:
    """The typical size of the trainer's logits on the probe: the standard deviation over the vocabulary of each
    position's log-probs (= of its logits), averaged over positions. Rounding errors scale with it."""
    return float(torch.cat(trainer.full).std(dim=-1).mean())


@dataclass(frozen=True)
class Limits:
    abs_mean: float
    abs_max: float
    kl: float

    @classmethod
    def for_dtype(cls, dtype: torch.dtype, logit_std: float, scale: float = 1.0) -> Limits:
        """|dlogp| mean <= 2 eps S, max <= 16 eps S, KL <= 2 (eps S)^2 (S: logit_std), each x `scale`."""
        unit = matmul_eps(dtype) * logit_std
        return cls(2 * unit * scale, 16 * unit * scale, 2 * unit * unit * scale)

    def exceeded(self, c: Comparison) -> list[str]:
        """The limits a comparison exceeds, as text (empty: within every limit)."""
        out = []
        if not c.abs_mean <= self.abs_mean:
            out.append(f"mean {self.abs_mean:.3g}")
        if not c.abs_max <= self.abs_max:
            out.append(f"max {self.abs_max:.3g}")
        if c.kl is not None and not c.kl <= self.kl:
            out.append(f"KL {self.kl:.3g}")
        return out

    def margin(self, c: Comparison) -> float:
        """The smallest limit / measure ratio (> 1: passed with that margin; capped at 1e6, e.g. identical scores)."""
        pairs = [(self.abs_mean, c.abs_mean), (self.abs_max, c.abs_max)] + (
            [(self.kl, c.kl)] if c.kl is not None else []
        )
        return min(min(limit / measure, 1e6) if measure > 0 else 1e6 for limit, measure in pairs)


def run_with_deadline(call: Callable[[], Any], seconds: float, what: str) -> Any:
    """call() in a daemon thread; GenerationCheckError naming `what` when it has not returned within `seconds` (the
    thread is left behind: the run stops). The CUDA device of the caller is the thread's too."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    result: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            result["value"] = call()
        except BaseException as e:  # re-raised in the caller
            result["error"] = e
        finally:
            done.set()

    threading.Thread(target=target, daemon=True, name="weight-sync").start()
    if not done.wait(seconds):
        raise GenerationCheckError(
            f"the weight sync to {what} did not finish within weight_sync_timeout {seconds:g}s: the transfer hangs "
            f"(an engine stuck or dead, or a collective that another rank never joined)"
        )
    if "error" in result:
        raise result["error"]
    return result.get("value")


def engine_names(generator: Any) -> str:
    """The engine(s) a generator talks to, for error messages."""
    urls = getattr(generator, "urls", None)
    if urls:
        return ", ".join(f"vLLM engine {k} ({u})" for k, u in enumerate(urls))
    return f"the {type(generator).__name__}"


@dataclass
class GenerationChecker:
    """The launch check (first sync) and the post-sync fingerprint of a generator against the trainer's policy; see
    the module docstring. `mode`: stop | warn | off."""

    generator: Any
    policy: Any
    probe: Probe
    dtype: torch.dtype = torch.float32  # the run's compute dtype: the limits follow from it
    scale: float = 1.0  # generation_check_scale
    mode: str = "stop"
    sync_timeout: float = 600.0
    autocast: Callable[[], ContextManager[Any]] = field(default=lambda: torch.autocast("cpu", enabled=False))
    launched: bool = False
    previous: Optional[TokenScores] = None  # the trainer's probe scores at the last checked version
    # for the rollout's row: the last sync's fingerprint (check/) and the seconds it spent checking (time/)
    last: dict[str, float] = field(default_factory=dict)
    at_launch: dict[str, float] = field(default_factory=dict)  # the launch check's numbers (all sequences, KL)

    @classmethod
    def from_config(
        cls, cfg: Any, generator: Any, policy: Any, tokenizer: Any, accelerator: Any, max_model_len: int
    ) -> GenerationChecker:
        from open_instruct.models import DTYPES

        return cls(
            generator,
            policy,
            make_probe(tokenizer, max_model_len),
            DTYPES[cfg.mixed_precision],
            cfg.generation_check_scale,
            cfg.generation_check,
            cfg.weight_sync_timeout,
            accelerator.autocast,
        )

    # ------------------------------------------------------------------------------------------------ scoring
    def trainer_scores(self, n: int) -> TokenScores:
        """The trainer's forward of the first n probe sequences as it scores rollouts: the prepared (maybe sharded)
        policy under the run's autocast (FSDP gathers layer by layer, as in training: every rank calls it)."""
        with self.autocast():
            return forward_scores(self.policy, self.probe.prompts[:n], self.probe.continuations[:n])

    def generator_scores(self, n: int, top_k: int) -> dict[str, TokenScores]:
        with self.generator.generation_context(self.policy):
            return self.generator.score_tokens(self.probe.prompts[:n], self.probe.continuations[:n], top_k)

    # ------------------------------------------------------------------------------------------------ checks
    def sync(self, model: Any, version: int) -> None:
        """generator.sync_weights(model, version) under the deadline, then the check (the launch check the first
        time); a failed post-sync check re-sends once before it stops the run."""
        what = engine_names(self.generator)
        run_with_deadline(lambda: self.generator.sync_weights(model, version), self.sync_timeout, what)
        own_module = getattr(self.generator, "model", None) is model  # hf: it samples with the trainer's own module
        self.last = {"time/generation_check": 0.0}
        if self.mode == "off" or (self.launched and own_module):
            return  # nothing was copied: nothing to check after a sync
        t0 = time.perf_counter()
        failure, trainer, row = self.check(version)
        if failure and self.launched:  # a sync that went wrong once: send again, then judge
            warnings.warn(f"generation check after weight sync {version} failed, re-sending once: {failure}")
            run_with_deadline(lambda: self.generator.sync_weights(model, version), self.sync_timeout, what)
            failure, trainer, row = self.check(version)
        launch = not self.launched
        self.launched, self.previous = True, trainer
        # the rows carry the fingerprint of every sync to an engine (the same measure at launch and after, so a
        # resumed run logs what an uninterrupted one does); hf's rows carry none
        self.last = {**({} if own_module else row), "time/generation_check": time.perf_counter() - t0}
        if failure:
            self.fail(failure, launch)

    def launch_only(self) -> None:
        """The launch check without a sync (a generator that already holds the policy, e.g. hf with async copies)."""
        self.last = {"time/generation_check": 0.0}
        if not self.launched and self.mode != "off":
            t0 = time.perf_counter()
            failure, self.previous, _ = self.check(getattr(self.generator, "version", 0))
            self.launched = True
            self.last["time/generation_check"] = time.perf_counter() - t0
            if failure:
                self.fail(failure, launch=True)

    def check(self, version: int) -> tuple[Optional[str], TokenScores, dict[str, float]]:
        """Compare every engine with the trainer on the probe: the failure text (None: passed), the trainer's scores,
        and the check/ row: the fingerprint (the first POST_SYNC_SEQUENCES sequences) of the engine closest to its
        limits. An engine that fails but matches the previously checked version is named as serving that one. The
        launch check's own numbers (all sequences, KL) go to `at_launch` and a printed line."""
        launch = not self.launched
        n = len(self.probe.prompts) if launch else POST_SYNC_SEQUENCES
        trainer = self.trainer_scores(n)
        engines = self.generator_scores(n, PROBE_TOP_K if launch else 0)
        previous, limits = self.previous, Limits.for_dtype(self.dtype, logit_scale(trainer), self.scale)
        if previous is not None:  # the launch check's scores: the sequences this check has
            previous = head(previous, n)
        trainer_fp = head(trainer, POST_SYNC_SEQUENCES)
        fp_limits = Limits.for_dtype(self.dtype, logit_scale(trainer_fp), self.scale)
        failures, worst, worst_fp = [], None, None
        for name, scores in engines.items():
            c = compare(scores, trainer)
            fp = compare(head(scores, POST_SYNC_SEQUENCES), trainer_fp)
            if worst is None or limits.margin(c) < limits.margin(worst):
                worst = c
            if worst_fp is None or fp_limits.margin(fp) < fp_limits.margin(worst_fp):
                worst_fp = fp
            beyond = limits.exceeded(c)
            if beyond:
                failures.append(
                    f"{name} at weight version {version}: {c.text()}; beyond the limits {', '.join(beyond)}"
                )
                if previous is not None:
                    old = compare(scores, previous)
                    if not limits.exceeded(old) and limits.exceeded(compare(previous, trainer)):
                        failures[-1] += "; it matches the previous version: the new weights were not applied"
        row: dict[str, float] = {}
        if worst_fp is not None:
            row = {
                "check/probe_abs_mean": worst_fp.abs_mean,
                "check/probe_abs_max": worst_fp.abs_max,
                "check/margin": fp_limits.margin(worst_fp),
            }
        if launch and worst is not None:
            self.at_launch = {"abs_mean": worst.abs_mean, "abs_max": worst.abs_max, "margin": limits.margin(worst)}
            if worst.kl is not None:
                self.at_launch["kl"] = worst.kl
            if not failures and not (torch.distributed.is_initialized() and torch.distributed.get_rank() != 0):
                print(f"generation check at launch: {worst.text()}; margin {limits.margin(worst):.3g}", flush=True)
        return "\n  ".join(failures) or None, trainer, row

    def fail(self, failure: str, launch: bool) -> None:
        if launch:
            cause = (
                "likely cause: the engine serves another model or other weights, or computes in another dtype than "
                "the run's mixed_precision (or its kernels differ more than that precision explains)"
            )
            what = "launch check: the generator does not reproduce the trainer's log-probs on the probe"
        else:
            cause = (
                "likely cause: the weight sync did not deliver every tensor (skipped, corrupted, an adapter not "
                "merged) or the engine still serves an earlier version; re-sending once did not fix it"
            )
            what = "post-sync check: the generator does not serve the weights the trainer sent"
        message = (
            f"{what}:\n  {failure}\n{cause}. Limits from the compute dtype (docs/trusted-generation.md); "
            f"override with --generation_check warn (log and go on) or --generation_check_scale"
        )
        if self.mode == "warn":
            warnings.warn(message)
            return
        raise GenerationCheckError(message)


# ---------------------------------------------------------------------------------------------------- mismatch/
def mismatch_sum_keys(async_steps: int) -> tuple[str, ...]:
    """The per-rollout sums behind the mismatch/ metrics (besides the loop's tokens and sampler_abs_diff): k3 and
    tokens beyond the TIS cap; under async also |dlogp| and tokens per version lag 0..async_steps."""
    per_lag = [f"mismatch_{what}_lag_{k}" for k in range(async_steps + 1) for what in ("abs", "tokens")]
    return ("mismatch_k3_sum", "mismatch_beyond_cap", *(per_lag if async_steps else ()))


def mismatch_token_sums(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    tis_cap: float,
    token_lags: Optional[Sequence[Sequence[int]]] = None,
    async_steps: int = 0,
) -> dict[str, torch.Tensor]:
    """Per micro-batch sums behind the mismatch/ metrics, r = trainer logp - sampler logp on the loss-mask tokens
    (policy tokens only in multi-turn episodes): k3 = exp(r) - 1 - r (an unbiased per-token estimate of
    KL(sampler || trainer) on the sampled tokens), tokens whose TIS ratio exp(r) exceeds tis_cap, max |r|, and under
    async (`token_lags`: per row, the version lag of each policy token in order) |r| and tokens per lag.

    0-dim tensors on log_ratio's device, computed with masks rather than boolean indexing: no host sync (the update
    reads them once per rollout)."""
    on = mask > 0
    r = log_ratio.float().masked_fill(~on, 0.0)
    sums = {
        "mismatch_k3_sum": (torch.expm1(r) - r).sum(),  # 0 where masked: expm1(0) - 0
        "mismatch_beyond_cap": ((r > math.log(tis_cap)) & on).sum().float(),
        "mismatch_abs_max": r.abs().max() if r.numel() else r.new_zeros(()),
    }
    if async_steps and token_lags is not None:
        # lags listed per policy token in order: the i-th policy token of a row (cumsum of the mask) takes lags[i];
        # built on the host from the lists, so only a host-to-device copy (pinned, non-blocking on a GPU)
        from open_instruct.data import host_to_device

        width = max(mask.shape[1], max((len(lags) for lags in token_lags), default=0))
        padded = torch.full((len(token_lags), width), -1, dtype=torch.long)
        for i, lags in enumerate(token_lags):
            padded[i, : len(lags)] = torch.tensor(list(lags), dtype=torch.long)
        nth = (on.long().cumsum(dim=1) - 1).clamp(min=0)
        lag = torch.where(on, host_to_device(padded, log_ratio.device).gather(1, nth), -1)
        for k in range(async_steps + 1):
            at = lag == k
            sums[f"mismatch_abs_lag_{k}"] = (r.abs() * at).sum()
            sums[f"mismatch_tokens_lag_{k}"] = at.sum().float()
    return sums


def mismatch_metrics(sums: dict[str, float], abs_max: float, async_steps: int = 0) -> dict[str, float]:
    """The mismatch/ row from rollout-wide sums (tokens, sampler_abs_diff, mismatch_sum_keys) and the max |dlogp|."""
    tokens = max(sums["tokens"], 1.0)
    row = {
        "mismatch/abs_mean": sums["sampler_abs_diff"] / tokens,
        "mismatch/abs_max": abs_max,
        "mismatch/k3_kl": sums["mismatch_k3_sum"] / tokens,
        "mismatch/beyond_tis_cap": sums["mismatch_beyond_cap"] / tokens,
    }
    for k in range(async_steps + 1) if async_steps else ():
        n = sums[f"mismatch_tokens_lag_{k}"]
        row[f"mismatch/abs_mean_lag_{k}"] = sums[f"mismatch_abs_lag_{k}"] / n if n else 0.0
    return row


def mismatch_warnings(row: dict[str, float], warn_kl: float, warn_beyond_cap: float) -> list[str]:
    """Warning lines for a rollout whose mismatch crosses the documented levels."""
    lines = []
    if row["mismatch/k3_kl"] > warn_kl:
        lines.append(f"mismatch/k3_kl {row['mismatch/k3_kl']:.3g} > mismatch_warn_kl {warn_kl:g}")
    if row["mismatch/beyond_tis_cap"] > warn_beyond_cap:
        lines.append(
            f"mismatch/beyond_tis_cap {row['mismatch/beyond_tis_cap']:.3g} > mismatch_warn_beyond_cap "
            f"{warn_beyond_cap:g}"
        )
    return lines
