"""A local disaggregated pdserve cluster with the router's HTTP front, for the checks that need an
OpenAI-compatible endpoint and GET /metrics (experiments/prometheus_check.py,
experiments/external_client_check.py), started one of two ways (--cluster):

  up      deploy.launcher.up() of the YAML below on a local Ray, what `pdserve up` runs: the
          router (gRPC and HTTP on free ports) in this process, one Ray actor per worker
  local   no Ray: the router in this process with RouterConfig(http_port=0), one prefill and one
          decode worker each in a spawned process through deploy.launcher.WorkerActor (the class
          `pdserve up` runs in its actors), joining the router through its Registry
Both give the workers the engine settings and torch threads validate_config gives the YAML and
pin them to cores as `pdserve up` pins a local deployment (deploy.launcher.core_plan: one core
each by default). To check a deployment already up, give the scripts its addresses (--router,
--http).
"""

from __future__ import annotations

import multiprocessing as mp
import time

from benchmarks.bench_common import add_out_arg, stop_children


def deploy_dict(args) -> dict:
    """The YAML the cluster follows (the workers' engine settings come from it)."""

    def pool(threads: int) -> dict:
        return {
            "replicas": 1,
            "resources": {"num_cpus": 1},
            "num_threads": threads,
            "kv_cache_memory": args.kv_cache_memory,
            "max_model_len": args.max_model_len,
        }

    return {
        "model": args.model,
        "kvtransfer": {"backend": args.kv_backend},
        "router": {"port": 0, "http_port": 0},
        "pools": {"prefill": pool(args.prefill_threads), "decode": pool(args.decode_threads)},
    }


def parse_args(ap, argv, out_name: str):
    """Adds what every check against an HTTP cluster takes (the prompts' seed, warm-up requests,
    the result file experiments/results/<out_name>, the local cluster's settings) to `ap`, parses
    `argv`, and checks it."""
    ap.add_argument(
        "--seed",
        type=int,
        default=None,
        help="prompts' seed (default: from the clock, so a "
        "rerun on the same cluster is not served from its prefix caches)",
    )
    ap.add_argument("--warmup", type=int, default=3)
    add_out_arg(ap, out_name, folder="experiments")
    add_args(ap)
    args = ap.parse_args(argv)
    if args.seed is None:
        args.seed = int(time.time()) % 1_000_000
    if bool(args.router) != bool(args.http):
        ap.error("--router and --http go together")
    return args


def add_args(ap) -> None:
    g = ap.add_argument_group("the local cluster (when --router/--http are not given)")
    g.add_argument("--cluster", default="up", choices=("up", "local"), help="default: up")
    g.add_argument("--model", default="smollm2")
    g.add_argument("--kv-backend", default="shm", choices=("grpc", "shm", "torch"))
    g.add_argument("--prefill-threads", type=int, default=1)
    g.add_argument("--decode-threads", type=int, default=1)
    g.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    g.add_argument("--max-model-len", type=int, default=2048)


def _worker_main(role: str, worker_config, threads: int, cpus, conn) -> None:
    """A spawned worker process: starts the worker, reports its address, serves until told."""
    try:
        from pdserve.deploy.workers import WorkerActor

        actor = WorkerActor(role, worker_config, threads, cpus)
        address, mode = actor.start()
        conn.send(("ready", address, mode))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send(("error", repr(e), ""))
        return
    try:
        conn.recv()  # anything, or the parent's end closing: stop
    except EOFError:
        pass
    actor.stop()


class LocalCluster:
    def __init__(self, args, start_timeout_s: float = 600.0):
        from pdserve.decode_worker.server import DecodeWorkerConfig
        from pdserve.deploy.config.load import validate_config
        from pdserve.deploy.launcher import core_plan
        from pdserve.prefill_worker.server import PrefillWorkerConfig
        from pdserve.router.server import Router, RouterConfig

        self.config = config = validate_config(deploy_dict(args), "local cluster")
        self.router = Router(
            RouterConfig(
                model=config.model,
                port=0,
                http_port=0,
                max_model_len=args.max_model_len,
                max_inflight=config.router.max_inflight,
            )
        ).start()
        self.router_address = self.router.address
        self.http_url = f"http://{self.router.http_address}"
        self.procs, self.conns, self.modes = [], [], {}
        ctx = mp.get_context("spawn")
        # cores of their own, as `pdserve up` pins a local deployment's workers (core_plan)
        cores = core_plan(config.worker_pools(), local=True)
        try:
            for key, pool in config.worker_pools():
                common = dict(
                    model=config.model,
                    engine_kwargs=config.engine_kwargs(pool),
                    worker_id=f"{key}-0",
                    registry_address=self.router_address,
                )
                cfg = (
                    DecodeWorkerConfig(kv_backend=config.kvtransfer.backend, **common)
                    if key == "decode"
                    else PrefillWorkerConfig(**common)
                )
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(
                    target=_worker_main,
                    args=(key, cfg, pool.threads, cores.get((key, 0)), theirs),
                    daemon=True,
                )
                proc.start()
                self.procs.append(proc)
                self.conns.append(ours)
            for (key, _), conn in zip(config.worker_pools(), self.conns):
                if not conn.poll(start_timeout_s):
                    raise TimeoutError(f"the {key} worker did not start in {start_timeout_s} s")
                status, detail, mode = conn.recv()
                if status != "ready":
                    raise RuntimeError(f"the {key} worker failed to start: {detail}")
                self.modes[key] = mode
            deadline = time.monotonic() + 60
            while not all(self.router.pool.num_workers(r) for r in ("prefill", "decode")):
                if time.monotonic() > deadline:
                    raise TimeoutError("the workers did not register with the router")
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        stop_children(self.conns, self.procs)
        self.procs, self.conns = [], []
        self.router.stop()


class UpCluster:
    """deploy.launcher.up() of deploy_dict(args), as `pdserve up` starts it, on a local Ray."""

    def __init__(self, args):
        from pdserve.deploy.config.load import validate_config
        from pdserve.deploy.launcher import up

        self.cluster = up(validate_config(deploy_dict(args), "http_cluster"), block=False)
        self.router = self.cluster.router
        self.router_address = self.cluster.router_address
        self.http_url = self.cluster.http_url
        self.modes = {}

    def stop(self) -> None:
        self.cluster.stop()


def start(args):
    """The cluster --cluster names."""
    return UpCluster(args) if args.cluster == "up" else LocalCluster(args)


def open_cluster(args):
    """(the cluster to stop, or None; its router's gRPC address; its HTTP base URL; what the report
    says of it): the running one --router and --http name, else a local one started here."""
    if args.router:
        http = args.http.rstrip("/")
        return None, args.router, http, {"router": args.router, "http": http}
    cluster = start(args)
    how = {
        "deploy": deploy_dict(args),
        "modes": cluster.modes,
        "how": f"experiments/http_cluster.py --cluster {args.cluster}",
    }
    return cluster, cluster.router_address, cluster.http_url, how
