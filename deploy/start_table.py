"""The table `pdserve up` prints once every worker is ready: one row per worker with its role, the
Ray node it runs on (and the nodes of its later pipeline stages where they differ), its process id (for `kill -USR1`: its stacks in its log), its cores, the precision it serves in, its KV transfer backend, its KV
capacity (blocks, tokens, and how many sequences of max_model_len fit at once) and its log file.
On `kvtransfer.backend: auto` a decode row says what it offers ("auto: shm, grpc"), a prefill row
what it picks ("auto -> shm"), and a line under the table the order auto follows and where it came
from: the deployment's `kvtransfer.profile` (file, date, machine) or the built-in default. A
disaggregated deployment's last line says which prompts the router may run on a decode worker
(router.local_prefill) and the price it uses, with where an "auto" cost came from.

The launcher collects each started worker's WorkerActor.info() (plain data, deploy/workers.py)
into Cluster.workers; `format_table` turns those into the text, and nothing here talks to Ray or a
worker, so tests/unit/test_start_table.py checks the wording alone. A value a worker did not
report shows as "?", so a table is printed even for a worker whose info could not be read.
"""

from __future__ import annotations

COLUMNS = (
    "worker",
    "role",
    "node",
    "pid",
    "cores",
    "precision",
    "KV backend",
    "KV blocks",
    "max seqs",
    "log",
)


def core_ranges(cores: list[int]) -> str:
    """0,1,2,5 -> "0-2,5"."""
    spans: list[list[int]] = []
    for c in sorted(set(cores)):
        if spans and c == spans[-1][1] + 1:
            spans[-1][1] = c
        else:
            spans.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)


def _cores(info: dict) -> str:
    cores = info.get("cores")
    if not cores:
        return "?"
    text = (
        f"{core_ranges(cores)} (pinned)" if info.get("pinned") else f"any of {core_ranges(cores)}"
    )
    if info.get("niceness"):  # Ray niced the process and it could not undo it (deploy/workers.py)
        text += f", nice {info['niceness']}"
    return text


def _where(ip: str | None, node_id: str | None) -> str:
    return f"{ip or '?'} ({node_id[:8] if node_id else '?'})"


def _node(info: dict) -> str:
    """Rank 0's node; when a pipelined worker's later stages run on other nodes (info["ranks"]:
    one entry per rank, deploy/rank_actors.py), each such stage's too: "... stage 1: ip (id)"."""
    ip, node_id = info.get("node_ip"), info.get("node_id")
    if not ip and not node_id:
        return "?"
    text = _where(ip, node_id)
    stages: dict[int, set[str]] = {}
    for r in info.get("ranks") or []:
        if r.get("node_id") != node_id:
            stages.setdefault(r.get("stage", 0), set()).add(
                _where(r.get("node_ip"), r.get("node_id"))
            )
    for stage, nodes in sorted(stages.items()):
        text += f", stage {stage}: {' + '.join(sorted(nodes))}"
    return text


def _precision(info: dict) -> str:
    dtype = info.get("dtype")
    if not dtype:
        return "?"
    text = dtype + (f"+{info['quantization']}" if info.get("quantization") else "")
    device = info.get("device")
    if device and device != "cpu":
        text += f" on {device}"
    if (info.get("tp") or 1) > 1:
        text += f", tp {info['tp']}"
    if (info.get("pp") or 1) > 1:
        text += f", pp {info['pp']}"
    return text


def _kv(info: dict) -> str:
    if info.get("blocks") is None:
        return "?"
    return f"{info['blocks']} x {info['block_size']} = {info['tokens']} tokens"


def _max_seqs(info: dict) -> str:
    if info.get("max_seqs_at_max_len") is None:
        return "?"
    return f"{info['max_seqs_at_max_len']} at {info['max_model_len']} tokens"


def row(info: dict, kv_backend: str | None = None) -> tuple[str, ...]:
    """One worker's cells, in COLUMNS' order. `kv_backend` overrides the worker's own (a
    colocated deployment hands no KV off: the launcher says so)."""
    return (
        info.get("worker_id") or "?",
        info.get("role") or "?",
        _node(info),
        str(info["pid"]) if info.get("pid") else "?",
        _cores(info),
        _precision(info),
        kv_backend or info.get("kv_backend") or "?",
        _kv(info),
        _max_seqs(info),
        info.get("log_file") or "?",
    )


def _offered(decode: dict) -> list[str]:
    """The backends a decode row on "auto" offers ("auto: shm, grpc" -> ["shm", "grpc"])."""
    text = str(decode.get("kv_backend") or "")
    if not text.startswith("auto:"):
        return ["grpc"]
    return [b.strip() for b in text.removeprefix("auto:").split(",") if b.strip()]


def auto_pick(info: dict, infos: list[dict], ranking=None) -> str | None:
    """On kvtransfer.backend "auto", what a prefill worker pushes over to the decode workers of
    `infos` (kvtransfer/choose.py): the first of `ranking`'s same-host order (None: the built-in
    one) that a decode worker on its node offers, the first of its cross-host order to the
    others, e.g. "auto -> shm" or "auto -> shm (2), grpc (1)". None for any other row."""
    from pdserve.kvtransfer.choose import DEFAULT

    ranking = ranking or DEFAULT
    decodes = [d for d in infos if d.get("role") == "decode"]
    if info.get("role") != "prefill" or not any(
        str(d.get("kv_backend") or "").startswith("auto") for d in decodes
    ):
        return None
    picks: dict[str, int] = {}
    for d in decodes:
        same_node = bool(d.get("node_id")) and d.get("node_id") == info.get("node_id")
        pick = ranking.pick(_offered(d), same_node) or "grpc"
        picks[pick] = picks.get(pick, 0) + 1
    if len(picks) == 1:
        return f"auto -> {next(iter(picks))}"
    return "auto -> " + ", ".join(f"{b} ({n})" for b, n in sorted(picks.items(), reverse=True))


def format_table(
    infos: list[dict], kv_backend: str | None = None, ranking=None, local_prefill: str = ""
) -> str:
    """The table of `infos` (one WorkerActor.info() each), its columns aligned, a header first.
    `ranking` (kvtransfer/choose.py Ranking): on kvtransfer.backend "auto", the order the picks
    follow, said on a line under the table with where it came from. `local_prefill`: the
    router's local-prefill rule in words (planner/local_prefill.py), on a line of its own."""
    rows = [COLUMNS] + [row(i, kv_backend or auto_pick(i, infos, ranking)) for i in infos]
    widths = [max(len(r[c]) for r in rows) for c in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    if ranking is not None:
        lines.append(f"KV transfer auto, fastest first: {ranking.describe()}")
    if local_prefill:
        lines.append(f"Local prefill: {local_prefill}")
    return "\n".join(lines)
