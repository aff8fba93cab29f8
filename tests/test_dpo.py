"""DPO (open_instruct/dpo.py) on the tiny model: the losses against hand-worked values, the reference log-prob
cache (live vs cached, shuffled, 1 vs 2 processes, reuse and invalidation), learning, and exact resume.

One short uninterrupted run (module fixture) is shared; its 2-process twin runs under torchrun."""

import glob
import json
import math
import os
import random
import subprocess
import sys
from typing import Any

import pytest
import torch
from training_helpers import (
    assert_rows_match,
    assert_weights_match,
    one_torch_thread,  # noqa: F401  (autouse fixture)
    read_metrics,
    sigterm_at_step,
)

from demo.synthetic import preference_rows, sft_rows, write_jsonl
from open_instruct import dpo, reference_cache
from open_instruct.config import DPOConfig
from open_instruct.models import PairLogps, pair_logps

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(REPO, "configs", "dpo_tiny.yaml")
STEPS = 12  # 96 episodes / global batch 8: 1.5 epochs of 64 pairs


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


# ---------------------------------------------------------------------------------------------------------------------
# Losses, by hand. Two pairs; response lengths chosen so that sums and per-token means differ.

POLICY = PairLogps(
    torch.tensor([-4.0, -10.0]), torch.tensor([-6.0, -9.0]), torch.tensor([2.0, 5.0]), torch.tensor([3.0, 3.0])
)
REF = PairLogps(
    torch.tensor([-5.0, -9.5]), torch.tensor([-5.5, -9.5]), torch.tensor([2.0, 5.0]), torch.tensor([3.0, 3.0])
)


def cfg_for(loss_type: str, **kw) -> DPOConfig:
    return DPOConfig(model_name_or_path="m", dataset_name_or_path="d.jsonl", loss_type=loss_type, **kw)


def test_dpo_sigmoid_and_label_smoothing_by_hand():
    # logratios: chosen (-4 + 5, -10 + 9.5) = (1, -0.5); rejected (-6 + 5.5, -9 + 9.5) = (-0.5, 0.5); h = (1.5, -1.0)
    beta = 0.1
    losses, chosen_r, rejected_r = dpo.preference_loss(cfg_for("dpo", beta=beta), POLICY, REF)
    assert losses.tolist() == pytest.approx([softplus(-0.15), softplus(0.1)], abs=1e-6)  # -log sigmoid(beta h)
    assert chosen_r.tolist() == pytest.approx([0.1, -0.05]) and rejected_r.tolist() == pytest.approx([-0.05, 0.05])
    # Conservative DPO, eps = 0.2: 0.8 * -log sigmoid(beta h) + 0.2 * -log sigmoid(-beta h)
    smoothed, _, _ = dpo.preference_loss(cfg_for("dpo", beta=beta, label_smoothing=0.2), POLICY, REF)
    assert smoothed.tolist() == pytest.approx(
        [0.8 * softplus(-0.15) + 0.2 * softplus(0.15), 0.8 * softplus(0.1) + 0.2 * softplus(-0.1)], abs=1e-6
    )


def test_dpo_norm_and_ipo_use_per_token_means_by_hand():
    # per-token means: policy chosen (-2, -2), rejected (-2, -3); ref chosen (-2.5, -1.9), rejected (-11/6, -19/6)
    lc = (-2 + 2.5, -2 + 1.9)  # (0.5, -0.1)
    lr = (-2 + 11 / 6, -3 + 19 / 6)  # (-1/6, 1/6)
    h = (lc[0] - lr[0], lc[1] - lr[1])  # (2/3, -4/15)
    losses, chosen_r, _ = dpo.preference_loss(cfg_for("dpo_norm", beta=5.0), POLICY, REF)
    assert losses.tolist() == pytest.approx([softplus(-5 * h[0]), softplus(-5 * h[1])], abs=1e-5)
    assert chosen_r.tolist() == pytest.approx([5 * lc[0], 5 * lc[1]], abs=1e-5)
    # IPO with beta (tau) 0.5: target margin 1 / (2 * 0.5) = 1; loss (h - 1)^2
    ipo, _, _ = dpo.preference_loss(cfg_for("ipo", beta=0.5), POLICY, REF)
    assert ipo.tolist() == pytest.approx([(2 / 3 - 1) ** 2, (-4 / 15 - 1) ** 2], abs=1e-5)


def test_simpo_is_reference_free_with_gamma_by_hand():
    # policy means: chosen (-2, -2), rejected (-2, -3); beta 2, gamma = 0.25 * 2 = 0.5
    cfg = cfg_for("simpo", beta=2.0, gamma_beta_ratio=0.25)
    losses, chosen_r, rejected_r = dpo.preference_loss(cfg, POLICY, None)
    assert losses.tolist() == pytest.approx([softplus(-(2 * 0.0 - 0.5)), softplus(-(2 * 1.0 - 0.5))], abs=1e-6)
    assert chosen_r.tolist() == pytest.approx([-4.0, -4.0]) and rejected_r.tolist() == pytest.approx([-4.0, -6.0])
    assert dpo.simpo_loss(torch.tensor([-1.0]), torch.tensor([-1.0]), 2.0, 0.0).item() == pytest.approx(math.log(2))


def test_wpo_weights_by_hand_and_detached():
    # w = exp(mean logp chosen + mean logp rejected) under the policy: (exp(-2 - 2), exp(-2 - 3))
    weights = dpo.wpo_weights(*POLICY.averages())
    assert weights.tolist() == pytest.approx([math.exp(-4), math.exp(-5)], rel=1e-6)
    losses, _, _ = dpo.preference_loss(cfg_for("wpo", beta=0.1), POLICY, REF)
    assert losses.tolist() == pytest.approx([math.exp(-4) * softplus(-0.15), math.exp(-5) * softplus(0.1)], rel=1e-5)
    # The weight is a constant for the gradient: d loss / d logp_chosen = -w * beta * sigmoid(-beta h).
    chosen = POLICY.chosen.clone().requires_grad_(True)
    loss, _, _ = dpo.preference_loss(cfg_for("wpo", beta=0.1), POLICY._replace(chosen=chosen), REF)
    loss.sum().backward()
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert chosen.grad.tolist() == pytest.approx(
        [-math.exp(-4) * 0.1 * sig(-0.15), -math.exp(-5) * 0.1 * sig(0.1)], rel=1e-5
    )


def test_bad_best_metric_is_a_config_error(tmp_path, capsys):
    """Checked when the config is parsed (DPOConfig.eval_metrics), before anything loads."""
    with pytest.raises(SystemExit) as e:
        dpo.main(
            [
                RECIPE,
                "--output_dir",
                str(tmp_path / "o"),
                "--model_name_or_path",
                str(tmp_path),
                "--best_metric",
                "eval/accuracy",
            ]
        )
    assert e.value.code == 2 and "eval/rewards/accuracy" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------------
# One short run (1 process, in this process), shared; its twin on 2 processes (torchrun, DDP over gloo).


@pytest.fixture(scope="module")
def pref_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("dpo_data")
    return {
        "train": write_jsonl(str(d / "train.jsonl"), preference_rows(64, 11)),
        "eval": write_jsonl(str(d / "eval.jsonl"), preference_rows(16, 12)),
    }


def run_args(tiny_models, pref_data, output_dir, cache_dir, world=1):
    """Global batch 8 either way: 4 x 2 accumulation on 1 process, 4 x 1 on each of 2."""
    return [
        RECIPE,
        "--model_name_or_path",
        tiny_models["causal_lm"],
        "--dataset_name_or_path",
        pref_data["train"],
        "--eval_dataset_name_or_path",
        pref_data["eval"],
        "--output_dir",
        str(output_dir),
        "--reference_cache_dir",
        str(cache_dir),
        "--total_episodes",
        str(8 * STEPS),
        "--per_device_train_batch_size",
        "4",
        "--gradient_accumulation_steps",
        str(2 // world),
        "--per_device_eval_batch_size",
        "6",
        "--learning_rate",
        "3e-3",
        "--lr_scheduler_type",
        "constant",
        "--logging_steps",
        "1",
        "--eval_steps",
        "4",
        "--checkpointing_steps",
        "4",
        "--keep_last_n_checkpoints",
        "5",
    ]


@pytest.fixture(scope="module")
def runs(tiny_models, pref_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dpo_runs")
    dpo.main(run_args(tiny_models, pref_data, tmp / "one", tmp / "cache_one"))
    return {"one": tmp / "one", "cache_one": tmp / "cache_one", "tmp": tmp}


@pytest.fixture(scope="module")
def two_process_run(runs, tiny_models, pref_data):
    """The same run on 2 processes under torchrun (DDP over gloo: accelerate's MULTI_CPU), 4 pairs per rank."""
    tmp = runs["tmp"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_", "OPEN_INSTRUCT_"))}
    env.update(
        PYTHONPATH=REPO, ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled"
    )
    args = run_args(tiny_models, pref_data, tmp / "two", tmp / "cache_two", world=2)
    args += ["--checkpointing_steps", str(STEPS), "--best_metric", ""]  # fewer saves; the logged rows are unaffected
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(_free_port()),
        os.path.join(REPO, "open_instruct", "dpo.py"),
        *args,
    ]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return {"two": tmp / "two", "cache_two": tmp / "cache_two", "log": proc.stdout + proc.stderr}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cache_file(folder) -> str:
    (path,) = glob.glob(os.path.join(str(folder), "ref_logps_*.safetensors"))
    return path


@pytest.mark.slow
def test_two_processes_match_one_and_write_the_same_cache(runs, two_process_run):
    from safetensors import safe_open
    from safetensors.torch import load_file

    assert "2 processes" in two_process_run["log"]  # the start-up line printed by rank 0: a real 2-process group
    with open(two_process_run["two"] / "checkpoints" / f"step_{STEPS}" / "trainer_state.json") as f:
        assert json.load(f)["world_size"] == 2
    one, two = _cache_file(runs["cache_one"]), _cache_file(two_process_run["cache_two"])
    assert os.path.basename(one) == os.path.basename(two)  # the key does not depend on the world size
    a, b = load_file(one), load_file(two)
    assert a.keys() == b.keys() and len(a["train/chosen_logps"]) == 64 and len(a["eval/chosen_logps"]) == 16
    for k in a:
        assert torch.allclose(a[k].double(), b[k].double(), atol=1e-6, rtol=0), k
    with safe_open(one, "pt") as f1, safe_open(two, "pt") as f2:
        assert f1.metadata() == f2.metadata()
    # Same global batch, same data order: the same per-step losses, rewards and final weights.
    assert_rows_match(read_metrics(runs["one"]), read_metrics(two_process_run["two"]), rel=1e-5)
    assert_weights_match(runs["one"] / "final_model", two_process_run["two"] / "final_model", atol=1e-5)


def test_cached_reference_equals_live_logps_in_shuffled_batches(runs, tiny_models, pref_data):
    """The initial model scores the pairs again, in a shuffled order and other batch sizes: each cached number
    (keyed by the example's position) matches its live value."""
    from safetensors.torch import load_file

    from open_instruct import data
    from open_instruct.config import parse_config
    from open_instruct.models import load_causal_lm, load_tokenizer

    cfg = parse_config(DPOConfig, run_args(tiny_models, pref_data, runs["one"], runs["cache_one"]))
    tokenizer = load_tokenizer(cfg.model_name_or_path)
    train, evals, _ = data.load_train_eval(cfg, tokenizer, data.tokenize_preferences)
    model = load_causal_lm(cfg.model_name_or_path).eval()
    cache = load_file(_cache_file(runs["cache_one"]))
    for split, examples, batch_size in (("train", train, 5), ("eval", evals, 3)):
        order = list(range(len(examples)))
        random.Random(0).shuffle(order)
        for i in range(0, len(order), batch_size):
            idx = order[i : i + batch_size]
            with torch.no_grad():
                live = pair_logps(model, data.collate_preferences([examples[j] for j in idx], tokenizer.pad_token_id))
            for name, value in (
                ("chosen_logps", live.chosen),
                ("rejected_logps", live.rejected),
                ("chosen_tokens", live.chosen_tokens),
                ("rejected_tokens", live.rejected_tokens),
            ):
                assert torch.allclose(cache[f"{split}/{name}"][idx].double(), value.double(), atol=1e-4, rtol=0), (
                    split,
                    name,
                    idx,
                )
        assert cache[f"{split}/row"].tolist() == [e["row"] for e in examples]


def test_step_zero_eval_is_chance_and_training_reuses_nothing_stale(runs):
    rows = read_metrics(runs["one"])
    first = rows[0]
    assert first["optimizer_step"] == 0 and first["episode"] == 0
    # Policy == reference: every reward is exactly 0 (same batches as the cached pass), a tie counts half a win.
    assert first["eval/rewards/margin"] == 0.0 and first["eval/rewards/accuracy"] == 0.5
    assert first["eval/loss"] == pytest.approx(math.log(2), abs=1e-6)
    train = [r for r in rows if "train/loss" in r]
    assert [r["optimizer_step"] for r in train] == list(range(1, STEPS + 1))
    assert train[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
    for key in (
        "train/rewards/chosen",
        "train/rewards/rejected",
        "train/rewards/margin",
        "train/rewards/accuracy",
        "train/logps/chosen",
        "train/logps/rejected",
        "lr",
        "perf/tokens_per_second",
        "perf/pairs_per_second",
        "episode",
        "optimizer_step",
        "rollout_step",
        "epoch",
    ):
        assert key in train[0], key
    assert train[-1]["episode"] == 8 * STEPS and train[-1]["epoch"] == 1.5


# ---------------------------------------------------------------------------------------------------------------------
# Cache reuse and invalidation


def test_cache_is_reused_and_invalidated_by_changes(tiny_models, tmp_path, capsys):
    train = preference_rows(24, 21)
    files = {
        "train": write_jsonl(str(tmp_path / "train.jsonl"), train),
        "eval": write_jsonl(str(tmp_path / "eval.jsonl"), preference_rows(6, 22)),
    }
    cache = tmp_path / "cache"

    def run(*extra, data=files):
        args = [
            RECIPE,
            "--model_name_or_path",
            tiny_models["causal_lm"],
            "--dataset_name_or_path",
            data["train"],
            "--eval_dataset_name_or_path",
            data["eval"],
            "--output_dir",
            str(tmp_path / "out"),
            "--reference_cache_dir",
            str(cache),
            "--total_episodes",
            "8",
            "--per_device_train_batch_size",
            "8",
            "--gradient_accumulation_steps",
            "1",
            "--save_final_model",
            "false",
            "--overwrite_output_dir",  # each call is a new run into the same folder
            "true",
            *extra,
        ]
        dpo.main(args)
        return capsys.readouterr().out

    out = run()
    assert "reference log-probs: computed for 24 train + 6 eval pairs" in out
    first = _cache_file(cache)
    stamp = os.stat(first).st_mtime_ns
    out = run("--loss_type", "ipo", "--beta", "0.3")  # the loss does not change the reference numbers
    assert f"reference log-probs: reused {first}" in out and os.stat(first).st_mtime_ns == stamp

    # A max_seq_length that drops the longest pairs (68 tokens; the others have 63-66): other examples, a new file.
    out = run("--max_seq_length", "66")
    assert (
        "13/24 rows kept: 0 bad, 11 dropped as over-long" in out and "reference log-probs: computed for 13 train" in out
    )
    assert len(glob.glob(str(cache / "ref_logps_*"))) == 2

    # One rejected answer edited: new data, new file.
    edited = [dict(r) for r in train]
    edited[5]["rejected"] = edited[5]["rejected"][:-1] + [{"role": "assistant", "content": "1+1=5"}]
    data2 = {"train": write_jsonl(str(tmp_path / "train2.jsonl"), edited), "eval": files["eval"]}
    assert "reference log-probs: computed" in run(data=data2)
    assert len(glob.glob(str(cache / "ref_logps_*"))) == 3

    # A damaged file is not trusted: recomputed and rewritten.
    with open(first, "r+b") as f:
        f.truncate(os.path.getsize(first) // 2)
    out = run()
    assert "unreadable" in out and "reference log-probs: computed" in out
    assert "reused" in run()

    # A cache that no longer matches the model (numbers edited, key intact) is caught by the step-0 eval.
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(first, "pt") as f:
        metadata = f.metadata()
    tables = load_file(first)
    tables["eval/chosen_logps"] += 0.5
    save_file(tables, first, metadata=metadata)
    out = run()
    assert "reused" in out and "WARNING: at step 0 the policy's log-probs differ from the cached reference" in out

    # SimPO needs no reference: no pass at all.
    assert "reference log-probs" not in run("--loss_type", "simpo", "--beta", "2.0", "--gamma_beta_ratio", "0.5")


def test_weights_fingerprint_sees_any_training_update(tiny_models):
    from open_instruct.models import load_causal_lm

    a, b = load_causal_lm(tiny_models["causal_lm"]), load_causal_lm(tiny_models["causal_lm"])
    assert reference_cache.weights_fingerprint(a) == reference_cache.weights_fingerprint(b)
    with torch.no_grad():
        b.model.norm.weight.add_(1e-6)  # one small tensor, a tiny step
    assert reference_cache.weights_fingerprint(a) != reference_cache.weights_fingerprint(b)


def test_reference_cache_key_changes_with_every_setting_that_changes_the_numbers(tiny_models):
    """FSDP2 vs autocast, padded vs packed, the attention kernel and the precision each change the reference
    log-probs' low bits: each must name another file in a shared reference_cache_dir; the same settings, the same."""
    from types import SimpleNamespace

    from open_instruct.models import load_causal_lm

    pairs = [{"prompt_len": 2, "chosen_ids": [1, 2, 3], "rejected_ids": [1, 2, 4]}]
    models = {kernel: load_causal_lm(tiny_models["causal_lm"], attn_implementation=kernel) for kernel in ("sdpa",
              "eager", "sdpa_varlen")}  # fmt: skip
    base = dict(
        model_name_or_path="m", model_revision=None, gguf_file=None, dataset_name_or_path="d", dataset_mixer_list=None,
        dataset_split="train", eval_dataset_name_or_path=None, eval_dataset_mixer_list=None, eval_dataset_split="test",
        mixed_precision="no", max_tokens_per_micro_batch=None, per_device_eval_batch_size=4, output_dir="o",
        reference_cache_dir="shared",
    )  # fmt: skip

    def path(kernel: str = "sdpa", fsdp: bool = False, **changes: Any) -> str:
        cfg = SimpleNamespace(**{**base, **changes})
        identity = reference_cache.reference_cache_identity(cfg, models[kernel], pairs, [], fsdp)
        return reference_cache.reference_cache_path(cfg, identity)

    variants = [
        path(fsdp=True),
        path(mixed_precision="bf16"),
        path("sdpa_varlen", max_tokens_per_micro_batch=512),
        path("sdpa", max_tokens_per_micro_batch=512),
        path("eager"),
        path(per_device_eval_batch_size=8),
    ]
    assert path() == path()  # deterministic: weights, data and settings only
    assert len({path(), *variants}) == 1 + len(variants)


def test_reference_cache_defaults_inside_output_dir(tmp_path):
    """A run writes nowhere outside its output_dir: the default cache folder is <output_dir>/ref_cache (it was
    <output_dir>/../.ref_cache); reference_cache_dir still moves it (a sweep shares one)."""
    from types import SimpleNamespace

    out = str(tmp_path / "runs" / "dpo_a")
    path = reference_cache.reference_cache_path(SimpleNamespace(output_dir=out, reference_cache_dir=None), {"k": 1})
    assert os.path.dirname(path) == os.path.join(out, "ref_cache")
    shared = str(tmp_path / "sweep_cache")
    moved = reference_cache.reference_cache_path(SimpleNamespace(output_dir=out, reference_cache_dir=shared), {"k": 1})
    assert moved == os.path.join(shared, os.path.basename(path))  # same key, other folder


# ---------------------------------------------------------------------------------------------------------------------
# Resume


def test_resume_mid_epoch_matches_uninterrupted_run(runs, tiny_models, pref_data, tmp_path, monkeypatch, capsys):
    out = tmp_path / "preempted"
    args = run_args(tiny_models, pref_data, out, runs["cache_one"])
    with sigterm_at_step(monkeypatch, 5):  # step 5 of 8 in the first epoch
        dpo.main(args)
    assert not (out / "final_model").exists()
    assert sorted(os.listdir(out / "checkpoints")) == ["step_4", "step_5"]
    printed = capsys.readouterr().out
    assert "SIGTERM: checkpoint written at optimizer step 5" in printed and "reference log-probs: reused" in printed

    dpo.main(args + ["--resume_from_checkpoint", "auto"])
    assert f"resumed from {out / 'checkpoints' / 'step_5'}" in capsys.readouterr().out
    assert_rows_match(read_metrics(runs["one"]), read_metrics(out))
    assert_weights_match(runs["one"] / "final_model", out / "final_model")


# ---------------------------------------------------------------------------------------------------------------------
# Learning


@pytest.mark.slow
def test_dpo_raises_heldout_preference_accuracy_from_chance_to_above_90pct(tiny_models, tmp_path):
    """SFT the tiny model briefly, then DPO on held-out-tested arithmetic preferences (operands 1..3, answers
    differing only in the result): eval accuracy 0.5 at step 0 -> > 0.9, with the margin growing at every eval."""
    from open_instruct import sft

    d = tmp_path
    sft_file = write_jsonl(str(d / "sft.jsonl"), sft_rows(1000, 0, max_operand=3))
    sft.main(
        [
            os.path.join(REPO, "configs", "sft_tiny.yaml"),
            "--model_name_or_path",
            tiny_models["causal_lm"],
            "--dataset_name_or_path",
            sft_file,
            "--eval_dataset_name_or_path",
            sft_file,
            "--max_eval_samples",
            "32",
            "--output_dir",
            str(d / "sft"),
            "--num_train_epochs",
            "2",
            "--learning_rate",
            "3e-3",
            "--lr_scheduler_type",
            "linear",
            "--warmup_ratio",
            "0.05",
            "--per_device_train_batch_size",
            "16",
            "--gradient_accumulation_steps",
            "2",
            "--seed",
            "1",
            "--eval_steps",
            "1000",
            "--checkpointing_steps",
            "1000",
        ]
    )
    train = write_jsonl(str(d / "pref_train.jsonl"), preference_rows(1000, 2, max_operand=3))
    held_out = write_jsonl(str(d / "pref_eval.jsonl"), preference_rows(200, 3, max_operand=3))
    dpo.main(
        [
            RECIPE,
            "--model_name_or_path",
            str(d / "sft" / "final_model"),
            "--dataset_name_or_path",
            train,
            "--eval_dataset_name_or_path",
            held_out,
            "--output_dir",
            str(d / "dpo"),
            "--loss_type",
            "dpo",
            "--beta",
            "0.5",
            "--learning_rate",
            "1e-3",
            "--lr_scheduler_type",
            "linear",
            "--warmup_ratio",
            "0.05",
            "--num_train_epochs",
            "1",
            "--per_device_train_batch_size",
            "16",
            "--gradient_accumulation_steps",
            "1",
            "--seed",
            "1",
            "--eval_steps",
            "16",
            "--checkpointing_steps",
            "1000",
            "--best_metric",
            "eval/rewards/accuracy",
        ]
    )
    evals = [r for r in read_metrics(d / "dpo") if "eval/loss" in r]
    acc = [r["eval/rewards/accuracy"] for r in evals]
    margin = [r["eval/rewards/margin"] for r in evals]
    print(
        f"eval accuracy {acc}, margin {[round(m, 3) for m in margin]} at steps {[r['optimizer_step'] for r in evals]}"
    )
    assert [r["optimizer_step"] for r in evals] == [0, 16, 32, 48, 62]
    assert acc[0] == 0.5 and margin[0] == 0.0  # policy == reference
    assert acc[-1] > 0.9
    assert all(b > a for a, b in zip(margin, margin[1:])), margin
    assert evals[-1]["eval/loss"] < 0.5 * math.log(2)
    assert (d / "dpo" / "best_model" / "model.safetensors").exists()
