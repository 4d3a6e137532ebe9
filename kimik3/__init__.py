"""kimik3: the Kimi-K3 hybrid model (KDA + MLA, LatentMoE, ViT) and its serving stack in JAX.

The public surface, each name imported on first use (so ``import kimik3`` imports no JAX):

* `LLM`, `SamplingParams`, `CompletionOutput`: offline inference with the server's defaults
  (`serving.llm`): ``kimik3.LLM("tiny").generate(prompts, kimik3.SamplingParams(...))``.
* `ModelConfig`, `get_config`: the configs and their presets (`kimik3.config`).
* `init_params`, `forward`: random weights and the forward pass (`kimik3.model`).
* the modules `config`, `model`, `generate` (its `generate` function is the no-cache fp32
  oracle), `tokenizer`, `text`, `checkpoint`, `hf`.
* `__version__`: the installed distribution's version (the source tree's pyproject.toml when
  it is not installed).
"""

from __future__ import annotations

import importlib
import os

# name -> (module, attribute)
_EXPORTS = {
    "LLM": ("serving.llm", "LLM"),
    "SamplingParams": ("serving.llm", "SamplingParams"),
    "CompletionOutput": ("serving.llm", "CompletionOutput"),
    "ModelConfig": ("kimik3.config", "ModelConfig"),
    "get_config": ("kimik3.config", "get_config"),
    "init_params": ("kimik3.model", "init_params"),
    "forward": ("kimik3.model", "forward"),
}
# `generate` stays the module (code imports it as one: ``from kimik3 import generate``); a function
# of that name here would be replaced by the module whenever the module is first imported
_SUBMODULES = ("config", "model", "generate", "tokenizer", "text", "checkpoint", "hf")

__all__ = ["__version__", *_EXPORTS, *_SUBMODULES]


def _version() -> str:
    from importlib import metadata  # on first use: ~30 ms that every `import kimik3.<module>` would pay

    try:
        return metadata.version("kimik3")
    except metadata.PackageNotFoundError:
        import tomllib  # on first use, as metadata above

        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")
        try:
            with open(path, "rb") as f:
                return tomllib.load(f)["project"]["version"]
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "0+unknown"


def __getattr__(name: str):
    if name == "__version__":
        value = _version()
    elif name in _EXPORTS:
        module, attr = _EXPORTS[name]
        value = getattr(importlib.import_module(module), attr)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
