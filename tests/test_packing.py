"""Padding-free packing (`max_tokens_per_micro_batch`): sequences concatenated into one row per device, positions
restarting at 0, no attention across sequence boundaries.

What is proved, on sequences of very different lengths (3 to 60 tokens) and tiny Llama models built here (fp32):
- the attention path: on CPU transformers' sdpa and eager both give a block-diagonal causal mask from the restarting
  position ids (each packed sequence's logits equal its logits alone); a neighbour changed in the row moves nothing
  else, while the same row with masking broken (a KV cache, or an explicit all-ones mask) does move: the test can fail;
- packed and padded batches give the same per-sequence log-probs, losses and gradients for SFT, the reward model
  (scores pooled at each sequence's last non-pad token, pad == eos too), DPO, and the RL forwards (policy log-probs,
  values, reward-model scores, with and without the spare column after_last_token uses);
- the knob is checked before any model loads (exit 2, naming the parameter and the numbers) and the planner shows it;
- every script run end to end with the knob on logs the padded run's numbers (within float rounding), and a 2-process
  FSDP2 run, whose ranks pack into different numbers of micro-batches, matches one process.
"""

from __future__ import annotations

import glob
import json
import os
import random

import pytest
import torch
from tolerances import backward_atol, forward_atol, gamma, run_rtol
from training_helpers import one_torch_thread, recipe_inputs  # noqa: F401  (autouse fixture)

from demo.tiny import tiny_llama_config
from open_instruct import data, models

pytestmark = pytest.mark.numerics  # every test here compares numbers computed two ways

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 100
PAD, EOS = 0, 1
LENGTHS = [3, 60, 17, 5, 42, 9, 28, 3]  # very different lengths: most of a padded batch would be padding


def causal_lm(attn: str = "sdpa") -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(VOCAB, attn_implementation=attn))


def classifier(pad_id: int = PAD) -> torch.nn.Module:
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(1)
    model = LlamaForSequenceClassification(tiny_llama_config(VOCAB, num_labels=1))
    model.config.pad_token_id = pad_id
    return model


def tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(5, VOCAB) for _ in range(n)]


def gradients(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(largest absolute difference over all gradient entries, largest gradient entry)."""
    assert a.keys() == b.keys() and a
    return max((a[k] - b[k]).abs().max().item() for k in a), max(a[k].abs().max().item() for k in a)


def logit_atol(model: torch.nn.Module, batch: dict) -> float:
    """forward_atol of the model's logits (or scores) on a padded batch: the bound for computing them another way."""
    with torch.no_grad():
        out = model(**models.forward_inputs(batch), use_cache=False).logits
    return forward_atol(model, batch["input_ids"].shape[1], out)


def both(collate, *args) -> tuple[dict, dict]:
    """The same examples collated padded and packed."""
    return collate(*args, packed=False), collate(*args, packed=True)


# ---------------------------------------------------------------------------------------------------------------------
# Packing itself


def test_pack_by_token_budget_holds_every_item_once_within_the_budget():
    rng = random.Random(0)
    lengths = [rng.randint(3, 60) for _ in range(200)]
    packs = data.pack_by_token_budget(lengths, 128)
    assert sorted(i for p in packs for i in p) == list(range(200))
    assert max(sum(lengths[i] for i in p) for p in packs) <= 128
    lower_bound = -(-sum(lengths) // 128)
    print(f"200 items, {sum(lengths)} tokens, budget 128: {len(packs)} packs (at least {lower_bound} needed)")
    assert len(packs) <= lower_bound + 2  # best-fit decreasing wastes little
    assert packs == data.pack_by_token_budget(lengths, 128)  # deterministic
    assert data.micro_batches(list("abcde"), 2) == [["a", "b"], ["c", "d"], ["e"]]  # off: rows
    assert data.micro_batches(list("abcde"), 2, [5, 1, 4, 2, 3], 6) == [["a", "b"], ["c", "d"], ["e"]]
    with pytest.raises(ValueError, match="item 1 has 61 tokens, more than the token budget 60"):
        data.pack_by_token_budget([3, 61], 60)


def test_packed_row_layout():
    batch = data.collate_sft(
        [{"input_ids": [7, 8, 9], "labels": [-100, 8, 9]}, {"input_ids": [5, 6], "labels": [5, 6]}], PAD, True
    )
    assert batch["input_ids"].tolist() == [[7, 8, 9, 5, 6]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert batch["sequence_ids"].tolist() == [[0, 0, 0, 1, 1]]
    assert batch["labels"].tolist() == [[-100, 8, 9, -100, 6]]  # a sequence's first token is never a target
    assert "attention_mask" not in batch and data.batch_tokens(batch) == 5 and data.batch_sequences(batch) == 2
    episodes = data.collate_episodes([[7, 8], [5]], [[9], [6, 4, 1]], PAD, 1, packed=True)
    assert episodes["input_ids"].tolist() == [[7, 8, 9, 5, 6, 4, 1]]
    # column j: the position before response token j (the episode's last token repeats past its end)
    assert episodes["window_index"].tolist() == [[1, 2, 2, 2, 2], [3, 4, 5, 6, 6]]
    assert episodes["responses"].tolist() == [[9, 0, 0, 0], [6, 4, 1, 0]]
    assert episodes["mask"].tolist() == [[1, 0, 0, 0], [1, 1, 1, 0]]


# ---------------------------------------------------------------------------------------------------------------------
# The attention path: block-diagonal causal masking, proved


def packed_logits(model: torch.nn.Module, seqs: list[list[int]], **kwargs) -> list[torch.Tensor]:
    batch = data.packed_row(seqs)
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], **kwargs).logits[0]
    return list(torch.split(out, [len(s) for s in seqs]))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_sequences_do_not_attend_to_each_other(attn):
    rng = random.Random(2)
    model = causal_lm(attn).eval()
    seqs = [tokens(n, rng) for n in LENGTHS]
    with torch.no_grad():
        alone = [model(input_ids=torch.tensor([s]), use_cache=False).logits[0] for s in seqs]
    packed = packed_logits(model, seqs, use_cache=False)
    gap = max((a - p).abs().max().item() for a, p in zip(alone, packed))
    bound = max(forward_atol(model, len(s), a) for s, a in zip(seqs, alone))
    print(f"{attn}: packed vs alone, max |logit diff| {gap:.2e} (bound {bound:.2e})")
    assert gap <= bound

    # The neighbour test: change sequence 3 only; every other sequence's logits stay put, sequence 3's move.
    changed = [list(s) for s in seqs]
    changed[3] = tokens(len(seqs[3]), random.Random(99))
    after = packed_logits(model, changed, use_cache=False)
    others = max((packed[i] - after[i]).abs().max().item() for i in range(len(seqs)) if i != 3)
    assert others == 0.0, others  # masked-out keys add exactly 0
    assert (packed[3] - after[3]).abs().max().item() > 100 * bound

    # The same test with masking broken fails: a KV cache (transformers' default) or an explicit all-ones mask
    # turns the packed-sequence detection off, and the sequences after the changed one move.
    for broken in ({"use_cache": True}, {"attention_mask": torch.ones(1, sum(LENGTHS), dtype=torch.long)}):
        before, moved = packed_logits(model, seqs, **broken), packed_logits(model, changed, **broken)
        leak = max((before[i] - moved[i]).abs().max().item() for i in range(4, len(seqs)))
        print(f"{attn}, masking broken by {list(broken)}: the neighbours move by {leak:.2e}")
        assert leak > 100 * bound


# ---------------------------------------------------------------------------------------------------------------------
# Packed == padded: per-sequence numbers, losses and gradients


def sft_examples(rng: random.Random) -> list[dict]:
    out = []
    for n in LENGTHS:
        ids = tokens(n, rng)
        prompt = rng.randint(1, n - 1)  # the first `prompt` tokens are not trained
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def test_sft_packed_equals_padded():
    from open_instruct.sft import token_loss_sum

    model = causal_lm()
    padded, packed = both(data.collate_sft, sft_examples(random.Random(3)), PAD)
    assert packed["input_ids"].numel() == sum(LENGTHS) < padded["input_ids"].numel() == 60 * len(LENGTHS)
    with torch.no_grad():
        rows_pad, count_pad = token_loss_sum(model, padded, per_row=True)
        rows_pack, count_pack = token_loss_sum(model, packed, per_row=True)
    assert count_pack.tolist() == count_pad.tolist()
    row_gap = (rows_pack - rows_pad).abs().max().item()
    losses = {}
    grads = {}
    for name, batch in (("padded", padded), ("packed", packed)):
        loss_sum, count = token_loss_sum(model, batch)
        losses[name] = (loss_sum / count).item()
        grads[name] = gradients(model, loss_sum / count)
    gap, scale = max_diff(grads["padded"], grads["packed"])
    # A token's loss moves by at most twice its logits' bound (log_softmax); a row adds up to L of them, the mean N.
    token_bound = 2 * logit_atol(model, padded)
    longest, n = max(LENGTHS), count_pad.sum().item()
    row_bound = longest * token_bound + 2 * gamma(longest) * rows_pad.max().item()
    loss_bound = token_bound + 2 * gamma(n) * losses["padded"]
    grad_bound = backward_atol(model, longest, sum(LENGTHS), grads["padded"])
    print(f"SFT: per-sequence loss sums {row_gap:.2e} (bound {row_bound:.2e}), loss {losses} (bound {loss_bound:.2e}), "
          f"gradients {gap:.2e} (bound {grad_bound:.2e}, largest {scale:.2e})")  # fmt: skip
    assert row_gap <= row_bound and abs(losses["packed"] - losses["padded"]) <= loss_bound
    assert gap <= grad_bound


def pairs(rng: random.Random) -> list[dict]:
    out = []
    for a, b in zip(LENGTHS, reversed(LENGTHS)):
        prompt_len = rng.randint(1, min(a, b) - 1) if min(a, b) > 1 else 1
        prompt = tokens(prompt_len, rng)
        chosen, rejected = prompt + tokens(a - prompt_len, rng), prompt + tokens(max(b - prompt_len, 1), rng)
        out.append({"chosen_ids": chosen, "rejected_ids": rejected, "prompt_len": prompt_len, "margin": 0.5})
    return out


@pytest.mark.parametrize("pad_id", [PAD, EOS], ids=["pad", "pad_is_eos"])
def test_reward_model_packed_equals_padded(pad_id):
    """Each sequence's score is read where HF's classifier reads a padded row: the last non-pad token. With pad ==
    eos (a tokenizer without a pad token) a trailing EOS is skipped: some sequences here end with it."""
    from open_instruct.reward_model import bradley_terry

    model = classifier(pad_id)
    examples = pairs(random.Random(4))
    for e in examples[::2]:
        e["chosen_ids"] = e["chosen_ids"] + [EOS]
    padded, packed = both(data.collate_preferences, examples, pad_id)
    scores, grads = {}, {}
    for name, batch in (("padded", padded), ("packed", packed)):
        chosen, rejected = models.pair_rewards(model, batch)
        scores[name] = torch.cat([chosen, rejected]).detach()
        grads[name] = gradients(model, bradley_terry(chosen, rejected, batch["margin"]).mean())
    if pad_id == EOS:  # the trailing EOS is skipped: the score is the one of the sequence without it
        with torch.no_grad():
            alone = model(input_ids=torch.tensor([examples[0]["chosen_ids"][:-1]])).logits[0, 0]
    bound = logit_atol(model, padded)  # a score is the head's output at one position: the forward's bound
    if pad_id == EOS:
        assert abs(scores["packed"][0].item() - alone.item()) <= bound
    gap = (scores["packed"] - scores["padded"]).abs().max().item()
    grad_gap, scale = max_diff(grads["padded"], grads["packed"])
    grad_bound = backward_atol(model, padded["input_ids"].shape[1], packed["input_ids"].numel(), grads["padded"])
    print(f"RM (pad id {pad_id}): scores {gap:.2e} (bound {bound:.2e}), gradients {grad_gap:.2e} "
          f"(bound {grad_bound:.2e}, largest {scale:.2e})")  # fmt: skip
    assert gap <= bound and grad_gap <= grad_bound


def test_dpo_packed_equals_padded():
    from open_instruct.config import DPOConfig
    from open_instruct.dpo import preference_loss

    model = causal_lm()
    examples = pairs(random.Random(5))
    padded, packed = both(data.collate_preferences, examples, PAD)
    n = len(examples)
    ref = models.PairLogps(-30 * torch.rand(n), -30 * torch.rand(n), torch.ones(n), torch.ones(n))
    cfg = DPOConfig(model_name_or_path="m", dataset_name_or_path="d.jsonl", loss_type="dpo", beta=0.1)
    logps, losses, grads = {}, {}, {}
    for name, batch in (("padded", padded), ("packed", packed)):
        policy = models.pair_logps(model, batch)
        loss = preference_loss(cfg, policy, ref._replace(chosen_tokens=policy.chosen_tokens))[0].mean()
        logps[name] = torch.cat([policy.chosen, policy.rejected]).detach()
        counts = torch.cat([policy.chosen_tokens, policy.rejected_tokens])
        losses[name], grads[name] = loss.item(), gradients(model, loss)
    assert counts.tolist() == [len(e["chosen_ids"]) - e["prompt_len"] for e in examples] + [
        len(e["rejected_ids"]) - e["prompt_len"] for e in examples
    ]
    gap = (logps["packed"] - logps["padded"]).abs().max().item()
    grad_gap, scale = max_diff(grads["padded"], grads["packed"])
    # A summed log-prob: up to `longest` tokens, each within twice the logits' bound, added up in another order.
    longest = padded["input_ids"].shape[1]
    logp_bound = longest * 2 * logit_atol(model, padded) + 2 * gamma(longest) * logps["padded"].abs().max().item()
    # The loss: -log sigmoid(beta * margin) is 1-Lipschitz in beta * margin (two sums: 2 * beta * logp_bound per pair)
    loss_bound = 2 * cfg.beta * logp_bound + 2 * gamma(n) * losses["padded"]
    grad_bound = backward_atol(model, longest, packed["input_ids"].numel(), grads["padded"])
    print(f"DPO: summed log-probs {gap:.2e} (bound {logp_bound:.2e}), loss {losses} (bound {loss_bound:.2e}), "
          f"gradients {grad_gap:.2e} (bound {grad_bound:.2e}, largest {scale:.2e})")  # fmt: skip
    assert gap <= logp_bound and abs(losses["packed"] - losses["padded"]) <= loss_bound
    assert grad_gap <= grad_bound


@pytest.mark.parametrize("extra", [0, 1], ids=["last_token", "after_last_token"])
def test_rl_forwards_packed_equal_padded(extra):
    """Policy log-probs (at a sampling temperature), values and reward-model scores of collate_episodes batches,
    and the gradients of a loss over policy log-probs and values."""
    from open_instruct.models import TokenValueModel, response_logits, sequence_scores, token_logprobs, token_values

    rng = random.Random(6)
    prompts = [tokens(rng.randint(2, 30), rng) for _ in LENGTHS]
    responses = [tokens(max(n // 2, 1), rng) + ([EOS] if i % 2 else []) for i, n in enumerate(LENGTHS)]
    policy, value, reward = causal_lm(), TokenValueModel(classifier()), TokenValueModel(classifier(EOS)).eval()
    out = {}
    for packed in (False, True):
        batch = data.collate_episodes(prompts, responses, PAD, extra, packed=packed)
        mask = batch["mask"]
        logits = response_logits(policy, batch, 0.7)
        logit_scale = logits.abs().max().item()
        logp = token_logprobs(logits, batch["responses"]) * mask
        values = token_values(value, batch)
        value_mask = mask.clone()  # the values also hold the state after the last token (after_last_token)
        value_mask[torch.arange(len(mask)), mask.sum(1).long().clamp(max=mask.shape[1] - 1)] = 1.0
        with torch.no_grad():
            scores = sequence_scores(reward, batch)
        loss = logp.sum() / mask.sum() + (values * value_mask).pow(2).sum() / value_mask.sum()
        both_models = torch.nn.ModuleDict({"policy": policy, "value": value})
        grads = gradients(both_models, loss)
        out[packed] = (logp.detach(), (values * value_mask).detach(), scores, loss.item(), grads)
    names = ("log-probs", "values", "RM scores", "loss")
    gaps = {
        n: (torch.as_tensor(out[True][i]) - torch.as_tensor(out[False][i])).abs().max().item()
        for i, n in enumerate(names)
    }
    grad_gap, scale = max_diff(out[False][4], out[True][4])
    # Log-probs: twice the logits' bound; values and scores: the forward's bound on their own magnitudes; the loss:
    # two means of those; gradients: backward_atol over both models.
    width = batch["input_ids"].shape[1]
    bounds = {
        "log-probs": 2 * forward_atol(policy, width, torch.tensor(logit_scale)),
        "values": forward_atol(value, width, out[False][1]),
        "RM scores": forward_atol(reward, width, out[False][2]),
    }
    bounds["loss"] = max(bounds.values()) + 4 * gamma(int(batch["mask"].numel())) * abs(out[False][3])
    grad_bound = backward_atol(policy, width, int(batch["input_ids"].numel()), out[False][4])
    print(f"RL (extra column {extra}): {gaps} (bounds {bounds}), gradients {grad_gap:.2e} (bound {grad_bound:.2e}, "
          f"largest {scale:.2e})")  # fmt: skip
    assert all(gaps[n] <= bounds[n] for n in names) and grad_gap <= grad_bound


# ---------------------------------------------------------------------------------------------------------------------
# The knob: checked before anything loads, shown by the planner


@pytest.mark.parametrize(
    "script, extra, longest",
    [
        ("sft", ["--max_seq_length", "64"], "max_seq_length 64 = 64 tokens"),
        ("reward_model", ["--max_seq_length", "64"], "2 x max_seq_length 64 = 128 tokens"),
        ("dpo", ["--max_seq_length", "64"], "2 x max_seq_length 64 = 128 tokens"),
        (
            "rlvr_ppo",
            ["--max_prompt_length", "50", "--response_length", "14", "--total_episodes", "64"],
            "max_prompt_length 50 + response_length 14 = 64 tokens",
        ),
    ],
)
def test_a_budget_below_the_longest_sequence_stops_before_loading(script, extra, longest, tmp_path, capsys):
    """Exit 2 with the parameter and the numbers; the model path does not exist, so nothing was loaded."""
    import importlib

    module = importlib.import_module(f"open_instruct.{script}")
    args = ["--model_name_or_path", str(tmp_path / "no_model"), "--dataset_name_or_path", str(tmp_path / "d.jsonl")]
    with pytest.raises(SystemExit) as stop:
        module.main([*args, "--output_dir", str(tmp_path / "out"), "--max_tokens_per_micro_batch", "40", *extra])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "max_tokens_per_micro_batch 40 is smaller than" in err and longest in err, err
    with pytest.raises(SystemExit) as stop:
        module.main([*args, "--output_dir", str(tmp_path / "out"), "--max_tokens_per_micro_batch", "-5", *extra])
    assert (
        stop.value.code == 2
        and "max_tokens_per_micro_batch must be a positive integer, got -5" in capsys.readouterr().err
    )


def test_the_planner_shows_the_knob(capsys):
    from open_instruct import plan

    recipe = os.path.join(REPO, "configs", "sft_8b.yaml")
    assert (
        plan.main([recipe, "--num_processes", "8", "--num_examples", "1000", "--max_tokens_per_micro_batch", "16384"])
        == 0
    )
    packed = capsys.readouterr().out
    assert plan.main([recipe, "--num_processes", "8", "--num_examples", "1000"]) == 0
    padded = capsys.readouterr().out
    assert "max_tokens_per_micro_batch" in packed and "16,384" in packed
    assert "max_tokens_per_micro_batch" in padded and "off" in padded
    assert (
        plan.main(
            [
                recipe,
                "--num_processes",
                "8",
                "--num_examples",
                "1000",
                "--max_tokens_per_micro_batch",
                "16384",
                "--json",
            ]
        )
        == 0
    )
    as_json = json.loads(capsys.readouterr().out)
    # sft_8b: 16 samples per device per update, max_seq_length 4096 at --fill 0.5 -> 16 x 2048 tokens = 2 packed rows
    assert as_json["max_tokens_per_micro_batch"] == 16384 and as_json["micro_batches_per_update"] == 2


# ---------------------------------------------------------------------------------------------------------------------
# End to end: every script with the knob on logs what the padded run logs


@pytest.fixture(scope="module")
def varied(tmp_path_factory):
    """Chats, preference pairs and RL prompts of very different lengths (character tokenizer: 1 token a character)."""
    from demo import synthetic

    rng = random.Random(0)
    root = tmp_path_factory.mktemp("packing_data")

    def text(lo: int, hi: int) -> str:
        return "".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randint(lo, hi))).strip() or "x"

    def chat(n: int) -> list[dict]:
        return [
            {"messages": [{"role": "user", "content": text(1, 50)}, {"role": "assistant", "content": text(1, 30)}]}
            for _ in range(n)
        ]

    def prefs(n: int) -> list[dict]:
        return [
            {"prompt": text(1, 30), "chosen": "yes " + text(0, 20), "rejected": "no " + text(0, 20)} for _ in range(n)
        ]

    rl = synthetic.rl_rows(48, 0)
    for row in rl:  # prompts of different lengths: a filler sentence of 0 to 40 characters before the question
        row["messages"][-1]["content"] = text(0, 40) + " " + row["messages"][-1]["content"]
    files = {"sft": chat(48), "sft_eval": chat(16), "pref": prefs(48), "pref_eval": prefs(16), "rl": rl}
    files["rl_eval"] = synthetic.rl_rows(8, 1)
    return {name: synthetic.write_jsonl(str(root / f"{name}.jsonl"), rows) for name, rows in files.items()}


def run_both(module, args: list[str], budget: int, tmp_path, monkeypatch) -> tuple[list[dict], list[dict]]:
    """The script's metrics rows padded and packed (same recipe otherwise). Prints the [rows, width] of every batch
    the run collated (training, eval, reference and scoring forwards): packed runs have one row, no padding."""
    from training_helpers import read_metrics

    from open_instruct import runtime

    rows = []
    for name, knob in (("padded", []), ("packed", ["--max_tokens_per_micro_batch", str(budget)])):
        shapes = []
        for collate in ("collate_sft", "collate_preferences", "collate_episodes"):
            original = getattr(data, collate)

            def recorded(*a, _original=original, **kw):
                batch = _original(*a, **kw)
                shapes.append(tuple(batch["input_ids"].shape))
                return batch

            monkeypatch.setattr(data, collate, recorded)
        out = tmp_path / name / "out"  # DPO: each run its own reference cache (<output_dir>/ref_cache)
        runtime.run(module.main, [*args, "--output_dir", str(out), *knob])
        monkeypatch.undo()
        slots = sum(r * w for r, w in shapes)
        print(f"{module.__name__} {name}: {len(shapes)} batches, {slots} token slots, widest {max(shapes)}")
        assert all(r == 1 and w <= budget for r, w in shapes) if knob else all(r > 1 for r, _ in shapes[:1])
        rows.append(read_metrics(str(out)))
    return rows[0], rows[1]


def tiny_run_rtol(seq_len: int, tokens: int, steps: int) -> float:
    """tolerances.run_rtol for the tiny models (demo/tiny.py) trained `steps` optimizer steps on micro-batches of
    `tokens` token slots at most `seq_len` wide."""
    return run_rtol(tiny_llama_config(VOCAB), seq_len, tokens, steps)


def compare(padded: list[dict], packed: list[dict], keys: tuple[str, ...], having: str | None = None) -> list[float]:
    """Largest relative difference of each row over `keys` (absolute below 0.01, where a relative difference of a
    value near 0 means nothing: these logged numbers are sums of terms of size ~0.01 and more; rows aligned, keys in
    both). `having`: only the rows that log that key (e.g. the train rows)."""
    if having is not None:
        padded, packed = [r for r in padded if having in r], [r for r in packed if having in r]
    assert len(padded) == len(packed) and padded
    out = []
    for a, b in zip(padded, packed):
        assert {k: a[k] for k in ("episode", "optimizer_step", "rollout_step")} == {
            k: b[k] for k in ("episode", "optimizer_step", "rollout_step")
        }
        present = [k for k in keys if k in a]
        assert present and all(k in b for k in present)
        out.append(max(abs(a[k] - b[k]) / max(abs(a[k]), 1e-2) for k in present))  # near-0 values: absolute
    return out


# The end-to-end runs: 6 steps of 4 x 2 rows, a row every step and an eval every 3, nothing saved.
SIX_STEPS = ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--logging_steps", "1"]
SIX_STEPS += ["--per_device_eval_batch_size", "8", "--eval_steps", "3", "--checkpointing_steps", "100"]
SIX_STEPS += ["--save_final_model", "false"]


def assert_six_steps_within_bounds(train: list[float], evals: list[float], seq_len: int) -> None:
    """Step 1's loss is from the untrained model: one forward; then each step adds its bound (run_rtol)."""
    first, bound = tiny_run_rtol(seq_len, 4 * seq_len, 0), tiny_run_rtol(seq_len, 4 * seq_len, 6)
    print(f"bounds: step 1 {first:.2e}, 6 steps {bound:.2e}")
    assert len(train) == 6 and train[0] <= first and max(train) <= bound and max(evals) <= bound


def test_sft_end_to_end_packed_matches_padded(tiny_models, varied, tmp_path, monkeypatch):
    from open_instruct import sft

    args = [
        *recipe_inputs("sft_tiny.yaml", tiny_models["causal_lm"], varied["sft"], varied["sft_eval"]),
        "--max_seq_length", "96", "--learning_rate", "3e-3", *SIX_STEPS,
    ]  # fmt: skip
    padded, packed = run_both(sft, args, 160, tmp_path, monkeypatch)
    train = compare(padded, packed, ("train/loss",), having="train/loss")
    evals = compare(padded, packed, ("eval/loss",), having="eval/loss")
    print(f"SFT, 6 steps: train/loss relative differences {train}, eval/loss {evals}")
    assert [r["train/tokens_trained"] for r in padded if "train/loss" in r] == [
        r["train/tokens_trained"] for r in packed if "train/loss" in r
    ]
    assert_six_steps_within_bounds(train, evals, 96)


def test_reward_model_end_to_end_packed_matches_padded(tiny_models, varied, tmp_path, monkeypatch):
    from open_instruct import reward_model

    args = [
        *recipe_inputs("rm_tiny.yaml", tiny_models["seq_cls"], varied["pref"], varied["pref_eval"]),
        "--max_seq_length", "64", "--learning_rate", "2e-3", "--warmup_ratio", "0", *SIX_STEPS,
    ]  # fmt: skip
    padded, packed = run_both(reward_model, args, 160, tmp_path, monkeypatch)
    keys = ("train/loss", "train/chosen_reward", "train/rejected_reward", "train/accuracy")
    train = compare(padded, packed, keys, having="train/loss")
    evals = compare(padded, packed, ("eval/loss", "eval/chosen_reward", "eval/accuracy"), having="eval/loss")
    print(f"RM, 6 steps: train relative differences {train}, eval {evals}")
    assert_six_steps_within_bounds(train, evals, 64)


def test_dpo_end_to_end_packed_matches_padded(tiny_models, varied, tmp_path, monkeypatch):
    """The reference pass is packed too: both runs compute their own cache (separate folders), and the caches agree."""
    from safetensors.torch import load_file

    from open_instruct import dpo

    args = [
        *recipe_inputs("dpo_tiny.yaml", tiny_models["causal_lm"], varied["pref"], varied["pref_eval"]),
        "--max_seq_length", "64", "--learning_rate", "1e-3", "--warmup_ratio", "0", *SIX_STEPS,
        "--string_rows", "chat_template",  # the string pairs in chat form, as this test's tolerances were set on
    ]  # fmt: skip
    padded, packed = run_both(dpo, args, 160, tmp_path, monkeypatch)
    caches = [glob.glob(str(tmp_path / name / "out" / "ref_cache" / "*.safetensors")) for name in ("padded", "packed")]
    assert [len(c) for c in caches] == [1, 1]  # computed by each run (the same key: the numbers agree)
    tables = [load_file(c[0]) for c in caches]
    ref_gap = max((tables[0][k] - tables[1][k]).abs().max().item() for k in tables[0] if "logps" in k)
    # A cached log-prob is a sum of up to 64 tokens' log-probs: relative to its size, one forward's bound (run_rtol
    # with no step) per token plus the sum's own rounding.
    ref_scale = max(tables[0][k].abs().max().item() for k in tables[0] if "logps" in k)
    ref_bound = (tiny_run_rtol(64, 4 * 64, 0) + 2 * gamma(64)) * ref_scale
    print(f"DPO reference cache, packed pass vs padded pass: max |log-prob diff| {ref_gap:.2e} (bound {ref_bound:.2e})")
    assert ref_gap <= ref_bound
    keys = ("train/loss", "train/logps/chosen", "train/logps/rejected", "train/rewards/margin")
    train = compare(padded, packed, keys, having="train/loss")
    evals = compare(padded, packed, ("eval/loss", "eval/logps/chosen"), having="eval/loss")
    print(f"DPO, 6 steps: train relative differences {train}, eval {evals}")
    # Step 1: policy == reference, so the margin is the difference of log-prob sums near -90 that were added up in
    # another order (one fp32 ulp there is 8e-6): a margin near 0 is compared against the 0.01 floor.
    bound = tiny_run_rtol(64, 4 * 64, 6)
    print(f"bound {bound:.2e}")
    assert len(train) == 6 and max(train) <= bound and max(evals) <= bound


RL_VARIANTS = {
    # PPO: policy, frozen reference (KL in the reward), value model (a spare column: after_last_token) and a frozen
    # reward model added to the score; GRPO: policy and reference (KL as a loss term, k3).
    "ppo": ["--algo", "ppo", "--score_placement", "after_last_token", "--reward_model_multiplier", "0.5"],
    "grpo": ["--algo", "grpo", "--kl_estimator", "k3", "--beta", "0.05"],
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(RL_VARIANTS))
def test_rlvr_end_to_end_packed_matches_padded(variant, tiny_models, varied, tmp_path, monkeypatch):
    from open_instruct import rlvr_ppo

    args = [
        *recipe_inputs("rlvr_tiny.yaml", tiny_models["causal_lm"], varied["rl"], varied["rl_eval"]),
        "--reward_model_path", tiny_models["seq_cls"], "--max_prompt_length", "110", "--response_length", "10",
        "--total_episodes", "64", "--local_rollout_batch_size", "8", "--num_samples_per_prompt", "4",
        "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2", "--num_epochs", "2",
        "--eval_steps", "100", "--checkpointing_steps", "100", "--save_final_model", "false",
        "--num_samples_logged", "0", *RL_VARIANTS[variant],
    ]  # fmt: skip
    padded, packed = run_both(rlvr_ppo, args, 200, tmp_path, monkeypatch)
    keys = (
        "train/score_mean", "train/rm_score_mean", "train/kl", "loss/policy", "loss/value", "loss/kl",
        "train/approx_kl", "train/entropy", "train/grad_norm", "train/value_grad_norm", "clipfrac/policy",
    )  # fmt: skip
    train = compare(padded, packed, keys, having="loss/policy")
    print(f"RLVR {variant}, 2 rollouts x 4 optimizer steps: relative differences {train}")
    same = [r["train/response_length"] for r in padded if "loss/policy" in r]
    assert same == [r["train/response_length"] for r in packed if "loss/policy" in r]  # the same completions
    # 2 rollouts x (2 epochs x 2 mini-batches) optimizer steps; responses of 10 tokens after prompts up to 110.
    bound = tiny_run_rtol(120, 8 * 120, 8)
    print(f"bound {bound:.2e}")
    assert len(train) == 2 and max(train) <= bound


# ---------------------------------------------------------------------------------------------------------------------
# Several processes: ranks pack into different numbers of micro-batches and run dummies to keep FSDP in step


def micro_batch_counts(train_file: str, tokenizer_dir: str, budget: int, steps: int) -> list[list[int]]:
    """Per optimizer step, the packed micro-batches each of 2 ranks builds (what sft.py does with global batch 8)."""
    from open_instruct.config import SFTConfig
    from open_instruct.models import load_tokenizer

    cfg = SFTConfig(model_name_or_path="m", dataset_name_or_path=train_file, max_seq_length=96)
    train, _ = data.tokenize_sft(data.load_rows(train_file), load_tokenizer(tokenizer_dir), cfg)
    stream = data.episode_stream(train, SFTConfig(model_name_or_path="m", dataset_name_or_path=train_file, seed=5))
    counts = []
    for step in range(steps):
        idx = stream.take(step * 8, 8)
        ranks = [[train[i] for i in data.EpisodeStream.local_slice(idx, r, 2)] for r in (0, 1)]
        counts.append([len(data.micro_batches(mb, 4, [data.packed_length(e) for e in mb], budget)) for mb in ranks])
    return counts


@pytest.mark.slow
def test_two_sharded_processes_packed_match_one_process(tiny_models, varied, tmp_path):
    """SFT, the reward model and DPO (its reference pass too) on 2 FSDP2 processes with packing log what one padded
    process logs; the ranks pack into different numbers of micro-batches, so the one with fewer runs dummies (else
    FSDP would hang)."""
    from test_fsdp import command, metrics, run_all, supervised_args

    counts = micro_batch_counts(varied["sft"], tiny_models["causal_lm"], 100, 4)
    print(f"packed micro-batches per step on ranks 0 and 1: {counts}")
    assert any(a != b for a, b in counts)
    runs = {}
    jobs = []
    for script, recipe, model, train, budget in (
        ("sft", "sft_tiny.yaml", tiny_models["causal_lm"], varied["sft"], 100),
        ("reward_model", "rm_tiny.yaml", tiny_models["seq_cls"], varied["pref"], 160),
        ("dpo", "dpo_tiny.yaml", tiny_models["causal_lm"], varied["pref"], 160),
    ):
        held_out = varied["sft_eval" if script == "sft" else "pref_eval"]
        extra = ["--max_seq_length", "96" if script == "sft" else "64", "--save_final_model", "false"]
        extra += ["--eval_dataset_name_or_path", held_out, "--eval_steps", "2", "--per_device_eval_batch_size", "4"]
        for mode, world, knob in (("single", 1, []), ("fsdp", 2, ["--max_tokens_per_micro_batch", str(budget)])):
            out = runs[script, mode] = str(tmp_path / script / mode / "out")  # own reference caches
            args = [os.path.join(REPO, "configs", recipe), *supervised_args(model, train, out, world, extra + knob)]
            cmd, env = command(f"open_instruct/{script}.py", args, mode)
            jobs.append((cmd, env, str(tmp_path / f"{script}_{mode}.log")))
    run_all(jobs)
    for script, keys in (
        ("sft", ("train/loss", "train/grad_norm")),
        ("reward_model", ("train/loss", "train/chosen_reward", "train/grad_norm")),
        ("dpo", ("train/loss", "train/logps/chosen", "train/grad_norm")),
    ):
        single, fsdp = ([r for r in metrics(runs[script, mode]) if "train/loss" in r] for mode in ("single", "fsdp"))
        gaps = compare(single, fsdp, keys)
        evals = [[r for r in metrics(runs[script, mode]) if "eval/loss" in r] for mode in ("single", "fsdp")]
        eval_gaps = compare(*evals, ("eval/loss",))
        print(f"{script}: 1 padded process vs 2 packed FSDP2 processes, relative differences per step {gaps}, "
              f"eval {eval_gaps}")  # fmt: skip
        bound = tiny_run_rtol(96, 4 * 96, 4)
        assert len(gaps) == 4 and max(gaps) <= bound and max(eval_gaps) <= bound, bound


@pytest.mark.slow
def test_rlvr_two_sharded_processes_packed_match_ddp_padded(tiny_models, varied, tmp_path):
    """PPO with every RL forward (policy, reference, value model, reward model; all sharded under FSDP2) packed on 2
    processes logs what 2 padded DDP processes log (same ranks: the same sampled completions)."""
    from test_fsdp import command, metrics, run_all

    base = [
        *recipe_inputs("rlvr_tiny.yaml", tiny_models["causal_lm"], varied["rl"], varied["rl_eval"]),
        "--reward_model_path", tiny_models["seq_cls"], "--reward_model_multiplier", "0.5",
        "--score_placement", "after_last_token", "--max_prompt_length", "110", "--response_length", "10",
        "--total_episodes", "32", "--local_rollout_batch_size", "4", "--num_samples_per_prompt", "2",
        "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--num_epochs", "2",
        "--eval_steps", "100", "--checkpointing_steps", "100", "--save_final_model", "false", "--learning_rate", "1e-3",
    ]  # fmt: skip
    runs, jobs = {}, []
    for mode, knob in (("ddp", []), ("fsdp", ["--max_tokens_per_micro_batch", "160"])):
        runs[mode] = str(tmp_path / mode)
        cmd, env = command("open_instruct/rlvr_ppo.py", [*base, "--output_dir", runs[mode], *knob], mode)
        jobs.append((cmd, env, str(tmp_path / f"{mode}.log")))
    run_all(jobs)
    ddp, fsdp = ([r for r in metrics(runs[m]) if "loss/policy" in r] for m in ("ddp", "fsdp"))
    keys = tuple(k for k, v in ddp[0].items() if isinstance(v, float) and not k.startswith(("perf/", "time/")))
    gaps = compare(ddp, fsdp, keys)
    print(f"RLVR PPO, 2 padded DDP vs 2 packed FSDP2 processes over {len(keys)} logged numbers: {gaps}")
    bound = tiny_run_rtol(120, 4 * 120, 8)
    assert len(gaps) == 2 and len(keys) >= 20 and max(gaps) <= bound, bound


def test_packing_with_lora_and_activation_checkpointing():
    """A LoRA reward model (the head is peft's trained copy, hooked through the wrapper) and an SFT model under
    activation checkpointing give the same numbers packed and padded."""
    from open_instruct.config import RewardModelConfig
    from open_instruct.lora import apply_lora
    from open_instruct.sft import token_loss_sum

    cfg = RewardModelConfig(model_name_or_path="m", dataset_name_or_path="d.jsonl", use_lora=True, lora_rank=4)
    model = apply_lora(classifier(), cfg, "SEQ_CLS")
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B starts at 0: give the adapters an effect
            p.data.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    padded, packed = both(data.collate_preferences, pairs(random.Random(4)), PAD)
    with torch.no_grad():
        with model.disable_adapter():
            base = torch.cat(models.pair_rewards(model, padded))
        lora = [torch.cat(models.pair_rewards(model, batch)) for batch in (padded, packed)]
    width = padded["input_ids"].shape[1]  # the adapters add a rank-4 reduction to each adapted projection
    bound = forward_atol(model, width, lora[0]) + 2 * 4 * gamma(4) * lora[0].abs().max().item()
    assert (lora[0] - base).abs().max().item() > 100 * bound  # the adapters change the scores ...
    assert (lora[1] - lora[0]).abs().max().item() <= bound  # ... and packed reads them like padded

    lm = causal_lm()
    lm.gradient_checkpointing_enable()
    lm.train()
    padded, packed = both(data.collate_sft, sft_examples(random.Random(3)), PAD)
    (loss_a, n_a), (loss_b, n_b) = token_loss_sum(lm, padded), token_loss_sum(lm, packed)
    loss_bound = 2 * logit_atol(lm, padded) + 2 * gamma(int(n_a)) * (loss_a / n_a).item()  # as in test_sft_packed...
    assert n_a == n_b and abs((loss_a / n_a).item() - (loss_b / n_b).item()) <= loss_bound


def test_attn_implementation_reaches_every_loaded_model(tiny_models):
    """--attn_implementation picks the kernel of the models the scripts load (flash_attention_2 on GPU for packing)."""
    from open_instruct.config import SFTConfig

    assert SFTConfig(model_name_or_path="m", dataset_name_or_path="d.jsonl").attn_implementation is None
    lm = models.load_causal_lm(tiny_models["causal_lm"], attn_implementation="eager")
    rm = models.load_sequence_classifier(tiny_models["seq_cls"], attn_implementation="eager")
    default = models.load_causal_lm(tiny_models["causal_lm"])
    assert (lm.config._attn_implementation, rm.config._attn_implementation) == ("eager", "eager")
    assert default.config._attn_implementation == "sdpa"  # transformers' default, on CPU and GPU
