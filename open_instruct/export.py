"""Turn a training checkpoint into a Hugging Face model folder (the policy alone by default).

    python -m open_instruct.export output/run/checkpoints/step_100 exported_model [--model policy]

Works for checkpoints written by any number of processes (the sharded state is gathered here)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from open_instruct.checkpoint import STATE, validate, write_hf_folder


def export_checkpoint(checkpoint: str, out_dir: str, model_name: str = "policy") -> str:
    import torch.distributed.checkpoint as dcp
    import transformers

    reason = validate(checkpoint)
    if reason is not None:
        raise SystemExit(f"export: {checkpoint} is not a complete checkpoint: {reason}")
    with open(os.path.join(checkpoint, STATE)) as f:
        classes = json.load(f)["model_classes"]
    if model_name not in classes:
        raise SystemExit(f"export: checkpoint has models {sorted(classes)}, not {model_name!r}")
    config = transformers.AutoConfig.from_pretrained(os.path.join(checkpoint, "hf", model_name))
    auto_cls = getattr(transformers, classes[model_name])
    model = auto_cls.from_config(config, dtype=torch.float32)
    state = {f"model.{model_name}": model.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(checkpoint, "state"))
    model.load_state_dict(state[f"model.{model_name}"])
    tokenizer = None
    tok_dir = os.path.join(checkpoint, "hf", "tokenizer")
    if os.path.isdir(tok_dir):
        tokenizer = transformers.AutoTokenizer.from_pretrained(tok_dir)
    write_hf_folder(model, model.state_dict(), tokenizer, out_dir, {"exported_from": os.path.abspath(checkpoint)})
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("out_dir")
    parser.add_argument("--model", default="policy", help="which model of the checkpoint (policy, value, ...)")
    args = parser.parse_args()
    print(export_checkpoint(args.checkpoint, args.out_dir, args.model))


if __name__ == "__main__":
    sys.exit(main())
