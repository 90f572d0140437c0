"""Hugging Face model folders ↔ :class:`~etrain.workers.protocol.run_config.ModelConfig`, and the parameter-name map.

Pure (stdlib only): the service reads a ``model.hf`` folder's ``config.json`` at submit time to
validate and plan the job without importing torch, and the workers use the same functions to build
the model and to name tensors when they load or export Hugging Face safetensors. The folder's files are
read without following symbolic links (``workers/safe_paths.py``): a link in a ``model.hf`` folder is
refused, whatever it points at.

etrain's modules keep torchtitan's names (``tok_embeddings``, ``layers.<i>.attention.wq``, ...)
because the parallel engine cuts models by those names; :func:`hf_name` / :func:`etrain_name` are the
one place that translates them to ``transformers``' names (``model.embed_tokens``,
``model.layers.<i>.self_attn.q_proj``, ...).
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from etrain.workers import safe_paths
from etrain.workers.protocol.run_config import ModelConfig, RopeScaling
from etrain.workers.protocol.errors import ConfigError

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

#: Hugging Face ``architectures`` entries etrain trains, with what each implies.
SUPPORTED_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"model_type": "llama"},
    "MistralForCausalLM": {"model_type": "mistral"},
    "Qwen2ForCausalLM": {"model_type": "qwen2", "attention_bias": "qkv"},
    "Qwen3ForCausalLM": {"model_type": "qwen3", "qk_norm": True},
}
#: ``seq_len`` when a spec gives none: ``min(max_position_embeddings, 4096)``.
DEFAULT_MAX_SEQ_LEN = 4096
#: Files copied next to an export so the folder tokenizes like the source.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")
_MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few KiB; refuse anything absurd before parsing
#: The index of a sharded save (``save_pretrained``): which file holds each tensor.
WEIGHTS_INDEX = "model.safetensors.index.json"


def _problem(message: str, fix: str) -> ConfigError:
    return ConfigError(message, field="model.hf", fix=fix)


def read_hf_config(folder: str | os.PathLike) -> dict[str, Any]:
    """``config.json`` of a Hugging Face model folder, as a dict; ``ConfigError`` naming ``model.hf``."""
    path = Path(folder)
    try:
        is_dir = stat.S_ISDIR(safe_paths.stat_path(path, field="model.hf").st_mode)
    except (FileNotFoundError, NotADirectoryError):
        is_dir = False
    if not is_dir:
        raise _problem(f"model.hf {str(folder)!r} is not a folder.",
                       "give the path of a Hugging Face model folder (with config.json) readable by the workers")
    config_path = path / "config.json"
    try:
        data = safe_paths.read_file(path, "config.json", field="model.hf", limit=_MAX_CONFIG_BYTES)
    except ValueError:
        raise _problem(f"{config_path} is larger than {_MAX_CONFIG_BYTES} bytes.",
                       "point model.hf at a model folder") from None
    except FileNotFoundError:
        raise _problem(f"model.hf {str(folder)!r} has no config.json.",
                       "give a folder written by transformers' save_pretrained (config.json + *.safetensors)") from None
    except OSError as exc:  # a folder, a special file, unreadable
        raise _problem(f"model.hf {str(folder)!r}: config.json cannot be read ({exc.strerror or exc}).",
                       "give a folder written by transformers' save_pretrained (config.json + *.safetensors)") from None
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
    raise _problem(f"model.hf architecture {found} is not supported.",
                   f"use a model of one of the supported architectures: {', '.join(supported)}")


def _rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)`` from either transformers v4 (``rope_theta`` + ``rope_scaling``) or v5
    (``rope_parameters``) configs."""
    params = dict(raw.get("rope_parameters") or {})
    legacy = raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = {**legacy, **params}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=float(scaling["factor"]))
    if kind == "llama3":
        return theta, RopeScaling(
            kind="llama3",
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
        )
    raise _problem(f"model.hf uses rope scaling {kind!r}, which etrain does not implement.",
                   "use a model with default, linear or llama3 RoPE scaling")


def model_config_from_hf(raw: dict[str, Any], *, seq_len: int | None = None) -> ModelConfig:
    """The :class:`ModelConfig` of a parsed ``config.json``; refuses what etrain cannot train exactly."""
    arch = _architecture(raw)
    traits = SUPPORTED_ARCHITECTURES[arch]
    try:
        d_model = int(raw["hidden_size"])
        n_heads = int(raw["num_attention_heads"])
        sizes = dict(
            n_layers=int(raw["num_hidden_layers"]),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
            d_ff=int(raw["intermediate_size"]),
            vocab_size=int(raw["vocab_size"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise _problem(f"model.hf config.json lacks or mangles a size ({exc}).",
                       "restore the config.json written by transformers") from exc
    max_positions = int(raw.get("max_position_embeddings") or DEFAULT_MAX_SEQ_LEN)
    seq = seq_len if seq_len is not None else min(max_positions, DEFAULT_MAX_SEQ_LEN)
    if seq > max_positions:
        raise ConfigError(f"model.seq_len={seq} exceeds the model's max_position_embeddings={max_positions}.",
                          field="model.seq_len", fix=f"use model.seq_len <= {max_positions}")
    _refuse_unsupported(raw, arch, seq)
    head_dim = raw.get("head_dim")
    theta, scaling = _rope(raw)
    if arch == "LlamaForCausalLM":
        bias = "all" if raw.get("attention_bias") else "none"
    else:
        bias = traits.get("attention_bias", "none")
    return ModelConfig(
        arch="llama",
        seq_len=seq,
        head_dim_override=int(head_dim) if head_dim and int(head_dim) != d_model // n_heads else None,
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        attention_bias=bias,
        qk_norm=bool(traits.get("qk_norm", False)),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=max_positions,
        hf_architecture=arch,
        **sizes,
    )


def _refuse_unsupported(raw: dict[str, Any], arch: str, seq_len: int) -> None:
    """Features that would make etrain's numbers differ from transformers' are refused, not ignored."""
    if raw.get("hidden_act", "silu") != "silu":
        raise _problem(f"model.hf uses hidden_act={raw.get('hidden_act')!r}; etrain's SwiGLU uses silu.",
                       "use a model with hidden_act 'silu'")
    if raw.get("mlp_bias"):
        raise _problem("model.hf has mlp_bias=true, which etrain's SwiGLU does not implement.",
                       "use a model without MLP biases")
    window = raw.get("sliding_window")
    uses_window = arch == "MistralForCausalLM" or raw.get("use_sliding_window") or any(
        t == "sliding_attention" for t in raw.get("layer_types") or [])
    if uses_window and window and seq_len > int(window):
        raise ConfigError(
            f"model.seq_len={seq_len} exceeds the model's sliding_window={window}; etrain runs full causal "
            "attention, which equals sliding-window attention only up to the window.",
            field="model.seq_len", fix=f"use model.seq_len <= {window}")


def hf_config_dict(model: ModelConfig) -> dict[str, Any]:
    """A ``config.json`` for ``model`` that ``transformers.AutoConfig`` reads back to the same sizes."""
    arch = model.hf_architecture or "LlamaForCausalLM"
    if model.arch != "llama" or arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"only Llama-family models export to Hugging Face format, not arch={model.arch!r}.",
                          field="checkpoint.export", fix="set checkpoint.export: none for the built-in GPT")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": model.rope_theta}
    if model.rope_scaling is not None:
        scaling = model.rope_scaling
        rope.update(rope_type=scaling.kind, factor=scaling.factor)
        if scaling.kind == "llama3":
            rope.update(low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor,
                        original_max_position_embeddings=scaling.original_max_position_embeddings)
    config: dict[str, Any] = {
        "architectures": [arch],
        "model_type": SUPPORTED_ARCHITECTURES[arch]["model_type"],
        "hidden_size": model.d_model,
        "intermediate_size": model.ffn_dim,
        "num_hidden_layers": model.n_layers,
        "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.head_dim,
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.max_position_embeddings or model.seq_len,
        "rms_norm_eps": model.norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": model.tie_embeddings,
        "rope_theta": model.rope_theta,  # transformers v4 readers
        "rope_parameters": rope,  # transformers v5 readers
        "torch_dtype": "float32",
    }
    if model.rope_scaling is not None:
        config["rope_scaling"] = dict(rope)
    if arch == "LlamaForCausalLM":
        config["attention_bias"] = model.attention_bias == "all"
        config["mlp_bias"] = False
    if arch == "MistralForCausalLM":
        # etrain trains full causal attention; without this key transformers would apply its
        # default 4096-token sliding window to longer inputs.
        config["sliding_window"] = None
    return config


# -- parameter names -------------------------------------------------------------------------------

_LAYER_MAP = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wo.bias": "self_attn.o_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
_TOP_MAP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight"}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_LAYER_INVERSE = {v: k for k, v in _LAYER_MAP.items()}
_TOP_INVERSE = {v: k for k, v in _TOP_MAP.items()}


def hf_name(fqn: str) -> str:
    """The ``transformers`` name of an etrain Llama parameter (``layers.3.attention.wq.weight`` →
    ``model.layers.3.self_attn.q_proj.weight``)."""
    if fqn in _TOP_MAP:
        return _TOP_MAP[fqn]
    match = _LAYER_RE.match(fqn)
    if match and match.group(2) in _LAYER_MAP:
        return f"model.layers.{match.group(1)}.{_LAYER_MAP[match.group(2)]}"
    raise KeyError(f"no Hugging Face name for parameter {fqn!r}")


def etrain_name(name: str) -> str:
    """The inverse of :func:`hf_name`."""
    if name in _TOP_INVERSE:
        return _TOP_INVERSE[name]
    match = _HF_LAYER_RE.match(name)
    if match and match.group(2) in _LAYER_INVERSE:
        return f"layers.{match.group(1)}.{_LAYER_INVERSE[match.group(2)]}"
    raise KeyError(f"no etrain name for Hugging Face tensor {name!r}")


def hf_parameter_names(model: ModelConfig) -> list[str]:
    """Every etrain FQN of a Llama-family model, in Hugging Face's order (tied output excluded)."""
    names = ["tok_embeddings.weight"]
    biased = {"none": (), "qkv": ("wq", "wk", "wv"), "all": ("wq", "wk", "wv", "wo")}[model.attention_bias]
    for i in range(model.n_layers):
        layer = [f"layers.{i}.attention_norm.weight"]
        for proj in ("wq", "wk", "wv", "wo"):
            layer.append(f"layers.{i}.attention.{proj}.weight")
            if proj in biased:
                layer.append(f"layers.{i}.attention.{proj}.bias")
        if model.qk_norm:
            layer += [f"layers.{i}.attention.q_norm.weight", f"layers.{i}.attention.k_norm.weight"]
        layer += [f"layers.{i}.ffn_norm.weight", f"layers.{i}.feed_forward.w1.weight",
                  f"layers.{i}.feed_forward.w2.weight", f"layers.{i}.feed_forward.w3.weight"]
        names += layer
    names.append("norm.weight")
    if not model.tie_embeddings:
        names.append("output.weight")
    return names


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
        raise _problem(f"{WEIGHTS_INDEX} of model.hf {folder!r} is not a valid index ({exc}).",
                       "restore the model's index file, or remove it with a single model.safetensors") from None
    bad = sorted(str(name) for name in names if not isinstance(name, str) or not name or name in (".", "..")
                 or "/" in name or os.sep in name)
    if bad:
        raise _problem(f"{WEIGHTS_INDEX} of model.hf {folder!r} names files outside the folder: {', '.join(bad[:8])}.",
                       "list only the folder's own *.safetensors files in the index")
    return sorted(names)
