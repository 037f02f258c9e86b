"""What every benchmark shares: the deterministic random-token prompts and their seeds, memory
snapshots, machine info, the CPU contention monitors that record how much CPU other processes used
while a section was measured, the scripts' parser and common options, and the one way a result is
written (write_result, led by run_header's command, date, commit and CPU model and flags;
write_timed and run_and_write add the run's took_s). A
benchmark imports it in its parent process and in the sides it spawns; it keeps no state.

No torch import at module level: the parent process, which imports this module too, must stay small.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TOKEN_LO, TOKEN_HI = 100, 49000

# seeds of the prompt sets (disjoint, so no two sections share a prompt by construction)
SEED_DECODE = 1000
SEED_WARMUP = 2000
SEED_TTFT = 3000  # + repeat index
SEED_COLD = 4000  # + repeat index
SEED_PREFIX = 5000
SEED_SUFFIX = 6000  # + repeat index
SEED_ONE_STREAM = 7000

CONTENTION_WARN_CORES = 0.1  # other processes' average CPU use that makes timings suspect


def log(msg: str) -> None:
    name = os.path.basename(sys.argv[0]).removesuffix(".py") if sys.argv else "bench"
    print(f"[{name} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def random_prompts(seed: int, n: int, length: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(TOKEN_LO, TOKEN_HI, (n, length), generator=g).tolist()


def proc_status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def memory_snapshot() -> dict:
    import resource

    return {
        "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        * 1024,  # KiB on Linux
        "vm_hwm_bytes": (proc_status_kb("VmHWM") or 0) * 1024,
        "vm_rss_bytes": (proc_status_kb("VmRSS") or 0) * 1024,
    }


def cpu_model() -> str:
    """This CPU's model name, "(run as KIND)" added under benchmarks/as_cpu.py (engine.cpu)."""
    from pdserve.engine.cpu import cpu_features

    return cpu_features().model


def cpu_flags() -> list[str]:
    """The ISA flags that decide the engine's paths (engine.cpu.ISA_FLAGS) this CPU has."""
    from pdserve.engine.cpu import cpu_features

    return cpu_features().isa()


def run_header(module: str, argv: list[str] | None) -> dict:
    """What every result file starts with: the command (`python -m MODULE ARGS`), when, at which
    commit, on which CPU."""
    args = argv if argv is not None else sys.argv[1:]
    return {
        "command": " ".join(["python", "-m", module, *args]),
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_head(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_flags": cpu_flags(),
    }


def write_result(
    path: str, report: dict, module: str | None = None, argv: list[str] | None = None
) -> None:
    """The benchmark's one current result file (indented JSON; its folder made when missing).
    With `module`, run_header(module, argv)'s fields (the command, date, commit, CPU model and
    flags) lead the report, each unless the report sets it itself; without it the report already
    starts with run_header's fields (a report that is written more than once as it grows)."""
    import json

    if module is not None:
        header = run_header(module, argv)
        report = {**{k: v for k, v in header.items() if k not in report}, **report}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)


def write_timed(path: str, report: dict, t0: float) -> None:
    """write_result(path, report) with report["took_s"] set to the seconds since perf_counter t0
    (a report written as it grows is stamped again at each write)."""
    report["took_s"] = round(time.perf_counter() - t0, 1)
    write_result(path, report)


def run_and_write(module: str, argv: list[str] | None, path: str, run) -> int:
    """A benchmark's main once its flags are read: run_header(module, argv)'s fields, then what
    `run()` returns, then took_s, written to `path`; main's exit status (0)."""
    t0 = time.perf_counter()
    report = {**run_header(module, argv), **run()}
    write_timed(path, report, t0)
    log(f"wrote {path}")
    return 0


def machine_info(threads: int) -> dict:
    import torch
    import transformers

    return {
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_num_threads": torch.get_num_threads(),
        "threads_requested": threads,
        "date_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }


def side_result(side: str, threads: int) -> dict:
    """The opening fields of one side's result (engine/bench.py's run_hf and run_pdserve),
    taken once torch's threads are set and the side's imports are done."""
    return {"side": side, "machine": machine_info(threads), "memory_start": memory_snapshot()}


def git_head() -> str | None:
    """Best effort, read from .git without running git."""
    try:
        git = os.path.join(REPO_ROOT, ".git")
        if os.path.isfile(git):  # a worktree: "gitdir: <path>"
            with open(git) as f:
                git = f.read().split(":", 1)[1].strip()
        with open(os.path.join(git, "HEAD")) as f:
            head = f.read().strip()
        if not head.startswith("ref:"):
            return head
        ref = head.split(":", 1)[1].strip()
        for base in (git, os.path.join(git, "..", "..")):  # worktrees keep refs in the common dir
            path = os.path.join(base, ref)
            if os.path.isfile(path):
                with open(path) as f:
                    return f.read().strip()
        return ref
    except Exception:
        return None


def count_new_tokens(outs, counts: dict, final: dict | None = None) -> int:
    """The tokens an engine step's outputs added to the tracked requests: `counts` maps each
    tracked request id to its tokens so far and is brought up to date; a finished request's
    output goes into `final` when given."""
    made = 0
    for o in outs:
        if o.request_id in counts:
            k = len(o.outputs[0].token_ids)
            made += k - counts[o.request_id]
            counts[o.request_id] = k
            if final is not None and o.finished:
                final[o.request_id] = o
    return made


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def closed_loop(items: list, concurrency: int, run_one) -> tuple[list, float]:
    """`run_one(item)` for every item, `concurrency` at a time on threads: the results (in the
    order they ended) and the wall time."""
    import threading

    todo, rows, lock = list(items), [], threading.Lock()
    t0 = time.perf_counter()

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                item = todo.pop()
            row = run_one(item)
            with lock:
                rows.append(row)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return rows, time.perf_counter() - t0


def machine_busy_cpu_s() -> float | None:
    """CPU seconds all cpus spent busy since boot (/proc/stat), None where unavailable."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    busy = sum(fields[:8]) - idle  # guest is inside user
    return busy / os.sysconf("SC_CLK_TCK")


class CpuMonitor:
    """How much CPU *other* processes used while we measured: the benchmark shares the machine."""

    own_key = "own_cpu_s"

    def __init__(self):
        self.t, self.busy, self.own = time.perf_counter(), machine_busy_cpu_s(), self._own()

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system

    def stop(self) -> dict:
        wall = time.perf_counter() - self.t
        own = self._own() - self.own
        busy = machine_busy_cpu_s()
        out = {"wall_s": wall, self.own_key: own}
        if busy is not None and self.busy is not None:
            foreign = max(0.0, (busy - self.busy) - own)
            out.update(
                machine_busy_cpu_s=busy - self.busy,
                foreign_cpu_s=foreign,
                foreign_cores_avg=foreign / wall if wall > 0 else None,
            )
        return out


def process_table() -> tuple[dict[int, int], dict[int, float]]:
    """Every live process: pid -> parent pid, and pid -> CPU seconds (user + system), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    parent, cpu = {}, {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = (
                    f.read().rsplit(")", 1)[1].split()
                )  # after the "(comm)", which may hold spaces
        except OSError:
            continue
        pid = int(name)
        parent[pid] = int(fields[1])
        cpu[pid] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return parent, cpu


def process_tree(parent: dict[int, int], root: int) -> set[int]:
    """`root` and its live descendants, from process_table()'s parents."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo += children.get(pid, [])
    return tree


def process_tree_cpu_s(root_pid: int | None = None) -> float:
    """CPU seconds (user + system) of `root_pid` (default: this process) and every live descendant:
    a benchmark that starts Ray or worker processes counts them as its own, not as other load.
    Descendants that exited meanwhile drop out of the sum, so use it over windows in which the
    set of processes is stable."""
    parent, cpu = process_table()
    tree = process_tree(parent, os.getpid() if root_pid is None else root_pid)
    return sum(cpu.get(pid, 0.0) for pid in tree)


class TreeCpuMonitor(CpuMonitor):
    """Like CpuMonitor, but this process's whole tree (Ray, workers, helpers) counts as its own."""

    own_key = "own_tree_cpu_s"

    @staticmethod
    def _own() -> float:
        return process_tree_cpu_s()


class CpuBreakdown:
    """CPU seconds per component over a window, from /proc sampled every `period_s` (so a child
    that exits, like the load generator, keeps what it used up to its last sample): this driver
    (the router's gRPC server and handlers; this script sleeps), each worker process (pid -> name
    given), the load generator child, the rest of this process tree (Ray's raylet, GCS, ...), and
    everything outside the tree."""

    def __init__(self, names: dict[int, str], period_s: float = 0.5):
        import threading

        self.names, self.period_s = dict(names), period_s
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.label: dict[int, str] = {}
        self.t0, self.busy0 = time.perf_counter(), machine_busy_cpu_s()
        self._stop = threading.Event()
        self._sample(first=True)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _label(self, pid: int, tree: set[int]) -> str:
        if pid == os.getpid():
            return "driver: router (+ this script)"
        if pid in self.names:
            return self.names[pid]
        if pid not in tree:
            return "outside this run"
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            cmd = ""
        if "-m pdserve bench" in cmd:
            return "load generator (pdserve bench)"
        return "ray and other processes of this run"

    def _sample(self, first: bool = False) -> None:
        parent, cpu = process_table()
        tree = process_tree(parent, os.getpid())
        for pid, c in cpu.items():
            if pid not in self.label:
                self.label[pid] = self._label(pid, tree)
                self.first[pid] = c if first else 0.0
            self.last[pid] = c

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        self._sample()
        wall = time.perf_counter() - self.t0
        busy = machine_busy_cpu_s() - self.busy0
        groups: dict[str, float] = {}
        for pid, label in self.label.items():
            groups[label] = groups.get(label, 0.0) + max(0.0, self.last[pid] - self.first[pid])
        return {
            "wall_s": wall,
            "machine_cores_avg": busy / wall,
            "cores_avg": {
                k: round(v / wall, 3) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])
            },
        }


def section(results: dict, name: str, fn) -> None:
    """Run one measurement; a failure is recorded, the other sections still run."""
    t0 = time.perf_counter()
    mon = CpuMonitor()
    log(f"{results['side']}: {name} ...")
    try:
        results[name] = fn()
    except Exception as e:  # noqa: BLE001 - the report must say what broke
        results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        log(f"{results['side']}: {name} FAILED: {type(e).__name__}: {e}")
    cpu = mon.stop()
    results.setdefault("cpu_contention", {})[name] = cpu
    log(
        f"{results['side']}: {name} done in {time.perf_counter() - t0:.1f} s; other processes used "
        f"{fmt(cpu.get('foreign_cores_avg'), '.2f')} cores on average meanwhile"
    )


def wait_for_idle_machine(max_wait_s: float) -> dict:
    """Poll until other processes use < CONTENTION_WARN_CORES over a 3 s window (or give up)."""
    t0 = time.perf_counter()
    while True:
        mon = CpuMonitor()
        time.sleep(3)
        f = mon.stop().get("foreign_cores_avg")
        waited = time.perf_counter() - t0
        if f is None or f < CONTENTION_WARN_CORES or waited >= max_wait_s:
            if f is not None and f >= CONTENTION_WARN_CORES:
                log(
                    f"machine still busy ({f:.2f} cores used by others) after {waited:.0f} s; going on"
                )
            return {"waited_s": waited, "foreign_cores_avg_last_3s": f}
        log(
            f"waiting for an idle machine: others use {f:.2f} cores ({waited:.0f}/{max_wait_s:.0f} s)"
        )


def stop_children(conns, procs, kill: bool = False, timeout_s: float = 30.0) -> None:
    """Stops a benchmark's child processes: "stop" down each pipe in `conns` (one whose child is
    gone is skipped), then waits up to timeout_s for each of `procs` and terminates one still
    alive (kill: kills it, and reaps it)."""
    for conn in conns:
        try:
            conn.send("stop")
        except OSError:
            pass
    for proc in procs:
        proc.join(timeout_s)
        if proc.is_alive():
            if kill:
                proc.kill()
                proc.join()
            else:
                proc.terminate()


def fmt(x, spec: str = ".1f", suffix: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{suffix}"


# ---- the options the benchmark scripts share ---------------------------------------------------
def script_parser(description: str) -> argparse.ArgumentParser:
    """A bench script's argument parser; --help prints `description` (the script's docstring, or
    its first paragraph) as written."""
    return argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def add_out_arg(ap, name: str, folder: str = "benchmarks") -> None:
    """--out: the JSON result file, by default <folder>/results/<name> in this checkout (wherever
    the script runs from); folder is benchmarks or experiments."""
    ap.add_argument(
        "--out",
        default=os.path.join(REPO_ROOT, folder, "results", name),
        help=f"JSON results path (default {folder}/results/{name})",
    )


def add_wait_idle_arg(
    ap, before: str, quiet: str = "other processes to stop using the CPU", default: float = 0
) -> None:
    """--wait-idle SECONDS: the benchmarks share the machine, so before each measured part
    (`before`: "each section", "each run", ...) a script may wait for it to be quiet."""
    ap.add_argument(
        "--wait-idle",
        type=float,
        default=default,
        metavar="SECONDS",
        help=f"before {before}, wait up to SECONDS for {quiet} (default {default:g})",
    )


def random_llama(name: str, config, seed: int, tokenizer_dir: str | None = None) -> str:
    """A LlamaForCausalLM of `config` with random weights (torch seed `seed`) and SmolLM2's
    tokenizer files (from `tokenizer_dir` where given: a machine without the embedded GGUF),
    written once into the pdserve cache as bench-models/NAME; its folder."""
    import shutil

    import torch
    from transformers import LlamaForCausalLM

    from pdserve.engine.loader import resolve_model
    from pdserve.engine.loader.resolve import default_cache_dir

    out = default_cache_dir() / "bench-models" / name
    if (out / "config.json").exists():
        return str(out)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for f in Path(tokenizer_dir or resolve_model("smollm2")).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, tmp / f.name)
    tmp.rename(out)
    return str(out)
