"""The async rollout buffer in a checkpoint: written as a structure + flat number arrays (checkpoint.write_array_state)
against the same state as indented JSON inside trainer_state.json (how it was written before).

    python bench/bench_checkpoint_buffer.py [--episodes 1024] [--tokens 1000]

The state is what RolloutSampler.state_dict saves for async runs: per episode its token ids, sampler log-probs and
weight versions (3 numbers per token), here random. Prints write and read seconds, bytes on disk, and whether the
read-back state equals the written one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

from open_instruct.checkpoint import read_array_state, write_array_state


def buffer_state(episodes: int, tokens: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    outputs = [
        {"response_ids": [rng.randrange(150_000) for _ in range(tokens)],
         "logprobs": [-3 * rng.random() for _ in range(tokens)],
         "weight_versions": [7] * tokens}
        for _ in range(episodes)
    ]  # fmt: skip
    return {"async_steps": 2, "world_size": 1, "ranks": [[{"step": 3, "output": {"fields": o}} for o in outputs]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=1000)
    args = parser.parse_args()
    state = buffer_state(args.episodes, args.tokens)
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        write_array_state(folder, "rollout_buffer", state)
        write_s = time.perf_counter() - start
        size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
        start = time.perf_counter()
        back = read_array_state(folder, "rollout_buffer")
        read_s = time.perf_counter() - start
        path = os.path.join(folder, "trainer_state.json")
        start = time.perf_counter()
        with open(path, "w") as f:
            json.dump({"rollout_buffer": state}, f, indent=1)
        json_write_s = time.perf_counter() - start
        json_size = os.path.getsize(path)
        start = time.perf_counter()
        with open(path) as f:
            json.load(f)
        json_read_s = time.perf_counter() - start
    tokens = args.episodes * args.tokens
    print(f"{tokens:,} buffered tokens ({args.episodes} episodes x {args.tokens}), 3 numbers each")
    print(f"  arrays:        write {write_s:.2f} s, read {read_s:.2f} s, {size / 1e6:.1f} MB, equal: {back == state}")
    print(f"  indented JSON: write {json_write_s:.2f} s, read {json_read_s:.2f} s, {json_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
