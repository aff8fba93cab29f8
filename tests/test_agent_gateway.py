"""The agent gateway (open_instruct/agent_gateway.py): an `openai`-client agent's requests become one training
episode. The same scripted episodes played through `--environment tool` and through the gateway by an agent that
runs the same calculator give identical prompt ids, response ids, loss masks, sampler log-probs, rewards and rollout
tensors, with no untrained turn; a tool call the model wrote in compact JSON, which the agent re-sends as
`tool_calls` and the template would re-render with spaces, stays the sampled ids; a bad agent spec is refused
before any model loads; a plain run never imports the gateway."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import types

import pytest
import torch
from test_multiturn_rlvr import ONE_PROCESS, SCRIPTS, ScriptedGenerator, config, kill_inside_tool_turn, rows

from open_instruct.errors import ConfigError
from open_instruct.generation import GenerationConfig
from open_instruct.rollouts import episode_layout

AGENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "agent_calculator.py")


def play(cfg, tokenizer, scripts):
    from open_instruct.rollouts import environment_run

    environments = environment_run(cfg, tokenizer)
    prompts = [{**r, "prompt_ids": environments.prompt_ids(r)} for r in rows()]
    out = environments.play(ScriptedGenerator(tokenizer, scripts), prompts, GenerationConfig(n=2, seed=5,
                            stop_strings=["###"]))  # fmt: skip
    return prompts, out


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    from open_instruct.models import load_tokenizer

    return load_tokenizer(tiny_models["causal_lm"])


def test_gateway_episodes_equal_the_environments(tiny_models, tokenizer):
    from open_instruct.episodes import episode_score
    from open_instruct.models import load_causal_lm
    from open_instruct.rlvr_ppo import RLModels, collect_rollout

    env_prompts, by_env = play(config(tiny_models), tokenizer, SCRIPTS)
    agent_cfg = config(tiny_models, "--environment", f"agent:{AGENT}:run")
    _, by_agent = play(agent_cfg, tokenizer, SCRIPTS)
    assert [len(e.turns) for e in by_agent.episodes] == [2, 1, 3, 1]
    assert [e.tool_calls for e in by_agent.episodes] == [1, 0, 2, 0]
    assert [episode_score(e, "last") for e in by_agent.episodes] == [1.0, 0.0, 1.0, 1.0]
    assert all(e.truncations["untrained_turns"] == 0 for e in by_agent.episodes)
    assert by_agent.prompt_ids == by_env.prompt_ids
    assert by_agent.response_ids == by_env.response_ids
    assert by_agent.loss_masks == by_env.loss_masks
    assert by_agent.logprobs == by_env.logprobs and by_agent.weight_versions == by_env.weight_versions
    assert [[t.reward for t in e.turns] for e in by_agent.episodes] == [[t.reward for t in e.turns]
                                                                        for e in by_env.episodes]  # fmt: skip
    assert [e.end_reason for e in by_agent.episodes] == ["done"] * 4
    assert sum(by_agent.loss_masks[0]) < len(by_agent.loss_masks[0])  # the tool's answer is there, masked

    # the trainer's rollout of each: the same tensors bit for bit (what the update trains on)
    policy = load_causal_lm(tiny_models["causal_lm"])
    run = types.SimpleNamespace(accelerator=ONE_PROCESS, tokenizer=tokenizer)
    layout = episode_layout(agent_cfg, tokenizer.pad_token_id)
    rollouts = [collect_rollout(agent_cfg, RLModels(policy=policy, value=None, reference=None), env_prompts, out, {},
                                0, run, True, layout) for out in (by_env, by_agent)]  # fmt: skip
    compared = 0
    for field in dataclasses.fields(rollouts[0]):
        a, b = getattr(rollouts[0], field.name), getattr(rollouts[1], field.name)
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), field.name
            compared += 1
    assert compared >= 4 and rollouts[0].mask.sum() == sum(sum(m) for m in by_env.loss_masks)


def compact_call(expression: str) -> str:
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(call, separators=(',', ':'))}</tool_call>"


def test_resent_history_keeps_the_sampled_ids(tiny_models, tokenizer):
    """The model writes its call in compact JSON; the agent re-sends it as `tool_calls`, which the template renders
    with spaces: the episode keeps the sampled ids and trains every turn."""
    scripts = [[compact_call("12*34"), "400", compact_call("21*2"), "42"], ["408", compact_call("40+2")], ["42"]]
    cfg = config(tiny_models, "--environment", f"agent:{AGENT}:run")
    _, out = play(cfg, tokenizer, scripts)
    episode = out.episodes[0]
    sampled = list(tokenizer(compact_call("12*34"), add_special_tokens=False)["input_ids"])
    first = episode.turns[0]
    assert episode.response_ids[first.policy_start : first.policy_end] == sampled
    assert [len(e.turns) for e in out.episodes] == [2, 1, 3, 1]
    assert all(e.truncations["untrained_turns"] == 0 for e in out.episodes)
    # what a re-render of the same history gives instead: the template's spaced JSON, other ids
    history = [{"role": "user", "content": "12*34="}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12*34"}}}]}]  # fmt: skip
    rendered = tokenizer.apply_chat_template(history, tokenize=False)
    assert compact_call("12*34") not in rendered and '"name": "calculator"' in rendered


def test_bad_agent_spec_is_refused_naming_it():
    from open_instruct.environments import environment_class

    with pytest.raises(ConfigError, match="must be an async function"):
        environment_class(f"agent:{AGENT}:not_async")
    with pytest.raises(ConfigError, match="has no function 'missing'"):
        environment_class(f"agent:{AGENT}:missing")


def test_a_plain_run_does_not_import_the_gateway():
    code = ("import sys; from open_instruct import rollouts, environments, episodes, integrations; "
            "integrations.find('tool'); print('open_instruct.agent_gateway' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_agent_trains_end_to_end_and_resumes_bit_exactly_after_a_sigkill_mid_episode(tiny_models, tmp_path):
    """rlvr_ppo.py with `--environment agent:...` on the tiny model: two turns per episode (the agent's tool turn
    between), no untrained turn. SIGKILLed while an agent of rollout 2 waits inside its tool turn and resumed with
    --resume_from_checkpoint auto, the run's metrics rows and final weights equal the uninterrupted run's exactly
    (the rollout in flight is played again from the same seeds, its agents run again)."""
    from safetensors.torch import load_file
    from test_multiturn_rlvr import RECIPE, REPO, read_rows
    from training_helpers import run_script, script_env

    data = tmp_path / "rl.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"{a}*7="}],
                                          "ground_truth": str(7 * a), "dataset": "arithmetic"})
                              for a in range(10, 30)) + "\n")  # fmt: skip
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text("".join(data.read_text().splitlines(keepends=True)[:4]))

    def argv(out, *extra):
        return [os.path.join(REPO, "open_instruct", "rlvr_ppo.py"), RECIPE, "--environment",
                f"agent:{AGENT}:always_calls", "--model_name_or_path", tiny_models["causal_lm"],
                "--dataset_name_or_path", str(data), "--eval_dataset_name_or_path", str(held_out),
                "--output_dir", str(out), "--total_episodes", "16", "--local_rollout_batch_size", "4",
                "--num_samples_per_prompt", "2", "--per_device_train_batch_size", "8", "--response_length", "40",
                "--max_turn_tokens", "8", "--checkpointing_steps", "1", "--eval_steps", "100", *extra]  # fmt: skip

    ref, out = tmp_path / "reference", tmp_path / "crashed"
    run_script(argv(ref))
    train = [r for r in read_rows(ref) if "loss/policy" in r]
    assert [r["rollout_step"] for r in train] == [1, 2]
    assert all(r["train/turns_per_episode"] == 2.0 for r in train)
    assert all(r.get("train/truncated_untrained_turns", 0.0) == 0.0 for r in train)
    gate = str(tmp_path / "gate")
    # agents: 4 in the step-0 evaluation, 8 in rollout 1 (4 prompts x 2): the 13th is rollout 2's first
    env = {**script_env(), "MT_GATE": gate, "MT_GATE_AT": "13"}
    kill_inside_tool_turn(argv(out), env, gate, out)  # the agent signals it waits inside its tool turn
    run_script(argv(out, "--resume_from_checkpoint", "auto"))

    def comparable(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]

    assert comparable(read_rows(out)) == comparable(read_rows(ref))
    a, b = load_file(ref / "final_model" / "model.safetensors"), load_file(out / "final_model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_agent_that_hangs_stops_the_run_at_the_environment_deadline(tiny_models, tokenizer):
    cfg = config(tiny_models, "--environment", f"agent:{AGENT}:hangs", "--environment_timeout", "0.5")
    with pytest.raises(ConfigError, match=r"agent .*hangs.*: no episode asked the model or ended within 0.5 s"):
        play(cfg, tokenizer, [["1", "2", "3", "4"]])
