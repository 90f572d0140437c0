"""Upper bounds on every number and string a client sends, and the cap that keeps the planner's
searches small.

Why bounds: every size in a job spec feeds arithmetic, searches and storage on the control plane
(the planner sizes the model layer by layer, the elastic policy lists the data-parallel sizes, SQLite
stores the integers). Unbounded, ``model.n_layers=10**12`` or ``GET /v1/jobs?offset=10**20`` turn one
request into an hour of CPU or an integer SQLite cannot hold. Each bound is set from real use with
headroom, so the largest models trained today still pass: Llama 3.1 405B has 126 layers, d_model
16384, 128 query and 8 key/value heads, d_ff 53248, a 128256-token vocabulary and a 131072-token
context, and was trained on 16384 GPUs with 16M-token batches. The bounds are in the field
definitions (``service/planning/spec.py``, ``service/ports.py``, ``api/schemas.py``, the routes' query
parameters), so the OpenAPI document states them and a value out of range is a 422 naming the field.
docs/job-spec.md's "Bounds" table lists them.

Why a cap: every axis the planner searches must divide something (pp divides the layers, dp
divides the micro-batches per step, tp divides the heads), so the searches enumerate divisors
(``etrain.workers.protocol.layout_rules.divisors``, O(sqrt(n))) instead of ranges, and :func:`spread` caps how
many of them a search tries, so no spec within the bounds makes a request search more than a few
thousand layouts.
"""

from __future__ import annotations

__all__ = [
    "MAX_CPUS_PER_WORKER",
    "MAX_AUX_LOSS_COEF",
    "MAX_CURSOR",
    "MAX_D_FF",
    "MAX_D_MODEL",
    "MAX_DEVICE_MEMORY_GB",
    "MAX_EXPERTS",
    "MAX_GLOBAL_BATCH",
    "MAX_GPUS_PER_WORKER",
    "MAX_HEADS",
    "MAX_HOST_MEMORY_GB",
    "MAX_LAYERS",
    "MAX_LR",
    "MAX_PATH",
    "MAX_RESTARTS",
    "MAX_SECONDS",
    "MAX_SEED",
    "MAX_SEQ_LEN",
    "MAX_STEPS",
    "MAX_VOCAB",
    "MAX_WORKERS",
    "MIN_RESOURCE",
    "NO_NUL",
    "spread",
]

# --- the model (405B: 126 layers, 16384 wide, 128/8 heads, d_ff 53248, vocab 128256, 131072 context)
MAX_LAYERS = 1024  # 8x the 405B; also bounds pp and virtual_stages (each divides the layers)
MAX_D_MODEL = 65536  # 4x the 405B's width
MAX_HEADS = 1024  # query and key/value heads; also bounds tp (it divides the heads)
MAX_D_FF = 262144  # 4 x MAX_D_MODEL (the GPT default); the 405B uses 53248
MAX_VOCAB = 1 << 21  # 2,097,152: 8x the largest vocabularies in use (256k)
MAX_SEQ_LEN = 1 << 20  # 1,048,576 tokens: 8x the 405B's 131072 context
MAX_EXPERTS = 4096  # experts per block (and the top-k): 10x the most in use (384; Qwen3-MoE 128, DeepSeek-V3 256)
MAX_AUX_LOSS_COEF = 1000.0  # model.router_aux_loss_coef (Qwen3-MoE's is 0.001)
MAX_LOSS_CHUNK_TOKENS = 1 << 24  # training.loss_chunk_tokens: a micro-batch's tokens at most (batch x seq)

# --- the run
MAX_STEPS = 100_000_000  # the 405B ran ~1M steps; also bounds warmup, checkpoint steps and step cursors
MAX_GLOBAL_BATCH = 1 << 24  # 16,777,216 sequences per step (the 405B: 2048 of 8192 tokens)
MAX_WORKERS = 65536  # ranks: 4x the 405B's 16384 GPUs; bounds dp, min/max_dp, max_workers, dp*tp*pp
MAX_LR = 10.0
MAX_SEED = (1 << 63) - 1  # fits SQLite's and numpy's integers
MAX_RESTARTS = 10_000
MAX_SECONDS = 7 * 24 * 3600.0  # any timeout, backoff or interval: a week
MAX_CPUS_PER_WORKER = 1024.0
MAX_GPUS_PER_WORKER = 64.0
#: Ray's resource granularity: amounts are kept to 4 decimals, so a rank asks for at least this much of a
#: resource it asks for at all (a smaller positive amount would also make "ranks per node" infinite).
MIN_RESOURCE = 0.0001
MAX_DEVICE_MEMORY_GB = 16384.0  # GiB per rank; the operator's value (or the detected one) caps it further
MAX_HOST_MEMORY_GB = 65536.0  # GiB of host memory per rank (64 TiB: beyond any one node)

# --- strings and cursors
MAX_PATH = 4096  # PATH_MAX on Linux
NO_NUL = r"^[^\x00]*$"  # a NUL byte cannot be in a path (the OS refuses it with ValueError)
MAX_CURSOR = 1 << 62  # offsets and ?since= cursors: inside SQLite's 64-bit integers with room to add to them


def spread(values: list[int], limit: int) -> list[int]:
    """At most ``limit`` of the ascending ``values``: all of them when they fit, else the first, the
    last and evenly spaced ones between (by rank, so the small end is sampled as densely as the large)."""
    if limit < 2:
        raise ValueError(f"spread() keeps at least the two ends, limit={limit}")
    if len(values) <= limit:
        return list(values)
    last = len(values) - 1
    picked = sorted({round(i * last / (limit - 1)) for i in range(limit)})
    return [values[i] for i in picked]
