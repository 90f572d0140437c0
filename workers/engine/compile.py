"""``training.compile``: each transformer block compiled with ``torch.compile``, the way torchtitan does it.

Why per block and not the whole model: every block runs the same code on same-shaped tensors, so one
compiled graph (forward and backward) serves all of them and compile time does not grow with depth;
the embedding and the output projection stay eager, the cross-entropy after it is compiled on its own
(it may run in chunks, ``workers/families/head_loss.py``),
and FSDP2's hooks, which sit on the block *modules*, stay outside the compiled code. Measured on an
H100 with Llama-1B shapes, wrapping every block this way took etrain from 34.0% to 44.8% MFU.

Order (``workers/engine/parallelize.py``): tensor parallelism → activation checkpointing → compile →
data parallelism. The block is compiled *in place* (``nn.Module.compile``), so parameter names, and with
them checkpoints and Hugging Face exports, carry no ``_orig_mod``.

The compile cache lives on the node's disk (:func:`use_node_cache`): inductor's FX-graph and AOTAutograd
caches key compiled code by graph and shapes, so a restarted or replacement rank on the same node loads
it instead of compiling again. ``ETRAIN_COMPILE_BACKEND`` chooses torch.compile's backend (default
``inductor``; the CPU test suite runs the many layouts with ``aot_eager``, which traces the same graphs
with the same guards but skips inductor's C++ code generation, and one test with inductor).
"""

from __future__ import annotations

import os
import tempfile

from torch import nn

__all__ = ["CACHE_ENV", "apply_compile", "compile_backend", "compile_seconds", "compiled_frames", "use_node_cache"]

#: Where compiled code is cached on a node (default ``<tmp>/etrain-compile-cache``).
CACHE_ENV = "ETRAIN_COMPILE_CACHE_DIR"
_BACKEND_ENV = "ETRAIN_COMPILE_BACKEND"


def compile_backend() -> str:
    return os.environ.get(_BACKEND_ENV, "inductor")


def use_node_cache() -> str:
    """Point inductor's caches at the node's etrain cache folder (unless the operator set one); returns it.

    Must run before the first compile in the process: inductor reads the folder once.
    """
    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.environ.get(CACHE_ENV)
    if not folder:
        folder = os.path.join(tempfile.gettempdir(), "etrain-compile-cache")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(folder, "triton"))
    return folder


def apply_compile(module: nn.Module, *, fullgraph: bool = True) -> None:
    """Compile each block of ``module`` (a whole model or one pipeline stage) in place.

    ``fullgraph=True`` (the default): a graph break inside a block is a bug to fix, not a silent
    slowdown. Dynamo's guards see the same code, shapes and dtypes on every step, so nothing recompiles
    after the first step (tests/integration/test_throughput_options.py counts the compiled frames).
    ``fullgraph=False`` where a block holds a region that must run eagerly by design (expert
    parallelism's token exchange, ``workers/families/expert_parallel.py``; context parallelism's ring,
    ``workers/families/ring_attention.py``): the graph breaks exactly there.
    """
    use_node_cache()
    backend = compile_backend()
    for block in module.layers.values():
        block.compile(backend=backend, fullgraph=fullgraph)
    # ... and the cross-entropy after the output projection (workers/families/head_loss.py)
    module.loss_compile_backend = backend


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (dynamo's own accounting)."""
    try:
        from torch._dynamo.utils import calculate_time_spent

        return float(calculate_time_spent().get("total_wall_time", 0.0))
    except (ImportError, AttributeError):  # a torch without the accounting: say nothing rather than fail
        return 0.0


def compiled_frames() -> int:
    """Frames dynamo has compiled in this process (a recompilation adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
