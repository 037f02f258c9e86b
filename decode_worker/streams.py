"""How a decode worker's engine outputs become token events, and the call that carries many
requests' events at once (DecodeWorker.Streams; Stream carries one request's: service.py).

`EventReader` reads one request's outputs (the engine's DELTA outputs, and the hand-off's first
output, CommitOutput) into TokenEvents: only the tokens not yet sent, what queued up merged into
one event per sequence, final events decorated with the worker's timings, cached tokens and
prompt logprobs. `Connection` is one Streams call's state, shared by the three threads that
touch it: the engine loop marks a request ready when it puts an output in its queue, the call's
request reader attaches and detaches requests as the caller names them, and the call's handler
waits for ready requests and sends what each holds in one StreamsResponse a round. A request
leaves a Connection when its events are all sent, when the caller detaches it, or when the call
ends; the last two abort it, as a Stream caller going away does. `Interval` holds a request's
outputs back from its queue until a stream interval's worth of tokens is there.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from pdserve.decode_worker.handoff import CommitOutput, HandoffTimings
from pdserve.engine.request import RequestOutput
from pdserve.protos.convert import unix_ns
from pdserve.protos.pdserve.v1 import worker_pb2
from pdserve.worker_common.logprobs import prompt_fields, top_of, wants_top

# at most this many queued outputs of one request are read in one round
MAX_COALESCED = 64
# at most this many of a Streams call's news wait for its handler: past it the call's request
# reader waits (and so reads no more of the caller's messages) until the handler took them, so
# a caller that sends and never reads holds a bounded amount of this worker's memory
MAX_PENDING_NEWS = 8192


class EventReader:
    """One request's outputs, read into the TokenEvents that carry what is new."""

    def __init__(self, n: int, colocated: bool, prompt_logprobs: int | None, worker_id: str):
        self.n, self.colocated, self.worker_id = n, colocated, worker_id
        self.wanted_prompt_logprobs = prompt_logprobs  # sampling.prompt_logprobs
        self.sent: dict[int, int] = {}  # sequence index -> tokens already sent
        # sequence index -> where the engine's next (delta) output starts: the hand-off's
        # CommitOutput sent the first token already, and the engine's outputs hold it again
        self.at: dict[int, int] = {}
        self.ended: set[int] = set()  # sequence indexes whose final event went out
        self.prompt_logprobs = None  # (prompt ids, logprobs) from the output that carried them
        self.finished = False
        self.first_token_ns = 0
        self.timings = HandoffTimings()  # stays empty: colocated, or freed before its commit
        self.cached_tokens = 0  # a colocated request's, once finished

    def take(self, outs: list[RequestOutput]) -> list[worker_pb2.TokenEvent]:
        """The events of these outputs (in order): one per sequence that has news, unless a
        committed first token's lack of top logprobs keeps it apart. ValueError: the prompt
        logprobs the request asked for cannot be given."""
        now = unix_ns()
        pending: list[worker_pb2.TokenEvent] = []
        for out in outs:
            if isinstance(out, CommitOutput):  # the hand-off's first output
                self.timings = out.timings
            if out.prompt_logprobs is not None:
                self.prompt_logprobs = (out.prompt_token_ids, out.prompt_logprobs)
            for event in self._events(out):
                _merge_into(pending, event)
        last = outs[-1]
        self.finished = last.finished
        if last.finished and self.colocated:
            self.cached_tokens = last.num_cached_tokens
        for event in pending:
            self.first_token_ns = self.first_token_ns or now
            if event.HasField("finish_reason") and self.colocated:
                event.num_cached_tokens = last.num_cached_tokens
                self._add_prompt_logprobs(event)
            if event.HasField("finish_reason"):
                event.timings.CopyFrom(
                    self.timings.to_proto(self.worker_id, self.first_token_ns, now)
                )
        return pending

    def _events(self, out: RequestOutput) -> list[worker_pb2.TokenEvent]:
        """The token events of one output (what is new in each sequence), and when it finished
        the request, the final events of the sequences it left open."""
        events = [self._event(comp, self._start(comp, out)) for comp in out.outputs]
        if out.finished:  # an abort's output names sequence 0 only: end every other one
            events += _end_rest(out, self.n, self.ended)
        return [e for e in events if e is not None]

    def _start(self, comp, out: RequestOutput) -> int:
        """Where comp's tokens start in its sequence's output: 0 for the hand-off's first
        output, else where the engine's previous (delta) output of that sequence ended."""
        if isinstance(out, CommitOutput):
            return 0
        start = self.at.get(comp.index, 0)
        self.at[comp.index] = start + len(comp.token_ids)
        return start

    def _event(self, comp, start: int) -> worker_pb2.TokenEvent | None:
        """The event for what is new in one sequence's output (whose tokens start at output
        position `start`): the tokens past those sent, and its end the first time it is
        finished; None when nothing is new."""
        sent, ended = self.sent, self.ended
        if comp.index in ended:
            return None
        skip = max(0, sent.get(comp.index, 0) - start)
        new_ids = comp.token_ids[skip:]
        final = comp.finish_reason is not None
        if not new_ids and not final:
            return None
        sent[comp.index] = max(sent.get(comp.index, 0), start + len(comp.token_ids))
        event = worker_pb2.TokenEvent(index=comp.index, token_ids=new_ids)
        if comp.logprobs:
            new_logprobs = comp.logprobs[skip:]
            event.logprobs.extend(new_logprobs)
            if wants_top(new_logprobs):  # a committed first token's stays empty
                event.top_logprobs.extend(top_of(x) for x in new_logprobs)
        if final:
            ended.add(comp.index)
            event.finish_reason = comp.finish_reason
            # for "abort" stop_str carries the human-readable reason (TokenEvent has no message)
            if isinstance(comp.stop_reason, str):
                event.stop_str = comp.stop_reason
            elif isinstance(comp.stop_reason, int):
                event.stop_token = comp.stop_reason
            event.accepted_prediction_tokens = comp.accepted_prediction_tokens
            event.rejected_prediction_tokens = comp.rejected_prediction_tokens
        return event

    def _add_prompt_logprobs(self, event) -> None:
        """A colocated request's prompt logprobs on each sequence's last event (the router puts
        them in the client's Finish), when its sampling asked for them."""
        if self.wanted_prompt_logprobs is None or event.finish_reason not in ("stop", "length"):
            return
        if self.prompt_logprobs is None:
            raise ValueError("no output carried them")
        fields = prompt_fields(*self.prompt_logprobs, self.wanted_prompt_logprobs)
        event.prompt_logprobs.extend(fields.get("prompt_logprobs", ()))
        event.prompt_top_logprobs.extend(fields.get("prompt_top_logprobs", ()))


class Interval:
    """A request's stream interval (ReserveRequest.stream_interval, vLLM's --stream-interval):
    which of its outputs wake its stream. The first output (its first token) and the last go at
    once; the others are held until they carry `every` new tokens between them (a sequence's
    tokens, the longest sequence's for n > 1), then go together, so a stream reader wakes, and
    the router receives and sends, once per `every` tokens instead of once per token. Called on
    the engine loop's thread only."""

    __slots__ = ("every", "held", "tokens", "started")

    def __init__(self, every: int):
        self.every = every
        self.held: list[RequestOutput] = []
        self.tokens = 0  # new tokens in `held`
        self.started = False  # the first output went

    def take(self, out: RequestOutput) -> list[RequestOutput]:
        """The outputs to queue now, in order, `out` last ([]: `out` is held)."""
        self.held.append(out)
        self.tokens += max((len(c.token_ids) for c in out.outputs), default=0)
        if self.started and not out.finished and self.tokens < self.every:
            return []
        self.started = True
        # the hand-off's first output (CommitOutput) carries the first token, which the engine's
        # first output holds again: it is not new
        due, self.held, self.tokens = self.held, [], -1 if isinstance(out, CommitOutput) else 0
        return due


def drain(outputs: queue.SimpleQueue, first: RequestOutput | None = None) -> list[RequestOutput]:
    """`first` (when given) and the outputs queued behind it, up to the request's last (at most
    MAX_COALESCED): a reader that fell behind the engine sends what they hold at once, so a
    worker with many streams sends fewer messages, not later ones."""
    outs = [] if first is None else [first]
    while not (outs and outs[-1].finished) and len(outs) < MAX_COALESCED:
        try:
            outs.append(outputs.get_nowait())
        except queue.Empty:
            break
    return outs


def _merge_into(pending: list[worker_pb2.TokenEvent], event: worker_pb2.TokenEvent) -> None:
    """`event` added to the events about to go out: into the last one of its sequence, which
    then carries both (tokens, logprobs, and the end where `event` has it), unless only one of
    them has its tokens' top logprobs (a committed first token has none), which the router
    could not then tell apart."""
    for earlier in reversed(pending):
        if earlier.index != event.index:
            continue
        if bool(earlier.top_logprobs) == bool(event.top_logprobs):
            earlier.MergeFrom(event)
            return
        break
    pending.append(event)


def _end_rest(out: RequestOutput, n: int, ended: set[int]) -> list[worker_pb2.TokenEvent]:
    """Final events for the sequences a finished output left open (an abort names only
    sequence 0), with the reason of the first sequence that gave one."""
    why = next((c for c in out.outputs if c.finish_reason is not None), None)
    events = []
    for index in range(n):
        if index in ended:
            continue
        ended.add(index)
        event = worker_pb2.TokenEvent(
            index=index, finish_reason=why.finish_reason if why else "abort"
        )
        if (
            why is not None
            and isinstance(why.stop_reason, str)
            and why.finish_reason in ("abort", "error")
        ):
            event.stop_str = why.stop_reason
        events.append(event)
    return events


class Connection:
    """One Streams call's requests: which are ready (an output arrived), which the caller
    attached, refused or detached since the handler last looked. At most `max_news` of the
    request reader's news wait for the handler (`note` waits for room past it)."""

    def __init__(self, max_news: int = MAX_PENDING_NEWS):
        lock = threading.Lock()
        self._cond = threading.Condition(lock)  # the handler waits here for news
        self._room = threading.Condition(lock)  # the request reader waits here for room
        self._ready: set[str] = set()
        self._news: list[tuple[str, str, object]] = []  # (kind, request id, what)
        self.max_news = max_news
        self.num_waits = 0  # times the request reader waited for room (the tests read it)
        self.closed = False

    def ready(self, rid: str) -> None:
        """An output of `rid` is queued (the engine loop's thread: cheap, never blocks long)."""
        with self._cond:
            if not self._ready:
                self._cond.notify()
            self._ready.add(rid)

    def note(self, kind: str, rid: str, what: object = None) -> bool:
        """The request reader's news: ("attach", rid, its _Stream), ("refuse", rid, (code,
        details)), ("detach", rid, None) or ("input_done", "", None); False once the call is
        closed (nobody will read it: an attached request is then the reader's to release).
        Waits while `max_news` of them are not taken yet (the handler is blocked sending to a
        caller that does not read), until the handler takes them or the call is closed."""
        with self._cond:
            while len(self._news) >= self.max_news and not self.closed and kind != "input_done":
                self.num_waits += 1
                self._room.wait()
            if self.closed:
                return False
            self._news.append((kind, rid, what))
            self._cond.notify()
            return True

    def close(self) -> list[tuple[str, str, object]]:
        """No more news is taken; the news nobody read."""
        with self._cond:
            self.closed = True
            news, self._news = self._news, []
            self._room.notify_all()
        return news

    def wait(self, timeout: float) -> tuple[list, set[str]]:
        """The news and the ready requests since the last call (both may be empty)."""
        with self._cond:
            if not self._ready and not self._news:
                self._cond.wait(timeout)
            news, self._news = self._news, []
            ready, self._ready = self._ready, set()
            if news:
                self._room.notify_all()
        return news, ready

    def notifier(self, rid: str) -> Callable[[], None]:
        return lambda: self.ready(rid)
