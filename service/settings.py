"""Server settings: one frozen value built once at start-up from the environment and CLI flags.

Nothing downstream reads the environment; it gets a :class:`Settings`. ``from_env`` applies, in
order: the defaults, the ``ETRAIN_*`` variables, then explicit overrides (CLI flags). An override
whose value is ``None`` means "flag not given" and is skipped; to clear a setting, build
``Settings(...)`` directly or use ``dataclasses.replace``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.errors import SettingsError

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


@dataclass(frozen=True, kw_only=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path = Path("./.etrain")
    ray_address: str | None = None  # None: start a local Ray instance
    dashboard_host: str = "127.0.0.1"
    dashboard_port: int = 8265
    api_token: str | None = field(default=None, repr=False)  # None: no authentication
    enable_chaos: bool = False
    max_request_bytes: int = 1_000_000
    poll_interval_s: float = 0.5
    #: Memory per rank (GiB) the planner checks jobs against, overriding what Ray's GPUs report
    #: (and the 8 GiB default of a CPU worker). None: detect (GPUs) or default.
    device_memory_gb: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir).expanduser())
        if self.api_token == "":
            object.__setattr__(self, "api_token", None)
        if self.ray_address == "":
            object.__setattr__(self, "ray_address", None)
        for name in ("port", "dashboard_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise SettingsError(f"{name}={value} is not a TCP port.", field=name, fix="use 0..65535")
        if self.max_request_bytes < 1:
            raise SettingsError(
                f"max_request_bytes={self.max_request_bytes} must be positive.",
                field="max_request_bytes",
                fix="use e.g. 1000000",
            )
        if self.device_memory_gb is not None and not self.device_memory_gb > 0:
            raise SettingsError(
                f"device_memory_gb={self.device_memory_gb} must be positive.", field="device_memory_gb",
                fix="give the memory per rank in GiB, e.g. 79 (or unset ETRAIN_DEVICE_MEMORY_GB to detect it)",
            )
        if self.poll_interval_s <= 0:
            raise SettingsError(
                f"poll_interval_s={self.poll_interval_s} must be positive.", field="poll_interval_s", fix="use e.g. 0.5"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> "Settings":
        """Defaults, then ``ETRAIN_*`` variables from ``env`` (default ``os.environ``), then overrides."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for name, (variable, parse) in _ENV.items():
            raw = env.get(variable)
            if raw is not None:
                values[name] = parse(variable, raw)
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"unknown settings: {sorted(unknown)}")
        values.update({name: value for name, value in overrides.items() if value is not None})
        return cls(**values)

    @property
    def db_path(self) -> Path:
        return self.data_dir / "etrain.db"

    def checkpoint_root(self, job_id: str) -> Path:
        return self.data_dir / "checkpoints" / job_id

    @property
    def api_url(self) -> str:
        return f"http://{_url_host(self.host)}:{self.port}"

    @property
    def dashboard_url(self) -> str:
        """Where the Ray dashboard of a local Ray started by the server listens."""
        return f"http://{_url_host(self.dashboard_host)}:{self.dashboard_port}"


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _text(variable: str, raw: str) -> str:
    return raw


def _integer(variable: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise SettingsError(
            f"{variable}={raw!r} is not an integer.", field=variable, fix="give a whole number"
        ) from None


def _number(variable: str, raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise SettingsError(
            f"{variable}={raw!r} is not a number.", field=variable, fix="give a number, e.g. 0.5"
        ) from None


def _flag(variable: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise SettingsError(
        f"{variable}={raw!r} is not a yes/no value.", field=variable, fix=f"set {variable}=1 or {variable}=0"
    )


_ENV = {
    "host": ("ETRAIN_HOST", _text),
    "port": ("ETRAIN_PORT", _integer),
    "data_dir": ("ETRAIN_DATA_DIR", lambda variable, raw: Path(raw)),
    "ray_address": ("ETRAIN_RAY_ADDRESS", _text),
    "dashboard_host": ("ETRAIN_DASHBOARD_HOST", _text),
    "dashboard_port": ("ETRAIN_DASHBOARD_PORT", _integer),
    "api_token": ("ETRAIN_API_TOKEN", _text),
    "enable_chaos": ("ETRAIN_ENABLE_CHAOS", _flag),
    "max_request_bytes": ("ETRAIN_MAX_REQUEST_BYTES", _integer),
    "poll_interval_s": ("ETRAIN_POLL_INTERVAL_S", _number),
    "device_memory_gb": ("ETRAIN_DEVICE_MEMORY_GB", _number),
}
