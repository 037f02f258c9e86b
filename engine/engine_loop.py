"""An LLMEngine owned by one dedicated thread, for servers.

Each worker process builds one EngineLoop at its start (`EngineLoop.build`, which builds the
engine on the loop thread itself) and stops it last, when the worker stops. gRPC handlers run on
a thread pool; if they called into torch directly, several threads would compete for the cores
(docs/experiments/design-measurements.md). Here every engine call runs on the loop thread,
between steps: other threads `call()` a function and wait for its result, and outputs go back
through per-request callbacks, which must be cheap (put into a queue). Each turn of the loop runs
the queued calls, then the periodic ticks (lease expiry), then one engine step if any work can
run, and dispatches the outputs. It sleeps until new work when idle, including when the only
unfinished requests are reservations waiting for their KV.

Liveness, read by the worker's Stats and heartbeats without waiting on the loop (`load()`): how
long the running turn has lasted (engine_stalled_ms), the CPU time the loop thread spent in it
(engine_turn_cpu_ms), how long it has gone without using the CPU (engine_idle_ms), the CPU time
of the longest turn that finished in about the last 30 s (engine_turn_ms_max), and what the step
running now should cost: its tokens (engine_turn_tokens) and the most CPU time per token of the
steps of at least a block of tokens in about the last 10 minutes (engine_us_per_token_max;
PRIOR_US_PER_TOKEN until one ran, so the first large step after a start is not taken for a hang).
The router tells a hung engine from a busy one by them (router/pool.py). They count the loop
thread's CPU time, not the wall clock's, because a machine shared with other busy processes
stretches a step's wall time many times over and its CPU time far less (OpenMP spins while its
other thread waits for a core; docs/experiments/design-measurements.md): a blocked engine (a
deadlock, a lost peer) uses no CPU, and a spinning one (a hung GPU that its host thread waits
on) uses more than its work should; a slow one does neither. Where a thread's CPU clock cannot
be read, and for an engine whose pipeline stages run in other processes (its loop thread waits
for them inside a step, using no CPU while they compute), every figure is the wall clock's.

A test hook for a hung engine whose server still answers: when the process's environment has
PDSERVE_TEST_ENGINE_HANG_FILE=PATH as the loop is made, the loop thread blocks at the start of a
turn (its turn clock running and its CPU idle, so engine_stalled_ms and engine_idle_ms grow)
while the file PATH, or PATH.NAME for the loop named NAME (a worker's is `<worker_id>-engine`),
exists. Unset, it costs one attribute check per turn; nothing on the network can set it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

from pdserve.engine.errors import EngineBroken
from pdserve.engine.request import RequestOutput

log = logging.getLogger(__name__)
OutputCallback = Callable[[RequestOutput], None]
HANG_FILE_ENV = "PDSERVE_TEST_ENGINE_HANG_FILE"  # the test hook (module docstring)
TURN_WINDOW_S = 15.0  # engine_turn_ms_max covers the last one to two of these windows
RATE_WINDOW_S = 300.0  # engine_us_per_token_max covers the last one to two of these windows
RATE_MIN_TOKENS = 16  # steps of fewer tokens are mostly fixed cost: not a rate
# us per token assumed before any step of RATE_MIN_TOKENS ran: slower than a 2-core CPU prefills
# SmolLM2 under load (about 0.75 ms quiet), so it only lengthens the first large step's bound
PRIOR_US_PER_TOKEN = 3000
# A turn makes progress while its thread uses at least this share of the wall time between two
# reads of its CPU clock: a blocked thread uses next to none (the hang hook's polling, about
# 0.1%), a computing one on a machine ten times over-committed still gets about 10%.
PROGRESS_CPU_SHARE = 0.02


class EngineLoopStopped(RuntimeError):
    pass


class EngineLoop:
    def __init__(self, engine, name: str = "engine-loop"):
        self.engine = engine
        self._calls: deque[tuple[Callable, tuple, Future]] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._callbacks: dict[str, OutputCallback] = {}
        self._ticks: list[tuple[float, Callable[[], None], list[float]]] = []
        self._stop = threading.Event()
        # why the engine cannot step any more (a rank died: _check_ranks); "" while it can
        self.broken = ""
        self._turn_since = 0.0  # time.monotonic() when the running turn began; 0.0: waiting
        # set by a worker's UpdateWeights while the engine loads them (worker_common/weights.py)
        self.loading_weights = False
        # the loop thread's CPU clock (set on the thread; None where it cannot be read), its
        # reading when the running turn began, and the last progress idle_ms() saw: (the turn's
        # _turn_since, the wall clock then, the CPU clock then)
        self._cpu_clock: int | None = None
        self._turn_cpu0 = 0.0
        self._progress = (0.0, 0.0, 0.0)
        self._progress_lock = threading.Lock()
        # the longest finished turn (s) in the current window and in the one before it, and when
        # the current window began: written by the loop thread only, read by load()
        self._turn_max = [0.0, 0.0]
        self._window_start = time.monotonic()
        # the slowest seconds per token of a step in the current rate window and the one before
        # it, and when the current one began (loop thread writes, load() reads)
        self._rate_max = [0.0, 0.0]
        self._rate_start = time.monotonic()
        hang = os.environ.get(HANG_FILE_ENV)
        self._hang_files = (hang, f"{hang}.{name}") if hang else None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.num_steps = 0

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    @classmethod
    def build(
        cls, factory: Callable[[], object], name: str = "engine-loop", timeout: float | None = None
    ) -> EngineLoop:
        """Start a loop whose engine `factory()` builds on the loop thread itself; returns once it
        is built, or raises what the factory raised. torch's OpenMP keeps a pool of worker threads
        for every thread that ever ran a parallel op, and once the pools together outnumber the
        cores every barrier sleeps after a short spin instead of spinning, so an engine built on
        another thread than the one that steps it runs its prefills slower."""
        loop = cls(None, name=name)
        built: Future = Future()

        def bootstrap():
            try:
                loop.engine = factory()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                built.set_exception(e)
                loop._fail_pending_calls()
                return
            built.set_result(None)
            loop._run()

        loop._thread = threading.Thread(target=bootstrap, name=name, daemon=True)
        loop._thread.start()
        built.result(timeout)
        return loop

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    # ---- from other threads -------------------------------------------------------------------
    def submit(self, fn: Callable, *args) -> Future:
        """Run fn(*args) on the loop thread; the Future holds its result or exception (EngineBroken
        at once once the loop is broken)."""
        fut: Future = Future()
        if self.broken:
            fut.set_exception(EngineBroken(self.broken))
            return fut
        with self._lock:
            if self._closed:
                fut.set_exception(EngineLoopStopped("the engine loop is stopped"))
                return fut
            self._calls.append((fn, args, fut))
        self._wake.set()
        return fut

    def call(self, fn: Callable, *args, timeout: float | None = 30.0):
        return self.submit(fn, *args).result(timeout)

    def add_request(
        self,
        request_id: str,
        prompt,
        params,
        on_output: OutputCallback,
        timeout: float | None = 30.0,
        admit: Callable[[], None] | None = None,
        **kwargs,
    ) -> None:
        """Validated on the loop thread; raises the engine's ValueError to the caller. `admit`
        runs first in the same loop turn and refuses the request by raising (what it raises
        reaches the caller)."""

        def add():
            if admit is not None:
                admit()
            self.engine.add_request(request_id, prompt, params, **kwargs)
            self._callbacks[request_id] = on_output

        self.call(add, timeout=timeout)

    def watch(self, request_id: str, on_output: OutputCallback) -> None:
        """Deliver outputs of a request added another way (reserve + commit) to `on_output`.
        Call it on the loop thread (inside `call`), before the request can produce output."""
        self._callbacks[request_id] = on_output

    def abort(
        self,
        request_id: str,
        reason: str = "aborted",
        timeout: float | None = 30.0,
        on_unknown: Callable[[str], None] | None = None,
    ) -> bool:
        """Stops a request; its callback receives a final "abort" output. False when the engine
        did not hold it: `on_unknown(request_id)` then runs in the same loop turn (so nothing
        added after it is missed: worker_common/early_aborts.py)."""
        return self.call(self.abort_here, request_id, reason, on_unknown, timeout=timeout)

    def abort_here(
        self,
        request_id: str,
        reason: str = "aborted",
        on_unknown: Callable[[str], None] | None = None,
    ) -> bool:
        """`abort` for a caller on the loop thread already (inside `call`), so that its own checks
        and the abort share one loop turn."""
        found = self.engine.abort(request_id)
        cb = self._callbacks.pop(request_id, None)
        if found and cb is not None:
            cb(RequestOutput.aborted(request_id, reason))
        if not found and on_unknown is not None:
            on_unknown(request_id)
        return found

    def load(self) -> dict[str, int]:
        """The engine's occupancy, read from any thread without waiting for the loop: health
        checks and heartbeats must answer while a long step runs (a long prompt's prefill takes
        seconds on a small CPU). Each count is one atomic read under the GIL; together they are a
        snapshot that may straddle a step, which is all a load report needs."""
        engine = self.engine
        bm, sched = engine.block_manager, engine.scheduler
        waiting = list(sched.waiting)  # copied in one C call: the loop may append meanwhile
        queued = sum(s.num_prompt_tokens - s.num_computed_tokens for s in waiting)
        return {
            "num_free_blocks": bm.num_free_blocks,
            "num_total_blocks": bm.num_blocks,
            "block_size": bm.block_size,
            "num_running": len(sched.running),
            "num_waiting": len(waiting),
            "queued_prompt_tokens": max(queued, 0),
            "engine_stalled_ms": self.stalled_ms(),
            "engine_turn_cpu_ms": self.turn_cpu_ms(),
            "engine_idle_ms": self.idle_ms(),
            "engine_turn_ms_max": self.turn_ms_max(),
            "engine_turn_tokens": int(getattr(engine, "running_step_tokens", 0) or 0),
            "engine_us_per_token_max": self.us_per_token_max(),
            "engine_loading_weights": self.loading_weights,
        }

    def stalled_ms(self) -> int:
        """How long the loop thread has been inside its current turn (queued calls, ticks, one
        step, dispatch), by the wall clock; 0 while it waits for work (WorkerStats.
        engine_stalled_ms: the router names the turn by when it began)."""
        since = self._turn_since
        return int((time.monotonic() - since) * 1000) if since else 0

    def turn_cpu_ms(self) -> int:
        """The CPU time the loop thread has used in its current turn; 0 while it waits for work.
        A turn that goes on using the CPU far beyond what its work costs is a spinning hang
        (WorkerStats.engine_turn_cpu_ms)."""
        since, cpu0 = self._turn_since, self._turn_cpu0
        if not since:
            return 0
        return max(0, int((self._clock() - cpu0) * 1000))

    def idle_ms(self) -> int:
        """How long the current turn has gone without progress: wall time since its thread was
        last seen using the CPU (at least PROGRESS_CPU_SHARE of the time between two readings);
        0 while it waits for work. Each call is a reading, and the worker's Stats and heartbeats
        call it about once a second, so a blocked turn shows within a second or so of blocking.
        Where the thread's CPU clock cannot be read: the turn's wall time
        (WorkerStats.engine_idle_ms)."""
        since = self._turn_since
        if not since:
            return 0
        now = time.monotonic()
        if self._cpu_clock is None:
            return int((now - since) * 1000)
        cpu = self._clock()
        with self._progress_lock:
            turn, wall, used = self._progress
            if turn != since:  # the first reading in this turn: measure from its start
                turn, wall, used = since, since, self._turn_cpu0
            if cpu > used and cpu - used >= PROGRESS_CPU_SHARE * (now - wall):
                wall, used = now, cpu
            self._progress = (turn, wall, used)
        return max(0, int((now - wall) * 1000))

    def _clock(self) -> float:
        """The loop thread's CPU clock in seconds, read from any thread (the wall clock where it
        cannot be read, or once the thread is gone)."""
        clock = self._cpu_clock
        if clock is not None:
            try:
                return time.clock_gettime(clock)
            except OSError:  # the thread has ended
                pass
        return time.monotonic()

    def turn_ms_max(self) -> int:
        """The most CPU time a turn of the loop that finished in about the last 30 s (between one
        and two TURN_WINDOW_S windows) used, in ms; 0 when none did. What the engine's work costs
        now: the router scales its hang bound by it (WorkerStats.engine_turn_ms_max)."""
        cur, prev = self._turn_max
        age = time.monotonic() - self._window_start
        if age >= 2 * TURN_WINDOW_S:  # no turn ended for two windows: both are stale
            return 0
        longest = max(cur, prev) if age < TURN_WINDOW_S else cur
        return int(longest * 1000)

    def us_per_token_max(self) -> int:
        """The most CPU microseconds per token a step of at least RATE_MIN_TOKENS tokens used in
        about the last 10 minutes (one to two RATE_WINDOW_S windows); PRIOR_US_PER_TOKEN when
        none ran there."""
        cur, prev = self._rate_max
        age = time.monotonic() - self._rate_start
        longest = 0.0 if age >= 2 * RATE_WINDOW_S else max(cur, prev)
        return int(longest * 1e6) if longest else PRIOR_US_PER_TOKEN

    def _note_step_rate(self, seconds: float) -> None:
        """Records the step that just ran, which used `seconds` of the loop thread's CPU clock,
        for us_per_token_max (loop thread only)."""
        tokens = getattr(self.engine, "last_step", (0, 0.0))[0]
        if tokens < RATE_MIN_TOKENS or seconds <= 0:
            return
        now = time.monotonic()
        if now - self._rate_start >= RATE_WINDOW_S:
            stale = now - self._rate_start >= 2 * RATE_WINDOW_S
            self._rate_max = [0.0, 0.0 if stale else self._rate_max[0]]
            self._rate_start = now
        self._rate_max[0] = max(self._rate_max[0], seconds / tokens)

    def take_step_trace(self, timeout: float | None = 30.0) -> list:
        """The engine's StepRecords since the last take (engine.step_trace.StepRecord), taken on the loop
        thread between steps so that none is half-written or lost."""

        def take():
            trace = self.engine.step_trace
            out = list(trace)
            trace.clear()
            return out

        return self.call(take, timeout=timeout)

    def every(self, period_s: float, fn: Callable[[], None]) -> None:
        """Run fn on the loop thread about every period_s seconds (e.g. lease expiry)."""
        self._ticks.append((period_s, fn, [time.monotonic() + period_s]))

    # ---- the loop thread ----------------------------------------------------------------------
    def _run(self) -> None:
        self._cpu_clock = _thread_cpu_clock(self.engine)
        while not self._stop.is_set():
            self._end_turn()
            self._turn_cpu0 = self._clock()  # before the turn shows as begun: load() reads both
            self._turn_since = time.monotonic()
            if self._hang_files is not None:
                self._hang_while_file()
            self._wake.clear()  # before taking calls: a submit after this sets it again
            self._run_calls()
            self._run_ticks()
            if self.engine.has_unfinished_requests():
                # reserved requests (waiting for their KV from a prefill worker) count as
                # unfinished but give a step nothing to do: stepping them in a loop would spin a
                # core for as long as the prefill takes, the core that prefill is computing on
                idle = not self._has_runnable()
                cpu0 = self._clock()
                try:
                    outputs = self.engine.step()
                except Exception as e:  # a failed step must not kill the server silently
                    log.exception("engine step failed; aborting its requests")
                    self._check_ranks(e)
                    self._fail_all(e)
                    continue
                self.num_steps += 1
                self._note_step_rate(self._clock() - cpu0)
                self._dispatch(outputs)
                if idle and not outputs:  # nothing ran and nothing was pending delivery
                    self._wait_for_work()
            else:
                self._wait_for_work()
        self._fail_pending_calls()

    def _has_runnable(self) -> bool:
        """Whether the scheduler holds sequences a step would compute (reserved ones it does not)."""
        scheduler = getattr(self.engine, "scheduler", None)
        if scheduler is None:  # an engine without a visible scheduler: assume work, as before
            return True
        return bool(scheduler.waiting or scheduler.running)

    def _run_calls(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, deque()
        for fn, args, fut in calls:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:
                    fut.set_exception(e)

    def _run_ticks(self) -> None:
        now = time.monotonic()
        for period, fn, due in self._ticks:
            if now >= due[0]:
                due[0] = now + period
                try:
                    fn()
                except Exception:
                    log.exception("engine loop tick failed")

    def _end_turn(self) -> None:
        """Records the turn that just finished, if one ran, for turn_ms_max (loop thread only)."""
        since = self._turn_since
        if not since:
            return
        now = time.monotonic()
        took = self._clock() - self._turn_cpu0
        self._turn_since = 0.0
        if now - self._window_start >= TURN_WINDOW_S:  # a new window; the old one is kept
            stale = now - self._window_start >= 2 * TURN_WINDOW_S
            self._turn_max = [0.0, 0.0 if stale else self._turn_max[0]]
            self._window_start = now
        if took > self._turn_max[0]:
            self._turn_max[0] = took

    def _hang_while_file(self) -> None:
        """The test hook (module docstring): blocks while a hang file exists."""
        while not self._stop.is_set() and any(os.path.exists(f) for f in self._hang_files):
            self._stop.wait(0.05)

    def _wait_for_work(self) -> None:
        self._end_turn()
        deadline = min((due[0] for _, _, due in self._ticks), default=time.monotonic() + 0.5)
        self._wake.wait(max(0.0, deadline - time.monotonic()))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            cb = self._callbacks.get(out.request_id)
            if out.finished:
                self._callbacks.pop(out.request_id, None)
            if cb is not None:
                try:
                    cb(out)
                except Exception:
                    log.exception("output callback of %s failed", out.request_id)

    def _check_ranks(self, error: BaseException) -> None:
        """After a failed step: when one of the engine's ranks has died, every later step would
        fail as this one did, so the loop is broken from now on (before the callers hear of the
        failure, so that they can tell)."""
        alive = getattr(self.engine, "ranks_alive", None)
        if alive is not None and not alive():
            self.broken = f"a rank of its engine died: {error}"[:500]
            log.error(
                "engine loop %s is broken: %s; it takes no more work",
                self._thread.name,
                self.broken,
            )

    def _fail_all(self, error: BaseException) -> None:
        """A step failed: every request it may have held is aborted, and each caller hears it
        now (a finished "abort" output naming the error), not at its own deadline."""
        reason = f"engine step failed: {error}"[:500]
        for request_id in list(self._callbacks):
            try:
                self.engine.abort(request_id)
            except Exception:  # the engine is in a bad way: the caller must still hear
                log.exception("abort of %s after a failed step failed", request_id)
            cb = self._callbacks.pop(request_id, None)
            if cb is not None:
                try:
                    cb(RequestOutput.aborted(request_id, reason))
                except Exception:
                    log.exception("output callback of %s failed", request_id)

    def _fail_pending_calls(self) -> None:
        with self._lock:
            self._closed = True
            calls, self._calls = self._calls, deque()
        for _, _, fut in calls:
            if not fut.done():
                fut.set_exception(EngineLoopStopped("the engine loop stopped"))


def _thread_cpu_clock(engine) -> int | None:
    """The calling thread's CPU clock id, or None where the liveness figures are the wall
    clock's: the platform cannot read another thread's CPU clock, or `engine` has pipeline
    stages in other processes, which its thread waits for inside a step."""
    config = getattr(engine, "config", None)
    if getattr(config, "pipeline_parallel_size", 1) > 1:
        return None
    try:
        clock = time.pthread_getcpuclockid(threading.get_ident())
        time.clock_gettime(clock)
    except (AttributeError, OSError):
        return None
    return clock


def warmed(engine, name: str):
    """`engine` once its warm_up ran (LLMEngine.warm_up says why), for an EngineLoop.build factory:
    workers warm their engine on the loop thread that will step it, before they register."""
    try:
        took = engine.warm_up()
    except BaseException:
        engine.shutdown()
        raise
    log.info("%s: engine warmed up in %.2fs", name, took)
    return engine
