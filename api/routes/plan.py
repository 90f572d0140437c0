"""/v1/plan: what the planner would do with a spec, without starting anything.

An infeasible spec is an answer here, not an error: 200 with ``feasible: false`` and the problems
(field + message + fix), because this endpoint exists to explain. A body that is not a JobSpec at
all (unknown field, wrong type) is still a 422.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends

from etrain.api.routes import get_manager, get_principal
from etrain.api.schemas import TOO_MANY, V1_RESPONSES, ErrorOut
from etrain.service.access.tenancy import Principal
from etrain.service.planning.spec import JobSpec
from etrain.service.ports import JobManagerPort

router = APIRouter(prefix="/v1", tags=["plan"], responses=V1_RESPONSES)


@router.post(
    "/plan",
    responses={
        422: {
            "model": ErrorOut,
            "description": "the body is not a job spec (a field out "
            "of bounds, an unknown field), or a path "
            "is outside the storage roots or the "
            "caller's reach",
        },
        429: TOO_MANY["max_plans"],
    },
)
def plan(
    spec: JobSpec,
    manager: Annotated[JobManagerPort, Depends(get_manager)],
    caller: Annotated[Principal, Depends(get_principal)],
) -> dict[str, Any]:
    """The plan: at most ETRAIN_TENANT_MAX_PLANS computed at once per tenant (429 with Retry-After beyond;
    the slot is taken by ``etrain.api.auth.PlanGate`` before the body is read, so a refusal costs no parsing)."""
    return manager.plan(spec, principal=caller)
