"""Tokenization speed at start-up: the per-row loop the scripts ran before (three chat-template calls a row, one
process) against open_instruct.data.load_train_eval (chat templates rendered once per role sequence, one tokenizer
call per conversation, forked worker processes, then the tokenized-data cache), on a synthetic chat set.

    python bench/bench_tokenize.py [--rows 100000] [--tokenizer tiny|bpe] [--num_proc 2] [--reference_rows 5000]

Data: short arithmetic chats (a user question, an assistant answer; one row in five has a second exchange), written
as JSONL. Tokenizers, both built locally: `tiny` is the tests' character-level tokenizer (demo/tiny.py), `bpe` a
byte-level BPE (the kind Llama 3 / Qwen / GPT use) trained here on the synthetic texts, with a ChatML template.

Reported (one JSON line per tokenizer):
- reference rows/s (and per CPU-second): data.tokenize_sft_messages row by row, on the first --reference_rows rows
  (what tokenize_sft did per row before; the tests compare the new path against it). It leaves out reading and
  validating the rows, which the first start below includes.
- tokenizer alone, rows per CPU-second: the fast tokenizer's batch encoder on every rendered conversation, once,
  in one process: the floor of any path that tokenizes each conversation (the new path does, once).
- first start: load_train_eval from the JSONL file with an empty cache: read, validate, tokenize (num_proc
  processes), write the cache entry. rows/s over the whole call, and per CPU-second (this process and its workers:
  less sensitive to other jobs on a shared machine than wall time).
- second start: load_train_eval again: the cache entry is read back; seconds.
The machine is shared: wall-clock figures move with its load (the load average is printed with each figure).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def chat_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(1, 999), rng.randint(1, 999)
        messages = [
            {"role": "user", "content": f"What is {a} plus {b}? Answer briefly."},
            {"role": "assistant", "content": f"{a} + {b} = {a + b}."},
        ]
        if i % 5 == 0:
            messages += [
                {"role": "user", "content": "And times two?"},
                {"role": "assistant", "content": f"{2 * (a + b)}."},
            ]
        rows.append({"id": i, "messages": messages})
    return rows


def bpe_tokenizer(rows: list[dict[str, Any]]) -> Any:
    """A byte-level BPE (vocabulary 2,000) trained on the rows' texts, ChatML markers as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from open_instruct.chat_templates import CHATML

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2000, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator((m["content"] for r in rows[:20000] for m in r["messages"]), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def load_avg() -> float:
    return round(os.getloadavg()[0], 2)


def run(args: argparse.Namespace, which: str, work: str) -> dict[str, Any]:
    from demo.tiny import build_tokenizer
    from open_instruct import data
    from open_instruct.config import SFTConfig

    rows = chat_rows(args.rows)
    path = os.path.join(work, "chats.jsonl")
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    tokenizer = build_tokenizer() if which == "tiny" else bpe_tokenizer(rows)

    sample = rows[: args.reference_rows]
    c0, t0 = cpu_seconds(), time.perf_counter()
    for r in sample:
        data.tokenize_sft_messages(tokenizer, r["messages"], "bench")
    reference = len(sample) / (time.perf_counter() - t0)
    reference_per_cpu = len(sample) / (cpu_seconds() - c0)
    reference_load = load_avg()

    texts = tokenizer.apply_chat_template([r["messages"] for r in rows], tokenize=False)
    c0 = cpu_seconds()
    backend = tokenizer.backend_tokenizer
    for start in range(0, len(texts), 1000):
        [e.ids for e in backend.encode_batch(texts[start : start + 1000], add_special_tokens=False)]
    tokenizer_alone_per_cpu = len(texts) / (cpu_seconds() - c0)
    del texts

    cache = os.path.join(work, f"cache_{which}")
    cfg = SFTConfig(
        model_name_or_path="unused",
        dataset_name_or_path=path,
        max_seq_length=4096,
        dataset_num_proc=args.num_proc,
        dataset_cache_dir=cache,
    )
    c0, t0 = cpu_seconds(), time.perf_counter()
    train, _, stats = data.load_train_eval(cfg, tokenizer, data.tokenize_sft)
    first_s, first_cpu = time.perf_counter() - t0, cpu_seconds() - c0
    first_load = load_avg()
    assert len(train) == args.rows and "written to the cache" in stats.inputs, stats.inputs
    t0 = time.perf_counter()
    again, _, stats2 = data.load_train_eval(cfg, tokenizer, data.tokenize_sft)
    second_s = time.perf_counter() - t0
    assert "read from the cache" in stats2.inputs and again[-1] == train[-1], stats2.inputs
    first = args.rows / first_s
    return {
        "tokenizer": which,
        "rows": args.rows,
        "num_proc": args.num_proc,
        "reference_rows_per_s": round(reference),
        "reference_rows_per_cpu_s": round(reference_per_cpu),
        "reference_load_avg": reference_load,
        "tokenizer_alone_rows_per_cpu_s": round(tokenizer_alone_per_cpu),
        "first_start_s": round(first_s, 1),
        "first_start_rows_per_s": round(first),
        "first_start_rows_per_cpu_s": round(args.rows / first_cpu),
        "first_start_load_avg": first_load,
        "speedup_first_start": round(first / reference, 1),
        "speedup_per_cpu_s": round(args.rows / first_cpu / reference_per_cpu, 1),
        "second_start_s": round(second_s, 2),
        "second_start_load_avg": load_avg(),
        "tokens": sum(len(e["input_ids"]) for e in train),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--tokenizer", nargs="+", default=["tiny", "bpe"], choices=["tiny", "bpe"])
    parser.add_argument("--num_proc", type=int, default=2)
    parser.add_argument("--reference_rows", type=int, default=5000)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread a process: the processes are the parallelism
    work = tempfile.mkdtemp(prefix="bench_tokenize_")
    try:
        for which in args.tokenizer:
            print(json.dumps(run(args, which, work)), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
