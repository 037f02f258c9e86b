"""One Generate call in the router, from admission to its last response, and resuming it when a
decode worker dies: ClientCall.

The servicer (router/service.py) creates a ClientCall for each request it admits, keeps it in
its in-flight map for PDServe.Abort and the client's cancellation, and drains `run()`. The call
owns what its client sees: one TextStream per sequence, the token ids sent per sequence, the
Finish of each sequence that ended before the last, and the Timings merged from its legs. It
also owns the worker side of the request: its legs (router/legs.py: one reservation, prefill and
token stream each), in the order they ran, and the resumes between them. It ends in one of three
ways: `run()` returns the last Finish, returns None because the client left (`cancel()`), or
raises CallFailed, which the servicer maps to the client's gRPC status. A call that fails lets go
of its running leg on the workers before it raises. Logprobs: the first token of a leg's
sequence gets its alternatives (sampling.top_logprobs) from the leg's PrefillResponse, and each
Finish the prompt's logprobs (sampling.prompt_logprobs) from whichever worker ran the prompt.
"""

from __future__ import annotations

import logging
import time
from concurrent import futures

import grpc

from pdserve.protos import tracing
from pdserve.protos.pdserve.v1 import pdserve_pb2, worker_pb2
from pdserve.router import stepping
from pdserve.router.legs import Inflight, Leg, LegFailed, Legs, RouterStatus
from pdserve.router.text import TextStream

log = logging.getLogger(__name__)
# pdserve.proto documents it as SamplingParams.max_tokens' default (the engine's); the router
# may not import the engine's SamplingParams (docs/architecture.md section 2)
DEFAULT_MAX_TOKENS = 16
_REOPEN = object()  # n>1: a decode worker died after tokens were streamed (ClientCall._run_legs)


class CallFailed(Exception):
    """The call ends with `error` (a worker's or the router's status; None: a stream that ended
    without a final event) found at `who`. `deadline_ms` is the client's where the failure may be
    its deadline passing, 0 where the router does not say so."""

    def __init__(self, error: grpc.RpcError | None, who: str, deadline_ms: int = 0):
        super().__init__(who)
        self.error, self.who, self.deadline_ms = error, who, deadline_ms


class ClientCall(Inflight):
    """One client's Generate call (the module docstring). The resume rules:

    A leg's decode worker died when the leg's stream fails (UNAVAILABLE, a stream that ends
    without a final event, a prefill that could not reach the decode worker to abort it, or a
    stream the router cancelled because the pool dropped its worker: router/open_legs.py) and
    neither the client, a PDServe.Abort nor the deadline ended it (`decode_died`). The call then
    lets go of that leg (its workers get an Abort from the router's abort threads), never picks
    that decode worker again, and starts another leg on a different one, with
        prompt   = the client's prompt + every token id already streamed to the client
        sampling = max_tokens (and min_tokens) lowered by the tokens already streamed
    (`resume_sampling`). The prefill runs again; the prefill worker's prefix cache holds the
    prompt, so mostly only the streamed tokens are computed. A call resumes at most
    options.max_resumes times; the next death fails it UNAVAILABLE, saying so. A sequence whose
    max_tokens or max_model_len the dead leg already reached ends with "length" and no new leg.
    The client's stream goes on where it stopped: no token is sent twice, text deltas continue
    from the same TextStream, usage counts every token. Each leg has its own worker-side request
    id, minted by the router, so whatever a dead leg left on a worker (a prefill still running, a
    reservation on a worker that was only unreachable) cannot collide with the next leg.

    n>1: a decode worker that dies before any token was streamed restarts the request as a whole.
    Once tokens were streamed, each sequence still open needs a prompt of its own (the client's
    plus its own tokens): they resume one after another, each alone on a leg with n=1, their
    events under the client's indexes, each sequence's Finish sent as it ends. After a
    PDServe.Abort the sequences not resumed yet end with "abort", without a new leg.

    What differs after a resume, compared with an uninterrupted run:
    - greedy decoding gives the same tokens up to rounding (a prefill recomputes the streamed
      tokens' KV: a near-tie can flip); seeded sampling restarts from a fresh generator of the
      same seed;
    - presence/frequency penalties see the earlier output as prompt, which they ignore (they
      count generated tokens only), so tokens streamed before the resume stop being penalised;
      repetition penalty counts prompt and output alike and is unchanged;
    - the new decode worker checks stop strings only in its own output; the router's TextStream
      sees the whole text and ends the stream itself when a stop string spans the resume point;
    - Timings come from the last leg, except queued and reserved (the first leg's), the prefill's
      (the first leg's when its prefill replied) and first_token (the first token the client
      received).
    """

    def __init__(
        self,
        transport: Legs,
        tokenizer,
        request: pdserve_pb2.GenerateRequest,
        request_id: str,
        prompt: list[int],
        deadline: float,
        queued_ns: int,
    ):
        super().__init__(request_id)
        self.transport = transport  # starts, streams and ends the legs on the workers
        self.options = transport.options
        self.request, self.prompt = request, prompt
        self.deadline, self.queued_ns = deadline, queued_ns  # time.monotonic(), unix ns
        sampling = self.sampling = request.sampling
        self.n = sampling.n if sampling.HasField("n") else 1
        self.texts = [
            TextStream(
                tokenizer,
                prompt,
                sampling.skip_special_tokens if sampling.HasField("skip_special_tokens") else True,
                tuple(sampling.stop),
                sampling.include_stop_str_in_output,
            )
            for _ in range(self.n)
        ]
        self.sent: list[list[int]] = [[] for _ in range(self.n)]  # token ids the client got
        self.legs: list[Leg] = []  # every leg started, in order
        # n>1: each sequence that ended before the last, as a Finish holding only its index and
        # usage (what is read later: the resumes and the request's metrics), not its prompt
        # logprobs
        self.finishes: list[pdserve_pb2.Finish] = []
        self.num_resumes = 0  # decode workers that died under this call
        self.num_moves = 0  # decode workers a role flip moved it off (router/flips.py)
        # the weights' version when it was admitted: Finish.weight_version (router/weights.py)
        self.weight_version = ""

    # ---- from other threads ---------------------------------------------------------------------
    def cancel(self) -> bool:
        """The client went away (the RPC's end, on the server's event loop, which must never
        wait on a worker): the running leg is aborted from the abort threads. False when the
        call had already ended."""
        with self.lock:
            if self.finished:
                return False
            self.cancelled = True
            leg = self.leg
        if leg is not None:
            self.transport.abort_later(leg, cancel_stream=True)
        return True

    def abort(self) -> None:
        """PDServe.Abort: the running leg's decode stream then ends with finish_reason "abort"."""
        with self.lock:
            self.abort_requested = True
        self._abort_running_leg()

    def _abort_running_leg(self, cancel_stream: bool = False) -> None:
        with self.lock:
            leg = self.leg
        if leg is not None:
            self.transport.abort_later(leg, cancel_stream)

    # ---- the call -------------------------------------------------------------------------------
    def run(self):
        """Yields the client's responses but the last and returns the last Finish, or None when
        the client left. Raises CallFailed. With request.return_prompt_token_ids the first
        response carries the prompt's ids (its TokenDelta's, or its Finish's)."""
        responses = self._responses()
        if not self.request.return_prompt_token_ids:
            return (yield from responses)
        try:
            first = next(responses)
            while stepping.is_pause(first):  # to the driver (router/stepping.py)
                yield first
                first = next(responses)
        except StopIteration as stop:  # no token before the end: the last Finish has them
            if stop.value is not None and not stop.value.prompt_token_ids:
                stop.value.prompt_token_ids.extend(self.prompt)
            return stop.value
        event = first.delta if first.HasField("delta") else first.finish
        if not event.prompt_token_ids:
            event.prompt_token_ids.extend(self.prompt)
        yield first
        return (yield from responses)

    def _responses(self):
        """run()'s responses, without the prompt's ids."""
        final = yield from self._run_legs(None)
        if final is _REOPEN:  # each sequence still open, alone on a leg, one after another
            ended = {f.index for f in self.finishes}
            reopened = [i for i in range(self.n) if i not in ended]
            for i in reopened[:-1]:
                final = yield from self._run_legs([i])
                if final is None:
                    return None
                yield self._finish_of(final)
            final = yield from self._run_legs(reopened[-1:])
        if final is None:
            return None
        self.finished = True
        if self.n == 1 and final.finish_reason in ("stop", "length", "repetition"):
            # the decode worker keeps the KV of the prompt and the answer (all but the last
            # token's, never computed): a conversation's next turn may go back there
            # (router/legs.py); a block with that token in it is not expected there
            self.transport.remember(
                self.legs[-1], self.prompt + self.sent[0][:-1], prompt_len=len(self.prompt)
            )
        return self._finish(final)

    def _run_legs(self, seqs: list[int] | None):
        """Runs sequences `seqs` (None: all n on one leg) until they end, on another leg each time
        a decode worker dies. Returns the final event of the sequence that ended last, None when
        the client left, or _REOPEN when n>1 sequences must resume one by one."""
        while True:
            if seqs is None:  # n>1 on one leg: only before any token, so it starts over
                sampling = self.sampling
                streamed = self.sent[0] if self.n == 1 else []
            else:  # one sequence alone, with its own tokens
                sampling = pdserve_pb2.SamplingParams()
                sampling.CopyFrom(self.sampling)
                sampling.n = 1
                streamed = self.sent[seqs[0]]
            leg_sampling = resume_sampling(sampling, len(streamed))
            index = seqs[0] if seqs else 0
            if (
                leg_sampling is None
                or len(self.prompt) + len(streamed) >= self.options.max_model_len
            ):
                # the dead leg had got there
                return worker_pb2.TokenEvent(index=index, finish_reason="length")
            if seqs is not None and self.abort_requested:  # no new leg for an aborted call
                return worker_pb2.TokenEvent(
                    index=index, finish_reason="abort", stop_str="aborted by the router"
                )
            try:
                leg = self.transport.start(
                    self, self.prompt + streamed, leg_sampling, self.deadline, len(self.legs)
                )
            except LegFailed as e:
                self._fail(e.error, e.who)
            if leg is None:
                return None
            self.legs.append(leg)
            final, error = yield from self._with_first_tops(
                leg,
                self.transport.stream(self, leg, self.texts, self.sent, self._finish_of, seqs),
                seqs is not None,
            )
            if self.cancelled:
                return None
            if not decode_died(leg, final, error, self.abort_requested, self.deadline):
                self._check_prefill(leg, final)
                if final is None:
                    self._fail(error, "decode worker", self.request.deadline_ms)
                return final
            if leg.moved:  # a role flip moved it (router/flips.py): not a death
                self.num_moves += 1
            else:
                self.num_resumes += 1
            if self.span is not None:  # the request's trace says where, after how many tokens
                why = leg.lost_why or (
                    error.details() if hasattr(error, "details") else str(error or "ended")
                )
                tracing.event(
                    self.span,
                    "move" if leg.moved else "resume",
                    {
                        "pdserve.decode_worker": self.transport.pool.name(leg.decode),
                        "pdserve.tokens_sent": sum(map(len, self.sent)),
                        "pdserve.why": str(why),
                    },
                )
            self._resume_or_fail(leg, error)
            if seqs is None and self.n > 1 and any(self.sent):
                return _REOPEN

    def _with_first_tops(self, leg: Leg, responses, alone: bool):
        """`responses` (one leg's) with sampling.top_logprobs: each delta's top_logprobs one per
        token, a sequence's first token on this leg (sampled by the prefill worker, whose
        alternatives the decode worker does not have) filled from the leg's PrefillResponse;
        `alone`: the leg runs one client sequence as its sequence 0."""
        if not self.sampling.top_logprobs:
            return (yield from responses)
        started: set[int] = set()  # client indexes whose first token on this leg went out
        try:
            while True:
                try:
                    r = next(responses)
                except StopIteration as stop:
                    return stop.value
                if stepping.is_pause(r):
                    pass
                elif r.HasField("delta") and r.delta.token_ids:
                    d = r.delta
                    while len(d.top_logprobs) < len(d.token_ids):
                        d.top_logprobs.add()
                    if d.index not in started and not d.top_logprobs[0].token_ids:
                        if stepping.on_loop() and not _replied(leg.prefill_future):
                            yield stepping.OFF_LOOP  # waiting for the prefill's reply blocks
                        d.top_logprobs[0].CopyFrom(self._first_top(leg, 0 if alone else d.index))
                    started.add(d.index)
                yield r
        finally:
            responses.close()  # its bookkeeping runs now, not when it is collected

    def _first_top(self, leg: Leg, index: int) -> pdserve_pb2.TopLogprobs:
        """The alternatives of the leg's sequence `index`'s first token, from its prefill worker's
        reply (empty when there is none: the HTTP front then fails the request)."""
        reply = self._prefill_result(leg.prefill_future)
        if reply is None or index >= len(reply.first_token_top_logprobs):
            return pdserve_pb2.TopLogprobs()
        return reply.first_token_top_logprobs[index]

    def _prompt_logprobs(self, final, finish: pdserve_pb2.Finish) -> None:
        """sampling.prompt_logprobs: the client's prompt's logprobs in `finish`, from the worker
        that computed the prompt (the final event of a leg prefilled on its decode worker, else a
        prefill reply; a resumed leg's prompt extends the client's: its head is the client's)."""
        if not self.sampling.HasField("prompt_logprobs"):
            return
        wanted = len(self.prompt) - 1
        sources = [final] + [leg.prefill_reply() for leg in self.legs]
        for src in sources:
            if src is not None and len(src.prompt_logprobs) >= wanted:
                finish.prompt_token_ids.extend(self.prompt)
                finish.prompt_logprobs.extend(src.prompt_logprobs[:wanted])
                finish.prompt_top_logprobs.extend(src.prompt_top_logprobs[:wanted])
                return

    def _resume_or_fail(self, leg: Leg, error) -> None:
        """After `leg`'s decode worker died: returns so the caller starts the next leg, or fails
        the call when no resume is left."""
        self.transport.retire(self, leg)
        why = leg.lost_why or (
            f"{error.code().name}: {error.details()}"
            if error is not None
            else "its stream ended without a final event"
        )
        name = self.transport.pool.name(leg.decode)
        if leg.moved:
            log.info(
                "%s moves from decode worker %s after %d tokens (%s)",
                self.request_id,
                name,
                sum(map(len, self.sent)),
                why,
            )
            return
        if self.num_resumes > self.options.max_resumes:
            self._fail(
                RouterStatus(
                    grpc.StatusCode.UNAVAILABLE,
                    f"decode worker {name} failed ({why}) and request {self.request_id!r} was "
                    f"already resumed {self.num_resumes - 1} times (max_resumes="
                    f"{self.options.max_resumes}); "
                    f"retry the request",
                ),
                "decode worker",
            )
        log.warning(
            "decode worker %s failed for %s after %d tokens (%s); resuming on another",
            name,
            self.request_id,
            sum(map(len, self.sent)),
            why,
        )

    def _check_prefill(self, leg: Leg, final) -> None:
        """Fails the call with the prefill's status when a failed prefill aborted the reservation,
        which ended `final`'s sequence (or the whole stream)."""
        self._prefill_result(leg.prefill_future)
        if (
            leg.prefill_error is not None
            and (final is None or final.finish_reason == "abort")
            and not self.abort_requested
        ):
            self._fail(leg.prefill_error, "prefill worker", self.request.deadline_ms)

    def _fail(self, error, who: str, deadline_ms: int = 0):
        """Lets go of the running leg on its workers and ends the call: raises CallFailed."""
        self.finished = True
        # its decode stream too, once the prefill worker let go: a stream past its deadline
        # stays attached until then (router/decode_streams.py)
        self._abort_running_leg(cancel_stream=True)
        raise CallFailed(error, who, deadline_ms)

    def _prefill_result(self, prefill: futures.Future | None):
        if prefill is None:  # colocated: there is no prefill leg
            return None
        if not prefill.done():
            stepping.off_loop("waiting for a prefill's reply")
        try:
            return prefill.result(timeout=self.options.prefill_result_wait_s)
        except futures.TimeoutError:
            return None

    # ---- Finish ---------------------------------------------------------------------------------
    def _finish_of(self, event) -> pdserve_pb2.GenerateResponse:
        """The response for a sequence that ended while others still run (n>1)."""
        self._check_prefill(self.legs[-1], event)  # as n=1: the call ends with the prefill's status
        finish = self._finish(event)
        self.finishes.append(pdserve_pb2.Finish(index=finish.index, usage=finish.usage))
        return pdserve_pb2.GenerateResponse(request_id=self.request_id, finish=finish)

    def _finish(self, final) -> pdserve_pb2.Finish:
        """The Finish of sequence final.index: usage, stop reason and the Timings of the legs."""
        first, last = self.legs[0], self.legs[-1]
        usage = pdserve_pb2.Usage(
            prompt_tokens=len(self.prompt),
            completion_tokens=len(self.sent[final.index]),
            # the last leg's decode worker's count (a leg that failed sends no final event)
            accepted_prediction_tokens=final.accepted_prediction_tokens,
            rejected_prediction_tokens=final.rejected_prediction_tokens,
        )
        self._cache_hits(first, final, usage)
        finish = pdserve_pb2.Finish(
            index=final.index,
            finish_reason=final.finish_reason,
            usage=usage,
            weight_version=self.weight_version,
        )
        kind = final.WhichOneof("stop_reason")
        if final.finish_reason in ("abort", "error"):
            finish.message = final.stop_str  # the decode worker's reason rides in stop_str
        elif kind == "stop_str":
            finish.stop_str = final.stop_str
        elif kind == "stop_token":
            finish.stop_token = final.stop_token
        timings = finish.timings
        timings.CopyFrom(final.timings)  # the decode worker's: transfer_end, commit, tokens
        timings.queued_unix_ns = self.queued_ns
        timings.reserved_unix_ns = first.reserved_ns
        if len(self.legs) > 1 and self.first_token_ns:
            # the client's first token came from an earlier leg
            timings.first_token_unix_ns = self.first_token_ns
        prefill_leg = first if first.prefill_reply() is not None else last
        prefill_reply = prefill_leg.prefill_reply()
        if prefill_reply is not None:
            timings.prefill_dispatch_unix_ns = prefill_leg.prefill_dispatch_ns
            stamps = prefill_reply.timings
            timings.prefill_arrival_unix_ns = stamps.prefill_arrival_unix_ns
            timings.prefill_start_unix_ns = stamps.prefill_start_unix_ns
            timings.prefill_end_unix_ns = stamps.prefill_end_unix_ns
            timings.transfer_start_unix_ns = stamps.transfer_start_unix_ns
            if prefill_leg is not last or not timings.transfer_end_unix_ns:
                # the decode side's arrival of the last KV frame when it has it, else the
                # prefill side's flush
                timings.transfer_end_unix_ns = stamps.transfer_end_unix_ns
            finish.usage.kv_transfer_bytes = prefill_reply.bytes_sent
        if prefill_leg.prefill is not None:
            timings.prefill_worker = self.transport.pool.name(prefill_leg.prefill)
        if not timings.decode_worker and last.decode is not None:
            timings.decode_worker = self.transport.pool.name(last.decode)
        self._prompt_logprobs(final, finish)
        return finish

    @staticmethod
    def _cache_hits(first: Leg, final, usage: pdserve_pb2.Usage) -> None:
        """Usage's cached tokens, from the leg that ran the prompt: a decode worker that ran it
        itself says on the final event what its prefix cache held (then nothing ran elsewhere);
        else the prefill worker's hits were not computed and the decode worker's (its
        reservation's) not transferred."""
        hits = usage.cache_hits
        if first.local:
            hits.decode_worker = usage.cached_prompt_tokens = final.num_cached_tokens
            return
        hits.decode_worker = first.reservation.num_cached_tokens
        reply = first.prefill_reply()
        if reply is not None:
            hits.prefill_worker = usage.cached_prompt_tokens = reply.num_cached_tokens
            hits.peer = min(reply.peer_fetched_tokens, reply.num_cached_tokens)


def _replied(prefill: futures.Future | None) -> bool:
    """Whether reading the prefill's reply (ClientCall._prefill_result) returns at once."""
    return prefill is None or prefill.done()


def resume_sampling(sampling: pdserve_pb2.SamplingParams, num_sent: int):
    """The client's sampling for a leg that starts after `num_sent` tokens were streamed; None when
    those already used up max_tokens (the sequence is complete)."""
    if num_sent == 0:
        return sampling
    max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    if max_tokens <= num_sent:
        return None
    resumed = pdserve_pb2.SamplingParams()
    resumed.CopyFrom(sampling)
    resumed.max_tokens = max_tokens - num_sent
    if sampling.HasField("min_tokens"):
        resumed.min_tokens = max(0, sampling.min_tokens - num_sent)
    return resumed


def decode_died(
    leg: Leg, final, error: grpc.RpcError | None, ended_by_client: bool, deadline: float
) -> bool:
    """Whether a leg's stream ended because its decode worker (or the link to it) failed, rather
    than by the client, an abort or the deadline."""
    if final is not None or ended_by_client or time.monotonic() >= deadline:
        return False
    if error is None:  # the worker closed the stream without a final event
        return True
    return error.code() == grpc.StatusCode.UNAVAILABLE or leg.decode_lost
