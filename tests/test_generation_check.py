"""The generation checks (open_instruct/generation_check.py) on CPU, main venv: the launch check, the post-sync
fingerprint against deliberately broken syncs, the sync deadline, and the mismatch/ sums against hand-worked values.

`EngineDouble` stands in for an engine: it holds its own copy of the model and receives the policy's weights as
(HF name, tensor) pairs through `vllm_generator.hf_weights` (LoRA merged), as the vLLM backends do; a test breaks the
transfer on purpose. The real engines are checked in tests/test_vllm_generator.py and tests/test_engine_client.py.
"""

import copy
import math
import threading

import pytest
import torch
from tolerances import unit_roundoff

from open_instruct.generation import GenerationConfig, HFGenerator
from open_instruct.generation_check import (
    GenerationChecker,
    GenerationCheckError,
    Limits,
    TokenScores,
    coarse_kl,
    compare,
    forward_scores,
    logit_scale,
    make_probe,
    matmul_eps,
)
from open_instruct.rl_algorithms import mismatch_metrics, mismatch_token_sums, mismatch_warnings
from open_instruct.vllm_generator import hf_weights


def tiny_model(seed: int = 0):
    from transformers import LlamaForCausalLM

    from demo.tiny import build_tokenizer, tiny_llama_config

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(len(tokenizer), 64, 2)).eval(), tokenizer


class EngineDouble:
    """An engine with its own weights, loaded from what `sync_weights` sends; `transport` may break the pairs."""

    last_sync_bytes, last_sync_seconds, in_flight_weight_updates = 0, 0.0, False

    def __init__(self, model, dtype=torch.float32):
        self.model = copy.deepcopy(model).to(dtype).eval()
        self.transport = lambda pairs: pairs
        self.version = -1

    def sync_weights(self, model, version=None):
        own = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in self.transport(hf_weights(model)):
                own[name].copy_(tensor)
        self.version = version

    def generation_context(self, model):
        import contextlib

        return contextlib.nullcontext()

    def score_tokens(self, prompt_ids, continuation_ids, top_k=0):
        scores = forward_scores(self.model, prompt_ids, continuation_ids, top_k)
        scores.full = None
        return {f"engine double (version {self.version})": scores}


def checker_for(gen, policy, tokenizer, **kw):
    return GenerationChecker(gen, policy, make_probe(tokenizer, 256), torch.float32, **kw)


def engine_checked_at_version_0():
    """(policy, engine, checker) after a first sync that passed: the start of every broken-sync story below."""
    policy, tokenizer = tiny_model()
    gen = EngineDouble(policy)
    checker = checker_for(gen, policy, tokenizer)
    checker.sync(policy, 0)
    return policy, gen, checker


def train_step(policy, seed: int, size: float = 0.05) -> None:
    """A stand-in for an optimizer step: every parameter moves."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * size)


# ------------------------------------------------------------------------------------------ numbers by hand
def test_limits_follow_the_dtype_and_the_logit_scale():
    assert matmul_eps(torch.bfloat16) == 2**-7 and matmul_eps(torch.float32) == 2**-10
    bf16, fp32 = Limits.for_dtype(torch.bfloat16, 2.0), Limits.for_dtype(torch.float32, 2.0)
    assert (bf16.abs_mean, bf16.abs_max, bf16.kl) == (4 * 2**-7, 32 * 2**-7, 8 * 2**-14)
    assert (fp32.abs_mean, fp32.abs_max, fp32.kl) == (4 * 2**-10, 32 * 2**-10, 8 * 2**-20)
    assert Limits.for_dtype(torch.float32, 2.0, scale=3.0).abs_max == 3 * fp32.abs_max
    assert logit_scale(TokenScores([], full=[torch.tensor([[0.0, 2.0], [1.0, 1.0]])])) == pytest.approx(2**0.5 / 2)


def test_coarse_kl_by_hand():
    """p = generator top-2 {0: .5, 1: .3} + rest .2; q = trainer (.25, .25, .5): KL = .5 ln 2 + .3 ln 1.2 + .2 ln .4."""
    q = torch.log(torch.tensor([0.25, 0.25, 0.25, 0.25]))
    top = {0: math.log(0.5), 1: math.log(0.3)}
    want = 0.5 * math.log(2) + 0.3 * math.log(1.2) + 0.2 * math.log(0.2 / 0.5)
    # q is float32: each log q_i is off by <= u|log q_i|, moving each of the three terms by at most that much
    atol = 3 * unit_roundoff(torch.float32) * math.log(4) * 2
    assert coarse_kl(top, q) == pytest.approx(want, abs=atol)
    assert coarse_kl({0: math.log(0.25), 1: math.log(0.25)}, q) == pytest.approx(0.0, abs=1e-15)


def test_mismatch_sums_by_hand():
    """r = trainer - sampler = (0, ln 3, -ln 2) on the mask, a masked token ignored: k3 = e^r - 1 - r."""
    r = torch.tensor([[0.0, math.log(3.0), -math.log(2.0), 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    sums = {k: float(v) for k, v in mismatch_token_sums(r, mask, tis_cap=2.0).items()}  # 0-dim device tensors
    k3 = (3 - 1 - math.log(3)) + (0.5 - 1 + math.log(2))
    assert sums["mismatch_k3_sum"] == pytest.approx(k3, rel=1e-6)
    assert sums["mismatch_beyond_cap"] == 1.0  # exp(ln 3) = 3 > 2; the masked 5.0 does not count
    assert sums["mismatch_abs_max"] == pytest.approx(math.log(3.0), rel=1e-6)
    row = mismatch_metrics({"tokens": 3.0, "sampler_abs_diff": math.log(6.0), **sums}, sums["mismatch_abs_max"])
    assert row["mismatch/abs_mean"] == pytest.approx(math.log(6.0) / 3)
    assert row["mismatch/beyond_tis_cap"] == pytest.approx(1 / 3)
    lines = mismatch_warnings(row, warn_kl=1e-3, warn_beyond_cap=0.01)
    assert len(lines) == 2 and "mismatch/k3_kl" in lines[0] and "mismatch/beyond_tis_cap 0.333" in lines[1]
    assert mismatch_warnings(row, warn_kl=1.0, warn_beyond_cap=0.5) == []
    # async 1: the three policy tokens were sampled with lags (0, 1, 1); the masked one carries none
    lags = torch.tensor([[0, 1, 1, -1]])
    lagged = {k: float(v) for k, v in mismatch_token_sums(r, mask, 2.0, lags=lags, async_steps=1).items()}
    assert (lagged["mismatch_tokens_lag_0"], lagged["mismatch_tokens_lag_1"]) == (1.0, 2.0)
    assert lagged["mismatch_abs_lag_0"] == 0.0
    assert lagged["mismatch_abs_lag_1"] == pytest.approx(math.log(6.0), rel=1e-6)
    per_lag = mismatch_metrics({"tokens": 3.0, "sampler_abs_diff": math.log(6.0), **lagged}, 0.0, async_steps=1)
    assert per_lag["mismatch/abs_mean_lag_0"] == 0.0
    assert per_lag["mismatch/abs_mean_lag_1"] == pytest.approx(math.log(6.0) / 2, rel=1e-6)


# ------------------------------------------------------------------------------------------ launch check
def test_honest_generators_pass_the_launch_check_with_margin():
    """hf (the trainer's own module) and an engine loaded from the trainer's weights reproduce its log-probs; the
    margins (limit / measure) are printed."""
    policy, tokenizer = tiny_model()
    for gen in (HFGenerator(policy, tokenizer), EngineDouble(policy)):
        checker = checker_for(gen, policy, tokenizer)
        checker.sync(policy, 0)
        print(type(gen).__name__, checker.at_launch)
        assert checker.launched and checker.at_launch["margin"] > 1
        assert checker.at_launch["kl"] == 0.0  # the same float32 module, the same probe: the same numbers
        # rows: an engine's fingerprint; hf samples with the trainer's module, nothing to fingerprint
        assert ("check/margin" in checker.last) == isinstance(gen, EngineDouble)


def test_another_model_is_refused_at_launch():
    """An engine serving other weights (nothing sent: it keeps another model's), refused before any rollout."""
    policy, tokenizer = tiny_model(0)
    other, _ = tiny_model(1)
    gen = EngineDouble(other)
    gen.transport = lambda pairs: []
    with pytest.raises(
        GenerationCheckError, match=r"launch check.*\n.*engine double.*\|dlogp\| mean .*; beyond the limits mean "
    ):
        checker_for(gen, policy, tokenizer).sync(policy, 0)
    # the override: warn and go on
    with pytest.warns(UserWarning, match="launch check"):
        checker_for(gen, policy, tokenizer, mode="warn").sync(policy, 0)


def test_another_dtype_is_refused_at_launch():
    """An engine computing in bf16 where the run is fp32 is off by bf16 rounding, beyond the fp32 limits; within the
    bf16 limits it passes (a run whose mixed_precision is bf16)."""
    policy, tokenizer = tiny_model()
    gen = EngineDouble(policy, dtype=torch.bfloat16)
    with pytest.raises(GenerationCheckError, match="another dtype"):
        checker_for(gen, policy, tokenizer).sync(policy, 0)
    checker = GenerationChecker(gen, policy, make_probe(tokenizer, 256), torch.bfloat16)
    checker.sync(policy, 0)
    print("bf16 engine vs fp32 trainer under bf16 limits:", checker.at_launch)
    assert checker.at_launch["margin"] > 1


# ------------------------------------------------------------------------------------------ post-sync fingerprint
def skip_one(pairs):
    return ((n, t) for n, t in pairs if n != "model.layers.1.mlp.down_proj.weight")


def corrupt_one(pairs):
    return ((n, t * 0 if n == "model.layers.0.self_attn.v_proj.weight" else t) for n, t in pairs)


def send_nothing(pairs):
    return iter(())


@pytest.mark.parametrize("transport", [skip_one, corrupt_one, send_nothing], ids=["skipped", "corrupted", "nothing"])
def test_a_broken_sync_is_caught_at_the_next_check(transport):
    policy, gen, checker = engine_checked_at_version_0()
    train_step(policy, seed=1)
    gen.transport = transport
    with pytest.warns(UserWarning, match="re-sending once"):  # the retry breaks the same way
        with pytest.raises(
            GenerationCheckError, match=r"post-sync check.*\n.*version 1: \|dlogp\| mean .* beyond the limits"
        ):
            checker.sync(policy, 1)


def test_the_previous_version_re_sent_is_named():
    policy, gen, checker = engine_checked_at_version_0()
    old = copy.deepcopy(policy)
    train_step(policy, seed=2)
    gen.transport = lambda pairs: hf_weights(old)  # the old version's weights re-sent
    with pytest.warns(UserWarning), pytest.raises(GenerationCheckError, match="matches the previous version"):
        checker.sync(policy, 1)


def test_a_sync_that_fails_once_is_retried_and_passes():
    policy, gen, checker = engine_checked_at_version_0()
    train_step(policy, seed=3)
    sends = []

    def first_send_lost(pairs):
        sends.append(1)
        return iter(()) if len(sends) == 1 else pairs

    gen.transport = first_send_lost
    with pytest.warns(UserWarning, match="re-sending once"):
        checker.sync(policy, 1)
    assert len(sends) == 2 and checker.last["check/margin"] > 1


def test_a_lora_adapter_not_merged_is_caught():
    """The policy is a PEFT LoRA model whose adapter has trained: sending the base weights without W + BA * s (the
    adapter left unmerged) serves the base model."""
    from peft import LoraConfig, get_peft_model

    from open_instruct import lora

    base, tokenizer = tiny_model()
    engine = EngineDouble(base)
    policy = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    checker = checker_for(engine, policy, tokenizer)
    checker.sync(policy, 0)  # B = 0 at init: merged == base
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(4))
    checker.sync(policy, 1)  # merged: passes
    assert checker.last["check/margin"] > 1

    def unmerged(pairs):
        own = {lora.base_name(n): p.detach() for n, p in policy.named_parameters() if "lora_" not in n}
        return ((n.replace("base_model.model.", ""), t) for n, t in own.items())

    engine.transport = unmerged
    with pytest.warns(UserWarning), pytest.raises(GenerationCheckError, match="adapter not merged"):
        checker.sync(policy, 2)


# ------------------------------------------------------------------------------------------ deadline
def test_a_sync_that_never_completes_times_out_naming_the_engine():
    policy, tokenizer = tiny_model()
    gen = EngineDouble(policy)
    gen.urls = ["http://10.0.0.7:8000"]  # as a dedicated engine names itself
    release = threading.Event()
    gen.transport = lambda pairs: (release.wait(), pairs)[1]
    checker = checker_for(gen, policy, tokenizer, sync_timeout=0.5)
    try:
        with pytest.raises(GenerationCheckError, match=r"vLLM engine 0 \(http://10.0.0.7:8000\).*within .* 0.5s"):
            checker.sync(policy, 0)
    finally:
        release.set()  # the abandoned sync thread finishes


def test_compare_flags_missing_scores():
    policy, tokenizer = tiny_model()
    probe = make_probe(tokenizer, 256)
    trainer = forward_scores(policy, probe.prompts, probe.continuations)
    short = copy.deepcopy(trainer)
    short.logprobs[0] = short.logprobs[0][:-1]
    assert compare(short, trainer).abs_max == math.inf
    assert compare(trainer, trainer).abs_max == 0.0


# ------------------------------------------------------------------------------------------ in a run
@pytest.mark.parametrize("async_steps", [0, 1])
def test_an_honest_rlvr_run_passes_every_check_and_logs_mismatch(tmp_path, tiny_models, async_steps):
    """Two PPO rollouts on hf (two epochs: the trainer's log-probs before the update are a separate forward, so the
    mismatch is the generator's sampling vs the trainer's scoring of the same weights): every sync checked with
    margin, the mismatch/ metrics in every row, and the sampler and trainer agreeing to float32 rounding. Async 1:
    the second rollout was sampled one version back, so its tokens all have lag 1 and differ by the update."""
    import json
    import os
    import subprocess
    import sys

    from demo import synthetic

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = synthetic.write_task_files(str(tmp_path / "data"), n_train=64, n_eval=8)
    out_dir = str(tmp_path / "run")
    args = [
        os.path.join(repo, "open_instruct", "rlvr_ppo.py"),
        os.path.join(repo, "configs", "rlvr_tiny.yaml"),
        *("--model_name_or_path", tiny_models["causal_lm"], "--dataset_name_or_path", files["rl_train"]),
        *("--eval_dataset_name_or_path", files["rl_eval"], "--output_dir", out_dir, "--total_episodes", "64"),
        *("--local_rollout_batch_size", "8", "--per_device_train_batch_size", "16", "--eval_steps", "100"),
        *("--checkpointing_steps", "100", "--async_steps", str(async_steps)),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": repo, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    done = subprocess.run([sys.executable, *args], cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "train/correct_rate" in r]
    assert len(rows) == 2
    # async: the launch check of the frozen copies (the same weights: all 0); synchronous hf samples with the trainer's
    # own module, nothing is copied and nothing checked (no generation check at all)
    launch = "generation check at launch: |dlogp| mean 0, max 0, KL 0 over 128 tokens"
    assert (launch in done.stdout) == bool(async_steps), done.stdout[-2000:]
    for row in rows:  # the warning line a user sees (default mismatch_warn_kl 1e-3), exactly when it is crossed
        line = f"warning: rollout {row['rollout_step']}: mismatch/k3_kl"
        assert (line in done.stdout) == (row["mismatch/k3_kl"] > 1e-3), done.stdout[-2000:]
    for row in rows:
        print({k: v for k, v in row.items() if k.startswith(("check/", "mismatch/", "time/generation_check"))})
        assert "check/margin" not in row  # hf: the trainer's module (or a copy of it), no fingerprint
        assert ("time/generation_check" in row) == bool(async_steps)
        if async_steps:
            assert row["train/version_lag_1"] in (0.0, 1.0)
            lagged = row["mismatch/abs_mean_lag_1"]
            if row["train/version_lag_1"] == 1.0:  # sampled before the update: off by the update, not by rounding
                assert lagged > Limits.for_dtype(torch.float32, 1.0).abs_max
                continue
            assert lagged == 0.0
        # the same fp32 module samples and scores: only the sampler's batched vs the trainer's padded forward differ
        assert 0 <= row["mismatch/abs_mean"] <= row["mismatch/abs_max"] < Limits.for_dtype(torch.float32, 1.0).abs_max
        # k3 = e^r - 1 - r <= r^2 for |r| < 1, plus float32 rounding of expm1(r) - r
        k3_bound = row["mismatch/abs_max"] ** 2 + unit_roundoff(torch.float32) * row["mismatch/abs_max"]
        assert row["mismatch/beyond_tis_cap"] == 0.0 and abs(row["mismatch/k3_kl"]) <= k3_bound


def test_a_run_whose_generator_fails_the_launch_check_stops_before_training(tmp_path, tiny_models, monkeypatch):
    """What a user sees: the run's generator serves another model (an engine double holding other weights, to which
    the sync delivers nothing). The run stops at the first sync, before any rollout, naming the numbers, the likely
    cause and the override; no rollout is logged."""
    import os

    from demo import synthetic
    from open_instruct import rlvr_ppo

    other, _ = tiny_model(seed=1)
    double = EngineDouble(other)
    double.transport = lambda pairs: iter(())
    monkeypatch.setattr(rlvr_ppo, "make_generator", lambda *a, **kw: double)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = synthetic.write_task_files(str(tmp_path / "data"), n_train=64, n_eval=8)
    out_dir = str(tmp_path / "run")
    args = [
        os.path.join(repo, "configs", "rlvr_tiny.yaml"),
        *("--model_name_or_path", tiny_models["causal_lm"], "--dataset_name_or_path", files["rl_train"]),
        *("--eval_dataset_name_or_path", files["rl_eval"], "--output_dir", out_dir, "--total_episodes", "64"),
        *("--local_rollout_batch_size", "8", "--per_device_train_batch_size", "16", "--eval_steps", "100"),
    ]
    with pytest.raises(GenerationCheckError) as stopped:
        rlvr_ppo.main(args)
    print(stopped.value)
    assert "launch check" in str(stopped.value) and "--generation_check warn" in str(stopped.value)
    metrics = os.path.join(out_dir, "metrics.jsonl")
    assert not os.path.exists(metrics) or "train/correct_rate" not in open(metrics).read()


# ------------------------------------------------------------------------------------------ the planner
def test_the_planner_counts_the_check(repo_root, capsys):
    """plan.py adds the probe check to every rollout: the trainer's probe forward (with its FSDP gather) and the
    engine's prefill; off, it is gone and the rollout is that much shorter."""
    import json
    import os

    from open_instruct import plan
    from open_instruct.generation_check import MAX_PROBE_TOKENS, POST_SYNC_SEQUENCES

    assert plan.PROBE_TOKENS == POST_SYNC_SEQUENCES * MAX_PROBE_TOKENS
    recipe = os.path.join(repo_root, "configs", "rlvr_8b.yaml")

    def planned(*flags):
        assert plan.main([recipe, "--num_processes", "7", "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)

    on, off = planned(), planned("--generation_check", "off")
    check = on["generation_check_seconds_per_rollout"]
    assert check > 0 and off["generation_check_seconds_per_rollout"] == 0
    assert on["rollout_seconds_sync"] - off["rollout_seconds_sync"] == pytest.approx(check, rel=1e-9)
    assert on["phase_hours"]["generation check"] == pytest.approx(check * on["num_training_steps"] / 3600, rel=1e-9)
    assert planned("--generation_backend", "hf")["generation_check_seconds_per_rollout"] == 0  # the trainer's module
    print(f"rlvr_8b on 7 GPUs: check {check:.3f} s per rollout of {on['rollout_seconds_sync']:.1f} s")


def test_a_bf16_generation_copy_passes_the_check_though_its_greedy_text_may_differ():
    """One process under bf16 generates from a bf16 copy of the fp32 weights (a bf16 residual stream), while the
    trainer computes under autocast over fp32 weights (an fp32 residual stream): the two round differently, so a
    greedy continuation can part from the trainer's at a near-tie (an audit on CPU saw 7 of 8 part). That is
    expected, not a broken sync: the launch check passes within the bf16 limits, and on the generator's own tokens
    the per-token |dlogp| (what mismatch/abs_mean averages) stays within the same bf16 limit."""
    policy, tokenizer = tiny_model()
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731 - the trainer's autocast
    gen = HFGenerator(policy, tokenizer, compute_dtype=torch.bfloat16)
    probe = make_probe(tokenizer, 256)
    checker = GenerationChecker(gen, policy, probe, torch.bfloat16, autocast=bf16)
    checker.launch_only()
    print("bf16 copy vs fp32 trainer under autocast:", checker.at_launch)
    assert checker.launched and checker.at_launch["margin"] > 1

    greedy = GenerationConfig(max_new_tokens=24, temperature=0)
    prompts = [list(p) for p in probe.prompts]
    with gen.generation_context(policy):
        copy_out = gen.generate(prompts, greedy)
    with bf16():
        trainer_out = HFGenerator(policy, tokenizer).generate(prompts, greedy)
    same = sum(a == b for a, b in zip(copy_out.response_ids, trainer_out.response_ids))
    print(f"greedy continuations identical in {same} of {len(prompts)}")
    with bf16():
        trainer = forward_scores(policy, prompts, copy_out.response_ids)
    diffs = torch.cat([torch.tensor(a) - torch.tensor(b) for a, b in zip(copy_out.logprobs, trainer.logprobs)]).abs()
    limits = Limits.for_dtype(torch.bfloat16, logit_scale(trainer))
    print(f"|dlogp| on its tokens: mean {diffs.mean():.3g} (limit {limits.abs_mean:.3g}), max {diffs.max():.3g}")
    assert diffs.mean() <= limits.abs_mean and diffs.max() <= limits.abs_max
