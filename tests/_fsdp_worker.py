"""Worker for tests/test_fsdp.py, started on 2 CPU processes by `accelerate launch` with the FSDP config:

    OPEN_INSTRUCT_CPU_FSDP=1 accelerate launch --config_file configs/accelerate/fsdp_cpu_2proc.yaml \
        tests/_fsdp_worker.py MODEL_DIR OUT_DIR

Checks what the RLVR and DPO scripts need beyond a trained model: a frozen model (reference / reward) sharded with
`distributed.prepare_frozen`, and greedy generation from sharded weights inside `distributed.full_params`, with the
two ranks generating different numbers of tokens (a per-step all-gather would deadlock there). Each rank writes
OUT_DIR/worker_rank<r>.json; the test asserts on it.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def local_numel(model) -> tuple[int, int, bool]:
    """(elements held here, elements in the model, every parameter a DTensor)."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    here = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
    return here, sum(p.numel() for p in params), all(isinstance(p, DTensor) for p in params)


def main() -> None:
    model_dir, out_dir = sys.argv[1], sys.argv[2]
    import torch

    from open_instruct import distributed
    from open_instruct.models import load_causal_lm

    cfg = SimpleNamespace(mixed_precision="no", activation_checkpointing=False, fsdp_cpu_offload=False, seed=0)
    accelerator = distributed.build_accelerator(cfg)
    rank = accelerator.process_index

    # An unsharded copy on every rank for the expected numbers. cpu_ram_efficient_loading (on in the config, as for
    # 70B) would leave it empty (meta) on rank 1, so it is switched off for this one load.
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "false"
    plain = load_causal_lm(model_dir).eval()
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "true"

    policy = load_causal_lm(model_dir)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    frozen = distributed.prepare_frozen(accelerator, load_causal_lm(model_dir))
    before, frozen_before = local_numel(policy), local_numel(frozen)  # before any forward: all shards

    ids = torch.tensor([[5, 17, 23, 9, 40, 41, 12]])
    with torch.no_grad():
        want_logits = plain(input_ids=ids).logits
        frozen_logits = frozen(input_ids=ids).logits
        policy_logits = policy(input_ids=ids).logits

    # Ranks ask for different lengths: with per-step collectives the shorter one would leave the other hanging.
    new_tokens = 4 if rank == 0 else 11
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = plain.generate(ids, **kwargs)
        with distributed.full_params(policy):
            inside = local_numel(policy)
            got = policy.generate(ids, **kwargs)
        with distributed.full_params(frozen):
            got_frozen = frozen.generate(ids, **kwargs)
    after = local_numel(policy)

    # Training still works after generation: one AdamW step on the re-sharded policy lands where the same step on
    # the unsharded copy does (both ranks feed the same ids, so the rank-averaged gradient is the plain one).
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    for model, opt in ((policy, optimizer), (plain, plain_optimizer)):
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        if model is policy:
            accelerator.backward(loss)
        else:
            loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        stepped_diff = (policy(input_ids=ids).logits - plain(input_ids=ids).logits).abs().max().item()
        moved = (plain(input_ids=ids).logits - want_logits).abs().max().item()

    report = {
        "rank": rank,
        "world_size": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "frozen_sharding": frozen_before,
        "frozen_requires_grad": any(p.requires_grad for p in frozen.parameters()),
        "policy_sharding_before": before,
        "policy_sharding_inside_full_params": inside,
        "policy_sharding_after": after,
        "frozen_logits_max_diff": (frozen_logits - want_logits).abs().max().item(),
        "policy_logits_max_diff": (policy_logits - want_logits).abs().max().item(),
        "new_tokens": new_tokens,
        "generated": got[0].tolist(),
        "generated_frozen": got_frozen[0].tolist(),
        "expected": want[0].tolist(),
        "after_step_logits_max_diff": stepped_diff,
        "step_moved_logits_by": moved,
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"worker_rank{rank}.json"), "w") as f:
        json.dump(report, f, indent=1)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
