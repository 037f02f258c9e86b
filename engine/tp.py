"""The process group of one engine's ranks: rank 0 schedules, ranks 1..N-1 follow.

An engine runs tensor_parallel_size x pipeline_parallel_size ranks (N), rank = stage * tp + TP
index (engine/parallel.py). Rank 0 (the caller's process) broadcasts each step's ModelInput as
msgpack bytes over a gloo group (plain data, no pickle) to every rank; each rank then runs the
step on its shard of its stage's layers and KV, the stages one after another, each handing its
activations to the next (model_runner.py). Only rank 0 samples: the vocab-parallel LM head, on
the first stage, gathers logits there. Under pipeline stages rank 0 does not wait for the
broadcast to be taken (`TPGroup.broadcast`): a later stage may still be computing an earlier step
whose final hidden states rank 0 does not need (model_runner.py `_hand_on`), and it takes the next
step's input when it gets there; rank 0 runs at most PP_STEPS_AHEAD steps ahead (`wait_ahead`,
called by the engine before it times a step).

A step that hands prefill KV off under pipeline stages (ModelInput.kv_pushes) ends with one more
collective: the later stages' ranks push their own layers (engine/kv_publish.py) and their push
reports are gathered on rank 0 (`TPGroup.gather_reports`). Rank 0 does not wait for that gather:
it would wait for the last stage to finish the step, and a prefill worker's long prompt would pay
the pipeline's bubble on every chunk. It issues the gather asynchronously and hands the reports to
the step's sinks later (`harvest_reports`): those done at the start of each step, all of them when
a step samples a hand-off request (before its output, hence its commit, leaves the engine, and
before its KV is freed), and all of them on shutdown; at most PP_STEPS_AHEAD + 1 are pending
(MAX_PENDING_REPORTS). The gathers run on a gloo group of their own (rank 0 and the later stages'
ranks, `reports` from `_init`), so the collective order on each group is the same on every rank
trivially: the control group carries only step broadcasts, in step order; the reports group only
gathers, in step order (a follower gathers right after its step, rank 0 issues the gather right
after its part of the same step). Neither can deadlock the other: a gloo group runs its
asynchronous works on threads of its own, rank 0 waits on a gather only once every collective
and activation send of that step and of every step before it has been issued, and a follower
reaches that gather after running exactly those steps. (On one shared group the gather would also
take one of that group's two gloo worker threads, and a first-stage TP rank could not take the
next step's broadcast before the last stage finished its gather.) The first stage's followers,
which push nothing, take no part.

On CUDA the weights' collectives run over NCCL, one GPU per rank. NCCL cannot put two ranks on
one GPU, so a machine with a single GPU can still run the TP code on CUDA tensors with
PDSERVE_TP_BACKEND=gloo: the ranks then share the GPUs round robin and the collectives pass
through host memory (engine/parallel.py). That setting is for proving the code, not for speed.

Who starts ranks 1..N-1 is a RankLauncher. By default (LLM(...) in a plain process, the tests) it is
LocalRanks: processes forked from multiprocessing's fork server, which imported torch once
(`_rank_context`; each takes rank 0's environment first, engine/rank_process.py; CUDA ranks are
spawned), the rendezvous on 127.0.0.1. A process may install another with `use_launcher` before
its engine starts; under `pdserve up` the worker's Ray actor installs deploy/rank_actors.py's,
which runs each follower as a Ray actor in its own bundle of the worker's placement group (so
pipeline stages may sit on different Ray nodes) and rendezvouses on rank 0's node address. Either
way a follower runs `follower_main`, and TPGroup holds one handle per follower (is_alive, join,
kill, pid, node), so the engine notices a dead rank (engine_core.ranks_alive) and stops the others
the same way.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os
import pickle
import time
from collections import deque
from collections.abc import Callable

import msgpack
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pdserve.engine import rank_process
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.kv_publish import StagePusher, report_rows
from pdserve.engine.model_runner import PP_STEPS_AHEAD, ModelInput, SeqInput
from pdserve.engine.parallel import current_tp_state, set_tp_state, stage_layers

_TIMEOUT = datetime.timedelta(seconds=int(os.environ.get("PDSERVE_TP_TIMEOUT_S", "600")))


def _master_store(host: str, world: int) -> dist.TCPStore:
    """Rank 0's store, listening on a port the kernel picks as it binds (store.port), before any
    follower is told the port. A port found free first and bound later could be taken between the
    two, by any process's outgoing connection (the kernel hands out the same ephemeral range): a
    CI run lost a TP-3 decode worker's start to EADDRINUSE so."""
    return dist.TCPStore(host, 0, world, is_master=True, timeout=_TIMEOUT, wait_for_workers=False)


def _backend(config: EngineConfig) -> str:
    """The weights' collective backend: nccl on CUDA, gloo on CPU; PDSERVE_TP_BACKEND=gloo
    forces gloo on CUDA (see the module docstring)."""
    wanted = os.environ.get("PDSERVE_TP_BACKEND", "")
    if wanted not in ("", "gloo", "nccl"):
        raise ValueError(f"PDSERVE_TP_BACKEND must be 'gloo' or 'nccl', got {wanted!r}")
    if config.device != "cuda":
        return "gloo"
    return wanted or "nccl"


def world_size(config: EngineConfig) -> int:
    return config.tensor_parallel_size * config.pipeline_parallel_size


JOINED_KEY = "pdserve/tp/joined"  # the followers that joined rank 0's store, counted there
_JOIN_POLL_S = 0.05


def _rendezvous(rank: int, world: int, host: str, port: int, followers: list, master=None):
    """The engine's store, which rank 0 hosts at host:port (`master`, made by _master_store
    before the followers started): a follower counts itself in; rank 0 waits until every
    follower has, and fails at once, naming the rank, when a follower's process (`followers`,
    the launcher's handles) ended before it joined. A follower that fails as it starts (an import
    error, a script without the __main__ guard) would otherwise keep rank 0 waiting
    PDSERVE_TP_TIMEOUT_S for a timeout that names nobody."""
    if rank:
        store = dist.TCPStore(host, port, world, is_master=False, timeout=_TIMEOUT)
        store.add(JOINED_KEY, 1)
        return store
    if master is None:  # (a store bound here would not be on the port the followers were told)
        raise ValueError("rank 0 rendezvouses on the store it made before the followers started")
    store = master
    deadline = time.monotonic() + _TIMEOUT.total_seconds()
    while (joined := store.add(JOINED_KEY, 0)) < world - 1:
        for r, handle in enumerate(followers, 1):
            if _ended(handle):
                code = getattr(handle, "exitcode", None)
                raise RuntimeError(
                    f"engine rank {r} ended{'' if code is None else f' (exit code {code})'} "
                    f"before it joined rank 0: its own error is in its output. A script that "
                    f'builds an LLM with several ranks needs the `if __name__ == "__main__":` '
                    f"guard"
                )
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{joined} of the engine's {world - 1} other ranks joined rank 0 within "
                f"PDSERVE_TP_TIMEOUT_S={_TIMEOUT.total_seconds():.0f}s"
            )
        time.sleep(_JOIN_POLL_S)
    return store


def _ended(handle) -> bool:
    """Whether a follower's process (a launcher's handle) has ended, without waiting for it: a
    multiprocessing Process by its exit code, another launcher's handle by its `ended()`."""
    ended = getattr(handle, "ended", None)
    return ended() if ended is not None else handle.exitcode is not None


def _init(
    config: EngineConfig,
    rank: int,
    host: str,
    port: int,
    followers: list | None = None,
    master: dist.TCPStore | None = None,
):
    """Joins the engine's process group; returns (control, reports): the gloo group of the step
    broadcasts, and under pipeline stages the gloo group of the push reports' gathers (rank 0 and
    the later stages' ranks; every rank creates it, members or not), else None. `followers`,
    `master`: rank 0's handles of the other ranks and its store (`_rendezvous`)."""
    backend = _backend(config)
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if config.device == "cuda":  # (gloo may share a GPU between ranks; NCCL may not)
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = _rendezvous(rank, tp * pp, host, port, followers or [], master)
    _restart_group_names()
    dist.init_process_group(backend, store=store, rank=rank, world_size=tp * pp, timeout=_TIMEOUT)
    try:
        return _groups(config, rank, backend)
    except BaseException:  # this process's next engine starts from no group, not from this one
        dist.destroy_process_group()
        raise


def _restart_group_names() -> None:
    """Makes this process name its next groups from 0, as a fresh follower does. torch names a
    group by a counter of the process, which only a whole destroy_process_group() resets; a rank
    0 whose earlier engine's group ended some other way named its new default group "2" while
    its followers named theirs "0", and every rank then waited in a rendezvous no other rank
    joined (a CI run hung so). Only where no default group is up: torch refuses a second one."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if not dist.is_initialized() and hasattr(world, "group_count"):
        world.group_count = 0


def _groups(config: EngineConfig, rank: int, backend: str):
    """_init's groups once the default group is up (its return value)."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if config.device == "cpu":  # share the cores instead of oversubscribing them N times
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (tp * pp)))
    # control messages stay on the CPU even when the weights talk over NCCL
    control = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
    if pp == 1:
        set_tp_state(rank, tp, dist.group.WORLD)
        return control, None
    stage_groups = [  # every rank creates every group, in the same order
        dist.new_group(ranks=list(range(s * tp, (s + 1) * tp))) if tp > 1 else None
        for s in range(pp)
    ]
    reports = dist.new_group(ranks=[0, *range(tp, tp * pp)], backend="gloo")
    stage = rank // tp
    set_tp_state(rank % tp, tp, stage_groups[stage], pp_rank=stage, pp_size=pp, world=control)
    return control, reports


# SeqInput's fields in its order: every one travels, so a field added there reaches the ranks
_SEQ_FIELDS = tuple(f.name for f in dataclasses.fields(SeqInput))


def _encode(inp: ModelInput | None) -> bytes:
    if inp is None:
        return msgpack.packb(None)
    return msgpack.packb(
        [
            [[getattr(s, name) for name in _SEQ_FIELDS] for s in inp.seqs],
            inp.block_copies,
            [[k, v] for k, v in inp.loras.items()],
            inp.kv_pushes,
            inp.reload_from,
            inp.weights_op,
            inp.memory_op,
            inp.state_copies,
        ]
    )


def _decode(data: bytes) -> ModelInput | None:
    obj = msgpack.unpackb(data)
    if obj is None:
        return None
    seqs, copies, loras, pushes, reload_from, weights_op, memory_op, state_copies = obj
    return ModelInput(
        [SeqInput(*s) for s in seqs],
        [tuple(c) for c in copies],
        {k: v for k, v in loras},
        pushes,
        reload_from,
        weights_op,
        memory_op,
        [tuple(c) for c in state_copies],
    )


def _broadcast_async(data: bytes, group) -> tuple[list, list[torch.Tensor]]:
    """Rank 0's side of _broadcast_bytes without waiting for the other ranks to take it: the
    works and the tensors they send (kept until the works are waited for)."""
    size = torch.tensor([len(data)], dtype=torch.long)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    works = [dist.broadcast(t, src=0, group=group, async_op=True) for t in (size, buf)]
    return works, [size, buf]


def _broadcast_bytes(data: bytes | None, group) -> bytes:
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.long)
    dist.broadcast(size, src=0, group=group)
    buf = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data is not None
        else torch.empty(int(size), dtype=torch.uint8)
    )
    dist.broadcast(buf, src=0, group=group)
    return buf.numpy().tobytes()


def follower_main(
    config: EngineConfig,
    model_config: ModelConfig,
    model_dir: str,
    rank: int,
    host: str,
    port: int,
    kv_cache_path: str | None,
) -> None:
    """Rank `rank`'s whole life: joins the group at host:port, builds its runner, runs every step
    rank 0 broadcasts until the stop (None), then leaves the group. A launcher runs it in the
    follower's process."""
    from pdserve.engine.precision import start_runner

    group, reports = _init(config, rank, host, port)
    runner = start_runner(config, model_config, model_dir, kv_cache_path)
    dist.barrier(group=group)  # see TPGroup.ready
    # this process's startup heap (torch, the model's modules) lives as long as it does: frozen,
    # the cyclic GC stops walking it, whose full passes would stall a step of every rank
    gc.collect()
    gc.freeze()
    replica = _a_replica(model_config)
    pusher = None if replica else _stage_pusher(config, model_config)
    later_stage = current_tp_state().pp_rank > 0
    try:
        while True:
            inp = _decode(_broadcast_bytes(None, group))
            if inp is None:
                break
            if not inp.kv_pushes or not later_stage:  # (the first stage's layers: rank 0's)
                runner.execute(inp)
                if inp.memory_op:  # a sleep's or a wake's: rank 0 answers once every rank is done
                    dist.barrier(group=group)
                continue
            # a pipelined prefill's hand-off: this rank pushes its own layers (kv_publish.py)
            # and reports to rank 0, which collects the report later (the module docstring)
            step = pusher.step(inp.kv_pushes, runner.kv_cache) if pusher is not None else None
            runner.execute(inp, on_layer_done=step)
            rows = report_rows(len(inp.kv_pushes), step, replica=replica)
            dist.gather(rows, None, dst=0, group=reports)
    finally:
        if pusher is not None:
            pusher.close()
    dist.destroy_process_group()


def _a_replica(model_config: ModelConfig) -> bool:
    """Whether this rank's KV heads are held by a rank before it in its stage too (fewer KV heads
    than ranks: an MLA model's one latent), which sends them (kvtransfer/layout.py
    KVLayout.sends): such a rank pushes nothing and reports REPLICA."""
    state = current_tp_state()
    return state.rank % max(1, state.size // model_config.num_kv_heads) != 0


def _stage_pusher(config: EngineConfig, model_config: ModelConfig) -> StagePusher | None:
    """This rank's KV pusher when it runs a later pipeline stage of an engine that hands off
    (kv_stage_sender set); None otherwise (the first stage's ranks: rank 0 pushes theirs)."""
    state = current_tp_state()
    if state.pp_rank == 0 or config.kv_stage_sender is None:
        return None
    first, end = stage_layers(model_config.num_layers)
    return StagePusher(config.kv_stage_sender, first, end, state.size, state.rank, state.pp_rank)


class LocalRanks:
    """The default RankLauncher: ranks 1..N-1 as processes of their own on this host, forked
    from the fork server (`_rank_context`), which rendezvous with rank 0 on 127.0.0.1 (daemonic:
    rank 0's process ends them when it exits)."""

    def rendezvous_host(self) -> str:
        return "127.0.0.1"

    def launch(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        model_dir: str,
        kv_cache_paths: list[str | None],
        host: str,
        port: int,
    ) -> list:
        """Starts follower_main for ranks 1..N-1; returns their handles (multiprocessing
        Processes: is_alive, join, kill, pid) in rank order. NCCL wants a GPU per rank, all
        visible to this process."""
        if (
            config.device == "cuda"
            and _backend(config) == "nccl"
            and torch.cuda.device_count() < world_size(config)
        ):
            raise ValueError(
                f"tensor_parallel_size={config.tensor_parallel_size} x pipeline_parallel_size="
                f"{config.pipeline_parallel_size} needs {world_size(config)} GPUs, "
                f"{torch.cuda.device_count()} visible"
            )
        ctx, env = _rank_context(config.device), dict(os.environ)
        shared = (config, model_config, model_dir)

        def payload(rank: int) -> bytes:  # follower_main and its arguments (rank_process.run)
            return pickle.dumps((follower_main, (*shared, rank, host, port, kv_cache_paths[rank])))

        procs = [
            ctx.Process(
                target=rank_process.run,
                daemon=True,
                name=f"pdserve-tp{rank}",
                args=(env, payload(rank)),
            )
            for rank in range(1, world_size(config))
        ]
        for p in procs:
            p.start()
        return procs

    def check(self, procs: list, kv_cache_paths: list[str | None]) -> None:
        """Nothing to check: every local rank shares this host."""


# what the fork server imports before it forks any follower: the imports are most of a
# follower's start (seconds of CPU a process): torch, the engine, and transformers, which the
# follower's unpickled model config and the precision probe's tokenizer need (with
# transformers.activations, which every family's config class imports: torch.distributed.tensor
# underneath), so that a follower forked from the server starts in a fraction of a second. The
# server forks from its idle main thread; the one other thread the import starts (numpy's OpenBLAS server) is made
# safe to fork by OpenBLAS's own fork handlers
FORK_SERVER_PRELOAD = [
    "__main__",
    "torch",
    "torch.distributed",
    "transformers",
    "transformers.activations",
    "pdserve.engine.tp",
    "pdserve.engine.tokenizer",
]


def _rank_context(device: str):
    """multiprocessing's fork-server context, its server told to import torch before it forks
    (which counts only before the server's first start: a process whose fork server is already
    running keeps it as it is, and its followers import torch themselves). A follower forked from
    it starts without importing torch; rank_process.run gives it rank 0's environment. CUDA
    ranks are spawned, as before the fork server: that path has not run forked on a GPU."""
    if device == "cuda":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORK_SERVER_PRELOAD)
    return ctx


_launcher = None  # the RankLauncher this process's engines use; None: LocalRanks


def use_launcher(launcher) -> None:
    """Makes engines started later in this process start their followers with `launcher`
    (rendezvous_host(), launch(...) as LocalRanks's, and check(handles, kv_cache_paths), which
    may refuse a placement once the ranks run); None restores LocalRanks."""
    global _launcher
    _launcher = launcher


def current_launcher():
    return _launcher if _launcher is not None else LocalRanks()


# the push reports' gathers rank 0 lets be pending at most (see the module docstring): one per
# step it may run ahead, and the step that just ended
MAX_PENDING_REPORTS = PP_STEPS_AHEAD + 1


@dataclasses.dataclass
class _PendingReports:
    """One step's push reports on their way to rank 0: the gather's work, the tensors it fills
    (kept until it is waited for), and who hears the reports."""

    work: object
    mine: torch.Tensor
    parts: list[torch.Tensor]
    deliver: Callable[[torch.Tensor], None]


class TPGroup:
    def __init__(self, procs, group, pipelined: bool = False, reports=None):
        self.procs = procs  # one handle per follower, rank order (is_alive, join, kill, pid)
        self.group = group
        self.pipelined = pipelined  # pipeline stages: broadcasts are not waited for (broadcast)
        self._pending: list[tuple[list, list[torch.Tensor]]] = []  # those, oldest first
        self.reports = reports  # the push reports' gloo group (pipeline stages), else None
        self._reports: deque[_PendingReports] = deque()  # their gathers, oldest first

    @classmethod
    def start(
        cls,
        config: EngineConfig,
        model_config: ModelConfig,
        model_dir: str,
        kv_cache_paths: list[str | None],
    ) -> TPGroup:
        """kv_cache_paths[r]: rank r's shared KV pool file, or None for private memory (one per
        rank of the engine). The followers start with this process's launcher (use_launcher)."""
        launcher = current_launcher()
        host = launcher.rendezvous_host()
        master = _master_store(host, world_size(config))
        port = master.port
        procs = launcher.launch(config, model_config, model_dir, kv_cache_paths, host, port)
        try:
            launcher.check(procs, kv_cache_paths)
            control, reports = _init(config, 0, host, port, procs, master)
        except BaseException:
            for p in procs:
                p.kill()
            raise
        return cls(procs, control, config.pipeline_parallel_size > 1, reports)

    def ready(self) -> None:
        """Returns once every follower built its runner (weights loaded, KV pool allocated), so
        rank 0 may map the followers' shared pools; after a sleep's or a wake's memory_op, once
        every follower has done its part (follower_main)."""
        dist.barrier(group=self.group)

    def broadcast(self, inp: ModelInput) -> None:
        """Hands `inp` to every follower. Under pipeline stages it returns without waiting for
        them to take it (the later stages may still be computing an earlier step: model_runner.py
        `_hand_on`); `wait_ahead` bounds how many are pending."""
        if not self.pipelined:
            _broadcast_bytes(_encode(inp), self.group)
            return
        self._pending.append(_broadcast_async(_encode(inp), self.group))
        while len(self._pending) > PP_STEPS_AHEAD:  # (wait_ahead ran before: seldom waits)
            self._wait_oldest()

    def wait_ahead(self) -> None:
        """Returns once fewer than PP_STEPS_AHEAD broadcasts are still to be taken by some rank,
        so the next step runs at most that many ahead of the later pipeline stages. The engine
        calls it before it plans and times a step: the step's time is then rank 0's own, not the
        later stages' backlog, and the next long-prefill chunk is sized from it
        (engine/scheduler.py)."""
        while len(self._pending) >= PP_STEPS_AHEAD:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        works, _ = self._pending.pop(0)
        for w in works:
            w.wait()

    def gather_reports(self, num_pushes: int, deliver: Callable[[torch.Tensor], None]) -> None:
        """After rank 0's part of a step with `num_pushes` stage pushes (ModelInput.kv_pushes):
        starts gathering every rank's report rows without waiting for them. `deliver` gets them
        later (`harvest_reports`), [ranks, num_pushes, 2] in rank order (engine/kv_publish.py
        report_rows; the first stage's rows are NOT_PUSHED: its layers leave through the
        sinks). Waits for the oldest once more than MAX_PENDING_REPORTS are pending."""
        members = dist.get_world_size(self.reports)
        parts = [torch.empty(num_pushes, 2, dtype=torch.int64) for _ in range(members - 1)]
        mine = report_rows(num_pushes, None)
        work = dist.gather(mine, [mine.clone()] + parts, dst=0, group=self.reports, async_op=True)
        self._reports.append(_PendingReports(work, mine, parts, deliver))
        while len(self._reports) > MAX_PENDING_REPORTS:
            self._harvest_oldest()

    def harvest_reports(self, wait: bool) -> None:
        """Hands the gathered push reports to their steps' sinks, oldest first: those whose
        gather is done, or (wait) every pending one, waiting for the later stages to report.
        Raises when a rank died (the gather fails); that gather is forgotten."""
        while self._reports and (wait or self._reports[0].work.is_completed()):
            self._harvest_oldest()

    @property
    def reports_pending(self) -> int:
        """The push reports' gathers not yet handed to their sinks."""
        return len(self._reports)

    def _harvest_oldest(self, deliver: bool = True) -> None:
        one = self._reports.popleft()
        one.work.wait()
        if not deliver:
            return
        first_stage = len(self.procs) + 1 - len(one.parts)  # ranks, less the later stages'
        rows = [one.mine] + [report_rows(one.mine.shape[0], None)] * (first_stage - 1)
        one.deliver(torch.stack(rows + one.parts))

    def stage_of_rank(self, config: EngineConfig) -> list[int]:
        """Each rank's pipeline stage, rank order."""
        return [r // config.tensor_parallel_size for r in range(world_size(config))]

    def abort(self) -> None:
        """Ends the followers without telling them (a start that failed: they may be in any
        collective of their own start) and leaves the process group."""
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.join(timeout=30)
        dist.destroy_process_group()
        set_tp_state(0, 1, None)

    def shutdown(self) -> None:
        try:
            while self._reports:  # (no sink is waiting for them any more)
                self._harvest_oldest(deliver=False)
            while self._pending:
                self._wait_oldest()
            _broadcast_bytes(_encode(None), self.group)
        except RuntimeError:
            if all(p.is_alive() for p in self.procs):
                raise
            # a rank died (the engine loop is broken: engine_loop.py); the others are killed
            # below, and the stop goes on
        finally:
            for p in self.procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
            dist.destroy_process_group()
            set_tp_state(0, 1, None)  # (pipeline state too)
