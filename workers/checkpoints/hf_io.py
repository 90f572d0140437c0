"""Hugging Face weights in (``model.hf`` safetensors → a built, possibly sharded model) and out
(a committed etrain checkpoint → a folder ``transformers.AutoModelForCausalLM.from_pretrained`` loads).

Loading (:func:`load_hf_weights`) uses torch's own ``HuggingFaceStorageReader`` with ``dcp.load``
on the model parts' *sharded* state dicts (``get_model_state_dict``: DTensor shards under TP and
FSDP2, plain tensors otherwise), renamed to Hugging Face's names with
:func:`etrain.workers.checkpoints.hf_config.hf_name`. Why DCP rather than reading the files ourselves: DCP's planner
turns each local shard (FSDP2-over-TP 2-D placements and uneven splits included) into read
requests for exactly the rows and columns a rank owns, and the reader serves each one with
``safe_open(...).get_slice(name)[slices]``, a memory-mapped read of that slice only; no rank ever
materialises a full copy of a tensor it shards, and pipeline stages only ask for their own layers
(names stay global, so the files need no re-indexing). Verified on torch 2.13, and asserted by
``tests/integration/test_hf_weights.py`` (elements read per rank == elements of its shards), for
one process, DP2×TP2 with ``replicate`` and with ZeRO-3 plus activation checkpointing, and PP2
stages, so the hand-written ``get_slice`` fallback was not needed. DCP fills the tensors *in place*:
the state dict's tensors (or DTensors' local tensors) share storage with the parameters, so nothing
is copied back (checked after the load; a copy would be an error, not a silent no-op). The files' dtype (bf16, fp16, fp32) is converted to the parameters' by
the copy. (The reader indexes every ``*.safetensors`` file in the folder; only the tensors asked
for are read.)

A mixture of experts' stacked expert parameters (``[n_experts, ...]``, one per projection) are one tensor per
expert in Hugging Face's files (the hub's layout, which ``transformers`` 5's ``save_pretrained`` writes too:
``mlp.experts.<e>.gate_proj.weight``): each rank asks DCP for its experts' tensors only, each read into a view of
its row of the parameter (whole, or FSDP2's ``Shard(0)`` by expert), and an export writes each row as its own
tensor (:meth:`etrain.workers.families.base.ModelFamily.hf_tensors`).

Before any collective, every rank reads the safetensors *headers* (names, shapes, dtypes; no
data) and checks them against the whole model the config describes, so a wrong folder fails with
one ``ConfigError(field="model.hf")`` listing the missing, unexpected and mis-shaped tensors on all
ranks alike, rather than a DCP planner error on some. Two kinds of extra tensors are ignored, as
``transformers`` itself ignores them: ``lm_head.weight`` of a model with tied embeddings (the
output shares the embedding), and RoPE ``inv_freq`` buffers written by old versions.

Files are opened without following symbolic links (``workers/protocol/safe_paths.py``): the weights are read
through a :func:`~etrain.workers.protocol.safe_paths.file_view` (each ``*.safetensors`` opened here, no link on the
way, and handed to safetensors and DCP as its descriptor), the tokenizer files are copied into an export
by contents from descriptors opened the same way, and the export is built and renamed into place through
its parent folder's descriptor. A link in a ``model.hf`` folder (``tokenizer.json`` pointing at the
service's checkpoint key, say) is refused with ``UnsafePathError`` rather than skipped: a model folder with
a link in it is not what its owner thinks it is, and an export silently missing its tokenizer would be
found out much later.

Exporting (:func:`export_hf`) runs in one process without a process group: it verifies the
checkpoint's manifest, then loads the parameters group by group (a group is one output file of at
most ``max_shard_bytes``) as full fp32 tensors with ``dcp.load(..., no_dist=True)`` from DCP's
``FileSystemReader`` (DCP reassembles any saved layout), writes each group as one safetensors file
(cast to ``checkpoint.export_dtype`` tensor by tensor) and frees it, so peak memory is one output shard read
as fp32 (twice the shard for a bf16 export), never the model. The folder is written next to
its destination and renamed into place, so an interrupted export leaves no half folder under the
final name.

Object storage: a checkpoint under ``s3://...`` is read with DCP's ``FsspecReader`` (the same
manifest verification first), and an ``s3://`` destination (a job's ``hf-export`` under an s3
checkpoint root) is written in a local temporary folder, each file uploaded as soon as it is complete
and deleted locally (peak local disk: one output shard); ``config.json`` is uploaded last, so a
destination without it is an interrupted export that ``from_pretrained`` will not mistake for a model.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard

from etrain.workers.checkpoints import storage
from etrain.workers.checkpoints.checkpoint_commit import resolve_latest, step_dir, verify
from etrain.workers.checkpoints.checkpoint_io import storage_reader
from etrain.workers.checkpoints.hf_config import (
    TOKENIZER_FILES,
    WEIGHTS_INDEX,
    hf_config_dict,
    hf_name,
    hf_parameter_names,
    weight_file_names,
)
from etrain.workers.families import family
from etrain.workers.families.model import canonical_fqn
from etrain.workers.protocol import safe_paths
from etrain.workers.protocol.errors import CheckpointError, ConfigError
from etrain.workers.protocol.run_config import ExportDtype, ModelConfig

__all__ = ["HFLoadReport", "expected_shapes", "export_hf", "find_step_dir", "load_hf_weights"]

#: The prefix etrain's checkpoints put before every model FQN
#: (``etrain.workers.checkpoints.checkpoint_state``: {"model": ...}).
_MODEL_PREFIX = "model."
#: safetensors dtypes whose values a float parameter can take as they are.
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
_SINGLE_NAME = "model.safetensors"
#: ``checkpoint.export_dtype`` -> the dtype the export writes (the names: ``run_config.ExportDtype``)
_EXPORT_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_LISTED = 8  # names listed per kind of problem in an error


# -- loading -------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class HFLoadReport:
    """What one rank loaded: ``elements_read`` counts the elements DCP copied out of the files (one
    per element of every slice read), and ``local_elements`` those of the shards the rank holds."""

    tensors: int
    elements_read: int
    local_elements: int


class _CountingPlanner(DefaultLoadPlanner):
    """DCP's default load planner, counting what the reader delivers (``commit_tensor`` is called once
    per slice read, with the filled destination)."""

    elements_read = 0

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        self.elements_read += tensor.numel()
        super().commit_tensor(read_item, tensor)


def load_hf_weights(
    model_parts: Sequence[nn.Module], folder: str | os.PathLike, model_config: ModelConfig
) -> HFLoadReport:
    """Overwrite the parameters of ``model_parts`` with the safetensors weights in ``folder``.

    Collective over the default process group when one is initialized (every rank calls it with its
    own parts: a whole model, or pipeline stages, plain or TP / FSDP2 / DDP-wrapped; activation
    checkpointing wrappers are fine); a plain single-process call without one. Each rank reads only
    the slices it owns. ``ConfigError(field="model.hf")`` when the files do not hold exactly the
    tensors the model needs, with their shapes.
    """
    directory = os.fspath(folder)
    if not family(model_config.arch).has_hf_format:
        raise ConfigError(
            f"Hugging Face weights load into models of a Hugging Face family, not arch={model_config.arch!r}.",
            field="model.hf",
            fix="give model.hf alone: its config.json says which family loads it",
        )
    with _weights_view(directory) as view:
        return _load_from(view, directory, model_parts, model_config)


@contextlib.contextmanager
def _weights_view(directory: str) -> Iterator[str]:
    """The folder's weight files and index, each opened without links (:func:`safe_paths.file_view`)."""

    def weight_entry(name: str) -> bool:
        return name.endswith(".safetensors") or name == WEIGHTS_INDEX

    with contextlib.ExitStack() as stack:
        try:
            view = stack.enter_context(safe_paths.file_view(directory, field="model.hf", select=weight_entry))
        except (FileNotFoundError, NotADirectoryError):
            raise ConfigError(
                f"model.hf {directory!r} is not a folder.",
                field="model.hf",
                fix="give the path of a Hugging Face model folder readable by the workers",
            ) from None
        yield view


def _load_from(view: str, directory: str, model_parts: Sequence[nn.Module], model_config: ModelConfig) -> HFLoadReport:
    """:func:`load_hf_weights` reading the checked files of ``directory`` through ``view``."""
    _check_weights(_read_headers(view, directory), model_config)
    tied = model_config.tie_embeddings
    found = family(model_config.arch)
    state: dict[str, torch.Tensor] = {}
    part_states: list[tuple[nn.Module, dict[str, torch.Tensor]]] = []
    for part in model_parts:
        part_state = {canonical_fqn(k): v for k, v in get_model_state_dict(part).items()}
        part_states.append((part, part_state))
        for fqn, tensor in part_state.items():
            if tied and fqn == "output.weight":
                continue  # the embedding's tensor; the file has no lm_head.weight
            if found.expert_template(fqn) is not None:
                pieces = _expert_slices(found, fqn, tensor, model_config)
            else:
                pieces = {hf_name(fqn, model_config.arch): tensor}
            for name, piece in pieces.items():
                if name in state:
                    raise ConfigError(
                        f"two model parts both hold {fqn!r}.",
                        field="model.hf",
                        fix="pass each pipeline stage's module once",
                    )
                state[name] = piece
    planner = _CountingPlanner()
    with _quiet_single_process():
        dcp.load(state, storage_reader=HuggingFaceStorageReader(view), planner=planner, no_dist=not _distributed())
    for part, part_state in part_states:
        if not _filled_in_place(part, part_state):
            # get_model_state_dict returns views of the parameters for every wrapper etrain uses;
            # a wrapper that copies would silently leave the seeded weights, so refuse loudly.
            raise RuntimeError(
                "DCP did not load the Hugging Face weights into the parameters in place "
                f"(a {type(part).__name__} state dict that copies); nothing was loaded"
            )
    return HFLoadReport(
        tensors=len(state),
        elements_read=planner.elements_read,
        local_elements=sum(_local(t).numel() for t in state.values()),
    )


def _expert_slices(found: Any, fqn: str, tensor: torch.Tensor, model_config: ModelConfig) -> dict[str, torch.Tensor]:
    """The per-expert Hugging Face tensors a rank reads into its part of stacked expert parameter ``fqn``:
    ``{name of expert e: view of its row e}`` for the experts it holds. The views share the parameter's
    storage (DCP fills them in place). Whole on one rank, or sharded by experts (FSDP2's ``Shard(0)``, HSDP's
    ``(Replicate, Shard(0))``, expert parallelism's): each rank names only its own experts, so it reads only
    their tensors. Split by width too (expert tensor parallelism: ``Shard(1)``/``Shard(2)`` over tp), each
    view is a DTensor of that expert's tensor, sharded the same way one dimension down, so DCP reads only
    this rank's slice of it."""
    local = _local(tensor)
    first = 0
    views: list[torch.Tensor] = [local[i] for i in range(local.shape[0])]
    if isinstance(tensor, DTensor):
        if any(p.is_partial() for p in tensor.placements):
            raise ConfigError(
                f"{fqn} is a partial sum ({tensor.placements}); stacked experts load whole or sharded.",
                field="model.hf",
            )
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        first = offset[0]
        if any(p.is_shard() and p.dim != 0 for p in tensor.placements):
            # one expert's tensor: the experts' split (dim 0) does not apply to it, the width's moves down a dim
            placements = [
                Shard(p.dim - 1) if p.is_shard() and p.dim != 0 else Replicate() if p.is_shard() else p
                for p in tensor.placements
            ]
            whole = tuple(tensor.shape[1:])
            views = [
                DTensor.from_local(
                    view, tensor.device_mesh, placements, run_check=False, shape=whole, stride=_strides(whole)
                )
                for view in views
            ]
    names = found.hf_tensors(fqn, tuple(tensor.shape), model_config)
    return {names[first + i][0]: view for i, view in enumerate(views)}


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Contiguous strides of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _hf_shapes(model_config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """``{Hugging Face name: shape}`` of every tensor of the model's files (a stacked expert parameter as
    one tensor per expert), in Hugging Face's order."""
    found = family(model_config.arch)
    return {
        name: shape
        for fqn, whole in expected_shapes(model_config).items()
        for name, shape, _ in found.hf_tensors(fqn, whole, model_config)
    }


def _read_headers(view: str, directory: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{name: (shape, safetensors dtype)}`` of every tensor in the folder's weight files (headers only),
    read through ``view`` (:func:`_weights_view`: its entries are the checked files; errors name ``directory``)."""
    from safetensors import SafetensorError, safe_open

    try:
        index = (Path(view) / WEIGHTS_INDEX).read_bytes()  # the view's own link to the checked index
    except FileNotFoundError:
        index = None
    files = [Path(view) / name for name in weight_file_names(index, os.listdir(view), directory)]
    if not files:
        raise ConfigError(
            f"model.hf {directory!r} has no *.safetensors weight files.",
            field="model.hf",
            fix="save the model with save_pretrained(..., safe_serialization=True)",
        )
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in files:
        if not path.is_file():
            raise ConfigError(
                f"{path.name} is listed in {WEIGHTS_INDEX} of {directory!r} but missing.",
                field="model.hf",
                fix="download the model's weight files completely",
            )
        try:
            with safe_open(str(path), framework="pt") as stream:
                for name in stream.keys():
                    piece = stream.get_slice(name)
                    found[name] = (tuple(piece.get_shape()), str(piece.get_dtype()))
        except (OSError, SafetensorError) as exc:
            raise ConfigError(
                f"cannot read {os.path.join(directory, path.name)}: {exc}",
                field="model.hf",
                fix="restore the model's safetensors files",
            ) from exc
    return found


def _ignored(name: str, model_config: ModelConfig) -> bool:
    return (model_config.tie_embeddings and name == "lm_head.weight") or name.endswith("rotary_emb.inv_freq")


def _check_weights(found: dict[str, tuple[tuple[int, ...], str]], model_config: ModelConfig) -> None:
    expected = _hf_shapes(model_config)
    found = {name: entry for name, entry in found.items() if not _ignored(name, model_config)}
    missing = sorted(expected.keys() - found.keys())
    extra = sorted(found.keys() - expected.keys())
    mismatched = [
        f"{name} {list(found[name][0])} (model needs {list(expected[name])})"
        for name in sorted(expected.keys() & found.keys())
        if found[name][0] != expected[name]
    ]
    odd_dtypes = [
        f"{name} ({dtype})"
        for name, (_, dtype) in sorted(found.items())
        if name in expected and dtype not in _FLOAT_DTYPES
    ]
    problems = []
    for label, names in (
        ("missing", missing),
        ("unexpected", extra),
        ("with the wrong shape", mismatched),
        ("not float16/bfloat16/float32 (quantized?)", odd_dtypes),
    ):
        if names:
            shown = ", ".join(names[:_LISTED]) + (f" and {len(names) - _LISTED} more" if len(names) > _LISTED else "")
            problems.append(f"{len(names)} tensors {label}: {shown}")
    if problems:
        raise ConfigError(
            f"model.hf weights do not match the {model_config.hf_architecture or model_config.arch} model its "
            "config.json "
            f"describes: {'; '.join(problems)}.",
            field="model.hf",
            fix="point model.hf at an unquantized save_pretrained folder whose config.json and safetensors belong "
            "together (and leave model sizes to the folder's config.json)",
        )


def expected_shapes(model_config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """``{etrain FQN: shape}`` of every parameter of the whole model, in Hugging Face's order (tied
    output excluded), from a meta-device build (allocates nothing)."""
    from etrain.workers.families.model import build_model_skeleton

    with torch.device("meta"):
        skeleton = build_model_skeleton(model_config)
    shapes = {canonical_fqn(name): tuple(p.shape) for name, p in skeleton.named_parameters()}
    return {fqn: shapes[fqn] for fqn in hf_parameter_names(model_config)}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _filled_in_place(part: nn.Module, part_state: dict[str, torch.Tensor]) -> bool:
    """Whether every loaded tensor shares storage with the parameter of its name (DCP wrote into it)."""
    params = {canonical_fqn(name): p for name, p in part.named_parameters(remove_duplicate=False)}
    params.update((canonical_fqn(name), b) for name, b in part.named_buffers(remove_duplicate=False))
    for fqn, tensor in part_state.items():
        param = params.get(fqn)
        if param is None:
            return False
        loaded, own = _local(tensor), _local(param)
        if own.numel() and loaded.untyped_storage().data_ptr() != own.untyped_storage().data_ptr():
            return False
    return True


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


# -- exporting -----------------------------------------------------------------------------------


def find_step_dir(checkpoint_root: str | os.PathLike, step: int | None = None) -> str:
    """The newest committed, verifying step directory under ``checkpoint_root`` (or that of ``step``).

    ``CheckpointError`` says why none qualifies (nothing committed, or each newer one's defect).
    """
    root = os.fspath(checkpoint_root)
    if step is not None:
        directory = step_dir(root, step)
        verify(directory)  # CheckpointError: not committed, or corrupt
        return directory
    found = resolve_latest(root)
    if found.step_dir is None:
        reasons = "; ".join(f"step {s.step}: {s.reason}" for s in found.skipped)
        raise CheckpointError(
            f"no committed checkpoint under {root}" + (f" ({reasons})" if reasons else ""),
            fix="export from the checkpoint root of a run that has saved at least once",
        )
    return found.step_dir


def export_hf(
    step_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    model_config: ModelConfig,
    *,
    source_dir: str | os.PathLike | None = None,
    max_shard_bytes: int = 2 << 30,
    expect_digest: str | None = None,
    dtype: ExportDtype = "float32",
) -> str:
    """Write the model of a committed checkpoint as a Hugging Face folder; returns its absolute path.

    ``dtype`` (``checkpoint.export_dtype``, :data:`~etrain.workers.protocol.run_config.ExportDtype`): ``float32`` keeps
    the fp32 master weights exactly; ``bfloat16`` (or ``float16``) rounds each to nearest, half the bytes, as
    Hugging Face releases ship (``config.json``'s ``torch_dtype`` says which).

    ``out_dir`` gets ``config.json``, the weights (``model.safetensors``, or
    ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` past ``max_shard_bytes``)
    and the tokenizer files of ``source_dir`` (default ``model_config.hf_path``) when it has them.
    Single process; never holds more than one output file's tensors (read as fp32). Refuses a non-empty ``out_dir``
    (``ConfigError``, field ``checkpoint.export``) and an uncommitted or corrupt checkpoint
    (``CheckpointError``).

    ``expect_digest``: the digest of the manifest the service verified with its key (the service always
    passes it). Whoever can write the checkpoint folder can rewrite an unsigned manifest to list a
    pickle of their own as ``.metadata``; with the digest, nothing is read unless the manifest is the
    signed one. ``None`` (a local tool on one's own files) checks the checksums only.
    """
    directory = os.fspath(step_dir)  # a URL string is returned as is
    if dtype not in _EXPORT_TORCH_DTYPES:
        raise ConfigError(
            f"checkpoint.export_dtype={dtype!r} is not a dtype the export writes.",
            field="checkpoint.export_dtype",
            fix=f"use one of {', '.join(_EXPORT_TORCH_DTYPES)}",
        )
    config = {**hf_config_dict(model_config), "torch_dtype": dtype}  # refuses what cannot be exported, before any work
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    if storage.is_url(out_dir):
        return _export_to_url(
            directory, storage.normalize_url(out_dir), model_config, config, source_dir, max_shard_bytes, expect_digest
        )
    out = os.path.abspath(os.fspath(out_dir))
    _check_destination(out)
    verify(directory, expect_digest=expect_digest)
    shapes = _checkpoint_shapes(directory, model_config)
    parent, name = os.path.split(out)
    folder = safe_paths.open_dir(parent, field="checkpoint.export", create=True)
    try:
        _export_into(
            folder,
            parent,
            name,
            directory,
            shapes,
            config,
            model_config,
            source_dir if source_dir is not None else model_config.hf_path,
            max_shard_bytes,
        )
    finally:
        os.close(folder)
    return out


def _check_destination(out: str) -> None:
    """An export never overwrites: ``out`` must be absent or an empty folder, and no link (refused)."""
    try:
        found = safe_paths.stat_path(out, field="checkpoint.export")
    except (FileNotFoundError, NotADirectoryError):
        return
    if not stat.S_ISDIR(found.st_mode) or safe_paths.list_names(out, field="checkpoint.export"):
        raise ConfigError(
            f"export destination {out} already exists and is not empty.",
            field="checkpoint.export",
            fix="export into a new or empty folder; exports never overwrite",
        )


def _export_into(
    folder: int,
    parent: str,
    name: str,
    directory: str,
    shapes: dict[str, tuple[int, ...]],
    config: dict[str, Any],
    model_config: ModelConfig,
    source: str | os.PathLike | None,
    max_shard_bytes: int,
) -> None:
    """Build the export in ``<name>.tmp-<pid>`` beside it and rename it into place, all through the
    parent folder's descriptor ``folder``; the files are written through the temporary folder's own
    descriptor (:func:`safe_paths.descriptor_path`), so a path swapped meanwhile redirects nothing. The
    rename replaces an empty folder and fails on anything else (a link put there since the check included)."""
    tmp_name = f"{name}.tmp-{os.getpid()}"
    safe_paths.remove_tree_inside(folder, tmp_name, field="checkpoint.export")  # an interrupted try of this process id
    os.mkdir(tmp_name, dir_fd=folder)
    try:
        tmp_fd = safe_paths.open_inside(folder, tmp_name, os.O_RDONLY | os.O_DIRECTORY, field="checkpoint.export")
        try:
            tmp = safe_paths.descriptor_path(tmp_fd, os.path.join(parent, tmp_name))
            _copy_tokenizer_files(source, tmp_fd)
            _write_weights(
                directory, tmp, shapes, max_shard_bytes, model_config, _EXPORT_TORCH_DTYPES[config["torch_dtype"]]
            )
            _write_json(os.path.join(tmp, "config.json"), config)
            os.fsync(tmp_fd)
        finally:
            os.close(tmp_fd)
        os.rename(tmp_name, name, src_dir_fd=folder, dst_dir_fd=folder)
        os.fsync(folder)
    except BaseException:
        with contextlib.suppress(Exception):
            safe_paths.remove_tree_inside(folder, tmp_name, field="checkpoint.export")
        raise


def _copy_tokenizer_files(source: str | os.PathLike | None, dest: str | int) -> list[str]:
    """Copy the :data:`TOKENIZER_FILES` that ``source`` (``model.hf``) has into ``dest`` (a folder's path or
    descriptor), by contents from descriptors opened without links; first, so a link is refused before
    any weight is written or uploaded. The names copied."""
    if source is None:
        return []
    return [name for name in TOKENIZER_FILES if safe_paths.copy_file_inside(source, name, dest, name, field="model.hf")]


def _export_to_url(
    directory: str,
    out: str,
    model_config: ModelConfig,
    config: dict[str, Any],
    source_dir: str | os.PathLike | None,
    max_shard_bytes: int,
    expect_digest: str | None,
) -> str:
    """:func:`export_hf` into an object-store prefix: files built locally, uploaded one by one, config last."""
    import tempfile

    if storage.walk_files(out):
        raise ConfigError(
            f"export destination {out} already holds objects.",
            field="checkpoint.export",
            fix="export into a new or empty prefix; exports never overwrite",
        )
    verify(directory, expect_digest=expect_digest)
    shapes = _checkpoint_shapes(directory, model_config)
    tmp = tempfile.mkdtemp(prefix="etrain-export-")

    def upload(path: str) -> None:
        storage.upload(path, storage.join(out, os.path.basename(path)))
        os.remove(path)

    try:
        for name in _copy_tokenizer_files(source_dir if source_dir is not None else model_config.hf_path, tmp):
            upload(os.path.join(tmp, name))
        _write_weights(
            directory,
            tmp,
            shapes,
            max_shard_bytes,
            model_config,
            _EXPORT_TORCH_DTYPES[config["torch_dtype"]],
            on_file=upload,
        )
        _write_json(os.path.join(tmp, "config.json"), config)
        upload(os.path.join(tmp, "config.json"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _checkpoint_shapes(directory: str, model_config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """``{etrain FQN: shape}`` to export, checked against what the checkpoint holds."""
    metadata = storage_reader(directory).read_metadata().state_dict_metadata
    expected = expected_shapes(model_config)
    stored = {key[len(_MODEL_PREFIX) :]: entry for key, entry in metadata.items() if key.startswith(_MODEL_PREFIX)}
    missing = [fqn for fqn in expected if fqn not in stored]
    mismatched = [
        f"{fqn} {list(stored[fqn].size)} (config says {list(shape)})"
        for fqn, shape in expected.items()
        if fqn in stored and tuple(stored[fqn].size) != shape
    ]
    # A tied model's checkpoint may list output.weight (the embedding's tensor); it is not exported.
    extra = sorted(set(stored) - set(expected) - ({"output.weight"} if model_config.tie_embeddings else set()))
    if missing or mismatched or extra:
        details = [
            f"{label}: {', '.join(names[:_LISTED])}"
            for label, names in (("missing", missing), ("wrong shape", mismatched), ("unexpected", extra))
            if names
        ]
        raise ConfigError(
            f"checkpoint {directory} does not hold the model its config describes ({'; '.join(details)}).",
            field="checkpoint.export",
            fix="export with the model config of the run that wrote this checkpoint",
        )
    return expected


def _shard_groups(shapes: dict[str, tuple[int, ...]], max_shard_bytes: int, element_size: int) -> list[list[str]]:
    """Parameters in order, cut into runs of at most ``max_shard_bytes`` bytes as written (``element_size`` a value;
    a larger single tensor gets a file of its own), like ``transformers``' ``save_pretrained(max_shard_size=...)``."""
    groups: list[list[str]] = [[]]
    size = 0
    for fqn, shape in shapes.items():
        nbytes = element_size * _numel(shape)
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(fqn)
        size += nbytes
    return groups


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _hf_tensors(
    tensors: dict[str, torch.Tensor], model_config: ModelConfig, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """A group of whole etrain parameters under their Hugging Face names, as ``dtype``: a stacked expert parameter
    as one tensor per expert (copies: safetensors refuses tensors that share memory), the hub's layout. Takes the
    fp32 tensors out of ``tensors`` one by one, so a cast group holds little more than its fp32 reading at once.
    A float16 export refuses a weight beyond float16's range (it would be written as inf)."""
    found = family(model_config.arch)
    named: dict[str, torch.Tensor] = {}
    for fqn in list(tensors):
        tensor = tensors.pop(fqn)
        for name, _, expert in found.hf_tensors(fqn, tuple(tensor.shape), model_config):
            piece = tensor if expert is None else tensor[expert]
            named[name] = piece.clone() if expert is not None and dtype == torch.float32 else piece.to(dtype)
            if dtype == torch.float16 and named[name].isinf().any():  # rounding never makes inf: only range does
                raise ConfigError(
                    f"checkpoint.export_dtype='float16': {fqn} holds a weight of magnitude "
                    f"{tensor.abs().max().item():.4g}, beyond float16's {torch.finfo(torch.float16).max:g} (it would "
                    "be written as inf).",
                    field="checkpoint.export_dtype",
                    fix="export in bfloat16 (float32's range) or float32",
                )
    return named


def _write_weights(
    directory: str,
    tmp: str,
    shapes: dict[str, tuple[int, ...]],
    max_shard_bytes: int,
    model_config: ModelConfig,
    dtype: torch.dtype,
    on_file=None,
) -> None:
    """``on_file(path)``: called with each file once written (the URL export uploads and deletes it). Each group
    (one output file of at most ``max_shard_bytes`` as written) is read as fp32 (the checkpoint's) and written as
    ``dtype`` (rounded to nearest), cast tensor by tensor."""
    from safetensors.torch import save_file

    groups = _shard_groups(shapes, max_shard_bytes, torch.empty((), dtype=dtype).element_size())
    weight_map: dict[str, str] = {}
    total = 0
    for index, group in enumerate(groups, start=1):
        name = _SINGLE_NAME if len(groups) == 1 else f"model-{index:05d}-of-{len(groups):05d}.safetensors"
        tensors = {fqn: torch.empty(shapes[fqn], dtype=torch.float32) for fqn in group}
        with _quiet_single_process():
            dcp.load({"model": tensors}, storage_reader=storage_reader(directory), no_dist=True)
        named = _hf_tensors(tensors, model_config, dtype)
        path = os.path.join(tmp, name)
        save_file(named, path, metadata={"format": "pt"})
        _fsync(path)
        for hf in named:
            weight_map[hf] = name
        total += sum(t.numel() * t.element_size() for t in named.values())
        del tensors, named  # the next group reuses this memory
        if on_file is not None:
            on_file(path)
    if len(groups) > 1:
        _write_json(os.path.join(tmp, WEIGHTS_INDEX), {"metadata": {"total_size": total}, "weight_map": weight_map})
        if on_file is not None:
            on_file(os.path.join(tmp, WEIGHTS_INDEX))


def _write_json(path: str, payload: dict[str, Any]) -> None:
    with open(path, "w") as stream:
        json.dump(payload, stream, indent=2, sort_keys=True)
        stream.write("\n")
        stream.flush()
        os.fsync(stream.fileno())


def _fsync(path: str) -> None:
    with open(path, "rb") as stream:
        os.fsync(stream.fileno())
