"""Checks of a run's inputs that need no model, no torch and no tokenizer: model folders (config.json, weights
present and not truncated, the GGUF file, a trained reward head), tokenizer files, dataset files and mixture sources,
the chat template's syntax, the attention kernel's package, the output folder, and RL's custom reward functions
(imported and their signature checked: the user's code may import what it likes). `runtime.start_checks` runs them with
the first rows of the data, the reward-function probe and the memory check, for a real start (before the output folder
is claimed) and for --dry_run alike, so a bad path fails with exit 2 naming it in seconds, not after the weights have
loaded. Hub names (not local paths) pass here
and are checked by their loaders. Two checks import torch, and only when they apply: LoRA target names (use_lora),
tried on the model's skeleton built from its config on the meta device (no weights), and flash_attention_2's CUDA."""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import struct
from typing import Any, Optional

from open_instruct import integrations
from open_instruct.chat_templates import resolve_chat_template
from open_instruct.errors import ConfigError

DATASET_EXTENSIONS = (".jsonl", ".json", ".parquet", ".csv")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def looks_local(name_or_path: str) -> bool:
    """A path rather than a hub name (`name` or `org/name`): starts with . / ~, has two or more separators, or
    exists."""
    return (
        name_or_path.startswith((".", "/", "~"))
        or name_or_path.strip("/").count("/") >= 2
        or os.path.exists(name_or_path)
    )


def _listing(folder: str) -> str:
    names = sorted(os.listdir(folder))
    return ", ".join(names[:8]) + (f", ... ({len(names)} entries)" if len(names) > 8 else "") if names else "nothing"


def safetensors_keys(path: str) -> list[str]:
    """Tensor names of a .safetensors file, from its JSON header; ConfigError if the file is cut short."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConfigError(f"weights file {path} is truncated ({size} bytes)")
        (header_len,) = struct.unpack("<Q", head)
        if 8 + header_len > size:
            raise ConfigError(f"weights file {path} is truncated ({size} bytes, header says {8 + header_len}+)")
        try:
            header = json.loads(f.read(header_len))
        except ValueError:
            raise ConfigError(f"weights file {path} has an unreadable header (not a safetensors file?)") from None
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    end = max((v["data_offsets"][1] for v in tensors.values()), default=0)
    if 8 + header_len + end != size:
        raise ConfigError(f"weights file {path} is truncated: {size} bytes, its header needs {8 + header_len + end}")
    return list(tensors)


def weight_files(folder: str) -> list[str]:
    """The weight files a folder's model loads from (shards listed in an index, or the single file)."""
    for index in WEIGHT_INDEXES:
        path = os.path.join(folder, index)
        if os.path.isfile(path):
            with open(path) as f:
                shards = sorted(set(json.load(f).get("weight_map", {}).values()))
            missing = [s for s in shards if not os.path.isfile(os.path.join(folder, s))]
            if missing:
                raise ConfigError(f"model folder {folder}: {index} lists missing weight files {missing}")
            return [os.path.join(folder, s) for s in shards]
    return [os.path.join(folder, name) for name in WEIGHT_FILES if os.path.isfile(os.path.join(folder, name))]


def check_model_folder(name_or_path: str, key: str, gguf_file: Optional[str] = None) -> None:
    """A local model folder must exist and hold config.json and complete weights (or the named GGUF file)."""
    if not looks_local(name_or_path):
        return  # a hub name: its loader reports what is wrong
    path = os.path.expanduser(name_or_path)
    if not os.path.exists(path):
        raise ConfigError(f"{key} {name_or_path!r} does not exist")
    if not os.path.isdir(path):
        raise ConfigError(f"{key} {name_or_path!r} is a file, not a model folder")
    if gguf_file:
        if not os.path.isfile(os.path.join(path, gguf_file)):
            raise ConfigError(f"gguf_file {gguf_file!r} is not in {key} {name_or_path!r} (it holds: {_listing(path)})")
        return
    if not os.path.isfile(os.path.join(path, "config.json")):
        what = "is empty" if not os.listdir(path) else f"has no config.json (it holds: {_listing(path)})"
        raise ConfigError(f"{key} {name_or_path!r} {what}: not a Hugging Face model folder")
    weights = weight_files(path)
    if not weights:
        raise ConfigError(f"{key} {name_or_path!r} has config.json but no weights ({' or '.join(WEIGHT_FILES)})")
    for file in weights:
        if file.endswith(".safetensors"):
            safetensors_keys(file)


def check_trained_score_head(name_or_path: str, key: str) -> None:
    """A reward model used for scoring must be a sequence classifier whose `score` head was trained and saved: a
    causal LM folder (e.g. an SFT model) would get a freshly initialised random head, and its 'rewards' would be
    noise."""
    if not looks_local(name_or_path) or not os.path.isdir(name_or_path):
        return
    with open(os.path.join(name_or_path, "config.json")) as f:
        architectures = json.load(f).get("architectures") or []
    keys = [k for file in weight_files(name_or_path) if file.endswith(".safetensors") for k in safetensors_keys(file)]
    has_head = any(k == "score.weight" or k.endswith(".score.weight") for k in keys)
    if not any("ForSequenceClassification" in a for a in architectures) or (keys and not has_head):
        raise ConfigError(
            f"{key} {name_or_path!r} is not a trained reward model (architectures {architectures}, "
            f"{'a' if has_head else 'no'} score.weight in its weights): its score head would be randomly initialised. "
            "Train one with reward_model.py and pass its final_model/"
        )


_NOT_A_LANGUAGE_MODEL = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")


def check_trained_lm_head(name_or_path: str, key: str) -> None:
    """A model that generates or scores tokens (the policy, a distillation teacher) must have a trained language-model
    head: a sequence classifier (a reward model) has a `score` head instead, transformers would initialise `lm_head`
    at random, and the run would sample from / distil toward noise. Read from config.json and the weights' names
    (safetensors headers) before anything loads: an `lm_head` weight, or output embeddings tied to the input ones."""
    if not looks_local(name_or_path) or not os.path.isfile(os.path.join(name_or_path, "config.json")):
        return
    with open(os.path.join(name_or_path, "config.json")) as f:
        config = json.load(f)
    architectures = config.get("architectures") or []
    keys = [k for file in weight_files(name_or_path) if file.endswith(".safetensors") for k in safetensors_keys(file)]
    has_head = any(k == "lm_head.weight" or k.endswith(".lm_head.weight") for k in keys)
    tied = config.get("tie_word_embeddings", True) and not any(k.split(".")[0] == "score" for k in keys)
    classifier = [a for a in architectures if a.endswith(_NOT_A_LANGUAGE_MODEL)]
    if classifier or (keys and not has_head and not tied):
        raise ConfigError(
            f"{key} {name_or_path!r} has no trained language-model head (architectures {architectures}, "
            f"{'an' if has_head else 'no'} lm_head.weight in its weights): its output layer would be randomly "
            "initialised. Give a causal language model (a ...ForCausalLM checkpoint, e.g. an SFT final_model/)"
        )


def check_dataset(name_or_path: Optional[str], key: str) -> None:
    """Each comma-separated part: a local file with a known extension that exists, or a hub name."""
    if not name_or_path:
        return
    for part in integrations.expand_sources(name_or_path):
        integration = integrations.find(part)
        if integration is not None:  # an integration's source: its package and settings checked now, by it
            integration.check(part, key)
            continue
        if os.path.isdir(part):
            continue  # a local dataset folder (datasets.load_dataset reads it)
        extension = os.path.splitext(part)[1]
        if os.path.isfile(part) and extension not in DATASET_EXTENSIONS:
            raise ConfigError(
                f"{key} {part!r}: unknown file type {extension or '(no extension)'!r}; "
                f"use {', '.join(DATASET_EXTENSIONS)}"
            )
        if not os.path.exists(part) and (extension in DATASET_EXTENSIONS or looks_local(part)):
            raise ConfigError(f"{key}: dataset file {part!r} does not exist")
        close = difflib.get_close_matches(extension, DATASET_EXTENSIONS, n=1, cutoff=0.6) if extension else []
        if not os.path.exists(part) and close:  # `train.jsnol`: a misspelt local file, not a hub dataset
            raise ConfigError(
                f"{key}: dataset file {part!r} does not exist (and {extension!r} is no known type; did you mean "
                f"{close[0]!r}?)"
            )


def probe_writable(folder: str, key: str) -> None:
    """Write and delete a small file in `folder` (created if missing); ConfigError saying plainly why not."""
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, f".write_probe_{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok" * 512)
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"{key} {folder!r} is not writable: {e.strerror or e}") from None


def check_output_dir_writable(output_dir: str) -> None:
    """The output folder, and its checkpoints/ folder when one exists (a read-only checkpoints/ would otherwise
    only fail at the first save)."""
    probe_writable(output_dir, "output_dir")
    checkpoints = os.path.join(output_dir, "checkpoints")
    if os.path.isdir(checkpoints):
        probe_writable(checkpoints, "checkpoints folder")


def check_played_by_an_environment(cfg: Any) -> None:
    """An integration's rows that only its environment scores (Source.needs_environment) need that environment."""
    if getattr(cfg, "environment", None):
        return
    sources = [s for key in ("dataset_name_or_path", "eval_dataset_name_or_path") if getattr(cfg, key, None)
               for s in integrations.expand_sources(getattr(cfg, key))]  # fmt: skip
    sources += [str(s) for key in ("dataset_mixer_list", "eval_dataset_mixer_list") for s in (getattr(cfg, key) or [])]
    for source in sources:
        integration = integrations.find(source)
        if integration is not None and integration.needs_environment:
            raise ConfigError(
                f"a {integration.prefix}: dataset is played by its environment: add --environment "
                f"{integration.prefix}:<the same>"
            )


def check_chat_template(template: Optional[str]) -> None:
    """A given chat template (a name, a Jinja file or Jinja text: chat_templates.resolve_chat_template) must at
    least be valid Jinja (the tokenizer compiles it only at the first use)."""
    template = resolve_chat_template(template)
    if not template:
        return
    import jinja2

    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"chat_template is not a valid Jinja template: {e.message} (line {e.lineno})") from None


TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt")  # or a sentencepiece/tiktoken *.model, *.tiktoken


def check_tokenizer_folder(folder: str, key: str) -> None:
    """A local folder the tokenizer loads from must hold its vocabulary (AutoTokenizer's own error for one that does
    not blames a missing sentencepiece package)."""
    names = os.listdir(folder)
    if not any(n in TOKENIZER_FILES or n.endswith((".model", ".tiktoken")) for n in names):
        raise ConfigError(
            f"{key} {folder!r} holds no tokenizer files ({', '.join(TOKENIZER_FILES)} or a sentencepiece *.model; it "
            f"holds: {_listing(folder)}): point tokenizer_name_or_path at the folder of the model's tokenizer"
        )


def check_attention_kernel(kernel: Optional[str]) -> None:
    """flash_attention_2 needs the flash-attn package, importable (a build for another torch/CUDA fails on import)
    and a CUDA device: transformers' errors for these come after the model load."""
    if kernel != "flash_attention_2":
        return
    if importlib.util.find_spec("flash_attn") is None:
        raise ConfigError(
            "attn_implementation flash_attention_2 needs the flash-attn package, which is not installed (CUDA only: "
            "pip install flash-attn --no-build-isolation); or use sdpa / sdpa_varlen"
        )
    try:
        importlib.import_module("flash_attn")
    except (ImportError, OSError) as e:
        raise ConfigError(
            f"attn_implementation flash_attention_2: the flash-attn package does not import ({e}); reinstall it for "
            "this torch and CUDA, or use sdpa / sdpa_varlen"
        ) from None
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("attn_implementation flash_attention_2 runs on CUDA GPUs only; this process sees none")


def lora_models(cfg: Any) -> list[tuple[str, str, Optional[str], str]]:
    """(key, path, gguf_file, peft task type) of each model the script gives LoRA adapters: the policy, or the
    reward model being trained; with PPO also the value model (lora.apply_lora in each script)."""
    if cfg.script == "reward_model":
        return [("model_name_or_path", cfg.model_name_or_path, cfg.gguf_file, "SEQ_CLS")]
    models = [("model_name_or_path", cfg.model_name_or_path, cfg.gguf_file, "CAUSAL_LM")]
    if getattr(cfg, "uses_value_model", False):
        if cfg.value_model_path:
            models.append(("value_model_path", cfg.value_model_path, None, "SEQ_CLS"))
        else:
            models.append(("model_name_or_path (value model)", cfg.model_name_or_path, cfg.gguf_file, "SEQ_CLS"))
    return models


def check_lora_targets(cfg: Any) -> None:
    """With use_lora: each lora_target_modules name must name a layer LoRA adapts in a model that gets adapters, and
    peft must accept the config on each of them. Tried on skeletons built from the models' configs on the meta
    device (no weights read). peft alone fails only after the load, and only when no name matches at all (a misspelt
    name next to a right one is skipped silently); a scalar head (`score`) is trained in full, not adapted."""
    if not cfg.use_lora:
        return
    import torch
    from accelerate import init_empty_weights
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
    )
    from transformers.pytorch_utils import Conv1D

    from open_instruct.lora import lora_config

    classes = {"CAUSAL_LM": AutoModelForCausalLM, "SEQ_CLS": AutoModelForSequenceClassification}
    mappings = {"CAUSAL_LM": MODEL_FOR_CAUSAL_LM_MAPPING, "SEQ_CLS": MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING}
    heads = {"SEQ_CLS": ("score", "classifier")}  # peft keeps them as modules_to_save (fully trained)
    layers: set[str] = set()  # leaf names of the layers LoRA can adapt, over every adapted model
    skeletons = []
    for key, path, gguf_file, task in lora_models(cfg):
        kwargs = {"trust_remote_code": cfg.trust_remote_code, **({"gguf_file": gguf_file} if gguf_file else {})}
        try:
            config = AutoConfig.from_pretrained(path, **kwargs, **({"num_labels": 1} if task == "SEQ_CLS" else {}))
        except (OSError, ValueError, KeyError) as e:
            if looks_local(path):
                raise ConfigError(f"{key} {path!r}: its config.json does not read as a model config ({e})") from None
            continue  # a hub model not reachable from here: its loader reports
        with init_empty_weights():  # the model class itself for transformers' own models, else the Auto class
            if type(config) in mappings[task]:
                skeleton = mappings[task][type(config)](config)
            else:
                skeleton = classes[task].from_config(config, trust_remote_code=cfg.trust_remote_code)
        skeletons.append((key, path, task, skeleton))
    hits: dict[str, set[bool]] = {t: set() for t in cfg.lora_target_modules or []}  # per name: is each hit a head
    for key, path, task, skeleton in skeletons:
        for name, module in skeleton.named_modules():
            leaf = name.rpartition(".")[2]
            is_head = leaf in heads.get(task, ())
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding, Conv1D)) and not is_head:
                layers.add(leaf)
            for target in hits:
                if name == target or name.endswith(f".{target}"):  # peft's rule for a list of names
                    hits[target].add(is_head)
    for target, found in hits.items():
        if False not in found:
            close = difflib.get_close_matches(target, sorted(layers), n=1, cutoff=0.6)
            why = (
                "is the scalar head, which is trained in full (LoRA does not adapt it)"
                if found
                else "names no layer of " + ", ".join(f"{k} {p!r}" for k, p, _, _ in skeletons)
            )
            raise ConfigError(
                f"lora_target_modules {target!r} {why}{f'; did you mean {close[0]!r}?' if close else ''} (layers "
                f"LoRA can adapt: {', '.join(sorted(layers))})"
            )
    for key, path, task, skeleton in skeletons:
        try:
            get_peft_model(skeleton, lora_config(cfg, task), low_cpu_mem_usage=True)
        except ValueError as e:  # peft's NoMatchingPeftModuleError, an unsupported layer type
            raise ConfigError(f"lora_target_modules {cfg.lora_target_modules} on {key} {path!r}: {e}") from None


def check_inputs(cfg: Any) -> None:
    """Every model and dataset path of the config (see the module docstring)."""
    check_model_folder(cfg.model_name_or_path, "model_name_or_path", cfg.gguf_file)
    if cfg.tokenizer_name_or_path and looks_local(cfg.tokenizer_name_or_path):
        if not os.path.isdir(cfg.tokenizer_name_or_path):
            raise ConfigError(f"tokenizer_name_or_path {cfg.tokenizer_name_or_path!r} is not a folder")
    if not cfg.gguf_file:  # a GGUF file carries its tokenizer
        key = "tokenizer_name_or_path" if cfg.tokenizer_name_or_path else "model_name_or_path"
        folder = cfg.tokenizer_name_or_path or cfg.model_name_or_path
        if looks_local(folder) and os.path.isdir(folder):
            check_tokenizer_folder(folder, key)
    if cfg.script != "reward_model" and not cfg.gguf_file:  # the others generate or score tokens with it
        check_trained_lm_head(cfg.model_name_or_path, "model_name_or_path")
    for key, teacher in cfg.loaded_teacher_settings() if hasattr(cfg, "loaded_teacher_settings") else ():
        check_model_folder(teacher, key)
        check_trained_lm_head(teacher, key)
    for key in ("value_model_path", "reward_model_path"):
        if getattr(cfg, key, None):
            check_model_folder(getattr(cfg, key), key)
    if getattr(cfg, "reward_model_path", None):
        check_trained_score_head(cfg.reward_model_path, "reward_model_path")
    check_dataset(cfg.dataset_name_or_path, "dataset_name_or_path")
    check_dataset(cfg.eval_dataset_name_or_path, "eval_dataset_name_or_path")
    check_dataset(getattr(cfg, "ptx_dataset", None), "ptx_dataset")  # RL: PPO-ptx's demonstrations
    for key in ("dataset_mixer_list", "eval_dataset_mixer_list"):  # every source: the same checks as one dataset
        for source in (getattr(cfg, key) or [])[0::2]:
            check_dataset(str(source), key)
    check_chat_template(cfg.chat_template)
    check_attention_kernel(cfg.attention_kernel)
    check_lora_targets(cfg)
    check_played_by_an_environment(cfg)
    if getattr(cfg, "environment", None):  # RL multi-turn: import the environment (a user file too) now
        from open_instruct.environments import check_environment_config

        check_environment_config(cfg.environment, cfg.tools, cfg.tool_call_format)
    if getattr(cfg, "reward_functions", None):  # RL: import each one and check its signature now, not mid-run
        from open_instruct.rewards import load_reward_function, run_hooks

        for spec in cfg.reward_functions:
            load_reward_function(spec)
        for hook in run_hooks(cfg.reward_functions):  # e.g. a model served by engines the run starts: its needs
            hook.check_run(cfg)
