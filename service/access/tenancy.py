"""Who is calling: the tenant a request acts for, and whether it is the operator (admin).

Pure data, no FastAPI: the API resolves a bearer token to a :class:`Principal` and hands it to every
``JobManager`` call; the manager and the store filter by it. A job belongs to the tenant that submitted
it; another tenant gets "no such job" for it (404, never 403, so ids do not leak), and the admin
(``ETRAIN_API_TOKEN``) sees everything.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The tenant of jobs submitted with the operator's token, and of rows written before tenants existed.
DEFAULT_TENANT = "default"


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


#: The operator: sees and may do everything. Also what in-process callers (tests, the CLI's own
#: server, the manager's internal calls) act as when they pass no principal.
ADMIN = Principal(tenant=DEFAULT_TENANT, admin=True)
