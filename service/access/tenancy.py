"""Who is calling: the tenant a request acts for, and whether it is the operator (admin).

Pure data, no FastAPI: the API resolves a bearer token to a :class:`Principal` and hands it to every
``JobManager`` call; the manager and the store filter by it. A job belongs to the tenant that submitted
it; another tenant gets "no such job" for it (404, never 403, so ids do not leak), and the admin
(``ETRAIN_API_TOKEN``) sees everything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: The tenant of jobs submitted with the operator's token, and of rows written before tenants existed.
DEFAULT_TENANT = "default"
#: Tenant names end up in the jobs table, logs, storage-root marks and (for the admin) metrics labels: keep
#: them plain.
TENANT_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


@dataclass(frozen=True)
class Principal:
    tenant: str
    admin: bool = False

    def can_see(self, owner: str) -> bool:
        """True when a job owned by ``owner`` exists for this caller."""
        return self.admin or owner == self.tenant

    @property
    def tenant_filter(self) -> str | None:
        """The tenant to filter lists by; None (all tenants) for the admin."""
        return None if self.admin else self.tenant

    @classmethod
    def reader_of(cls, owner: str) -> Principal:
        """Who reads what is written into a job of ``owner`` (its events): that tenant, or for the operator's
        own jobs (``DEFAULT_TENANT``) the admin."""
        return cls(tenant=owner, admin=owner == DEFAULT_TENANT)


#: The operator: sees and may do everything. Also what in-process callers (tests, the CLI's own
#: server, the manager's internal calls) act as when they pass no principal.
ADMIN = Principal(tenant=DEFAULT_TENANT, admin=True)
