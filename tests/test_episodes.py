"""Token-in/token-out episodes: observation ids by prefix difference, generated ids kept verbatim under a tokenizer
whose decode->encode changes them, the loss mask, turn rewards, GAE across turns (hand-worked), budgets, and the
batch driver with a scripted generate_fn whose episodes end at different turns. CPU, no model."""

from __future__ import annotations

import collections
import json
import string
import threading

import pytest
import torch

from demo.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS, build_tokenizer
from open_instruct.environments import Environment, GuardedEnvironment, StepResult, ToolEnvironment, make_environment
from open_instruct.episodes import (
    Episode,
    EpisodeBudget,
    EpisodeTokenizer,
    Turn,
    cut_at_action_end,
    episode_sample_row,
    episode_score,
    episode_stat_sums,
    episode_stats,
    pad_episodes,
    render_episode,
    rollout_episodes,
    shared_stop_strings,
    token_rewards,
)
from open_instruct.errors import ConfigError
from open_instruct.rl_algorithms import multi_turn_gae


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def build_merging_tokenizer():
    """A BPE tokenizer (the tiny chat template and specials) with the merges a+b -> "ab" and 1+2 -> "12", so the
    sampled split ["a", "b"] decodes to "ab", which encodes to the single id of "ab": decode->encode is not the
    identity."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + chars + ["<unk>", "ab", "12"])}
    model = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b"), ("1", "2")], unk_token="<unk>"))
    model.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=model,
        pad_token="<pad>",
        eos_token="<|end|>",
        unk_token="<unk>",
        additional_special_tokens=SPECIAL_TOKENS[2:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def hermes_call(expression: str) -> str:
    return f"<tool_call>{json.dumps({'name': 'calculator', 'arguments': {'expression': expression}})}</tool_call>"


class ScriptedGenerator:
    """generate_fn answering each episode's turns from a script keyed by its prompt text; records every call.
    A script entry is (text, closed): closed appends the end-of-turn token. Log-prob of the k-th token: -(k+1)/10."""

    def __init__(self, tokenizer, tokens: EpisodeTokenizer, scripts: dict[str, list[tuple[str, bool]]]):
        self.tokenizer, self.tokens = tokenizer, tokens
        self.scripts = {tuple(tokens.prompt_ids([{"role": "user", "content": p}])): s for p, s in scripts.items()}
        self.turn = collections.Counter()
        self.calls: list[tuple[list[list[int]], list[int]]] = []

    def __call__(self, requests, caps):
        self.calls.append(([list(r) for r in requests], list(caps)))
        out = []
        for ids, cap in zip(requests, caps):
            prompt = next(p for p in self.scripts if tuple(ids[: len(p)]) == p)
            text, closed = self.scripts[prompt][self.turn[prompt]]
            self.turn[prompt] += 1
            gen = (encode(self.tokenizer, text) + ([self.tokens.turn_end_id] if closed else []))[:cap]
            out.append((gen, [-(k + 1) / 10 for k in range(len(gen))]))
        return out


def calculator_env(**kwargs) -> ToolEnvironment:
    return ToolEnvironment(tools=["calculator"], tool_output_max_tokens=None, **kwargs)


def row(question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": question}], "ground_truth": answer, "verifier": "arithmetic"}


# -----------------------------------------------------------------------------------------------------------------
# Observation ids


def test_observation_ids_are_the_template_suffix_after_the_turn_end(tok):
    tokens = EpisodeTokenizer(tok)
    closed = tokens.observation_ids([{"role": "tool", "content": "42"}], turn_closed=True)
    # The tiny template renders an assistant turn as content + "<|end|>\n": the "\n" after the end token, the tool
    # turn and the next assistant header are the observation.
    assert closed == encode(tok, "\n<|tool|>\n42<|end|>\n<|assistant|>\n")
    assert tokens.observation_ids([{"role": "tool", "content": "42"}], turn_closed=False) == [tok.eos_token_id] + closed
    two = tokens.observation_ids([{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}], True)
    assert two == encode(tok, "\n<|tool|>\n1<|end|>\n<|tool|>\n2<|end|>\n<|assistant|>\n")
    assert tokens.observation_ids("\n<output>\n5\n</output>\n", True) == encode(tok, "\n<output>\n5\n</output>\n")


def test_observation_ids_survive_a_template_that_renders_the_last_assistant_turn_differently():
    """Like Qwen3, which adds an empty think block to the final assistant message only: the render without the
    observation is then not a prefix of the render with it, but the turn-end count still finds the cut."""
    tok = build_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and loop.last %}"
        "{{ '<|assistant|>\n<think></think>' + m['content'] + '<|end|>\n' }}"
        "{% else %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
    )
    tokens = EpisodeTokenizer(tok)
    without = tokens.render_ids(EpisodeTokenizer.BASE, None, False)
    with_obs = tokens.render_ids(EpisodeTokenizer.BASE + [{"role": "tool", "content": "42"}], None, True)
    assert with_obs[: len(without)] != without  # a plain prefix difference would fail here
    assert tokens.observation_ids([{"role": "tool", "content": "42"}], True) == encode(
        tok, "\n<|tool|>\n42<|end|>\n<|assistant|>\n"
    )


def build_template_tokenizer(template: str, eos: str):
    """A character tokenizer with the Qwen and Llama 3 special tokens, carrying a real model's chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [
        "<pad>",
        "<|im_end|>",
        "<|im_start|>",
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
        "<|begin_of_text|>",
        "<|eot_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|python_tag|>",
        "<|eom_id|>",
    ]
    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    model = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + chars + ["<unk>"])}, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    model.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=model,
        pad_token="<pad>",
        eos_token=eos,
        unk_token="<unk>",
        additional_special_tokens=specials[2:],
    )
    fast.chat_template = template
    return fast


QWEN_TOOL_TURN = "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "template, eos, expected, plain_prefix_holds",
    [
        ("qwen2_5.jinja", "<|im_end|>", QWEN_TOOL_TURN, True),
        ("qwen3.jinja", "<|im_end|>", QWEN_TOOL_TURN, False),  # the last assistant turn gets an empty think block
        ("qwen3_5_think.jinja", "<|im_end|>", QWEN_TOOL_TURN + "<think>\n", True),
        (
            "llama3_1.jinja",
            "<|eot_id|>",
            '<|start_header_id|>ipython<|end_header_id|>\n\n"42"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n',
            True,
        ),
    ],
)
def test_observation_ids_through_real_model_templates(template, eos, expected, plain_prefix_holds):
    """The models' own templates, as TRL ships them (trl/chat_templates), with and without tool schemas."""
    import importlib.util
    import os

    folder = os.path.join(importlib.util.find_spec("trl").submodule_search_locations[0], "chat_templates")
    tok = build_template_tokenizer(open(os.path.join(folder, template)).read(), eos)
    tokens = EpisodeTokenizer(tok)
    for tools in (None, ToolEnvironment(tool_output_max_tokens=None).tools):
        assert (
            tokens.decode(tokens.observation_ids([{"role": "tool", "content": "42"}], True, tools), False) == expected
        )
    without = tokens.render_ids(EpisodeTokenizer.BASE, None, False)
    with_obs = tokens.render_ids(EpisodeTokenizer.BASE + [{"role": "tool", "content": "42"}], None, True)
    assert (with_obs[: len(without)] == without) == plain_prefix_holds


def test_a_template_that_drops_tool_messages_is_refused(tok):
    tok = build_tokenizer()
    tok.chat_template = CHAT_TEMPLATE.replace(
        "{% for message in messages %}", "{% for message in messages if message['role'] != 'tool' %}"
    )
    with pytest.raises(ValueError, match="does not render the 'tool' message"):
        EpisodeTokenizer(tok).observation_ids([{"role": "tool", "content": "42"}], True)


# -----------------------------------------------------------------------------------------------------------------
# Token-in/token-out under a tokenizer whose decode->encode changes ids


def test_generated_ids_survive_verbatim_where_decode_encode_would_change_them():
    tok = build_merging_tokenizer()
    tokens = EpisodeTokenizer(tok)
    a, b, one, two = tok.convert_tokens_to_ids(["a", "b", "1", "2"])
    ab, twelve = tok.convert_tokens_to_ids(["ab", "12"])
    sampled = [a, b, one, two]  # a non-canonical split the sampler may produce
    assert encode(tok, tok.decode(sampled)) == [ab, twelve] != sampled

    class Echo(Environment):
        def reset(self, example):
            return example["messages"]

        def step(self, action):
            done = action.endswith("!")
            return StepResult(None if done else [{"role": "user", "content": "ab?"}], float(done), done, {})

    eos = tok.eos_token_id
    script = iter([[a, b, one, two, eos], [a, b] + encode(tok, "!") + [eos]])
    episodes = rollout_episodes(
        [Echo()],
        [{"messages": [{"role": "user", "content": "say ab12"}]}],
        lambda requests, caps: [(ids, [-0.5] * len(ids)) for ids in [next(script)]],
        tokens,
        EpisodeBudget(max_turns=3),
    )
    ep = episodes[0]
    observation = encode(tok, "\n<|user|>\nab?<|end|>\n<|assistant|>\n")
    assert ab in observation  # the observation is tokenized (canonically) by the tokenizer, the policy ids are not
    assert ep.response_ids == [a, b, one, two, eos] + observation + [a, b] + encode(tok, "!") + [eos]
    assert ep.loss_mask == [1] * 5 + [0] * len(observation) + [1] * 4
    assert ep.turns[1].action == "ab!" and ep.end_reason == "done"


# -----------------------------------------------------------------------------------------------------------------
# The batch driver


QUESTIONS = {"2+2?": "4", "3*3?": "9", "5-1?": "4"}
SCRIPTS = {
    "2+2?": [("The answer is 4", True)],  # answers at once: 1 turn
    "3*3?": [(hermes_call("3*3"), True), ("It is 8", True)],  # one call, then a wrong answer: 2 turns
    "5-1?": [(hermes_call("5-1"), True), (hermes_call("4*1"), True), ("So 4", True)],  # two calls: 3 turns
}


def play(tok, budget=EpisodeBudget(max_turns=4, max_turn_tokens=128, max_response_tokens=1024), step_workers=1):
    tokens = EpisodeTokenizer(tok)
    gen = ScriptedGenerator(tok, tokens, SCRIPTS)
    versions = iter(range(100))
    episodes = rollout_episodes(
        [calculator_env() for _ in QUESTIONS],
        [row(q, a) for q, a in QUESTIONS.items()],
        gen,
        tokens,
        budget,
        weight_version=lambda: next(versions),
        step_workers=step_workers,
    )
    return episodes, gen, tokens


def test_batch_driver_episodes_end_at_different_turns(tok):
    episodes, gen, tokens = play(tok)
    assert [len(e.turns) for e in episodes] == [1, 2, 3]
    assert [len(reqs) for reqs, _ in gen.calls] == [3, 2, 1]  # finished episodes leave the batch
    assert [e.end_reason for e in episodes] == ["done"] * 3
    assert [episode_score(e, "sum") for e in episodes] == [1.0, 0.0, 1.0]
    eos = tok.eos_token_id

    def tool_turn(result):  # a call turn ends at its `</tool_call>`: its end token is the observation's first
        return [eos] + encode(tok, f"\n<|tool|>\n{result}<|end|>\n<|assistant|>\n")

    # Every request is the episode's prompt + everything so far, token for token.
    prompt = tokens.prompt_ids(row("5-1?", "4")["messages"])
    call1 = encode(tok, hermes_call("5-1"))
    call2 = encode(tok, hermes_call("4*1"))
    assert gen.calls[1][0][1] == prompt + call1 + tool_turn(4)
    assert gen.calls[2][0][0] == prompt + call1 + tool_turn(4) + call2 + tool_turn(4)
    last = episodes[2]
    assert last.response_ids == call1 + tool_turn(4) + call2 + tool_turn(4) + encode(tok, "So 4") + [eos]
    # Sampler log-probs and weight versions on policy tokens; 0.0 and -1 on the observation.
    n1, n_obs = len(call1), len(tool_turn(4))
    assert last.sampler_logprobs[:n1] == pytest.approx([-(k + 1) / 10 for k in range(n1)])
    assert last.sampler_logprobs[n1 : n1 + n_obs] == [0.0] * n_obs
    assert last.weight_versions[:n1] == [0] * n1 and last.weight_versions[n1 : n1 + n_obs] == [-1] * n_obs
    assert last.weight_versions[-1] == 2  # the third generation call sampled the last turn
    assert [(t.policy_start, t.policy_end, t.observation_end) for t in last.turns] == [
        (0, n1, n1 + n_obs),
        (n1 + n_obs, n1 + n_obs + len(call2), n1 + 2 * n_obs + len(call2)),
        (n1 + 2 * n_obs + len(call2), len(last.response_ids), len(last.response_ids)),
    ]
    threaded, _, _ = play(tok, step_workers=3)
    assert [e.response_ids for e in threaded] == [e.response_ids for e in episodes]


def test_observation_tokens_never_carry_loss_weight(tok):
    episodes, _, _ = play(tok)
    batch = pad_episodes(episodes, tok.pad_token_id, "sum")
    for b, ep in enumerate(episodes):
        expected = torch.zeros(batch.loss_mask.shape[1])
        for turn in ep.turns:
            expected[turn.policy_start : turn.policy_end] = 1
        assert torch.equal(batch.loss_mask[b], expected)
        assert int(batch.attention_mask[b].sum()) == len(ep.response_ids)
    observation = (batch.attention_mask == 1) & (batch.loss_mask == 0)
    # 1 + 2 calls, each turn's end token and the tool turn
    assert int(observation.sum()) == 3 * len(encode(tok, "<|end|>\n<|tool|>\n9<|end|>\n<|assistant|>\n"))
    assert bool((batch.sampler_logprobs[observation] == 0).all() and (batch.weight_versions[observation] == -1).all())
    assert bool((batch.token_rewards[observation] == 0).all())
    # A masked policy-gradient loss (token mean) has exactly zero gradient on every observation token.
    logp = torch.randn(batch.loss_mask.shape, requires_grad=True)
    advantages = torch.randn(batch.loss_mask.shape)
    loss = -(advantages * logp * batch.loss_mask).sum() / batch.loss_mask.sum()
    loss.backward()
    assert bool((logp.grad[observation] == 0).all()) and bool((logp.grad[batch.loss_mask == 1] != 0).all())


def test_budgets_end_episodes_and_are_counted(tok):
    tokens = EpisodeTokenizer(tok)
    forever = {"2+2?": [(hermes_call("1+1"), True)] * 10}
    gen = ScriptedGenerator(tok, tokens, forever)
    [ep] = rollout_episodes([calculator_env()], [row("2+2?", "4")], gen, tokens, EpisodeBudget(max_turns=3))
    assert len(ep.turns) == 3 and ep.end_reason == "max_turns" and ep.truncations == {"max_turns": 1}
    assert ep.loss_mask[-1] == 1  # no observation after the last turn
    # max_turn_tokens: each turn is cut at 8 tokens without its end token; the broken call is a (wrong) answer.
    gen = ScriptedGenerator(tok, tokens, {"2+2?": [(hermes_call("2+2"), True)]})
    [ep] = rollout_episodes([calculator_env()], [row("2+2?", "4")], gen, tokens, EpisodeBudget(max_turn_tokens=8))
    assert ep.response_ids == encode(tok, hermes_call("2+2"))[:8] and ep.truncations == {"max_turn_tokens": 1}
    assert ep.end_reason == "done" and not ep.turns[0].stopped and episode_score(ep, "sum") == 0.0
    # max_response_tokens: the request caps shrink with the response; an observation that does not fit ends it.
    call = encode(tok, hermes_call("1+1"))  # the turn ends at `</tool_call>`; its end token opens the observation
    obs = [tok.eos_token_id] + encode(tok, "\n<|tool|>\n2<|end|>\n<|assistant|>\n")
    budget = EpisodeBudget(max_turns=10, max_turn_tokens=128, max_response_tokens=2 * len(call) + len(obs) + 5)
    gen = ScriptedGenerator(tok, tokens, forever)
    [ep] = rollout_episodes([calculator_env()], [row("2+2?", "4")], gen, tokens, budget)
    assert [caps for _, caps in gen.calls] == [[128], [len(call) + 5]]
    assert ep.response_ids == call + obs + call and ep.end_reason == "max_response_tokens"
    with pytest.raises(ConfigError, match="max_turns"):
        EpisodeBudget(max_turns=0)


def test_fenced_turn_is_cut_at_the_block_end_and_output_continues_the_message(tok):
    tokens = EpisodeTokenizer(tok)
    env = ToolEnvironment(
        tools=["python"],
        tool_format="fenced",
        python_runtime=lambda c, t: ("5\n", "", "ok"),
        tool_output_max_tokens=None,
    )
    block = "Compute:\n```python\nprint(2 + 3)\n```"
    gen = ScriptedGenerator(tok, tokens, {"2+3?": [(block + "\nThe answer is 9", True), ("The answer is 5", True)]})
    [ep] = rollout_episodes([env], [row("2+3?", "5")], gen, tokens, EpisodeBudget())
    output = encode(tok, "\n<output>\n5\n\n</output>\n")
    assert ep.response_ids == encode(tok, block) + output + encode(tok, "The answer is 5") + [tok.eos_token_id]
    assert ep.sampler_logprobs[: len(encode(tok, block))] == pytest.approx(
        [-(k + 1) / 10 for k in range(len(encode(tok, block)))]
    )
    assert ep.turns[0].stopped and not ep.turns[0].closed and ep.tool_calls == 1 and episode_score(ep, "sum") == 1.0


def test_a_hermes_call_turn_ends_at_the_call_end_with_the_sampled_ids(tok):
    """The model writes its call and then repeats it up to the turn budget (SmolLM2 after RL did): the turn ends at
    the first `</tool_call>`, its ids and log-probs are the first sampled ones unchanged, the dropped repeat is in no
    list, and the turn's end token comes back as the observation's first token (loss mask 0)."""
    tokens = EpisodeTokenizer(tok)
    call, eos = encode(tok, hermes_call("2+2")), tok.eos_token_id
    gen = ScriptedGenerator(tok, tokens, {"2+2?": [(hermes_call("2+2") * 3, True), ("4", True)]})
    [ep] = rollout_episodes([calculator_env()], [row("2+2?", "4")], gen, tokens, EpisodeBudget(max_turn_tokens=128))
    observation = [eos] + encode(tok, "\n<|tool|>\n4<|end|>\n<|assistant|>\n")
    assert ep.response_ids == call + observation + encode(tok, "4") + [eos]
    assert ep.loss_mask == [1] * len(call) + [0] * len(observation) + [1, 1]
    assert ep.sampler_logprobs[: len(call)] == pytest.approx([-(k + 1) / 10 for k in range(len(call))])
    assert ep.sampler_logprobs[len(call) : len(call) + len(observation)] == [0.0] * len(observation)
    first = ep.turns[0]
    assert (first.policy_end, first.stopped, first.closed) == (len(call), True, False)
    assert first.action == hermes_call("2+2") and ep.tool_calls == 1 and not ep.truncations
    assert episode_score(ep, "sum") == 1.0
    # A generator that stopped at the marker itself (stop strings) gives the same episode.
    stopped = ScriptedGenerator(tok, tokens, {"2+2?": [(hermes_call("2+2"), False), ("4", True)]})
    budget = EpisodeBudget(max_turn_tokens=128)
    [same] = rollout_episodes([calculator_env()], [row("2+2?", "4")], stopped, tokens, budget)
    assert (same.response_ids, same.loss_mask, same.sampler_logprobs) == (
        ep.response_ids,
        ep.loss_mask,
        ep.sampler_logprobs,
    )


def test_generators_stop_at_the_end_markers_every_environment_shares():
    hermes, fenced = calculator_env(), ToolEnvironment(tools=["python"], tool_format="fenced",
                                                       python_runtime=lambda c, t: ("", "", "ok"),
                                                       tool_output_max_tokens=None)  # fmt: skip
    plain = make_environment("multi_turn")
    assert hermes.stop_strings == ("</tool_call>",) and fenced.stop_strings == () == plain.stop_strings
    assert shared_stop_strings([hermes, calculator_env()]) == ["</tool_call>"]
    assert shared_stop_strings([hermes, plain]) is None  # a marker stops every request: only a shared one
    assert shared_stop_strings([hermes, plain], ["###"]) == ["###"]
    assert shared_stop_strings([hermes], ["###", "</tool_call>"]) == ["###", "</tool_call>"]
    assert shared_stop_strings([]) is None
    assert hermes.action_end("x</tool_call>y</tool_call>") == len("x</tool_call>")
    assert hermes.action_end("<tool_call>{}") is None


def test_cut_at_action_end_keeps_the_fewest_ids_that_complete_the_action():
    ids = list(range(10))

    def action_end(text):
        return text.index("5") + 1 if "5" in text else None

    def decode(x):
        return "".join(map(str, x))

    assert cut_at_action_end(ids, decode, action_end) == 6
    assert cut_at_action_end(ids, decode, lambda text: None) == 10 and cut_at_action_end([], decode, action_end) == 0


# -----------------------------------------------------------------------------------------------------------------
# Rewards and GAE


def scripted_episode(rewards, spans):
    """An episode whose response is policy/observation spans: spans = [(policy_len, obs_len), ...]."""
    ep = Episode(prompt_ids=[0])
    for reward, (n_policy, n_obs) in zip(rewards, spans):
        start = len(ep.response_ids)
        ep.append_policy([7] * n_policy, [0.0] * n_policy, [0] * n_policy)
        end = len(ep.response_ids)
        ep.append_observation([8] * n_obs)
        ep.turns.append(Turn(start, end, len(ep.response_ids), "", True, True, reward))
    return ep


def test_turn_rewards_sum_and_last_on_policy_tokens():
    ep = scripted_episode([-0.5, 0.25, 1.0], [(2, 3), (1, 2), (2, 0)])
    #              t: 0    1     2  3  4  5     6  7  8    9
    assert token_rewards(ep, "sum") == [0, -0.5, 0, 0, 0, 0.25, 0, 0, 0, 1.0]
    assert token_rewards(ep, "last") == [0, 0, 0, 0, 0, 0, 0, 0, 0, 1.0]
    assert episode_score(ep, "sum") == 0.75 and episode_score(ep, "last") == 1.0
    assert sum(token_rewards(ep, "sum")) == episode_score(ep, "sum")
    # A turn that generated nothing hands its reward to the policy token before it.
    empty = scripted_episode([0.5, 2.0], [(2, 1), (0, 0)])
    assert token_rewards(empty, "sum") == [0, 2.5, 0] and token_rewards(empty, "last") == [0, 2.0, 0]
    with pytest.raises(ConfigError, match="turn_reward_aggregation"):
        token_rewards(ep, "mean")


def test_gae_across_turns_hand_worked():
    # response: policy, policy, obs, obs, policy, pad;  gamma = lam = 0.5
    rewards = torch.tensor([[0.0, 0.5, 0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[1.0, 2.0, 9.0, 9.0, 3.0, 7.0]])
    mask = torch.tensor([[1, 1, 0, 0, 1, 0]])
    advantages, returns = multi_turn_gae(rewards, values, mask, gamma=0.5, lam=0.5)
    # position 4 (last policy token): delta = 1 + 0.5 * 0 - 3 = -2;          A = -2
    # position 1 (next policy token 4): delta = 0.5 + 0.5 * 3 - 2 = 0;      A = 0 + 0.25 * -2 = -0.5
    # position 0 (next policy token 1): delta = 0 + 0.5 * 2 - 1 = 0;        A = 0 + 0.25 * -0.5 = -0.125
    assert advantages.tolist() == [[-0.125, -0.5, 0.0, 0.0, -2.0, 0.0]]
    assert returns.tolist() == [[0.875, 1.5, 0.0, 0.0, 1.0, 0.0]]
    with pytest.raises(ValueError, match="non-policy token"):
        multi_turn_gae(torch.tensor([[0.0, 0.0, 1.0]]), torch.zeros(1, 3), torch.tensor([[1, 1, 0]]), 1.0, 1.0)


def test_gae_ignores_observation_tokens_entirely():
    """Inserting observation tokens (any values) between policy tokens changes no policy token's advantage or
    return: the recursion runs over policy tokens as if the observations were absent."""
    generator = torch.Generator().manual_seed(0)
    compact_r, compact_v = torch.randn(2, 6, generator=generator), torch.randn(2, 6, generator=generator)
    compact_m = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    compact_r = compact_r * compact_m
    a_compact, r_compact = multi_turn_gae(compact_r, compact_v, compact_m, gamma=0.9, lam=0.8)
    insert_at = [2, 5]  # observations of 3 tokens before compact positions 2 and 5 (after 4 for row 1: padding)
    cols = []
    for t in range(6):
        if t in insert_at:
            cols += [None] * 3
        cols.append(t)
    r = torch.stack([compact_r[:, t] if t is not None else torch.zeros(2) for t in cols], 1)
    v = torch.stack([compact_v[:, t] if t is not None else torch.full((2,), 99.0) for t in cols], 1)
    m = torch.stack([compact_m[:, t] if t is not None else torch.zeros(2, dtype=torch.long) for t in cols], 1)
    a_long, r_long = multi_turn_gae(r, v, m, gamma=0.9, lam=0.8)
    keep = [i for i, t in enumerate(cols) if t is not None]
    assert torch.allclose(a_long[:, keep], a_compact) and torch.allclose(r_long[:, keep], r_compact)
    assert bool((a_long[:, [i for i, t in enumerate(cols) if t is None]] == 0).all())
    # gamma = lam = 1: the advantage is the sum of the rewards still to come minus the value
    a, _ = multi_turn_gae(compact_r[:1], compact_v[:1], compact_m[:1], 1.0, 1.0)
    expected = compact_r[0].flip(0).cumsum(0).flip(0) - compact_v[0]
    assert torch.allclose(a[0], expected)


# -----------------------------------------------------------------------------------------------------------------
# Logging and sample rows


def test_stats_and_rendering(tok):
    episodes, _, tokens = play(tok)
    episodes[2].tool_errors["calculator_error"] += 1  # as if one call had failed
    sums = episode_stat_sums(episodes)
    obs_tokens = 3 * len(encode(tok, "<|end|>\n<|tool|>\n9<|end|>\n<|assistant|>\n"))  # a call's end token too
    turns = [text for script in SCRIPTS.values() for text, _ in script]
    policy_tokens = sum(len(encode(tok, text)) + ("</tool_call>" not in text) for text in turns)  # + end token
    assert sums == {
        "episodes": 3.0,
        "turns": 6.0,
        "tool_calls": 3.0,
        "episodes_with_tool_calls": 2.0,
        "done": 3.0,
        "policy_tokens": float(policy_tokens),
        "observation_tokens": float(obs_tokens),
        "tool_errors/calculator_error": 1.0,
    }
    stats = episode_stats(sums)
    assert stats["env/turns_per_episode"] == 2.0 and stats["env/tool_calls_per_episode"] == 1.0
    assert stats["env/tool_call_rate"] == pytest.approx(2 / 3) and stats["env/done_rate"] == 1.0
    assert stats["env/observation_token_share"] == pytest.approx(obs_tokens / (obs_tokens + policy_tokens))
    assert stats["env/tool_errors"] == 1.0 and stats["env/tool_errors/calculator_error"] == 1.0
    text = render_episode(episodes[1], tokens)
    assert text == (
        "<|user|>\n3*3?<|end|>\n<|assistant|>\n"
        + hermes_call("3*3")
        + "[[observation]]<|end|>\n<|tool|>\n9<|end|>\n<|assistant|>\n[[/observation]]"
        + "It is 8<|end|>"
    )
    sample = episode_sample_row(episodes[1], tokens, "sum")
    assert (sample["score"], sample["turns"], sample["tool_calls"], sample["end_reason"]) == (0.0, 2, 1, "done")


def test_a_hanging_tool_in_one_episode_does_not_stop_the_batch(tok):
    release = threading.Event()

    def hanging(code, timeout_s):
        release.wait()
        return "", "", "ok"

    tokens = EpisodeTokenizer(tok)
    python_call = '<tool_call>{"name": "python", "arguments": {"code": "print(4)"}}</tool_call>'
    gen = ScriptedGenerator(
        tok, tokens, {"2+2?": [(python_call, True), ("The answer is 4", True)], "3*3?": [("The answer is 9", True)]}
    )
    envs = [
        ToolEnvironment(
            tools=["python"],
            python_runtime=hanging,
            tool_output_max_tokens=None,
            tool_timeout_s=0.05,
            tool_deadline_grace_s=0.05,
        ),
        calculator_env(),
    ]
    try:
        episodes = rollout_episodes(
            envs, [row("2+2?", "4"), row("3*3?", "9")], gen, tokens, EpisodeBudget(), step_workers=2
        )
    finally:
        release.set()
    assert [episode_score(e, "sum") for e in episodes] == [1.0, 1.0]
    assert episodes[0].tool_errors == {"python_hung": 1} and "python_hung" in render_episode(episodes[0], tokens)
    assert episode_stats(episode_stat_sums(episodes))["env/tool_errors/python_hung"] == 1.0


def test_generate_fn_contract_versions_and_errors(tok):
    tokens = EpisodeTokenizer(tok)
    answer = encode(tok, "The answer is 4") + [tok.eos_token_id]
    # (ids, logprobs, versions): an async engine may report the version per token (here it changed mid-turn)
    versions = [3] * 5 + [4] * (len(answer) - 5)
    [ep] = rollout_episodes(
        [calculator_env()],
        [row("2+2?", "4")],
        lambda requests, caps: [(answer, [-1.0] * len(answer), versions)],
        tokens,
        EpisodeBudget(),
    )
    assert ep.weight_versions == versions and ep.end_reason == "done"
    with pytest.raises(ValueError, match="returned 20 ids, 20 logprobs, 20 versions for a request of at most 8"):
        rollout_episodes(
            [calculator_env()],
            [row("2+2?", "4")],
            lambda requests, caps: [([5] * 20, [0.0] * 20)],
            tokens,
            EpisodeBudget(max_turn_tokens=8),
        )
    with pytest.raises(ValueError, match="1 results for 2 requests"):
        rollout_episodes(
            [calculator_env(), calculator_env()],
            [row("2+2?", "4")] * 2,
            lambda requests, caps: [(answer, [0.0] * len(answer))],
            tokens,
            EpisodeBudget(),
        )


def test_a_user_environment_from_a_file_plays_text_turns(tmp_path, tok):
    """An environment written in the user's own file, loaded by path, driven through the episode loop with plain
    text observations (no chat template): each turn continues the text."""
    (tmp_path / "countdown_env.py").write_text(
        "from open_instruct.environments import Environment, StepResult\n"
        "class Countdown(Environment):\n"
        "    def reset(self, example):\n"
        "        self.left = example['start']\n"
        "        return f'count from {self.left}:'\n"
        "    def step(self, action):\n"
        "        right = action.strip() == str(self.left)\n"
        "        self.left -= 1\n"
        "        done = self.left == 0 or not right\n"
        "        return StepResult(None if done else ' ok,', float(right), done, {})\n"
    )
    tokens = EpisodeTokenizer(tok)
    said = iter(["3", "2", "1"])

    def generate(requests, caps):
        return [(ids, [0.0] * len(ids)) for ids in [encode(tok, " " + next(said))]]

    env = make_environment(f"{tmp_path / 'countdown_env.py'}:Countdown")
    [ep] = rollout_episodes([env], [{"start": 3}], generate, tokens, EpisodeBudget(max_turns=5))
    assert tokens.decode(ep.ids) == "count from 3: 3 ok, 2 ok, 1"
    assert ep.loss_mask == [1, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1]
    assert [t.reward for t in ep.turns] == [1.0, 1.0, 1.0] and episode_score(ep, "sum") == 3.0


# -----------------------------------------------------------------------------------------------------------------
# Group scores and the environment's own metrics


class LongestInGroup(Environment):
    """One turn worth 0.25; score_group adds 1 to the group's longest answer(s) and reports each answer's length."""

    def reset(self, example):
        return example["messages"]

    def step(self, action):
        self.answer = action
        return StepResult(None, 0.25, True, {"metrics": {"length": float(len(action))}})

    def score_group(self, group):
        lengths = [len(env.answer) for env in group]
        longest = [float(n == max(lengths)) for n in lengths]
        return [(w, {"metrics": {"length": float(n), "longest": w}}) for n, w in zip(lengths, longest)]


class OneScoreForTwo(LongestInGroup):
    def score_group(self, group):
        return [(1.0, {})]


def test_group_scores_land_on_the_last_turn_and_metrics_are_averaged(tok):
    from open_instruct.episodes import score_groups

    tokens = EpisodeTokenizer(tok)
    scripts = {"a?": [("xyz", True), ("x", True)], "b?": [("pq", True), ("rs", True)]}
    examples = [row(q, "") for q in ("a?", "a?", "b?", "b?")]  # two groups of two, as EnvironmentRun.play orders them
    envs = [GuardedEnvironment(LongestInGroup(), f"row {i // 2}", 10.0) for i in range(4)]
    episodes = rollout_episodes(envs, examples, ScriptedGenerator(tok, tokens, scripts), tokens, EpisodeBudget())
    score_groups(envs, episodes, 2)
    assert [episode_score(e, "sum") for e in episodes] == [1.25, 0.25, 1.25, 1.25]  # "b?": a tie, both longest
    assert [episode_score(e, "last") for e in episodes] == [1.25, 0.25, 1.25, 1.25]
    stats = episode_stats(episode_stat_sums(episodes))
    assert stats["env/metric/length"] == (3 + 1 + 2 + 2) / 4 and stats["env/metric/longest"] == 3 / 4

    envs = [GuardedEnvironment(OneScoreForTwo(), "row 0", 10.0) for _ in range(2)]
    episodes = rollout_episodes(envs, examples[:2], ScriptedGenerator(tok, tokens, scripts), tokens, EpisodeBudget())
    with pytest.raises(
        ConfigError, match=r"OneScoreForTwo.score_group returned .* not one \(reward, info\) per episode"
    ):
        score_groups(envs, episodes, 2)
