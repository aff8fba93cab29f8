"""The generator interface on the tiny local model: padding, stops, n samples, seeding, re-scoring."""

import importlib.util
import inspect
import math

import pytest
import torch

from open_instruct.generation import GenerationConfig, Generator, HFGenerator, finalize_response
from open_instruct.generation_backends import generator_for
from open_instruct.models import load_causal_lm, load_tokenizer, token_logprobs

QUESTIONS = ["Hi", "What is 2+2? Answer briefly.", "Name a color", "Write one long sentence about the sea and sky."]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A hidden-64 model gains nothing from a second thread, and on a busy CPU spinning threads cost 10x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def lm(tiny_models):
    tokenizer = load_tokenizer(tiny_models["causal_lm"])
    model = load_causal_lm(tiny_models["causal_lm"])
    return model, tokenizer


@pytest.fixture(scope="module")
def prompts(lm):
    _, tokenizer = lm
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        for q in QUESTIONS
    ]


def _ids(x):
    return list(x["input_ids"]) if not isinstance(x, list) else x


def test_protocol_and_backends(lm):
    model, tokenizer = lm
    gen = generator_for("hf", model, tokenizer, batch_size=2)
    assert isinstance(gen, Generator) and isinstance(gen, HFGenerator)
    assert gen.sync_weights(model) is None and gen.version == 0  # the first sync: version 0
    gen.sync_weights(model, 7)
    out = gen.generate([[1, 2, 3]], GenerationConfig(max_new_tokens=3, temperature=0))
    assert out.weight_versions == [[7] * len(out.response_ids[0])]  # the version of every sampled token
    assert (gen.last_sync_seconds, gen.last_sync_bytes) == (0.0, 0)
    if importlib.util.find_spec("vllm") is None:  # the optional backend names itself when it is missing
        with pytest.raises(NotImplementedError, match="vllm"):
            generator_for("vllm", model, tokenizer)
    with pytest.raises(ValueError, match="unknown generation backend"):
        generator_for("jax", model, tokenizer)
    with pytest.raises(ValueError, match="temperature"):
        GenerationConfig(temperature=-1)


def test_left_padding_matches_single_prompt_greedy(lm, prompts):
    model, tokenizer = lm
    prompts = [_ids(p) for p in prompts]
    assert len({len(p) for p in prompts}) > 1  # the batch really needs padding
    cfg = GenerationConfig(max_new_tokens=12, temperature=0)
    batched = HFGenerator(model, tokenizer, batch_size=4).generate(prompts, cfg)
    single = HFGenerator(model, tokenizer, batch_size=1)
    for i, p in enumerate(prompts):
        alone = single.generate([p], cfg)
        assert alone.response_ids[0] == batched.response_ids[i]
        assert alone.texts[0] == batched.texts[i]
    assert batched.prompt_ids == prompts
    assert batched.prompt_index == [0, 1, 2, 3]


def test_stop_string_truncation(lm, prompts):
    model, tokenizer = lm
    prompts = [_ids(p) for p in prompts]
    gen = HFGenerator(model, tokenizer, batch_size=4)
    free = gen.generate(prompts, GenerationConfig(max_new_tokens=16, temperature=0))
    assert not any(free.stopped)  # random tiny model: runs to max_new_tokens
    assert all(len(r) == 16 for r in free.response_ids)
    stop = free.texts[0][4:6]  # two characters the first response produces
    cut = gen.generate(prompts, GenerationConfig(max_new_tokens=16, temperature=0, stop_strings=[stop]))
    for i in range(len(prompts)):
        full, ids, text = free.response_ids[i], cut.response_ids[i], cut.texts[i]
        assert full[: len(ids)] == ids  # same greedy path, cut earlier or not at all
        if stop in free.texts[i]:
            assert cut.stopped[i]
            assert text.endswith(stop) or stop in text
            assert stop not in tokenizer.decode(ids[:-1])  # the last kept token completed the stop string
        else:
            assert not cut.stopped[i] and ids == full
    assert cut.stopped[0] and cut.texts[0] == free.texts[0][:6]  # char-level: cut exactly after the stop


def test_eos_truncation_and_stopped_flags(lm, prompts):
    model, tokenizer = lm
    prompts = [_ids(p) for p in prompts]
    free = HFGenerator(model, tokenizer).generate(prompts, GenerationConfig(max_new_tokens=16, temperature=0))
    first = free.response_ids[0]
    eos = next(t for t in first[2:] if t not in first[:2])  # pretend a token response 0 makes mid-way is EOS
    gen = HFGenerator(model, tokenizer, eos_token_ids=[eos])
    out = gen.generate(prompts, GenerationConfig(max_new_tokens=16, temperature=0))
    for i in range(len(prompts)):
        full = free.response_ids[i]
        if eos in full:
            k = full.index(eos) + 1
            assert out.response_ids[i] == full[:k] and out.stopped[i]
            assert out.texts[i] == tokenizer.decode(full[: k - 1])  # trailing EOS not in the text
        else:
            assert out.response_ids[i] == full and not out.stopped[i]
    assert out.stopped[0] and 3 <= len(out.response_ids[0]) < len(first)


def test_finalize_response_rules(lm):
    _, tokenizer = lm
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = tokenizer.eos_token_id
    ids, text, stopped = finalize_response(enc("abc") + [eos] + enc("zz"), [eos], tokenizer, None)
    assert ids == enc("abc") + [eos] and text == "abc" and stopped
    ids, text, stopped = finalize_response(enc("ab STOP cd") + [eos], [eos], tokenizer, ["STOP", "b S"])
    assert text == "ab S" and stopped  # the earliest completed stop string wins
    ids, text, stopped = finalize_response(enc("abc") + [eos], [eos], tokenizer, ["c"])
    assert text == "abc" and ids == enc("abc") and stopped  # stop string before EOS: cut at the string
    ids, text, stopped = finalize_response(enc("abcd"), [eos], tokenizer, ["x"])
    assert ids == enc("abcd") and text == "abcd" and not stopped


def test_n_samples_contiguous_and_seeded(lm, prompts):
    model, tokenizer = lm
    prompts = [_ids(p) for p in prompts[:2]]
    gen = HFGenerator(model, tokenizer, batch_size=4)
    cfg = GenerationConfig(max_new_tokens=10, temperature=1.0, top_p=0.95, n=3, seed=123)
    state = torch.random.get_rng_state()
    a = gen.generate(prompts, cfg)
    assert torch.equal(state, torch.random.get_rng_state())  # a seeded call leaves the global RNG alone
    b = gen.generate(prompts, cfg)
    c = gen.generate(prompts, GenerationConfig(max_new_tokens=10, temperature=1.0, top_p=0.95, n=3, seed=124))
    assert a.prompt_index == [0, 0, 0, 1, 1, 1] and len(a) == 6
    assert a.response_ids == b.response_ids and a.texts == b.texts
    assert a.response_ids != c.response_ids
    assert len({tuple(r) for r in a.response_ids[:3]}) > 1  # samples of one prompt differ


def test_rescored_logprobs_are_finite(lm, prompts):
    model, tokenizer = lm
    prompts = [_ids(p) for p in prompts[:2]]
    temperature = 0.7
    out = HFGenerator(model, tokenizer).generate(
        prompts, GenerationConfig(max_new_tokens=8, temperature=temperature, n=2, seed=0)
    )
    with torch.no_grad():
        for j, resp in enumerate(out.response_ids):
            seq = torch.tensor([out.prompt_ids[out.prompt_index[j]] + resp])
            logits = model(input_ids=seq).logits[:, :-1]
            lp = token_logprobs(logits, seq[:, 1:], temperature)[0, -len(resp) :]
            assert lp.shape[0] == len(resp) and torch.isfinite(lp).all()
            assert all(not math.isnan(x) and x <= 0 for x in lp.tolist())


def test_per_prompt_budgets_cut_each_response_like_a_shorter_max_new_tokens(lm, prompts):
    """Token in, token out for episodes at different turns: prompt 1 already holds an earlier turn (its first
    prompt + the response to it + the next prompt), and each prompt has its own remaining budget. A prompt's
    response is exactly what generating it alone with max_new_tokens = its budget gives."""
    model, tokenizer = lm
    gen = HFGenerator(model, tokenizer, batch_size=4)
    first, second = _ids(prompts[0]), _ids(prompts[1])
    greedy = GenerationConfig(max_new_tokens=10, temperature=0)
    earlier = gen.generate([first], greedy).response_ids[0]
    episodes = [second, first + earlier + second]  # episode 0 at its first turn, episode 1 at its second
    out = gen.generate(episodes, greedy, max_new_tokens=[3, 7])
    for i, budget in enumerate([3, 7]):
        alone = gen.generate([episodes[i]], GenerationConfig(max_new_tokens=budget, temperature=0))
        assert out.response_ids[i] == alone.response_ids[0] and out.stopped[i] == alone.stopped[0]
        assert len(out.response_ids[i]) <= budget and len(out.logprobs[i]) == len(out.response_ids[i])
    with pytest.raises(ValueError, match="max_new_tokens has 1 entries for 2 prompts"):
        gen.generate(episodes, greedy, max_new_tokens=[3])


def test_engine_budgets_cap_each_prompt_and_refuse_what_exceeds_the_context():
    """The engines' per-request budgets: the config's max_new_tokens or the smaller per-prompt cap, and a prompt
    whose length + budget passes max_model_len (or an empty one) refused, naming it."""
    from open_instruct.generation import engine_budgets

    config = GenerationConfig(max_new_tokens=8)
    prompts = [[1] * 10, [1] * 20]
    assert engine_budgets(prompts, config, None, 30) == [8, 8]
    assert engine_budgets(prompts, config, [5, 12], 28) == [5, 8]  # 20 + 8 = 28 fits exactly
    with pytest.raises(ValueError, match=r"prompt 1 \(20 tokens\) \+ max_new_tokens 8 exceeds .* max_model_len 27"):
        engine_budgets(prompts, config, None, 27)
    with pytest.raises(ValueError, match="at least one token"):
        engine_budgets([[1], []], config, None, 30)
    with pytest.raises(ValueError, match="2 entries for 1 prompts"):
        engine_budgets([[1]], config, [3, 4], 30)


def test_stop_strings_decode_only_running_rows_within_a_window(lm):
    """The stop-string check of one decoding step decodes the rows still running, a bounded tail each: a row that met
    a stop string or emitted EOS is not decoded again (before: every row, every step)."""
    from open_instruct.generation import _StopOnStrings

    _, tokenizer = lm
    eos = tokenizer.eos_token_id
    a, b, x = (tokenizer.convert_tokens_to_ids(c) for c in "abx")
    decoded: list[int] = []

    class CountingTokenizer:
        def batch_decode(self, rows, **kwargs):
            decoded.append(len(rows))
            assert all(len(r) <= criterion.window for r in rows)
            return tokenizer.batch_decode(rows, **kwargs)

    criterion = _StopOnStrings(CountingTokenizer(), ["ab"], prompt_width=2, eos_ids=[eos])
    prompt = [[x, x]] * 3
    # row 0 completes "ab" at step 2; row 1 emits EOS at step 1 (generate pads it afterwards); row 2 runs on
    steps = [[a, eos, x], [b, eos, x], [x, eos, x]] + [[x, eos, x]] * 40
    flags = []
    for t in range(len(steps)):
        ids = torch.tensor([p + [s[r] for s in steps[: t + 1]] for r, p in enumerate(prompt)])
        flags.append(criterion(ids, torch.zeros(3, 5)).tolist())
    assert flags[0] == [False, True, False] and flags[1] == [True, True, False] and flags[-1] == [True, True, False]
    assert decoded == [2, 2] + [1] * 41  # rows decoded per step: 45 in all, not 3 x 43 = 129
    assert criterion.rows_decoded == 45


def test_generation_sub_batches_match_one_batch(lm, prompts):
    """HF generation in bounded sub-batches (one KV cache each): greedy outputs equal one whole batch's; seeded
    sampling is reproducible for a given sub-batch size."""
    model, tokenizer = lm
    prompts = [_ids(p) for p in prompts]
    greedy = GenerationConfig(max_new_tokens=10, temperature=0, n=2)
    whole = HFGenerator(model, tokenizer, batch_size=len(prompts) * 2).generate(prompts, greedy)
    for size in (1, 3):
        parts = HFGenerator(model, tokenizer, batch_size=size).generate(prompts, greedy)
        assert parts.response_ids == whole.response_ids and parts.texts == whole.texts
    sampled = GenerationConfig(max_new_tokens=10, temperature=1.0, n=2, seed=7)
    first = HFGenerator(model, tokenizer, batch_size=3).generate(prompts, sampled)
    again = HFGenerator(model, tokenizer, batch_size=3).generate(prompts, sampled)
    assert first.response_ids == again.response_ids and first.logprobs == again.logprobs


def test_a_groups_prompt_is_prefilled_once_and_samples_as_before(lm, prompts):
    """share_prompts (the default, `shared_prompt_generation`): in each generate call a prompt's n rows share one
    prefill of the prompt but its last token. Greedy tokens equal the unshared generator's, seeded samples too, and
    the sampler's log-probs agree within the rounding of a reordered forward (a log-softmax: twice the logits'
    bound); the prompt tokens not computed again are (rows of a prompt in a call - 1) x (its length - 1), summed.
    A call that splits a group (batch_size 5, groups of 3) shares within the call; share_prompts=False shares none."""
    from tolerances import forward_atol

    model, tokenizer = lm
    prompts = [_ids(p) for p in prompts]
    longest = max(prompts, key=len)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([longest])).logits
    atol = 2 * forward_atol(model, len(longest) + 12, logits)
    for config in (GenerationConfig(max_new_tokens=12, temperature=0, n=3),
                   GenerationConfig(max_new_tokens=12, temperature=1.0, n=3, seed=5)):  # fmt: skip
        for batch_size in (6, 5):  # samples depend on the batch size (see the test above): each compared at its own
            plain_generator = HFGenerator(model, tokenizer, batch_size=batch_size, share_prompts=False)
            plain = plain_generator.generate(prompts, config)
            assert plain_generator.prompt_tokens_shared == 0
            shared_generator = HFGenerator(model, tokenizer, batch_size=batch_size)
            shared = shared_generator.generate(prompts, config)
            assert shared.response_ids == plain.response_ids and shared.texts == plain.texts
            for a, b in zip(shared.logprobs, plain.logprobs):
                assert max(abs(x - y) for x, y in zip(a, b)) <= atol
            if batch_size == 6:  # rows sorted by length, 2 whole groups per call
                assert shared_generator.prompt_tokens_shared == sum(2 * (len(p) - 1) for p in prompts)
            else:  # calls of 5 rows: 3 + 2 | 1 + 3 + 1 | 2 rows of the prompts by length
                a, b, c, d = sorted(len(p) - 1 for p in prompts)
                assert shared_generator.prompt_tokens_shared == 2 * a + b + 2 * c + d


@pytest.mark.parametrize(
    "micro,rollout,max_model_len,expected",
    [
        (None, (32, 1), 4096, 32),  # rlvr_8b: 131072 // 4096 = 32 = the whole rollout
        (None, (64, 8), 4096, 32),  # 512 sequences of 4096 tokens: 16 calls of 32
        (None, (32, 4), 108, 128),  # tiny recipes: the whole rollout in one call
        (5, (32, 4), 108, 5),
        (500, (32, 4), 108, 128),
        (None, (1, 1), 10**6, 1),
    ],
)
def test_generation_sequences_per_call(micro, rollout, max_model_len, expected):
    from types import SimpleNamespace

    from open_instruct.batch_math import generation_sequences_per_call

    cfg = SimpleNamespace(
        generation_micro_batch_size=micro, local_rollout_batch_size=rollout[0], num_samples_per_prompt=rollout[1]
    )
    assert generation_sequences_per_call(cfg, max_model_len) == expected


def test_seeded_generation_ignores_the_process_rng(lm, prompts):
    """A seeded generate draws from a generator of its own: the process-wide RNG reseeded, consumed and restored at
    every decoding step (what torch.utils.checkpoint does in the training thread of an async run, on every
    recompute) changes none of its tokens or log-probs."""
    model, tokenizer = lm
    prompts = [_ids(p) for p in prompts[:2]]
    cfg = GenerationConfig(max_new_tokens=10, temperature=1.0, top_p=0.95, n=3, seed=5)
    quiet = HFGenerator(model, tokenizer, batch_size=4).generate(prompts, cfg)
    steps = [0]

    def churn(module, args):  # every forward: reseed, draw, and restore an older state, as other threads may
        steps[0] += 1
        saved = torch.get_rng_state()
        torch.manual_seed(1000 + steps[0])
        torch.rand(7)
        if steps[0] % 2:
            torch.set_rng_state(saved)

    hook = model.register_forward_pre_hook(churn)
    try:
        busy = HFGenerator(model, tokenizer, batch_size=4).generate(prompts, cfg)
    finally:
        hook.remove()
    assert steps[0] >= 10  # the process RNG really was disturbed at each decoding step
    assert busy.response_ids == quiet.response_ids and busy.logprobs == quiet.logprobs
    assert len({tuple(r) for r in quiet.response_ids}) > 1  # it sampled (not greedy)


def test_unseeded_generation_draws_from_the_process_rng(lm, prompts):
    """seed=None samples from the process-wide RNG: the same global seed gives the same samples."""
    model, tokenizer = lm
    prompts = [_ids(p) for p in prompts[:2]]
    cfg = GenerationConfig(max_new_tokens=10, temperature=1.0, n=2)
    gen = HFGenerator(model, tokenizer, batch_size=4)
    torch.manual_seed(3)
    a = gen.generate(prompts, cfg)
    torch.manual_seed(3)
    b = gen.generate(prompts, cfg)
    c = gen.generate(prompts, cfg)  # the global stream moved on
    assert a.response_ids == b.response_ids and a.response_ids != c.response_ids


def test_bf16_run_generates_from_one_cast_copy_per_weight_version(lm, prompts):
    """Without FSDP a bf16 run keeps fp32 weights; the generator casts them once per weight version into a copy
    (not at every decoding step under autocast), used for every generate call of that version, dropped when the
    generation block ends or new weights arrive; the fp32 model is untouched, tied weights stay tied, and greedy
    output equals generating from the model with its parameters cast to bf16 in place."""
    import copy

    model, tokenizer = lm
    prompts = [_ids(p) for p in prompts]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = HFGenerator(model, tokenizer, batch_size=4, compute_dtype=torch.bfloat16)
    greedy = GenerationConfig(max_new_tokens=8, temperature=0)
    with gen.generation_context(model):
        first = gen.generate(prompts, greedy)
        copy_a = gen._compute_dtype_model()
        assert gen.generate(prompts, greedy).response_ids == first.response_ids
        assert gen._compute_dtype_model() is copy_a  # one cast for the version, whatever the calls and steps
        assert copy_a is not model and all(p.dtype == torch.bfloat16 for p in copy_a.parameters())
        tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
        assert (copy_a.get_input_embeddings().weight is copy_a.get_output_embeddings().weight) == tied
        gen.sync_weights(model, version=1)
        assert gen._compute_dtype_model() is not copy_a  # new weights: a new copy
    assert gen._cast_copy is None  # dropped with the block: memory while generating only
    assert all(p.dtype == torch.float32 and torch.equal(p, before[n]) for n, p in model.named_parameters())
    whole = copy.deepcopy(model)
    for p in whole.parameters():  # parameters only: buffers (the rotary frequencies) stay fp32, as in the copy
        p.data = p.data.to(torch.bfloat16)
    assert HFGenerator(whole, tokenizer, batch_size=4).generate(prompts, greedy).response_ids == first.response_ids


def test_a_nan_distribution_is_a_clean_error_not_a_device_assert(lm, prompts, monkeypatch):
    """One row's logits turn NaN at the third decoding step. On a GPU, multinomial over such a row is a device-side
    assert that leaves the CUDA context unusable; here a multinomial that refuses it the same way stands in. The
    sampler never hands it one, and the generate call ends with NonFiniteError naming the row; a clean call reads
    the check off the device once per generate call, not once per token."""
    from host_syncs import HostSyncCounter

    from open_instruct import generation
    from open_instruct.errors import NonFiniteError

    model, tokenizer = lm
    prompts = [_ids(p) for p in prompts[:2]]
    cfg = GenerationConfig(max_new_tokens=6, temperature=1.0, n=2, seed=3)
    real_multinomial = torch.multinomial

    def cuda_like_multinomial(probs, *args, **kwargs):
        if not bool(((probs >= 0) & torch.isfinite(probs)).all()):
            raise AssertionError("device-side assert triggered: probability tensor contains inf, nan or element < 0")
        return real_multinomial(probs, *args, **kwargs)

    monkeypatch.setattr(generation.torch, "multinomial", cuda_like_multinomial)
    steps = [0]

    def nan_in_row_1(module, args, output):
        if len(output) != 4:  # the shared prompt prefix's forward (2 distinct prompts), not a decoding step
            return output
        steps[0] += 1
        if steps[0] >= 3:
            output[1, -1] = float("nan")
        return output

    hook = model.lm_head.register_forward_hook(nan_in_row_1)
    try:
        with pytest.raises(NonFiniteError, match=r"1 of 4 sequences .*rows \[1\]\).*NaN, inf or negative"):
            HFGenerator(model, tokenizer, batch_size=4).generate(prompts, cfg)
    finally:
        hook.remove()
    assert steps[0] == cfg.max_new_tokens  # generate ran to the end: nothing asserted on the way

    source, first = inspect.getsourcelines(generation._OwnSampler)
    sampler_lines = range(first, first + len(source))
    with HostSyncCounter() as counter:
        clean = HFGenerator(model, tokenizer, batch_size=2).generate(prompts, cfg)  # 2 generate calls of 2 rows
    assert len(clean.response_ids) == 4
    in_sampler = [e for e in counter.events if e[0].startswith(generation.__file__ + ":")
                  and int(e[0].rsplit(":", 1)[1]) in sampler_lines]  # fmt: skip
    assert len(in_sampler) == 2, in_sampler
