"""The one place errors become HTTP responses.

Every error body has the same shape, so clients (the CLI) print any of them the same way::

    {"error": "invalid_spec", "message": "...", "fix": "...",
     "detail": [{"field": "training.steps", "message": "...", "fix": "..."}]}

``error`` is a stable machine-readable code; ``fix`` and each item's ``fix`` are omitted when unknown.
Validation errors name the dotted spec field (``training.global_batch``), never pydantic's internal
location (``body``, union member names). Unexpected exceptions are logged with an id and answered
with that id only: no tracebacks or internals leave the server.
"""

from __future__ import annotations

import inspect
import json
import logging
import re
import types
import typing
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from etrain.service.errors import (
    AdminOnly,
    ChaosDisabled,
    JobConflict,
    JobNotFound,
    NotAuthenticated,
    PriorityNotAllowed,
    QuotaExceeded,
    RankNotFound,
    ServiceUnavailable,
    SpecRejected,
)
from etrain.service.planning.spec import JobSpec
from etrain.workers.protocol.errors import EtrainError

log = logging.getLogger("etrain.api")

# EtrainError subclasses -> (HTTP status, error code); first match in MRO order wins, base last.
_ETRAIN_ERRORS: tuple[tuple[type[EtrainError], int, str], ...] = (
    (SpecRejected, 422, "invalid_spec"),
    (JobNotFound, 404, "job_not_found"),
    (RankNotFound, 404, "rank_not_found"),
    (JobConflict, 409, "conflict"),
    (ChaosDisabled, 403, "chaos_disabled"),
    (NotAuthenticated, 401, "unauthorized"),
    (AdminOnly, 403, "admin_only"),
    (PriorityNotAllowed, 403, "priority_not_allowed"),
    (QuotaExceeded, 429, "quota_exceeded"),
    (ServiceUnavailable, 503, "service_unavailable"),
    (EtrainError, 400, "bad_request"),
)

_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    411: "length_required",
    413: "request_too_large",
    415: "unsupported_media_type",
    429: "too_many_requests",
}

_LOCATION_ROOTS = frozenset({"body", "query", "path", "header", "cookie"})
_UNION_TAG = re.compile(r"^[A-Z]\w*$|[\[\]]")  # "ParallelismSpec", "literal['auto']", "function-after[...]"


def error_response(
    status_code: int,
    error: str,
    message: str,
    *,
    fix: str | None = None,
    detail: Sequence[dict[str, Any]] = (),
    headers: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> JSONResponse:
    """Build an error response in the one shape; middleware (auth, size limit) uses it too. ``extra``
    adds keys after the standard ones (a 429's ``quota`` numbers)."""
    body: dict[str, Any] = {"error": error, "message": message}
    if fix:
        body["fix"] = fix
    body["detail"] = [{k: v for k, v in item.items() if v is not None} for item in detail]
    body.update(extra or {})
    return JSONResponse(body, status_code=status_code, headers=headers)


def etrain_error_response(exc: EtrainError) -> JSONResponse:
    """The response for a service error, outside a route too (the auth gate answers 401 with it)."""
    status_code, code = next((s, c) for cls, s, c in _ETRAIN_ERRORS if isinstance(exc, cls))
    if isinstance(exc, SpecRejected):
        return _validation_response([p.to_dict() for p in exc.problems], code=code)
    detail = [{"field": exc.field, "message": exc.message, "fix": exc.fix}] if exc.field else []
    headers = {"WWW-Authenticate": "Bearer"} if status_code == 401 else None
    extra = None
    if isinstance(exc, QuotaExceeded):  # 429: the cap's numbers, and when to try again
        headers = {"Retry-After": str(exc.retry_after_s)}
        extra = {"quota": exc.to_dict(), "retry_after_s": exc.retry_after_s}
    elif isinstance(exc, PriorityNotAllowed):
        extra = {"priority": exc.to_dict()}
    return error_response(status_code, code, exc.message, fix=exc.fix, detail=detail, headers=headers, extra=extra)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _request_validation_error)
    app.add_exception_handler(ValidationError, _pydantic_validation_error)
    app.add_exception_handler(EtrainError, _etrain_error)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    app.add_exception_handler(Exception, _unexpected_error)


# -- handlers ---------------------------------------------------------------------------------------


async def _request_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    model = _body_model(request)
    detail = validation_detail(exc.errors(), model=model)
    is_spec = model is JobSpec and any(_is_body_error(e) for e in exc.errors())
    return _validation_response(detail, code="invalid_spec" if is_spec else "invalid_request")


async def _pydantic_validation_error(request: Request, exc: ValidationError) -> JSONResponse:
    # A model validated inside a route (not by FastAPI): the input was the client's, so still a 422.
    detail = validation_detail(exc.errors(), model=None)
    return _validation_response(detail, code="invalid_request")


def _validation_response(detail: list[dict[str, Any]], *, code: str) -> JSONResponse:
    count = len(detail)
    summary = "; ".join(
        item["message"] if item["message"].startswith(item["field"]) else f"{item['field']}: {item['message']}"
        for item in detail[:5]
    )
    more = f" (and {count - 5} more)" if count > 5 else ""
    what = "job spec" if code == "invalid_spec" else "request"
    message = f"the {what} has {count} problem{'s' if count != 1 else ''}: {summary}{more}"
    return error_response(422, code, message, detail=detail)


async def _etrain_error(request: Request, exc: EtrainError) -> JSONResponse:
    if isinstance(exc, ServiceUnavailable):
        log.warning("%s %s: %s", request.method, request.url.path, exc)
    return etrain_error_response(exc)


async def _http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 400 and isinstance(exc.__cause__, UnicodeDecodeError):
        # FastAPI answers a JSON body that is not UTF-8 with a bare 400; any other unparsable body is a
        # 422 naming ``body`` (json_invalid), so this one is too: one answer for "not JSON".
        is_spec = _body_model(request) is JobSpec
        return _validation_response(
            [
                {
                    "field": "body",
                    "message": f"the request body is not UTF-8 text: {exc.__cause__.reason} at byte "
                    f"{exc.__cause__.start}.",
                    "fix": "send a JSON object encoded as UTF-8 with Content-Type: application/json",
                }
            ],
            code="invalid_spec" if is_spec else "invalid_request",
        )
    code = _HTTP_CODES.get(exc.status_code, "http_error")
    message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    headers = getattr(exc, "headers", None)
    if exc.status_code == 405:
        # Starlette names the methods of the first route whose path matched (POST /v1/jobs, not GET): list
        # every route's, and answer OPTIONS itself with them.
        allow = ", ".join(allowed_methods(request))
        if request.method == "OPTIONS":
            return Response(status_code=204, headers={"Allow": allow})
        headers = {**(headers or {}), "Allow": allow}
        if message == "Method Not Allowed":
            message = f"{request.method} is not allowed on {request.url.path}; allowed: {allow}"
    if exc.status_code == 404 and message == "Not Found":
        message = f"no such endpoint: {request.method} {request.url.path}"
    return error_response(exc.status_code, code, message, headers=headers)


def allowed_methods(request: Request) -> list[str]:
    """Every method the app answers on this request's path, read from its OpenAPI document (every route the
    API serves is in it), plus OPTIONS (the handler above answers it), sorted."""
    methods = {"OPTIONS"}
    for pattern, verbs in _path_methods(request.app):
        if pattern.fullmatch(request.url.path):
            methods |= verbs
    return sorted(methods)


def _path_methods(app: FastAPI) -> list[tuple[re.Pattern[str], set[str]]]:
    """(path template as a regex, its methods) of the document, built once per app."""
    cached = getattr(app.state, "path_methods", None)
    if cached is None:
        cached = []
        for path, operations in app.openapi().get("paths", {}).items():
            pattern = "[^/]+".join(re.escape(part) for part in re.split(r"\{[^}/]+\}", path))  # {job_id}: a segment
            cached.append((re.compile(pattern), {method.upper() for method in operations}))
        app.state.path_methods = cached
    return cached


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    error_id = uuid.uuid4().hex[:12]
    log.error("unhandled error %s on %s %s", error_id, request.method, request.url.path, exc_info=exc)
    return error_response(
        500,
        "internal",
        f"internal server error (id {error_id}); the server log has the details.",
        fix="retry; if it persists, report the error id to the operator",
    )


# -- validation details -----------------------------------------------------------------------------


def validation_detail(errors: Iterable[dict[str, Any]], *, model: type[BaseModel] | None) -> list[dict[str, Any]]:
    """Pydantic errors as ``[{field, message, fix?}]`` with dotted spec fields and readable messages."""
    items = []
    for error in _pick_union_branches(list(errors)):
        full = tuple(error.get("loc", ()))
        loc = [part for i, part in enumerate(full) if not _is_tag_at(full, i, error.get("type"))]
        if loc and loc[0] in _LOCATION_ROOTS:
            loc = loc[1:]
        in_url = bool(error.get("loc")) and error["loc"][0] in ("query", "path")
        items.append(_describe(error, [str(part) for part in loc], model, in_url=in_url))
    # pydantic reports some errors twice through different union branches; keep the first
    unique, seen = [], set()
    for item in items:
        key = (item["field"], item["message"])
        if key not in seen:
            seen.add(key)
            unique.append(item)
    return unique


def _describe(
    error: dict[str, Any], loc: list[str], model: type[BaseModel] | None, *, in_url: bool = False
) -> dict[str, Any]:
    kind = error.get("type", "")
    field = ".".join(loc) or "body"
    message = str(error.get("msg", "invalid value"))
    fix = None
    if kind == "json_invalid":
        reason = (error.get("ctx") or {}).get("error", "not valid JSON")
        position = error.get("loc", ("body", None))[-1]
        return {
            "field": "body",
            "message": f"the request body is not valid JSON: {reason} (at character {position}).",
            "fix": "send a JSON object with Content-Type: application/json",
        }
    if kind == "missing":
        if not loc:
            return {"field": "body", "message": "the request body is missing.", "fix": "send a JSON object"}
        message = f"{field} is required."
    elif kind == "extra_forbidden":
        message = f"{field} is not a known field."
        allowed = _allowed_fields(model, loc[:-1])
        fix = f"remove it or fix the spelling; allowed here: {', '.join(allowed)}" if allowed else "remove it"
    elif kind in ("value_error", "assertion_error"):
        message = re.sub(r"^(Value|Assertion) error, ", "", message)
        message = f"{field}: {message}" if not message.startswith(field) else message
    elif not loc:
        given = error.get("input")
        if isinstance(given, (bytes, str)):
            return {
                "field": "body",
                "message": "the request body is not JSON.",
                "fix": "send a JSON object with Content-Type: application/json (the CLI reads YAML for you)",
            }
        message = f"the request body must be a JSON object, not {type(given).__name__}: {message}."
    else:
        given = error.get("input")
        if in_url:
            message = f"{field}={_clip(str(given))}: {message}."
        elif isinstance(given, (str, int, float, bool)) or given is None:
            message = f"{field}={_clip(repr(given))}: {message}."
        else:
            message = f"{field}: {message}."
    return {"field": field, "message": message, "fix": fix}


def _clip(text: str, limit: int = 80) -> str:
    """Echo the client's value, but never a megabyte of it."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_tag_at(loc: Sequence[Any], index: int, kind: str | None) -> bool:
    """Is ``loc[index]`` pydantic's name for a union branch rather than a field? Our fields are
    snake_case, so a CamelCase or bracketed part is a branch, except the last part of an
    unknown-field error: that is the client's own key."""
    part = loc[index]
    if not isinstance(part, str) or not _UNION_TAG.search(part):
        return False
    return index < len(loc) - 1 or kind != "extra_forbidden" or bool(re.search(r"[\[\]]", part))


def _pick_union_branches(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Of the errors pydantic reports for each branch of a union field, keep the branch the client
    most plausibly meant: one the input's type fits, then fewest unknown fields, then fewest errors.
    ``parallelism: {dp: 0}`` is then "parallelism.dp must be >= 1", not also "max_workers is
    required" and "should be 'auto'".
    """
    branches: dict[tuple, dict[str, list[dict[str, Any]]]] = {}
    order: list[tuple[str, Any]] = []
    for error in errors:
        loc = tuple(error.get("loc", ()))
        tag_at = next((i for i in range(len(loc)) if _is_tag_at(loc, i, error.get("type"))), None)
        if tag_at is None:
            order.append(("plain", error))
            continue
        prefix, tag = loc[:tag_at], loc[tag_at]
        if prefix not in branches:
            branches[prefix] = {}
            order.append(("union", prefix))
        branches[prefix].setdefault(tag, []).append(error)
    picked: list[dict[str, Any]] = []
    for kind, value in order:
        if kind == "plain":
            picked.append(value)
            continue
        candidates = branches[value]

        def rank(tag: str, depth: int = len(value)) -> tuple[bool, int, bool, int]:
            errs = candidates[tag]
            # the input's type does not fit the branch at all (a string for a model, a dict for a literal)
            mismatch = any(len(e.get("loc", ())) == depth + 1 for e in errs)
            unknown = sum(e.get("type") == "extra_forbidden" for e in errs)
            literal = "[" in tag  # on a total mismatch "should be 'auto'" says more than "not a dict"
            return (mismatch, unknown, not literal if mismatch else literal, len(errs))

        best = min(candidates, key=rank)
        picked.extend(candidates[best])
    return picked


def _is_body_error(error: dict[str, Any]) -> bool:
    loc = error.get("loc", ())
    return bool(loc) and loc[0] == "body"


def _body_model(request: Request) -> type[BaseModel] | None:
    """The pydantic model of the matched route's body parameter, if any (for allowed-field hints)."""
    endpoint = getattr(request.scope.get("route"), "endpoint", None)
    if endpoint is None:
        return None
    try:
        hints = typing.get_type_hints(endpoint)
    except Exception:  # a hint we cannot resolve only costs us the hint
        return None
    for name in inspect.signature(endpoint).parameters:
        hint = hints.get(name)
        if inspect.isclass(hint) and issubclass(hint, BaseModel):
            return hint
    return None


def _allowed_fields(model: type[BaseModel] | None, path: list[str]) -> list[str]:
    """Field names accepted at ``path`` inside ``model`` (aliases as the client writes them)."""
    current: Any = model
    for part in path:
        if not (inspect.isclass(current) and issubclass(current, BaseModel)):
            return []
        info = next(
            (f for n, f in current.model_fields.items() if part in (n, f.alias)),
            None,
        )
        if info is None:
            return []
        current = _model_in(info.annotation)
    if not (inspect.isclass(current) and issubclass(current, BaseModel)):
        return []
    return sorted(f.alias or n for n, f in current.model_fields.items())


def _model_in(annotation: Any) -> Any:
    """The BaseModel inside an annotation (``X | None``, ``Union[X, Literal[...]]`` -> X)."""
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None
