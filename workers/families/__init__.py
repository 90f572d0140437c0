"""Model families: one declaration per family (pure), one module of torch layers each, the builder; the registry.

Everything that differs between model families is declared once, in ``workers/families/<name>.py`` (a
:class:`~etrain.workers.families.base.ModelFamily`): presets, Hugging Face architectures, config and
parameter-name mapping, shape rules, what tensor parallelism splits and how (a plan as data), parameter,
FLOP and activation counts for the planner and MFU. The family-dependent layout rules
(``etrain.workers.families.layout``), the planner, the spec checks, the entry points that take a run
config and the Hugging Face reader and writer ask :func:`family` instead of branching on a name; the run
config (``etrain.workers.protocol.run_config``) names a family but never asks one, so a model's parameter
count is :func:`num_params` and the presets are :data:`MODEL_PRESETS`, here;
``etrain.workers.families.model`` builds the modules from ``<name>_model.py`` (torch), imported by name on
the ranks only, and holds the loss and the canonical parameter names. Adding a family:
``docs/adding-a-model-family.md``.

This package's ``__init__`` and the declarations are pure (no torch): the control plane imports them.
"""

from __future__ import annotations

from typing import Any

from etrain.workers.families import gpt, llama, mixtral, olmo2, qwen3_moe
from etrain.workers.families.base import ModelFamily
from etrain.workers.protocol.errors import ConfigError

__all__ = [
    "FAMILIES",
    "MODEL_PRESETS",
    "ModelFamily",
    "check_shape",
    "family",
    "family_names",
    "hf_architectures",
    "hf_family",
    "num_params",
    "presets",
]

#: Every registered family by name (``ModelConfig.arch``, ``model.kind``), in the order they are listed.
FAMILIES: dict[str, ModelFamily] = {
    f.name: f for f in (gpt.FAMILY, llama.FAMILY, olmo2.FAMILY, qwen3_moe.FAMILY, mixtral.FAMILY)
}


def family(name: str) -> ModelFamily:
    """The family called ``name``; ``ConfigError`` (field ``model.kind``) naming the registered ones."""
    try:
        return FAMILIES[name]
    except (KeyError, TypeError):
        raise ConfigError(
            f"model family {name!r} is not registered.", field="model.kind", fix=f"use one of {', '.join(FAMILIES)}"
        ) from None


def check_shape(model: Any) -> None:
    """Raise the first shape rule ``model`` (a ``ModelConfig``) breaks for its family, as ``ConfigError``."""
    for error in family(model.arch).shape_errors(model):
        raise error


def num_params(model: Any) -> int:
    """Exact parameter count of the model ``model`` (a ``ModelConfig``) builds: its family's count, tested
    against the modules; ``ConfigError`` for an unregistered ``arch``, like :func:`family`."""
    return family(model.arch).num_params(model)


def family_names() -> tuple[str, ...]:
    return tuple(FAMILIES)


def hf_architectures() -> dict[str, dict[str, Any]]:
    """Every Hugging Face ``architectures`` entry some family loads, with its traits and family name."""
    return {
        arch: {**traits, "family": f.name} for f in FAMILIES.values() for arch, traits in f.hf_architectures.items()
    }


def hf_family(architecture: str) -> ModelFamily | None:
    """The family that loads Hugging Face ``architecture`` (``LlamaForCausalLM``), or None."""
    for f in FAMILIES.values():
        if architecture in f.hf_architectures:
            return f
    return None


def presets() -> dict[str, dict[str, Any]]:
    """Every family's presets, each with its ``arch``; a name is one family's only."""
    found: dict[str, dict[str, Any]] = {}
    for f in FAMILIES.values():
        for name, sizes in f.presets.items():
            if name in found:
                raise ValueError(f"preset {name!r} is declared by two families")
            found[name] = {"arch": f.name, **sizes}
    return found


#: Named sizes for quick starts (each family declares its own, each with its ``arch``); a spec may override
#: the sizes of a preset.
MODEL_PRESETS: dict[str, dict[str, Any]] = presets()
