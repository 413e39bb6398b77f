"""The model families pdserve runs, by the architecture a checkpoint's config.json names.

Each family is one module in common/model/families/ with two functions:

- ``read_config(raw) -> ModelConfig``: config.json read as transformers reads it for that
  family (torch-free: the router reads configs and imports no torch);
- ``build_model(cfg, parallel) -> CausalLM``: the model of one rank, a decoder over the
  shared layers (common/model/decoder.py) with the attention and MLP of that family.

A checkpoint's family is the entry of its ``model_type`` (the class transformers would
build, and so the one the equivalence tests compare against; its ``architectures`` pick
between entries of one model_type), else the entry of its ``architectures``. The modules
are imported by name when a config asks for them, as vLLM's model registry does: reading a
config imports one family, and this table imports none (config.py reads through it, the
families read into config.py's ModelConfig).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, NamedTuple

from pdserve.common.errors import ModelLoadError


class Family(NamedTuple):
    architecture: str  # config.json "architectures": transformers' model class
    model_type: str  # config.json "model_type"
    module: str  # common/model/families/<module>.py

    def load(self) -> ModuleType:
        return importlib.import_module(f"pdserve.common.model.families.{self.module}")


FAMILIES = (
    Family("LlamaForCausalLM", "llama", "llama"),
    Family("MistralForCausalLM", "mistral", "mistral"),
    Family("Qwen2ForCausalLM", "qwen2", "qwen2"),
    Family("Qwen3ForCausalLM", "qwen3", "qwen3"),
    Family("Qwen3MoeForCausalLM", "qwen3_moe", "qwen3_moe"),
    Family("DeepseekV2ForCausalLM", "deepseek_v2", "deepseek"),
    Family("DeepseekV3ForCausalLM", "deepseek_v3", "deepseek"),
    Family("DeepseekV32ForCausalLM", "deepseek_v32", "deepseek_v32"),
    Family("DeepseekV4ForCausalLM", "deepseek_v4", "deepseek_v4"),
)


def family_of(raw: dict[str, Any]) -> Family:
    """The family of a config.json (``raw``); a ModelLoadError naming the supported ones."""
    architectures = raw.get("architectures") or []
    by_arch = [f for f in FAMILIES if f.architecture in architectures]
    model_type = raw.get("model_type")
    if model_type is None:  # not a transformers config: Llama, as pdserve always read it
        return by_arch[0] if by_arch else FAMILIES[0]
    by_type = [f for f in FAMILIES if f.model_type == model_type]
    exact = [f for f in by_type if f.architecture in architectures]
    for found in (exact, by_type, by_arch):
        if found:
            return found[0]
    named = f"; its config.json names architectures {architectures}" if architectures else ""
    raise ModelLoadError(
        f"model_type {model_type!r} is not supported; pdserve runs "
        f"{', '.join(f'{f.architecture} ({f.model_type})' for f in FAMILIES)}{named}"
    )


def family_named(architecture: str) -> Family:
    """The family of a ModelConfig's ``architecture`` (one ``family_of`` returned)."""
    for family in FAMILIES:
        if family.architecture == architecture:
            return family
    raise ModelLoadError(f"no model family runs the architecture {architecture!r}")
