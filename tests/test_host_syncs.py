"""No host sync per micro-batch: the training step of every script reads the device a fixed number of times,
whatever the number of micro-batches (tests/host_syncs.py models the device on CPU and counts the reads), and copies
host data to the device without blocking (pinned memory, non-blocking copies) except a fixed few per step.

Each script runs one optimizer step split into 2 and into 4 micro-batches; the syncs our code makes must be the
same in number, and few. Syncs inside transformers are reported, not bounded (they are not this repository's)."""

import os

import pytest
from host_syncs import HostSyncCounter, count_between, count_during, model_gpu_copies
from training_helpers import one_torch_thread  # noqa: F401  (autouse fixture)

from demo.synthetic import preference_rows, rl_rows, sft_rows, write_jsonl
from open_instruct import distributed, runtime

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Per optimizer step of a supervised script: the step's statistics read once (StepSums.read) and the update's
# finiteness check (the logged grad norm is read from it).
MAX_SYNCS_PER_STEP = 2
# RL, one rollout and one optimizer step: the rollout's results copied to the host (log-probs and values; reward-model
# scores); the step's statistics and the update's token sums read once; per trained model (policy, value) the
# finiteness check and the logged grad norm.
MAX_RL_SYNCS = 2 + 2 + 2 * 2
# Blocking host-to-device copies per step, whatever the number of micro-batches: none in the supervised loops (their
# batches go through pinned memory); RL's rollout scoring is counted with its update (see the test).
MAX_BLOCKING_COPIES_PER_STEP = 0


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    d = tmp_path_factory.mktemp("sync_data")
    rows = {
        "sft": sft_rows(16, 0),
        "sft_eval": sft_rows(4, 1),
        "pref": preference_rows(16, 2),
        "pref_eval": preference_rows(4, 3),
        "rl": rl_rows(16, 4),
        "rl_eval": rl_rows(4, 5),
    }
    return {name: write_jsonl(str(d / f"{name}.jsonl"), r) for name, r in rows.items()}


def common(tiny_models, out, micro_batches, mini_batch, model="causal_lm"):
    return [
        "--model_name_or_path",
        tiny_models[model],
        "--output_dir",
        str(out),
        "--per_device_train_batch_size",
        str(mini_batch // micro_batches),
        "--logging_steps",
        "1",
        "--eval_steps",
        "1000",
        "--checkpointing_steps",
        "1000",
        "--seed",
        "3",
    ]


def supervised_syncs(monkeypatch, script, argv):
    """Host syncs of our code in the one optimizer step of a supervised script (sft, dpo, reward_model)."""
    counter = HostSyncCounter()
    with monkeypatch.context() as m:
        count_between(m, (distributed, "step_micro_batches"), (runtime.RunContext, "count_update"), counter)
        model_gpu_copies(m, counter)
        script.main(argv)
    return counter


# script -> (recipe, training data, held-out data, model): one optimizer step of each supervised script
SUPERVISED = {
    "sft": ("sft_tiny.yaml", "sft", "sft_eval", "causal_lm"),
    "dpo": ("dpo_tiny.yaml", "pref", "pref_eval", "causal_lm"),
    "reward_model": ("rm_tiny.yaml", "pref", "pref_eval", "seq_cls"),
}


def supervised_argv(name, tiny_models, task, out, micro_batches):
    recipe, train, held_out, model = SUPERVISED[name]
    return [
        os.path.join(REPO, "configs", recipe),
        "--dataset_name_or_path",
        task[train],
        "--eval_dataset_name_or_path",
        task[held_out],
        "--gradient_accumulation_steps",
        str(micro_batches),
        "--total_episodes",
        "8",
        *common(tiny_models, out, micro_batches, 8, model),
    ]


@pytest.mark.parametrize("name", list(SUPERVISED), ids=["sft", "dpo", "rm"])
def test_supervised_step_syncs_do_not_grow_with_micro_batches(name, tiny_models, task, tmp_path, monkeypatch):
    import importlib

    script = importlib.import_module(f"open_instruct.{name}")
    counts, copies = {}, {}
    for n in (2, 4):
        argv = supervised_argv(name, tiny_models, task, tmp_path / f"mb{n}", n)
        counter = supervised_syncs(monkeypatch, script, argv)
        counts[n], copies[n] = counter.ours(), counter.our_copies()
        print(f"{name}, {n} micro-batches: ours {dict(counts[n])}; inside libraries {dict(counter.theirs())}; "
              f"blocking copies {dict(copies[n])}")  # fmt: skip
    assert sum(counts[2].values()) == sum(counts[4].values()), counts
    assert sum(counts[4].values()) <= MAX_SYNCS_PER_STEP, counts[4]
    assert sum(copies[2].values()) == sum(copies[4].values()) <= MAX_BLOCKING_COPIES_PER_STEP, copies


def rl_argv(tiny_models, task, out, micro_batches, algo, sampling=()):
    # one rollout of 4 prompts x 2 samples, one epoch, one mini-batch: a single optimizer step
    extra = ["--beta", "0.05"] if algo == "ppo" else ["--beta", "0.05", "--kl_estimator", "k3", "--async_steps", "1"]
    return [
        os.path.join(REPO, "configs", "rlvr_tiny.yaml"),
        "--algo",
        algo,
        "--dataset_name_or_path",
        task["rl"],
        "--eval_dataset_name_or_path",
        task["rl_eval"],
        "--total_episodes",
        "8",
        "--local_rollout_batch_size",
        "4",
        "--num_samples_per_prompt",
        "2",
        "--gradient_accumulation_steps",
        str(micro_batches),
        "--num_epochs",
        "1",
        "--response_length",
        "6",
        "--temperature",
        "0.7",
        *extra,
        *sampling,
        *common(tiny_models, out, micro_batches, 8),
    ]


TRUNCATED = ("--top_p", "0.5", "--top_k", "20", "--min_p", "0.05")


@pytest.mark.parametrize("algo,sampling", [("ppo", ()), ("grpo", ()), ("grpo", TRUNCATED)])
def test_rl_syncs_do_not_grow_with_micro_batches(algo, sampling, tiny_models, task, tmp_path, monkeypatch):
    """PPO (value model, reference, on-policy) and GRPO (asynchronous: the rollout re-scores the sampling policy):
    the rollout's scoring forwards and the update's micro-batches; GRPO also with top-k / top-p / min-p sampling,
    whose truncated log-probs (a sort, a topk per chunk) stay on the device."""
    from open_instruct import rlvr_ppo

    counts, copies = {}, {}
    for n in (2, 4):
        counter = HostSyncCounter()
        with monkeypatch.context() as m:
            count_during(m, rlvr_ppo, "update", counter)
            count_during(m, rlvr_ppo, "collect_rollout", counter)
            model_gpu_copies(m, counter)
            rlvr_ppo.main(rl_argv(tiny_models, task, tmp_path / f"mb{n}", n, algo, sampling))
        counts[n], copies[n] = counter.ours(), counter.our_copies()
        print(f"{algo}, {n} micro-batches: ours {dict(counts[n])}; inside libraries {dict(counter.theirs())}; "
              f"blocking copies {dict(copies[n])}")  # fmt: skip
    assert sum(counts[2].values()) == sum(counts[4].values()), counts
    assert sum(counts[4].values()) <= MAX_RL_SYNCS, counts[4]
    assert sum(copies[2].values()) == sum(copies[4].values()), copies
