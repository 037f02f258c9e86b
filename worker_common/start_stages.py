"""A worker's start, stage by stage, as it happens: the model's files, the compiled CPU kernels,
the weights, the precision probe, the KV cache and the warm-up, each a line with its time.

A first start of a worker spends a minute or more before it serves (building two compiled
kernels, loading and converting weights, probing which precision to serve in, warming up), and
without these lines an operator sees nothing of it. StageLog keeps a worker's lines, logs each
one as it is added (the worker's own log) and hands out those not yet read (`since`), so that
`pdserve up` can print them on its console while the start runs (deploy/start_watch.py polls
WorkerActor.stages). `traced(stages)` is the one place that knows where in the engine those stages
are: for the duration of a start it wraps those engine functions (STAGE_POINTS) with timing that
adds a line when each begins (the long ones) and ends, and it puts them back as they were when the
start is over. The wrappers only observe: each calls the original with the same arguments and
returns what it returned. Only the process that builds rank 0's engine is traced (a TP group's
other ranks run the same stages in processes of their own). tests/unit/test_start_stages.py checks
that every point still exists in the engine, so a renamed one fails a test instead of going quiet.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

log = logging.getLogger(__name__)

# (module, attribute path, stage): the engine functions whose calls are a start's stages
STAGE_POINTS = (
    ("pdserve.engine.engine_core", "resolve_model", "model files"),
    ("pdserve.engine.kernels", "_build", "kernel build"),
    ("pdserve.engine.model_runner", "ModelRunner._load_weights", "weights"),
    ("pdserve.engine.model_runner", "ModelRunner._new_kv_cache", "KV capacity"),
    ("pdserve.engine.precision", "choose_precision", "precision probe"),
    ("pdserve.engine.engine_core", "LLMEngine.warm_up", "warm-up"),
)


@dataclass(frozen=True)
class Stage:
    t: float  # seconds since the StageLog began (or `begin` was last called)
    name: str  # one of STAGE_POINTS' stages, or the worker's own ("serving")
    text: str

    def line(self) -> str:
        return f"{self.t:6.1f}s {self.name}: {self.text}"


class StageLog:
    """One worker's start stages, in order; safe to add to and read from any thread."""

    def __init__(self, worker_id: str, clock: Callable[[], float] = time.monotonic):
        self.worker_id = worker_id
        self._clock = clock
        self._t0 = clock()
        self._stages: list[Stage] = []
        self._lock = threading.Lock()

    def begin(self) -> None:
        """Times the stages from now (the start itself, not the process's creation before it)."""
        self._t0 = self._clock()

    def add(self, name: str, text: str) -> Stage:
        stage = Stage(round(self._clock() - self._t0, 3), name, text)
        with self._lock:
            self._stages.append(stage)
        log.info("%s start: %s", self.worker_id, stage.line())
        return stage

    def since(self, index: int) -> list[Stage]:
        """The stages after the first `index` (what a reader that has seen `index` lacks)."""
        with self._lock:
            return self._stages[max(index, 0) :]


def log_to_stderr() -> None:
    """This module's lines on stderr too, whatever the process's logging setup (a Ray actor's
    stderr is its log file, which the start table names). Once per process."""
    if not any(getattr(h, "_pdserve_stages", False) for h in log.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handler._pdserve_stages = True
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.0f} MiB"


def kv_capacity(num_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int) -> dict:
    """What a KV cache of `num_blocks` blocks holds: its tokens, and how many sequences of
    max_model_len tokens can run at once (its blocks, bounded by max_num_seqs)."""
    per_seq = -(-max_model_len // block_size)
    return dict(
        blocks=num_blocks,
        block_size=block_size,
        tokens=num_blocks * block_size,
        max_model_len=max_model_len,
        max_seqs_at_max_len=min(num_blocks // per_seq, max_num_seqs),
    )


def _describe(stage: str, args: tuple, result, took: float) -> str:
    """The end line of `stage`, from the wrapped call's arguments and result."""
    if stage == "model files":
        return f"{result} ({took:.1f}s)"
    if stage == "kernel build":
        name = args[0] if args else "?"
        if result is None:
            return f"{name}: unavailable, the torch path serves instead ({took:.1f}s)"
        return f"{name}: ready in {took:.1f}s"
    if stage == "weights":
        return f"loaded in {took:.1f}s"
    if stage == "precision probe":
        return f"{result[1]} ({took:.1f}s)"
    if stage == "warm-up":
        return f"one throwaway request in {took:.1f}s"
    if stage == "KV capacity":
        runner, cache = args[0], result
        blocks = cache.shape[2] - getattr(runner, "_spare_blocks", 0)
        cfg = runner.config
        cap = kv_capacity(blocks, runner.block_size, cfg.max_model_len, cfg.max_num_seqs)
        return (
            f"{cap['blocks']} blocks x {cap['block_size']} tokens = {cap['tokens']} tokens "
            f"({_mib(cache.numel() * cache.element_size())}, {str(cache.dtype).removeprefix('torch.')}"
            f"); {cap['max_seqs_at_max_len']} sequences of max_model_len {cap['max_model_len']} "
            f"at once"
        )
    return f"done in {took:.1f}s"


_BEGIN = {  # the stages long enough to say when they begin
    "kernel build": lambda args: (
        f"{args[0] if args else '?'}: building, or loading the cached build"
    ),
    "precision probe": lambda args: "scoring the probe text in each precision",
    "warm-up": lambda args: "one throwaway request",
}


def _wrap(original: Callable, stage: str, stages: StageLog) -> Callable:
    @functools.wraps(original)
    def traced_call(*args, **kwargs):
        if stage in _BEGIN:
            stages.add(stage, _BEGIN[stage](args))
        t0 = time.monotonic()
        result = original(*args, **kwargs)
        try:
            stages.add(stage, _describe(stage, args, result, time.monotonic() - t0))
        except Exception as e:  # a line that cannot be worded must not fail the start
            stages.add(stage, f"done ({type(e).__name__} wording it)")
        return result

    return traced_call


def resolve_point(module: str, path: str) -> tuple[object, str]:
    """(the object holding the attribute, its name) for a STAGE_POINTS entry."""
    owner = importlib.import_module(module)
    *parents, name = path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    getattr(owner, name)  # AttributeError when the engine no longer has it
    return owner, name


@contextlib.contextmanager
def traced(stages: StageLog) -> Iterator[StageLog]:
    """Within the block, every STAGE_POINTS call in this process adds its lines to `stages`;
    after it, the engine's functions are its own again. A point the engine lacks is skipped, with
    one warning."""
    saved = []
    try:
        for module, path, stage in STAGE_POINTS:
            try:
                owner, name = resolve_point(module, path)
            except (ImportError, AttributeError) as e:
                log.warning("start stage %r not traced: %s.%s missing (%s)", stage, module, path, e)
                continue
            # a class's own function (bound to its instances as before), or the module's
            original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            saved.append((owner, name, original))
            setattr(owner, name, _wrap(original, stage, stages))
        yield stages
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
