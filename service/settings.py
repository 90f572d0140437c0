"""Server settings: one frozen value built once at start-up from the environment and CLI flags.

Nothing downstream reads the environment; it gets a :class:`Settings`. ``from_env`` applies, in
order: the defaults, the ``ETRAIN_*`` variables, then explicit overrides (CLI flags). An override
whose value is ``None`` means "flag not given" and is skipped; to clear a setting, build
``Settings(...)`` directly or use ``dataclasses.replace``.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from etrain.service.access.tenancy import DEFAULT_TENANT, TENANT_NAME
from etrain.service.errors import SettingsError

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


#: Each spare is an idle process with torch imported (~300 MB of host memory).
MAX_WARM_SPARES_PER_NODE = 16
#: Each pre-started supervisor is an idle process on the head node with Ray loaded.
MAX_SUPERVISOR_SPARES = 8
#: Each planner process holds the spec models and the planner (~100 MB); more than a few only queue for cores.
MAX_PLAN_WORKERS = 16
#: The token cache's folder inside the checkpoint tree (a dot name: no job id starts with one).
TOKEN_CACHE_NAME = ".token-cache"


@dataclass(frozen=True, kw_only=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path = Path("./.etrain")
    ray_address: str | None = None  # None: start a local Ray instance
    dashboard_host: str = "127.0.0.1"
    dashboard_port: int = 8265
    #: The operator's (admin) bearer token. None with no tenant tokens either: ``etrain serve`` generates
    #: one into ``<data_dir>/api-token`` (service/access/api_token.py); the API is never open.
    api_token: str | None = field(default=None, repr=False)
    #: Tenant tokens, ``ETRAIN_API_TOKENS="alice=TOKEN,bob=TOKEN"``: (tenant, token) pairs (a mapping
    #: tenant -> token is accepted too). A tenant may have several tokens (rotation); a token one tenant.
    api_tokens: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    #: A file of ``tenant=token`` lines (``#`` comments), read once at start-up and merged with api_tokens.
    api_tokens_file: Path | None = None
    #: Per-tenant quotas on unfinished (non-terminal) jobs and on the workers (world size) they hold,
    #: checked at submit (workers at scale too); None is unlimited. The admin token is exempt.
    tenant_max_jobs: int | None = 20
    tenant_max_workers: int | None = None
    #: Fair use, per tenant (the admin is exempt): event streams open at once (``follow=true``) and plan
    #: computations running at once (``POST /v1/plan`` and submits with ``parallelism: auto``); None is
    #: unlimited. Over a cap a request is a 429 with ``Retry-After`` (service/access/quotas.py).
    tenant_max_streams: int | None = 8
    tenant_max_plans: int | None = 2
    #: The job priorities a tenant may ask for (the admin: any the spec allows, -1000..1000), and per-tenant
    #: ranges that replace it, ``ETRAIN_TENANT_PRIORITIES="alice=0..500,bob=-10..10"`` ((tenant, min, max)
    #: triples; a mapping tenant -> (min, max) is accepted too).
    tenant_min_priority: int = 0
    tenant_max_priority: int = 100
    tenant_priorities: tuple[tuple[str, int, int], ...] = ()
    #: Worker processes that run the planner's searches (``POST /v1/plan``, submits with ``parallelism: auto``)
    #: off the API's process, so plans never hold its interpreter; 0: on the API's threads (service/manager.py).
    plan_workers: int = 1
    #: How long /healthz answers from its last probe of the database and Ray (seconds; a background thread
    #: refreshes it, one probe at a time); 0: every request waits for a fresh probe.
    health_cache_s: float = 2.0
    enable_chaos: bool = False
    max_request_bytes: int = 1_000_000
    poll_interval_s: float = 0.5
    #: Memory per rank (GiB) the planner checks jobs against, overriding what Ray's GPUs report
    #: (and the 8 GiB default of a CPU worker). None: detect (GPUs) or default.
    device_memory_gb: float | None = None
    #: The only directories a job's paths (data.path, data.tokenizer, model.hf, checkpoint.path, an
    #: export's out) may resolve into, ``ETRAIN_STORAGE_ROOTS``: absolute directories and
    #: ``s3://bucket/prefix`` roots (checkpoint.path only), separated by commas or ':' (a ':' that opens
    #: '://' separates nothing, so ``/a:/b`` and ``/data:s3://bucket/ckpt`` both work). Empty: the data
    #: directory (service/access/storage_roots.py). URLs are kept as strings, folders as Paths. An entry
    #: marked ``tenant=root`` is that tenant's (it moves to ``tenant_roots``; its root stays here too); an
    #: unmarked one is shared by every tenant (service/access/reach.py).
    storage_roots: tuple[Path | str, ...] = ()
    #: (tenant, root) of the roots only that tenant (and the admin) may reach; every root here is in
    #: ``storage_roots`` too. Built from ``tenant=root`` entries of ``storage_roots``, or given directly.
    tenant_roots: tuple[tuple[str, Path | str], ...] = ()
    #: ``ETRAIN_CHECKPOINT_ROOT``: where a job whose spec names no checkpoint.path checkpoints
    #: (``<root>/<job-id>``): an absolute folder every node shares, or ``s3://bucket/prefix`` (needs the
    #: ``s3`` extra; credentials from the AWS environment). None: ``<data_dir>/checkpoints``.
    checkpoint_base: str | None = None
    #: ``ETRAIN_TOKEN_CACHE_DIR``: the folder of tokenized corpora (``data.tokenizer``), an absolute folder every
    #: node shares and only the service writes. None: ``<checkpoint root>/.token-cache`` (``<data_dir>/token-cache``
    #: when the checkpoint root is an object store). Never beside the data (workers/engine/tokenized.py says why).
    token_cache_base: str | None = None
    #: ``ETRAIN_TOKEN_CACHE_MAX_GB``: the token cache's bound (GB, 10^9 bytes). After a submit writes a cache, the
    #: least recently used caches no unfinished job uses are removed until the folder fits
    #: (service/decisions/token_cache.py). None (set empty): no bound.
    token_cache_max_gb: float | None = 100.0
    #: Queue jobs whose minimum layout exceeds the cluster's total resources instead of refusing them
    #: (422): for autoscaling clusters, where nodes are added on demand (service/decisions/admission.py).
    admit_beyond_cluster: bool = False
    #: Pre-started rank processes (torch imported, no resources held) kept on every node that can run
    #: ranks, so a first launch or a replacement pays no interpreter start (service/runtime/spares.py); 0: off;
    #: None (``auto``, the default): one per GPU on a GPU node, one on a CPU-only node.
    warm_spares_per_node: int | None = None
    #: Job supervisors started ahead on the head node, without a job, so a job's start pays no actor start
    #: (service/runtime/supervisor_spares.py); 0: off.
    supervisor_spares: int = 1
    #: token -> tenant, from api_tokens and api_tokens_file (checked: names, duplicates); derived.
    token_tenants: Mapping[str, str] = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir).expanduser())
        if self.api_token == "":
            object.__setattr__(self, "api_token", None)
        if self.api_token is not None:
            _check_token(self.api_token, "ETRAIN_API_TOKEN", "ETRAIN_API_TOKEN")
        if isinstance(self.api_tokens, Mapping):
            object.__setattr__(self, "api_tokens", tuple(self.api_tokens.items()))
        if self.api_tokens_file is not None:
            object.__setattr__(self, "api_tokens_file", Path(self.api_tokens_file).expanduser())
        object.__setattr__(self, "token_tenants", self._token_tenants())
        for name in ("tenant_max_jobs", "tenant_max_workers", "tenant_max_streams", "tenant_max_plans"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise SettingsError(
                    f"{name}={value} must be 0 or more.",
                    field=name,
                    fix=f"give a limit per tenant, or set ETRAIN_{name.upper()}= (empty) for no limit",
                )
        self._check_priorities()
        if not 0 <= self.plan_workers <= MAX_PLAN_WORKERS:
            raise SettingsError(
                f"plan_workers={self.plan_workers} must be 0..{MAX_PLAN_WORKERS}.",
                field="plan_workers",
                fix="use 1 (the default: one planner process) or 0 to plan on the API's threads (ETRAIN_PLAN_WORKERS)",
            )
        if not 0 <= self.health_cache_s <= 300:
            raise SettingsError(
                f"health_cache_s={self.health_cache_s} must be 0..300 seconds.",
                field="health_cache_s",
                fix="use e.g. 2 (ETRAIN_HEALTH_CACHE_S; 0 probes the database and Ray on every /healthz)",
            )
        if self.ray_address == "":
            object.__setattr__(self, "ray_address", None)
        for name in ("port", "dashboard_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise SettingsError(f"{name}={value} is not a TCP port.", field=name, fix="use 0..65535")
        if self.warm_spares_per_node is not None and not 0 <= self.warm_spares_per_node <= MAX_WARM_SPARES_PER_NODE:
            raise SettingsError(
                f"warm_spares_per_node={self.warm_spares_per_node} must be 0..{MAX_WARM_SPARES_PER_NODE} or auto.",
                field="warm_spares_per_node",
                fix="use auto (the default: one per GPU, one on a CPU-only node), a number per node, or 0 for none",
            )
        if not 0 <= self.supervisor_spares <= MAX_SUPERVISOR_SPARES:
            raise SettingsError(
                f"supervisor_spares={self.supervisor_spares} must be 0..{MAX_SUPERVISOR_SPARES}.",
                field="supervisor_spares",
                fix="use 1 (the default), more for bursts of job starts, or 0 for none",
            )
        if self.max_request_bytes < 1:
            raise SettingsError(
                f"max_request_bytes={self.max_request_bytes} must be positive.",
                field="max_request_bytes",
                fix="use e.g. 1000000",
            )
        if self.device_memory_gb is not None and not self.device_memory_gb > 0:
            raise SettingsError(
                f"device_memory_gb={self.device_memory_gb} must be positive.",
                field="device_memory_gb",
                fix="give the memory per rank in GiB, e.g. 79 (or unset ETRAIN_DEVICE_MEMORY_GB to detect it)",
            )
        if self.poll_interval_s <= 0:
            raise SettingsError(
                f"poll_interval_s={self.poll_interval_s} must be positive.", field="poll_interval_s", fix="use e.g. 0.5"
            )
        roots = (self.storage_roots,) if isinstance(self.storage_roots, (str, os.PathLike)) else self.storage_roots
        try:
            plain, owned = _owned_roots(roots, self.tenant_roots)
        except ValueError as err:
            raise SettingsError(
                f"ETRAIN_STORAGE_ROOTS: {err}.",
                field="storage_roots",
                fix=_ROOTS_FIX.format(variable="ETRAIN_STORAGE_ROOTS"),
            ) from None
        object.__setattr__(self, "storage_roots", plain)
        object.__setattr__(self, "tenant_roots", owned)

        if self.checkpoint_base is not None:
            object.__setattr__(self, "checkpoint_base", _checkpoint_base(self.checkpoint_base))
        if self.token_cache_base is not None:
            object.__setattr__(self, "token_cache_base", _token_cache_base(self.token_cache_base))
            self._check_token_cache_apart()
        if self.token_cache_max_gb is not None and not 0 <= self.token_cache_max_gb < float("inf"):
            raise SettingsError(
                f"ETRAIN_TOKEN_CACHE_MAX_GB={self.token_cache_max_gb:g} must be 0 or more.",
                field="token_cache_max_gb",
                fix="give the token cache's size in GB (default 100), or set it empty for no bound",
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
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

    def _check_priorities(self) -> None:
        """The default tenant range and the per-tenant ones: inside the spec's -1000..1000, min <= max, one
        range per known-looking tenant name."""
        if isinstance(self.tenant_priorities, Mapping):
            object.__setattr__(
                self, "tenant_priorities", tuple((tenant, *bounds) for tenant, bounds in self.tenant_priorities.items())
            )
        ranges = [
            (
                "ETRAIN_TENANT_MIN_PRIORITY..ETRAIN_TENANT_MAX_PRIORITY",
                "tenant_max_priority",
                self.tenant_min_priority,
                self.tenant_max_priority,
            )
        ]
        seen: set[str] = set()
        for tenant, low, high in self.tenant_priorities:
            where = f"ETRAIN_TENANT_PRIORITIES entry {tenant!r}"
            _check_tenant(tenant, "ETRAIN_TENANT_PRIORITIES", "ETRAIN_TENANT_PRIORITIES")
            if tenant in seen:
                raise SettingsError(
                    f"ETRAIN_TENANT_PRIORITIES names tenant {tenant!r} twice.",
                    field="ETRAIN_TENANT_PRIORITIES",
                    fix="give each tenant one MIN..MAX range",
                )
            seen.add(tenant)
            ranges.append((where, "ETRAIN_TENANT_PRIORITIES", low, high))
        for where, field_name, low, high in ranges:
            if not -MAX_PRIORITY <= low <= high <= MAX_PRIORITY:
                raise SettingsError(
                    f"{where}: the priority range {low}..{high} is not MIN..MAX within "
                    f"-{MAX_PRIORITY}..{MAX_PRIORITY}.",
                    field=field_name,
                    fix=f"give MIN <= MAX, both within -{MAX_PRIORITY}..{MAX_PRIORITY} (the job spec's bounds), "
                    "e.g. 0..100",
                )

    def priority_range(self, tenant: str) -> tuple[int, int, str]:
        """(min, max, the setting that says so) of the priorities ``tenant`` may give its jobs."""
        for name, low, high in self.tenant_priorities:
            if name == tenant:
                return low, high, f"ETRAIN_TENANT_PRIORITIES={name}={low}..{high}"
        return (
            self.tenant_min_priority,
            self.tenant_max_priority,
            f"ETRAIN_TENANT_MIN_PRIORITY={self.tenant_min_priority}, "
            f"ETRAIN_TENANT_MAX_PRIORITY={self.tenant_max_priority}",
        )

    def _token_tenants(self) -> dict[str, str]:
        """Every tenant token (environment, then file) -> its tenant; SettingsError names the source of
        a bad entry (never the token itself: error messages end up in logs)."""
        entries = [(tenant, token, "ETRAIN_API_TOKENS", "ETRAIN_API_TOKENS") for tenant, token in self.api_tokens]
        if self.api_tokens_file is not None:
            entries += [
                (*pair, where, "ETRAIN_API_TOKENS_FILE") for *pair, where in _read_tokens_file(self.api_tokens_file)
            ]
        tenants: dict[str, str] = {}
        for tenant, token, where, variable in entries:
            _check_tenant(tenant, where, variable)
            _check_token(token, where, variable, tenant=tenant)
            if token == self.api_token:
                raise SettingsError(
                    f"{where}: tenant {tenant!r} has the admin token (ETRAIN_API_TOKEN).",
                    field=variable,
                    fix=f"give every tenant its own token, e.g. {_NEW_TOKEN}",
                )
            if token in tenants:
                raise SettingsError(
                    f"{where}: tenant {tenant!r} has the same token as tenant {tenants[token]!r}.",
                    field=variable,
                    fix="a token must name one tenant: give each entry its own token",
                )
            tenants[token] = tenant
        return tenants

    @property
    def auth_configured(self) -> bool:
        """True when any token is set; otherwise the server generates its admin token at start-up."""
        return self.api_token is not None or bool(self.token_tenants)

    @property
    def api_token_path(self) -> Path:
        """Where a generated admin token lives (``etrain.service.access.api_token``)."""
        return self.data_dir / "api-token"

    @property
    def db_path(self) -> Path:
        return self.data_dir / "etrain.db"

    def checkpoint_root(self, job_id: str) -> Path | str:
        """Where job ``job_id`` checkpoints unless its spec says otherwise: ``<checkpoint root>/<job-id>``, a
        Path for a local root (default ``<data_dir>/checkpoints``), a URL string for an object-store one."""
        if self.checkpoint_base is None:
            return self.data_dir / "checkpoints" / job_id
        if _is_url(self.checkpoint_base):
            return f"{self.checkpoint_base}/{job_id}"
        return Path(self.checkpoint_base) / job_id

    def checkpoint_location(self, job_id: str) -> str:
        """:meth:`checkpoint_root` as the job uses it: a local path resolved (symlinks followed), or the URL."""
        from etrain.service.access.storage_roots import resolve

        return resolve(self.checkpoint_root(job_id))

    @property
    def checkpoint_tree(self) -> str:
        """The checkpoint root holding every job's default directory, resolved (a URL as it is)."""
        from etrain.service.access.storage_roots import resolve

        return resolve(self.checkpoint_base or self.data_dir / "checkpoints")

    def _check_token_cache_apart(self) -> None:
        """ETRAIN_TOKEN_CACHE_DIR must be a folder only the service writes: not in (nor holding) a storage root, which
        a tenant may be able to write directly (a shared dataset volume), unless it lies in the service's own data
        directory or checkpoint tree."""
        from etrain.service.access.storage_roots import inside, resolve

        cache = resolve(self.token_cache_base)
        own = [resolve(self.data_dir), self.checkpoint_tree]
        if any(inside(cache, folder) for folder in own if not _is_url(folder)):
            return
        for root in self.storage_roots:
            if _is_url(root):
                continue
            resolved = resolve(root)
            if inside(cache, resolved) or inside(resolved, cache):
                raise SettingsError(
                    f"ETRAIN_TOKEN_CACHE_DIR={self.token_cache_base!r} {'is in' if inside(cache, resolved) else 'holds'} "
                    f"the storage root {str(root)!r}, where a tenant may be able to write files and plant token ids.",
                    field="token_cache_base",
                    fix="give a folder outside every storage root that only the service writes (or one inside its "
                    "checkpoint root), or leave it unset: <checkpoint root>/.token-cache",
                )

    @property
    def token_cache_dir(self) -> str:
        """Where tokenized corpora live (``ETRAIN_TOKEN_CACHE_DIR``, else inside the checkpoint tree, which every
        node sees and no tenant's path reaches), resolved."""
        from etrain.service.access.storage_roots import resolve

        if self.token_cache_base is not None:
            return resolve(self.token_cache_base)
        tree = self.checkpoint_tree
        return (
            resolve(self.data_dir / "token-cache") if _is_url(tree) else resolve(os.path.join(tree, TOKEN_CACHE_NAME))
        )

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


def _integer_or_auto(variable: str, raw: str) -> int | None:
    """A whole number, or ``auto`` (None: the service decides)."""
    return None if raw.strip().lower() == "auto" else _integer(variable, raw)


def _number(variable: str, raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise SettingsError(
            f"{variable}={raw!r} is not a number.", field=variable, fix="give a number, e.g. 0.5"
        ) from None


def _optional_number(variable: str, raw: str) -> float | None:
    return None if raw.strip() == "" else _number(variable, raw.strip())


def _optional_integer(variable: str, raw: str) -> int | None:
    return None if raw.strip() == "" else _integer(variable, raw.strip())


#: Visible ASCII (an HTTP header value), no comma (the ETRAIN_API_TOKENS separator).
_TOKEN_CHARS = re.compile(r"^[\x21-\x2b\x2d-\x7e]+$")
#: The shortest token the server accepts: 16 random URL-safe characters are 96 bits, beyond guessing.
MIN_TOKEN_LENGTH = 16
#: The job spec's priority bounds (service/planning/spec.py): the admin may use all of them.
MAX_PRIORITY = 1000
_NEW_TOKEN = "python -c 'import secrets; print(secrets.token_hex(32))'"  # hex: never starts with '-'


def _check_tenant(tenant: str, where: str, variable: str) -> None:
    if not TENANT_NAME.match(tenant):
        raise SettingsError(
            f"{where}: {tenant!r} is not a tenant name.",
            field=variable,
            fix="use 1-63 characters of a-z, 0-9, '_' and '-', starting with a letter or digit",
        )
    if tenant == DEFAULT_TENANT:
        raise SettingsError(
            f"{where}: the tenant name {DEFAULT_TENANT!r} is reserved for the operator's own jobs "
            "(those submitted with ETRAIN_API_TOKEN).",
            field=variable,
            fix="pick another tenant name",
        )


def _check_token(token: str, where: str, variable: str, *, tenant: str | None = None) -> None:
    if not _TOKEN_CHARS.match(token):
        whose = "the token" if tenant is None else f"the token of tenant {tenant!r}"
        raise SettingsError(
            f"{where}: {whose} is empty or holds spaces, commas or non-ASCII characters.",
            field=variable,
            fix=f"use a random URL-safe token, e.g. {_NEW_TOKEN}",
        )
    if len(token) < MIN_TOKEN_LENGTH:
        whose = "the token" if tenant is None else f"the token of tenant {tenant!r}"
        raise SettingsError(
            f"{where}: {whose} has {len(token)} characters; a token needs at least {MIN_TOKEN_LENGTH} (a short "
            "token can be guessed).",
            field=variable,
            fix=f"use a random token of {MIN_TOKEN_LENGTH} or more characters, e.g. {_NEW_TOKEN}",
        )


def _tenant_tokens(variable: str, raw: str) -> tuple[tuple[str, str], ...]:
    """``alice=TOKEN,bob=TOKEN`` (spaces around entries ignored, empty entries skipped)."""
    pairs = []
    for number, entry in enumerate((part.strip() for part in raw.split(",")), start=1):
        if entry:
            pairs.append(_tenant_token(entry, f"{variable} entry {number}", variable))
    return tuple(pairs)


def _tenant_token(entry: str, where: str, variable: str) -> tuple[str, str]:
    tenant, equals, token = entry.partition("=")
    if not equals:
        raise SettingsError(
            f"{where} is not 'tenant=token'.",
            field=variable,
            fix="write each entry as tenant=token, e.g. ETRAIN_API_TOKENS=alice=TOKEN1,bob=TOKEN2",
        )
    return tenant.strip(), token.strip()


def _read_tokens_file(path: Path) -> list[tuple[str, str, str]]:
    """(tenant, token, "file:line") for each ``tenant=token`` line; blank lines and ``#`` comments skipped."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise SettingsError(
            f"cannot read the tenant tokens file {path}: {getattr(err, 'strerror', None) or err}.",
            field="ETRAIN_API_TOKENS_FILE",
            fix="point ETRAIN_API_TOKENS_FILE at a readable UTF-8 file of tenant=token lines",
        ) from None
    entries = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if line and not line.startswith("#"):
            where = f"{path}:{number}"
            entries.append((*_tenant_token(line, where, "ETRAIN_API_TOKENS_FILE"), where))
    return entries


def _priority_ranges(variable: str, raw: str) -> tuple[tuple[str, int, int], ...]:
    """``alice=0..500,bob=-10..10`` (spaces around entries ignored, empty entries skipped)."""
    ranges = []
    for number, entry in enumerate((part.strip() for part in raw.split(",")), start=1):
        if not entry:
            continue
        tenant, _, bounds = entry.partition("=")
        match = re.fullmatch(r"\s*(-?\d+)\s*\.\.\s*(-?\d+)\s*", bounds)
        if match is None:
            raise SettingsError(
                f"{variable} entry {number} is not 'tenant=MIN..MAX'.",
                field=variable,
                fix=f"write each entry as tenant=MIN..MAX, e.g. {variable}=alice=0..500,bob=-10..10",
            )
        ranges.append((tenant.strip(), int(match.group(1)), int(match.group(2))))
    return tuple(ranges)


def _storage_roots(variable: str, raw: str) -> tuple[str, ...]:
    """The entries as written (``tenant=`` marks kept for ``Settings``), each checked now."""
    from etrain.service.access.storage_roots import split_roots

    entries = tuple(split_roots(raw))
    try:
        _owned_roots(entries, ())
    except ValueError as err:
        raise SettingsError(f"{variable}: {err}.", field=variable, fix=_ROOTS_FIX.format(variable=variable)) from None
    return entries


def _owned_roots(
    entries: tuple[str | os.PathLike, ...], owned: tuple[tuple[str, str | os.PathLike], ...]
) -> tuple[tuple[Path | str, ...], tuple[tuple[str, Path | str], ...]]:
    """(every root, the (tenant, root) pairs) from storage-root entries (``tenant=root`` marks split off) and
    pairs given apart; ValueError for a bad root or mark, or a root marked for two tenants."""
    from etrain.service.access.reach import split_owner
    from etrain.service.access.storage_roots import parse_root

    plain: list[Path | str] = []
    pairs: dict[Path | str, str] = {}
    for tenant, root in [split_owner(entry) for entry in entries] + [split_owner(f"{t}={r}") for t, r in owned]:
        parsed = parse_root(root)
        plain.append(parsed)
        if tenant is not None:
            if pairs.setdefault(parsed, tenant) != tenant:
                raise ValueError(
                    f"storage root {str(parsed)!r} is marked for two tenants, {pairs[parsed]!r} and {tenant!r}"
                )
    return tuple(dict.fromkeys(plain)), tuple((tenant, root) for root, tenant in pairs.items())


_ROOTS_FIX = (
    "give absolute directories or s3://bucket/prefix roots, each shared or marked tenant=root for one "
    "tenant, e.g. {variable}=/data,/checkpoints,s3://bucket/ckpt,alice=/data/alice"
)


def _is_url(value: Any) -> bool:
    from etrain.workers.checkpoints.storage import is_url

    return is_url(value)


def _checkpoint_base(raw: str | os.PathLike) -> str:
    """ETRAIN_CHECKPOINT_ROOT checked: an s3:// URL whose backend is installed, or an absolute folder."""
    from etrain.workers.checkpoints.storage import missing_backend, normalize_url, url_problem

    if _is_url(raw):
        problem = url_problem(raw)
        if problem:
            raise SettingsError(
                f"ETRAIN_CHECKPOINT_ROOT: {problem}.",
                field="checkpoint_base",
                fix="give s3://bucket/prefix with plain key components",
            )
        url = normalize_url(raw)
        missing = missing_backend(url)
        if missing:
            raise SettingsError(
                f"ETRAIN_CHECKPOINT_ROOT={url!r}: {missing}.",
                field="checkpoint_base",
                fix="install it where the service and the ranks run: pip install 'etrain[s3]'",
            )
        return url
    path = Path(raw).expanduser()
    if not path.is_absolute():
        raise SettingsError(
            f"ETRAIN_CHECKPOINT_ROOT={str(raw)!r} is not an absolute path.",
            field="checkpoint_base",
            fix="give an absolute folder every Ray node and the server share, or s3://bucket/prefix",
        )
    return str(path)


def _token_cache_base(raw: str | os.PathLike) -> str:
    """ETRAIN_TOKEN_CACHE_DIR checked: an absolute folder (tokens are memory-mapped: no object store)."""
    if _is_url(raw) or not Path(raw).expanduser().is_absolute():
        raise SettingsError(
            f"ETRAIN_TOKEN_CACHE_DIR={str(raw)!r} is not an absolute folder.",
            field="token_cache_base",
            fix="give an absolute folder every Ray node and the server share and only the service writes "
            "(ranks memory-map the tokens from it), or leave it unset: <checkpoint root>/.token-cache",
        )
    return str(Path(raw).expanduser())


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
    "api_tokens": ("ETRAIN_API_TOKENS", _tenant_tokens),
    "api_tokens_file": ("ETRAIN_API_TOKENS_FILE", lambda variable, raw: Path(raw) if raw.strip() else None),
    "tenant_max_jobs": ("ETRAIN_TENANT_MAX_JOBS", _optional_integer),
    "tenant_max_workers": ("ETRAIN_TENANT_MAX_WORKERS", _optional_integer),
    "tenant_max_streams": ("ETRAIN_TENANT_MAX_STREAMS", _optional_integer),
    "tenant_max_plans": ("ETRAIN_TENANT_MAX_PLANS", _optional_integer),
    "tenant_min_priority": ("ETRAIN_TENANT_MIN_PRIORITY", _integer),
    "tenant_max_priority": ("ETRAIN_TENANT_MAX_PRIORITY", _integer),
    "tenant_priorities": ("ETRAIN_TENANT_PRIORITIES", _priority_ranges),
    "health_cache_s": ("ETRAIN_HEALTH_CACHE_S", _number),
    "plan_workers": ("ETRAIN_PLAN_WORKERS", _integer),
    "enable_chaos": ("ETRAIN_ENABLE_CHAOS", _flag),
    "max_request_bytes": ("ETRAIN_MAX_REQUEST_BYTES", _integer),
    "poll_interval_s": ("ETRAIN_POLL_INTERVAL_S", _number),
    "device_memory_gb": ("ETRAIN_DEVICE_MEMORY_GB", _number),
    "storage_roots": ("ETRAIN_STORAGE_ROOTS", _storage_roots),
    "checkpoint_base": ("ETRAIN_CHECKPOINT_ROOT", lambda variable, raw: raw.strip() or None),
    "token_cache_base": ("ETRAIN_TOKEN_CACHE_DIR", lambda variable, raw: raw.strip() or None),
    "token_cache_max_gb": ("ETRAIN_TOKEN_CACHE_MAX_GB", _optional_number),
    "admit_beyond_cluster": ("ETRAIN_ADMIT_BEYOND_CLUSTER", _flag),
    "warm_spares_per_node": ("ETRAIN_WARM_SPARES_PER_NODE", _integer_or_auto),
    "supervisor_spares": ("ETRAIN_SUPERVISOR_SPARES", _integer),
}
