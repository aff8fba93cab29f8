"""Async rollouts (async_steps N): the staleness bound, per-token weight versions across an in-flight update, the
off-policy masks, the rollouts in flight saved with a checkpoint, and kills of an async run at chosen moments (a
generation in flight, a weight update, a checkpoint, a random moment) resuming to the uninterrupted result.

The sampler tests drive `rollouts.RolloutSampler` with a stand-in generator (no model): each token it "samples" is
labelled with the version the stand-in holds at that moment, and a test decides with events when a weight update
lands inside a response. The end-to-end tests run rlvr_ppo.py on the hf backend (its own frozen copy of the policy
per version, generating in a background thread), which is deterministic, so weights must match bit for bit.
"""

from __future__ import annotations

import glob
import os
import signal
import threading
from types import SimpleNamespace

import pytest
import torch
from _reliability_helpers import Run, Zygote, assert_same_rows, assert_same_weights, read_rows, stop_at
from training_helpers import one_torch_thread  # noqa: F401  (autouse fixture: one intra-op thread in this process)

from demo.synthetic import rl_rows, write_jsonl
from open_instruct import checkpoint, rlvr_ppo
from open_instruct.generation import GenerationOutput
from open_instruct.rollouts import RolloutSampler, output_from_state, output_state, token_version_lags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------------------------------------------------
# A stand-in generator and sampler


class StandInGenerator:
    """Generates `length` tokens per prompt and sample, each labelled with the version it holds when the token is
    made, with log-prob -1 - version/2. `in_flight_weight_updates` True: sync_weights may land mid-response; with
    `span` = (call, token, version), the weight update to `version` waits until generate call number `call` has made
    `token` tokens of its first response, and that response waits for it (events, no sleeps): it then spans two
    versions exactly there."""

    last_sync_seconds, last_sync_bytes = 0.0, 0

    def __init__(self, in_flight: bool, length: int = 4, span: tuple = (0, 0, 0)) -> None:
        self.in_flight_weight_updates = in_flight
        self.length, self.span = length, span
        self.version, self.model = -1, None
        self.at_span, self.updated = threading.Event(), threading.Event()
        self.calls: list[int] = []  # the version each generate call started with

    def sync_weights(self, model, version=None):
        if self.span[0] and version == self.span[2]:
            assert self.at_span.wait(timeout=60), "the response never reached the update point"
        self.model, self.version = model, version
        if version == self.span[2]:
            self.updated.set()

    def generation_context(self, model):
        import contextlib

        return contextlib.nullcontext()

    def generate(self, prompt_ids, config, max_new_tokens=None):
        self.calls.append(self.version)
        out = GenerationOutput(prompt_ids=[list(p) for p in prompt_ids])
        for i, p in enumerate(prompt_ids):
            for _ in range(config.n):
                versions = []
                for t in range(self.length):
                    if (len(self.calls), t, len(out.response_ids)) == (self.span[0], self.span[1], 0):
                        self.at_span.set()
                        assert self.updated.wait(timeout=60), "the weight update never came"
                    versions.append(self.version)
                out.response_ids.append([p[0]] * self.length)
                out.texts.append("x" * self.length)
                out.stopped.append(True)
                out.prompt_index.append(i)
                out.logprobs.append([-1.0 - v / 2 for v in versions])
                out.weight_versions.append(versions)
        return out


def stand_in_sampler(generator, depth: int, rollouts: int = 8):
    cfg = SimpleNamespace(
        async_steps=depth, response_length=4, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, stop_strings=None,
        num_samples_per_prompt=2, seed=1,
    )  # fmt: skip
    policy = torch.nn.Linear(2, 2)
    accelerator = SimpleNamespace(process_index=0, num_processes=1, unwrap_model=lambda m: m)
    prompts_for = lambda step: [{"prompt_ids": [100 + step, 1]}, {"prompt_ids": [200 + step, 1]}]  # noqa: E731
    return RolloutSampler(cfg, generator, policy, accelerator, prompts_for, rollouts)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_frozen_copies_give_each_rollout_one_version_within_the_bound(depth):
    """A generator that cannot take weights in flight (hf) gets a frozen copy of the policy per version, in order:
    rollout j is generated entirely by version max(j - N, 0), so its tokens' lag is exactly min(j, N) <= N, and the
    prompts trained on are rollout j's, once each."""
    gen = StandInGenerator(in_flight=False)
    sampler = stand_in_sampler(gen, depth)
    for step in range(8):
        prompts, out, _, _ = sampler.take(step)
        assert [p["prompt_ids"][0] for p in prompts] == [100 + step, 200 + step]
        lags = token_version_lags(out, step)
        assert all(lag == min(step, depth) for row in lags for lag in row), (step, lags)
        assert sorted(sampler.in_flight) == list(range(step + 1, min(step + depth, 7) + 1))
        with torch.no_grad():  # the trainer's update: the copies taken before it must not move
            sampler.policy.weight.add_(1.0)
    assert gen.calls == [max(j - depth, 0) for j in range(8)]
    # each version's copy is the policy as it was then, not a reference to the live module
    sampler.idle()  # (the last copy handed over)
    assert gen.model is not sampler.policy and torch.allclose(gen.model.weight, sampler.policy.weight - 1.0)
    sampler.close()


def test_response_spanning_an_in_flight_update_keeps_per_token_versions_and_weights():
    """Dedicated engines take weights in flight. With N = 2, rollout 2 is submitted at take(0) (version 0) and is
    generating when take(1) sends version 1: its first response, 2 tokens in when the update lands, carries versions
    [0, 0, 1, 1] and the sampler's log-probs of each version; trained at version 2 its lags are [2, 2, 1, 1]. Its
    truncated-IS weights use each token's own sampler log-prob: with trainer log-probs -0.7,
    w = min(exp(-0.7 + 1.0), 2) = exp(0.3) = 1.3499 on the version-0 tokens and min(exp(-0.7 + 1.5), 2) = 2 (exp(0.8)
    = 2.2255 capped) on the version-1 ones; IcePop with high 2 keeps the first two only, sequence masking at lag 1
    drops the row."""
    gen = StandInGenerator(in_flight=True, span=(3, 2, 1))  # call 3 = rollout 2; the update to version 1
    sampler = stand_in_sampler(gen, depth=2)
    outs = [sampler.take(step)[1] for step in range(3)]
    assert outs[1].weight_versions == [[0] * 4] * 4  # rollout 1 finished before version 1 was sent
    assert outs[2].weight_versions[0] == [0, 0, 1, 1] and outs[2].weight_versions[1:] == [[1] * 4] * 3
    assert outs[2].logprobs[0] == [-1.0, -1.0, -1.5, -1.5]
    assert token_version_lags(outs[2], 2)[0] == [2, 2, 1, 1]
    old_logp, sampler_logp = torch.full((1, 4), -0.7), torch.tensor([outs[2].logprobs[0]])
    weights = rlvr_ppo.truncated_is_weights(old_logp, sampler_logp, cap=2.0)
    assert torch.allclose(weights, torch.tensor([[1.3498588, 1.3498588, 2.0, 2.0]]))  # exp(0.8) capped
    kept = rlvr_ppo.off_policy_mask(old_logp, sampler_logp, torch.tensor([2]), None, 2.0, None)
    assert kept.tolist() == [[1.0, 1.0, 0.0, 0.0]]  # exp(0.8) = 2.23 > 2
    kept = rlvr_ppo.off_policy_mask(old_logp, sampler_logp, torch.tensor([2]), 0.5, None, 1)
    assert kept.tolist() == [[0.0, 0.0, 0.0, 0.0]]  # lag 2 > 1: the whole completion
    kept = rlvr_ppo.off_policy_mask(old_logp, sampler_logp, torch.tensor([2]), 1.4, None, 2)
    assert kept.tolist() == [[0.0, 0.0, 1.0, 1.0]]  # exp(0.3) = 1.35 < 1.4; lag 2 <= 2
    sampler.close()


def test_staleness_never_exceeds_the_bound_with_updates_in_flight():
    """Whatever the interleaving of generation and in-flight updates, every token trained on at rollout k was sampled
    by a version >= k - N, and the versions within a response never go down."""
    for depth in (1, 2, 4):
        gen = StandInGenerator(in_flight=True, length=6)
        sampler = stand_in_sampler(gen, depth, rollouts=10)
        for step in range(10):
            _, out, _, _ = sampler.take(step)
            for versions in out.weight_versions:
                assert versions == sorted(versions) and min(versions) >= step - depth and max(versions) <= step
        sampler.close()


def test_version_spans_become_per_token_versions_and_a_missed_update_is_caught():
    """vLLM reports [start, end) spans per version; a response cut after its stop keeps the first tokens' versions.
    A label the engine was never sent since the call began means it missed an update: EngineError naming it."""
    from open_instruct.engine_client import ServerGenerator, token_versions
    from open_instruct.engines import EngineError
    from open_instruct.generation import GenerationConfig

    spans = [{"version": "3", "start": 0, "end": 4}, {"version": "4", "start": 4, "end": 9}]
    assert token_versions(spans, 7, -1) == [3, 3, 3, 3, 4, 4, 4]
    assert token_versions(None, 3, 5) == [5, 5, 5]

    class Tok:
        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(97 + i % 26) for i in ids)

    gen = object.__new__(ServerGenerator)
    gen.tokenizer, gen.eos_ids, gen.urls = Tok(), [0], ["http://engine:1"]
    gen.version, gen.sent_versions, gen.adapter_dir = 4, {2, 3, 4}, None  # merged-weight syncs
    out = GenerationOutput(prompt_ids=[[1]])
    lp = {"content": [{"logprob": -0.1 * t} for t in range(6)]}
    choice = {"token_ids": [5, 6, 7, 8, 9, 0, 11], "weight_versions": spans, "logprobs": lp, "finish_reason": "stop"}
    gen._append(out, 0, 0, choice, GenerationConfig(max_new_tokens=8), 3)
    assert out.response_ids == [[5, 6, 7, 8, 9, 0]] and out.weight_versions == [[3, 3, 3, 3, 4, 4]]
    with pytest.raises(EngineError, match=r"engine 0 \(http://engine:1\) sampled with weight version\(s\) \[3\]"):
        gen._append(out, 0, 0, choice, GenerationConfig(max_new_tokens=8), 4)  # the call began at version 4


def test_version_lag_counts_sampled_tokens_only_and_sums_by_lag():
    """Per-token lag = trainer version - sampling version; tokens an environment wrote (loss_masks 0) have none.
    version_lag_stats: tokens 5, lags [0, 1, 1, 2, 3] at bound 2 -> sum 7, lag_0 1, lag_1 2, lag_2 1, beyond 1."""
    out = GenerationOutput(prompt_ids=[[1]], weight_versions=[[5, 4, 4, 9], [3, 2]])
    out.loss_masks = [[1, 1, 1, 0], [1, 1]]
    lags = token_version_lags(out, 5)
    assert lags == [[0, 1, 1], [2, 3]]
    stats = rlvr_ppo.version_lag_stats(lags, bound=2)
    assert stats == {"lag_tokens": 5, "lag_sum": 7, "lag_0": 1, "lag_1": 2, "lag_2": 1, "lag_3": 1}


def test_rollouts_in_flight_round_trip_through_a_checkpoint_and_stale_ones_are_regenerated():
    """state_dict drains the rollouts in flight and keeps every per-token list of their outputs (a multi-turn
    episode's loss_masks too), bit for bit through JSON; a sampler resumed at that step uses them as they are. One
    resumed with a shallower pipeline (async_steps 1, accepted with allow_resume_changes) keeps only what its depth
    holds and regenerates a rollout whose tokens are beyond its bound, from the same prompts."""
    import json

    gen = StandInGenerator(in_flight=False)
    sampler = stand_in_sampler(gen, depth=2)
    for step in range(3):
        sampler.take(step)
    state = json.loads(json.dumps(sampler.state_dict()))  # rollouts 3, 4 (versions 1, 2), as a checkpoint holds it
    assert [e["step"] for e in state["ranks"][0]] == [3, 4]
    before = {s: e.output for s, e in sampler.in_flight.items()}
    sampler.close()

    resumed = stand_in_sampler(StandInGenerator(in_flight=False), depth=2)
    assert resumed.load_state_dict(state, next_step=3) == [3, 4]
    prompts, out, _, _ = resumed.take(3)
    assert vars(out) == vars(before[3]) and [p["prompt_ids"][0] for p in prompts] == [103, 203]
    resumed.idle()
    assert resumed.regenerated == 0 and resumed.generator.calls == [3]  # only rollout 5 generated (version 3)
    resumed.close()

    shallow = stand_in_sampler(StandInGenerator(in_flight=False), depth=1)
    assert shallow.load_state_dict(state, next_step=3) == [3]  # rollout 4 is beyond a depth of 1 at step 3
    _, out, _, _ = shallow.take(3)  # rollout 3 from version 1: lag 2 > 1, so generated again at version 3
    assert shallow.regenerated == 1 and shallow.generator.calls[0] == 3
    assert all(v == 3 for row in out.weight_versions for v in row)
    shallow.close()

    episode = GenerationOutput(prompt_ids=[[1]], response_ids=[[4, 5]], logprobs=[[-0.1234567, 0.0]])
    episode.loss_masks = [[1, 0]]
    back = output_from_state(json.loads(json.dumps(output_state(episode))))
    assert type(back) is GenerationOutput and vars(back) == vars(episode)
    with pytest.raises(ValueError, match="not one of open_instruct's"):
        output_from_state({"class": "os:system", "fields": {}})


def test_async_config_rules():
    """async_steps N > 1 is accepted (hf and dedicated engines); the colocated vllm engine is refused, as are masks
    outside their ranges; truncated IS defaults on with async; a resume with another async_steps is a resume key."""
    from open_instruct.config import RLVRConfig
    from open_instruct.errors import ConfigError

    def cfg(**kw):
        c = RLVRConfig(model_name_or_path="m", dataset_name_or_path="d", total_episodes=8, **kw)
        c.resolve_defaults()
        c.validate()
        return c

    assert cfg(async_steps=4).truncated_importance_sampling is True
    assert cfg(async_steps=3, generation_backend="vllm_server").async_steps == 3
    with pytest.raises(ConfigError, match="async_steps 2 needs generation_backend vllm_server"):
        cfg(async_steps=2, generation_backend="vllm")
    with pytest.raises(ConfigError, match="is_mask_low must be in"):
        cfg(is_mask_low=1.5)
    with pytest.raises(ConfigError, match="is_mask_high must be >= 1"):
        cfg(is_mask_high=0.5)
    layout = checkpoint.resume_layout({**vars(cfg(async_steps=2)), "script": "rlvr_ppo"}, 1)
    assert layout["async_steps"][0] == 2


# ---------------------------------------------------------------------------------------------------------------------
# Kill an async run at chosen moments and resume: the uninterrupted run's rows, episodes and weights


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    d = tmp_path_factory.mktemp("async_data")
    return {
        "rl": write_jsonl(str(d / "rl.jsonl"), rl_rows(64, 4)),
        "rl_eval": write_jsonl(str(d / "ev.jsonl"), rl_rows(8, 5)),
    }


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


# 8 rollouts of 4 prompts x 2 samples, async_steps 2, 2 mini-batches each; checkpoints every 2 rollouts; every
# completion written to samples.jsonl (the episode sequence: which prompts each rollout trained on).
def async_argv(models, task, out, *extra):
    return [
        os.path.join(REPO, "configs", "rlvr_tiny.yaml"),
        "--model_name_or_path", models["causal_lm"],
        "--dataset_name_or_path", task["rl"],
        "--eval_dataset_name_or_path", task["rl_eval"],
        "--output_dir", str(out),
        "--total_episodes", "64",
        "--local_rollout_batch_size", "4",
        "--num_samples_per_prompt", "2",
        "--per_device_train_batch_size", "4",
        "--num_epochs", "1",
        "--response_length", "8",
        "--eval_steps", "4",
        "--checkpointing_steps", "2",
        "--num_samples_logged", "8",
        "--async_steps", "2",
        *extra,
    ]  # fmt: skip


def start(zygote, argv, out, **kw) -> Run:
    return Run(zygote, "rlvr_ppo", argv, str(out) + f".{len(glob.glob(str(out) + '.*.log'))}.log", **kw)


def ended(run: Run, code: int) -> Run:
    got = run.wait()
    assert got == code, f"exit {got}, expected {code}:\n{run.output()[-4000:]}"
    return run


def rollouts_logged(out) -> int:
    return max((r["rollout_step"] for r in read_rows(str(out)) if "train/score_mean" in r), default=0)


@pytest.mark.concurrency
@pytest.mark.slow
def test_async_run_killed_in_flight_preempted_and_killed_in_a_weight_update_and_a_save_resumes_exactly(
    zygote, tiny_models, task, tmp_path
):
    """async_steps 2 on the hf backend: killed with responses in flight, preempted (SIGTERM: the rollouts in flight
    drained into the checkpoint), killed as a weight version goes to the generator, killed inside a checkpoint write;
    each time resumed with `auto`. The metrics rows (version lags included), every completion trained on (prompt,
    response, score: the episode sequence) and the final weights equal an uninterrupted run's."""
    ref, out = tmp_path / "reference" / "out", tmp_path / "crashed" / "out"
    ended(start(zygote, async_argv(tiny_models, task, ref), ref), 0)
    argv = async_argv(tiny_models, task, out)
    resume = argv + ["--resume_from_checkpoint", "auto"]

    # 1. SIGKILL at the 3rd decoding step of generate call 4 (1: the step-0 eval, 2-4: rollouts 0-2), which runs in
    #    the background thread while the trainer trains on rollout 0 or 1: responses in flight.
    ended(start(zygote, argv, out, faults={"kill_in_generation": {"call": 4, "forward": 3}}), -signal.SIGKILL)
    assert rollouts_logged(out) <= 2

    # 2. SIGTERM after rollout 3's row: the rollouts in flight are completed and saved with the checkpoint.
    run = start(zygote, resume, out, env=stop_at("metrics_row", 3))
    run.signal_at_stop(signal.SIGTERM)
    ended(run, 0)
    reached = rollouts_logged(out)  # stopped right after rollout 3's row: the SIGTERM lands there
    assert reached == 3 and f"SIGTERM: checkpoint written at rollout step {reached}" in run.output()

    # 3. SIGKILL as the weights of version 5 go to the generator (rollout 5 taken, rollout 6 in flight).
    ended(start(zygote, resume, out, env={checkpoint.FAULT_ENV: "weight_sync:step_5"}), -signal.SIGKILL)
    assert rollouts_logged(out) == 5

    # 4. SIGKILL with the rollouts in flight written into the checkpoint of rollout 6 (optimizer step 12), before it
    #    is renamed into place: the resume goes back to the one before.
    ended(start(zygote, resume, out, env={checkpoint.FAULT_ENV: "checkpoint_write:step_12"}), -signal.SIGKILL)
    assert rollouts_logged(out) == 6

    # 5. Resume to the end.
    ended(start(zygote, resume, out), 0)
    assert_same_rows(read_rows(str(ref)), read_rows(str(out)))
    assert_same_rows(read_rows(str(ref), "samples.jsonl"), read_rows(str(out), "samples.jsonl"))
    assert_same_weights(ref / "final_model", out / "final_model")
    lags = [r["train/version_lag_mean"] for r in read_rows(str(out)) if "train/version_lag_mean" in r]
    assert lags == [0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]  # rollout j: version max(j - 2, 0), lag min(j, 2)


def exact_rows(out, name: str = "metrics.jsonl") -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in read_rows(str(out), name)]


def test_async_runs_with_activation_checkpointing_are_deterministic(zygote, tiny_models, task, tmp_path):
    """GRPO, async_steps 2: the training thread's activation checkpointing saves and restores the process-wide RNG on
    every recompute while the background thread generates. The generator samples from a torch.Generator of its own,
    so two runs with activation checkpointing log the same rows and end with the same weights, exactly, and they
    sample the same completions as a run without it (whose numbers differ from theirs in the last bits only: the
    recomputed backward sums in another order)."""
    from safetensors.torch import load_file

    recompute = ["--activation_checkpointing", "true"]
    outs = [tmp_path / name / "out" for name in ("plain", "recomputed", "again")]
    for out, extra in zip(outs, ([], recompute, recompute)):
        ended(start(zygote, async_argv(tiny_models, task, out, "--algo", "grpo", *extra), out), 0)
    plain, recomputed, again = (exact_rows(out) for out in outs)
    assert [r["train/version_lag_mean"] for r in again if "train/version_lag_mean" in r][2:] == [2.0] * 6  # async
    assert again == recomputed
    a, b = (load_file(out / "final_model" / "model.safetensors") for out in outs[1:])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    samples = [exact_rows(out, "samples.jsonl") for out in outs]
    assert len(samples[0]) == 8 * 8 and samples[0] == samples[1] == samples[2]


def test_resume_with_another_async_steps_is_refused_unless_accepted(tmp_path, capsys):
    """The rollouts a checkpoint saved in flight were generated for its pipeline depth: a resume with another
    async_steps is refused (exit-2 ConfigError naming both values and the flag that accepts it) unless
    --allow_resume_changes async_steps says so; then the saved rollouts within the new bound are used and the others
    regenerated (test_rollouts_in_flight_round_trip_through_a_checkpoint_and_stale_ones_are_regenerated)."""
    import json

    from open_instruct.config import RLVRConfig
    from open_instruct.errors import ConfigError

    def cfg(**kw):
        c = RLVRConfig(model_name_or_path=str(tmp_path / "m"), dataset_name_or_path="d", total_episodes=8, **kw)
        c.resolve_defaults()
        return c

    folder = tmp_path / "step_4"
    folder.mkdir()
    state = {"config": vars(cfg(async_steps=2)), "world_size": 1}
    (folder / checkpoint.STATE).write_text(json.dumps(state))
    with pytest.raises(ConfigError) as refused:
        checkpoint.check_resume_compatible(str(folder), cfg(async_steps=1), 1)
    assert "async_steps: checkpoint 2 (rollouts in flight, saved with the checkpoint), now 1" in str(refused.value)
    assert "--allow_resume_changes async_steps" in str(refused.value)
    checkpoint.check_resume_compatible(
        str(folder), cfg(async_steps=1, allow_resume_changes=["async_steps"], resume_from_checkpoint="auto"), 1
    )
    assert "accepting a change (allow_resume_changes): async_steps" in capsys.readouterr().out
    checkpoint.check_resume_compatible(str(folder), cfg(async_steps=2), 1)  # the same depth: nothing to accept


def test_async_hf_on_several_processes_is_refused_before_loading(monkeypatch):
    """Async hf generation copies the whole policy per version: on several processes (a sharded policy) it is
    refused before any model loads, naming the backend to use instead."""
    from open_instruct.config import RLVRConfig
    from open_instruct.errors import ConfigError
    from open_instruct.generation_backends import check_before_loading

    cfg = RLVRConfig(model_name_or_path="m", dataset_name_or_path="d", total_episodes=8, async_steps=2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="async_steps 2 with generation_backend hf runs in one process .* not 2"):
        check_before_loading(cfg, 64)
    monkeypatch.setenv("WORLD_SIZE", "1")
    check_before_loading(cfg, 64)
