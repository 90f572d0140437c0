"""Which paths a tenant may reach inside the storage roots: the shared roots, its own roots and its own jobs'
checkpoint directories, never another tenant's (pure).

The storage roots (storage_roots.py) fence jobs off from the rest of the machine; this rule fences tenants
off from each other inside the roots. A path a tenant names (``data.path``, ``data.tokenizer``,
``model.hf``, ``checkpoint.path`` at submit and ``/v1/plan``, an export's ``out``; resolved) is refused
when it lies in, or contains:

* a storage root marked for another tenant (``ETRAIN_STORAGE_ROOTS=/data/shared,alice=/data/alice``:
  an unmarked root is shared, a marked one is its tenant's; :func:`split_owner` reads the mark);
* the checkpoint tree that holds every job's default directory (contains: refused; lies in: only the
  directory of a job the caller can see);
* the service's token cache (``ETRAIN_TOKEN_CACHE_DIR``; by default it lies in the checkpoint tree): the
  tokenized corpora every job trusts by their names, which only the service writes;
* the checkpoint directory of another tenant's job as the store records it (a custom
  ``checkpoint.path``, default ones too), running or long finished: its weights, its exports and its
  rank logs are that tenant's.

"Contains" matters because a folder is read as a whole (the text walk of ``data.path``) or written into.
The admin (the operator's token) reaches every path inside the roots. The verdict is a function of the
path and the store's records, never of which files exist, and a refusal never names the other tenant or
its job: the answer is the same for a missing and an existing file.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

from etrain.service.access.storage_roots import inside, resolve
from etrain.service.access.tenancy import TENANT_NAME, Principal
from etrain.service.planning.spec import JobSpec, SpecProblem
from etrain.service.planning.spec_paths import PATH_FIELDS
from etrain.workers.checkpoints import storage

__all__ = ["JobDirectory", "Reach", "split_owner"]

#: (job id, tenant, resolved checkpoint directory) of a job, as the store records it.
JobDirectory = tuple[str, str, str]


def split_owner(entry: str | os.PathLike) -> tuple[str | None, str | os.PathLike]:
    """One ``ETRAIN_STORAGE_ROOTS`` entry: ``tenant=root`` -> ``(tenant, root)``, a plain root -> ``(None, root)``.

    An entry that starts like a path (``/``, ``~``) or a URL is never a mark, so ``/data/a=b`` stays a
    folder. ``ValueError`` for a mark that is not a tenant name. ``default=`` marks a root only the admin
    (whose own jobs are tenant ``default``) reaches.
    """
    if not isinstance(entry, str) or storage.is_url(entry) or entry.startswith(("/", "~")) or "=" not in entry:
        return None, entry
    tenant, _, root = entry.partition("=")
    tenant = tenant.strip()
    if not TENANT_NAME.match(tenant):
        raise ValueError(
            f"storage root {entry!r}: {tenant!r} is not a tenant name (1-63 characters of a-z, 0-9, "
            "'_' and '-'); mark a tenant's root as tenant=/absolute/dir"
        )
    return tenant, root.strip()


class Reach:
    """The rule above for one service: its checkpoint tree and the marked roots (``(tenant, root)``)."""

    def __init__(
        self, *, tree: str, owners: Iterable[tuple[str, str | os.PathLike]] = (), token_cache: str | None = None
    ):
        self._tree = resolve(tree)
        self._owners = tuple((tenant, resolve(root)) for tenant, root in owners)
        self._token_cache = None if token_cache is None else resolve(token_cache)

    def visible_roots(self, roots: Iterable[str], principal: Principal) -> tuple[str, ...]:
        """The storage roots an error message may name to ``principal``: all for the admin, else the shared
        ones and its own (where another tenant's data lives is not a tenant's business)."""
        if principal.admin:
            return tuple(roots)
        others = {root for tenant, root in self._owners if tenant != principal.tenant}
        return tuple(root for root in roots if resolve(root) not in others)

    def spec_problems(
        self,
        spec: JobSpec,
        given: JobSpec,
        principal: Principal,
        *,
        job_dirs: Callable[[str], Iterable[JobDirectory]],
        tenant_of: Callable[[str], str | None],
    ) -> list[SpecProblem]:
        """Every path field of ``spec`` (pinned, inside the roots) that ``principal`` may not reach; messages
        echo the value as ``given`` (before pinning: never where a symlink points).
        ``job_dirs(path)``: the recorded job directories that may overlap ``path`` (a superset is fine);
        ``tenant_of(job_id)``: a job's tenant, None for no such job."""
        problems = []
        for field, section, name in PATH_FIELDS:
            value = getattr(getattr(spec, section), name)
            if value:
                problem = self.problem(
                    field,
                    value,
                    principal,
                    shown=getattr(getattr(given, section), name),
                    job_dirs=job_dirs,
                    tenant_of=tenant_of,
                )
                if problem is not None:
                    problems.append(problem)
        return problems

    def problem(
        self,
        field: str,
        path: str,
        principal: Principal,
        *,
        shown: str | None = None,
        job_dirs: Callable[[str], Iterable[JobDirectory]],
        tenant_of: Callable[[str], str | None],
    ) -> SpecProblem | None:
        """Why ``principal`` may not use ``path`` (pinned) for ``field``, or None; the message shows ``shown``
        (the value as given; default ``path``)."""
        if principal.admin:
            return None
        path = resolve(path)
        value = f"{field}={shown if shown is not None else path!r}"
        fix = f"point {field} at a shared storage root, one of your own, or one of your jobs' checkpoint directories"
        for tenant, root in self._owners:
            if tenant != principal.tenant and (inside(path, root) or inside(root, path)):
                where = "is in" if inside(path, root) else "contains"
                return SpecProblem(
                    field=field, fix=fix, message=f"{value} {where} a storage root reserved for another tenant."
                )
        tree = self._tree_problem(field, path, value, principal, tenant_of)
        if tree is not None:
            return tree
        if self._token_cache is not None and (inside(path, self._token_cache) or inside(self._token_cache, path)):
            where = "is in" if inside(path, self._token_cache) else "contains"
            return SpecProblem(field=field, fix=fix, message=f"{value} {where} the service's token cache.")
        for _job_id, tenant, directory in job_dirs(path):
            if not principal.can_see(tenant) and (inside(path, directory) or inside(directory, path)):
                where = "is inside" if inside(path, directory) else "contains"
                return SpecProblem(
                    field=field,
                    fix=fix,
                    message=f"{value} {where} the checkpoint directory of a job you cannot access.",
                )
        return None

    def _tree_problem(
        self, field: str, path: str, value: str, principal: Principal, tenant_of: Callable[[str], str | None]
    ) -> SpecProblem | None:
        """A path that reaches into the checkpoint tree: only the caller's jobs' directories."""
        if inside(self._tree, path):
            return SpecProblem(
                field=field,
                message=f"{value} contains the service's checkpoint directory {self._tree}, which holds "
                "other jobs' checkpoints.",
                fix=f"point {field} at a folder of your own",
            )
        if inside(path, self._tree):
            job_id = (
                path[len(self._tree) + 1 :].split("/")[0]
                if storage.is_url(path)
                else os.path.relpath(path, self._tree).split(os.sep)[0]
            )
            tenant = tenant_of(job_id)
            if tenant is None or not principal.can_see(tenant):
                return SpecProblem(
                    field=field,
                    message=f"{value} is inside the checkpoint directory of a job you cannot access.",
                    fix=f"point {field} at one of your own jobs' checkpoint directories, or a folder of your own",
                )
        return None
