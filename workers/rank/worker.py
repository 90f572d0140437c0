"""The Ray actor around one rank's :class:`etrain.workers.engine.train.Trainer`.

One ``TrainWorker`` per rank, placed in its placement-group bundle by ``service/runtime/supervisor_actor.py``. The class
is plain Python (the runtime wraps it with ``ray.remote``), so it stays importable without a cluster.

The actor is *threaded* (the runtime gives it ``max_concurrency > 1``): ``run`` occupies one thread
for the whole attempt while control calls (``chaos``, ``request_checkpoint``, ``ping``) land on
others. Everything the supervisor needs to know travels as fire-and-forget calls on the supervisor
handle (``report_ready``, ``report_steps``, ``report_checkpoint``, ``report_chaos``).

Every step ends with the step-boundary control exchange (``workers/step_control.StepBoundaries``, one
all-gather over a gloo group of its own, overlapped with the next step): the schedule's saves are known
to every rank, and rank 0's requests reach every rank through the exchange, so all ranks save and
stop at the same step. Supervisor requests (``request_checkpoint``, ``request_stop``) count on rank 0
only. The same exchange gives rank 0 every rank's timings; only rank 0 reports steps, batched
(``workers/rank/report_batch.py``). Its reports are the job's heartbeat: a rank that hangs blocks the
exchange, so rank 0 stops reporting, which is what hang detection needs.

Cross-cutting work is in trainer callbacks, not branches in the loop. Fault drills are a plugin
(``workers/rank/chaos.py``), loaded and registered as a callback only when the launch plan enables them
(``LaunchPlan.chaos_enabled``); otherwise the rank refuses ``chaos`` calls. The messages this actor
takes and sends are in ``workers/protocol/messages.py``.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import threading
import time
from typing import Any

from etrain.workers.engine.compile import use_node_cache
from etrain.workers.protocol.compiled_blocks import COMPILED_BLOCK_FORMS, compiled_block_form
from etrain.workers.protocol.messages import REPORT_TIMEOUT_S, ChaosOrder, LaunchPlan, NodeInfo, RunResult
from etrain.workers.protocol.run_config import RunConfig
from etrain.workers.rank.compiled_code import CompiledCode
from etrain.workers.rank.device_info import RankGpus, ray_bundle
from etrain.workers.rank.device_memory import cuda_memory_reader, wait_for_device_memory
from etrain.workers.rank.host_memory import HostMemorySampler, host_memory_use
from etrain.workers.rank.rank_saves import RankSaves
from etrain.workers.rank.report_batch import ReportBatcher
from etrain.workers.rank.step_control import ControlRequests, StepBoundaries, scheduled_save

#: Words of a parameter fingerprinted at a time on its device (``local_param_digest``): a few int64 copies
#: of a piece are its temporary memory (here 4 x 256 MiB at most).
DIGEST_CHUNK_WORDS = 32 << 20


class TrainWorker:
    """One rank of a job's worker group."""

    def __init__(
        self,
        *,
        job_id: str,
        rank: int,
        world_size: int,
        supervisor: Any,
        gpu_ids: list[str] | None = None,
        bundle: str = "",
        spare: bool = False,
    ):
        """``gpu_ids``: the GPUs of this rank's bundle, which Ray did not give to this actor (the worker
        group creates ranks without resources of their own, on the bundle's node; ``spare``: a warm spare,
        ``workers/rank/spare.py``); None: Ray's own, for an actor created with GPUs. ``bundle`` says which
        bundle that is (for messages), where the caller knows it."""
        use_node_cache()  # before anything imports torch._dynamo (workers/engine/compile.py says why)
        self.job_id = job_id
        self.rank = rank
        self.world_size = world_size
        self._supervisor = supervisor
        # One source for the rank's GPUs, pinned before CUDA starts, the context made in the background.
        self._gpus = RankGpus(
            who=f"rank {rank} of job {job_id}", gpu_ids=gpu_ids, bundle=bundle or ray_bundle(rank), spare=spare
        )
        self._drills = None  # etrain.workers.rank.chaos.RankDrills, once a launch plan enables drills
        self._plan: LaunchPlan | None = None
        self._control = ControlRequests()  # acted on at step boundaries, on rank 0 only
        # completed step -> this rank's state then (workers/checkpoints/snapshot.py)
        self._snapshots: dict[int, Any] = {}
        self._saves = None  # this attempt's RankSaves (workers/rank/rank_saves.py)
        self._run_thread: int | None = None  # the thread running `run` (its frames answer `where`)
        self._step: int | None = None  # the step that thread is in
        self._log: Any = None  # the attempt's RankLog while `run` runs
        self._running = False  # an attempt's `run` is under way (a rank is renumbered only between them)
        # a GPU rank's first attempt waits for memory another process holds (workers/rank/device_memory.py)
        self._device_memory_checked = False

    # --- control calls (run concurrently with `run`) -------------------------------------------

    def node_info(self) -> NodeInfo:
        import ray

        context = ray.get_runtime_context()
        return {
            "rank": self.rank,
            "node_id": context.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
        }

    def _node_id(self) -> str:
        try:
            import ray

            return ray.get_runtime_context().get_node_id()
        except Exception:  # noqa: BLE001 - outside Ray (a test's process): no node to name
            return ""

    def free_port(self) -> int:
        """A free TCP port on this node for the rendezvous (asked of rank 0 only)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]

    def ping(self) -> int:
        return self.rank

    def where(self) -> dict[str, Any]:
        """Where this rank's training thread is, for a hang's diagnosis: ``{"step", "frames"}`` (frames
        outermost first, each ``[file, line, function]``; empty when no attempt runs). Answered from
        another thread of the actor while the training thread is blocked (in a collective, in I/O)."""
        import sys
        import traceback

        ident = getattr(self, "_run_thread", None)  # a spare not yet assigned has run nothing
        frame = sys._current_frames().get(ident) if ident is not None else None
        frames = [[f.filename, f.lineno or 0, f.name] for f in traceback.extract_stack(frame)] if frame else []
        log = getattr(self, "_log", None)
        if log is not None and frames:  # the rank's own log keeps what it answered
            innermost = "; ".join(f"{file}:{line} in {name}" for file, line, name in reversed(frames[-6:]))
            log.write(f"hang diagnosis: the training thread is at step {self._step}: {innermost}")
        return {"step": getattr(self, "_step", None), "frames": frames[-40:]}

    def request_checkpoint(self, completed_steps: int | None = None) -> None:
        """Save a checkpoint at the first step boundary with at least ``completed_steps`` steps done
        (None: the next one). Only rank 0's requests count: it decides for every rank at the boundary."""
        self._control.request_checkpoint(completed_steps)

    def renumber(self, rank: int, world_size: int) -> int:
        """Become rank ``rank`` of ``world_size`` for the next attempt (an in-place resize keeps this process
        at another place in the new world: its data-parallel index stays, the world around it changes).
        Refused while an attempt runs."""
        if getattr(self, "_running", False):
            raise RuntimeError(f"rank {self.rank} of job {self.job_id} cannot be renumbered while it trains")
        self.rank, self.world_size = int(rank), int(world_size)
        return self.rank

    def request_stop(self) -> None:
        """Finish the current step (and its save, if any) and return from ``run``; counts on rank 0 only,
        which stops every rank at the same boundary."""
        self._control.request_stop()

    def chaos(self, order: ChaosOrder) -> None:
        """Arm (``at_step``, or a save to fire in) or fire at once a fault drill on this rank; refused
        unless a launch plan of this process enabled drills (the supervisor sends none otherwise)."""
        if self._drills is None:
            raise RuntimeError(
                f"rank {self.rank} of job {self.job_id} refuses chaos order {order.id} ({order.action}): fault "
                "drills are disabled for this job (its launch plan has chaos_enabled=False); they run only on "
                "servers started with ETRAIN_ENABLE_CHAOS=1 (`etrain serve --enable-chaos`)"
            )
        self._drills.receive(order)

    # --- the attempt ----------------------------------------------------------------------------

    def run(self, plan: LaunchPlan, master_addr: str, master_port: int) -> RunResult:
        """Rendezvous, build the trainer, restore, and train until the plan's last step.

        Returns ``{"final_step", "final_loss", "stopped"}``; raises on any failure (the supervisor
        classifies it). Everything the attempt prints, each step and any error go to the rank's log
        file (``workers/rank/rank_log.py``: what ``etrain logs`` shows).
        """
        import traceback

        from etrain.workers.checkpoints import storage
        from etrain.workers.rank.rank_log import RankLog, rank_log_path

        given = plan
        self._run_thread, self._step = threading.get_ident(), None
        # The checkpoint folder is opened once, without links, and everything the attempt writes under it
        # (shards, extra state, the rank log) goes through that descriptor: the folder swapped for a link
        # after submit redirects nothing (workers/protocol/safe_paths.py HeldDir). UnsafePathError fails the attempt.
        held = storage.hold_dir(plan.config.checkpoint.path) if plan.config.checkpoint.path else None
        if held is not None:
            plan = dataclasses.replace(
                plan,
                resume_dir=held.inside(plan.resume_dir),
                config=dataclasses.replace(
                    plan.config, checkpoint=dataclasses.replace(plan.config.checkpoint, path=held.path)
                ),
            )
        log = RankLog(rank_log_path(held.path, self.job_id, self.rank)) if held is not None else None
        self._log = log
        if log is not None:
            info = self.node_info()
            log.write(
                f"attempt {plan.attempt}: rank {self.rank}/{self.world_size} on {info['ip']} (node "
                f"{info['node_id'][:12]}, pid {info['pid']}), layout {plan.config.parallel.describe()}, "
                + (f"resuming step {plan.start_step} from {given.resume_dir}" if given.resume_dir else "fresh start")
            )
            log.capture()
        self._running = True
        try:
            result = self._train(plan, master_addr, master_port, log)
        except BaseException as err:
            if log is not None:
                log.write(
                    held.shown(
                        f"attempt {plan.attempt}: failed: {type(err).__name__}: {err}\n"
                        + traceback.format_exc().rstrip()
                    )
                )
            raise
        else:
            if log is not None:
                log.write(
                    f"attempt {plan.attempt}: {'stopped' if result['stopped'] else 'finished'} at step "
                    f"{result['final_step']}"
                )
            return result
        finally:
            self._log, self._running = None, False
            if log is not None:
                log.close()
            if held is not None:
                held.close()

    def _train(self, plan: LaunchPlan, master_addr: str, master_port: int, log: Any) -> RunResult:
        import torch
        import torch.distributed as dist

        from etrain.workers.engine.compile import compile_profile, compile_seconds
        from etrain.workers.engine.mesh import backend_for
        from etrain.workers.engine.train import Trainer
        from etrain.workers.rank.step_exchange import StepExchange

        self._plan = plan
        self._control = ControlRequests()  # requests to an earlier attempt of this process do not carry over
        callbacks = self._arm_drills(plan)
        config = plan.config
        torch.set_num_threads(max(1, int(os.environ.get("ETRAIN_TORCH_THREADS", "1"))))
        device = self._device(config)
        batcher = None
        phases = _Phases()  # where the attempt's start-up goes: one line in the rank log
        compiled_before = compile_seconds()  # this process may have compiled in an earlier attempt
        profile_before = compile_profile() if config.training.compile else None
        _leave_process_groups()  # a kept process (in-place repair) rejoins from a clean slate
        dist.init_process_group(
            backend=backend_for(device.type, cpu_offload=config.parallel.offload == "cpu"),
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=config.collective_timeout_s),
        )
        phases.mark("process group")
        restored = None  # the Trainer once its state is whole (after the restore): a failure keeps that state
        boundaries = None
        try:
            from etrain.workers.rank.health_check import check_health

            if device.type == "cuda" and not self._device_memory_checked:
                # After the rendezvous (the CUDA context is made beside it) and before the health check, whose
                # allocation would fail on a device another process still fills, failing this node; on a GPU
                # its deadline leaves the peers room for this wait (health_check_timeout_s).
                self._device_memory_checked = True
                found = wait_for_device_memory(cuda_memory_reader(device))
                if found.held_at_start:
                    phases.mark("device memory")
                    if log is not None:
                        log.write(f"attempt {plan.attempt}: {found.summary()}")
                    self._supervisor.report_note.remote(
                        plan.attempt, "device_memory", f"rank {self.rank}: {found.summary()}"
                    )
            drills = self._drills
            check_health(
                device,
                rank=self.rank,
                node=self._node_id(),
                drill=(lambda: drills.health_failure(plan.start_step)) if drills is not None else None,
            )
            phases.mark("health check")
            trainer = Trainer(
                config,
                rank=self.rank,
                world_size=self.world_size,
                device=device,
                callbacks=callbacks,
                load_pretrained=plan.resume_dir is None,  # a resume overwrites them anyway
            )
            phases.mark("trainer")
            compiled = CompiledCode(
                plan, rank=self.rank, coords=trainer.topology.coords(self.rank), supervisor=self._supervisor, log=log
            )
            if compiled.load():  # before the first step compiles: its graphs then come from the node's cache
                phases.mark("compile cache")
            source, committed, resumed = None, plan.start_step, None
            if plan.resume_dir:
                source, start, resumed = self._restore(trainer, plan)
                if start != plan.start_step:  # a later step the ranks held in memory (an in-place repair)
                    plan = self._plan = dataclasses.replace(plan, start_step=start)
            phases.mark("state")
            restored = trainer
            # Collective when the saves are async (the background writer's gloo group).
            self._saves = saves = RankSaves(
                rank=self.rank,
                plan=plan,
                device_type=device.type,
                supervisor=self._supervisor,
                control=self._control,
                drills_due=self._drills_due,
                keep_snapshot=self._keep_snapshot,
            )
            # Collective too: the step-boundary control exchange's own gloo group (workers/rank/step_exchange.py).
            exchange = StepExchange(world_size=self.world_size, timeout_s=config.collective_timeout_s)
            if self.rank == 0:
                batcher = self._report_batcher(plan.attempt)
            phases.mark("control groups")
            if log is not None:
                log.write(f"attempt {plan.attempt}: ready after {phases}{self._gpus.warmup_summary()}")
            self._supervisor.report_ready.remote(
                plan.attempt, self.rank, self.node_info() | {"state_source": source, "start_step": plan.start_step}
            )
            final_loss = None
            step = plan.start_step
            total = config.training.steps
            every = config.checkpoint.every_steps
            # Every rank saves and stops where rank 0's requests and the schedule say, the exchange
            # overlapped with the next step (workers/rank/step_control.py).
            boundaries = StepBoundaries(
                exchange, control=self._control if self.rank == 0 else None, total_steps=total, every_steps=every
            )
            saves.before_first_step(trainer)
            if plan.start_step > committed and scheduled_save(plan.start_step, total_steps=total, every_steps=every):
                # Resumed from memory at a step whose scheduled save never committed (the failure came during
                # it): make that save again, from the very copy the ranks resumed from, written in the background.
                self._keep_snapshot(trainer, plan.start_step, held=resumed)
                blocked_s = saves.save_held(trainer, resumed)
                if log is not None:
                    log.write(
                        f"checkpoint step {plan.start_step} {saves.describe(blocked_s, held=True)} "
                        "(again, after the repair)"
                    )
            host_memory = HostMemorySampler()
            for step in range(plan.start_step, total):
                self._step = step + 1  # the step it runs, counted as the logs count it
                metrics = dataclasses.asdict(trainer.train_step(step))
                metrics["host_mem_bytes"] = host_memory.held_bytes()  # exchanged: the supervisor's host-memory watch
                final_loss = metrics["loss"]
                if step == plan.start_step:
                    saves.after_first_step(trainer)
                    if config.training.compile:
                        compiled_now = compile_profile()
                        # compiling is lazy (the first step's forward and backward): its own phase
                        form = compiled_block_form(
                            ep=config.parallel.ep,
                            tp=config.parallel.tp,
                            moe=config.model.n_experts > 0,
                            checkpointing=config.training.activation_checkpointing,
                        )
                        compiled_line = (
                            f"compile {compile_seconds() - compiled_before:.1f}s "
                            f"(first step {metrics['step_s']:.1f}s; {COMPILED_BLOCK_FORMS[form]}"
                        )
                        if log is not None:
                            log.write(
                                f"attempt {plan.attempt}: {compiled_line}; "
                                f"cache {os.environ.get('TORCHINDUCTOR_CACHE_DIR')})"
                            )
                            log.write(f"attempt {plan.attempt}: compile spans {compiled_now.since(profile_before)}")
                        if self.rank == 0:  # the job's event: rank 0's figures (each rank's are in its log)
                            self._supervisor.report_note.remote(plan.attempt, "compiled", f"rank 0: {compiled_line})")
                        counts = compiled_now.counts_since(profile_before)
                        grew = counts["FX graph cache misses"] + counts["AOTAutograd cache misses"] > 0
                        compiled.after_first_step(grew)
                        if grew:  # the node's cache grew: keep it within its bound, in the background
                            self._bound_node_cache(plan, log)
                decision = boundaries.after_step(metrics)
                if batcher is not None:  # a step that saves or stops is urgent (the last step always saves)
                    for record, urgent in decision.reports:
                        batcher.add(record, urgent=urgent)
                if log is not None:
                    log.write(
                        f"step {step + 1}/{total} loss {metrics['loss']:.4f} "
                        f"compute {metrics['compute_s']:.3f}s comm_wait {metrics['comm_wait_s']:.3f}s"
                    )
                if decision.save:
                    blocked_s = saves.save(trainer, step + 1, final=step + 1 >= total)
                    if log is not None:
                        log.write(f"checkpoint step {step + 1} {saves.describe(blocked_s)}")
                        log.sync()  # an s3:// log is uploaded at each checkpoint (a no-op for a local one)
                saves.after_step(metrics, step + 1, total)
                if decision.stop:
                    return self._result(trainer, step + 1, final_loss, stopped=True)
            return self._result(trainer, total, final_loss, stopped=False)
        except Exception as err:
            if restored is not None:
                self._keep_live_state(restored, err, log)
            if batcher is not None and boundaries is not None:  # the last step completed, reported as it ends
                for record in boundaries.unreported():
                    batcher.add(record)
            raise
        finally:
            # Each step on its own: after a peer died, the async writer's close can raise, and this
            # process may run the next attempt (an in-place repair), which needs the groups gone.
            # Timed like the start-up: the seconds between the last step and the job's end, in one line.
            ending = _Phases()
            if batcher is not None:  # the last steps reach the supervisor before run() returns
                self._close_reports(batcher)
                ending.mark("reports")
            if self._saves is not None:  # the save in flight lands and every report is acknowledged
                self._saves.close(log)
                self._saves = None
                ending.mark("saves closed")
            _leave_process_groups()
            ending.mark("process groups")
            if log is not None:
                log.write(f"attempt {plan.attempt}: wound down in {ending}")
                # what the rank held against what its bundle reserves (workers/rank/host_memory.py)
                log.write(f"attempt {plan.attempt}: {host_memory_use().describe(plan.host_memory_bytes)}")

    @staticmethod
    def _bound_node_cache(plan: LaunchPlan, log: Any) -> threading.Thread | None:
        """One pass of the node's compile-cache bound in the background (``workers/engine/node_cache_bound.py``);
        its thread, or None where no cache folder is set."""
        from etrain.workers.engine.node_cache_bound import bound_in_background, inductor_header_folder

        def write(line: str) -> None:
            if log is not None:  # as compiled_code.py's background share writes its line
                log.write(f"attempt {plan.attempt}: {line}")

        folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        # and inductor's precompiled headers, which it keeps in its default folder whatever the cache's is
        return bound_in_background([folder, inductor_header_folder()], write) if folder else None

    def _restore(self, trainer, plan: LaunchPlan) -> tuple[str, int, Any]:
        """Load the state to resume from; returns where it came from, the step to run next and the snapshot
        it came from (None: from storage).

        A relaunch reads committed step ``plan.start_step`` from storage (the supervisor verified its
        checksums just before). An in-place repair first offers memory: the ranks agree on the newest step
        from the last commit on that memory serves to every rank (each its own copy, or one received from a
        data-parallel replica): the survivors' live state after a failure, else a checkpointed step's copy.
        When memory cannot serve every rank, all of them read the committed step from storage together,
        hashing every file (the supervisor did not, this time).
        """
        if plan.state_from_memory:
            from etrain.workers.checkpoints.snapshot import replica_holder_groups, resume_from_snapshot, share_snapshots

            parallel, total, limit = plan.config.parallel, plan.config.training.steps, plan.memory_resume_limit
            self._forget_snapshots_unfit(parallel)
            snapshot, origin = share_snapshots(
                self._snapshots,
                replica_holder_groups(parallel, trainer.topology),
                floor=plan.start_step,
                below=total if limit is None else min(total, limit + 1),
            )
            if snapshot is not None:
                start = resume_from_snapshot(trainer, snapshot)
                self._forget_snapshots_after(start)
                return origin, start, snapshot
            trainer.restore(plan.resume_dir, verify_checksums=True, expect_digest=plan.resume_digest)
            self._forget_snapshots_after(plan.start_step)
            return "storage (no replica in memory for every rank)", plan.start_step, None
        trainer.restore(plan.resume_dir, verify_checksums=False, expect_digest=plan.resume_digest)
        return "storage", plan.start_step, None

    def _forget_snapshots_unfit(self, parallel) -> None:
        """Drop the copies taken at another data-parallel size where state is sharded over dp (an in-place
        resize of a ZeRO/HSDP job): their shards are of other tensors than this layout's."""
        from etrain.workers.protocol.memory_resume import state_still_fits

        for step, kept in list(self._snapshots.items()):
            if not state_still_fits(taken_at_dp=kept.dp, dp=parallel.dp, zero=parallel.zero):
                del self._snapshots[step]

    def _forget_snapshots_after(self, step: int) -> None:
        """Drop the copies of steps after the one this attempt resumed from: they belong to a history the
        job left, and must never be offered again as its state."""
        for later in [kept for kept in self._snapshots if kept > step]:
            del self._snapshots[later]

    def _keep_live_state(self, trainer, err: BaseException, log: Any) -> None:
        """After this attempt failed: keep this rank's state at the step it completed last, for the in-place
        repair that may follow (``workers/checkpoints/snapshot.py`` says why that state is exact; nothing in
        a step draws random numbers, so the generators are as that step left them). Only where a replica
        can serve the lost rank the same step (DDP, HSDP: ``snapshot.has_replicas``), not after a job error
        (no repair follows), and on a GPU
        only if the device has nothing left to run: a collective that a dead peer never joined leaves it
        busy, and a copy queued behind it would never finish. Never raises: the attempt's own error is
        what the caller reports."""
        import time

        import torch

        from etrain.workers.checkpoints.snapshot import has_replicas
        from etrain.workers.protocol.errors import EtrainError

        plan = self._plan
        parallel = plan.config.parallel if plan is not None else None
        if parallel is None or isinstance(err, EtrainError) or not plan.keep_snapshots:
            return
        step = trainer.next_step
        if not has_replicas(parallel) or step in self._snapshots:
            return
        try:
            started = time.monotonic()
            if trainer.device.type == "cuda" and not _device_idle(torch.cuda.current_stream(trainer.device)):
                if log is not None:
                    log.write(f"attempt {plan.attempt}: step {step}'s state not kept: the GPU is still busy")
                return
            self._store_snapshot(trainer, step)
            if log is not None:
                log.write(
                    f"attempt {plan.attempt}: kept step {step}'s state in memory ({time.monotonic() - started:.2f}s)"
                )
        except Exception as copy_err:  # noqa: BLE001 - the repair falls back to the committed step
            if log is not None:
                log.write(f"attempt {plan.attempt}: step {step}'s state not kept: {copy_err}")

    def _keep_snapshot(self, trainer, completed_steps: int, *, held: Any = None) -> None:
        """Copy this rank's state at a checkpointed step to host memory, for an in-place repair (``held``: a
        snapshot of that step this rank holds already, kept instead of a new copy).

        Two are kept (``memory_resume.SNAPSHOTS_KEPT``): the newest may not be committed yet when a rank dies,
        the one before it is.
        Only where a data-parallel replica holds the same state (``snapshot.has_replicas``: DDP, HSDP's other
        replica groups, with the same experts under expert parallelism): the rank a repair replaces is a new
        process with no snapshot, so without a replica to send it one every rank restores from storage
        (``etrain.workers.checkpoints.snapshot.share_snapshots``) and a copy here would never be read.
        The exception is dp=1 in a job that may grow (``LaunchPlan.may_grow``): an in-place grow resumes
        from the step committed at dp=1, and the ranks it adds receive this rank's copy of it.
        Never raises: the copy only speeds a repair up, so a copy that fails (host memory, a tensor it cannot
        read) is said in the rank log and the save goes on; a repair then restores from storage what memory
        cannot serve.
        """
        from etrain.workers.checkpoints.snapshot import has_replicas

        parallel = self._plan.config.parallel
        # A grow from dp=1 adds this rank's replicas (ep and dp_replicate divide dp: both are 1 here).
        replica_to_be = self._plan.may_grow and parallel.dp == 1 and has_replicas(dataclasses.replace(parallel, dp=2))
        if not self._plan.keep_snapshots or not (has_replicas(parallel) or replica_to_be):
            return
        try:
            self._store_snapshot(trainer, completed_steps, held=held)
        except Exception as err:  # noqa: BLE001 - the save and the run go on; the repair falls back to storage
            if self._log is not None:
                self._log.write(
                    f"attempt {self._plan.attempt}: step {completed_steps}'s state not kept in memory: "
                    f"{type(err).__name__}: {err}"
                )

    def _store_snapshot(self, trainer, step: int, *, held: Any = None) -> None:
        """Copy this rank's state after ``step`` completed steps to host memory (or keep ``held``, a copy of
        it); the newest two are kept, the others dropped before the copy is taken (``memory_resume.keep_copy``)."""
        from etrain.workers.checkpoints.snapshot import take_snapshot
        from etrain.workers.protocol.memory_resume import keep_copy

        def take() -> Any:
            if held is not None:
                return held
            return take_snapshot(step, *trainer.state_for_checkpoint(), dp=trainer.config.parallel.dp)

        keep_copy(self._snapshots, step, take)

    def _report_batcher(self, attempt: int) -> ReportBatcher:
        """Rank 0's batched step reports: ``report_steps(attempt, records)``, fire-and-forget."""
        supervisor = self._supervisor
        return ReportBatcher(lambda records: supervisor.report_steps.remote(attempt, records)).start()

    @staticmethod
    def _close_reports(batcher: ReportBatcher) -> None:
        """Send what is buffered and wait until the supervisor accepted the last report (it takes calls
        from one caller in order); a supervisor that is gone or slow does not fail the attempt."""
        import ray

        try:
            last = batcher.close()
            if last is not None:
                ray.get(last, timeout=REPORT_TIMEOUT_S)
        except Exception:
            pass

    def _result(self, trainer, final_step: int, final_loss: float | None, *, stopped: bool) -> RunResult:
        started = time.monotonic()
        digest = local_param_digest(trainer.model_parts)
        if self._log is not None:
            self._log.write(f"attempt {self._plan.attempt}: param digest {time.monotonic() - started:.2f}s")
        return {
            "rank": self.rank,
            "final_step": final_step,
            "final_loss": final_loss,
            "stopped": stopped,
            "param_digest": digest,
        }

    # --- drills ---------------------------------------------------------------------------------

    def _arm_drills(self, plan: LaunchPlan) -> list[Any]:
        """The trainer callbacks of this attempt: the drill plugin's, loaded only when the plan enables
        drills (``workers/rank/chaos.py``), with the plan's orders for this rank armed; none otherwise.
        A process keeps its drills across the attempts it runs (armed orders, a slow factor, a hang)."""
        if not plan.chaos_enabled:
            return []
        if self._drills is None:
            from etrain.workers.rank.chaos import RankDrills

            self._drills = RankDrills(rank=self.rank, report=self._report_chaos)
        for order in plan.chaos:
            self._drills.arm(order)
        return [self._drills.callback]

    def _drills_due(self, completed_steps: int, during: str) -> None:
        """Fire the drills due inside this save (``checkpoint_write``/``checkpoint_commit``), if any."""
        if self._drills is not None:
            self._drills.fire_due(completed_steps, during)

    def _report_chaos(self, order: ChaosOrder, step: int | None) -> None:
        """Tell the supervisor a drill fired and wait until it accepted (the process may die next)."""
        import ray

        attempt = self._plan.attempt if self._plan else -1
        ray.get(self._supervisor.report_chaos.remote(attempt, self.rank, order.id, step), timeout=REPORT_TIMEOUT_S)

    # --- devices --------------------------------------------------------------------------------

    def devices(self) -> dict[str, Any]:
        """The GPUs this rank runs on (a control call, for tests and operators): the ids ``_device`` uses,
        where they came from, the bundle, ``CUDA_VISIBLE_DEVICES`` and the background CUDA warm-up."""
        return {"rank": self.rank} | self._gpus.state()

    def _device(self, config: RunConfig):
        """The CPU, or ``cuda:0`` of a process pinned to this rank's own GPUs (``workers/rank/device_info.py``)."""
        return self._gpus.device(config.device)


def _device_idle(stream: Any, wait_s: float = 2.0) -> bool:
    """Whether ``stream`` finishes what it was given within ``wait_s`` (polled: a wait could hang)."""
    import time

    deadline = time.monotonic() + wait_s
    while not stream.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class _Phases:
    """Seconds per start-up phase of an attempt, so a slow start says where its time went."""

    def __init__(self) -> None:
        import time

        self._clock = time.monotonic
        self._started = self._last = self._clock()
        self._spent: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        now = self._clock()
        self._spent.append((phase, now - self._last))
        self._last = now

    def __str__(self) -> str:
        return f"{self._last - self._started:.2f}s (" + ", ".join(f"{name} {s:.2f}s" for name, s in self._spent) + ")"


def _leave_process_groups() -> None:
    """Destroy the default group and every group made from it (the exchange's, the async writer's)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def local_param_digest(model_parts) -> str:
    """A SHA-256 over this rank's local parameters, in name order: of each parameter's name, dtype, size
    and a 128-bit fingerprint of its bytes computed where the parameter lives (:func:`_fingerprint`).

    Ranks holding the same parameters (data-parallel replicas with zero <= 1) must report the same
    digest after training; a mismatch means the replicas diverged (gradients were not averaged).

    Why a fingerprint on the device: hashing the bytes on the host means copying them there first. For
    a 1B model's 5 GB of fp32 parameters that cost the end of every H100 attempt 4.3-4.6 s with SHA-256
    per parameter on threads, and still 3.6-4.3 s in 64 MiB pieces (``make gpu-check``, 2026-11-27): the
    device -> pageable host copies were the cost. On the device the fingerprint is a few integer kernels
    per parameter, and what reaches the host is 16 bytes per parameter.
    """
    import hashlib

    import torch

    named = [
        (name, param)
        for part in model_parts
        for name, param in sorted(part.named_parameters(), key=lambda item: item[0])
    ]
    locals_ = [param.to_local() if hasattr(param, "to_local") else param for _, param in named]
    with torch.no_grad():
        prints = [_fingerprint(local.detach()) for local in locals_]
    host = torch.stack(prints).cpu() if prints else []  # one device -> host copy, 16 bytes per parameter
    digest = hashlib.sha256()
    for (name, _), local, fingerprint in zip(named, locals_, host):
        digest.update(f"{name}|{local.dtype}|{local.numel()}|".encode())
        digest.update(fingerprint.numpy().tobytes())
    return digest.hexdigest()


#: The word sizes a fingerprint reads a parameter's bytes as, widest first.
_WORDS = (("int32", 4), ("int16", 2), ("uint8", 1))
#: Odd 64-bit mixing constants (splitmix64's), as signed int64.
_MIX = (0x9E3779B97F4A7C15 - 2**64, 0xBF58476D1CE4E5B9 - 2**64)


def _fingerprint(tensor) -> Any:
    """Two wrapping int64 sums over ``tensor``'s bytes read as words ``w_i`` (32-bit where the size allows,
    else 16- or 8-bit), on its device: ``sum w_i * (2i + 1)`` and ``sum ((w_i ^ (i * C1)) * C2)``.

    Integer sums wrap modulo 2**64 whatever the order they are added in, so the same bytes give the same
    fingerprint on any device and with any kernel. Any single changed word changes the first sum (its
    factor is odd); the second mixes positions and values so that changes do not cancel in the first.
    Pieces of ``DIGEST_CHUNK_WORDS`` bound the temporary memory (a few int64 copies of a piece).
    """
    import torch

    flat = tensor.contiguous().view(-1)
    nbytes = flat.numel() * flat.element_size()
    word, size = next((getattr(torch, d), size) for d, size in _WORDS if nbytes % size == 0)
    if (flat.storage_offset() * flat.element_size()) % size:
        flat = flat.clone()  # a view at an unaligned offset: words are read from a copy, the same bytes
    words = flat.view(torch.uint8).view(word) if nbytes else flat.new_zeros(0, dtype=torch.int32)
    sums = torch.zeros(2, dtype=torch.int64, device=tensor.device)
    for start in range(0, words.numel(), DIGEST_CHUNK_WORDS):
        w = words[start : start + DIGEST_CHUNK_WORDS].to(torch.int64)
        i = torch.arange(start, start + w.numel(), dtype=torch.int64, device=w.device)
        sums[0] += (w * (2 * i + 1)).sum()
        sums[1] += ((w ^ (i * _MIX[0])) * _MIX[1]).sum()
    return sums
