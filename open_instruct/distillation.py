"""On-policy distillation: a frozen teacher scores the tokens the student sampled (rl_algorithms.py's `distill` row).

Two objectives (`distill_loss`), both over the student's own samples and only on policy tokens (the loss mask):

    reverse_kl  the sampled-token reverse KL as a dense per-token advantage, trained by the ordinary policy loss:
                    A_t = teacher_kl_weight * (log pi_teacher(y_t) - log pi_student(y_t))      (no discount)
                its expectation under the student is -KL(pi_student || pi_teacher) per position
                (rl_algorithms.teacher_advantages, in the `distill` estimator)
    jsd         the full-distribution generalized JSD of TRL's `beta` (here `distill_jsd_beta`) as a loss term,
                    loss_t = teacher_kl_weight * JSD_beta(p_student(.|y_<t) , p_teacher(.|y_<t))
                computed from both models' last hidden states and output layers a chunk of tokens at a time, so no
                [tokens, vocab] logits of either model are kept (chunked_generalized_jsd)

The teacher needs no checkpoint state: it is frozen, loaded again from `teacher_model_name_or_path` on resume.
Several teachers (`teacher_models`, TRL's MOPD): each training row names its own (`teacher_column`), its tokens are
scored by that teacher only (routed_teacher_logprobs), the metrics break down per teacher (TeacherRoutes).

All it does in a run is below, plugged into rlvr_ppo.py's hooks (rlvr_ppo.features_of): `teacher_scores` (each
no-grad micro-batch of collect_rollout: the teacher's log-prob of every sampled token, which the `distill` estimator
reads), under jsd `student_forward` and `jsd_loss_term` (the update), `teacher_kl_sums` and `metrics` (the log row);
`check_teacher` before any model loads.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from open_instruct.errors import ConfigError

JSD_CHUNK_TOKENS = 1024  # tokens whose [chunk, vocab] logits (both models, fp32) are alive at once


def generalized_jsd(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    beta: float,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
) -> torch.Tensor:
    """Per-position generalized JSD between softmax(student_logits / T) and softmax(teacher_logits / T), [..., V] ->
    [...], in float32, as TRL 1.16 defines `beta`:

        beta = 0:   KL(p_t || p_s)                                   (forward KL)
        beta = 1:   KL(p_s || p_t)                                   (reverse KL)
        else:       beta * KL(p_t || m) + (1 - beta) * KL(p_s || m),   m = (1 - beta) p_s + beta p_t

    top_k: both distributions restricted to the teacher's k most likely tokens at that position and renormalised
    there (the divergence of the truncated distributions; k >= vocabulary is the full one)."""
    zs, zt = student_logits.float() / temperature, teacher_logits.float() / temperature
    if top_k is not None and top_k < zt.shape[-1]:
        index = zt.topk(top_k, dim=-1).indices
        zs, zt = zs.gather(-1, index), zt.gather(-1, index)
    log_ps, log_pt = F.log_softmax(zs, -1), F.log_softmax(zt, -1)
    if beta == 0.0:
        return (log_pt.exp() * (log_pt - log_ps)).sum(-1)
    if beta == 1.0:
        return (log_ps.exp() * (log_ps - log_pt)).sum(-1)
    log_m = torch.logaddexp(log_ps + math.log(1.0 - beta), log_pt + math.log(beta))
    return beta * (log_pt.exp() * (log_pt - log_m)).sum(-1) + (1.0 - beta) * (log_ps.exp() * (log_ps - log_m)).sum(-1)


def _full_weight(weight: torch.Tensor) -> torch.Tensor:
    """A sharded (FSDP2 DTensor) output-layer weight gathered once, so the chunks below do not each re-gather it."""
    full_tensor = getattr(weight, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else weight


def _head_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Output-layer logits of hidden states, the matmul in the dtype autocast picks (bf16 under bf16), as float32."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    bias = None if bias is None else bias.to(dtype)
    return F.linear(hidden.to(dtype), weight.to(dtype), bias).float()


def chunked_generalized_jsd(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    beta: float,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    student_bias: Optional[torch.Tensor] = None,
    teacher_bias: Optional[torch.Tensor] = None,
    chunk: int = JSD_CHUNK_TOKENS,
) -> torch.Tensor:
    """generalized_jsd per token [N] of hidden states [N, H_s] / [N, H_t] under each model's output layer ([V, H]),
    `chunk` tokens at a time. Each chunk is checkpointed: the forward keeps no logits, the backward recomputes the
    chunk's (gradients reach the student's hidden states and output layer; the teacher's side gets none). Memory:
    two [chunk, V] fp32 logits (plus their softmaxes) instead of [N, V] for each model."""
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(
            f"student and teacher output layers differ in vocabulary: {student_weight.shape[0]} vs "
            f"{teacher_weight.shape[0]}"
        )
    student_weight, teacher_weight = _full_weight(student_weight), _full_weight(teacher_weight).detach()
    teacher_hidden = teacher_hidden.detach()

    def piece(h_s: torch.Tensor, w_s: torch.Tensor, b_s: Optional[torch.Tensor], h_t: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            teacher_logits = _head_logits(h_t, teacher_weight, teacher_bias)
        return generalized_jsd(_head_logits(h_s, w_s, b_s), teacher_logits, beta, temperature, top_k)

    parts = []
    for s in range(0, len(student_hidden), chunk):
        args = (student_hidden[s : s + chunk], student_weight, student_bias, teacher_hidden[s : s + chunk])
        if torch.is_grad_enabled() and (student_hidden.requires_grad or student_weight.requires_grad):
            parts.append(checkpoint(piece, *args, use_reentrant=False))
        else:
            parts.append(piece(*args))
    return torch.cat(parts) if parts else student_hidden.new_zeros(0, dtype=torch.float32)


def _unwrapped(model: Any) -> Any:
    """The language model inside a DDP wrapper (which has no get_output_embeddings); others as they are (FSDP2
    shards the module in place, peft forwards the call)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


@contextlib.contextmanager
def output_layer_inputs(model: Any, skip_output_layer: bool) -> Iterator[list[torch.Tensor]]:
    """Record what the model's output layer receives (its last hidden states, [B, K, H]) during forwards in the block.

    skip_output_layer: the layer returns a [B, K, 1] zero instead of its logits (a frozen teacher whose distribution
    is only needed chunk by chunk: no [B, K, V] logits at all); else it runs as usual (the student, whose sampled-token
    log-probs the policy loss still takes from its logits). The layer is entered through its module call, so FSDP's
    hooks around it (gathering a sharded weight) run as for any forward."""
    head = _unwrapped(model).get_output_embeddings()
    captured: list[torch.Tensor] = []
    original, previous = head.forward, vars(head).get("forward")  # an instance forward set before (fp32_head)

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        captured.append(x)
        return x.new_zeros(*x.shape[:-1], 1) if skip_output_layer else original(x, *args, **kwargs)

    head.forward = forward
    try:
        yield captured
    finally:
        if previous is None:
            del head.forward
        else:
            head.forward = previous


def response_hidden(captured: list[torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The hidden states predicting each response token, [B, R, H], from what output_layer_inputs recorded during one
    models.response_logits call with group 1 (padded: the last R + 1 positions, less the last; packed: the positions
    of `window_index`)."""
    if len(captured) != 1:
        raise RuntimeError(f"expected one output-layer call (response_logits with group 1), got {len(captured)}")
    hidden = captured[0]
    if "window_index" in batch:
        keep = batch["window_index"][:, :-1]
        return hidden.reshape(*keep.shape, hidden.shape[-1])
    return hidden[:, :-1]


def output_layer(model: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The output layer's weight [V, H] and bias (None without one)."""
    head = _unwrapped(model).get_output_embeddings()
    return head.weight, getattr(head, "bias", None)


def vocabulary_problem(
    student: str,
    teacher: str,
    trust_remote_code: bool = False,
    student_gguf: Optional[str] = None,
    student_tokenizer: Optional[str] = None,
) -> Optional[str]:
    """Why the teacher cannot score the student's tokens (None when it can), from the two configs' vocab_size and
    the two tokenizers' vocabularies: files only, no weights loaded (a GGUF student: its file's metadata)."""
    from transformers import AutoConfig, AutoTokenizer

    sources = ((student, {"gguf_file": student_gguf} if student_gguf else {}), (teacher, {}))
    kwargs = {"trust_remote_code": trust_remote_code}
    sizes = [getattr(AutoConfig.from_pretrained(p, **kwargs, **extra), "vocab_size", None) for p, extra in sources]
    if sizes[0] != sizes[1]:
        return f"vocab_size {sizes[0]} (student {student}) != {sizes[1]} (teacher {teacher})"
    if student_tokenizer:  # the run's tokenizer_name_or_path
        sources = ((student_tokenizer, {}), sources[1])
    vocabularies = [AutoTokenizer.from_pretrained(p, **kwargs, **extra).get_vocab() for p, extra in sources]
    if vocabularies[0] != vocabularies[1]:
        differ = sorted(set(vocabularies[0].items()) ^ set(vocabularies[1].items()), key=str)[:3]
        return (
            f"the tokenizers of student {student} ({len(vocabularies[0])} tokens) and teacher {teacher} "
            f"({len(vocabularies[1])} tokens) differ, e.g. {differ}"
        )
    return None


def check_teacher(cfg: Any) -> None:
    """Refuse (ConfigError, exit 2) before any model loads a teacher (each of teacher_models) whose vocabulary is
    not the student's: the teacher scores the student's token ids, so one id must mean one token in both."""
    from open_instruct.config import is_teacher_server

    student = cfg.model_name_or_path
    for key, teacher in cfg.teacher_settings():
        if is_teacher_server(teacher):  # the server answers, with the student's tokenization, in log-probs
            from open_instruct.models import run_tokenizer
            from open_instruct.teacher_server import check_teacher_server

            max_len = cfg.max_prompt_length + cfg.response_length
            check_teacher_server(key, teacher, run_tokenizer(cfg), max_len)
            continue
        try:
            problem = vocabulary_problem(
                student, teacher, cfg.trust_remote_code, cfg.gguf_file, cfg.tokenizer_name_or_path
            )
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"{key} {teacher!r} (student {student!r}): cannot read its config or tokenizer: {e}"
            ) from None
        if problem:
            raise ConfigError(
                f"{key} {teacher!r} cannot distil into model {student!r}: {problem}. The teacher must share the "
                "student's tokenizer."
            )


def chunked_sampled_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    labels: torch.Tensor,
    temperature: float,
    chunk: int = JSD_CHUNK_TOKENS,
) -> torch.Tensor:
    """No-grad log p(labels) [N] of hidden states [N, H] under an output layer at a temperature, chunk by chunk:

    log p(y) = z_y / T - logsumexp(z / T),   z = W h + b"""
    weight, out = _full_weight(weight), torch.empty(len(hidden), dtype=torch.float32, device=hidden.device)
    with torch.no_grad():
        for s in range(0, len(hidden), chunk):
            logits = _head_logits(hidden[s : s + chunk], weight, bias) / temperature
            out[s : s + chunk] = logits.gather(1, labels[s : s + chunk, None]).squeeze(1) - logits.logsumexp(-1)
    return out


def teacher_hidden(teacher: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The frozen teacher's last hidden states predicting each response token [B, R, H_t], without its logits."""
    from open_instruct.models import response_logits

    with torch.no_grad(), output_layer_inputs(teacher, skip_output_layer=True) as captured:
        response_logits(teacher, batch, 1.0, 1)
    return response_hidden(captured, batch)


def teacher_token_logprobs(
    teacher: Any, batch: dict[str, torch.Tensor], mask: torch.Tensor, temperature: float
) -> torch.Tensor:
    """log pi_teacher(y_t) [B, R] of the sampled response tokens at the sampling temperature, 0 off `mask` (no
    [B, R, V] logits: the output layer runs on the masked positions, a chunk at a time)."""
    hidden, keep = teacher_hidden(teacher, batch), mask > 0
    weight, bias = output_layer(teacher)
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    out[keep] = chunked_sampled_logprobs(hidden[keep], weight, bias, batch["responses"][keep], temperature)
    return out


def jsd_to_teacher(
    student: Any,
    student_captured: list[torch.Tensor],
    teacher: Any,
    t_hidden: torch.Tensor,
    batch: dict[str, torch.Tensor],
    mask: torch.Tensor,
    beta: float,
    temperature: float,
    top_k: Optional[int],
) -> torch.Tensor:
    """generalized_jsd per response token [B, R] (0 off `mask`) between the student, whose last hidden states
    output_layer_inputs recorded during its training forward (gradients flow through them and its output layer),
    and the frozen teacher, whose hidden states `t_hidden` [B, R, H_t] teacher_hidden gave."""
    keep = mask > 0
    s_hidden = response_hidden(student_captured, batch)
    (s_weight, s_bias), (t_weight, t_bias) = output_layer(student), output_layer(teacher)
    per_token = chunked_generalized_jsd(
        s_hidden[keep], s_weight, t_hidden[keep], t_weight, beta, temperature, top_k, s_bias, t_bias
    )
    out = torch.zeros(mask.shape, dtype=per_token.dtype, device=mask.device)
    return out.masked_scatter(keep, per_token)


# ---------------------------------------------------------------------------------------------------------------------
# The hooks (rlvr_ppo.Feature): what distillation adds to a rollout step


def teacher_scores(
    cfg: Any, models: Any, batch: dict[str, torch.Tensor], mask: torch.Tensor, episodes: Sequence[dict] = ()
) -> dict[str, torch.Tensor]:
    """score_batch: the teacher's log-prob of every sampled policy token (the `distill` estimator's teacher_logp);
    with teacher_models, each row's own teacher's (routed_teacher_logprobs)."""
    if models.teachers:
        return {"teacher_logp": routed_teacher_logprobs(cfg, models.teachers, batch, mask, episodes)}
    return {"teacher_logp": teacher_logprobs(models.teacher, batch, mask, cfg.temperature, episodes)}


def teacher_logprobs(
    teacher: Any, batch: dict[str, torch.Tensor], mask: torch.Tensor, temperature: float, episodes: Sequence[dict]
) -> torch.Tensor:
    """log pi_teacher(y_t) [B, R], 0 off `mask`: a loaded teacher's forward, or a teacher server's answers (each row's
    prompt and response tokens sent to it: teacher_server.TeacherServer)."""
    from open_instruct.teacher_server import TeacherServer

    if isinstance(teacher, TeacherServer):
        return teacher.token_logprobs([e["prompt_ids"] for e in episodes], batch["responses"], mask)
    return teacher_token_logprobs(teacher, batch, mask, temperature)


def teacher_of(cfg: Any, episode: dict) -> str:
    """The name of the row's teacher: its `teacher` (data.tokenize_prompts read it from teacher_column) among two
    or more teacher_models; the only one's name when there is one (TRL: a single teacher scores every row)."""
    return episode.get("teacher") if len(cfg.teacher_models) > 1 else next(iter(cfg.teacher_models))


def routed_teacher_logprobs(
    cfg: Any, teachers: dict[str, Any], batch: dict[str, torch.Tensor], mask: torch.Tensor, episodes: Sequence[dict]
) -> torch.Tensor:
    """log pi_teacher(y_t) [B, R] of each row under its own teacher (teacher_of), 0 off `mask`: each teacher's forward
    runs on the micro-batch, its output layer on its rows' tokens only. A teacher none of the rows names is skipped on
    one process; across processes every teacher runs on every micro-batch (an FSDP-sharded forward is a collective,
    and the ranks' micro-batches name different teachers)."""
    from open_instruct.teacher_server import TeacherServer

    names = [teacher_of(cfg, e) for e in episodes]
    every = torch.distributed.is_available() and torch.distributed.is_initialized()
    every = every and torch.distributed.get_world_size() > 1
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    for name, teacher in teachers.items():
        rows = torch.tensor([n == name for n in names], dtype=mask.dtype, device=mask.device)
        served = isinstance(teacher, TeacherServer)  # no collective: a server's rows only
        if (every and not served) or any(n == name for n in names):
            out += teacher_logprobs(teacher, batch, mask * rows[:, None], cfg.temperature, episodes)
    return out


class TeacherRoutes:
    """teacher_models: the training rows' teachers checked before any model loads (every row names one of them:
    TRL's rule, a missing or unknown name is an error, never a silent misroute), and the rollout_sums and metrics
    hooks with a breakdown per teacher: train/teacher_kl/<name> (each teacher's rows' tokens) and
    train/teacher_completions/<name>, beside train/teacher_kl over all of them."""

    def __init__(self, cfg: Any, train: Sequence[dict]):
        self.cfg, self.names = cfg, list(cfg.teacher_models)
        if len(self.names) < 2:
            return
        for e in train:
            name = e.get("teacher")
            if name not in cfg.teacher_models:
                what = f"names teacher {name!r}" if name is not None else f"has no {cfg.teacher_column!r}"
                raise ConfigError(
                    f"{e.get('where', 'a training row')} {what} (teacher_column {cfg.teacher_column!r}), not one of "
                    f"teacher_models {self.names}"
                )

    def rollout_sums(self, rollout: Any) -> dict[str, float]:
        sums = teacher_kl_sums(rollout)
        if len(self.names) < 2:
            return sums
        for name in self.names:
            rows = torch.tensor([teacher_of(self.cfg, e) == name for e in rollout.episodes], dtype=torch.bool)
            sums[f"teacher_completions/{name}"] = float(rows.sum())
            part = teacher_kl_sums(rollout, rows)
            sums[f"teacher_kl/{name}"], sums[f"teacher_tokens/{name}"] = part["teacher_kl"], part["teacher_tokens"]
        return sums

    def metrics(self, cfg: Any, rollout: Any, sums: dict, train: dict, updates: float, accelerator: Any) -> dict:
        row = metrics(cfg, rollout, sums, train, updates, accelerator)
        for name in self.names if len(self.names) > 1 else ():
            row[f"train/teacher_completions/{name}"] = sums[f"teacher_completions/{name}"]
            if sums[f"teacher_tokens/{name}"] > 0:  # a teacher the rollout did not draw has no kl in the row
                row[f"train/teacher_kl/{name}"] = sums[f"teacher_kl/{name}"] / sums[f"teacher_tokens/{name}"]
        return row


def student_forward(cfg: Any, models: Any, batch: dict[str, torch.Tensor]) -> tuple[Any, list[torch.Tensor]]:
    """policy_forward under jsd: the student's forward as one full-logits output-layer call that records its last
    hidden states (the JSD needs them; docs/distillation.md): its TokenScores and those hidden states."""
    from open_instruct.models import TokenScores, entropy_from_logits, response_logits, token_logprobs

    with output_layer_inputs(models.policy, skip_output_layer=False) as hidden:
        logits = response_logits(models.policy, batch, cfg.temperature, 1)
    return TokenScores(token_logprobs(logits, batch["responses"]), entropy_from_logits(logits.detach()), None), hidden


def jsd_loss_term(
    cfg: Any,
    models: Any,
    batch: dict[str, torch.Tensor],
    mask: torch.Tensor,
    w: torch.Tensor,
    hidden: list[torch.Tensor],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """loss_term under jsd: teacher_kl_weight * sum_t w_t * JSD_beta(student, teacher)_t, and that sum (jsd_loss)."""
    t_hidden = teacher_hidden(models.teacher, batch)
    divergence = jsd_to_teacher(
        models.policy, hidden, models.teacher, t_hidden, batch, mask, cfg.distill_jsd_beta, cfg.temperature,
        cfg.distill_top_k,
    )  # fmt: skip
    return cfg.teacher_kl_weight * (divergence * w).sum(), {"jsd_loss": (divergence.detach() * w).sum()}


def teacher_kl_sums(rollout: Any, rows: Optional[torch.Tensor] = None) -> dict[str, float]:
    """rollout_sums: sum over policy tokens of old_logp - teacher_logp (the sampled-token estimate of
    KL(pi_student || pi_teacher) per token), and those tokens; zeros without the student's log-probs (on-policy).
    rows: [n] bool, only those rows' tokens (one teacher's)."""
    if rollout.teacher_logp is None or rollout.on_policy:
        return {"teacher_kl": 0.0, "teacher_tokens": 0.0}
    mask = rollout.mask if rows is None else rollout.mask * rows[:, None]
    gap = ((rollout.old_logp - rollout.teacher_logp) * mask).sum()
    return {"teacher_kl": float(gap), "teacher_tokens": float(mask.sum())}


def metrics(cfg: Any, rollout: Any, sums: dict[str, float], train: dict[str, float], updates: float, _: Any) -> dict:
    """metrics: log pi_student - log pi_teacher per sampled policy token (train/teacher_kl), and loss/jsd."""
    row = {}
    if rollout.teacher_logp is not None:
        row["train/teacher_kl"] = sums["teacher_kl"] / max(sums["teacher_tokens"], 1.0)
    if cfg.distill_loss == "jsd":
        row["loss/jsd"] = train["jsd_loss"] / updates
    return row
