"""bench/bench_throughput.py: its workload (long-tailed lengths in 32..1024), its FLOP count (N without the input
embedding, by hand) and one real CPU run of its tiny preset whose MFU is 6 N tokens/s over the GEMM peak it measured
(the formula docs/benchmarks.md's throughput table rests on)."""

import argparse
import os
import random
import statistics
import sys

import pytest
from training_helpers import bench_script

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bench():
    module = bench_script("bench_throughput.py")
    yield module
    sys.modules.pop("bench_throughput", None)


def test_lengths_are_long_tailed_within_32_to_1024(bench):
    drawn = bench.lengths(4000, random.Random(0), median=180)
    assert min(drawn) >= 32 and max(drawn) <= 1024
    assert 160 <= statistics.median(drawn) <= 200
    assert statistics.mean(drawn) > 1.15 * statistics.median(drawn)  # a long right tail pulls the mean up
    assert sum(x > 600 for x in drawn) > 40  # ~2% beyond 600 tokens


def test_sft_rows_have_the_drawn_token_lengths(bench, tiny_models):
    from open_instruct.data import chat_ids
    from open_instruct.models import load_tokenizer

    tokenizer = load_tokenizer(tiny_models["causal_lm"])
    rows = bench.sft_rows(50, 0, median=180, high=1024)
    expected = bench.lengths(50, random.Random(0), 180)
    assert [len(chat_ids(tokenizer, r["messages"])) for r in rows] == expected


def test_flop_count_and_mfu_of_a_tiny_cpu_run(bench, tmp_path):
    """N by hand for the tiny preset (hidden 64, 2 layers, 4 heads / 2 KV heads of 16, MLP 128, vocab 1024); one
    packed SFT worker run; its MFU = 6 N tokens/s / the worker's fp32 GEMM peak."""
    from transformers import AutoModelForCausalLM

    p = bench.PRESETS["tiny"]
    models = bench.build_models(str(tmp_path / "models"), p)
    n = bench.flops_params(AutoModelForCausalLM.from_pretrained(models["causal_lm"]))
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64  # q, o; k, v; gate, up, down; 2 norms
    assert n == 2 * per_layer + 64 + 64 * 1024  # + final norm + output layer (the input embedding is left out)
    args = argparse.Namespace(
        preset="tiny", workloads=["sft"], variants=["ours_packed"], precision="no", threads=1, repeats=1,
        workdir=str(tmp_path), json=None,
    )  # fmt: skip
    result = bench.run(args, p)["sft"]["ours_packed"][0]
    assert result["tokens_per_second"] > 0 and result["peak_flops"] > 1e9
    assert result["mfu"] == pytest.approx(6 * n * result["tokens_per_second"] / result["peak_flops"], rel=1e-12)
    assert 0 < result["mfu"] < 1


def test_bench_counts_flops_like_the_scripts(bench):
    """One FLOPs count (open_instruct.gpu_stats): a tied output layer is no longer dropped from N."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from open_instruct.gpu_stats import matmul_params, mfu

    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    tied = LlamaForCausalLM(LlamaConfig(vocab_size=100, tie_word_embeddings=True, **shape))
    assert bench.flops_params(tied) == matmul_params(tied) == sum(p.numel() for p in tied.parameters())
    assert bench.mfu(1000, 2.0, 12e3) == mfu(6000, 2.0, 12e3) == 1.0
