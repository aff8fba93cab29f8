"""Turn a training checkpoint into a Hugging Face model folder (the policy alone by default;
a LoRA run's checkpoint is exported merged).

    python -m open_instruct.export output/run/checkpoints/step_100 exported_model [--model policy]

Works for checkpoints written by any number of processes (the sharded state is gathered here)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from open_instruct import lora
from open_instruct.checkpoint import STATE, validate, write_hf_folder


def _stored_prefix(checkpoint: str, model_name: str) -> str:
    """`seq_cls.` when the checkpoint stores the model wrapped in a TokenValueModel (PPO's value model), else ''.
    Read from the checkpoint's own key names, so checkpoints written before this was recorded export too."""
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(os.path.join(checkpoint, "state")).read_metadata().state_dict_metadata
    return "seq_cls." if any(k.startswith(f"model.{model_name}.seq_cls.") for k in keys) else ""


def export_checkpoint(checkpoint: str, out_dir: str, model_name: str = "policy") -> str:
    """Write model `model_name` of `checkpoint` as an HF folder that `from_pretrained` loads (a policy as a causal
    LM; a reward or PPO value model as a sequence classifier with its trained score head)."""
    import torch.distributed.checkpoint as dcp
    import transformers

    reason = validate(checkpoint)
    if reason is not None:
        raise SystemExit(f"export: {checkpoint} is not a complete checkpoint: {reason}")
    with open(os.path.join(checkpoint, STATE)) as f:
        trainer_state = json.load(f)
    classes = trainer_state["model_classes"]
    if model_name not in classes:
        raise SystemExit(f"export: checkpoint has models {sorted(classes)}, not {model_name!r}")
    prefix = _stored_prefix(checkpoint, model_name)
    class_name = "AutoModelForSequenceClassification" if prefix else classes[model_name]
    config = transformers.AutoConfig.from_pretrained(os.path.join(checkpoint, "hf", model_name))
    model = getattr(transformers, class_name).from_config(config, dtype=torch.float32)
    run_cfg = argparse.Namespace(**{"use_lora": False, **trainer_state.get("config", {})})
    task_type = "SEQ_CLS" if "SequenceClassification" in class_name else "CAUSAL_LM"
    model = lora.apply_lora(model, run_cfg, task_type)  # a LoRA run's checkpoint holds the peft model's state
    state = {f"model.{model_name}": {prefix + k: v for k, v in model.state_dict().items()}}
    dcp.load(state, checkpoint_id=os.path.join(checkpoint, "state"))
    model.load_state_dict({k[len(prefix) :]: v for k, v in state[f"model.{model_name}"].items()})
    if lora.is_peft(model):  # exported merged: a plain HF model
        merged = lora.merged_state_dict(model, model.state_dict())
        model = lora.plain_model(model)
    else:
        merged = model.state_dict()
    tokenizer = None
    tok_dir = os.path.join(checkpoint, "hf", "tokenizer")
    if os.path.isdir(tok_dir):
        tokenizer = transformers.AutoTokenizer.from_pretrained(tok_dir)
    write_hf_folder(model, merged, tokenizer, out_dir, {"exported_from": os.path.abspath(checkpoint)})
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("out_dir")
    parser.add_argument("--model", default="policy", help="which model of the checkpoint (policy; value for PPO)")
    args = parser.parse_args()
    print(export_checkpoint(args.checkpoint, args.out_dir, args.model))


if __name__ == "__main__":
    sys.exit(main())
