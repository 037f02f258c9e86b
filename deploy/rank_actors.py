"""A worker's follower ranks as Ray actors, so that its pipeline stages may sit on different Ray
nodes (issue #53).

A worker replica of `pdserve up` is one placement group with a bundle per rank (tp x pp,
deploy/placement.py); its WorkerActor, rank 0, sits on bundle 0. Outside Ray an engine spawns its
ranks 1..N-1 as child processes (engine/tp.py, LocalRanks); under Ray the WorkerActor installs
RayRanks (engine/tp.py use_launcher) before it builds its engine, and the engine starts rank r as
a RankActor on bundle r of the same placement group, wherever Ray placed that bundle. The ranks
rendezvous over gloo at rank 0's node address (ray.util.get_node_ip_address()), on the port its
store bound before they started, and each RankActor runs engine/tp.py's follower_main, the loop
a local follower runs.

Lifecycle. A RankActor lives as long as its follower loop: RankHandle mirrors a local process
(is_alive: the loop's task has not ended; join: wait for it to end, then kill the actor's process;
kill: ray.kill), so the engine's shutdown stops and reaps rank actors as it reaps local processes,
and a rank actor that dies breaks the engine as a dead local rank does (engine/engine_loop.py;
the worker's process then exits and the supervisor replaces it). The RankActors are created by the
WorkerActor's process, which owns them: if it dies, Ray kills them with it, and removing the
placement group at stop kills whatever is left in its bundles.

Hosts. Each pipeline stage pushes its own layers' KV to the decode side (engine/kv_publish.py),
so the later stages may sit on any host. Rank 0 reads the pools of its own stage's other
tensor-parallel ranks from files it maps (kv_cache_shared_dir), which works only where those
ranks share its host: RayRanks.check refuses, in one message, such a rank whose node address
differs from rank 0's; two Ray nodes started on one machine share it, as the tests' second `ray
start` does.
"""

from __future__ import annotations

import os
import socket
import time

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

WHERE_TIMEOUT_S = 300.0  # a rank actor's process start and imports, on a loaded machine
NAME_RETRY_S = 30.0  # a dead worker's rank actors' names are freed a moment after it dies
DEATH_NOTICE_S = 2.0  # how long a rank on another host gets for Ray to report its death


class RankActor:
    """One follower rank (1..N-1) of an engine, in a Ray actor process of its own."""

    def __init__(self, cpus: list[int] | None = None):
        from pdserve.deploy.workers import at_normal_priority, pin_to

        self.cpus = cpus
        pin_to(cpus)
        self.niceness = at_normal_priority()

    def where(self) -> dict:
        """The node and process this rank runs in (the start table's per-stage nodes)."""
        return dict(
            node_id=ray.get_runtime_context().get_node_id(),
            node_ip=ray.util.get_node_ip_address(),
            hostname=socket.gethostname(),
            pid=os.getpid(),
            niceness=self.niceness,
        )

    def run(self, config, model_config, model_dir: str, rank: int, host: str, port: int, kv_path):
        """The follower loop (engine/tp.py follower_main) until rank 0 broadcasts the stop."""
        from pdserve.deploy.workers import at_normal_priority, pin_to
        from pdserve.engine.tp import follower_main

        pin_to(self.cpus)  # this thread computes, and torch's threads inherit its cores
        at_normal_priority()
        follower_main(config, model_config, model_dir, rank, host, port, kv_path)


# no Ray restarts: a restarted rank could not rejoin its group; `where` answers while `run` runs
RemoteRank = ray.remote(max_restarts=0, max_concurrency=2)(RankActor)


def _pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host runs (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        try:
            os.kill(pid, 0)  # no /proc here: ask the kernel
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return data[data.rfind(b")") + 2 :].split()[:1] != [b"Z"]


class RankHandle:
    """A rank actor as engine/tp.py's TPGroup sees a follower process."""

    def __init__(self, rank: int, actor, run_ref, where: dict | None = None):
        self.rank = rank
        self.actor = actor
        self.run_ref = run_ref
        self.where = where or {}

    @property
    def pid(self) -> int | None:
        return self.where.get("pid")

    def is_alive(self) -> bool:
        """Whether its follower loop still runs. Asked right after a step failed, when Ray may not
        have heard of a death yet (a dead actor ends the loop's task with an error a moment
        later): a rank on this host is looked up by its pid, one on another host gets
        DEATH_NOTICE_S for Ray to report it."""
        ready, _ = ray.wait([self.run_ref], timeout=0)
        if ready:
            return False
        if self.pid and self.where.get("hostname") == socket.gethostname():
            return _pid_alive(self.pid)
        ready, _ = ray.wait([self.run_ref], timeout=DEATH_NOTICE_S)
        return not ready

    def ended(self) -> bool:
        """Whether its follower loop has ended, as far as Ray has reported, without waiting
        (engine/tp.py asks it while rank 0 waits for the ranks to join)."""
        ready, _ = ray.wait([self.run_ref], timeout=0)
        return bool(ready)

    def join(self, timeout: float | None = None) -> None:
        """Waits up to `timeout` for its loop to end; once ended, its actor process goes."""
        ready, _ = ray.wait([self.run_ref], timeout=timeout)
        if ready:
            self.kill()

    def kill(self) -> None:
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # already gone
            pass


class RayRanks:
    """engine/tp.py's RankLauncher under Ray: rank r as a RankActor on bundle r of the calling
    actor's placement group (the WorkerActor's)."""

    def __init__(self, worker_id: str, cpus: list[int] | None = None, pg=None):
        self.worker_id = worker_id
        self.cpus = cpus  # a local deployment's cores of this replica (launcher.core_plan)
        self.pg = pg if pg is not None else get_current_placement_group()
        if self.pg is None:
            raise RuntimeError(f"{worker_id}: rank actors need the worker's placement group")

    def rendezvous_host(self) -> str:
        return ray.util.get_node_ip_address()

    def launch(self, config, model_config, model_dir, kv_cache_paths, host, port) -> list:
        n = config.tensor_parallel_size * config.pipeline_parallel_size
        bundles = self.pg.bundle_specs
        if len(bundles) < n:
            raise RuntimeError(
                f"{self.worker_id}: {n} ranks but its placement group has {len(bundles)} bundles"
            )
        handles = []
        try:
            for rank in range(1, n):
                actor = self._create(rank, bundles[rank])
                ref = actor.run.remote(
                    config, model_config, model_dir, rank, host, port, kv_cache_paths[rank]
                )
                handles.append(RankHandle(rank, actor, ref))
            wheres = ray.get([h.actor.where.remote() for h in handles], timeout=WHERE_TIMEOUT_S)
        except BaseException:
            for h in handles:
                h.kill()
            raise
        for h, where in zip(handles, wheres):
            h.where = where
        return handles

    def _create(self, rank: int, bundle: dict):
        deadline = time.monotonic() + NAME_RETRY_S
        while True:
            try:
                return RemoteRank.options(
                    name=f"{self.worker_id}-rank{rank}",  # `ray list actors`: prefill-0-rank1
                    num_cpus=bundle.get("CPU", 0),
                    num_gpus=bundle.get("GPU", 0),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self.pg, placement_group_bundle_index=rank
                    ),
                ).remote(self.cpus)
            except ValueError as e:  # the name of a dead predecessor's rank, not yet freed
                if "already taken" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def check(self, handles: list[RankHandle], kv_cache_paths) -> None:
        """Refuses ranks on another host than rank 0's whose KV pool rank 0 maps from a file
        (the first pipeline stage's tensor-parallel ranks; the later stages push their own KV,
        engine/kv_publish.py): see the module docstring."""
        here = ray.util.get_node_ip_address()
        away = [
            h
            for h in handles
            if h.where.get("node_ip") not in (None, here) and kv_cache_paths[h.rank] is not None
        ]
        if away:
            shown = ", ".join(f"rank {h.rank} on {h.where['node_ip']}" for h in away)
            raise RuntimeError(
                f"{self.worker_id}: its ranks landed on other hosts than rank 0's ({here}: "
                f"{shown}), but rank 0 maps the KV pools of its own stage's tensor-parallel "
                f"ranks from files under kv_cache_shared_dir, which only ranks on its host "
                f"share. Give each pipeline stage's ranks one host (the later stages may sit "
                f"elsewhere: they push their own KV), or a node that holds every rank "
                f"(pools.<pool>.resources)"
            )


def rank_nodes(engine) -> list[dict]:
    """Where each rank of `engine` runs, rank order, rank 0 (this process) first: {rank, stage,
    node_id, node_ip, pid}; empty when the engine has one rank or its followers are local."""
    tp = engine.config.tensor_parallel_size
    group = getattr(engine, "tp", None)
    if group is None or not all(isinstance(p, RankHandle) for p in group.procs):
        return []
    first = dict(
        node_id=ray.get_runtime_context().get_node_id(),
        node_ip=ray.util.get_node_ip_address(),
        pid=os.getpid(),
    )
    rows = [dict(rank=0, stage=0, **first)]
    for h in group.procs:
        rows.append(
            dict(
                rank=h.rank,
                stage=h.rank // tp,
                node_id=h.where.get("node_id"),
                node_ip=h.where.get("node_ip"),
                pid=h.where.get("pid"),
            )
        )
    return rows
