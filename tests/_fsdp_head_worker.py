"""Worker for tests/test_fsdp.py: the chunked log-prob head under FSDP2 on 2 CPU processes (gloo), started by
`accelerate launch` with the FSDP config:

    OPEN_INSTRUCT_CPU_FSDP=1 accelerate launch --config_file configs/accelerate/fsdp_cpu_2proc.yaml \
        tests/_fsdp_head_worker.py MODEL_DIR OUT_DIR

accelerate makes the output layer its own FSDP unit (an FSDPLinear). With chunks of 2 tokens, RL's log-probs and
entropies (response_scores at temperature 0.7, forward and backward) and SFT/DPO's sequence log-probs run through
the chunked head (counted), never make a tensor of more than 2 vocabulary-wide rows (measured), and equal the
unsharded model's full-logit numbers and gradients (both ranks score the same batch, so the rank-averaged gradient
is the unsharded one). Each rank writes OUT_DIR/head_rank<r>.json; the test asserts on it.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    model_dir, out_dir = sys.argv[1], sys.argv[2]
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from open_instruct import distributed, models
    from open_instruct.data import collate_episodes
    from open_instruct.models import (
        entropy_from_logits,
        load_causal_lm,
        response_logits,
        response_scores,
        sequence_logprobs,
        token_logprobs,
    )

    cfg = SimpleNamespace(mixed_precision="no", activation_checkpointing=False, fsdp_cpu_offload=False, seed=0)
    accelerator = distributed.build_accelerator(cfg)
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "false"  # an unsharded copy on every rank (see _fsdp_worker.py)
    plain = load_causal_lm(model_dir)
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "true"
    policy = load_causal_lm(model_dir)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    head = policy.get_output_embeddings()
    vocab = plain.config.vocab_size
    models.LOGPROB_CHUNK_TOKENS = 2

    calls = {"chunked": 0}
    original_apply = models._ChunkedTokenScores.apply

    def counted_apply(*args):
        calls["chunked"] += 1
        return original_apply(*args)

    models._ChunkedTokenScores.apply = counted_apply

    class VocabRows(TorchDispatchMode):  # rows of the largest [..., vocab] tensor an op makes (new memory)
        rows = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if torch.is_tensor(t)}
            for t in tree_flatten(out)[0]:
                if torch.is_tensor(t) and t.dim() and t.shape[-1] == vocab:
                    if t.untyped_storage().data_ptr() not in inputs:
                        self.rows = max(self.rows, t.numel() // vocab)
            return out

    batch = collate_episodes([[5, 6, 7, 8], [9, 10, 11], [12, 13]], [[14, 15, 16], [17], [18, 19]], pad_id=0)
    weights = torch.arange(9, dtype=torch.float32).view(3, 3) / 9, torch.linspace(-1, 1, 9).view(3, 3)

    def full_grads() -> dict[str, torch.Tensor]:
        grads = {n: p.grad.clone() for n, p in plain.named_parameters()}
        plain.zero_grad()
        return grads

    def sharded_grads() -> dict[str, torch.Tensor]:
        grads = {
            n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in policy.named_parameters()
        }
        optimizer.zero_grad()
        return grads

    def max_diff(a: dict, b: dict) -> float:
        return max((a[n] - b[n]).abs().max().item() for n in a)

    # RL: log-probs and entropies of the responses
    logits = response_logits(plain, batch, 0.7)
    want_logp, want_ent = token_logprobs(logits, batch["responses"]), entropy_from_logits(logits)
    (want_logp * weights[0] + want_ent * weights[1]).sum().backward()
    want_rl = full_grads()
    calls["chunked"] = 0
    with VocabRows() as rl_rows:
        scores = response_scores(policy, batch, 0.7, entropy=True)
        accelerator.backward((scores.logp * weights[0] + scores.entropy * weights[1]).sum())
    got_rl = sharded_grads()
    rl_calls = calls["chunked"]

    # SFT/DPO: summed log-probs of the masked tokens
    sft_batch = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    sft_batch["loss_mask"] = batch["attention_mask"]
    want_sums = sequence_logprobs(plain, sft_batch)[0]  # the unpatched-head path is checked in test_logprob_head
    want_sums_full = (
        token_logprobs(plain(**{k: sft_batch[k] for k in ("input_ids", "attention_mask")}).logits[:, :-1],
                       sft_batch["input_ids"][:, 1:]) * sft_batch["loss_mask"][:, 1:]
    ).sum(-1)  # fmt: skip
    want_sums_full.sum().backward()
    want_sft = full_grads()
    calls["chunked"] = 0
    with VocabRows() as sft_rows:
        sums = sequence_logprobs(policy, sft_batch)[0]
        accelerator.backward(sums.sum())
    got_sft = sharded_grads()

    report = {
        "rank": accelerator.process_index,
        "world_size": accelerator.num_processes,
        "head_class": type(head).__name__,
        "head_is_fsdp_unit": isinstance(head, FSDPModule),
        "head_is_chunked": models._plain_linear(head),
        "head_sharded": isinstance(head.weight, DTensor),
        "chunked_calls_rl": rl_calls,
        "chunked_calls_sft": calls["chunked"],
        "vocab_rows_rl": rl_rows.rows,
        "vocab_rows_sft": sft_rows.rows,
        "full_logits_rows": 3 * 3,
        "rl_logp_max_diff": (scores.logp - want_logp).abs().max().item(),
        "rl_entropy_max_diff": (scores.entropy - want_ent).abs().max().item(),
        "rl_grad_max_diff": max_diff(got_rl, want_rl),
        "rl_grad_max": max(g.abs().max().item() for g in want_rl.values()),
        "sft_sums_max_diff": (sums - want_sums_full).abs().max().item(),
        "sft_sums_vs_unsharded_head": (sums - want_sums).abs().max().item(),
        "sft_grad_max_diff": max_diff(got_sft, want_sft),
        "sft_grad_max": max(g.abs().max().item() for g in want_sft.values()),
        "logits_max": logits.abs().max().item(),
        "seq_len": batch["input_ids"].shape[1],
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"head_rank{accelerator.process_index}.json"), "w") as f:
        json.dump(report, f, indent=1)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
