"""The vLLM generation backend (optional extra) against the HF backend on a tiny local Llama.

Engine tests need vLLM (`make test-vllm` builds .venv-vllm with it); in the main venv they are skipped and only the
version check and the missing-extra error run. On CPU they check correctness, not speed.
"""

import os
import sys

import pytest
import torch
from training_helpers import chat_prompts, move_adapter, recipe_args, torchrun_two_processes

from open_instruct.generation import GenerationConfig, HFGenerator, finalize_response
from open_instruct.generation_backends import generator_for
from open_instruct.models import token_logprobs
from open_instruct.vllm_generator import (
    ANY_VERSION_ENV,
    SUPPORTED_VLLM,
    VLLMUnavailableError,
    VLLMVersionError,
    check_vllm_version,
    hf_weights,
)

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


# ------------------------------------------------------------------------------------- no vLLM needed
@pytest.mark.parametrize("version", ["0.32.0", "0.32.4", "0.32.0+cpu", "0.32.1rc1"])
def test_version_in_range_accepted(version, monkeypatch):
    monkeypatch.delenv(ANY_VERSION_ENV, raising=False)
    assert check_vllm_version(version) == version


@pytest.mark.parametrize("version", ["0.31.9", "0.33.0", "1.0.0", "0.10.2"])
def test_version_out_of_range_refused(version, monkeypatch):
    monkeypatch.delenv(ANY_VERSION_ENV, raising=False)
    lo, hi = SUPPORTED_VLLM
    with pytest.raises(VLLMVersionError) as err:
        check_vllm_version(version)
    msg = str(err.value)
    assert version in msg and f">={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}" in msg and "requirements-vllm.txt" in msg
    monkeypatch.setenv(ANY_VERSION_ENV, "1")  # the documented escape hatch
    assert check_vllm_version(version) == version


def test_unreadable_version_refused(monkeypatch):
    with pytest.raises(VLLMVersionError, match="cannot read"):
        check_vllm_version("dev")


def test_installed_version_is_checked(monkeypatch):
    """check_vllm_version() reads vllm.__version__: a fake module with an old version is refused."""
    import types

    monkeypatch.delenv(ANY_VERSION_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.20.1"))
    with pytest.raises(VLLMVersionError, match="0.20.1"):
        check_vllm_version()


def test_missing_extra_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError, as in the main venv
    with pytest.raises(VLLMUnavailableError, match="requirements-vllm.txt") as err:
        generator_for("vllm", torch.nn.Linear(2, 2), None)
    assert isinstance(err.value, ImportError) and isinstance(err.value, NotImplementedError)


@pytest.mark.parametrize(
    "extra, named",
    [
        ([], "use_lora is False, generation_backend hf"),
        (["--generation_backend", "vllm_server"], "use_lora is False, generation_backend vllm_server"),
        (["--use_lora", "true"], "use_lora is True, generation_backend hf"),
    ],
)
def test_adapter_sync_outside_a_lora_run_on_a_vllm_engine_is_refused(extra, named):
    """vllm_lora_sync adapter means something only for a LoRA policy on a vLLM engine (colocated or dedicated):
    elsewhere a ConfigError (exit 2) naming what is set, before anything loads."""
    from open_instruct.config import RLVRConfig, parse_config
    from open_instruct.errors import ConfigError

    argv = ["--model_name_or_path", "m", "--dataset_name_or_path", "d.jsonl", "--vllm_lora_sync", "adapter", *extra]
    with pytest.raises(ConfigError, match=f"vllm_lora_sync adapter needs use_lora true.*{named}"):
        parse_config(RLVRConfig, argv)


def test_rlvr_refuses_missing_vllm_before_loading(tiny_models, tmp_path, repo_root):
    """generation_backend vllm without the extra: exit 2 with the install hint, before any model or data loads."""
    import importlib.util
    import subprocess

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    from demo.synthetic import rl_rows, write_jsonl

    data = write_jsonl(str(tmp_path / "rl.jsonl"), rl_rows(8, 0))
    args = recipe_args(
        "rlvr_tiny.yaml", tiny_models["causal_lm"], data, data, tmp_path / "out", "--generation_backend", "vllm"
    )
    cmd = [sys.executable, os.path.join(repo_root, "open_instruct", "rlvr_ppo.py"), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": repo_root})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "generation_backend vllm" in proc.stderr and "requirements-vllm.txt" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_hf_weights_names_and_values():
    """The names streamed to vLLM are the HF checkpoint names, wrappers removed, tied weights once."""
    from transformers import LlamaForCausalLM

    from demo.tiny import tiny_llama_config

    model = LlamaForCausalLM(tiny_llama_config(40, 64, 1, tie_word_embeddings=True))
    wrapped = torch.nn.Module()
    wrapped.module = model  # what DDP / accelerate hand back
    got = dict(hf_weights(wrapped))
    want = dict(model.named_parameters())
    assert got.keys() == want.keys() and "lm_head.weight" not in got
    assert all(torch.equal(got[k], want[k]) for k in want)
    untied = dict(hf_weights(wrapped, untie=True))  # for an engine whose lm_head is its own tensor
    assert untied.keys() == want.keys() | {"lm_head.weight"}
    assert torch.equal(untied["lm_head.weight"], want["model.embed_tokens.weight"])
    assert (
        dict(hf_weights(LlamaForCausalLM(tiny_llama_config(40, 64, 1)), untie=True)).keys()
        == dict(LlamaForCausalLM(tiny_llama_config(40, 64, 1)).named_parameters()).keys()
    )  # untied model: nothing extra


# ------------------------------------------------------------------------------------- engine tests
def _tiny_cpu_llama(tokenizer, seed=0, **overrides):
    """The tiny test Llama with head_dim 32: vLLM's CPU attention has no kernel for the default tiny's 16."""
    from transformers import LlamaForCausalLM

    from demo.tiny import tiny_llama_config

    torch.manual_seed(seed)
    cfg = tiny_llama_config(
        len(tokenizer), 64, 2, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, **overrides
    )
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = cfg.eos_token_id
    return model


@pytest.fixture(scope="module")
def engine():
    pytest.importorskip("vllm")
    from demo.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    model = _tiny_cpu_llama(tokenizer)
    threads = torch.get_num_threads()
    torch.manual_seed(123)
    expected_draw = torch.rand(4)
    torch.manual_seed(123)
    gen = generator_for("vllm", model, tokenizer, max_model_len=256, seed=0, kv_cache_memory_bytes=256 << 20)
    side_effects = {
        "rng_kept": torch.equal(torch.rand(4), expected_draw),
        "threads_kept": torch.get_num_threads() == threads,
    }
    prompts = chat_prompts(tokenizer)
    yield gen, model, tokenizer, prompts, side_effects
    gen.close()


_KEPT_OPEN: list = []  # engines that must outlive their test (see keep_open)


def keep_open(gen):
    """Hold a second in-process engine until the process exits: vLLM's finalizer shuts an engine down when it is
    collected, and that destroys the model-parallel state every in-process engine shares."""
    _KEPT_OPEN.append(gen)
    return gen


def test_engine_leaves_trainer_state_alone(engine):
    gen, *_, side_effects = engine
    assert side_effects == {"rng_kept": True, "threads_kept": True}
    assert gen.engine_seconds > 0 and gen.last_sync_seconds > 0


def test_greedy_matches_hf(engine):
    gen, model, tokenizer, prompts, _ = engine
    assert len({len(p) for p in prompts}) > 1
    cfg = GenerationConfig(max_new_tokens=20, temperature=0)
    want = HFGenerator(model, tokenizer, batch_size=4).generate(prompts, cfg)
    got = gen.generate(prompts, cfg)
    assert got.response_ids == want.response_ids
    assert got.texts == want.texts and got.stopped == want.stopped
    assert got.prompt_ids == prompts and got.prompt_index == [0, 1, 2, 3]
    assert all(len(r) == 20 for r in got.response_ids) and not any(got.stopped)  # random model: no EOS


def test_sampler_log_probs_are_the_sampled_distributions(engine):
    """vLLM returns the log-prob of each sampled token after temperature and top-p (logprobs_mode processed), the
    quantity truncated importance sampling compares: at top_p 1 it equals the HF trainer's re-scored log-probs of
    the same tokens up to kernel noise; with top_p < 1 the renormalised nucleus makes it >= the full log-prob."""
    from open_instruct.data import collate_episodes
    from open_instruct.models import response_logits, token_logprobs

    gen, model, tokenizer, prompts, _ = engine
    for top_p in (1.0, 0.5):
        out = gen.generate(prompts, GenerationConfig(max_new_tokens=8, temperature=0.7, top_p=top_p, n=2, seed=3))
        assert [len(lp) for lp in out.logprobs] == [len(r) for r in out.response_ids]
        batch = collate_episodes([prompts[i] for i in out.prompt_index], out.response_ids, tokenizer.pad_token_id)
        with torch.no_grad():
            rescored = token_logprobs(response_logits(model, batch, 0.7), batch["responses"])
        gaps = [lp[t] - rescored[i, t].item() for i, lp in enumerate(out.logprobs) for t in range(len(lp))]
        if top_p == 1.0:
            assert max(abs(g) for g in gaps) < 2e-3, max(abs(g) for g in gaps)
        else:
            assert min(gaps) > -2e-3 and max(gaps) > 1e-3


def test_weight_sync_follows_the_policy(engine):
    """After the policy changes, the engine samples the old weights until sync_weights, then the new ones exactly."""
    gen, model, tokenizer, prompts, _ = engine
    cfg = GenerationConfig(max_new_tokens=16, temperature=0)
    hf = HFGenerator(model, tokenizer, batch_size=4)
    before = gen.generate(prompts, cfg).response_ids
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        with torch.no_grad():
            g = torch.Generator().manual_seed(1)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
        changed = hf.generate(prompts, cfg).response_ids
        assert changed != before  # the perturbation changes greedy outputs
        assert gen.generate(prompts, cfg).response_ids == before  # engine has its own copy: stale until synced
        gen.sync_weights(model)
        assert gen.last_sync_seconds > 0
        # Same prompts as before the sync: also proves no prefix-cache block from the old weights is reused.
        assert gen.generate(prompts, cfg).response_ids == changed
    finally:
        model.load_state_dict(saved)
        gen.sync_weights(model)
    assert gen.generate(prompts, cfg).response_ids == before


def test_eos_and_stop_strings_match_hf(engine):
    """EOS kept in the ids and dropped from the text; a stop string cuts right after the token completing it."""
    gen, model, tokenizer, prompts, _ = engine
    saved = model.lm_head.weight.detach().clone()
    hf = HFGenerator(model, tokenizer, batch_size=4)
    try:
        cfg = GenerationConfig(max_new_tokens=24, temperature=0)
        t = hf.generate(prompts[:1], cfg).response_ids[0][4]
        with torch.no_grad():  # EOS (id 1) gets 1.1x the logit of a token greedy picks: it now wins where t did
            model.lm_head.weight[1] = 1.1 * model.lm_head.weight[t]
        gen.sync_weights(model)
        want, got = hf.generate(prompts, cfg), gen.generate(prompts, cfg)
        assert got.response_ids == want.response_ids and got.texts == want.texts and got.stopped == want.stopped
        eos_rows = [i for i, r in enumerate(got.response_ids) if r and r[-1] == 1]
        assert eos_rows and all(got.stopped[i] and "<|end|>" not in got.texts[i] for i in eos_rows)

        free = [t for t, s in zip(got.texts, got.stopped) if not s] or got.texts
        stop = next(t[3:5] for t in free if len(t) >= 5)
        cfg = GenerationConfig(max_new_tokens=24, temperature=0, stop_strings=[stop])
        want, got = hf.generate(prompts, cfg), gen.generate(prompts, cfg)
        assert got.response_ids == want.response_ids and got.texts == want.texts and got.stopped == want.stopped
        assert any(t.endswith(stop) for t in got.texts)
    finally:
        with torch.no_grad():
            model.lm_head.weight.copy_(saved)
        gen.sync_weights(model)


def test_sampling_groups_and_seeds(engine):
    gen, model, tokenizer, prompts, _ = engine
    cfg = GenerationConfig(max_new_tokens=8, temperature=1.0, n=3, seed=7)
    torch.manual_seed(5)
    expected_draw = torch.rand(3)
    torch.manual_seed(5)
    a = gen.generate(prompts, cfg)
    assert torch.equal(torch.rand(3), expected_draw)  # seeded: the global RNG is untouched
    assert a.prompt_index == [i for i in range(len(prompts)) for _ in range(3)] and len(a) == 12
    assert a.response_ids == gen.generate(prompts, cfg).response_ids  # same seed, same samples
    assert (
        a.response_ids
        != gen.generate(prompts, GenerationConfig(max_new_tokens=8, temperature=1.0, n=3, seed=8)).response_ids
    )
    assert len({tuple(r) for r in a.response_ids[:3]}) > 1  # the n samples of a prompt differ
    for ids, text, stopped in zip(a.response_ids, a.texts, a.stopped):  # already cut: cutting again changes nothing
        assert (ids, text, stopped) == finalize_response(ids, gen.eos_ids, tokenizer, None)
        assert stopped == (ids[-1] == 1) and (stopped or len(ids) == 8)
    # seed=None draws from the global RNG: reseeding it repeats the rollout
    free = GenerationConfig(max_new_tokens=8, temperature=1.0, n=2)
    torch.manual_seed(9)
    x = gen.generate(prompts, free).response_ids
    torch.manual_seed(9)
    assert gen.generate(prompts, free).response_ids == x


def test_samples_follow_the_policy_distribution(engine):
    """First-token frequencies of vLLM samples match p = softmax(logits / T) as the trainer scores it
    (models.token_logprobs), and top_p keeps only the nucleus: the trainer's log-probs describe what vLLM sampled."""
    gen, model, tokenizer, prompts, _ = engine
    prompt, temperature, n = prompts[0], 0.7, 3000
    saved = model.lm_head.weight.detach().clone()
    try:
        with torch.no_grad():  # a random tiny model is nearly uniform: sharpen it so temperature matters
            model.lm_head.weight.mul_(12.0)
            logits = model(torch.tensor([prompt])).logits[0, -1]
        gen.sync_weights(model)
        vocab = len(logits)
        # p(v) for every token v from the trainer's scorer: the same logits at V positions, label v at position v
        probs = token_logprobs(logits.expand(1, vocab, vocab), torch.arange(vocab)[None], temperature)[0].exp().double()
        out = gen.generate([prompt], GenerationConfig(max_new_tokens=1, temperature=temperature, n=n, seed=3))
        freq = torch.bincount(torch.tensor([r[0] for r in out.response_ids]), minlength=vocab).double() / n
        g = torch.Generator().manual_seed(0)  # the TV distance pure sampling noise gives at this n
        noise = (
            sum(
                0.5
                * (torch.bincount(torch.multinomial(probs, n, True, generator=g), minlength=vocab) / n - probs)
                .abs()
                .sum()
                for _ in range(20)
            ).item()
            / 20
        )
        tv = 0.5 * (freq - probs).abs().sum().item()
        tv_t1 = 0.5 * (freq - torch.softmax(logits.double(), -1)).abs().sum().item()  # the sampler without temperature
        print(f"first-token TV vs policy {tv:.4f}, vs T=1 {tv_t1:.4f}, sampling noise {noise:.4f}")
        assert tv < 2 * noise, (tv, noise)
        assert tv_t1 > 4 * noise, (tv_t1, noise)  # the check would catch a sampler ignoring temperature

        top_p = 0.6  # nucleus: the fewest most likely tokens whose mass reaches top_p
        order = torch.argsort(probs, descending=True)
        keep = int((torch.cumsum(probs[order], 0) < top_p).sum().item()) + 1
        out = gen.generate(
            [prompt], GenerationConfig(max_new_tokens=1, temperature=temperature, top_p=top_p, n=500, seed=4)
        )
        seen = {r[0] for r in out.response_ids}
        print(f"top_p {top_p}: nucleus of {keep} tokens, {len(seen)} seen")
        assert seen <= set(order[:keep].tolist()) and len(seen) > 1, (seen, order[: keep + 2].tolist())
    finally:
        with torch.no_grad():
            model.lm_head.weight.copy_(saved)
        gen.sync_weights(model)


def test_tied_embeddings_follow_the_policy(engine):
    """A model with tied input/output embeddings (SmolLM2, small Qwen/Llama 3.2): the engine's lm_head must follow
    the embedding on every sync (vLLM 0.32's reload alone keeps the old lm_head: this failed before untying)."""
    _, _, tokenizer, prompts, _ = engine
    model = _tiny_cpu_llama(tokenizer, seed=1, tie_word_embeddings=True)
    # A second engine in this process, kept open to the end of the module: closing one (which collecting it does,
    # through vLLM's finalizer) tears down the parallel state both share, and the module engine's next forward fails.
    gen = keep_open(generator_for("vllm", model, tokenizer, max_model_len=256, kv_cache_memory_bytes=128 << 20))
    assert gen.untied_lm_head
    cfg = GenerationConfig(max_new_tokens=16, temperature=0)
    hf = HFGenerator(model, tokenizer, batch_size=4)
    before = gen.generate(prompts, cfg).response_ids
    assert before == hf.generate(prompts, cfg).response_ids
    with torch.no_grad():  # the shared embedding / output matrix changes with the rest
        g = torch.Generator().manual_seed(2)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    want = hf.generate(prompts, cfg).response_ids
    assert want != before
    gen.sync_weights(model)
    assert gen.generate(prompts, cfg).response_ids == want


def test_generation_checks_on_the_colocated_engine(engine, monkeypatch):
    """generation_check.py on the real engine: the launch check passes with margin; after the policy moves, a sync
    that skips a tensor, corrupts one, or sends nothing is caught at the check that follows it (the retry breaks the
    same way), the last one named as the previous version still served; a sync that never returns times out naming
    the engine; an honest sync passes again."""
    import threading

    from open_instruct import vllm_generator
    from open_instruct.generation_check import GenerationChecker, GenerationCheckError, make_probe

    gen, model, tokenizer, prompts, _ = engine
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    checker = GenerationChecker(gen, model, make_probe(tokenizer, 256), torch.float32)
    honest = vllm_generator.hf_weights
    try:
        checker.sync(model, 10)  # the launch check, with the top-k KL
        print("colocated vLLM fp32, launch check:", checker.at_launch)
        assert checker.at_launch["margin"] > 1 and "kl" in checker.at_launch and checker.last["check/margin"] > 1
        breaks = {
            "skipped": lambda m, **kw: (
                (n, t) for n, t in honest(m, **kw) if n != "model.layers.1.mlp.down_proj.weight"
            ),
            "corrupted": lambda m, **kw: ((n, t * 0 if "0.self_attn.o_proj" in n else t) for n, t in honest(m, **kw)),
            "nothing sent": lambda m, **kw: iter(()),
        }
        for i, (what, broken) in enumerate(breaks.items()):
            with torch.no_grad():
                g = torch.Generator().manual_seed(i)
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.05)
            monkeypatch.setattr(vllm_generator, "hf_weights", broken)
            expected = "matches the previous version" if what == "nothing sent" else r"version 1\d: \|dlogp\|"
            with (
                pytest.warns(UserWarning, match="re-sending once"),
                pytest.raises(GenerationCheckError, match=expected),
            ):
                checker.sync(model, 11 + i)
            monkeypatch.setattr(vllm_generator, "hf_weights", honest)
            checker.sync(model, 11 + i)
            assert checker.last["check/margin"] > 1, what

        release = threading.Event()
        monkeypatch.setattr(gen.llm, "collective_rpc", lambda *a, **kw: release.wait())
        checker.sync_timeout = 1.0
        try:
            with pytest.raises(GenerationCheckError, match="weight sync to the VLLMGenerator did not finish within"):
                checker.sync(model, 20)
        finally:
            release.set()
        monkeypatch.undo()
    finally:
        model.load_state_dict(saved)
        gen.sync_weights(model)


def test_an_engine_in_another_dtype_is_refused_at_launch(engine):
    """A bf16 engine where the run computes in fp32: beyond the fp32 limits, refused; within the bf16 limits."""
    from open_instruct.generation_check import GenerationChecker, GenerationCheckError, make_probe

    _, model, tokenizer, _, _ = engine
    # A second engine in this process, kept open (see test_tied_embeddings_follow_the_policy).
    gen = keep_open(
        generator_for("vllm", model, tokenizer, max_model_len=256, kv_cache_memory_bytes=128 << 20, dtype="bfloat16")
    )
    with pytest.raises(GenerationCheckError, match="launch check(.|\n)*another dtype") as refused:
        GenerationChecker(gen, model, make_probe(tokenizer, 256), torch.float32).sync(model, 0)
    print("bf16 engine under fp32 limits:", str(refused.value).splitlines()[1])
    checker = GenerationChecker(gen, model, make_probe(tokenizer, 256), torch.bfloat16)
    checker.sync(model, 0)
    print("bf16 engine under bf16 limits:", checker.at_launch)
    assert checker.at_launch["margin"] > 1


def test_lora_adapter_only_sync_serves_the_adapted_policy():
    """lora_sync "adapter": the engine holds the base weights and loads the adapter (vLLM's LoRA, a new id per sync);
    only the adapter's bytes move per sync (by hand: rank 8, 2 layers of q 64->64, k 64->32, v 64->32, o 64->64,
    gate/up 64->128, down 128->64: 8 x (128 + 96 + 96 + 128 + 192 x 3) = 8192 factor entries per layer, 16384 x 4 B
    = 65536 B, against the merged weights' 2 x 64V embedding and head + 2 x (36864 + 128 norms) + 64). Greedy output
    is the adapted policy's (not the base's), the generation check passes against the adapted trainer while the base
    model's log-probs are beyond its limits, and a changed adapter is followed after its sync with the base weights
    left alone. On main the engine could only take merged weights (no lora_sync)."""
    pytest.importorskip("vllm")
    from peft import LoraConfig, get_peft_model

    from demo.tiny import build_tokenizer
    from open_instruct.generation_check import (
        GenerationChecker,
        Limits,
        compare,
        forward_scores,
        logit_scale,
        make_probe,
    )
    from open_instruct.vllm_generator import VLLMGenerator

    tokenizer = build_tokenizer()
    policy = get_peft_model(
        _tiny_cpu_llama(tokenizer, seed=4), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    ).eval()
    move_adapter(policy, 0)
    prompts = chat_prompts(tokenizer)
    gen = keep_open(VLLMGenerator(policy, tokenizer, max_model_len=256, kv_cache_memory_bytes=128 << 20,
                                  lora_sync="adapter"))  # fmt: skip
    vocab = len(tokenizer)
    assert gen.last_sync_bytes == 65536
    assert gen.full_sync_bytes == 2 * 64 * vocab * 4 + (2 * (36864 + 128) + 64) * 4
    assert gen.lora_request.lora_int_id == 1 and os.path.isfile(
        os.path.join(gen.lora_request.lora_path, "adapter_model.safetensors")
    )

    cfg = GenerationConfig(max_new_tokens=16, temperature=0)
    hf = HFGenerator(policy, tokenizer, batch_size=4)
    adapted = hf.generate(prompts, cfg).response_ids
    with policy.disable_adapter():
        base = hf.generate(prompts, cfg).response_ids
    assert adapted != base
    assert gen.generate(prompts, cfg).response_ids == adapted

    # The generation check: the engine's fingerprint is the adapted policy's, and the base's is beyond the limits.
    probe = make_probe(tokenizer, 256)
    checker = GenerationChecker(gen, policy, probe, torch.float32)
    checker.sync(policy, 1)
    assert checker.at_launch["margin"] > 1 and gen.lora_request.lora_int_id == 2
    (engine_scores,) = gen.score_tokens(probe.prompts, probe.continuations).values()
    with policy.disable_adapter():
        base_scores = forward_scores(policy, probe.prompts, probe.continuations)
    assert Limits.for_dtype(torch.float32, logit_scale(base_scores)).exceeded(compare(engine_scores, base_scores))

    # A new adapter: followed after its sync, the old one dropped, the base weights not sent again.
    reloads = []
    real_rpc = gen.llm.collective_rpc
    gen.llm.collective_rpc = lambda *a, **kw: reloads.append(a) or real_rpc(*a, **kw)
    try:
        move_adapter(policy, 1)
        moved = hf.generate(prompts, cfg).response_ids
        assert moved != adapted
        assert gen.generate(prompts, cfg).response_ids == adapted  # stale until synced
        checker.sync(policy, 2)
    finally:
        gen.llm.collective_rpc = real_rpc
    assert reloads == [] and checker.last["check/margin"] > 1
    assert gen.llm.llm_engine.list_loras() == {3} and gen.last_sync_bytes == 65536
    assert gen.generate(prompts, cfg).response_ids == moved


def test_bad_requests_fail_clearly(engine):
    gen, _, tokenizer, prompts, _ = engine
    with pytest.raises(ValueError, match="max_model_len 256"):
        gen.generate([prompts[0]], GenerationConfig(max_new_tokens=256))
    with pytest.raises(ValueError, match="at least one token"):
        gen.generate([[]], GenerationConfig())
    from demo.tiny import tiny_llama_config
    from open_instruct.vllm_generator import VLLMGenerator

    with pytest.raises(ValueError, match="head_dim is 16"):  # the default tiny model: caught before any engine starts
        VLLMGenerator._check_cpu_head_dim(tiny_llama_config(len(tokenizer)))


# ------------------------------------------------------------------------------------- sleep mode (GPU only)
class _FakeLLM:
    """Records the engine calls the generator makes; generates one EOS per prompt."""

    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(f"sleep{level}")

    def wake_up(self, tags=None):
        self.calls.append("wake:" + ",".join(tags))

    def collective_rpc(self, method, kwargs):
        self.calls.append(method)
        list(kwargs["weights_iterator"])

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def generate(self, prompts, params, use_tqdm, lora_request=None):
        from types import SimpleNamespace

        self.calls.append("generate")
        return [
            SimpleNamespace(
                outputs=[
                    SimpleNamespace(
                        index=0, token_ids=[1], finish_reason="stop", logprobs=[{1: SimpleNamespace(logprob=-0.5)}]
                    )
                ]
            )
            for _ in prompts
        ]


def test_sleep_wake_order():
    """Sleep mode cannot run on CPU, so its bookkeeping is checked on a fake engine: weights are woken and
    reloaded before generating, the KV cache only for generating, and a generate after a sleep without a sync
    reloads the live policy first."""
    pytest.importorskip("vllm")
    from demo.tiny import build_tokenizer
    from open_instruct.vllm_generator import VLLMGenerator

    gen = object.__new__(VLLMGenerator)
    gen.llm, gen.tokenizer, gen.eos_ids, gen.max_model_len = _FakeLLM(), build_tokenizer(), [1], 64
    gen.sleep_enabled, gen._weights_released, gen._kv_released, gen.untied_lm_head = True, False, False, False
    gen.weight_dtype = None  # the policy's own dtype: no cast before the gather
    gen.adapter_sync, gen.lora_request = False, None  # merged-weight syncs (vllm_lora_sync merged)
    policy = torch.nn.Linear(2, 2)
    gen.sync_weights(policy)
    gen.generate([[5, 6]], GenerationConfig(max_new_tokens=4, temperature=0))
    assert gen.llm.calls == ["reload_weights", "reset_prefix_cache", "generate", "sleep2"]
    gen.llm.calls.clear()
    # what a generate after sleeping does: wake the weights, reload the live policy, wake the KV cache, sleep again
    woken_generate = ["wake:weights", "reload_weights", "reset_prefix_cache", "wake:kv_cache", "generate", "sleep2"]
    gen.sync_weights(policy)  # after the optimizer steps
    out = gen.generate([[5, 6]], GenerationConfig(max_new_tokens=4, temperature=0))
    assert gen.llm.calls == woken_generate
    assert out.response_ids == [[1]] and out.stopped == [True]
    gen.llm.calls.clear()
    gen.generate([[5, 6]], GenerationConfig(max_new_tokens=4, temperature=0))  # no sync since the last sleep
    assert gen.llm.calls == woken_generate
    gen.llm.calls.clear()
    gen.sync_weights(policy)  # a rank with no eval prompts syncs twice without generating: weights woken once
    gen.sync_weights(policy)
    gen.generate([[5, 6]], GenerationConfig(max_new_tokens=4, temperature=0))
    assert gen.llm.calls == ["wake:weights"] + ["reload_weights", "reset_prefix_cache"] * 2 + [
        "wake:kv_cache",
        "generate",
        "sleep2",
    ]


# ------------------------------------------------------------------------------------- the RLVR script on vLLM
@pytest.mark.slow
def _tiny_rl_start(tmp_path) -> tuple[str, str]:
    """(a random tiny Llama saved with its tokenizer, 32 arithmetic RL prompts) for a short rlvr_ppo.py run."""
    from demo.synthetic import rl_rows, write_jsonl
    from demo.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    init = str(tmp_path / "init")
    _tiny_cpu_llama(tokenizer).save_pretrained(init)
    tokenizer.save_pretrained(init)
    return init, write_jsonl(str(tmp_path / "train.jsonl"), rl_rows(32, 0))


def test_rlvr_on_vllm_evaluates_the_current_policy(tmp_path):
    """rlvr_ppo.py with generation_backend vllm: rollouts, training and evals run, time/weight_sync is logged, and
    each held-out eval (greedy, on the engine) equals an HF greedy eval of the policy at that point: at rollout 0
    the initial model, at the last rollout the saved final model. A stale engine (a missing sync) fails this."""
    pytest.importorskip("vllm")
    import json
    import subprocess

    from demo.synthetic import rl_rows, write_jsonl
    from eval.verifiable import load_prompts
    from open_instruct.models import load_causal_lm, load_tokenizer
    from open_instruct.rewards import score_batch

    init, train = _tiny_rl_start(tmp_path)
    evals = write_jsonl(str(tmp_path / "eval.jsonl"), rl_rows(12, 1))
    out_dir = tmp_path / "run"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [
        sys.executable,
        os.path.join(repo, "open_instruct", "rlvr_ppo.py"),
        os.path.join(repo, "configs", "rlvr_tiny.yaml"),
        "--model_name_or_path",
        init,
        "--dataset_name_or_path",
        train,
        "--eval_dataset_name_or_path",
        evals,
        "--output_dir",
        str(out_dir),
        "--generation_backend",
        "vllm",
        "--total_episodes",
        "64",
        "--local_rollout_batch_size",
        "16",
        "--num_samples_per_prompt",
        "2",
        "--per_device_train_batch_size",
        "16",
        "--learning_rate",
        "3e-3",
        "--eval_steps",
        "2",
        "--checkpointing_steps",
        "100",
        "--save_final_model",
        "true",
    ]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "PYTHONPATH": repo}
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = [json.loads(line) for line in open(out_dir / "metrics.jsonl")]
    train_rows = [r for r in rows if "time/weight_sync" in r]
    eval_rows = [r for r in rows if "eval/response_length" in r]
    assert [r["rollout_step"] for r in train_rows] == [1, 2]
    # rollout 0 samples with the weights the baseline eval had just synced (no second sync); rollout 1 syncs
    assert train_rows[0]["time/weight_sync"] == 0 and train_rows[1]["time/weight_sync"] > 0
    assert [r["rollout_step"] for r in eval_rows] == [0, 2]

    def hf_eval(path):
        tok = load_tokenizer(path)
        examples = load_prompts(evals, tok, max_prompt_length=96)
        out = HFGenerator(load_causal_lm(path), tok, batch_size=16).generate(
            [e["prompt_ids"] for e in examples], GenerationConfig(max_new_tokens=12, temperature=0)
        )
        correct = score_batch(
            out.texts, [e["ground_truth"] for e in examples], [e["verifier"] for e in examples]
        ).correct
        return sum(map(len, out.response_ids)) / len(examples), sum(correct) / len(examples)

    final = str(out_dir / "final_model")
    for row, path in ((eval_rows[0], init), (eval_rows[1], final)):
        length, correct = hf_eval(path)
        assert row["eval/response_length"] == pytest.approx(length) and row["eval/correct_rate"] == pytest.approx(
            correct
        )
    assert hf_eval(init) != hf_eval(final)  # training changed the policy, so the last comparison has teeth


_DIST_WORKER = """
import os, sys, json
sys.path.insert(0, os.environ["REPO"])
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import LlamaForCausalLM
from open_instruct.generation import GenerationConfig, HFGenerator
from demo.tiny import build_tokenizer, tiny_llama_config
from open_instruct.vllm_generator import VLLMGenerator

def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tok = build_tokenizer()
    cfg = tiny_llama_config(len(tok), 64, 2, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    torch.manual_seed(0)
    full = LlamaForCausalLM(cfg).eval()  # unsharded reference
    torch.manual_seed(0)
    policy = LlamaForCausalLM(cfg)
    mesh = init_device_mesh("cpu", (world,))
    for layer in policy.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(policy, mesh=mesh)
    gen = VLLMGenerator(policy, tok, max_model_len=256, kv_cache_memory_bytes=128 << 20)
    prompts = [[5 + rank, 40, 50, 60, 4], [7, 8, 9 + rank]]  # each rank generates for its own prompts
    g = GenerationConfig(max_new_tokens=12, temperature=0)
    first = gen.generate(prompts, g).response_ids == HFGenerator(full, tok).generate(prompts, g).response_ids
    noise = torch.Generator().manual_seed(5)  # the same update on every rank: on the shards and on the reference
    with torch.no_grad():
        for p, q in zip(policy.parameters(), full.parameters()):
            delta = torch.randn(q.shape, generator=noise) * 0.3
            q.add_(delta)
            p.add_(distribute_tensor(delta, p.device_mesh, p.placements) if isinstance(p, DTensor) else delta)
    stale = gen.generate(prompts, g).response_ids
    gen.sync_weights(policy)
    want = HFGenerator(full, tok).generate(prompts, g).response_ids
    result = dict(
        backend=gen.llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend,
        sharded=sum(isinstance(p, DTensor) for p in policy.parameters()), first=first,
        stale_differs=stale != want, synced=gen.generate(prompts, g).response_ids == want,
    )
    with open(os.path.join(os.environ["OUT"], f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()

if __name__ == "__main__":
    main()
"""


@pytest.mark.slow
def test_fsdp2_ranks_each_sync_their_engine(tmp_path):
    """Two training processes (torchrun, gloo) with an FSDP2-sharded policy: each rank gets its own engine through
    vLLM's external_launcher, sync_weights gathers the shards (DTensor.full_tensor) and every rank's engine then
    generates exactly what the unsharded updated model generates."""
    pytest.importorskip("vllm")
    import json

    worker = tmp_path / "worker.py"
    worker.write_text(_DIST_WORKER)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "REPO": repo, "OUT": str(tmp_path), "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"}
    torchrun_two_processes(worker, env)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result == {
            "backend": "external_launcher",
            "sharded": 21,
            "first": True,
            "stale_differs": True,
            "synced": True,
        }


def test_multi_turn_episodes_on_the_colocated_engine(tmp_path):
    """Multi-turn RLVR on the colocated vLLM engine: each round of turns is one generate call with per-request
    token budgets; every episode plays its two turns (the environment from a user file) and the run trains."""
    pytest.importorskip("vllm")
    import json
    import subprocess

    from training_helpers import TWO_TURNS_ENV

    init, train = _tiny_rl_start(tmp_path)
    env_file = tmp_path / "two_turns.py"
    env_file.write_text(TWO_TURNS_ENV)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out_dir = tmp_path / "run"
    cmd = [sys.executable, os.path.join(repo, "open_instruct", "rlvr_ppo.py"),
           os.path.join(repo, "configs", "rlvr_tiny.yaml"), "--model_name_or_path", init,
           "--dataset_name_or_path", train, "--eval_dataset_name_or_path", train, "--max_eval_samples", "4",
           "--output_dir", str(out_dir), "--generation_backend", "vllm",
           "--environment", f"{env_file}:TwoTurns", "--total_episodes", "32", "--local_rollout_batch_size", "8",
           "--num_samples_per_prompt", "2", "--per_device_train_batch_size", "16", "--response_length", "96",
           "--max_turn_tokens", "12", "--eval_steps", "100", "--checkpointing_steps", "100"]  # fmt: skip
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "PYTHONPATH": repo}
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    train_rows = [json.loads(line) for line in open(out_dir / "metrics.jsonl") if "train/turns_per_episode" in line]
    assert [r["rollout_step"] for r in train_rows] == [1, 2]
    assert all(r["train/turns_per_episode"] == 2.0 and r["train/observation_token_share"] > 0 for r in train_rows)
