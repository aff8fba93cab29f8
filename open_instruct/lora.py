"""LoRA through peft: adapters on the trained model, the adapter-disabled model as the reference, merged weights.

With `use_lora`, every script wraps its trained model right after it loads (before accelerate.prepare):
`apply_lora(model, cfg, "CAUSAL_LM")` for a policy, `"SEQ_CLS"` for a reward or value model (the `score` head is
then a peft `modules_to_save` copy, fully trained). Base weights are frozen, so the optimizer (which only takes
parameters with requires_grad) holds Adam state for the adapters (and head) only.

Names: peft puts the HF model under `base_model.model.`, an adapted linear's weight under `<module>.base_layer.weight`
with its factors in `<module>.lora_A.default.weight` [r, in] and `<module>.lora_B.default.weight` [out, r], and a
trained head under `score.modules_to_save.default.*` (its frozen original in `score.original_module.*`). An adapted
embedding keeps its factors in `<module>.lora_embedding_A.default` [r, vocab] and `.lora_embedding_B.default`
[dim, r] (no `.weight`), and a GPT-2 Conv1D stores its weight [in, out] (peft's `fan_in_fan_out`).
`merged_tensors` maps these back to the base names with what peft's merge_and_unload computes: W + B @ A * scaling
for a linear, W + (B @ A)^T * scaling for a Conv1D and an embedding. It is used for merged final/best models and
exports (checkpoint.save_hf_model, export.py) and for the weights streamed to vLLM (vllm_generator.hf_weights).
Checkpoints keep the peft model's own state dict (base + adapters), so resume is exact.

An adapted input embedding tied to the output head: peft's forward adapts the lookup only (the head keeps W), while
a merged model with tied embeddings can hold one matrix: the merged save takes peft's merge (both W'; peft warns
about adapters on tied layers), the vLLM stream (lm_head untied there) sends the head W, as the trainer computes.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Collection, Iterator, Mapping

import torch

from open_instruct.distributed import unwrap_model

PEFT_PREFIX = "base_model.model."
ADAPTER = "default"


def apply_lora(model: Any, cfg: Any, task_type: str, dropout: bool = True) -> Any:
    """The model with LoRA adapters (a peft model) when cfg.use_lora, else the model unchanged.

    task_type: "CAUSAL_LM" (policy) or "SEQ_CLS" (reward/value model: peft keeps its `score` head trainable).
    dropout=False: no dropout on the adapters either (DPO and RL, whose log-probs must be reproducible)."""
    if not cfg.use_lora:
        return model
    from peft import get_peft_model

    # peft up to 0.21 reads transformers' deprecated alias `model.is_gradient_checkpointing` in PeftModel.__init__
    # (to decide whether to make the inputs require grads; 0.22 no longer does), and transformers 5 warns on every
    # read ("deprecated ... Use `is_activation_checkpointing`"). The value read is the right one and there is nothing
    # for a user to change, so that one FutureWarning, from this one call, is not shown.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return get_peft_model(model, lora_config(cfg, task_type, dropout))


def lora_config(cfg: Any, task_type: str, dropout: bool = True) -> Any:
    """The peft LoraConfig of a run (apply_lora; preflight tries it on the model's skeleton before loading)."""
    from peft import LoraConfig

    return LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout if dropout else 0.0,
        target_modules=list(cfg.lora_target_modules) if cfg.lora_target_modules else "all-linear",
        task_type=task_type,
    )


def is_peft(model: Any) -> bool:
    return hasattr(unwrap_model(model), "peft_config") and hasattr(unwrap_model(model), "get_base_model")


def adapter_disabled(model: Any) -> Any:
    """Context: the forward of the model without its LoRA deltas (the initial weights: the frozen reference of DPO and
    RL, with no second copy in memory). A no-op for a model without adapters (e.g. a separate reference model)."""
    return unwrap_model(model).disable_adapter() if is_peft(model) else contextlib.nullcontext()


def plain_model(model: Any) -> Any:
    """The HF model inside a peft model (its adapted linears still hold the adapters), else the model itself."""
    model = unwrap_model(model)
    return model.get_base_model() if is_peft(model) else model


def scalings(model: Any) -> dict[str, float]:
    """Raw module name (as in the peft model's state dict) -> alpha / r of each adapted layer."""
    return {
        name: float(module.scaling[ADAPTER])
        for name, module in unwrap_model(model).named_modules()
        if isinstance(getattr(module, "scaling", None), dict) and ADAPTER in module.scaling
    }


def fan_in_fan_out_layers(model: Any) -> set[str]:
    """Raw module names of the adapted layers whose weight is stored [in, out] (peft's fan_in_fan_out, set for
    GPT-2's Conv1D): their update B @ A is transposed before it is added."""
    return {
        name
        for name, module in unwrap_model(model).named_modules()
        if getattr(module, "fan_in_fan_out", False) and isinstance(getattr(module, "scaling", None), dict)
    }


def base_name(name: str) -> str:
    """The plain HF name of a peft parameter name."""
    name = name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")
    return name.replace(f".modules_to_save.{ADAPTER}.", ".")


def is_base_tensor(name: str) -> bool:
    """Whether a peft parameter name is a weight of the plain model: not a LoRA factor and not the frozen original
    of a trained head (a plain model's names are all base tensors)."""
    return not any(part in name for part in (".lora_A.", ".lora_B.", ".lora_embedding_", ".original_module."))


def adapter_tensors(
    tensors: Mapping[str, torch.Tensor], full: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name in peft's saved adapter, whole tensor) of every LoRA factor of a peft model's parameters: the adapter
    name dropped, as `save_pretrained` writes them (`...q_proj.lora_A.weight`), for an engine that loads adapters
    (vLLM's LoRA). `full` as in merged_tensors (called in the same order on every rank)."""
    for key, value in tensors.items():
        if ".lora_A." in key or ".lora_B." in key or ".lora_embedding_" in key:
            yield key.replace(f".{ADAPTER}", ""), full(value)


def write_adapter(model: Any, tensors: Mapping[str, torch.Tensor], folder: str) -> int:
    """Write a peft adapter folder (adapter_config.json + adapter_model.safetensors, what PeftModel.from_pretrained
    and vLLM's LoRARequest load) from adapter_tensors' pairs; the bytes of the tensors written."""
    from safetensors.torch import save_file

    unwrap_model(model).peft_config[ADAPTER].save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in tensors.items()}, f"{folder}/adapter_model.safetensors")
    return sum(t.numel() * t.element_size() for t in tensors.values())


def merged_tensors(
    tensors: Mapping[str, torch.Tensor],
    scaling: Mapping[str, float],
    full: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    transposed: Collection[str] = frozenset(),
) -> Iterator[tuple[str, torch.Tensor]]:
    """(plain HF name, merged tensor) for every tensor of a peft model's state dict or named parameters, in order.

    linear:                       W' = W + (B @ A) * scaling
    Conv1D (module in transposed,  W' = W + (B @ A)^T * scaling      (W stored [in, out]: fan_in_fan_out_layers)
    and every embedding):                                            (embedding: A [r, vocab], B [dim, r])

    computed in float64, rounded once to W's dtype; LoRA factors and the frozen originals of trained heads are left
    out. `full` turns a (sharded) value into the whole tensor; it is called in the same order on every rank (it may
    be a collective)."""
    for key, value in tensors.items():
        if not is_base_tensor(key):
            continue
        value = full(value)
        module, _, leaf = key.rpartition(".base_layer.")
        factors, transpose = (f"{module}.lora_A.{ADAPTER}.weight", f"{module}.lora_B.{ADAPTER}.weight"), False
        if f"{module}.lora_embedding_A.{ADAPTER}" in tensors:
            factors, transpose = (f"{module}.lora_embedding_A.{ADAPTER}", f"{module}.lora_embedding_B.{ADAPTER}"), True
        if leaf == "weight" and factors[0] in tensors:
            a, b = full(tensors[factors[0]]).double(), full(tensors[factors[1]]).double()
            delta = (b @ a).T if transpose or module in transposed else b @ a
            value = (value.double() + delta * scaling[module]).to(value.dtype)
        yield base_name(key), value


def merged_state_dict(model: Any, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain HF state dict of a peft model with its adapters merged in (from its full state dict). With tied
    input/output embeddings the output head's entry is the merged input embedding (what a tied model loads)."""
    merged = dict(merged_tensors(state_dict, scalings(model), transposed=fan_in_fan_out_layers(model)))
    tied = tied_embedding_names(model)
    if tied is not None and tied[0] in merged and tied[1] in merged:
        merged[tied[1]] = merged[tied[0]]
    return merged


def tied_embedding_names(model: Any) -> tuple[str, str] | None:
    """(input embedding weight, output head weight) in plain HF names when the model ties them, else None."""
    hf = plain_model(model)
    if not getattr(getattr(hf, "config", None), "tie_word_embeddings", False):
        return None
    get_in, get_out = getattr(hf, "get_input_embeddings", None), getattr(hf, "get_output_embeddings", None)
    inputs, outputs = get_in() if get_in else None, get_out() if get_out else None
    if inputs is None or outputs is None:
        return None
    names = {id(module): name for name, module in hf.named_modules()}
    if id(inputs) not in names or id(outputs) not in names:
        return None
    return f"{names[id(inputs)]}.weight", f"{names[id(outputs)]}.weight"


def count_trainable(model: Any) -> tuple[int, int]:
    """(trainable parameters, all parameters)."""
    params = list(unwrap_model(model).parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
