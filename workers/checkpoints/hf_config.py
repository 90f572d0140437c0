"""Hugging Face model folders ↔ :class:`~etrain.workers.protocol.run_config.ModelConfig`, and the parameter-name map.

Pure (stdlib only): the service reads a ``model.hf`` folder's ``config.json`` at submit time to
validate and plan the job without importing torch, and the workers use the same functions to build
the model and to name tensors when they load or export Hugging Face safetensors. The folder's files are
read without following symbolic links (``workers/protocol/safe_paths.py``): a link in a ``model.hf`` folder is
refused, whatever it points at.

What is particular to an architecture (which family loads it, its config keys, its parameter names) is
declared by the model families (``etrain.workers.families``); this module finds the family of a
folder's ``architectures`` and asks it. etrain's modules keep torchtitan's names (``tok_embeddings``,
``layers.<i>.attention.wq``, ...) because the parallel engine cuts models by those names;
:func:`hf_name` / :func:`etrain_name` translate them to ``transformers``' names (``model.embed_tokens``,
``model.layers.<i>.self_attn.q_proj``, ...) with the family's tables.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from etrain.workers import families
from etrain.workers.families.base import DEFAULT_MAX_SEQ_LEN, hf_problem
from etrain.workers.protocol import safe_paths
from etrain.workers.protocol.errors import ConfigError
from etrain.workers.protocol.run_config import ModelConfig

__all__ = [
    "DEFAULT_MAX_SEQ_LEN",
    "SUPPORTED_ARCHITECTURES",
    "etrain_name",
    "hf_config_dict",
    "hf_name",
    "hf_parameter_names",
    "model_config_from_hf",
    "read_hf_config",
    "TOKENIZER_FILES",
    "WEIGHTS_INDEX",
    "weight_file_names",
    "weight_files",
]

#: Hugging Face ``architectures`` entries etrain trains, with what each implies and the family that loads it.
SUPPORTED_ARCHITECTURES: dict[str, dict[str, Any]] = families.hf_architectures()
#: Files copied next to an export so the folder tokenizes like the source.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "chat_template.jinja",
)
_MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few KiB; refuse anything absurd before parsing
#: The index of a sharded save (``save_pretrained``): which file holds each tensor.
WEIGHTS_INDEX = "model.safetensors.index.json"


_problem = hf_problem


def read_hf_config(folder: str | os.PathLike) -> dict[str, Any]:
    """``config.json`` of a Hugging Face model folder, as a dict; ``ConfigError`` naming ``model.hf``."""
    path = Path(folder)
    try:
        is_dir = stat.S_ISDIR(safe_paths.stat_path(path, field="model.hf").st_mode)
    except (FileNotFoundError, NotADirectoryError):
        is_dir = False
    if not is_dir:
        raise _problem(
            f"model.hf {str(folder)!r} is not a folder.",
            "give the path of a Hugging Face model folder (with config.json) readable by the workers",
        )
    config_path = path / "config.json"
    try:
        data = safe_paths.read_file(path, "config.json", field="model.hf", limit=_MAX_CONFIG_BYTES)
    except ValueError:
        raise _problem(
            f"{config_path} is larger than {_MAX_CONFIG_BYTES} bytes.", "point model.hf at a model folder"
        ) from None
    except FileNotFoundError:
        raise _problem(
            f"model.hf {str(folder)!r} has no config.json.",
            "give a folder written by transformers' save_pretrained (config.json + *.safetensors)",
        ) from None
    except OSError as exc:  # a folder, a special file, unreadable
        raise _problem(
            f"model.hf {str(folder)!r}: config.json cannot be read ({exc.strerror or exc}).",
            "give a folder written by transformers' save_pretrained (config.json + *.safetensors)",
        ) from None
    try:
        raw = json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise _problem(f"{config_path} is not valid JSON ({exc}).", "restore the config.json of the model") from exc
    if not isinstance(raw, dict):
        raise _problem(f"{config_path} does not hold a JSON object.", "restore the config.json of the model")
    return raw


def _architecture(raw: dict[str, Any]) -> str:
    names = raw.get("architectures") or []
    supported = sorted(SUPPORTED_ARCHITECTURES)
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    model_type = raw.get("model_type")
    for name, traits in SUPPORTED_ARCHITECTURES.items():
        if not names and traits["model_type"] == model_type:
            return name
    found = ", ".join(names) if names else f"model_type={model_type!r}"
    raise _problem(
        f"model.hf architecture {found} is not supported.",
        f"use a model of one of the supported architectures: {', '.join(supported)}",
    )


def model_config_from_hf(raw: dict[str, Any], *, seq_len: int | None = None) -> ModelConfig:
    """The :class:`ModelConfig` of a parsed ``config.json`` (its family's reading of it); refuses what etrain
    cannot train exactly."""
    arch = _architecture(raw)
    found = families.hf_family(arch)
    return ModelConfig(arch=found.name, hf_architecture=arch, **found.config_from_hf(raw, arch, seq_len=seq_len))


def hf_config_dict(model: ModelConfig) -> dict[str, Any]:
    """A ``config.json`` for ``model`` that ``transformers.AutoConfig`` reads back to the same sizes;
    ``ConfigError`` (field ``checkpoint.export``) for a family without a Hugging Face format."""
    found = families.family(model.arch)
    if not found.has_hf_format:
        raise ConfigError(
            f"only models of a Hugging Face family export to Hugging Face format, not arch={model.arch!r}.",
            field="checkpoint.export",
            fix="set checkpoint.export: none for the built-in GPT",
        )
    return found.hf_config(model)


# -- parameter names -------------------------------------------------------------------------------


def hf_name(fqn: str, family: str) -> str:
    """The ``transformers`` name of a parameter of a ``family`` model (``layers.3.attention.wq.weight`` →
    ``model.layers.3.self_attn.q_proj.weight``)."""
    return families.family(family).hf_name(fqn)


def etrain_name(name: str, family: str) -> str:
    """The inverse of :func:`hf_name`."""
    return families.family(family).etrain_name(name)


def hf_parameter_names(model: ModelConfig) -> list[str]:
    """Every etrain FQN of the model, in Hugging Face's order (tied output excluded)."""
    return families.family(model.arch).hf_parameter_names(model)


def weight_files(folder: str | os.PathLike) -> list[Path]:
    """The ``*.safetensors`` files of a model folder (index-listed or globbed); empty when there are none.
    The index is read without following links."""
    path = Path(folder)
    try:
        index = safe_paths.read_file(path, WEIGHTS_INDEX, field="model.hf", limit=_MAX_CONFIG_BYTES * 64)
    except (OSError, ValueError):  # no index (or none readable): the folder's own *.safetensors
        index = None
    listing = [] if index is not None else [entry.name for entry in path.glob("*.safetensors")]
    return [path / name for name in weight_file_names(index, listing, str(folder))]


def weight_file_names(index: bytes | None, listing: Iterable[str], folder: str) -> list[str]:
    """The weight files of a model folder, by name: those its ``model.safetensors.index.json`` (``index``)
    lists, else the ``*.safetensors`` among ``listing``. An index must name plain files of the folder
    itself (``ConfigError`` for ``../x`` or ``sub/x``: nothing outside the folder is read)."""
    if index is None:
        return sorted(name for name in listing if name.endswith(".safetensors"))
    try:
        weight_map = json.loads(index.decode("utf-8")).get("weight_map", {})
        names = set(weight_map.values())
    except (ValueError, AttributeError, TypeError) as exc:
        raise _problem(
            f"{WEIGHTS_INDEX} of model.hf {folder!r} is not a valid index ({exc}).",
            "restore the model's index file, or remove it with a single model.safetensors",
        ) from None
    bad = sorted(
        str(name)
        for name in names
        if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or os.sep in name
    )
    if bad:
        raise _problem(
            f"{WEIGHTS_INDEX} of model.hf {folder!r} names files outside the folder: {', '.join(bad[:8])}.",
            "list only the folder's own *.safetensors files in the index",
        )
    return sorted(names)
