"""Tiny models and a character-level chat tokenizer, built locally (no hub access).

Tests, the demo and the benchmarks save these to a folder and load them by path like any hub model:

    python -m demo.tiny /tmp/tiny            # writes /tmp/tiny/{causal_lm,seq_cls}
"""

from __future__ import annotations

import argparse
import os
import string
from typing import Any

# Tool calls render Hermes-style, as Qwen templates do and as environments.ToolEnvironment parses them: an assistant
# message's OpenAI-style `tool_calls` become `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` after its
# content (json.dumps' separators, so a call the model writes as text and the same call given as `tool_calls` are the
# same tokens); a `tool` message is an ordinary turn. `tools=` schemas are not rendered (the demos' prompts are the
# same with and without tools: only whether a call is run differs).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% if message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "{% set f = call['function'] if call['function'] is defined else call %}"
    "{{ '<tool_call>' + {'name': f['name'], 'arguments': f['arguments']} | tojson + '</tool_call>' }}"
    "{% endfor %}{% endif %}"
    "{{ '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]


def build_tokenizer() -> Any:
    """Character-level tokenizer over printable ASCII, with role markers as single tokens and a chat template.

    `<|end|>` is both the end-of-turn marker and EOS, so generation stops where the chat template ends a turn."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars + ["<unk>"])}
    # One token per character, newlines included: a BPE without merges splits text into characters and looks each
    # up (the ids of a WordLevel model behind a one-character Split pre-tokenizer, which tiny models saved before
    # use, at ~3x the speed); Fuse makes decode join characters without spaces.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<|end|>",
        bos_token=None,
        unk_token="<unk>",
        additional_special_tokens=SPECIAL_TOKENS[2:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "right"
    return fast


def tiny_llama_config(vocab_size: int, hidden_size: int = 64, num_layers: int = 2, **overrides: Any) -> Any:
    from transformers import LlamaConfig

    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def save_tiny_models(out_dir: str, hidden_size: int = 64, num_layers: int = 2, seed: int = 0) -> dict[str, str]:
    """Write a causal LM and a sequence-classification model (num_labels=1) sharing one tokenizer.

    Returns {"causal_lm": path, "seq_cls": path}. The same seed gives the same weights."""
    import torch
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    tokenizer = build_tokenizer()
    config = tiny_llama_config(len(tokenizer), hidden_size, num_layers)
    paths = {}
    for name, cls, extra in [
        ("causal_lm", LlamaForCausalLM, {}),
        ("seq_cls", LlamaForSequenceClassification, {"num_labels": 1}),
    ]:
        torch.manual_seed(seed)
        cfg = tiny_llama_config(len(tokenizer), hidden_size, num_layers, **extra)
        model = cls(cfg)
        path = os.path.join(out_dir, name)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[name] = path
    del config
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description="Build tiny local models and tokenizer.")
    parser.add_argument("out_dir")
    parser.add_argument("--hidden_size", type=int, default=64)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for name, path in save_tiny_models(args.out_dir, args.hidden_size, args.num_layers, args.seed).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
