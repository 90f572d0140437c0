"""Talking to the etrain server: the HTTP client, its two error kinds, the token, and the exit codes.

Every command except ``serve``, ``demo`` and ``prepare-data`` is a few requests through :class:`Client`.
Every request has a timeout; a server that answers with an error becomes :class:`ApiError` (its JSON
body names the field and the fix), and a problem on this side (server unreachable, unreadable file)
becomes :class:`CliError`. Both are printed by ``output.print_error`` and exit non-zero.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"
#: Job statuses that never change again: a wait ends at one of them.
TERMINAL = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_TIMEOUT, EXIT_INTERRUPTED = 0, 1, 2, 124, 130


class ApiError(Exception):
    """The server answered with an error status; ``body`` is its JSON error (or raw text)."""

    def __init__(self, status_code: int, body: Any):
        super().__init__(f"HTTP {status_code}")
        self.status_code = status_code
        self.body = body


class CliError(Exception):
    """A problem on this side (unreadable spec file, server unreachable): message and optional fix."""

    def __init__(self, message: str, fix: str | None = None):
        super().__init__(message)
        self.message = message
        self.fix = fix


class Client:
    """The REST API over httpx; every request has a timeout."""

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 30.0, transport=None):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s, transport=transport)

    def close(self) -> None:
        self._http.close()

    def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: dict | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        extra = {} if timeout_s is None else {"timeout": timeout_s}
        try:
            response = self._http.request(method, path, json=json_body, params=params, **extra)
        except httpx.TimeoutException as err:
            raise CliError(
                f"the server at {self.url} did not answer in time ({type(err).__name__}).",
                fix="retry, or raise --timeout",
            ) from err
        except httpx.TransportError as err:
            raise self._unreachable(err) from err
        if response.status_code >= 400:
            raise _api_error(response)
        if response.headers.get("content-type", "").startswith("application/json"):
            return response.json()
        return response.text

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params={k: v for k, v in params.items() if v is not None} or None)

    @contextmanager
    def stream(
        self, path: str, *, params: dict[str, Any], headers: dict[str, str], read_timeout_s: float
    ) -> Iterator[httpx.Response]:
        """GET a streaming response (server-sent events); ``read_timeout_s`` bounds each wait for data."""
        timeout = httpx.Timeout(self.timeout_s, read=read_timeout_s)
        try:
            with self._http.stream("GET", path, params=params, headers=headers, timeout=timeout) as response:
                if response.status_code >= 400:
                    response.read()
                    raise _api_error(response)
                yield response
        except httpx.ConnectError as err:
            raise self._unreachable(err) from err

    def post(self, path: str, body: Any = None, *, timeout_s: float | None = None) -> Any:
        return self.request("POST", path, json_body=body, timeout_s=timeout_s)

    def _unreachable(self, err: Exception) -> CliError:
        return CliError(
            f"cannot reach the etrain server at {self.url}: {err}",
            fix="start it with `etrain serve`, or set ETRAIN_URL / --url",
        )


def _api_error(response: httpx.Response) -> ApiError:
    """The server's error answer (read already): its JSON body, else its text."""
    try:
        body = response.json()
    except ValueError:
        body = response.text
    return ApiError(response.status_code, body)


def _is_local(url: str) -> bool:
    import ipaddress
    from urllib.parse import urlsplit

    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def client_token(url: str, token: str | None) -> str | None:
    """``--token`` / ETRAIN_API_TOKEN; else, for a server on this machine, the token it generated into
    ``$ETRAIN_DATA_DIR/api-token`` (default ./.etrain). Never that file's token for a remote URL."""
    if token:
        return token
    if not _is_local(url):
        return None
    from etrain.service.access.api_token import read_api_token, token_path

    try:
        return read_api_token(token_path(os.environ.get("ETRAIN_DATA_DIR") or ".etrain"))
    except FileNotFoundError:
        return None  # the server answers 401 with the fix
    except Exception as error:  # an unsafe token file (SettingsError): say why, never use it
        from etrain.workers.protocol.errors import EtrainError

        if not isinstance(error, EtrainError):
            raise
        raise CliError(error.message, error.fix) from None
