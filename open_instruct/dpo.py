"""Direct preference optimisation (DPO and its common variants): one loop, read top to bottom.

    python open_instruct/dpo.py configs/dpo_tiny.yaml [--key value ...]
    accelerate launch --config_file configs/accelerate/fsdp_8gpu.yaml open_instruct/dpo.py configs/dpo_8b.yaml

Each pair's chosen and rejected responses go through the policy in one concatenated forward; log-probs are summed
over response tokens only (prompt and padding masked). `--loss_type` picks the loss (formulas in the docstrings of
the loss functions below): dpo, dpo_norm (Tulu 3), ipo, simpo (reference-free), wpo; `label_smoothing` gives
conservative DPO. The loss is the mean over the pairs of the global mini-batch, whatever the split into devices
and micro-batches.

Reference log-probs are computed once, before training, by a no-grad pass of the initial policy over the train and
eval sets (in batches of per_device_eval_batch_size, shared out over the processes), and cached on disk
(safetensors) keyed by example position. The reference model is never held in memory
during training. The cache lives in `reference_cache_dir` (default: `<output_dir>/../.ref_cache`, shared by the runs
of a sweep over beta, lr or loss type) under a hash of what determines the numbers:
  - the model: name/path, revision, gguf file, config, and a fingerprint of the loaded weights (shapes, dtypes and
    the bytes of up to 4,096 evenly spaced elements of every tensor; training moves every weight, so any trained
    model differs in the sample);
  - the data as the model sees it: sha256 of the tokenized train and eval examples in order (chosen ids, rejected
    ids, prompt length), which covers the files' content, the split, max_seq_length, overlong, the columns and the
    chat template; the data sources are recorded as well;
  - the forward's precision (mixed_precision).
Only summed log-probs and token counts are stored, so every loss type reuses the same cache. A rerun with the same
settings prints "reused"; any change computes a new file. simpo needs no reference and skips the pass.

Logged per optimizer step (means over the pairs of the global mini-batch), and with the eval/ prefix on the held-out
set (at step 0, then every eval_steps): train/loss; train/rewards/chosen, rejected, margin (beta times what the loss
compares, see preference_loss); train/rewards/accuracy (chosen reward above rejected, a tie counting half: 0.5 at
step 0 where policy == reference); train/logps/chosen, rejected (summed response log-probs of the policy); lr,
perf/tokens_per_second, perf/pairs_per_second, and the four counters.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from array import array
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file or a module

from open_instruct import distributed, runtime
from open_instruct.config import DPOConfig
from open_instruct.utils import ConfigError

if TYPE_CHECKING:  # torch is imported inside functions so a bad config exits before the slow import
    import torch

REFERENCE_FREE = ("simpo",)
STAT_KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy", "logps/chosen", "logps/rejected")  # train/ and eval/
EVAL_METRICS = tuple(f"eval/{k}" for k in STAT_KEYS)
CACHE_FORMAT = 1


# ---------------------------------------------------------------------------------------------------------------------
# Losses: pure functions of per-pair tensors. "logratio" = log pi(y|x) - log pi_ref(y|x); each returns one loss per pair.


def dpo_loss(chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """Sigmoid DPO (Rafailov et al. 2023), with conservative-DPO label smoothing eps (Mitchell 2023):

        h    = chosen_logratio - rejected_logratio
        loss = -(1 - eps) * log sigmoid(beta * h) - eps * log sigmoid(-beta * h)

    eps is the assumed probability that a pair's label is flipped (0 gives plain DPO)."""
    import torch.nn.functional as F

    h = beta * (chosen_logratios - rejected_logratios)
    return -(1 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)


def ipo_loss(chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, beta: float) -> torch.Tensor:
    """IPO (Azar et al. 2023, eq. 17), beta playing the paper's tau:

        loss = (chosen_logratio - rejected_logratio - 1 / (2 * beta))^2

    The script feeds it per-token mean log-ratios, so the target margin does not scale with response length (TRL's
    reading of the paper, which its authors report the IPO authors confirmed)."""
    return (chosen_logratios - rejected_logratios - 1 / (2 * beta)) ** 2


def simpo_loss(chosen_avg_logps: torch.Tensor, rejected_avg_logps: torch.Tensor, beta: float, gamma_beta_ratio: float) -> torch.Tensor:
    """SimPO (Meng et al. 2024): reference-free, on per-token mean log-probs, with target margin gamma:

        loss = -log sigmoid(beta * (chosen_avg_logp - rejected_avg_logp) - gamma),   gamma = gamma_beta_ratio * beta"""
    import torch.nn.functional as F

    return -F.logsigmoid(beta * (chosen_avg_logps - rejected_avg_logps) - gamma_beta_ratio * beta)


def wpo_weights(chosen_avg_logps: torch.Tensor, rejected_avg_logps: torch.Tensor) -> torch.Tensor:
    """WPO pair weights (Zhou et al. 2024, "WPO: Enhancing RLHF with Weighted Preference Optimization",
    arXiv:2406.11827):

        w = exp(chosen_avg_logp + rejected_avg_logp)      (detached; in (0, 1])

    the product of the policy's length-normalised probabilities of the two responses, so pairs the current policy
    is likely to produce weigh more (off-policy data is re-weighted towards on-policy). The paper's optional "weight
    alignment" (dividing each token probability by sum_v p(v)^2) is not applied."""
    return (chosen_avg_logps + rejected_avg_logps).exp().detach()


class Logps(NamedTuple):
    """Per-pair summed response log-probs and response token counts."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor

    def averages(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.chosen / self.chosen_tokens.clamp(min=1), self.rejected / self.rejected_tokens.clamp(min=1)


def preference_loss(cfg: DPOConfig, policy: Logps, ref: Optional[Logps]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair losses, chosen rewards, rejected rewards) for cfg.loss_type.

    A reward is beta times what the loss compares: the log-ratio (summed for dpo/wpo, per-token mean for dpo_norm
    and ipo) or, for simpo, the per-token mean log-prob."""
    if cfg.loss_type == "simpo":
        chosen, rejected = policy.averages()
        return simpo_loss(chosen, rejected, cfg.beta, cfg.gamma_beta_ratio), cfg.beta * chosen.detach(), cfg.beta * rejected.detach()
    assert ref is not None
    if cfg.loss_type in ("dpo_norm", "ipo"):
        (pc, pr), (rc, rr) = policy.averages(), ref.averages()
        chosen, rejected = pc - rc, pr - rr
    else:
        chosen, rejected = policy.chosen - ref.chosen, policy.rejected - ref.rejected
    if cfg.loss_type == "ipo":
        losses = ipo_loss(chosen, rejected, cfg.beta)
    else:
        losses = dpo_loss(chosen, rejected, cfg.beta, cfg.label_smoothing)
        if cfg.loss_type == "wpo":
            losses = losses * wpo_weights(*policy.averages())
    return losses, cfg.beta * chosen.detach(), cfg.beta * rejected.detach()


def pair_stat_sums(losses: torch.Tensor, chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, policy: Logps) -> dict[str, float]:
    """Sums over pairs of the logged statistics (divided by the global pair count after the all-reduce).

    Accuracy counts a tie as half a win: before the first update the policy equals the reference, every reward is
    0 and the accuracy is 0.5 (chance), not 0."""
    import torch

    wins = (chosen_rewards > rejected_rewards).float() + 0.5 * (chosen_rewards == rejected_rewards).float()
    values = [losses.detach(), chosen_rewards, rejected_rewards, chosen_rewards - rejected_rewards, wins, policy.chosen.detach(), policy.rejected.detach()]
    return dict(zip(STAT_KEYS, torch.stack([v.float().sum() for v in values]).tolist()))  # one device sync


def policy_logps(model: Any, batch: dict[str, torch.Tensor]) -> Logps:
    """One forward over [chosen rows; rejected rows] (data.collate_preferences), split back into the two halves."""
    from open_instruct.models import sequence_logprobs

    sums, counts, _ = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["loss_mask"])
    n = len(sums) // 2
    return Logps(sums[:n], sums[n:], counts[:n], counts[n:])


def length_order(examples: list[dict]) -> list[int]:
    """Example positions sorted by padded pair length (less padding per micro-batch), ties by position."""
    return sorted(range(len(examples)), key=lambda i: (max(len(examples[i]["chosen_ids"]), len(examples[i]["rejected_ids"])), i))


# ---------------------------------------------------------------------------------------------------------------------
# Reference log-prob cache


def weights_fingerprint(model: torch.nn.Module, samples: int = 4096) -> str:
    """sha256 over every tensor's name, shape, dtype and the bytes of up to `samples` evenly spaced elements."""
    import torch

    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // samples)
        sample = flat[::step][:samples].cpu().contiguous()
        h.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        h.update(sample.view(torch.uint8).numpy().tobytes() if sample.numel() else b"")
    return h.hexdigest()


def tokens_fingerprint(examples: list[dict[str, Any]]) -> str:
    """sha256 of the tokenized pairs in order: the data exactly as the model sees it."""
    h = hashlib.sha256()
    for e in examples:
        h.update(array("q", [e["prompt_len"], len(e["chosen_ids"]), len(e["rejected_ids"])]).tobytes())
        h.update(array("q", e["chosen_ids"]).tobytes())
        h.update(array("q", e["rejected_ids"]).tobytes())
    return h.hexdigest()


def reference_cache_identity(cfg: DPOConfig, model: Any, train: list[dict], evals: list[dict]) -> dict[str, Any]:
    """Everything the cached numbers depend on (hashed into the file name; stored in the file's metadata)."""
    config = model.config.to_dict()
    config.pop("_name_or_path", None)
    return {
        "format": CACHE_FORMAT,
        "model": {
            "name_or_path": cfg.model_name_or_path,
            "revision": cfg.model_revision,
            "gguf_file": cfg.gguf_file,
            "config": config,
            "weights_sha256": weights_fingerprint(model),
        },
        "data": {
            "train": {"sources": cfg.dataset_name_or_path, "split": cfg.dataset_split, "pairs": len(train), "tokens_sha256": tokens_fingerprint(train)},
            "eval": {"sources": cfg.eval_dataset_name_or_path, "split": cfg.eval_dataset_split, "pairs": len(evals), "tokens_sha256": tokens_fingerprint(evals)},
        },
        "forward": {"mixed_precision": cfg.mixed_precision},
    }


def reference_cache_path(cfg: DPOConfig, identity: dict[str, Any]) -> str:
    folder = cfg.reference_cache_dir or os.path.join(os.path.dirname(os.path.abspath(cfg.output_dir)), ".ref_cache")
    key = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return os.path.join(folder, f"ref_logps_{key}.safetensors")


def compute_reference(model: Any, examples: list[dict], accelerator: Any, batch_size: int, pad_id: int) -> dict[str, torch.Tensor]:
    """One no-grad pass of `model` over `examples`: summed response log-probs of chosen and rejected, by position.

    Examples are sorted by length (less padding) and dealt to the ranks in micro-batches; the results are
    gathered, so every rank returns the full table."""
    import torch

    from open_instruct import data

    rank, world = accelerator.process_index, accelerator.num_processes
    mine = data.dealt_micro_batches(length_order(examples), batch_size, rank, world)  # same batches on 1 or N ranks
    index = torch.full((len(mine) * batch_size,), -1, dtype=torch.long)
    values = torch.zeros(len(mine) * batch_size, 2)
    model.eval()
    with torch.no_grad():
        for k, (group, real) in enumerate(mine):
            batch = {key: v.to(accelerator.device) for key, v in data.collate_preferences([examples[i] for i in group], pad_id).items()}
            with accelerator.autocast():
                lp = policy_logps(model, batch)
            if real:
                rows = slice(k * batch_size, k * batch_size + len(group))
                index[rows] = torch.tensor(group)
                values[rows] = torch.stack([lp.chosen, lp.rejected], dim=1).float().cpu()
    model.train()
    if world > 1:
        index = accelerator.gather(index.to(accelerator.device)).cpu()
        values = accelerator.gather(values.to(accelerator.device)).cpu()
    keep = index >= 0
    table = torch.full((len(examples), 2), float("nan"))
    table[index[keep]] = values[keep]
    assert not table.isnan().any(), "reference pass missed examples"
    return {
        "chosen_logps": table[:, 0].contiguous(),
        "rejected_logps": table[:, 1].contiguous(),
        **expected_counts(examples),
    }


def expected_counts(examples: list[dict]) -> dict[str, torch.Tensor]:
    """Response token counts and source rows per example (stored with the cache, checked when it is read)."""
    import torch

    return {
        "chosen_tokens": torch.tensor([len(e["chosen_ids"]) - e["prompt_len"] for e in examples], dtype=torch.long),
        "rejected_tokens": torch.tensor([len(e["rejected_ids"]) - e["prompt_len"] for e in examples], dtype=torch.long),
        "row": torch.tensor([e["row"] for e in examples], dtype=torch.long),
    }


def read_reference_cache(path: str, splits: dict[str, list[dict]], log: Any = print) -> Optional[dict[str, dict[str, torch.Tensor]]]:
    """The cached tables, or None when the file is missing or does not fit these examples (then it is rebuilt)."""
    if not os.path.isfile(path):
        return None
    import torch
    from safetensors.torch import load_file

    try:
        flat = load_file(path)
    except Exception as e:  # a damaged file is rebuilt, not trusted
        log(f"reference cache {path} is unreadable ({e}); recomputing")
        return None
    out: dict[str, dict[str, torch.Tensor]] = {}
    for split, examples in splits.items():
        table = {k.split("/", 1)[1]: v for k, v in flat.items() if k.startswith(f"{split}/")}
        expected = expected_counts(examples)
        if not examples:
            out[split] = {}
            continue
        if set(table) != {"chosen_logps", "rejected_logps", *expected} or any(not torch.equal(table[k], v) for k, v in expected.items()):
            log(f"reference cache {path} does not match the {split} examples; recomputing")
            return None
        out[split] = table
    return out


def write_reference_cache(path: str, tables: dict[str, dict[str, torch.Tensor]], identity: dict[str, Any]) -> None:
    """Atomic write: a temp file in the same folder, renamed into place."""
    from safetensors.torch import save_file

    os.makedirs(os.path.dirname(path), exist_ok=True)
    flat = {f"{split}/{k}": v.contiguous() for split, table in tables.items() for k, v in table.items()}
    fd, tmp = tempfile.mkstemp(prefix=".tmp_", suffix=".safetensors", dir=os.path.dirname(path))
    os.close(fd)
    try:
        save_file(flat, tmp, metadata={"identity": json.dumps(identity, sort_keys=True, default=str)})
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def reference_tables(cfg: DPOConfig, model: Any, train: list[dict], evals: list[dict], identity: dict[str, Any], accelerator: Any, pad_id: int, log: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Read the cache if every rank has a valid copy; otherwise run the reference pass and write it.

    `model` must hold the initial weights. Each node's local main process writes the file (nodes need not share
    a filesystem)."""
    path = reference_cache_path(cfg, identity)
    splits = {"train": train, "eval": evals}
    tables = read_reference_cache(path, splits, log)
    if runtime.global_sum(accelerator, tables is not None) == accelerator.num_processes:
        log(f"reference log-probs: reused {path}")
        return tables  # type: ignore[return-value]
    t0 = time.perf_counter()
    tables = {split: compute_reference(model, ex, accelerator, cfg.per_device_eval_batch_size, pad_id) if ex else {} for split, ex in splits.items()}
    if accelerator.is_local_main_process:
        write_reference_cache(path, tables, identity)
    accelerator.wait_for_everyone()
    log(f"reference log-probs: computed for {len(train)} train + {len(evals)} eval pairs in {time.perf_counter() - t0:.1f}s, saved to {path}")
    return tables


def reference_logps(table: dict[str, torch.Tensor], indices: list[int], device: Any) -> Logps:
    import torch

    idx = torch.tensor(indices)
    return Logps(*(table[k][idx].to(device) for k in ("chosen_logps", "rejected_logps", "chosen_tokens", "rejected_tokens")))


# ---------------------------------------------------------------------------------------------------------------------


def main(argv=None) -> None:
    cfg = runtime.start(DPOConfig, argv)
    if cfg.best_metric and cfg.best_metric not in EVAL_METRICS:
        raise ConfigError(f"best_metric {cfg.best_metric!r} is not a DPO eval metric; choose one of {list(EVAL_METRICS)}")

    import torch

    from open_instruct import data
    from open_instruct.checkpoint import BestTracker, restore_training_state, save_training_state
    from open_instruct.models import DTYPES, disable_dropout, load_causal_lm, load_tokenizer, make_optimizer_and_scheduler
    from open_instruct.tracking import MetricsLogger
    from open_instruct.utils import Counters, should_log

    accelerator = runtime.make_accelerator(cfg)
    rank, world = accelerator.process_index, accelerator.num_processes
    tokenizer = load_tokenizer(cfg.tokenizer_name_or_path or cfg.model_name_or_path, cfg.gguf_file, cfg.trust_remote_code, cfg.chat_template)
    train, evals, stats = data.load_train_eval(cfg, tokenizer, data.tokenize_preferences)
    plan = cfg.batch_plan(world, len(train))  # validated before the model loads
    if not cfg.eval_steps:
        evals = []  # never evaluated: no reference pass over it either
    if accelerator.is_main_process:
        print(f"data: {stats.summary()}; {len(evals)} held-out pairs; world_size {world}", flush=True)

    model = load_causal_lm(cfg.model_name_or_path, DTYPES["no"], cfg.gguf_file, cfg.trust_remote_code, cfg.model_revision)
    disable_dropout(model)
    use_reference = cfg.loss_type not in REFERENCE_FREE
    identity = None
    if use_reference:  # from the weights as loaded (the main process's copy, which FSDP loading always fills)
        box = [reference_cache_identity(cfg, model, train, evals) if accelerator.is_main_process else None]
        if world > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(box, from_process=0)
        identity = box[0]
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable()
    optimizer, scheduler = make_optimizer_and_scheduler(model, cfg, plan.optimizer_steps)
    model, optimizer = accelerator.prepare(model, optimizer)
    pad_id = tokenizer.pad_token_id
    log = print if accelerator.is_main_process else (lambda *a, **k: None)

    # The reference pass runs on the initial weights, so it comes before any checkpoint is restored.
    ref = reference_tables(cfg, model, train, evals, identity, accelerator, pad_id, log) if use_reference else None

    counters = Counters()
    state = restore_training_state(cfg, accelerator, {"policy": model}, {"policy": optimizer}, {"policy": scheduler}, counters)
    best = BestTracker(cfg, state)
    logger = MetricsLogger(cfg, accelerator.is_main_process, plan.optimizer_steps, "optimizer_step", counters.optimizer_step if state else None)
    stream = data.EpisodeStream(len(train), cfg.seed)
    preemption = runtime.Preemption()

    def evaluate() -> dict[str, float]:
        model.eval()
        sums = dict.fromkeys(STAT_KEYS, 0.0)
        with torch.no_grad():
            # The reference pass's batches: at step 0 the policy reproduces the cached numbers bit for bit.
            for group, real in data.dealt_micro_batches(length_order(evals), cfg.per_device_eval_batch_size, rank, world):
                batch = {k: v.to(accelerator.device) for k, v in data.collate_preferences([evals[i] for i in group], pad_id).items()}
                with accelerator.autocast():
                    policy = policy_logps(model, batch)
                if not real:
                    continue
                losses, chosen_r, rejected_r = preference_loss(cfg, policy, reference_logps(ref["eval"], group, accelerator.device) if ref else None)
                for k, v in pair_stat_sums(losses, chosen_r, rejected_r, policy).items():
                    sums[k] += v
        model.train()
        totals = runtime.global_sums(accelerator, sums)
        return {f"eval/{k}": v / len(evals) for k, v in totals.items()}

    def checkpoint() -> None:
        save_training_state(cfg, accelerator, {"policy": model}, {"policy": optimizer}, {"policy": scheduler}, counters, tokenizer, best.state())

    if evals and cfg.eval_steps and state is None:  # the starting point: a baseline row at optimizer_step 0
        metrics = evaluate()
        logger.log({**counters.as_log(), **metrics})
        drift = (abs(metrics["eval/rewards/chosen"]) + abs(metrics["eval/rewards/rejected"])) / cfg.beta
        if ref is not None and drift > 1e-3:  # the same batches as the cached pass give exactly 0 when it is right
            logger.write(f"WARNING: at step 0 the policy's log-probs differ from the cached reference (|mean chosen log-ratio| + "
                         f"|mean rejected log-ratio| = {drift:.3g}); is the cache stale?")
    throughput = runtime.Throughput()
    model.train()
    while counters.optimizer_step < plan.optimizer_steps:
        # This step's pairs: a slice of the global order, by episode position (world-size independent).
        local_idx = data.EpisodeStream.local_slice(stream.take(counters.episode, plan.mini_batch_size), rank, world)
        groups = list(data.micro_batches(local_idx, cfg.per_device_train_batch_size))

        sums = dict.fromkeys(STAT_KEYS, 0.0)
        for i, group in enumerate(groups):
            batch = {k: v.to(accelerator.device) for k, v in data.collate_preferences([train[j] for j in group], pad_id).items()}
            sync = i == len(groups) - 1
            with distributed.grad_sync(accelerator, model, sync):  # DDP: all-reduce on the last micro-batch only
                with accelerator.autocast():
                    policy = policy_logps(model, batch)
                losses, chosen_r, rejected_r = preference_loss(cfg, policy, reference_logps(ref["train"], group, accelerator.device) if ref else None)
                # The mean over the global mini-batch; DDP/FSDP average gradients over ranks, hence x world.
                accelerator.backward(losses.sum() * world / plan.mini_batch_size)
            for k, v in pair_stat_sums(losses, chosen_r, rejected_r, policy).items():
                sums[k] += v
            throughput.add(int(batch["attention_mask"].sum()), len(group))

        grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        stats_step = {f"train/{k}": v / plan.mini_batch_size for k, v in runtime.global_sums(accelerator, sums).items()}
        step_ok = runtime.apply_update(cfg, accelerator, optimizer, scheduler, stats_step["train/loss"], grad_norm, counters,
                                       plan.mini_batch_size, len(train), logger)

        if should_log(counters.optimizer_step, cfg.logging_steps):
            perf = throughput.report(accelerator)
            logger.log({
                **counters.as_log(),
                **stats_step,
                "train/grad_norm": float(grad_norm),
                "train/skipped_update": int(not step_ok),
                "lr": scheduler.get_last_lr()[0],
                **perf,
                "perf/pairs_per_second": perf["perf/episodes_per_second"],
            })
        if runtime.step_boundary(cfg, counters.optimizer_step, plan.optimizer_steps, "optimizer step", evaluate if evals else None, checkpoint,
                                 accelerator, counters, logger, best, model, tokenizer, preemption):
            logger.close()
            return

    runtime.finish(cfg, model, tokenizer, accelerator, counters, logger)


if __name__ == "__main__":
    runtime.run(main)
