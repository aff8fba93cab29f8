"""Loading models and tokenizers, log-probs from logits, and the optimizer/scheduler every script uses."""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any, NamedTuple, Optional

import torch

from open_instruct import attention
from open_instruct.chat_templates import resolve_chat_template
from open_instruct.data import is_packed
from open_instruct.errors import ConfigError

DTYPES = {"no": torch.float32, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_tokenizer(
    name_or_path: str,
    gguf_file: Optional[str] = None,
    trust_remote_code: bool = False,
    chat_template: Optional[str] = None,
    revision: Optional[str] = None,
) -> Any:
    """Tokenizer with a pad token and a chat template (the given one wins over the tokenizer's own: a name, a Jinja
    file or Jinja text, see chat_templates.resolve_chat_template)."""
    from transformers import AutoTokenizer

    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code, "revision": revision}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
    if chat_template:
        tokenizer.chat_template = resolve_chat_template(chat_template)
    if tokenizer.chat_template is None:
        raise ConfigError(f"tokenizer of {name_or_path!r} has no chat template: set chat_template in the recipe")
    check_template_renders_content(
        tokenizer, "chat_template" if chat_template else f"the chat template of {name_or_path!r}"
    )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def run_tokenizer(cfg: Any) -> Any:
    """The run's tokenizer: tokenizer_name_or_path (else the model's), with the recipe's GGUF file, trust_remote_code
    and chat_template."""
    name = cfg.tokenizer_name_or_path or cfg.model_name_or_path
    return load_tokenizer(name, cfg.gguf_file, cfg.trust_remote_code, cfg.chat_template)


def check_template_renders_content(tokenizer: Any, which: str) -> None:
    """A chat template must put each message's content into the text (one that renders only roles or markup would
    train on template text alone): ConfigError, checked on a user + assistant conversation."""
    import jinja2

    probe = [{"role": "user", "content": "probe-user-71"}, {"role": "assistant", "content": "probe-assistant-71"}]
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False)
    except (jinja2.TemplateError, TypeError, ValueError) as e:
        raise ConfigError(f"{which} fails on a user + assistant conversation: {e}") from None
    missing = [m["role"] for m in probe if m["content"] not in text]
    if missing:
        raise ConfigError(
            f"{which} renders no content of the {' and '.join(missing)} message (a user + assistant conversation "
            f"renders as {text[:200]!r}): fix the template (e.g. {{{{ message['content'] }}}} in its loop)"
        )


def _pretrained_kwargs(
    gguf_file: Optional[str],
    dtype: torch.dtype,
    trust_remote_code: bool,
    revision: Optional[str],
    attn_implementation: Optional[str] = None,
) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": trust_remote_code, "revision": revision}
    if attn_implementation:
        if attn_implementation == attention.NAME:
            attention.register()
        kwargs["attn_implementation"] = attn_implementation
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    else:
        kwargs["use_safetensors"] = None  # prefer safetensors; transformers refuses unsafe pickles by default
    return kwargs


def _drop_gguf(model: torch.nn.Module, cls: Any) -> torch.nn.Module:
    """A GGUF-loaded model cannot be saved: rebuild it from its config (without quantization_config)."""
    config = model.config
    if getattr(config, "quantization_config", None) is None and not hasattr(model, "hf_quantizer"):
        return model
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = cls.from_config(config, dtype=next(model.parameters()).dtype)
    plain.load_state_dict(model.state_dict(), strict=False)
    return plain


def load_causal_lm(
    name_or_path: str,
    dtype: torch.dtype = torch.float32,
    gguf_file: Optional[str] = None,
    trust_remote_code: bool = False,
    revision: Optional[str] = None,
    attn_implementation: Optional[str] = None,
) -> Any:
    """A causal LM whose forward also takes `token_scoring` (add_logprob_head)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        name_or_path, **_pretrained_kwargs(gguf_file, dtype, trust_remote_code, revision, attn_implementation)
    )
    if gguf_file:
        model = _drop_gguf(model, AutoModelForCausalLM)
    return add_logprob_head(model)


def load_policy(cfg: Any) -> Any:
    """The causal LM a script's config names (model_name_or_path, gguf_file, revision, attention kernel), in fp32:
    the master weights every trainer starts from (mixed precision is autocast, never the stored dtype)."""
    return load_causal_lm(
        cfg.model_name_or_path,
        DTYPES["no"],
        cfg.gguf_file,
        cfg.trust_remote_code,
        cfg.model_revision,
        attn_implementation=cfg.attention_kernel,
    )


def hold_frozen_in_compute_dtype(model: Any, mixed_precision: str, sharded: bool) -> Any:
    """A never-trained model (RL's reference policy, a reward model) stored in the dtype its bf16 compute uses, with
    the same numbers as the fp32 copy it replaces (it has no optimizer, so nothing needs fp32 master weights):
    - under FSDP2 (`sharded`) the mixed-precision policy computes every parameter in bf16: all stored in bf16;
    - under autocast (one process, DDP) only matmul weights are computed in bf16: Linear weights stored in bf16, while
      embeddings, norms, tied output embeddings and fp32 scalar heads (`fp32_head`) stay fp32, so its outputs equal
      the fp32 model's bit for bit.
    Only parameters are cast: buffers (rotary inverse frequencies) stay as they are, as for the trained policy.
    Without mixed precision: unchanged (fp32)."""
    if mixed_precision != "bf16":
        return model
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}

    def autocast_matmul(module: torch.nn.Module) -> bool:
        return (
            isinstance(module, torch.nn.Linear)
            and id(module.weight) not in embeddings  # a tied output layer shares the input embedding's tensor
            and getattr(module.forward, "__func__", None) is not _fp32_linear_forward  # fp32 under autocast
        )

    modules = [m for m in model.modules() if sharded or autocast_matmul(m)]
    with torch.no_grad():
        for param in {id(p): p for m in modules for p in m.parameters(recurse=False)}.values():
            param.data = param.data.to(torch.bfloat16)
    return model


# ---------------------------------------------------------------------------------------------------------------------
# Log-probs of chosen tokens straight from the last hidden states: only the scored positions go through the output
# layer, a chunk of tokens at a time, and no [tokens, vocab] logits are kept for the backward (it recomputes them).
# SFT, DPO and the reference pass score a fraction of the positions (not prompts, not padding), RL every response
# position (with the entropy in the update); at a 128k vocabulary the logits of 4k tokens are 2 GB in fp32.
# docs/memory-and-syncs.md describes it.

LOGPROB_CHUNK_TOKENS = 2048  # rows of [chunk, vocab] fp32 logits alive at once (128 MB at a 16k vocabulary)
# Output-layer transforms of some architectures (Gemma 2 soft-capping, Cohere/Granite scaling): models that set one
# keep the plain path (full logits from their own forward).
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier")


class SamplingTruncation(NamedTuple):
    """The sampler's truncation of softmax(logits / temperature), applied in vLLM's order (its v1 Sampler; the hf
    backend applies its warpers in the same order, generation.HFGenerator._warpers): min-p (drop tokens with
    p < min_p * max p), then top-k (keep logits >= the k-th largest), then top-p (sort ascending, drop the tokens whose
    cumulative probability, renormalised after top-k, is <= 1 - top_p; the most likely always stays). Off: top_k 0,
    top_p 1, min_p 0."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def active(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


class TokenScoring(NamedTuple):
    """What the log-prob head scores: at each of `positions` (indices into the forward's last hidden states flattened
    to [batch * seq]), log p(label) of the token in `labels` (same shape) under softmax(logits / temperature), and,
    with `entropy`, the entropy of that distribution. With an active `truncation`, log p(label) is under the
    sampler's truncated distribution, renormalised over the tokens it keeps (truncated_logits); the entropy stays
    the full distribution's."""

    positions: torch.Tensor
    labels: torch.Tensor
    temperature: float = 1.0
    entropy: bool = False
    truncation: Optional[SamplingTruncation] = None


class TokenScores(NamedTuple):
    """The head's output, float32, shaped like TokenScoring.labels (entropy None unless asked for); past_key_values:
    the forward's cache when it was asked for one (use_cache=True)."""

    logp: torch.Tensor
    entropy: Optional[torch.Tensor] = None
    past_key_values: Any = None


def truncation_removes(
    logits: torch.Tensor, truncation: SamplingTruncation, labels: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """[K, V] bool: the tokens the sampler's truncation (SamplingTruncation: min-p, top-k, top-p in that order) drops
    from fp32 logits [K, V] already divided by the temperature, with the ops of vLLM's and transformers' samplers
    (so identical logits give an identical support). `labels` ([K]): those tokens are kept whatever the rule says: a
    sampled token the trainer's logits would drop (a boundary tie or engine rounding) then keeps a finite log-prob
    instead of -inf. All on the device, no host sync; a few [K, V] temporaries, K a chunk of the head."""
    removed = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    z = logits
    if truncation.min_p > 0.0:
        probs = torch.softmax(z, dim=-1)
        removed |= probs < probs.amax(dim=-1, keepdim=True) * truncation.min_p
        z = z.masked_fill(removed, float("-inf"))
    if 0 < truncation.top_k < z.shape[-1]:
        removed |= z < torch.topk(z, truncation.top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(removed, float("-inf"))
    if truncation.top_p < 1.0:
        ordered, order = torch.sort(z, dim=-1, descending=False)
        drop = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - truncation.top_p
        drop[..., -1:] = False  # the most likely token always stays
        removed |= drop.scatter(-1, order, drop)
    if labels is not None:
        removed.scatter_(-1, labels.unsqueeze(-1), False)
    return removed


def truncated_logits(
    logits: torch.Tensor, truncation: Optional[SamplingTruncation], labels: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Logits with -inf where the sampler's truncation drops a token (truncation_removes), so log_softmax of them is
    the log-prob renormalised over the kept support: what a sampler with top-k / top-p / min-p reports for the token
    it drew. Unchanged when `truncation` is None or off. The gradient flows to the kept logits only (the support is
    piecewise constant in the logits)."""
    if truncation is None or not truncation.active:
        return logits
    return logits.masked_fill(truncation_removes(logits, truncation, labels), float("-inf"))


def logp_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, want_entropy: bool, truncation: Optional[SamplingTruncation] = None
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """log p(labels) and (want_entropy) the entropy H = logsumexp(z) - sum(softmax(z) * z) per row of fp32 logits
    [K, V] (already divided by the temperature): the full-logits formulas, which the chunked head applies per chunk.
    An active `truncation`: log p(labels) under the truncated, renormalised distribution (truncated_logits); the
    entropy is the full distribution's."""
    lse = torch.logsumexp(logits, dim=-1)
    if truncation is not None and truncation.active:
        kept = truncated_logits(logits, truncation, labels)
        logp = kept.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(kept, dim=-1)
    else:
        logp = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    return logp, entropy_from_logits(logits, lse) if want_entropy else None


def entropy_from_logits(logits: torch.Tensor, lse: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-position entropy of softmax(logits): H = logsumexp(z) - sum(softmax(z) * z) (lse: logsumexp(z) if known)."""
    logits = logits.float()
    lse = torch.logsumexp(logits, -1) if lse is None else lse
    return lse - (torch.softmax(logits, -1) * logits).sum(-1)


class _ChunkedTokenScores(torch.autograd.Function):
    """log p(label) and the entropy per row of `hidden` [K, d] under the output layer (weight [V, d], bias) and a
    temperature, float32 and shaped like `labels`.

    The matmuls run in `dtype` (bf16 under autocast: the product accumulates in fp32 inside the GEMM), the softmax in
    fp32. Only [chunk, V] logits exist at a time; the forward keeps none, and the backward recomputes each chunk's
    logits z (a checkpoint per chunk) to form, per row with upstream gradients g (log-prob) and e (entropy),
        dL/dz = g * (onehot(label) - p) - e * p * (z - sum(p * z)),    p = softmax(z),
    divided by the temperature for the raw logits: one more output-layer matmul and [chunk, V] memory. With an active
    `truncation` (SamplingTruncation) the log-prob is the truncated distribution's, and its p in g * (onehot - p) is
    the truncated, renormalised one (its support recomputed from the same z); the entropy's stays the full p."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        labels: torch.Tensor,
        dtype: torch.dtype,
        chunk: int,
        temperature: float,
        want_entropy: bool,
        truncation: Optional[SamplingTruncation] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        flat = labels.reshape(-1)
        logp = torch.empty(labels.shape, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(labels.shape if want_entropy else (0,), dtype=torch.float32, device=hidden.device)
        for s in range(0, len(hidden), chunk):
            logits = torch.nn.functional.linear(hidden[s : s + chunk].to(dtype), w, b).float()
            if temperature != 1.0:
                logits = logits / temperature
            lp, ent = logp_and_entropy(logits, flat[s : s + chunk], want_entropy, truncation)
            logp.view(-1)[s : s + chunk] = lp
            if want_entropy:
                entropy.view(-1)[s : s + chunk] = ent
        ctx.save_for_backward(hidden, weight, bias, flat)
        ctx.dtype, ctx.chunk, ctx.temperature, ctx.want_entropy = dtype, chunk, temperature, want_entropy
        ctx.truncation = truncation if truncation is not None and truncation.active else None
        if not want_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logp: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor]
    ) -> tuple[Optional[torch.Tensor], ...]:
        hidden, weight, bias, labels = ctx.saved_tensors
        t = ctx.temperature
        w, b = weight.to(ctx.dtype), None if bias is None else bias.to(ctx.dtype)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_bias = None if bias is None else torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
        g_logp = None if grad_logp is None else grad_logp.reshape(-1).float()
        g_ent = None if grad_entropy is None or not ctx.want_entropy else grad_entropy.reshape(-1).float()
        for s in range(0, len(hidden), ctx.chunk):
            h = hidden[s : s + ctx.chunk].to(ctx.dtype)
            z = torch.nn.functional.linear(h, w, b).float()
            if t != 1.0:
                z = z / t
            # in place: two [chunk, V] fp32 buffers (z, p) and the gradient in ctx.dtype (truncation: a third, p_logp)
            p = torch.softmax(z, dim=-1)
            g_out = None if g_logp is None else g_logp[s : s + ctx.chunk, None]
            p_logp = p  # the distribution the log-prob is of
            if ctx.truncation is not None and g_out is not None:
                p_logp = torch.softmax(truncated_logits(z, ctx.truncation, labels[s : s + ctx.chunk]), dim=-1)
            if g_ent is not None:  # -e * p * (z - E_p[z]); E_p[z] as a batched dot product (no [chunk, V] temporary)
                z.sub_(torch.bmm(p.unsqueeze(1), z.unsqueeze(2)).squeeze(2))
                g = z.mul_(p).mul_(-g_ent[s : s + ctx.chunk, None])
                if g_out is not None:
                    g.sub_(p_logp.mul_(g_out))
            else:
                g = p_logp.mul_(-g_out)
            if g_out is not None:  # + g at the label: g * (onehot - p) in all
                g.scatter_add_(1, labels[s : s + ctx.chunk, None], g_out)
            if t != 1.0:
                g.div_(t)
            g = g.to(ctx.dtype)
            grad_hidden[s : s + ctx.chunk] = g @ w
            grad_weight += (g.t() @ h).float()
            if grad_bias is not None:
                grad_bias += g.float().sum(0)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight.to(weight.dtype), grad_bias, None, None, None, None, None, None


def _plain_linear(head: torch.nn.Module) -> bool:
    """An output layer that is a torch Linear, as is or as FSDP2 wraps it (FSDPLinear: its class derives from
    FSDPModule and Linear). LoRA and other wrappers add to the forward, so they are not."""
    if type(head) is torch.nn.Linear:
        return True
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(head, FSDPModule) and type(head).__bases__[1:] == (torch.nn.Linear,)


def _call_as_forward(module: torch.nn.Module, function: Any, *args: Any) -> Any:
    """Call `function(*args)` as `module`'s forward, so the module's hooks run around it: under FSDP2 the output
    layer is its own unit, whose hooks all-gather its weight once before (not once per chunk), free it after, gather it
    again before the backward and reduce-scatter its gradient. The instance attribute shadows the class's forward
    only for this call (as fp32_head does for good)."""
    previous = module.__dict__.get("forward")
    module.forward = function
    try:
        return module(*args)
    finally:
        if previous is None:
            del module.forward
        else:
            module.forward = previous


def _wrapped_head_scores(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    labels: torch.Tensor,
    temperature: float,
    want_entropy: bool,
    truncation: Optional[SamplingTruncation] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """logp_and_entropy of one chunk through the head's own forward (a LoRA-wrapped head adds its adapter there)."""
    logits = head(hidden).float()
    return logp_and_entropy(logits / temperature if temperature != 1.0 else logits, labels, want_entropy, truncation)


def chunked_token_scores(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    labels: torch.Tensor,
    temperature: float = 1.0,
    entropy: bool = False,
    chunk: Optional[int] = None,
    truncation: Optional[SamplingTruncation] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """log p(labels) and (entropy=True) the entropy, float32 shaped like `labels`, of hidden states [K, d] under the
    output layer `head` and softmax(logits / temperature), [chunk, vocab] logits at a time, forward and backward
    (`truncation`: log p under the sampler's truncated distribution, logp_and_entropy).

    A Linear head (FSDP2's FSDPLinear too) runs _ChunkedTokenScores inside its own module call (_call_as_forward);
    any other head (LoRA's) runs its forward per chunk under activation checkpointing (recomputed in the backward)."""
    device, chunk = hidden.device.type, chunk or LOGPROB_CHUNK_TOKENS
    if _plain_linear(head):

        def scores(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # read inside the module call: under FSDP2, head.weight is the gathered weight only there
            weight, bias = head.weight, head.bias
            dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
            return _ChunkedTokenScores.apply(h, weight, bias, labels, dtype, chunk, temperature, entropy, truncation)

        logp, ent = _call_as_forward(head, scores, hidden)
        return logp, ent if entropy else None
    from torch.utils.checkpoint import checkpoint

    flat, parts = labels.reshape(-1), []
    for s in range(0, len(hidden), chunk):
        args = (hidden[s : s + chunk], head, flat[s : s + chunk], temperature, entropy, truncation)
        parts.append(checkpoint(_wrapped_head_scores, *args, use_reentrant=False))
    # new tensors of labels' shape (cat copies; clone: a view returned by an FSDP root module makes torch warn)
    logp = torch.cat([p[0] for p in parts]).view(labels.shape).clone()
    ent = torch.cat([p[1] for p in parts]).view(labels.shape).clone() if entropy else None
    return logp, ent


def scored_positions(labels: torch.Tensor) -> torch.Tensor:
    """Where labels aligned with input_ids ([B, T], -100 where nothing is scored) are predicted: the flat indices
    b * T + t of the positions t whose next token labels[b, t + 1] is scored, row-major. Their number depends on the
    values: on a device tensor this waits for the device (a host sync), so the training loops compute it on the host
    batch (with_scored_index)."""
    scored = torch.zeros_like(labels, dtype=torch.bool)
    scored[:, :-1] = labels[:, 1:] != -100
    return scored.reshape(-1).nonzero().squeeze(1)


def _forward_with_logprobs(self: Any, *args: Any, token_scoring: Optional[TokenScoring] = None, **kwargs: Any) -> Any:
    """The model's own forward, or with `token_scoring` (TokenScoring) the log-prob head on its last hidden states: a
    TokenScores. Runs inside the model's forward, so DDP/FSDP hooks and accelerate's autocast wrap it like any
    forward."""
    if token_scoring is None:
        return type(self).forward(self, *args, **kwargs)
    kwargs.setdefault("use_cache", False)  # left as None, transformers fills a KV cache in training too
    kwargs.pop("logits_to_keep", None)
    if "past_key_values" in kwargs:  # a TokenScores' cache handed back (shared_prefix_forward), under its name here
        kwargs[_cache_keyword(type(self))] = kwargs.pop("past_key_values")
    positions, labels, temperature, want_entropy, truncation = token_scoring
    if any(getattr(self.config, key, None) not in (None, 1, 1.0) for key in _LOGIT_TRANSFORMS):
        out = type(self).forward(self, *args, **kwargs)
        logits = out.logits.reshape(-1, out.logits.shape[-1])[positions].float()  # [*labels.shape, V]
        logp, ent = logp_and_entropy(logits / temperature, labels, want_entropy, truncation)
        return TokenScores(logp, ent, _returned_cache(out))
    out = getattr(self, self.base_model_prefix)(*args, **kwargs)
    hidden = out.last_hidden_state
    hidden = hidden.reshape(-1, hidden.shape[-1])[positions.reshape(-1)]
    head = self.get_output_embeddings()
    logp, ent = chunked_token_scores(hidden, head, labels, temperature, want_entropy, truncation=truncation)
    return TokenScores(logp, ent, _returned_cache(out) if kwargs["use_cache"] else None)


@functools.lru_cache(maxsize=None)
def _cache_keyword(model_class: type) -> str:
    """The keyword under which `model_class`'s forward takes a KV cache: `cache` from transformers 5.2x on,
    `past_key_values` before (see kv_cache_name)."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def _returned_cache(output: Any) -> Any:
    """The KV cache a forward returned, read under its current name (kv_cache_name), or None."""
    name = kv_cache_name(output)
    return None if name is None else getattr(output, name)


def add_logprob_head(model: Any) -> Any:
    """Give a causal LM the `token_scoring` forward (see _forward_with_logprobs); its plain forward is unchanged
    (generation, export). Set on the instance, so checkpoints and parameter names are untouched; LoRA (peft) and
    DDP/FSDP/accelerate wrap it afterwards and pass the keyword through."""
    import functools
    import types

    forward = functools.wraps(type(model).forward)(_forward_with_logprobs)  # generate() reads the signature
    model.forward = types.MethodType(forward, model)
    return model


def _fp32_linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """Linear.forward in float32 whatever autocast says (the instance's `forward`, see fp32_head)."""
    with torch.autocast(x.device.type, enabled=False):
        bias = None if self.bias is None else self.bias.float()
        return torch.nn.functional.linear(x.float(), self.weight.float(), bias)


def fp32_head(head: Optional[torch.nn.Module]) -> Optional[torch.nn.Module]:
    """Make a scalar head (reward model, value model: hidden -> 1) compute in float32 under bf16 autocast.

    A score is one dot product over the hidden size: in bf16 it keeps 8 significant bits, so a reward near 10 is
    only known to +-0.03 (PPO's value targets and a reward model's margins live at that scale). In fp32 it costs
    nothing (hidden x 1). The instance's `forward` is replaced, so parameter names and checkpoints are unchanged;
    copies (peft's modules_to_save) rebind it to themselves. Under FSDP2 mixed precision the weight arrives in bf16
    and is upcast here: the product and its sum are still fp32."""
    import types

    if isinstance(head, torch.nn.Linear):
        head.forward = types.MethodType(_fp32_linear_forward, head)
    return head


def load_sequence_classifier(
    name_or_path: str,
    dtype: torch.dtype = torch.float32,
    gguf_file: Optional[str] = None,
    trust_remote_code: bool = False,
    revision: Optional[str] = None,
    pad_token_id: Optional[int] = None,
    require_trained_head: bool = False,
    attn_implementation: Optional[str] = None,
) -> Any:
    """A scalar-head model (num_labels=1): reward model, or value model initialised from a policy or RM.

    require_trained_head: refuse (ConfigError) a model whose score head transformers had to initialise because the
    weights lack it (a causal LM given as a reward model: its scores would be noise). Local folders are refused
    before loading already (preflight.check_trained_score_head); this catches hub models."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    # A classifier from a causal LM (a value model from the policy, a reward model to train) always makes transformers
    # print a LOAD REPORT table (lm_head unused, score new): expected, so it is held back and only other keys are told.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            name_or_path,
            num_labels=1,
            output_loading_info=True,
            **_pretrained_kwargs(gguf_file, dtype, trust_remote_code, revision, attn_implementation),
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    untrained = sorted(k for k in info["missing_keys"] if k.split(".")[0] == "score")
    other_missing = sorted(k for k in info["missing_keys"] if k.split(".")[0] != "score")
    other_unexpected = sorted(k for k in info["unexpected_keys"] if k.split(".")[0] != "lm_head")
    if other_missing or other_unexpected:
        hf_logging.get_logger(__name__).warning(
            f"loading {name_or_path} as a scalar-head model: weights missing from the checkpoint (initialised): "
            f"{other_missing}; weights in the checkpoint not used: {other_unexpected}"
        )
    if require_trained_head and untrained:
        raise ConfigError(
            f"{name_or_path!r} is not a trained reward model: its weights have no {untrained} (the score head would "
            "be randomly initialised)"
        )
    if gguf_file:
        model = _drop_gguf(model, AutoModelForSequenceClassification)
    fp32_head(getattr(model, "score", None))  # scores in fp32 under bf16 autocast
    if pad_token_id is not None and model.config.pad_token_id is None:
        model.config.pad_token_id = pad_token_id
    return model


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(labels) per position from logits of the same length (already aligned: logits[t] predicts labels[t]).

    Computed in float32 as logit[label] - logsumexp(logits): unlike log_softmax this never materialises a second
    [batch, seq, vocab] tensor (2 GB per 4k tokens at a 128k vocabulary). Temperature divides the logits as in
    sampling."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    labels = labels.clamp(min=0)  # masked positions (-100) are gathered at 0 and must be masked by the caller
    return torch.gather(logits, 2, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def forward_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model inputs of a batch: a padded one's input_ids and attention_mask (and position_ids when it has them),
    or a packed row's (data.packed_row) input_ids and position_ids with NO attention mask.

    Packed rows rely on transformers: given position_ids that restart at 0, no 2D attention mask and no KV cache,
    its masking_utils (find_packed_sequence_indices) builds a block-diagonal causal mask for sdpa and eager, and
    flash_attention_2 runs its varlen kernel with the sequence boundaries read from the position ids: no token attends
    across a boundary (tests/test_packing.py proves it). So the forward must get use_cache=False: with a cache (the
    default, config.use_cache) transformers skips the detection and each sequence would attend to those before it."""
    if is_packed(batch):
        return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    keys = ("input_ids", "attention_mask", "position_ids")
    return {k: batch[k] for k in keys if k in batch}


def sequence_sums(values: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-sequence sums of values aligned to input_ids[:, 1:] (one per predicted token): row sums of a padded batch
    [rows, T-1]; for a packed row [1, T-1], the sum over each sequence's predicted tokens (the masks zero every
    sequence's first token, which would be predicted from the sequence before it).

    A 0/1 [sequences, T-1] matrix product: deterministic (no atomic adds) and needs no host sync."""
    if not is_packed(batch):
        return values.sum(-1)
    return owner_sums(values.reshape(-1), batch["sequence_ids"][0, 1:], len(batch["sequence_lengths"]))


def owner_sums(values: torch.Tensor, owner: torch.Tensor, n: int) -> torch.Tensor:
    """[n] sums of values [K] by owner [K] (in 0..n-1), as a 0/1 matrix product (deterministic, unlike index_add
    on GPUs)."""
    members = owner.unsqueeze(0) == torch.arange(n, device=owner.device).unsqueeze(1)
    return members.to(values.dtype) @ values


def scored_logprobs(
    model: Any, batch: dict[str, torch.Tensor], labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One forward (padded or packed batch) in which only the positions with a label (`labels` aligned with
    input_ids, -100 where nothing is scored) reach the output layer: their log-probs [K] (float32, row-major
    order), the sequence each belongs to [K] (a padded batch's row, a packed row's sequence) and how many sequences
    the batch holds."""
    from open_instruct.data import batch_sequences

    # the batch's host-computed positions of these labels (with_scored_index), else found here (a host sync)
    positions = batch["scored_index"] if "scored_index" in batch else scored_positions(labels)
    targets = labels.reshape(-1)[positions + 1]
    out = model(**forward_inputs(batch), token_scoring=TokenScoring(positions, targets), use_cache=False)
    if isinstance(out, TokenScores):
        logps = out.logp
    else:  # a model without add_logprob_head ignored the keyword: full logits
        logits = out.logits.reshape(-1, out.logits.shape[-1])[positions]
        logps = logp_and_entropy(logits.float(), targets, False)[0]
    width = labels.shape[1]
    owner = batch["sequence_ids"].reshape(-1)[positions + 1] if is_packed(batch) else positions // width
    return logps, owner, batch_sequences(batch)


def trained_labels(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The tokens a batch trains on, aligned with input_ids (-100 elsewhere): a preference batch's response tokens
    (loss_mask), or an SFT batch's labels."""
    if "loss_mask" in batch:
        return batch["input_ids"].masked_fill(batch["loss_mask"] == 0, -100)
    return batch["labels"]


def with_scored_index(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A host batch plus `scored_index`, the scored_positions of its trained_labels: computed before the batch moves
    to the device, so scored_logprobs finds them without a host sync."""
    return {**batch, "scored_index": scored_positions(trained_labels(batch))}


def sequence_logprobs(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence sums of log p(token) over the tokens batch["loss_mask"] marks (responses only), padded or packed,
    and their counts. Only those tokens' positions go through the output layer (scored_logprobs)."""
    logps, owner, n = scored_logprobs(model, batch, trained_labels(batch))
    return owner_sums(logps, owner, n), sequence_sums(batch["loss_mask"][:, 1:].float(), batch)


class PairLogps(NamedTuple):
    """Per-pair summed response log-probs and response token counts."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor

    def averages(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.chosen / self.chosen_tokens.clamp(min=1), self.rejected / self.rejected_tokens.clamp(min=1)


def pair_logps(model: Any, batch: dict[str, torch.Tensor]) -> PairLogps:
    """One forward over [chosen sequences; rejected sequences] (data.collate_preferences, padded or packed), split
    back into the two halves."""
    sums, counts = sequence_logprobs(model, batch)
    n = len(sums) // 2
    return PairLogps(sums[:n], sums[n:], counts[:n], counts[n:])


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last non-pad token of each row, for right-padded or left-padded batches."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (attention_mask.long() * positions).argmax(dim=1)


def pooled_positions(batch: dict[str, torch.Tensor], pad_id: Optional[int]) -> torch.Tensor:
    """Where a sequence classifier pools each sequence of a packed row: its last token that is not `pad_id` (its
    last token when pad_id is None), or its first token when every token is pad_id. That is Hugging Face's pooling
    of a padded row (the rightmost non-pad token; index 0 when there is none), so packed and padded scores agree
    also when pad == eos and a trailing EOS is skipped."""
    ids, owner, lengths = batch["input_ids"][0], batch["sequence_ids"][0], batch["sequence_lengths"]
    positions = torch.arange(len(ids), device=ids.device)
    starts = torch.cumsum(lengths, 0) - lengths
    candidates = positions if pad_id is None else torch.where(ids != pad_id, positions, starts[owner])
    members = owner.unsqueeze(0) == torch.arange(len(lengths), device=ids.device).unsqueeze(1)
    return torch.where(members, candidates.unsqueeze(0), -1).max(1).values


def _classifier(model: Any) -> Any:
    """The Hugging Face sequence classifier under DDP / peft wrappers (its `score` is peft's trained copy)."""
    from open_instruct.distributed import unwrap_model

    inner = unwrap_model(model)
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def scalar_head_scores(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Scalar score of each sequence (reward model), float32: for a padded batch, Hugging Face's sequence classifier
    pools at the last non-pad token of each row; a packed row holds many sequences, so the head's output at every
    token is read (a hook on the head, during the classifier's own forward: FSDP and peft run as usual) and taken at
    each sequence's pooled_positions."""
    if not is_packed(batch):
        out = model(**forward_inputs(batch), use_cache=False)  # no KV cache (see sequence_logprobs)
        return out.logits.squeeze(-1).float()  # HF sequence classifiers pool at the last non-pad token: [batch, 1]
    classifier, per_token = _classifier(model), []
    hook = classifier.score.register_forward_hook(lambda module, args, output: per_token.append(output))
    try:
        model(**forward_inputs(batch), use_cache=False)
    finally:
        hook.remove()
    return per_token[0][0, :, 0][pooled_positions(batch, classifier.config.pad_token_id)].float()


def pair_rewards(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards of the chosen and rejected halves of a `data.collate_preferences` batch (padded or packed), float32."""
    scores = scalar_head_scores(model, batch)
    return scores.chunk(2)


def make_optimizer_and_scheduler(
    model: torch.nn.Module, cfg: Any, num_optimizer_steps: int, fused: bool = True
) -> tuple[Any, Any]:
    """AdamW (no weight decay on biases and norms) and the recipe's schedule over num_optimizer_steps.

    fused (every script) runs one AdamW kernel over all parameters (CPU and CUDA, DTensor too) instead of a Python
    loop of small ops per parameter: ~2.5x cheaper steps for small models on CPU, and no per-op thread wake-ups."""
    from transformers import get_scheduler

    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 or "norm" in name.lower() else decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=cfg.learning_rate,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_epsilon,
        fused=fused,
    )
    # A step skipped on purpose (a non-finite loss, a mini-batch whose groups were all filtered) still advances the
    # schedule, so it stays a function of the step count; torch warns when that happens before any optimizer step.
    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step")
    scheduler = get_scheduler(
        cfg.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=int(cfg.warmup_ratio * num_optimizer_steps),
        num_training_steps=num_optimizer_steps,
    )
    return optimizer, scheduler


def disable_dropout(model: torch.nn.Module) -> None:
    """Dropout off everywhere: DPO's policy log-probs must match its (dropout-free) cached reference, and RL's
    training-time log-probs must match the ones the rollout was scored with."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    for key in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if isinstance(getattr(model.config, key, None), float):
            setattr(model.config, key, 0.0)


# ---------------------------------------------------------------------------------------------------------------------
# RL forwards on collate_episodes batches (left-padded prompts, right-padded responses), with the speed plumbing:
# completions of one prompt share its forward (the prompt runs once; its key/value cache is repeated for the
# responses), which skips most of the tokens of every forward and backward with 8+ samples per prompt.


class TokenValueModel(torch.nn.Module):
    """A value (or reward) model giving one scalar per token: a sequence classifier's backbone hidden states passed
    through its scalar head at every position (the classifier's own forward only pools the last token).

    Wrapping it in a module keeps DDP/FSDP gradient hooks on the call that computes values."""

    def __init__(self, seq_cls: Any) -> None:
        super().__init__()
        self.seq_cls = seq_cls
        self.config = seq_cls.config
        self._no_split_modules = getattr(seq_cls, "_no_split_modules", None)  # FSDP auto-wrap reads it
        if not isinstance(getattr(seq_cls, "score", None), torch.nn.Module):
            raise ValueError(f"{type(seq_cls).__name__} has no `score` head: cannot read per-token values from it")

    def forward(self, batch: dict[str, torch.Tensor], num_positions: int, group: int = 1) -> torch.Tensor:
        """Scalar outputs of the last `num_positions` (<= R+1) positions of a collate_episodes batch, float32
        [batch, num_positions]. group > 1: runs of `group` rows share their prompt (see shared_prompt_groups)."""
        # LoRA (peft) wraps the classifier: its adapted layers and trained head live in the plain model it holds.
        seq_cls = self.seq_cls.get_base_model() if hasattr(self.seq_cls, "get_base_model") else self.seq_cls
        backbone = getattr(seq_cls, seq_cls.base_model_prefix)
        parts = shared_prefix_forward(backbone, batch, group, feed_last=True) if group > 1 else None
        if parts is not None:
            first, rest = parts
            hidden = first.last_hidden_state[:, -1:].repeat_interleave(group, 0)
            if rest is not None:
                hidden = torch.cat([hidden, rest.last_hidden_state], 1)
        elif is_packed(batch):  # the padded layout's last R+1 positions, read out of the packed row: [B, R+1, H]
            hidden = backbone(**forward_inputs(batch), use_cache=False).last_hidden_state[0][batch["window_index"]]
        else:
            hidden = backbone(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
            ).last_hidden_state
        # A new tensor, not a view of the head's [B, P, 1] output: FSDP2 warns on every step about a view returned
        # by a sharded module (an in-place op on it would skip the pre-backward all-gather; none is done here).
        return seq_cls.score(hidden[:, -num_positions:]).squeeze(-1).float().clone()


def shared_prompt_groups(model: Any, batch: dict[str, torch.Tensor], group: int) -> int:
    """`group` if the batch's rows come in runs of `group` identical (padded) prompts, so each prompt can be run once
    and its key/value cache reused by its `group` responses; else 1. With 8 samples per prompt this skips most of
    the tokens of every forward and backward. Single process only: DDP allows one forward per backward, and FSDP
    (which works) would then round differently from DDP, whose runs it is checked against bit for bit."""
    if is_packed(batch):  # packing and prompt sharing exclude each other: a packed row already holds no padding
        return 1
    n, width = batch["input_ids"].shape
    distributed = (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    )
    if group <= 1 or n % group or distributed or isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return 1
    # Compared on the host copy when the batch carries one (rollouts.EpisodeLayout.batch): on the device, reading the
    # answer would make the host wait for the device once per micro-batch.
    ids = batch.get("host_input_ids", batch["input_ids"])
    prompts = ids[:, : width - batch["responses"].shape[1]].view(n // group, group, -1)
    return group if bool((prompts == prompts[:, :1]).all()) else 1


def shared_prefix_forward(
    module: Any,
    batch: dict[str, torch.Tensor],
    group: int,
    feed_last: bool,
    first_kwargs: Optional[dict[str, Any]] = None,
    rest_kwargs: Optional[dict[str, Any]] = None,
) -> Optional[tuple[Any, Any]]:
    """Run each shared prompt once (rows 0, group, 2*group, ...) with a cache, repeat the cache `group` times and run
    the responses on it. Returns (prompt output, response output or None), or None when the module returns no cache
    (Hugging Face turns the cache off under activation checkpointing): callers then run the plain forward.
    feed_last: also feed the last response column (needed for hidden states, not for next-token logits).
    first_kwargs / rest_kwargs: more keywords of the two calls (default: the prompt call keeps the last logits only)."""
    width = batch["input_ids"].shape[1]
    width_p = width - batch["responses"].shape[1]
    end = width if feed_last else width - 1
    ids, mask, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    kwargs = first_kwargs if first_kwargs is not None else {} if feed_last else {"logits_to_keep": 1}
    first = module(
        input_ids=ids[::group, :width_p],
        attention_mask=mask[::group, :width_p],
        position_ids=pos[::group, :width_p],
        use_cache=True,
        **kwargs,
    )
    cache_name = kv_cache_name(first)
    if cache_name is None:
        return None
    if end == width_p:
        return first, None
    cache = getattr(first, cache_name)  # a model output or a TokenScores (a named tuple: no lookup by name)
    cache.batch_repeat_interleave(group)
    rest = module(
        input_ids=ids[:, width_p:end],
        attention_mask=mask[:, :end],
        position_ids=pos[:, width_p:end],
        use_cache=True,
        **{cache_name: cache},
        **(rest_kwargs or {}),
    )
    return first, rest


def kv_cache_name(output: Any) -> Optional[str]:
    """The name under which a forward returned its KV cache, and under which the next forward takes it back: `cache`
    from transformers 5.2x on, `past_key_values` before (the vLLM venv pins an older release). Reading or passing the
    old name on a new release prints a deprecation warning on every call. None: the forward returned no cache.
    A TokenScores (the log-prob head's forward) holds its cache as past_key_values, which that forward takes back
    under the model's own name."""
    if isinstance(output, TokenScores):
        return "past_key_values" if output.past_key_values is not None else None
    for name in ("cache", "past_key_values"):
        if name in output and output[name] is not None:
            return name
    return None


def response_logits(model: Any, batch: dict[str, torch.Tensor], temperature: float, group: int = 1) -> torch.Tensor:
    """Logits (divided by the sampling temperature) predicting each response token: [B, R, vocab].

    group > 1: rows may come in runs of `group` sharing a prompt, whose forward is then shared (same numbers).
    A packed batch (collate_episodes(packed=True)) runs as one row; the head runs only at the positions that predict
    response tokens (window_index), laid out [B, R] as in the padded layout."""
    width_r = batch["responses"].shape[1]
    group = shared_prompt_groups(model, batch, group)
    parts = shared_prefix_forward(model, batch, group, feed_last=False) if group > 1 else None
    if is_packed(batch):
        keep = batch["window_index"][:, :-1]
        out = model(**forward_inputs(batch), logits_to_keep=keep.reshape(-1), use_cache=False)
        logits = out.logits.view(*keep.shape, -1).float()
    elif parts is not None:
        first, rest = parts
        logits = first.logits[:, -1:].repeat_interleave(group, 0)
        if rest is not None:
            logits = torch.cat([logits, rest.logits], 1)
        logits = logits.float()
    else:
        out = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            logits_to_keep=width_r + 1,
        )
        logits = out.logits[:, :-1].float()
    return logits / temperature if temperature != 1.0 else logits


def response_scores(
    model: Any,
    batch: dict[str, torch.Tensor],
    temperature: float,
    group: int = 1,
    entropy: bool = False,
    truncation: Optional[SamplingTruncation] = None,
) -> TokenScores:
    """log p(response token) under softmax(logits / temperature) and (entropy=True) that distribution's entropy at
    every response position, float32 [B, R], through the chunked log-prob head: no [B, R, vocab] logits exist (the
    numbers of token_logprobs(response_logits(...)) and entropy_from_logits of them).

    Padded, packed (window_index) or, with group > 1, sharing each prompt's forward like response_logits. An active
    `truncation` (the sampler's top-k / top-p / min-p): log p under the truncated, renormalised distribution."""
    responses = batch["responses"]
    rows, width_r = responses.shape
    device = responses.device

    def scoring(positions: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        return {"token_scoring": TokenScoring(positions, labels, temperature, entropy, truncation)}

    if is_packed(batch):  # one packed row: window_index are positions in it
        return model(**forward_inputs(batch), **scoring(batch["window_index"][:, :-1], responses), use_cache=False)
    group = shared_prompt_groups(model, batch, group)
    width = batch["input_ids"].shape[1]
    if group > 1:
        width_p = width - width_r
        # the prompt call's last position (of prompt row i // group) predicts response token 0 of row i; the response
        # call (columns width_p .. width - 2) predicts tokens 1 .. R-1
        first_at = (torch.arange(rows, device=device) // group * width_p + width_p - 1).unsqueeze(1)
        rest_at = torch.arange(rows * (width_r - 1), device=device).view(rows, width_r - 1)
        parts = shared_prefix_forward(
            model, batch, group, False, scoring(first_at, responses[:, :1]), scoring(rest_at, responses[:, 1:])
        )
        if parts is not None:
            first, rest = parts
            if rest is None:
                return TokenScores(first.logp, first.entropy)
            return TokenScores(
                torch.cat([first.logp, rest.logp], 1), torch.cat([first.entropy, rest.entropy], 1) if entropy else None
            )
    # columns width - R - 1 .. width - 2 predict the R response tokens
    at = torch.arange(rows, device=device).unsqueeze(1) * width + torch.arange(
        width - width_r - 1, width - 1, device=device
    )
    return model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        **scoring(at, responses),
    )


def token_values(value_model: Any, batch: dict[str, torch.Tensor], group: int = 1) -> torch.Tensor:
    """V(state before response token t) for every t: the scalar head at the position whose logits predict token t."""
    width_r = batch["responses"].shape[1]
    out = value_model(batch, width_r + 1, shared_prompt_groups(value_model, batch, group))
    return out[:, :-1]


def sequence_scores(reward_model: Any, batch: dict[str, torch.Tensor], group: int = 1) -> torch.Tensor:
    """Reward-model score of each prompt+response, read where reward-model training read it: Hugging Face sequence
    classifiers pool at the last token that is not `config.pad_token_id`. Usually that is the last response token;
    when pad == eos (a tokenizer without a pad token), a trailing EOS counts as padding and the score is read at the
    token before it (the last prompt token if the response is only EOS)."""
    width_r = batch["responses"].shape[1]
    out = reward_model(batch, width_r + 1, shared_prompt_groups(reward_model, batch, group))  # [B, R+1]
    # Position 0: the last prompt token (always real, left padding); 1..R: the response tokens.
    if is_packed(batch):
        tokens = batch["input_ids"][0][batch["window_index"]]  # past a response's end: repeats, masked below
    else:
        tokens = torch.cat([batch["input_ids"][:, -width_r - 1 : -width_r], batch["responses"]], 1)
    real = torch.cat([torch.ones_like(batch["mask"][:, :1]), batch["mask"]], 1)
    pad_id = getattr(getattr(reward_model, "config", None), "pad_token_id", None)
    if pad_id is not None:
        real = real * (tokens != pad_id)
    return out.gather(1, last_token_index(real).unsqueeze(1)).squeeze(1)
