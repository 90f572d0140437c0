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

import dataclasses
import os
import tempfile
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the module loads without torch: rank processes call use_node_cache() before torch loads
    from torch import nn

__all__ = [
    "CACHE_ENV",
    "CompileProfile",
    "apply_compile",
    "compile_backend",
    "compile_profile",
    "compile_seconds",
    "compiled_frames",
    "node_cache_folder",
    "silence_checked_warnings",
    "use_node_cache",
]

#: Where compiled code is cached on a node (default ``<tmp>/etrain-compile-cache-<user>``).
CACHE_ENV = "ETRAIN_COMPILE_CACHE_DIR"
_BACKEND_ENV = "ETRAIN_COMPILE_BACKEND"


def _user() -> str:
    """This process's user name for a folder name (its uid where the name cannot be read, as in a container
    run under an arbitrary uid)."""
    import getpass
    import re

    try:
        name = getpass.getuser()
    except (KeyError, OSError):
        name = str(os.getuid())
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) or str(os.getuid())


def compile_backend() -> str:
    return os.environ.get(_BACKEND_ENV, "inductor")


def node_cache_folder() -> str:
    """The folder this process's ranks compile into (nothing is made or set): ``TORCHINDUCTOR_CACHE_DIR``
    where the operator (or :func:`use_node_cache`) set it, else ``ETRAIN_COMPILE_CACHE_DIR``, else
    ``<tmp>/etrain-compile-cache-<user>``, one per user as inductor's own (another user's folder, mode 0700,
    could not be written)."""
    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.environ.get(CACHE_ENV)
    return folder or os.path.join(tempfile.gettempdir(), f"etrain-compile-cache-{_user()}")


def use_node_cache() -> str:
    """Point inductor's caches at the node's etrain cache folder (unless the operator set one); returns it.

    Must run before ``torch._dynamo`` is imported: importing it sets ``TORCHINDUCTOR_CACHE_DIR`` to
    inductor's own default (torch 2.13, ``torch._dynamo.package``), which a later call would take for the
    operator's choice, and any Trainer build imports it. So rank processes call this first thing
    (``TrainWorker``, ``SpareRank`` before it imports torch); :func:`apply_compile` calls it again (a no-op
    then). Before this rule the H100's ranks compiled into ``/tmp/torchinductor_root`` whatever
    ``ETRAIN_COMPILE_CACHE_DIR`` said (their rank logs name the folder).
    """
    folder = node_cache_folder()
    os.makedirs(folder, mode=0o700, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(folder, "triton"))
    return folder


def apply_compile(module: nn.Module, *, form: str = "whole") -> None:
    """Compile each block of ``module`` (a whole model or one pipeline stage) in place, in the ``form`` that
    ``etrain.workers.protocol.compiled_blocks.compiled_block_form`` gives for the layout.

    ``"whole"``: ``fullgraph=True``, a graph break inside a block is a bug to fix, not a silent slowdown
    (context parallelism's ring is one custom op inside the graph: ``workers/families/ring_attention.py``).
    Dynamo's guards see the same code, shapes and dtypes on every step, so nothing recompiles after the
    first step (tests/integration/test_throughput_options.py counts the compiled frames). ``"split"``
    where a block holds a region that must run eagerly by design (expert parallelism's token exchange,
    ``workers/families/expert_parallel.py``): the graph breaks exactly there. ``"split_inside_checkpoint"``:
    the same, compiled inside the block's (eager) activation checkpoint, since a break inside a compiled
    checkpoint would run the whole block eagerly. ``"eager"``: the blocks are not compiled (selective
    checkpointing around an eager region); the loss still is.
    """
    use_node_cache()
    silence_checked_warnings()
    backend = compile_backend()
    if form != "eager":
        for block in module.layers.values():
            if form == "split_inside_checkpoint":
                block = block._checkpoint_wrapped_module  # noqa: SLF001 (torch's CheckpointWrapper)
            block.compile(backend=backend, fullgraph=form == "whole")
    # ... and the cross-entropy after the output projection (workers/families/head_loss.py)
    module.loss_compile_backend = backend


#: torch's warning for a checkpoint policy (selective checkpointing) under torch.compile, and its logger: it
#: holds only where the checkpointed region runs no in-place op, which tests/unit/test_families.py checks for
#: every family.
_IN_PLACE_WARNING = "context_fn is passed to torch.utils.checkpoint"
_IN_PLACE_WARNING_LOGGER = "torch._higher_order_ops.wrap"


class _DropChecked:
    """A logging filter dropping the one warning whose condition a test checks (every rank's log, once per
    process, told users to look for in-place ops they cannot change)."""

    def filter(self, record) -> bool:
        return _IN_PLACE_WARNING not in record.getMessage()


def silence_checked_warnings() -> None:
    """Filter torch's in-place warning out of its logger (once per process: the filter is not added twice)."""
    import logging

    logger = logging.getLogger(_IN_PLACE_WARNING_LOGGER)
    if not any(isinstance(f, _DropChecked) for f in logger.filters):
        logger.addFilter(_DropChecked())


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (dynamo's own accounting)."""
    try:
        from torch._dynamo.utils import calculate_time_spent

        return float(calculate_time_spent().get("total_wall_time", 0.0))
    except (ImportError, AttributeError):  # a torch without the accounting: say nothing rather than fail
        return 0.0


#: The compile caches' hit and miss counters worth a line: (dynamo's counter group, its key, the name shown).
_CACHE_COUNTERS = (
    ("inductor", "fxgraph_cache_hit", "FX graph cache hits"),
    ("inductor", "fxgraph_cache_miss", "FX graph cache misses"),
    ("aot_autograd", "autograd_cache_hit", "AOTAutograd cache hits"),
    ("aot_autograd", "autograd_cache_miss", "AOTAutograd cache misses"),
)


@dataclasses.dataclass(frozen=True)
class CompileProfile:
    """What this process has spent compiling, by dynamo's timed spans, and its compile caches' counters,
    at one moment: the difference of two (:meth:`since`) says where one attempt's compile went, the line a
    rank log needs to tell a cold cache, a warm one and slow loading apart (the H100's warm-cache first
    step still compiled for 5.1-5.6 s, unexplained)."""

    spans: dict[str, float]
    counters: dict[str, int]

    def since(self, earlier: CompileProfile, *, top: int = 8, at_least_s: float = 0.05) -> str:
        """``span s, span s, ...; FX graph cache hits n, misses n, ...``: the ``top`` longest spans (nested:
        dynamo's outer spans hold the inner ones) of at least ``at_least_s`` since ``earlier``."""
        grown = {name: seconds - earlier.spans.get(name, 0.0) for name, seconds in self.spans.items()}
        longest = sorted(((s, n) for n, s in grown.items() if s >= at_least_s), reverse=True)[:top]
        spans = ", ".join(f"{name} {seconds:.2f}s" for seconds, name in longest) or "no span over 0.05s"
        counts = ", ".join(f"{shown} {count}" for shown, count in self.counts_since(earlier).items())
        return f"{spans}; {counts}"

    def counts_since(self, earlier: CompileProfile) -> dict[str, int]:
        """The compile caches' hits and misses since ``earlier``, by their shown names."""
        return {shown: self.counters.get(shown, 0) - earlier.counters.get(shown, 0) for _, _, shown in _CACHE_COUNTERS}


def compile_profile() -> CompileProfile:
    """This process's :class:`CompileProfile` now (empty where torch does not keep the accounting)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics, counters
    except ImportError:
        return CompileProfile(spans={}, counters={})
    spans = {name: float(sum(values)) for name, values in compilation_time_metrics.items()}
    cache = {shown: int(counters[group][key]) for group, key, shown in _CACHE_COUNTERS}
    return CompileProfile(spans=spans, counters=cache)


def compiled_frames() -> int:
    """Frames dynamo has compiled in this process (a recompilation adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
