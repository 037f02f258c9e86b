"""Connecting `pdserve up` to Ray: a local Ray it starts for the deployment, or a cluster it joins
by address (ray.address, --address).

`init_ray` is called once per `up`, after the pre-start checks. A local Ray gets a private temp
dir (off the machine-wide /tmp/ray), ray.num_cpus, the dashboard when ray.dashboard asks for it
(checked first: a Ray installed without its dashboard's packages cannot run one), and a watchdog
that kills its processes should `up` die without stopping them (deploy/ray_reaper.py). A cluster
joined by address is first asked whether it wants a token, and this process given the one Ray's
clients would find (deploy/ray_join.py). A Ray the caller already started (a notebook, a test) is
used as it is. Either way a failure is a DeployError whose one line names the key to change; the
Cluster that `up` returns shuts down, on stop, the Ray this module reports it started.

A local Ray listens on loopback only unless ray.bind is `all` (`start_local_ray(loopback=True)`).
Ray binds its servers (GCS, raylet and object manager, the workers' and the driver's gRPC servers,
the dashboard agent and its metrics export port, the runtime env agent, the autoscaler's metrics)
to 127.0.0.1 exactly when the node's IP is a loopback address, and everywhere otherwise; and
ray.init turns a `_node_ip_address` of 127.0.0.1 into the machine's address unless Ray clusters
are off (ray_constants.ENABLE_RAY_CLUSTER, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: Ray's local-only
mode, the default on macOS and Windows). `_loopback_node` turns that mode on for the start: the
environment variable for the processes Ray starts, the constant for this one; the dashboard, when
on, gets dashboard_host 127.0.0.1 too. With ray.bind `all` Ray chooses as it always did.
Ray writes ~/.ray/auth_token with the default mode (0644 under the usual umask);
ray_join.protect_token_file makes it 0600 before and after the start.

A local Ray leaves a session folder (its logs and sockets) in its temp dir at every start and never
removes one; `prune_ray_sessions` keeps the newest KEPT_RAY_SESSIONS and any that may be in use.

A local Ray's start survives a slow machine (`start_local_ray`): Ray gives its GCS 30 s to bind
a port and the raylet 30 s to register, which a 2-core machine under load has missed; the GCS
gets 120 s here, and a start that still times out is killed and tried once more. Its workers run
at niceness 0, not Ray's 15 (deploy/workers.py, `at_normal_priority`, says why), and Ray starts
no idle workers ahead of need (its default starts one per CPU as the driver connects): the
deployment's actors each get a worker of their own, so those sat unused, each a Python process
that imported Ray on the cores the deployment's own processes start on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import shutil
import sys
import time

import ray

from pdserve.deploy import ray_join, ray_reaper
from pdserve.deploy.config.schema import DeployConfig
from pdserve.deploy.prechecks import DeployError, local_ray_temp_dir
from pdserve.deploy.secret_files import pid_alive
from pdserve.deploy.supervisor import ray_error_reason

log = logging.getLogger("pdserve.deploy.launcher")


def check_dashboard() -> None:
    """Refuses ray.dashboard where Ray's dashboard cannot run: a Ray installed without its
    dashboard's packages (`pip install ray`, not `ray[default]`) would refuse it in ray.init."""
    try:
        from ray._private.utils import get_dashboard_dependency_error
    except ImportError:  # Ray moved it: ray.init says so itself
        return
    missing = get_dashboard_dependency_error()
    if missing:
        raise DeployError(
            f"ray.dashboard: this Ray has no dashboard ({missing}); install "
            f"`pip install 'ray[default]'`, or set ray.dashboard to false"
        )


def init_ray(config: DeployConfig, address: str | None) -> tuple[bool, ray_reaper.Watchdog | None]:
    """Connects to (or starts) Ray. Returns whether this call started it (so stop() shuts it down)
    and, for a local Ray it started, the watchdog that kills Ray's processes should this process
    die without stopping them (deploy/ray_reaper.py)."""
    if ray.is_initialized():  # the caller owns Ray (a notebook, a test): reuse it
        return False, None
    address = address or config.ray.address
    kwargs = dict(include_dashboard=False, log_to_driver=False)
    loopback = config.ray.bind == "loopback"
    if address is None and config.ray.dashboard:
        check_dashboard()
        kwargs.update(
            include_dashboard=True,
            dashboard_port=config.ray.dashboard_port,
            dashboard_host="127.0.0.1" if loopback else "0.0.0.0",
        )
    elif config.ray.dashboard:
        log.warning("ray.dashboard is for a local Ray; the cluster at %s has its own", address)
    if address is not None and not loopback:
        log.warning(
            "ray.bind is for a local Ray; the cluster at %s listens where it was started", address
        )
    if address is not None:  # the cluster's token, found as Ray's own clients find it
        log.info("joining the Ray cluster at %s: %s", address, ray_join.prepare_join(address))
    if address is None:
        # a private temp dir keeps this Ray off the machine-wide default (/tmp/ray); checked
        # writable before (check_writable_dirs)
        temp_dir = local_ray_temp_dir(config)
        os.makedirs(temp_dir, exist_ok=True)
        prune_ray_sessions(temp_dir)
        kwargs.update(num_cpus=config.ray.num_cpus, _temp_dir=str(temp_dir))
    elif config.ray.temp_dir:
        kwargs.update(_temp_dir=os.path.abspath(config.ray.temp_dir))
    try:
        if address is None:
            context, started = start_local_ray(loopback=loopback, **kwargs)
        else:
            context, started = ray.init(address=address, **kwargs), {}
    except (ConnectionError, RuntimeError, ValueError, ray.exceptions.AuthenticationError) as e:
        where = (
            f"join the Ray cluster at {address} (ray.address, --address)"
            if address
            else "start a local Ray (ray.num_cpus, ray.temp_dir)"
        )
        raise DeployError(f"cannot {where}: {ray_error_reason(e)}") from None
    if kwargs["include_dashboard"]:
        log.info("Ray dashboard on http://%s", getattr(context, "dashboard_url", "?"))
    return True, ray_reaper.watch(started) if started else None


KEPT_RAY_SESSIONS = 10  # a local Ray's session folders kept in its temp dir, newest first
SESSION_QUIET_S = 3600  # a session folder whose logs changed more recently may be in use


def prune_ray_sessions(temp_dir: pathlib.Path, keep: int = KEPT_RAY_SESSIONS) -> list[str]:
    """Removes the session folders (`session_<date>_<time>_<pid>`, each start's logs and sockets)
    that earlier local Rays left in `temp_dir`, all but the `keep` newest: Ray never removes them,
    and pdserve's default temp dir is in the user's cache, not in a /tmp that a reboot clears. A
    folder that may be in use is kept, however old: one whose starting process (the pid its name
    ends with) still runs, or whose logs changed within SESSION_QUIET_S (a running Ray writes its
    state there every few seconds, whoever started it). Returns the names removed; a folder that
    cannot be removed is left, with a warning, and never fails the start."""
    sessions = sorted(  # Ray's names sort by their start time
        (
            entry
            for entry in temp_dir.glob("session_*")
            if entry.is_dir()
            and not entry.is_symlink()  # session_latest
            and entry.name.rsplit("_", 1)[-1].isdigit()
        ),
        key=lambda entry: entry.name,
        reverse=True,
    )
    removed = []
    for entry in sessions[keep:]:
        if _maybe_in_use(entry):
            continue
        try:
            shutil.rmtree(entry)
        except OSError as e:
            log.warning("could not remove an old Ray session folder %s: %s", entry, e)
            continue
        removed.append(entry.name)
    if removed:
        log.info("removed %d old Ray session folders from %s", len(removed), temp_dir)
    return removed


def _maybe_in_use(session: pathlib.Path) -> bool:
    try:
        if pid_alive(int(session.name.rsplit("_", 1)[-1])):
            return True  # the process that started it still runs
    except (OverflowError, ValueError):  # not a pid Ray would have written
        pass
    try:
        latest = max(
            (f.stat().st_mtime for f in (session / "logs").iterdir()),
            default=session.stat().st_mtime,
        )
    except OSError:
        return False  # (no logs folder: nothing that runs writes there)
    return time.time() - latest < SESSION_QUIET_S


STARTUP_TRIES = 2
GCS_PORT_WAIT_S = 120  # Ray's own default is 30 s (RAY_gcs_server_port_wait_time_s)


def _timed_out(error: BaseException) -> bool:
    """Whether ray.init failed because a process it started was slow: the GCS did not write its
    port file, or the raylet did not register, in time."""
    return "timed out" in str(error).lower()


LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray's nodes use loopback addresses


@contextlib.contextmanager
def _loopback_node():
    """Ray's local-only mode while a local Ray starts (see the module docstring): node IP
    127.0.0.1, so that every server Ray starts binds to loopback. Restored afterwards; the
    processes started meanwhile keep it (they got the variable and the node IP at their start)."""
    from ray._private import ray_constants

    before_env, before_const = os.environ.get(LOCAL_ONLY_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[LOCAL_ONLY_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before_const
        if before_env is None:
            os.environ.pop(LOCAL_ONLY_ENV, None)
        else:
            os.environ[LOCAL_ONLY_ENV] = before_env


def start_local_ray(loopback: bool = True, **kwargs) -> tuple[object, dict[int, int]]:
    """ray.init(**kwargs) starting a local Ray whose workers run at niceness 0, listening on
    loopback only unless `loopback` is False, made to survive a slow start. Returns Ray's context
    and, on Linux, the processes it started here (pid -> start time: the GCS, the raylet, ...) for
    the watchdog. A start that times out has what it started killed (Ray leaves those processes
    running, and they would hold the CPU the second try needs) and is tried once more; a second
    timeout is raised as a RuntimeError that says so, any other failure as it came."""
    with _loopback_node() if loopback else contextlib.nullcontext():
        if loopback:
            kwargs.setdefault("_node_ip_address", "127.0.0.1")
        ray_join.protect_token_file()  # a token Ray would find or write: 0600 before the start
        try:
            return _start_local_ray(**kwargs)
        finally:
            ray_join.protect_token_file()  # and one Ray wrote (it writes it 0644)


def _start_local_ray(**kwargs) -> tuple[object, dict[int, int]]:
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", str(GCS_PORT_WAIT_S))
    system = {}  # an operator's RAY_* choice stands
    if "RAY_worker_niceness" not in os.environ:
        system["worker_niceness"] = 0
    if "RAY_prestart_worker_first_driver" not in os.environ:
        system["prestart_worker_first_driver"] = False
    if system:
        kwargs["_system_config"] = {**system, **(kwargs.get("_system_config") or {})}
    local = sys.platform == "linux"  # the process table is read from /proc
    for attempt in range(1, STARTUP_TRIES + 1):
        before = ray_reaper.children_of(os.getpid()) if local else {}
        try:
            context = ray.init(**kwargs)
        except Exception as e:  # the raylet's timeout is a bare Exception
            if local:
                ray_reaper.kill_recorded(_started_since(before))
            ray.shutdown()
            if not _timed_out(e):
                raise
            if attempt == STARTUP_TRIES:
                raise RuntimeError(f"it timed out {STARTUP_TRIES} times: {e}") from e
            log.warning("the local Ray did not start in time (%s); trying once more", e)
            continue
        return context, _started_since(before) if local else {}
    raise AssertionError("unreachable")


def _started_since(before: dict[int, int]) -> dict[int, int]:
    """This process's children (pid -> start time) that `before` did not list."""
    now = ray_reaper.children_of(os.getpid())
    return {pid: start for pid, start in now.items() if before.get(pid) != start}
