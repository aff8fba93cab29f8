"""Named chat templates for `--chat_template`, and the one function that turns the option's value into Jinja.

    --chat_template tulu                 # a name below
    --chat_template templates/mine.jinja # a Jinja file
    --chat_template "{% for m in messages %}..."   # Jinja text, as before

A name that is neither one of NAMED_TEMPLATES nor an existing file, and holds no Jinja tags, is refused (exit 2)
with the list of names, instead of being rendered as literal text. Every template here is prefix-stable (a
conversation's prefix renders as a prefix of the whole conversation, the generation prompt included), which
SFT's assistant-only labels and the preference prompt length rely on. This module imports nothing heavy.
"""

from __future__ import annotations

import os
from typing import Optional

from open_instruct.errors import ConfigError

# Tulu 2/3 (open-instruct's `tulu`): role headers on their own line, EOS after each assistant reply.
TULU = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<|system|>\n' + message['content'] + '\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + '\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\n' + message['content'] + eos_token + '\n' }}"
    "{% else %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

# ChatML (Qwen, SmolLM, OpenHermes): <|im_start|>role ... <|im_end|>.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Zephyr: <|role|> headers, every turn closed by the EOS token.
ZEPHYR = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

# Llama 3 style: BOS once, header tokens around the role, <|eot_id|> after each turn (content trimmed, as Meta's).
LLAMA3 = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

NAMED_TEMPLATES: dict[str, str] = {"tulu": TULU, "chatml": CHATML, "zephyr": ZEPHYR, "llama-3": LLAMA3}
NAME_ALIASES = {"llama3": "llama-3", "llama_3": "llama-3"}


def resolve_chat_template(value: Optional[str]) -> Optional[str]:
    """The Jinja text `--chat_template value` stands for: a name in NAMED_TEMPLATES, a path to a Jinja file, or
    Jinja text itself (it holds `{{` or `{%`). None/empty: None (the tokenizer's own). ConfigError for anything
    else, listing the names."""
    if not value:
        return None
    name = NAME_ALIASES.get(value.strip().lower(), value.strip().lower())
    if name in NAMED_TEMPLATES:
        return NAMED_TEMPLATES[name]
    if "{{" in value or "{%" in value:
        return value
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if "{{" not in text and "{%" not in text:
            raise ConfigError(f"chat_template file {value!r} holds no Jinja tags ({{{{ }}}} or {{% %}})")
        return text
    raise ConfigError(
        f"chat_template {value!r} is not a template name ({', '.join(NAMED_TEMPLATES)}), not an existing Jinja "
        "file, and holds no Jinja tags; give one of the names, a path to a .jinja file, or the Jinja text"
    )
