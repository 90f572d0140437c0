"""Parallel-equivalence helpers: run a layout on real gloo ranks and compare it with one process.

Used by ``tests/integration/test_equivalence.py`` (DP/ZeRO/TP layouts) and
``tests/integration/test_pipeline_equivalence.py`` (PP layouts)::

    reference = run_reference(config)                 # one process, no process group
    results = run_layout(config_with_layout)          # one RunResult per rank
    assert_equivalent(reference, results, layout="dp2 zero=3")

The reference is the same ``Trainer`` with world size 1, so the only difference between the two
runs is the parallel layout. Equivalence is asserted in fp32 to a tight tolerance: every step's
loss within ``LOSS_RTOL`` (relative) and every final parameter within ``PARAM_ATOL`` (absolute).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch

from etrain.workers.protocol.run_config import DataConfig, ModelConfig, ParallelConfig, RunConfig, TrainingConfig
from tests.dist_utils import run_distributed
from tests.state_utils import full_state_dict

__all__ = [
    "EPS_REGIME_ATOL",
    "LOSS_RTOL",
    "MODELS",
    "PARAM_ATOL",
    "TINY_GPT",
    "TINY_LLAMA",
    "TINY_LLAMA_TIED",
    "RunResult",
    "assert_equivalent",
    "assert_replicas_identical",
    "cached_reference",
    "max_param_diff",
    "reference_key",
    "run_layout",
    "run_reference",
    "small_config",
    "spec_reference_losses",
]

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-4
#: Warnings no layout's training may raise: each one names a fault in how etrain drives torch. FSDP2 and
#: ``replicate`` warn when the wrapped model returns a view (the tp loss's ``to_local`` once did, so every
#: dp × tp rank log repeated it after each checkpoint).
UNWANTED_WARNINGS = ("returned a view tensor",)

#: The built-in GPT the equivalence tests were written for.
TINY_GPT = ModelConfig(n_layers=4, d_model=32, n_heads=4, vocab_size=64, seq_len=16)
#: One tiny Llama-family model that takes every Llama-specific code path at once: grouped-query
#: attention (4 query heads on 2 kv heads, so tp=2 leaves one kv head per rank), Qwen2's q/k/v
#: biases, Qwen3's per-head q/k RMSNorms (their TP plan is the head-sharded one), SwiGLU's third
#: projection (w3), RoPE; untied, so it also runs pipelined.
TINY_LLAMA = ModelConfig(
    arch="llama",
    n_layers=4,
    d_model=32,
    n_heads=4,
    n_kv_heads=2,
    d_ff=64,
    vocab_size=64,
    seq_len=16,
    attention_bias="qkv",
    qk_norm=True,
)
#: The same with tied input/output embeddings (one parameter used at both ends): non-pipelined
#: layouts only, since ``build_pipeline`` refuses to cut a tied model into stages.
TINY_LLAMA_TIED = dataclasses.replace(TINY_LLAMA, tie_embeddings=True)
MODELS: dict[str, ModelConfig] = {"gpt": TINY_GPT, "llama": TINY_LLAMA, "llama-tied": TINY_LLAMA_TIED}


@dataclass(frozen=True)
class RunResult:
    """What one rank reports after training: per-step losses/norms and the full parameters."""

    rank: int
    losses: list[float]
    grad_norms: list[float]
    params: dict[str, torch.Tensor]
    #: every warning the rank's training raised (Python's ``warnings``, each occurrence)
    warnings: tuple[str, ...] = ()


def small_config(
    *, steps: int = 8, parallel: ParallelConfig | None = None, model: ModelConfig = TINY_GPT, **training
) -> RunConfig:
    """A tiny model that trains in well under a second per step on one CPU core.

    Defaults: the GPT of 4 layers, d_model 32, 4 heads, vocab 64, seq 16 (``model=TINY_LLAMA`` or
    any of ``MODELS`` for another), global batch 8 in micro-batches of 2 (grad accumulation 4 on
    one process, 2 at dp=2), AdamW with clipping at a norm that binds.
    """
    training_kwargs = dict(
        steps=steps, global_batch=8, micro_batch=2, lr=3e-3, warmup_steps=2, grad_clip=0.5, weight_decay=0.1, seed=7
    )
    training_kwargs.update(training)
    return RunConfig(
        job_id="equivalence",
        model=model,
        data=DataConfig(kind="synthetic", seed=3),
        parallel=parallel or ParallelConfig(),
        training=TrainingConfig(**training_kwargs),
    )


def _train(rank: int, world_size: int, config: RunConfig) -> RunResult:
    """Runs in each rank: train ``config.training.steps`` steps and report."""
    from etrain.workers.engine.train import Trainer

    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        trainer = Trainer(config, rank=rank, world_size=world_size, device=torch.device("cpu"))
        history = trainer.run(0, config.training.steps)
    return RunResult(
        rank=rank,
        losses=[m.loss for m in history],
        grad_norms=[m.grad_norm for m in history],
        params=full_state_dict(trainer),
        warnings=tuple(str(w.message) for w in raised),
    )


def reference_key(config: RunConfig) -> RunConfig:
    """The single-process config equivalent to ``config``: one rank, eager, whole logits, no activation
    checkpointing.

    Activation checkpointing, compiling the blocks and chunking the loss only trade memory or time,
    so none may change a number; the reference runs without them. Use the result as a cache key:
    every layout of one config shares the same reference run.
    """
    training = dataclasses.replace(config.training, activation_checkpointing="none", compile=False, loss_chunk_tokens=0)
    return dataclasses.replace(config, parallel=ParallelConfig(), training=training)


def run_reference(config: RunConfig) -> RunResult:
    """Train ``config`` in this process with no process group (world size 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(0, 1, reference_key(config))
    finally:
        torch.set_num_threads(threads)


def spec_reference_losses(body: dict) -> list[float]:
    """Per-step losses of a job spec (a REST body) trained here in one process: the service's own
    spec -> RunConfig, then :func:`run_reference`. What a job of any layout is compared with."""
    from etrain.service.planning.spec import JobSpec

    return run_reference(
        JobSpec.model_validate(body).to_run_config(job_id="reference", checkpoint_root="/unused")
    ).losses


def cached_reference(cache: dict[RunConfig, RunResult], config: RunConfig) -> RunResult:
    """:func:`run_reference` of ``config``, run once per distinct reference key and kept in ``cache`` (a
    module-scoped fixture's dict): every layout of one config shares one single-process run."""
    key = reference_key(config)
    if key not in cache:
        cache[key] = run_reference(key)
    return cache[key]


def run_layout(config: RunConfig, *, timeout_s: float = 150.0) -> list[RunResult]:
    """Train ``config`` on ``config.parallel.world_size`` spawned gloo ranks; results by rank."""
    return run_distributed(_train, config.parallel.world_size, config, timeout_s=timeout_s)


#: AdamW's eps regime (eps 1e-8): an element whose gradient nearly cancels (a token seen twice in four steps)
#: turns fp32 summation-order noise into a visible update difference. A layout that sums attention in another
#: order (ring attention) may leave a few such elements beyond PARAM_ATOL; :func:`assert_equivalent` then allows
#: ``eps_regime_elements`` of them per tensor, none beyond this.
EPS_REGIME_ATOL = 5e-4


def assert_equivalent(
    reference: RunResult, results: list[RunResult], *, layout: str, eps_regime_elements: int = 0
) -> None:
    """Every rank's per-step losses, gradient norms and final parameters equal the single process (at most
    ``eps_regime_elements`` elements of a tensor beyond PARAM_ATOL, and those within EPS_REGIME_ATOL)."""
    for result in results:
        assert len(result.losses) == len(reference.losses), layout
        for step, (got, want) in enumerate(zip(result.losses, reference.losses)):
            assert abs(got - want) <= LOSS_RTOL * abs(want), (
                f"{layout} rank {result.rank} step {step}: loss {got!r} vs single-process {want!r} "
                f"(relative difference {abs(got - want) / abs(want):.3g} > {LOSS_RTOL})"
            )
        for step, (got, want) in enumerate(zip(result.grad_norms, reference.grad_norms)):
            # The global norm over every shard and stage: clipping binds, so a wrong norm would
            # also show in the parameters, but this names the cause.
            assert abs(got - want) <= LOSS_RTOL * abs(want), (
                f"{layout} rank {result.rank} step {step}: grad norm {got!r} vs single-process {want!r}"
            )
        assert result.params.keys() == reference.params.keys(), (
            f"{layout} rank {result.rank}: parameter names differ: "
            f"{sorted(result.params.keys() ^ reference.params.keys())}"
        )
        for name, want in reference.params.items():
            got = result.params[name]
            assert got.shape == want.shape, f"{layout} rank {result.rank} {name}: shape {got.shape} vs {want.shape}"
            delta = (got - want).abs()
            diff = delta.max().item()
            beyond = int((delta > PARAM_ATOL).sum())
            assert beyond <= eps_regime_elements and diff <= (EPS_REGIME_ATOL if beyond else PARAM_ATOL), (
                f"{layout} rank {result.rank} {name}: max |Δ| = {diff:.3g}, {beyond} elements > {PARAM_ATOL}"
            )
        unwanted = [w for w in result.warnings if any(text in w for text in UNWANTED_WARNINGS)]
        assert not unwanted, f"{layout} rank {result.rank}: {unwanted[0]}"


def assert_replicas_identical(results: list[RunResult], *, layout: str) -> None:
    """All ranks end with bit-identical full parameters (dp replicas never drift apart)."""
    first = results[0]
    for result in results[1:]:
        for name, tensor in first.params.items():
            assert torch.equal(result.params[name], tensor), (
                f"{layout}: rank {result.rank} {name} differs from rank 0 by "
                f"{(result.params[name] - tensor).abs().max().item():.3g}"
            )


def max_param_diff(reference: RunResult, result: RunResult) -> float:
    """Largest absolute parameter difference (for reports)."""
    return max((result.params[k] - v).abs().max().item() for k, v in reference.params.items())


def save_and_commit(trainer, root: str, world_size: int) -> str:
    """Save the trainer's checkpoint of its next step under ``root`` and commit it as the supervisor does
    once every rank has reported (collective when ``world_size > 1``); returns the step directory."""
    import torch.distributed as dist

    from etrain.workers.checkpoints.checkpoint_commit import commit, step_dir

    directory = step_dir(root, trainer.next_step)
    report = trainer.save(directory)
    reports = [report]
    if world_size > 1:
        reports = [None] * world_size
        dist.all_gather_object(reports, report)
    if trainer.rank == 0:
        commit(
            directory,
            step=trainer.next_step,
            layout=trainer.config.parallel.describe(),
            world_size=world_size,
            reports=reports,
        )
    if world_size > 1:
        dist.barrier()
    return directory
