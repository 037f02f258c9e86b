"""`pdserve ctl`: the operators' door to a running deployment, through its router's Admin service.

    pdserve ctl [--router H:P] [--secret-file F] roles
    pdserve ctl [--router H:P] [--secret-file F] flip WORKER_ID prefill|decode [--drain-s S]

Every call carries the deployment's cluster secret: the file given by --secret-file (the one
the deployment's security.cluster_secret_file names), else PDSERVE_CLUSTER_SECRET. `roles` prints
one line per worker, tab-separated, starting with its id: the pool the router holds it in, the
router's state for it (serving, draining, switching, reconciling, stuck, down), what the router
intends for it (`intent=ROLE/STATE`), what the worker itself last reported (`reports=ROLE/STATE`
and how long ago; `reports=?` before its first report), `ok` or `MISMATCH` (the two differ
outside a flip: the router is driving the worker to its intent; `STUCK` past
router.reconcile_bound_s), its running and waiting sequences, its KV use and its address. `flip` moves a worker to
the other pool and returns once it serves there (exit 0, with how long the drain and the switch
took), or is refused with the router's reason (exit 1): the last worker of a pool, an unknown
worker, a flip under way, a wrong secret. Its decode streams still open after --drain-s seconds
(default: the router's router.flip_drain_s) resume on another decode worker.
Exit 2: bad usage, an unreadable secret file, or a router that cannot be reached.
"""

from __future__ import annotations

import argparse
import os
import sys

from pdserve.deploy.config.files import SECRET_ENV

MAX_SECRET_FILE_BYTES = 4096
CONNECT_TIMEOUT_S = 5.0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--secret-file",
        metavar="F",
        default=None,
        help=f"the file holding the cluster secret (default: ${SECRET_ENV})",
    )
    sub = p.add_subparsers(dest="ctl_cmd", required=True)
    sub.add_parser("roles", help="list the workers with their roles and states")
    flip = sub.add_parser("flip", help="move a worker to the other pool")
    flip.add_argument("worker_id")
    flip.add_argument("role", choices=["prefill", "decode"])
    flip.add_argument(
        "--drain-s",
        type=float,
        default=None,
        help="how long its decode streams may take to end before they move (default: the "
        "router's router.flip_drain_s)",
    )


def read_secret(path: str | None, environ=os.environ) -> str:
    """The cluster secret from `path`, else from the environment; ValueError saying what to fix."""
    if path is None:
        secret = environ.get(SECRET_ENV, "").strip()
        if not secret:
            raise ValueError(
                f"no cluster secret: give --secret-file (the deployment's "
                f"security.cluster_secret_file) or set {SECRET_ENV}"
            )
        return secret
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SECRET_FILE_BYTES + 1)
    except OSError as e:
        raise ValueError(f"cannot read the secret file {path}: {e.strerror or e}") from None
    try:
        secret = data.decode().strip()
    except UnicodeDecodeError:
        secret = ""
    if not secret or len(data) > MAX_SECRET_FILE_BYTES:
        raise ValueError(f"{path} must hold the cluster secret as one line of UTF-8 text")
    return secret


def run(args, channel) -> int:
    """Runs `args.ctl_cmd` on `channel` (to the router); the exit status."""
    import grpc

    from pdserve.protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
    from pdserve.protos.security import SECRET_METADATA_KEY

    try:
        secret = read_secret(args.secret_file)
        if args.ctl_cmd == "flip" and args.drain_s is not None and not args.drain_s > 0:
            raise ValueError(f"--drain-s must be > 0, got {args.drain_s}")
    except ValueError as e:
        print(f"pdserve ctl: {e}", file=sys.stderr)
        return 2
    metadata = ((SECRET_METADATA_KEY, secret),)
    admin = worker_pb2_grpc.AdminStub(channel)
    try:
        grpc.channel_ready_future(channel).result(timeout=CONNECT_TIMEOUT_S)
    except grpc.FutureTimeoutError:
        channel.close()
        print(
            f"pdserve ctl: cannot reach the router at {args.router} within "
            f"{CONNECT_TIMEOUT_S:g} s: is the deployment up? (--router)",
            file=sys.stderr,
        )
        return 2
    try:
        with channel:
            if args.ctl_cmd == "roles":
                reply = admin.ListWorkers(
                    worker_pb2.ListWorkersRequest(), metadata=metadata, timeout=10
                )
                for w in reply.workers:
                    print(_row(w))
                return 0
            drain_ms = round(args.drain_s * 1000) if args.drain_s is not None else 0
            reply = admin.Flip(
                worker_pb2.FlipRequest(
                    worker_id=args.worker_id, role=args.role, drain_timeout_ms=drain_ms
                ),
                metadata=metadata,
                timeout=3600,
            )
    except grpc.RpcError as e:
        print(f"pdserve ctl: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    print(
        f"{reply.worker_id}: {reply.from_role} -> {reply.role} (drain {reply.drain_ms} ms, "
        f"switch {reply.switch_ms} ms, {reply.moved_streams} streams moved)"
    )
    return 0


def _row(w) -> str:
    s = w.stats if w.HasField("stats") else None
    load = "running=? waiting=? kv=?"
    if s is not None:
        total = s.num_total_blocks
        used = f"{100 * (total - s.num_free_blocks) / total:.0f}%" if total else "?"
        load = f"running={s.num_running} waiting={s.num_waiting} kv={used}"
    intent = f"intent={w.intended_role or '?'}/{w.intended_state or '?'}"
    reports = "reports=?"
    if w.reported_role:
        age = f" {w.reported_age_ms / 1000:.1f}s ago" if w.reported_age_ms >= 0 else ""
        reports = f"reports={w.reported_role}/{w.reported_state}{age}"
    match = "STUCK" if w.stuck else "MISMATCH" if w.mismatch else "ok"
    columns = (w.worker_id, w.role, w.state, intent, reports, match, load, w.address)
    return "\t".join(columns)
