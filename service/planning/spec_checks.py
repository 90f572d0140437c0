"""The rules that tie a spec's fields together, checked at submit: every problem at once.

:func:`check_spec` runs them in order: the field bounds again (:func:`field_problems`, for a spec that
skipped validation), the model (``model.hf`` and the preset / kind / sizes that go with it), the data
paths and tokenizer, the batch (``etrain.workers.protocol.layout_rules.batch_problems``: the same rule the
engine applies), warm-up, the elastic range and the world size, and the supervisor's own settings
(built here as the supervisor builds them). The layout rules and memory are the planner's
(``service/planning/planner.py``), which calls the same ``layout_rules``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any

from pydantic import BaseModel

from etrain.service.planning.bounds import MAX_WORKERS
from etrain.service.planning.spec import _HF_EXCLUSIVE_FIELDS, JobSpec, ParallelismSpec, SpecProblem
from etrain.workers import families
from etrain.workers.families import MODEL_PRESETS
from etrain.workers.protocol import layout_rules
from etrain.workers.protocol.errors import ConfigError

__all__ = ["check_spec", "field_problems"]


def field_problems(spec: JobSpec) -> list[SpecProblem]:
    """The field rules (types, bounds) checked again on a spec that may not have been validated
    (``model_construct``, ``model_copy(update=...)``): nothing downstream (the planner's searches, the
    supervisor's rules) may see an unbounded size. Empty for any spec that came through validation."""
    from pydantic import ValidationError

    try:
        JobSpec.model_validate(spec.model_dump(by_alias=True, round_trip=True))
    except ValidationError as err:
        problems = []
        for error in err.errors():
            loc = _branch_of(spec, error["loc"])
            if loc is None:
                continue  # an error of a union branch the spec does not use
            field = ".".join(loc) or "spec"
            given = error.get("input")
            shown = f"={given!r}" if isinstance(given, (int, float, str)) and len(repr(given)) <= 80 else ""
            problems.append(
                SpecProblem(
                    field=field,
                    message=f"{field}{shown}: {error['msg']}.",
                    fix="see the bounds in docs/job-spec.md (service/planning/bounds.py)",
                )
            )
        return problems or [SpecProblem(field="spec", message=str(err), fix=None)]
    return []


def _branch_of(spec: JobSpec, loc: tuple) -> list[str] | None:
    """A pydantic error location as the spec's field path, or None when it is about a union branch
    (named in the location: "ParallelismSpec", "literal['auto']") other than the one the spec holds."""
    path: list[str] = []
    value: Any = spec
    for part in map(str, loc):
        if part[:1].isupper() or "[" in part:
            held = "literal" if isinstance(value, str) else type(value).__name__
            if not part.startswith(held):
                return None
            continue
        path.append(part)
        value = getattr(value, part, None) if isinstance(value, BaseModel) else None
    return path


def check_spec(spec: JobSpec) -> list[SpecProblem]:
    """Cross-field rules of the spec itself (the planner adds layout and memory rules).

    Starts with :func:`field_problems`: a spec whose fields are out of bounds gets only those
    problems, at once, before any rule that searches or sizes anything runs."""
    problems = field_problems(spec)
    if problems:
        return problems
    problems = _model_problems(spec)
    model = {} if problems else spec.model.resolved()  # the model-dependent rules need a readable model
    if spec.data.kind in ("text", "tokens"):
        if not spec.data.path:
            problems.append(
                SpecProblem(
                    field="data.path",
                    message=f"data.kind={spec.data.kind!r} needs a data.path.",
                    fix="give a file or folder path readable by the workers, or use data.kind='synthetic'",
                )
            )
        elif not os.path.exists(spec.data.path):
            problems.append(
                SpecProblem(
                    field="data.path",
                    message=f"data.path {spec.data.path!r} does not exist.",
                    fix="give an existing file or folder (relative paths are relative to the server's directory)",
                )
            )
    problems += _tokenizer_problems(spec, model.get("vocab_size"))
    if model and spec.data.kind == "text" and not spec.data.tokenizer and (model.get("vocab_size") or 0) < 256:
        problems.append(
            SpecProblem(
                field="model.vocab_size",
                message=f"data.kind='text' uses byte tokens (256 values) but model.vocab_size={model.get('vocab_size')}.",
                fix="set model.vocab_size to at least 256",
            )
        )
    problems += _float8_problems(spec)
    if spec.is_auto:
        return problems + _policy_problems(spec, problems)
    layout = spec.layout
    training = spec.training
    problems += SpecProblem.of(
        layout_rules.batch_problems(
            global_batch=training.global_batch,
            micro_batch=training.micro_batch,
            dp=layout.dp,
            microbatches=layout.microbatches,
        )
    )
    if training.warmup_steps > training.steps:
        problems.append(
            SpecProblem(
                field="training.warmup_steps",
                message=f"training.warmup_steps={training.warmup_steps} exceeds training.steps={training.steps}.",
                fix="use warmup_steps <= steps",
            )
        )
    min_dp, max_dp = spec.min_dp, spec.max_dp
    if not min_dp <= layout.dp <= max_dp:
        problems.append(
            SpecProblem(
                field="resources.min_dp",
                message=f"need resources.min_dp <= parallelism.dp <= resources.max_dp, got {min_dp} <= {layout.dp} <= {max_dp}.",
                fix="set min_dp at most dp and max_dp at least dp",
            )
        )
    if spec.resources.device == "cuda" and spec.resources.gpus_per_worker <= 0:
        problems.append(
            SpecProblem(
                field="resources.gpus_per_worker",
                message="resources.device='cuda' needs resources.gpus_per_worker > 0.",
                fix="set gpus_per_worker: 1 (one GPU per rank)",
            )
        )
    problems += _world_problems(spec)
    problems += _policy_problems(spec, problems)
    return problems


def _float8_problems(spec: JobSpec) -> list[SpecProblem]:
    if not spec.training.float8:
        return []
    tp = 1 if spec.is_auto else spec.layout.tp
    sequence_parallel = False if spec.is_auto else spec.layout.sequence_parallel
    problems = SpecProblem.of(
        layout_rules.float8_problems(
            device=spec.resources.device, precision=spec.training.precision, tp=tp, sequence_parallel=sequence_parallel
        )
    )
    if importlib.util.find_spec("torchao") is None:
        problems.append(
            SpecProblem(
                field="training.float8",
                message="training.float8 needs torchao, which is not installed where etrain runs.",
                fix="pip install 'etrain[float8]' on the server and the Ray workers, or set training.float8: false",
            )
        )
    return problems


def _world_problems(spec: JobSpec) -> list[SpecProblem]:
    """dp·cp·tp·pp ranks, now and at the elastic ceiling, within MAX_WORKERS (each degree is bounded alone)."""
    layout = spec.layout
    problems = []
    for field, dp in (("parallelism", layout.dp), ("resources.max_dp", spec.max_dp)):
        world = layout_rules.world_size(pp=layout.pp, dp=dp, tp=layout.tp, cp=layout.cp)
        if world > MAX_WORKERS:
            cp = f"·{layout.cp}" if layout.cp > 1 else ""
            problems.append(
                SpecProblem(
                    field=field,
                    message=f"{'dp' if field == 'parallelism' else 'resources.max_dp'}{'·cp' if cp else ''}·tp·pp = "
                    f"{dp}{cp}·{layout.tp}·{layout.pp} = {world} ranks, more than this service runs in one job "
                    f"({MAX_WORKERS}).",
                    fix=f"use at most {MAX_WORKERS} ranks: lower "
                    + ("parallelism.dp, cp, tp or pp" if field == "parallelism" else "resources.max_dp"),
                )
            )
            break
    return problems


def _policy_fields() -> dict[str, str]:
    """Settings of the supervisor (service/decisions/supervisor_state.py ``SupervisorConfig``, its policy
    service/decisions/job_policy.py, service/decisions/elastic.py) -> the spec field they come from."""
    from etrain.service.decisions.job_policy import FROM_SPEC

    return {
        "total_steps": "training.steps",
        "global_batch": "training.global_batch",
        "micro_batch": "training.micro_batch",
        "dp": "parallelism.dp",
        "dp_replicate": "parallelism.dp_replicate",
        "tp": "parallelism.tp",
        **{name: fields[0] for name, fields in FROM_SPEC.items()},
    }


_BATCH_FIELDS = frozenset(
    {
        "training.global_batch",
        "training.micro_batch",
        "resources.min_dp",
        "resources.max_dp",
        "parallelism.dp",
        "parallelism",
    }
)


def _policy_problems(spec: JobSpec, found: list[SpecProblem]) -> list[SpecProblem]:
    """The rules the job's supervisor enforces when it is created, run here, at submit, by building the
    same objects: its policy (``policy_for``: ``StragglerConfig``) and ``SupervisorConfig`` (steps,
    restarts, timeouts, ``backoff_max_s >= backoff_base_s``, the elastic dp range: ``ElasticPolicy`` and
    the initial dp). A spec they refuse is a 422 naming the field, never a job that is recorded and then
    fails to start.

    An auto spec is checked with one rank (min_dp = max_dp = dp = 1) until the planner has chosen its
    layout (the manager checks the resolved spec again). Batch/dp problems ``check_spec`` already
    reported are not reported twice, and a dp that dp_replicate does not divide is left to the
    planner's rule, whose message says more.
    """
    from etrain.service.decisions.job_policy import policy_for
    from etrain.service.decisions.stragglers import StragglerConfigError
    from etrain.service.decisions.supervisor_state import SupervisorConfig, SupervisorConfigError, initial_state

    training = spec.training
    try:
        if spec.is_auto:
            tp = pp = dp = multiple = 1
            policy = dataclasses.replace(policy_for(spec.with_layout(ParallelismSpec())), min_dp=1, max_dp=1)
        else:
            layout = spec.layout
            tp, pp, dp = layout.tp, layout.pp, layout.dp
            replicate = 1 if layout_rules.dp_replicate_problems(dp, layout.dp_replicate) else layout.dp_replicate
            ep = layout.ep if dp % layout.ep == 0 else 1  # an ep that does not divide dp is the planner's problem
            multiple = layout_rules.dp_multiple(dp_replicate=replicate, ep=ep)
            policy = policy_for(spec)
    except StragglerConfigError as err:  # the spec's bounds are as tight; a rule StragglerConfig adds is still a 422
        return [SpecProblem(field="stragglers", message=f"stragglers: {err.message}.", fix=err.fix)]
    problems: list[SpecProblem] = []
    try:
        config = SupervisorConfig(
            total_steps=training.steps,
            global_batch=training.global_batch,
            micro_batch=training.micro_batch,
            policy=policy,
            tp=tp,
            pp=pp,
            dp_multiple=multiple,
        )
        initial_state(config, dp=dp)
    except SupervisorConfigError as err:
        field = _policy_fields().get(err.field or "", "fault_tolerance")
        if not (field in _BATCH_FIELDS and any(p.field in _BATCH_FIELDS for p in found)):
            problems.append(
                SpecProblem(field=field, message=f"{field}: {err.message}.", fix=err.fix or _POLICY_FIX.get(field))
            )
    return problems


_POLICY_FIX = {
    "fault_tolerance.backoff_max_s": "set fault_tolerance.backoff_max_s at least fault_tolerance.backoff_base_s "
    "(the backoff doubles from base up to max)",
    "resources.min_dp": "widen resources.min_dp..max_dp to include a dp that divides "
    "training.global_batch / training.micro_batch",
    "training.global_batch": "make training.global_batch a multiple of training.micro_batch",
}


def _tokenizer_problems(spec: JobSpec, vocab_size: int | None) -> list[SpecProblem]:
    """``data.tokenizer``: text data only, a readable tokenizer.json, and ids the model can embed.

    Reading the tokenizer needs ``tokenizers`` (no torch); the tokenizing itself happens at submit
    (``JobManager``), bounded, or ahead of it with ``etrain prepare-data``.
    """
    data = spec.data
    if not data.tokenizer:
        return []
    if data.kind != "text":
        return [
            SpecProblem(
                field="data.tokenizer",
                message=f"data.tokenizer applies to data.kind='text' only, not {data.kind!r}.",
                fix="remove data.tokenizer, or set data.kind: text",
            )
        ]
    from etrain.workers.engine.tokenized import tokenizer_info
    from etrain.workers.protocol.errors import DataError

    try:
        info = tokenizer_info(data.tokenizer)
    except DataError as err:
        return [SpecProblem(field="data.tokenizer", message=err.message, fix=err.fix)]
    if vocab_size is not None and info.vocab_size > vocab_size:
        return [
            SpecProblem(
                field="data.tokenizer",
                message=f"data.tokenizer {info.path} has {info.vocab_size} token ids but model.vocab_size={vocab_size}: "
                f"ids >= {vocab_size} have no embedding.",
                fix=f"set model.vocab_size to at least {info.vocab_size} (e.g. {-(-info.vocab_size // 64) * 64}), "
                "or use the tokenizer the model was trained with",
            )
        ]
    return []


def _model_problems(spec: JobSpec) -> list[SpecProblem]:
    """``model`` (and ``checkpoint.export``, which depends on it): exclusive fields, kind vs preset or folder,
    and what the ``model.hf`` folder's config.json allows. Reading the folder happens here, after
    :func:`resolve_paths`, so a bad folder is one 422 naming ``model.hf``, never a 500. What each kind
    allows is its family's declaration (``etrain.workers.families``)."""
    model = spec.model
    problems: list[SpecProblem] = []
    if model.hf is not None:
        for name in _HF_EXCLUSIVE_FIELDS:
            if getattr(model, name) is not None:
                problems.append(
                    SpecProblem(
                        field=f"model.{name}",
                        message=f"model.hf and model.{name} are exclusive: the model's sizes come from "
                        f"{model.hf}/config.json.",
                        fix=f"remove model.{name} (only model.seq_len and model.router_aux_loss_coef may be "
                        "given with model.hf)",
                    )
                )
        if problems:
            return problems
    elif model.preset is not None:
        preset_kind = MODEL_PRESETS[model.preset]["arch"]
        if preset_kind != model.kind:
            problems.append(
                SpecProblem(
                    field="model.kind",
                    message=f"model.kind={model.kind!r} but model.preset={model.preset!r} is a {preset_kind} model.",
                    fix=f"remove model.kind, or choose a {model.kind} preset",
                )
            )
    kind = families.family(model.kind) if model.kind is not None else None
    if model.n_kv_heads is not None and kind is not None and not kind.grouped_query_attention:
        grouped = [f.name for f in families.FAMILIES.values() if f.grouped_query_attention]
        problems.append(
            SpecProblem(
                field="model.n_kv_heads",
                message=f"model.n_kv_heads (grouped-query attention) does not apply to model.kind={model.kind!r}.",
                fix=f"remove model.n_kv_heads, or set model.kind to one of {', '.join(grouped)}",
            )
        )
    if problems:
        return problems
    try:
        config = model.to_config()
    except ConfigError as err:
        return [SpecProblem(field=err.field or "model", message=err.message, fix=err.fix)]
    if model.hf is not None and model.kind is not None and model.kind != config.arch:
        problems.append(
            SpecProblem(
                field="model.kind",
                message=f"model.kind={model.kind!r} but model.hf holds a {config.hf_architecture} "
                f"(model.kind={config.arch!r}).",
                fix=f"remove model.kind (or set it to {config.arch!r})",
            )
        )
    found = families.family(config.arch)
    # The family's own shape rules (a mixture of experts' top-k within its experts, MoE fields on a dense
    # kind, ...), at submit time rather than in the ranks.
    problems += [
        SpecProblem(field=e.field or "model", message=e.message, fix=e.fix) for e in found.shape_errors(config)
    ]
    if spec.export_format == "hf" and not found.has_hf_format:
        with_hf = [f.name for f in families.FAMILIES.values() if f.has_hf_format]
        problems.append(
            SpecProblem(
                field="checkpoint.export",
                message=f"checkpoint.export='hf' writes a transformers model folder; model.kind={config.arch!r} "
                f"({found.summary.split(':')[0]}) has no Hugging Face equivalent.",
                fix=f"set checkpoint.export: none, or train a model of a Hugging Face family ({', '.join(with_hf)}: "
                "model.hf or one of their presets)",
            )
        )
    if spec.checkpoint.export_dtype != "float32" and not found.has_hf_format:  # it would change nothing
        problems.append(
            SpecProblem(
                field="checkpoint.export_dtype",
                message=f"checkpoint.export_dtype={spec.checkpoint.export_dtype!r} sets the dtype of Hugging Face "
                f"exports; model.kind={config.arch!r} has none.",
                fix="leave checkpoint.export_dtype out",
            )
        )
    return problems
