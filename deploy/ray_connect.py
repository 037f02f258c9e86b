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
"""

from __future__ import annotations

import logging
import os
import sys

import ray

from pdserve.deploy import ray_join, ray_reaper
from pdserve.deploy.config import DeployConfig
from pdserve.deploy.prechecks import DeployError, local_ray_temp_dir
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
    if address is None and config.ray.dashboard:
        check_dashboard()
        kwargs.update(include_dashboard=True, dashboard_port=config.ray.dashboard_port)
    elif config.ray.dashboard:
        log.warning("ray.dashboard is for a local Ray; the cluster at %s has its own", address)
    if address is not None:  # the cluster's token, found as Ray's own clients find it
        log.info("joining the Ray cluster at %s: %s", address, ray_join.prepare_join(address))
    if address is None:
        # a private temp dir keeps this Ray off the machine-wide default (/tmp/ray); checked
        # writable before (check_writable_dirs)
        temp_dir = local_ray_temp_dir(config)
        os.makedirs(temp_dir, exist_ok=True)
        kwargs.update(num_cpus=config.ray.num_cpus, _temp_dir=str(temp_dir))
    elif config.ray.temp_dir:
        kwargs.update(_temp_dir=os.path.abspath(config.ray.temp_dir))
    local = address is None and sys.platform == "linux"  # the watchdog reads /proc
    before = ray_reaper.children_of(os.getpid()) if local else {}
    try:
        context = ray.init(address=address, **kwargs)
    except (ConnectionError, RuntimeError, ValueError, ray.exceptions.AuthenticationError) as e:
        where = (
            f"join the Ray cluster at {address} (ray.address, --address)"
            if address
            else "start a local Ray (ray.num_cpus, ray.temp_dir)"
        )
        raise DeployError(f"cannot {where}: {ray_error_reason(e)}") from None
    if kwargs["include_dashboard"]:
        log.info("Ray dashboard on http://%s", getattr(context, "dashboard_url", "?"))
    if not local:
        return True, None
    # the processes ray.init started here: Ray's head (GCS, raylet, monitor, ...)
    now = ray_reaper.children_of(os.getpid())
    started = {pid: start for pid, start in now.items() if before.get(pid) != start}
    return True, ray_reaper.watch(started)
