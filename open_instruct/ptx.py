"""PPO-ptx: a supervised loss on demonstrations added to the RL loss (InstructGPT, Ouyang et al. 2022, eq. 2).

    objective = RL objective + ptx_coef * E_{x ~ ptx_dataset} [ log pi(x) ]

InstructGPT mixed in pretraining text so RL would not unlearn what pretraining taught; here the rows are any SFT
data (`ptx_dataset`, every SFT format data.tokenize_sft reads, trained on the assistant tokens only, each at most an
episode's length: max_prompt_length + response_length), typically the cold-start demonstrations the RL run starts
from: a pull back towards them that does not depend on a sampled group scoring unevenly (a group whose completions
all fail the same way gives the policy loss nothing to push against). OpenRLHF's pretrain_data and ptx_coef are
the same idea, one demonstration micro-batch per policy micro-batch.

How the term joins the loss (rlvr_ppo.micro_batch_loss's loss_term hook): each policy micro-batch draws
per_device_train_batch_size demonstration rows, their mean next-token NLL per trained token (temperature 1: the
model's likelihood, not the sampling temperature) weighted by the micro-batch's share of the optimizer step's units
(aggregation_weights' U). Those shares add up to 1 over the step's micro-batches on every rank, so each optimizer
step adds ptx_coef x (a mean NLL per demonstration token), whatever the loss aggregation, the split into micro-batches
and ranks, or how many groups filter_zero_std_groups kept. A step with no rows to train (every group dropped) is
skipped, its demonstrations too. `loss/ptx` logs that NLL (before ptx_coef).

The rows a micro-batch draws are a function of the seed and the micro-batch's own tokens, so a resumed run draws
what the uninterrupted one would have, and every rank draws its own.
"""

from __future__ import annotations

import copy
import hashlib
import random
from typing import Any

import torch
from accelerate import PartialState

from open_instruct import data
from open_instruct.models import run_tokenizer, scored_logprobs, with_scored_index


def demonstrations_config(cfg: Any) -> Any:
    """The config the demonstrations are read and tokenized with (data.load_train_eval, so the tokenized-data cache
    keeps them as it keeps a train set): ptx_dataset as the only source, all of its "train" split, no held-out part;
    at most an episode's tokens (max_prompt_length + response_length) each, a longer one dropped or truncated as
    `overlong` says, so a demonstration micro-batch is no larger than a rollout's (what the planner counts)."""
    view = copy.copy(cfg)
    view.max_seq_length = cfg.max_prompt_length + cfg.response_length
    view.dataset_name_or_path, view.dataset_mixer_list, view.dataset_split = cfg.ptx_dataset, None, "train"
    view.eval_dataset_name_or_path = view.eval_dataset_mixer_list = None
    view.eval_fraction, view.max_train_samples, view.max_eval_samples = 0.0, None, None
    return view


class DemonstrationLoss:
    """The ptx loss term (rlvr_ppo.Feature.loss_term) over the tokenized rows of cfg.ptx_dataset: loaded and checked
    when built, before any model loads (a bad row stops the run naming its file and row)."""

    def __init__(self, cfg: Any, tokenizer: Any):
        tokenizer = run_tokenizer(cfg) if tokenizer is None else tokenizer  # the policy's (a phase without features)
        self.examples, _, self.stats = data.load_train_eval(demonstrations_config(cfg), tokenizer, data.tokenize_sft)
        if PartialState().is_main_process:  # beside the start-up summary's data line
            print(f"  ptx    {self.stats.summary()}", flush=True)
        self.pad_id = tokenizer.pad_token_id

    def rows_for(self, cfg: Any, host_input_ids: torch.Tensor) -> list[dict]:
        """per_device_train_batch_size demonstrations (distinct when there are that many), chosen by the seed and the
        micro-batch's tokens."""
        digest = hashlib.sha256(host_input_ids.numpy().tobytes()).hexdigest()
        rng = random.Random(f"{cfg.seed}:{digest}")
        k = min(cfg.per_device_train_batch_size, len(self.examples))
        return [self.examples[i] for i in rng.sample(range(len(self.examples)), k)]

    def __call__(
        self, cfg: Any, models: Any, batch: dict, mask: torch.Tensor, w: torch.Tensor, state: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(ptx_coef x NLL x units, {"ptx_loss": NLL x units}): units is the micro-batch's part of U (token_mean: its
        weighted tokens; the sequence means: its rows with any weight), so dividing by U weighs each micro-batch's
        demonstration NLL by its share of the step."""
        host = with_scored_index(data.collate_sft(self.rows_for(cfg, batch["host_input_ids"]), self.pad_id))
        tokens = int((host["labels"][:, 1:] != -100).sum())
        on_device = data.to_device(host, mask.device)
        logps, _, _ = scored_logprobs(models.policy, on_device, on_device["labels"])
        nll = -logps.sum() / max(tokens, 1)
        units = w.sum() if cfg.loss_aggregation == "token_mean" else (w.sum(1) > 0).sum().to(w.dtype)
        return cfg.ptx_coef * nll * units, {"ptx_loss": nll.detach() * units}


def metrics(cfg: Any, rollout: Any, sums: dict[str, float], train: dict[str, float], updates: float, _: Any) -> dict:
    """loss/ptx: the demonstrations' NLL per trained token, averaged over the rollout's updates."""
    return {"loss/ptx": train["ptx_loss"] / updates}
