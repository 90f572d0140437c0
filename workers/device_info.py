"""What an accelerator offers, read where it is: the body of the control plane's probe task.

Ray reports how many GPUs a node has and their type (``accelerator_type:H100``), not their memory,
which is what the planner checks a layout against. So the control plane runs
:func:`gpu_memory_bytes` as a one-GPU Ray task (``etrain.service.runtime.supervisor_actor.probe_gpu_memory_gib``) once per
accelerator type. torch is imported inside the function: this module is importable without it,
and the service (which must not import torch) only ships the function to a worker.
"""

from __future__ import annotations

__all__ = ["gpu_memory_bytes"]


def gpu_memory_bytes() -> int | None:
    """Total memory of the first visible CUDA device in bytes (``torch.cuda.mem_get_info``), or None
    when this process sees no GPU."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        return None
    _free, total = torch.cuda.mem_get_info(0)
    return int(total)
