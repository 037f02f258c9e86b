"""Closed-loop multi-turn chat sessions against the public gRPC API (`pdserve.v1.PDServe`): the load
that shows prefix reuse, since each turn's prompt holds the answer the model actually gave.

    sessions = option_sessions(n=6, turns=5, message_len=256, answer_len=128, doc_len=1024)
    card = loadgen.model_card("127.0.0.1:50051")
    sessions, cut = fit_sessions(sessions, card.max_model_len, cap=False)   # refuses what won't fit
    prompts = build_session_prompts(sessions, card.vocab_size, seed=0)
    records, duration_s = run_sessions("127.0.0.1:50051", sessions, prompts, concurrency=2)

A session is T turns. Turn 1's prompt is an optional document of D tokens and a user message of U
tokens; turn k+1's prompt is turn k's prompt, the token ids turn k's stream returned (its deltas,
collected as they arrive) and a new user message. Every part is random token ids from the model
card's vocabulary, deterministic from the seed, drawn as workload.build_prompts draws them (a
document shared by all sessions is one prefix block of that function, so every session's turn 1
starts with the same tokens; a per-session document is that session's own). Each turn is sent as
loadgen sends a request (make_request, _send): greedy, max_tokens = the answer length, ignore_eos,
so an answer is exactly that long and every prompt's length is known before the run.

The loop is closed: a session sends its next turn only after the previous one ended and a think
time passed (fixed, or exponential with that mean, from the seed). Sessions start all at once, or
one every 1/session_rate seconds; at most `concurrency` are in flight, so concurrency 1 runs them
one after another. A turn that fails ends its session (the next turn would need its answer); the
turns left are counted as skipped. Each turn is a metrics.SessionRecord: the request's record plus
the session, the turn index, the reusable prompt tokens (the previous turn's prompt and answer:
what a cache could hold) and the cached-token counters of Finish.usage (`cached_prompt_tokens`,
and `cache_hits` by source).

Shapes come from options (option_sessions) or from a Mooncake trace's hash-id chains
(from_trace, `pdserve bench --sessions-from mooncake`; its docstring says how turns are found).

Every prompt must fit the model's max_model_len with its answer: fit_sessions refuses a run that
does not (options: a clear error naming the turn and what to lower), or cuts each session before
its first turn that does not fit (trace shapes, cap=True), so nothing is sent that the router
would refuse.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from dataclasses import dataclass

from pdserve.tuning import workload
from pdserve.tuning.metrics import SessionRecord

THINK_DISTS = ("fixed", "exponential")
SHARED_DOC_BLOCK = 0  # the block id of a document all sessions share (workload.build_prompts)


class SessionsError(ValueError):
    """Session shapes or options that cannot run: the message says what to change."""


@dataclass(frozen=True)
class Turn:
    message_len: int  # new user tokens (turn 1: after the document)
    answer_len: int  # max_tokens; ignore_eos makes it the answer's length


@dataclass(frozen=True)
class Session:
    index: int
    turns: tuple[Turn, ...]
    doc_len: int = 0  # document tokens before turn 1's message
    shared_doc: bool = False  # one document for all sessions (else this session's own)
    block_ids: tuple[int, ...] = ()  # trace shapes: turn 1's prefix blocks (mooncake hash_ids)
    block_tokens: int = 0  # tokens per block after scaling

    def prompt_lens(self) -> list[int]:
        """Each turn's prompt length, with every earlier answer as long as asked."""
        out = [self.doc_len + self.turns[0].message_len]
        for prev, turn in zip(self.turns, self.turns[1:]):
            out.append(out[-1] + prev.answer_len + turn.message_len)
        return out


@dataclass
class SessionPrompts:
    """The token ids a session sends besides the answers: turn 1's prompt, then each later turn's
    new message."""

    first: list[int]
    messages: list[list[int]]


def option_sessions(
    n: int,
    turns: int,
    message_len: int,
    answer_len: int,
    doc_len: int = 0,
    shared_doc: bool = False,
) -> list[Session]:
    """`n` sessions of the same shape, from `pdserve bench --sessions` options."""
    for name, value, low in (
        ("--sessions", n, 1),
        ("--turns", turns, 1),
        ("--message-len", message_len, 1),
        ("--answer-len", answer_len, 1),
        ("--doc-len", doc_len, 0),
    ):
        if value < low:
            raise SessionsError(f"{name} must be >= {low}, got {value}")
    if shared_doc and not doc_len:
        raise SessionsError("--shared-doc needs a document: give --doc-len N (N >= 1)")
    shape = tuple(Turn(message_len, answer_len) for _ in range(turns))
    return [Session(i, shape, doc_len, shared_doc) for i in range(n)]


def trace_chains(requests: list[workload.RequestSpec]) -> list[list[int]]:
    """The conversations of a Mooncake trace's requests (in time order, lengths unscaled): chains
    of request indices, as the module docstring says, in the order of their first request."""
    chains: list[list[int]] = []
    # (key length, key's last id) -> chains whose last request's ids minus its last one end there
    tails: dict[tuple[int, int], list[int]] = {}

    def key(i: int) -> tuple[int, ...]:
        return requests[i].block_ids[:-1]

    for j, r in enumerate(requests):
        ids, found = r.block_ids, None
        for m in range(len(ids), 0, -1):
            fits = [
                c
                for c in tails.get((m, ids[m - 1]), ())
                if key(chains[c][-1]) == ids[:m]
                and r.prompt_len
                >= requests[chains[c][-1]].prompt_len + requests[chains[c][-1]].output_len
            ]
            if fits:
                found = max(fits, key=lambda c: chains[c][-1])
                break
        if found is None:
            chains.append([j])
            found = len(chains) - 1
        else:
            old = key(chains[found][-1])
            tails[(len(old), old[-1])].remove(found)
            chains[found].append(j)
        new = key(j)
        if new:
            tails.setdefault((len(new), new[-1]), []).append(found)
    return chains


def from_trace(
    name_or_path: str,
    *,
    scale: float = 1.0,
    max_message: int | None = None,
    max_answer: int | None = None,
    max_turns: int | None = None,
    max_sessions: int | None = None,
) -> list[Session]:
    """Session shapes from a Mooncake trace's hash-id chains ("mooncake" is the shipped
    mooncake_synthetic).

    A Mooncake trace's `hash_ids` name 512-token prefix blocks in hash chains, so equal leading ids
    are a shared prefix. Reading the requests in time order, a request continues an earlier one's
    conversation when the earlier request's ids, all but its last, lead its own ids and its prompt
    holds at least the earlier prompt and answer (input_length >= the earlier input_length +
    output_length). The last block is left out because it is a partial block: once the answer is
    appended its tokens, and so its hash, change; no request of the shipped trace extends another
    one's ids in full. A request continues at most one conversation, the one with the longest such
    prefix, then the latest; each conversation is a chain. Chains of two requests or more are the
    sessions, in the order of their first request: turn 1 is the first request (its prompt built
    from its blocks, so sessions that share a document share its tokens), turn k+1's new message is
    the growth input_length(k+1) - input_length(k) - output_length(k), each answer that request's
    output_length; lengths are multiplied by `scale` (blocks become round(512 * scale) tokens),
    then capped by max_message and max_answer, at least 1 token each. The trace gives shapes only:
    start times and think times come from the options (the trace's gaps between turns are minutes).
    """
    if not scale > 0:
        raise SessionsError(f"--scale must be > 0, got {scale}")
    for name, cap in (
        ("--max-message", max_message),
        ("--max-answer", max_answer),
        ("--turns", max_turns),
        ("--sessions", max_sessions),
    ):
        if cap is not None and cap < 1:
            raise SessionsError(f"{name} must be >= 1, got {cap}")
    name = "mooncake_synthetic" if name_or_path == "mooncake" else name_or_path
    requests = workload.load_trace(name)  # unscaled: the growth is computed on the trace's own
    if not any(r.block_ids for r in requests):
        raise SessionsError(
            f"trace {name_or_path} has no hash_ids: sessions come from a Mooncake-format .jsonl"
        )

    def scaled(n: int, cap: int | None) -> int:
        n = max(1, round(n * scale))
        return min(n, cap) if cap else n

    block_tokens = max(1, round(workload.MOONCAKE_BLOCK_TOKENS * scale))
    sessions: list[Session] = []
    for chain in trace_chains(requests):
        if len(chain) < 2:
            continue
        if max_sessions is not None and len(sessions) == max_sessions:
            break
        chain = chain[:max_turns] if max_turns else chain
        first = requests[chain[0]]
        turns = [Turn(scaled(first.prompt_len, max_message), scaled(first.output_len, max_answer))]
        for i, j in zip(chain, chain[1:]):
            a, b = requests[i], requests[j]
            grown = b.prompt_len - a.prompt_len - a.output_len
            turns.append(Turn(scaled(grown, max_message), scaled(b.output_len, max_answer)))
        sessions.append(
            Session(len(sessions), tuple(turns), 0, False, first.block_ids, block_tokens)
        )
    if not sessions:
        raise SessionsError(f"trace {name_or_path} has no multi-turn conversation in its hash_ids")
    return sessions


def fit_sessions(
    sessions: list[Session], max_model_len: int, cap: bool = False
) -> tuple[list[Session], dict]:
    """Sessions whose every prompt and answer fit `max_model_len`. cap=False: raises SessionsError
    when one does not (naming the turn and how many turns would fit); cap=True: cuts each session
    before its first turn that does not fit and drops a session whose turn 1 does not, raising
    only when none is left. Returns (sessions, {"turns_cut", "sessions_dropped"})."""
    kept, turns_cut, dropped = [], 0, 0
    for s in sessions:
        fit = [p + t.answer_len <= max_model_len for p, t in zip(s.prompt_lens(), s.turns)]
        n = fit.index(False) if False in fit else len(fit)
        if n == len(s.turns):
            kept.append(s)
            continue
        if not cap:
            need = s.prompt_lens()[n] + s.turns[n].answer_len
            raise SessionsError(
                f"session {s.index}'s turn {n + 1} would need {need} tokens (prompt "
                f"{s.prompt_lens()[n]} with every earlier answer, + {s.turns[n].answer_len} "
                f"answer) > max_model_len {max_model_len}: "
                + (
                    f"at most {n} turns fit; lower --turns, --message-len, --answer-len or "
                    f"--doc-len"
                    if n
                    else "even turn 1 does not fit; lower --doc-len or --message-len"
                )
            )
        turns_cut += len(s.turns) - n
        if n == 0:
            dropped += 1
        else:
            kept.append(Session(s.index, s.turns[:n], s.doc_len, s.shared_doc, s.block_ids,
                                s.block_tokens))  # fmt: skip
    if not kept:
        raise SessionsError(
            f"no session's turn 1 fits max_model_len {max_model_len}: lower --scale or cap it "
            f"with --max-message and --max-answer"
        )
    return kept, dict(turns_cut=turns_cut, sessions_dropped=dropped)


def _random_ids(n: int, vocab_size: int, seed: str) -> list[int]:
    """n random token ids drawn as workload.build_prompts draws a unique prompt."""
    return workload.build_prompts([workload.RequestSpec(0.0, n, 1)], vocab_size, seed)[0]


def build_session_prompts(
    sessions: list[Session], vocab_size: int, seed: int = 0
) -> list[SessionPrompts]:
    """Every session's turn-1 prompt (document and message; trace shapes: its blocks, shared by
    id across sessions) and later messages, deterministic from `seed`."""
    firsts = []
    for s in sessions:
        if s.block_ids:
            firsts.append(
                workload.RequestSpec(0.0, s.turns[0].message_len, 1, s.block_ids, s.block_tokens)
            )
        elif s.shared_doc:
            n = s.doc_len + s.turns[0].message_len
            firsts.append(workload.RequestSpec(0.0, n, 1, (SHARED_DOC_BLOCK,), s.doc_len))
        else:
            firsts.append(workload.RequestSpec(0.0, s.doc_len + s.turns[0].message_len, 1))
    first_ids = workload.build_prompts(firsts, vocab_size, seed)
    return [
        SessionPrompts(
            first,
            [
                _random_ids(t.message_len, vocab_size, f"{seed}/session/{s.index}/turn/{k}")
                for k, t in enumerate(s.turns[1:], start=2)
            ],
        )
        for s, first in zip(sessions, first_ids)
    ]


def cache_hits(finish) -> dict[str, int] | None:
    """Finish.usage.cache_hits as {source: tokens}, or None when the server did not set it."""
    if finish is None:
        return None
    usage = finish.usage
    if not usage.HasField("cache_hits"):
        return None
    hits = usage.cache_hits
    return {f.name: int(getattr(hits, f.name)) for f in hits.DESCRIPTOR.fields}


def run_sessions(
    address: str, sessions, prompts, *, tls=None, **kwargs
) -> tuple[list[SessionRecord], float]:
    """drive() over a channel to the router at `address` (`tls`: the --tls-* options,
    loadgen.open_channel)."""
    from pdserve.protos.pdserve.v1 import pdserve_pb2_grpc
    from pdserve.tuning import loadgen

    with loadgen.open_channel(address, tls) as channel:
        return drive(pdserve_pb2_grpc.PDServeStub(channel), sessions, prompts, **kwargs)


def drive(
    stub,
    sessions: list[Session],
    prompts: list[SessionPrompts],
    *,
    concurrency: int | None = None,
    session_rate: float | None = None,
    think_time_s: float = 0.1,
    think_dist: str = "fixed",
    seed: int = 0,
    model: str = "",
    request_timeout_s: float | None = 600.0,
    progress: bool = False,
    desc: str = "turns",
) -> tuple[list[SessionRecord], float]:
    """Runs every session on `stub` (a PDServe stub); returns the records in (session, turn)
    order and the run's duration, from the first send to the end of the last turn.
    concurrency None: every session in flight; session_rate None: all start at once."""
    from tqdm import tqdm

    if len(prompts) != len(sessions):
        raise ValueError(f"{len(sessions)} sessions but {len(prompts)} prompts")
    if concurrency is not None and concurrency < 1:
        raise SessionsError(f"--concurrency must be >= 1, got {concurrency}")
    if session_rate is not None and not session_rate > 0:
        raise SessionsError(f"--session-rate must be > 0 sessions/s, got {session_rate}")
    if think_time_s < 0 or think_dist not in THINK_DISTS:
        raise SessionsError(
            f"think time must be >= 0 s and one of {', '.join(THINK_DISTS)}, got "
            f"{think_time_s:g} s {think_dist}"
        )
    slots = threading.BoundedSemaphore(concurrency or max(1, len(sessions)))
    bar = tqdm(
        total=sum(len(s.turns) for s in sessions),
        desc=desc,
        unit="turn",
        disable=not progress,
        dynamic_ncols=True,
    )
    lock = threading.Lock()
    order = itertools.count()
    per_session: list[list[SessionRecord]] = [[] for _ in sessions]

    def tick(n: int = 1) -> None:
        with lock:
            bar.update(n)

    def run_one(pos: int, t0: float) -> None:
        try:
            _session(
                stub, sessions[pos], prompts[pos], per_session[pos], t0, order, lock, tick,
                think_time_s, think_dist, seed, model, request_timeout_s,
            )  # fmt: skip
        finally:
            slots.release()

    threads = []
    t0 = time.perf_counter()
    for pos in range(len(sessions)):
        if session_rate is not None:
            delay = t0 + pos / session_rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        slots.acquire()
        thread = threading.Thread(
            target=run_one, args=(pos, t0), name=f"session-{sessions[pos].index}", daemon=True
        )
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    duration_s = time.perf_counter() - t0
    bar.close()
    return [r for records in per_session for r in records], duration_s


def _session(
    stub, s: Session, parts: SessionPrompts, out: list, t0: float, order, lock, tick,
    think_time_s: float, think_dist: str, seed: int, model: str, timeout_s: float | None,
) -> None:  # fmt: skip
    """One session's turns, each after the previous one ended and a think time passed."""
    from pdserve.tuning import loadgen

    if len(parts.messages) != len(s.turns) - 1:
        raise ValueError(
            f"session {s.index}: {len(s.turns)} turns but {len(parts.messages)} messages"
        )
    rng = random.Random(f"{seed}/think/{s.index}")
    prompt: list[int] = list(parts.first)
    answer: list[int] = []
    due = time.perf_counter()
    for k, turn in enumerate(s.turns, start=1):
        reusable = 0
        if k > 1:
            reusable = len(prompt) + len(answer)
            prompt = prompt + answer + parts.messages[k - 2]
            think = think_time_s
            if think_dist == "exponential" and think_time_s > 0:
                think = rng.expovariate(1 / think_time_s)
            due = time.perf_counter() + think
            time.sleep(think)
        with lock:
            index = next(order)
        rec = SessionRecord(
            index, due - t0, len(prompt), turn.answer_len, session=s.index, turn=k,
            reusable_prompt_tokens=reusable, prompt_ids=prompt,
        )  # fmt: skip
        out.append(rec)
        answer = []
        spec = workload.RequestSpec(0.0, len(prompt), turn.answer_len)
        msg = loadgen.make_request(spec, prompt, model)
        finish = loadgen._send(stub, msg, rec, t0, timeout_s, tick, answer)
        rec.answer_ids = answer
        rec.cache_hits = cache_hits(finish)
        if not rec.ok:
            tick(len(s.turns) - k)  # the turns this session will not send
            return


def planned_turns(sessions: list[Session]) -> dict[int, int]:
    """turn index -> how many sessions have that turn (summarize_turns' `planned`)."""
    out: dict[int, int] = {}
    for s in sessions:
        for k in range(1, len(s.turns) + 1):
            out[k] = out.get(k, 0) + 1
    return out


def shapes_json(sessions: list[Session]) -> list[dict]:
    """The sessions' shapes for a result file: lengths per turn, prompt lengths, document."""
    return [
        dict(
            session=s.index,
            doc_len=s.doc_len,
            shared_doc=s.shared_doc,
            message_lens=[t.message_len for t in s.turns],
            answer_lens=[t.answer_len for t in s.turns],
            prompt_lens=s.prompt_lens(),
        )
        for s in sessions
    ]
