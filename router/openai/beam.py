"""use_beam_search on /v1/completions and /v1/chat/completions: vLLM's beam search
(engine/beam_search.py runs it) driven through the router's own gRPC Generate, n the beam width.

Each step is one Generate call per live beam (every call goes through the router's admission,
routing and retries as any other): one token (max_tokens 1) with its top logprobs, the 2 x n most
likely (more where the body's logprobs ask for more alternatives), at the body's temperature (unset:
the model's default, as vLLM's), its other sampling fields at their neutral values (so the
model's generation_config.json defaults shape nothing). The first step sends the body's own
prompt (text, token ids, or the chat, rendered by the router) and learns its token ids; each later
step sends a beam's whole token list, so the prefix cache computes only its last block. At most
max_tokens steps (unset: 16 for a completion, up to the context for a chat, as without beam
search; past the context: a 400 naming the field), at most n beams a step, and every prompt of
a batch searched at once: at most MAX_N calls in flight. A client that disconnects stops the
search: its calls are cancelled, which the router turns into aborts.

The answer is each prompt's best n sequences, best first, as n choices (choice i * n + j: prompt
i's j-th best), written by the front's own response code (responses/whole.py, stream.py) from the
GenerateResponses a finished call would have sent (`_Answered`): so echo, logprobs, return_token_ids,
a chat's tool calls and reasoning split, the `pdserve` extension and stream_options read as
without beam search. As vLLM's: a stream sends everything once the search has ended; a choice's
tokens leave the end-of-sequence token out unless include_stop_str_in_output, its finish_reason is
"stop" (stop_reason the end-of-sequence id) or "length"; the usage counts each prompt's tokens
once and every choice's tokens (n sequences' worth). router/openai/protocol.py refuses, with a 400
naming it, every field a beam search cannot apply (BEAM_NEUTRAL).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc
import grpc.aio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.engine.beam_search import BeamSearch, BeamSearchParams, run_async
from pdserve.protos.limits import MAX_LOGPROBS
from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.call import DEFAULT_MAX_TOKENS
from pdserve.router.openai.errors import ApiError
from pdserve.router.openai.generate import id_headers, is_large, name_client_field, request_id_of
from pdserve.router.openai.protocol import name_field
from pdserve.router.openai.responses.parts import finish_reason
from pdserve.router.openai.responses.reasoning import Reading, reading_of
from pdserve.router.openai.responses.stream import rest, stream
from pdserve.router.openai.responses.whole import whole_response
from pdserve.router.openai.state import state_of

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class _Step:
    """One call's answer: the candidates of the next token (the 2 x n most likely and the
    sampled one), `record` (every alternative the call gave, most likely first, and the sampled
    token: what a choice's logprobs are read from), and its Finish."""

    candidates: dict[int, float]
    record: dict[int, float]
    finish: pdserve_pb2.Finish
    prompt_ids: list[int]


@dataclass
class _Prompt:
    """A prompt's search and what its answer needs from its first call."""

    index: int
    gen: pdserve_pb2.GenerateRequest  # the body's own request (its model, priority)
    search: BeamSearch
    first: pdserve_pb2.Finish
    metadata: tuple  # the first call's initial metadata (prompt tokens, a chat's reading)


async def beam_generate(request: Request, gens: list, metadata, body, chat: bool) -> Response:
    """The response to `body` (use_beam_search) whose prompts' GenerateRequests are `gens`, as
    router/openai/generate.py's `generate` answers one without beam search."""
    front = state_of(request)
    ids = request_id_of(request, body)
    search = asyncio.ensure_future(_search(front, gens, metadata, body, ids.router))
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        done, _ = await asyncio.wait({search, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if search not in done:  # the client left: the search stops, its calls cancelled
            return Response(status_code=499)
        try:
            call = search.result()
        except ApiError as e:  # a refusal of something the body set: name the body's field
            name_field(e, body)
            name_client_field(e, body, chat)
            raise
    finally:
        watcher.cancel()
        search.cancel()
    model_id = getattr(body, "model", None) or front.settings.model_id
    text_of = front.ids_of if getattr(body, "return_tokens_as_token_ids", None) else front.text_of
    first = await call.read()
    if body.stream:
        args = (call, first, body, chat, model_id, ids.router, text_of)
        return StreamingResponse(
            stream(*args, public_id=ids.public),
            media_type="text/event-stream",
            headers={**_SSE_HEADERS, **id_headers(ids.public)},
        )
    responses = [first] + [r async for r in rest(call)]
    reading = await reading_of(call) if chat else Reading()
    args = (responses, body, chat, model_id, ids.router, text_of, reading, True)
    if is_large(responses, body):
        out = await asyncio.to_thread(whole_response, *args)
    else:
        out = whole_response(*args)
    out["id"] = f"chatcmpl-{ids.public}" if chat else f"cmpl-{ids.public}"
    return JSONResponse(out, headers=id_headers(ids.public))


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _search(front, gens: list, metadata, body, request_id: str) -> _Answered:
    """Every prompt's search to its end; its answer as a finished call's responses."""
    n = body.n
    sampling = step_sampling(body, min(MAX_LOGPROBS, max(2 * n, body.num_top())))
    firsts = await _together(
        _one_token(front, _first_gen(gen, sampling), metadata, f"{request_id}-{p}-0", 2 * n)
        for p, gen in enumerate(gens)
    )
    eos = getattr(front.settings.tokenizer, "eos_token_id", None)
    prompts = []
    for p, (gen, (step, md)) in enumerate(zip(gens, firsts)):
        if step is None or not step.prompt_ids:
            raise ApiError(
                500, "the router answered a beam's first step without a token", "server_error"
            )
        params = BeamSearchParams(
            beam_width=n,
            max_tokens=_steps(front, body, len(step.prompt_ids)),
            ignore_eos=bool(body.ignore_eos),
            temperature=float(1.0 if body.temperature is None else body.temperature),
            length_penalty=float(body.length_penalty),
            include_stop_str_in_output=bool(body.include_stop_str_in_output),
        )
        search = BeamSearch(step.prompt_ids, params, eos, context=p)
        search.advance([step.candidates], [step.record])
        prompts.append(_Prompt(p, gen, search, step.finish, tuple(md or ())))
    latest = [p.first for p in prompts]  # each prompt's latest Finish (its weight version)

    async def scorer(owners: list[BeamSearch], tokens: list[list[int]]) -> list:
        calls = [
            _one_token(
                front,
                _next_gen(prompts[search.context].gen, ids, sampling),
                metadata,
                f"{request_id}-{search.context}-{search.steps}-{k}",
                2 * n,
            )
            for k, (search, ids) in enumerate(zip(owners, tokens))
        ]
        out = []
        for search, (step, _) in zip(owners, await _together(calls)):
            if step is not None:
                latest[search.context] = step.finish
            out.append(None if step is None else (step.candidates, step.record))
        return out

    await run_async([p.search for p in prompts], scorer)
    responses = []
    for p in prompts:  # off the event loop: up to MAX_N sequences of a context's tokens to decode
        responses += await asyncio.to_thread(_answer, front, body, p, latest[p.index])
    return _Answered(responses, prompts[0].metadata, [p.search.prompt_len for p in prompts])


def step_sampling(body, top: int) -> pdserve_pb2.SamplingParams:
    """A step's sampling: one token with its `top` most likely, the body's temperature, seed and
    cache salt, every other field neutral (so the model's defaults, which the router fills in
    where a field is unset, shape nothing either; vLLM's step sets only the temperature)."""
    s = pdserve_pb2.SamplingParams(
        max_tokens=1,
        logprobs=True,
        top_logprobs=top,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
    )
    if body.temperature is not None:
        s.temperature = body.temperature
    if body.seed is not None:
        s.seed = body.seed
    if body.cache_salt is not None:
        s.cache_salt = body.cache_salt
    return s


def _first_gen(gen, sampling) -> pdserve_pb2.GenerateRequest:
    """The first step's request: the body's prompt as its own request sends it (truncated, a
    chat rendered by the router), one token, and its token ids back."""
    first = pdserve_pb2.GenerateRequest()
    first.CopyFrom(gen)
    first.sampling.CopyFrom(sampling)
    first.ClearField("prediction")  # (speed alone: one token speculates on nothing)
    first.return_prompt_token_ids = True
    first.max_tokens_up_to_context = False
    return first


def _next_gen(gen, ids: list[int], sampling) -> pdserve_pb2.GenerateRequest:
    """A later step's request: the beam's whole token list (the prompt as the first step ran
    it, and the beam's tokens), under the body's model and priority."""
    nxt = pdserve_pb2.GenerateRequest(model=gen.model, sampling=sampling, priority=gen.priority)
    nxt.token_ids.ids.extend(ids)
    return nxt


def _steps(front, body, prompt_len: int) -> int:
    """The search's steps: the body's max_tokens (unset: a completion's 16, a chat's up to the
    context, and never past it, as without beam search); an ApiError 400 naming the field where
    it does not fit beside the prompt."""
    limit = front.settings.max_model_len
    room = max(limit - prompt_len, 1) if limit else None
    asked = body.max_new_tokens()
    if asked is None:
        if room is None:
            return DEFAULT_MAX_TOKENS
        return (
            room if getattr(body, "messages", None) is not None else min(DEFAULT_MAX_TOKENS, room)
        )
    if room is not None and asked > room:
        field = "max_tokens"
        if getattr(body, "max_completion_tokens", None) is not None:
            field = "max_completion_tokens"
        raise ApiError(
            400,
            f"{field}={asked} with the prompt's {prompt_len} tokens is more than "
            f"max_model_len={limit} holds: {field} can be at most {room}",
            param=field,
            code="context_length_exceeded",
        )
    return asked


async def _together(coros):
    """The results of `coros` run at once; the first failure cancels the others and is raised,
    as a cancellation of this cancels them all."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


async def _one_token(front, gen, metadata, request_id: str, width: int):
    """One step's call: (its _Step, None where no token came; the call's initial metadata).
    The candidates are the `width` most likely tokens and the sampled one. A failed or aborted
    call raises its ApiError."""
    gen.request_id = request_id
    front.check_request_size(gen)
    call = front.stub.Generate(gen, metadata=metadata)
    tokens, logprobs, tops, prompt_ids, finish = [], [], [], [], None
    try:
        while (msg := await call.read()) is not grpc.aio.EOF:
            if msg.HasField("delta"):
                d = msg.delta
                tokens += d.token_ids
                logprobs += d.logprobs
                tops += d.top_logprobs
                prompt_ids = prompt_ids or list(d.prompt_token_ids)
            elif msg.HasField("finish"):
                finish = msg.finish
                prompt_ids = prompt_ids or list(finish.prompt_token_ids)
        md = await call.initial_metadata()
    except grpc.RpcError as e:
        raise ApiError.from_grpc(e) from None
    finally:
        call.cancel()
    if finish is None:
        raise ApiError(500, "the router ended a beam's call without a Finish", "server_error")
    finish_reason(finish)  # an aborted or failed call fails the search (its ApiError)
    if not tokens:
        return None, md
    if not logprobs or not tops:
        raise ApiError(500, "the router answered a beam's token without logprobs", "server_error")
    sampled, logprob, top = tokens[0], logprobs[0], tops[0]
    # vLLM's order: the sampled token, then the most likely ones (a tie keeps this order)
    candidates = {sampled: logprob}
    for token, value in zip(top.token_ids[:width], top.logprobs[:width]):
        candidates.setdefault(token, value)
    record = dict(zip(top.token_ids, top.logprobs))
    record.setdefault(sampled, logprob)
    return _Step(candidates, record, finish, prompt_ids), md


class _Answered:
    """A finished Generate call as the front's response code reads one: the search's
    GenerateResponses, the first call's initial metadata, each prompt's token count."""

    def __init__(self, responses: list, metadata: tuple, prompt_counts: list[int]):
        self._left, self._metadata, self._counts = list(responses), metadata, prompt_counts

    async def read(self):
        return self._left.pop(0) if self._left else grpc.aio.EOF

    async def initial_metadata(self):
        return self._metadata

    async def prompt_counts(self) -> list[int]:
        return list(self._counts)

    def cancel(self) -> None:
        pass


def _answer(front, body, prompt: _Prompt, last: pdserve_pb2.Finish) -> list:
    """The GenerateResponses of a prompt's best sequences (choice prompt * n + j): each one's
    tokens (the end-of-sequence token left out unless include_stop_str_in_output) with their text
    and, where the body asks, their logprobs and alternatives, then its Finish: "stop" with the
    end-of-sequence id as stop_token (vLLM's stop_reason) or "length", the prompt's usage of the
    first call (its cache hits) with the prompt's and this sequence's token counts, the first
    call's timings and the last call's weight version."""
    search, n, k = prompt.search, body.n, body.num_top()
    sampling = prompt.gen.sampling
    skip = sampling.skip_special_tokens if sampling.HasField("skip_special_tokens") else True
    tok = front.settings.tokenizer
    out = []
    for j, seq in enumerate(search.best()):
        index = prompt.index * n + j
        ids, records = seq.tokens[search.prompt_len :], seq.logprobs
        if seq.finish_reason == "stop" and not body.include_stop_str_in_output:
            ids, records = ids[:-1], records[:-1]
        text = tok.decode(ids, skip_special_tokens=skip) if ids else ""
        delta = pdserve_pb2.TokenDelta(index=index, token_ids=ids, text=text)
        if body.wants_logprobs:
            delta.logprobs.extend(rec[t] for t, rec in zip(ids, records))
            for rec in records if k else ():
                best = list(rec.items())[:k]
                delta.top_logprobs.add(
                    token_ids=[t for t, _ in best], logprobs=[v for _, v in best]
                )
        if j == 0 and body.return_token_ids:
            delta.prompt_token_ids.extend(seq.tokens[: search.prompt_len])
        finish = pdserve_pb2.Finish(index=index, finish_reason=seq.finish_reason)
        if seq.finish_reason == "stop" and search.eos_token_id is not None:
            finish.stop_token = search.eos_token_id
        finish.usage.CopyFrom(prompt.first.usage)
        finish.usage.prompt_tokens = search.prompt_len
        finish.usage.completion_tokens = len(ids)
        finish.timings.CopyFrom(prompt.first.timings)
        finish.weight_version = last.weight_version
        out.append(pdserve_pb2.GenerateResponse(delta=delta))
        out.append(pdserve_pb2.GenerateResponse(finish=finish))
    return out
