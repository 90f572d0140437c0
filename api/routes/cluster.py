"""/v1/cluster: the cluster as the scheduler sees it (nodes, free resources, holdings, the queue).

Served from the manager's latest snapshot of the cluster (the scheduler thread refreshes it every
couple of seconds), so a request does not wait on Ray. A tenant sees its own jobs' holdings and
queue entries, and the cluster-wide numbers (nodes, totals, counts); the admin sees every job.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from etrain.api.routes import get_manager, get_principal
from etrain.api.schemas import V1_RESPONSES, ClusterOut, ErrorOut
from etrain.service.access.tenancy import Principal
from etrain.service.ports import JobManagerPort

router = APIRouter(prefix="/v1/cluster", tags=["cluster"], responses=V1_RESPONSES)

Manager = Annotated[JobManagerPort, Depends(get_manager)]
Caller = Annotated[Principal, Depends(get_principal)]


@router.get(
    "",
    response_model=ClusterOut,
    responses={503: {"model": ErrorOut, "description": "the cluster's resources cannot be read now"}},
)
def get_cluster(manager: Manager, caller: Caller) -> ClusterOut:
    """Nodes (alive, total and free CPUs/GPUs), totals, what each started job holds, and the queue
    (position, priority and why each job waits)."""
    return ClusterOut.model_validate(manager.cluster(principal=caller))
