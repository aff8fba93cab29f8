"""Verifiable accuracy of a model on prompts with ground truth (the RLVR data format).

    python -m eval.verifiable MODEL DATA.jsonl [--temperature 0] [--max_new_tokens 64] [--output_dir D]

Rows: `messages` (the prompt conversation), `ground_truth`, and `dataset` naming the verifier (gsm8k, math,
ifeval, arithmetic). Prints accuracy with a 95% Wilson interval, a per-source breakdown, and writes every
prediction to <output_dir>/predictions.jsonl and the summary to <output_dir>/summary.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections import defaultdict
from types import SimpleNamespace
from typing import Any, Optional, Sequence


def wilson_interval(correct: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval for a binomial proportion (well-behaved at 0% and 100%, unlike p +- z*se)."""
    if total == 0:
        return 0.0, 0.0
    p = correct / total
    denom = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denom
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def load_prompts(
    data: str,
    tokenizer: Any,
    max_prompt_length: int = 1024,
    limit: Optional[int] = None,
    messages_column: str = "messages",
    ground_truth_column: str = "ground_truth",
    verifier_column: str = "dataset",
) -> list[dict[str, Any]]:
    from open_instruct.data import load_rows, tokenize_prompts

    cfg = SimpleNamespace(
        messages_column=messages_column,
        ground_truth_column=ground_truth_column,
        verifier_column=verifier_column,
        max_prompt_length=max_prompt_length,
        overlong="drop",
        skip_bad_rows=False,
        dataset_name_or_path=data,
    )
    examples, _ = tokenize_prompts(load_rows(data, "test", limit), tokenizer, cfg)
    return examples


def evaluate_verifiable(
    model: Any,
    tokenizer: Any,
    examples: Sequence[dict[str, Any]],
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    stop_strings: Optional[list[str]] = None,
    batch_size: int = 32,
    seed: int = 0,
    timeout: float = 2.0,
    generator: Any = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(summary, predictions). Greedy when temperature is 0. Shared by the RLVR script's held-out eval and the CLI."""
    from open_instruct.generation import GenerationConfig
    from open_instruct.generation_backends import generator_for
    from open_instruct.rewards import score_batch

    generator = generator or generator_for("hf", model, tokenizer, batch_size=batch_size)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, temperature=temperature, stop_strings=stop_strings, seed=seed
    )
    was_training = model.training
    model.eval()
    out = generator.generate([e["prompt_ids"] for e in examples], config)
    model.train(was_training)
    scores = score_batch(
        out.texts,
        [e["ground_truth"] for e in examples],
        [e["verifier"] for e in examples],
        verification_reward=1.0,
        timeout=timeout,
    )
    predictions = []
    by_source: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for e, text, ok, stopped in zip(examples, out.texts, scores.correct, out.stopped):
        predictions.append(
            {
                "row": e["row"],
                "source": e["verifier"],
                "prompt": tokenizer.decode(e["prompt_ids"]),
                "response": text,
                "ground_truth": e["ground_truth"],
                "correct": bool(ok),
                "stopped": bool(stopped),
            }
        )
        by_source[e["verifier"]][0] += int(ok)
        by_source[e["verifier"]][1] += 1
    n_correct = sum(scores.correct)
    low, high = wilson_interval(n_correct, len(examples))
    summary = {
        "accuracy": n_correct / max(len(examples), 1),
        "ci95": [low, high],
        "correct": n_correct,
        "total": len(examples),
        "stop_rate": sum(out.stopped) / max(len(examples), 1),
        "verifier_timeouts": scores.num_timeouts,
        "by_source": {
            k: {"accuracy": c / t, "correct": c, "total": t, "ci95": list(wilson_interval(c, t))}
            for k, (c, t) in sorted(by_source.items())
        },
    }
    return summary, predictions


def write_results(out_dir: str, predictions: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    """An evaluation's files: one prediction per line in predictions.jsonl, and summary.json."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "predictions.jsonl"), "w") as f:
        for p in predictions:
            f.write(json.dumps(p) + "\n")
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)


def format_summary(summary: dict[str, Any], title: str = "") -> str:
    lo, hi = summary["ci95"]
    lines = [title] if title else []
    lines.append(
        f"accuracy {summary['accuracy']:.1%}  ({summary['correct']}/{summary['total']}, 95% CI {lo:.1%}-{hi:.1%}),"
        f" stopped {summary['stop_rate']:.0%}, verifier timeouts {summary['verifier_timeouts']}"
    )
    if len(summary["by_source"]) > 1 or title:
        lines.append(f"  {'source':<16}{'accuracy':>10}{'n':>8}   95% CI")
        for src, s in summary["by_source"].items():
            lines.append(f"  {src:<16}{s['accuracy']:>10.1%}{s['total']:>8}   {s['ci95'][0]:.1%}-{s['ci95'][1]:.1%}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("data")
    parser.add_argument("--gguf_file", default=None)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--stop_strings", nargs="*", default=None)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--generation_backend", choices=["hf", "vllm"], default="hf", help="vllm: pip install -r requirements-vllm.txt"
    )
    parser.add_argument("--output_dir", default=None, help="default: <model>/eval_verifiable")
    args = parser.parse_args(argv)

    import torch

    from open_instruct.models import load_causal_lm, load_tokenizer

    torch.manual_seed(args.seed)
    tokenizer = load_tokenizer(args.model, args.gguf_file)
    tokenizer.padding_side = "left"
    model = load_causal_lm(args.model, torch.float32, args.gguf_file)
    examples = load_prompts(args.data, tokenizer, limit=args.limit)
    generator = None  # hf: built by evaluate_verifiable
    if args.generation_backend == "vllm" and examples:
        from open_instruct.generation_backends import generator_for

        longest = max(len(e["prompt_ids"]) for e in examples)
        generator = generator_for("vllm", model, tokenizer, max_model_len=longest + args.max_new_tokens, seed=args.seed)
    start = time.time()
    summary, predictions = evaluate_verifiable(
        model,
        tokenizer,
        examples,
        args.max_new_tokens,
        args.temperature,
        args.stop_strings,
        args.batch_size,
        args.seed,
        generator=generator,
    )
    summary["seconds"] = time.time() - start
    out_dir = args.output_dir or os.path.join(args.model if os.path.isdir(args.model) else ".", "eval_verifiable")
    write_results(out_dir, predictions, summary)
    print(
        format_summary(
            summary, f"{args.model} on {args.data} ({'greedy' if args.temperature == 0 else f'T={args.temperature}'})"
        )
    )
    print(f"predictions: {os.path.join(out_dir, 'predictions.jsonl')}")
    return summary


if __name__ == "__main__":
    main()
