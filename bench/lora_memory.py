"""Peak memory of the same SFT run with full fine-tuning and with LoRA (rank 16, all linear layers), on CPU.

    python bench/lora_memory.py [--hidden_size 512] [--num_layers 8] [--out output/bench_lora_memory]

A Llama built locally (demo/tiny.py) trains 8 optimizer steps of batch 4 in its own process each way; the peak
resident set size (ru_maxrss) of that process is printed with the trainable-parameter count and the AdamW state +
gradient bytes they imply (12 bytes per trainable float32 parameter). The process baseline (torch, transformers,
the weights, activations) is the same both ways, so the difference is the optimizer and gradient memory saved."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = (
    "import resource, sys; from open_instruct import sft; sft.main(sys.argv[1:]); "
    "print('PEAK_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden_size", type=int, default=512)
    parser.add_argument("--num_layers", type=int, default=8)
    parser.add_argument("--out", default=os.path.join(REPO, "output", "bench_lora_memory"))
    args = parser.parse_args()
    sys.path.insert(0, REPO)
    from transformers import AutoModelForCausalLM

    from demo.synthetic import sft_rows, write_jsonl
    from demo.tiny import save_tiny_models
    from open_instruct import lora
    from open_instruct.config import SFTConfig

    os.makedirs(args.out, exist_ok=True)
    model_dir = save_tiny_models(os.path.join(args.out, "models"), args.hidden_size, args.num_layers)["causal_lm"]
    train = write_jsonl(os.path.join(args.out, "train.jsonl"), sft_rows(64, 0))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    for name, extra in (("full", []), ("lora", ["--use_lora", "true"])):
        cfg = SFTConfig(model_name_or_path=model_dir, dataset_name_or_path=train, use_lora=bool(extra))
        trainable, total = lora.count_trainable(
            lora.apply_lora(AutoModelForCausalLM.from_pretrained(model_dir), cfg, "CAUSAL_LM")
        )
        cmd = [sys.executable, "-c", CHILD, os.path.join(REPO, "configs", "sft_tiny.yaml")]
        cmd += [
            "--model_name_or_path",
            model_dir,
            "--dataset_name_or_path",
            train,
            "--eval_dataset_name_or_path",
            train,
        ]
        cmd += ["--eval_steps", "1000", "--checkpointing_steps", "1000", "--best_metric", "eval/loss"]
        cmd += ["--output_dir", os.path.join(args.out, name), "--per_device_train_batch_size", "4"]
        cmd += ["--gradient_accumulation_steps", "1", "--total_episodes", "32", *extra]
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{name} run failed:\n{proc.stderr[-2000:]}")
        peak_kb = int(next(line for line in proc.stdout.splitlines() if line.startswith("PEAK_KB")).split()[1])
        print(
            f"{name}: {total / 1e6:.1f}M parameters, {trainable / 1e6:.2f}M trainable (AdamW state + grads "
            f"{12 * trainable / 2**20:.0f} MiB); peak RSS {peak_kb / 1024:.0f} MiB"
        )


if __name__ == "__main__":
    main()
