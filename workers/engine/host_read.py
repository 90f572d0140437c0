"""The step's one host read: where a rank's host waits for its device, and through it for its peers.

Why a module of its own: the hang diagnosis (``service/decisions/hangs.py``) tells a rank that waits on its
peers from one that stopped by itself by the frames of its training thread. On gloo a collective blocks the
host inside ``torch.distributed``, and the frames say so. On NCCL a collective only queues a kernel: the
host runs on and blocks where it next reads a value the device computes, the step's loss and gradient norm,
behind kernels that wait for a peer. There the innermost frame is this function, and the diagnosis counts a
rank in it as waiting (on its peers, or on its own device hung inside a kernel: no single culprit either
way), not as the rank that stopped the job. On CPU the read returns at once.
"""

from __future__ import annotations

import torch

__all__ = ["read_on_host"]


def read_on_host(values: torch.Tensor) -> list[float]:
    """``values`` (a 1-D tensor on the step's device) as Python floats: the host waits for the device here."""
    return values.tolist()
