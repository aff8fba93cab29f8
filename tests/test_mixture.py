"""Dataset mixtures (open_instruct/mixture.py, data.load_mixture, the interleaved EpisodeStream): amounts, errors,
determinism across runs and world sizes, and rows per source in the stream and in the plan."""

import json
import os
from types import SimpleNamespace

import pytest

from demo import synthetic
from open_instruct import data
from open_instruct.config import SFTConfig, parse_config
from open_instruct.errors import ConfigError
from open_instruct.mixture import parse_mixer_list, rows_to_take, select_rows
from open_instruct.plan import build_plan

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    d = tmp_path_factory.mktemp("mix")
    return {
        "a": synthetic.write_jsonl(str(d / "math_a.jsonl"), synthetic.sft_rows(300, 1)),
        "b": synthetic.write_jsonl(str(d / "chat_b.jsonl"), synthetic.sft_rows(400, 2)),
    }


def sft_config(*mixer: str, **kw) -> SFTConfig:
    return SFTConfig(model_name_or_path="m", dataset_mixer_list=list(mixer), **kw)


def test_amounts_fraction_count_and_upsampling(sources):
    a, b = parse_mixer_list([sources["a"], "0.5", sources["b"], "500"])
    assert (a.label, a.is_fraction, a.amount) == ("math_a", True, 0.5)
    assert (b.label, b.is_fraction, b.amount) == ("chat_b", False, 500)
    assert rows_to_take(a, 300) == 150 and rows_to_take(b, 400) == 500
    picked = select_rows(a, 300, seed=7)
    assert len(picked) == len(set(picked)) == 150 and picked == sorted(picked)
    up = select_rows(b, 400, seed=7)  # 500 of 400: every row once, 100 rows twice
    assert len(up) == 500 and set(up) == set(range(400)) and sum(up.count(i) == 2 for i in range(400)) == 100
    assert select_rows(a, 300, seed=7) == picked  # seeded
    assert select_rows(a, 300, seed=8) != picked
    (whole,) = parse_mixer_list([sources["a"], "1.0"])
    assert select_rows(whole, 300, seed=7) == list(range(300))


@pytest.mark.parametrize(
    "mixer, message",
    [
        (["{a}", "1.0", "{b}"], r"odd number of items \(3\): the last source '.*chat_b.jsonl' has no amount"),
        (["{a}", "-5"], r"entry '.*math_a.jsonl': negative row count -5"),
        (["{a}", "1.5"], r"entry '.*math_a.jsonl': fraction 1.5 is above 1.0; write a row count as an integer"),
        (["{a}", "1"], r"entry '.*math_a.jsonl': amount 1 is ambiguous"),
        (["{a}", "0"], r"entry '.*math_a.jsonl': row count 0"),
        (["{a}", "lots"], r"entry '.*math_a.jsonl': amount 'lots' is neither a fraction"),
        (["{a}", "1.0", "nope/missing.jsonl", "10"], r"entry 'nope/missing.jsonl': file does not exist"),
        (["1.0", "{a}"], r"expected a source name before amount '.*math_a.jsonl', got the number '1.0'"),
        (["{a}", "1.0", "{a}", "10"], r"listed twice"),
    ],
)
def test_bad_mixer_specs_name_the_entry(sources, mixer, message):
    tokens = [t.format(**sources) for t in mixer]
    with pytest.raises(ConfigError, match=message):
        sft_config(*tokens)


def test_bad_mixer_exits_2_before_any_model_loads(sources, capsys):
    from open_instruct import sft

    with pytest.raises(SystemExit) as exc:  # the model path does not exist: the config error must come first
        sft.main(["--model_name_or_path", "no/such/model", "--dataset_mixer_list", sources["a"], "-3"])
    assert exc.value.code == 2
    assert "negative row count -3" in capsys.readouterr().err


def test_recipe_yaml_list_and_either_or(sources, tmp_path):
    recipe = tmp_path / "mix.yaml"
    recipe.write_text(
        f"script: sft\nmodel_name_or_path: m\ndataset_mixer_list: [{sources['a']}, 1.0, {sources['b']}, 100]\n"
    )
    cfg = parse_config(SFTConfig, [str(recipe)])
    assert cfg.dataset_mixer_list == [sources["a"], "1.0", sources["b"], "100"]
    with pytest.raises(ConfigError, match="dataset_name_or_path or dataset_mixer_list, not both"):
        parse_config(SFTConfig, [str(recipe), "--dataset_name_or_path", sources["a"]])
    with pytest.raises(ConfigError, match="max_train_samples would cut a mixture"):
        parse_config(SFTConfig, [str(recipe), "--max_train_samples", "10"])
    with pytest.raises(ConfigError, match="train_order as_written with dataset_mixer_list"):
        parse_config(SFTConfig, [str(recipe), "--train_order", "as_written"])


def stream_sources(mixer: list[str], seed: int) -> tuple[list[tuple[str, int]], data.EpisodeStream]:
    rows, _ = data.load_mixture(mixer, "train", seed, "dataset_mixer_list")
    examples = [{"source": r.label, "row": r.index} for r in rows]
    cfg = SimpleNamespace(dataset_mixer_list=mixer, seed=seed)
    return [(e["source"], e["row"]) for e in examples], data.episode_stream(examples, cfg)


def test_three_to_one_mixture_holds_its_ratio_in_every_prefix(sources):
    # 300 rows of a (1.0) and 100 of b's 400 (count): 3:1. The sampler promises each source's share of the first N
    # episodes of an epoch to within one row (N x 3/4 rounded up or down), and exactly at the end of the epoch.
    mixer = [sources["a"], "1.0", sources["b"], "100"]
    identity, stream = stream_sources(mixer, seed=3)
    assert sum(s == "math_a" for s, _ in identity) == 300 and sum(s == "chat_b" for s, _ in identity) == 100
    for epoch in (0, 1):
        order = stream.take(epoch * 400, 400)
        assert sorted(order) == list(range(400))  # an epoch is a permutation of the mixture
        count_a = 0
        for n, i in enumerate(order, start=1):
            count_a += identity[i][0] == "math_a"
            assert abs(count_a - 0.75 * n) < 1, (epoch, n, count_a)
    first_64 = [identity[i][0] for i in stream.take(0, 64)]
    assert (first_64.count("math_a"), first_64.count("chat_b")) == (48, 16)

    # Deterministic: a second load + stream gives the same rows in the same order; another seed does not.
    identity2, stream2 = stream_sources(mixer, seed=3)
    assert [identity2[i] for i in stream2.take(0, 800)] == [identity[i] for i in stream.take(0, 800)]
    identity3, stream3 = stream_sources(mixer, seed=4)
    assert [identity3[i] for i in stream3.take(0, 400)] != [identity[i] for i in stream.take(0, 400)]


def test_world_size_2_reads_the_same_rows_as_world_size_1(sources):
    mixer = [sources["a"], "0.5", sources["b"], "50"]  # 150 : 50
    identity, stream = stream_sources(mixer, seed=5)
    batch = 16
    for step in range(30):  # past the epoch boundary (200 rows)
        global_idx = stream.take(step * batch, batch)
        one = data.EpisodeStream.local_slice(global_idx, 0, 1)
        two = [i for rank in (0, 1) for i in data.EpisodeStream.local_slice(global_idx, rank, 2)]
        assert [identity[i] for i in two] == [identity[i] for i in one]
        assert sum(identity[i][0] == "math_a" for i in one) == 12  # 16 x 3/4 in every step


def test_plain_dataset_order_is_unchanged():
    # No mixture: the stream is the plain seeded permutation it always was (recorded runs stay reproducible).
    import random

    order = list(range(50))
    random.Random(9 * 1_000_003 + 0).shuffle(order)
    assert data.EpisodeStream(50, 9).take(0, 50) == order


def test_load_train_eval_summary_and_source_labels(sources, tiny_models, tmp_path):
    from open_instruct.models import load_tokenizer

    tokenizer = load_tokenizer(tiny_models["causal_lm"])
    eval_a = synthetic.write_jsonl(str(tmp_path / "math_eval.jsonl"), synthetic.sft_rows(20, 11))
    eval_b = synthetic.write_jsonl(str(tmp_path / "chat_eval.jsonl"), synthetic.sft_rows(30, 12))
    cfg = sft_config(
        sources["a"], "0.1", sources["b"], "20", eval_dataset_mixer_list=[eval_a, "1.0", eval_b, "10"], seed=2
    )
    train, evals, stats = data.load_train_eval(cfg, tokenizer, data.tokenize_sft)
    assert len(train) == 50 and len(evals) == 30
    assert {e["source"] for e in train} == {"math_a", "chat_b"}
    assert data.mixed_sources(evals) == ["chat_eval", "math_eval"]
    assert [(s["label"], s["rows"], s["available"], s["kept"]) for s in stats.sources] == [
        ("math_a", 30, 300, 30),
        ("chat_b", 20, 400, 20),
    ]
    assert "per source: math_a 30 kept of 30 taken (fraction 0.1 of 300), chat_b 20 kept of 20 taken" in (
        stats.summary()
    )


def test_plan_shows_rows_per_source(sources, tmp_path):
    recipe = tmp_path / "mix.yaml"
    recipe.write_text(
        "script: sft\nmodel_name_or_path: meta-llama/Llama-3.1-8B\n"
        f"dataset_mixer_list: [{sources['a']}, 0.5, {sources['b']}, 250]\nper_device_train_batch_size: 2\n"
    )
    from open_instruct.plan import TimeAssumptions

    # fp32 8B on 2 processes needs ~2 x 80 GB GPUs; memory is not what this test checks
    plan = build_plan(str(recipe), [], 2, None, assumptions=TimeAssumptions(gpu_memory_gb=1000))
    assert plan["num_examples"] == 400
    assert [(s["label"], s["rows"], s["available"]) for s in plan["sources"]] == [
        ("math_a", 150, 300),
        ("chat_b", 250, 400),
    ]
    assert plan["optimizer_steps"] == 100  # 400 rows / (2 x 2 processes)
    from open_instruct.plan import format_plan

    text = format_plan(plan)
    assert "math_a" in text and "150" in text and "fraction 0.5 of 300 rows" in text
    json.dumps(plan)  # --json stays serialisable


def _metrics(output_dir) -> list[dict]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_sft_and_dpo_report_eval_metrics_per_source(tiny_models, tmp_path):
    """A mixed held-out set: eval/<source>/... per source, and each overall number is the weighted mean of the
    per-source ones (SFT: weighted by trained tokens, DPO: by pairs)."""
    import torch

    from open_instruct import dpo, sft

    torch.set_num_threads(1)
    sft_a = synthetic.write_jsonl(str(tmp_path / "sft_a.jsonl"), synthetic.sft_rows(40, 21))
    sft_b = synthetic.write_jsonl(str(tmp_path / "sft_b.jsonl"), synthetic.sft_rows(40, 22))
    out = tmp_path / "sft"
    sft.main(
        [os.path.join(REPO, "configs", "sft_tiny.yaml"), "--model_name_or_path", tiny_models["causal_lm"]]
        + ["--dataset_name_or_path", "", "--dataset_mixer_list", sft_a, "1.0", sft_b, "8"]
        + ["--eval_dataset_name_or_path", "null", "--eval_dataset_mixer_list", sft_a, "0.25", sft_b, "10"]
        + ["--output_dir", str(out), "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1"]
        + ["--eval_steps", "3", "--checkpointing_steps", "100", "--logging_steps", "1"]
        + ["--best_metric", "eval/sft_b/loss", "--best_metric_mode", "min"]  # a per-source metric picks best_model
    )
    row = [m for m in _metrics(out) if "eval/loss" in m][-1]
    a, b = row["eval/sft_a/loss"], row["eval/sft_b/loss"]
    assert min(a, b) - 1e-9 <= row["eval/loss"] <= max(a, b) + 1e-9 and a != b
    cfg = parse_config(SFTConfig, ["--model_name_or_path", "m", "--dataset_name_or_path", sft_a])
    cfg.eval_dataset_mixer_list = [sft_a, "0.25", sft_b, "10"]
    assert {k for k in row if k.count("/") == 2} == set(cfg.per_source_metric_names())  # accepted = logged
    with open(out / "best_model" / "training_info.json") as f:
        best = json.load(f)
    assert best["eval/sft_b/loss"] == min(m["eval/sft_b/loss"] for m in _metrics(out) if "eval/sft_b/loss" in m)

    pref_a = synthetic.write_jsonl(str(tmp_path / "pref_a.jsonl"), synthetic.preference_rows(24, 31))
    pref_b = synthetic.write_jsonl(str(tmp_path / "pref_b.jsonl"), synthetic.preference_rows(24, 32))
    out = tmp_path / "dpo"
    dpo.main(
        [os.path.join(REPO, "configs", "dpo_tiny.yaml"), "--model_name_or_path", tiny_models["causal_lm"]]
        + ["--dataset_name_or_path", "", "--dataset_mixer_list", pref_a, "1.0", pref_b, "8"]
        + ["--eval_dataset_name_or_path", "null", "--eval_dataset_mixer_list", pref_a, "0.5", pref_b, "4"]
        + ["--output_dir", str(out), "--reference_cache_dir", str(tmp_path / "cache")]
        + ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1", "--learning_rate", "3e-3"]
        + ["--eval_steps", "4", "--checkpointing_steps", "100", "--logging_steps", "1", "--best_metric", "null"]
    )
    row = [m for m in _metrics(out) if "eval/loss" in m][-1]
    for key in ("loss", "rewards/accuracy", "rewards/margin"):
        mixed = (12 * row[f"eval/pref_a/{key}"] + 4 * row[f"eval/pref_b/{key}"]) / 16
        assert row[f"eval/{key}"] == pytest.approx(mixed, rel=1e-5, abs=1e-7), key
