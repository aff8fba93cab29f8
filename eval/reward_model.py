"""Reward-model accuracy on a preference dataset.

    python -m eval.reward_model MODEL DATA.jsonl [--batch_size 16] [--output scores.jsonl]

A pair counts as right when r_chosen > r_rejected (ties are wrong, as in training). Prints the accuracy with
a 95% Wilson interval, the mean margin r_chosen - r_rejected, the mean rewards and the pair count; --output
writes one JSON line per pair. Rows are read and tokenized exactly as the trainer does (open_instruct.data):
`chosen`/`rejected` conversations, or `prompt` + `chosen` + `rejected` strings. Rewards are read exactly as the
trainer reads them (open_instruct.models.pair_rewards).
"""

from __future__ import annotations

import argparse
import json
import os
from types import SimpleNamespace
from typing import Any, Optional, Sequence


def score_pairs(
    model: Any, examples: Sequence[dict[str, Any]], pad_id: int, batch_size: int = 16
) -> list[dict[str, Any]]:
    """Per-pair rewards: [{"row", "chosen_reward", "rejected_reward", "margin", "correct"}], in input order."""
    import torch

    from open_instruct.data import collate_preferences, micro_batches
    from open_instruct.models import pair_rewards

    device = next(model.parameters()).device
    model.eval()
    out: list[dict[str, Any]] = []
    with torch.no_grad():
        for mb in micro_batches(list(examples), batch_size):
            batch = {k: v.to(device) for k, v in collate_preferences(mb, pad_id).items()}
            chosen, rejected = pair_rewards(model, batch)
            for e, c, r in zip(mb, chosen.tolist(), rejected.tolist()):
                out.append(
                    {"row": e["row"], "chosen_reward": c, "rejected_reward": r, "margin": c - r, "correct": c > r}
                )
    return out


def summarize_scores(scores: Sequence[dict[str, Any]]) -> dict[str, Any]:
    from eval.verifiable import wilson_interval

    n = len(scores)
    correct = sum(s["correct"] for s in scores)
    mean = lambda key: sum(s[key] for s in scores) / n if n else float("nan")  # noqa: E731
    return {
        "accuracy": correct / n if n else float("nan"),
        "ci95": wilson_interval(correct, n),
        "correct": correct,
        "total": n,
        "ties": sum(s["chosen_reward"] == s["rejected_reward"] for s in scores),
        "mean_margin": mean("margin"),
        "mean_chosen_reward": mean("chosen_reward"),
        "mean_rejected_reward": mean("rejected_reward"),
    }


def format_summary(summary: dict[str, Any], title: str = "") -> str:
    lo, hi = summary["ci95"]
    line = (
        f"accuracy {summary['accuracy']:.1%} ({summary['correct']}/{summary['total']} pairs, 95% CI "
        f"{lo:.1%}-{hi:.1%}), "
        f"mean margin {summary['mean_margin']:.4f} (chosen {summary['mean_chosen_reward']:.4f}, "
        f"rejected {summary['mean_rejected_reward']:.4f}), ties {summary['ties']}"
    )
    return f"{title}\n{line}" if title else line


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="HF-format sequence classifier folder or hub name (e.g. <run>/final_model)")
    parser.add_argument("data", help="preference rows: .jsonl/.json/.parquet file(s) or a hub dataset")
    parser.add_argument("--split", default="test", help="hub dataset split")
    parser.add_argument("--batch_size", type=int, default=16, help="pairs per forward")
    parser.add_argument("--max_seq_length", type=int, default=2048)
    parser.add_argument("--overlong", choices=["drop", "truncate"], default="drop")
    parser.add_argument("--max_samples", type=int, default=None)
    parser.add_argument("--skip_bad_rows", action="store_true")
    parser.add_argument("--chosen_column", default="chosen")
    parser.add_argument("--rejected_column", default="rejected")
    parser.add_argument("--prompt_column", default="prompt")
    parser.add_argument("--output", default=None, help="write per-pair scores to this .jsonl file")
    args = parser.parse_args(argv)
    if args.batch_size <= 0:
        parser.error(f"--batch_size must be > 0, got {args.batch_size}")

    import torch
    import transformers

    from open_instruct.data import load_rows, tokenize_preferences
    from open_instruct.models import load_sequence_classifier, load_tokenizer

    transformers.utils.logging.disable_progress_bar()
    tokenizer = load_tokenizer(args.model)
    data_cfg = SimpleNamespace(
        **{
            k: getattr(args, k)
            for k in (
                "chosen_column",
                "rejected_column",
                "prompt_column",
                "max_seq_length",
                "overlong",
                "skip_bad_rows",
            )
        },
        dataset_name_or_path=args.data,
    )
    examples, stats = tokenize_preferences(load_rows(args.data, args.split, args.max_samples), tokenizer, data_cfg)
    model = load_sequence_classifier(args.model, torch.float32, pad_token_id=tokenizer.pad_token_id)
    model.config.pad_token_id = tokenizer.pad_token_id  # pool where we pad (see open_instruct/reward_model.py)
    if torch.cuda.is_available():
        model = model.cuda()

    scores = score_pairs(model, examples, tokenizer.pad_token_id, args.batch_size)
    summary = {**summarize_scores(scores), "data": stats.as_log("")}
    print(f"data: {stats.summary()}")
    print(format_summary(summary, f"{args.model} on {args.data}"))
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            for s in scores:
                f.write(json.dumps(s) + "\n")
        print(f"per-pair scores: {args.output}")
    return summary


if __name__ == "__main__":
    from open_instruct import runtime

    runtime.run(main)
