"""The public PDServe gRPC service: Generate, Embed, Abort, ListModels.

Generate checks every field before any work (protos/limits.py, router/text.py: sizes, counts,
and numbers a wrapped -1 would make enormous), maps its `model` to the base model or a LoRA
adapter (router/lora.py; another name is NOT_FOUND), tokenizes it, gives the sampling fields the
client left unset the model's defaults (its generation_config.json, as vLLM's server does:
`with_model_defaults`), refuses a prompt plus max_tokens past
max_model_len (`fit_to_context`), refuses it UNAVAILABLE when a role has no worker, admits it
(router/admission.py: at most max_inflight run at once, more wait in a bounded queue, max_queued
of them for at most max_queue_wait_s; a request_id not already in flight on the same connection),
sends the prompt's token count in its initial metadata (PROMPT_TOKENS_KEY: the HTTP front's
continuous usage) and hands it to a ClientCall (router/call.py), which runs it on the workers,
resumes it when a decode worker dies (the resume rules: router/call.py) and yields its responses.
The servicer maps how the call ended to the client's gRPC status and the router's metrics.
Generate and Embed are coroutines on the server's event loop (router/grpc_loop.py): their
blocking code runs on its thread pool, and a Generate call's generator on the loop itself while
it only streams tokens (router/stepping.py). The client leaving and PDServe.Abort only mark the
call: the worker Abort calls run on the router's abort threads, never on the loop, which must
never wait on a worker (it would stall every call, health checks and heartbeats included).

Priority (GenerateRequest.priority, vLLM's): refused unless the router's scheduling_policy is
"priority" (`check_priority`); then the call's place in the admission queue, and it travels with
the call to the decode queue and both workers' engines (router/legs.py). A Batch API line's call
(router/admission.py BATCH_METADATA_KEY) waits behind every interactive call in the admission
queue, and travels on at `batch_priority`, past every priority an interactive call is sent with,
so that the decode queue and the engines also take interactive work first, under either policy.
Within a class the admission queue shares the slots between tenants (`flow_of`: a hash of the
client's API key, then its x-gateway-inference-fairness-id entry), fewest running first.

Embed (embeddings): the same checks and admission as Generate, then one PrefillWorker.Embed call
with every input (DecodeWorker.Embed on a colocated deployment's worker), retried once on another
worker when the first is unavailable; no reservation, no decode worker in a disaggregated one.
Its `model` maps to the base model or a LoRA adapter as Generate's does, and every input runs
under that adapter on the worker (WorkerEmbedRequest.lora_name), picked adapter-aware as a
prefill is. Its truncate_prompt_tokens keeps each input's first k tokens (`first_tokens`), as
vLLM truncates a pooling model's inputs, where Generate keeps a prompt's last k.

Ids: the client's request_id is only a label for its own responses and its own Abort calls, which
find requests started on the same connection only (another client cannot abort them), and
only once admitted (a queued call leaves the queue when its RPC is cancelled). The workers
see ids the router mints (router/legs.py), so nothing a client chooses reaches a worker.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time
import uuid
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from pdserve.engine.tokenizer import reasoning_tags
from pdserve.planner.local_prefill import LocalPrefill
from pdserve.protos import tracing
from pdserve.protos.convert import unix_ns
from pdserve.protos.limits import (
    MAX_IMAGES,
    Refusal,
    check_context,
    check_id,
    check_sampling,
    invalid,
)
from pdserve.protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc, worker_pb2
from pdserve.protos.security import API_KEY_METADATA_KEY, bearer_token
from pdserve.router.admission import (
    ADMITTED,
    BATCH_METADATA_KEY,
    CANCELLED,
    DEADLINE,
    FAIRNESS_ID_KEY,
    MAX_FAIRNESS_ID_CHARS,
    SHED,
    Admission,
    QueueFull,
    Ticket,
)
from pdserve.router.call import DEFAULT_MAX_TOKENS, CallFailed, ClientCall
from pdserve.router.chat_tools import HARMONY, tool_call_format
from pdserve.router.grpc_loop import BridgeContext, drive, run_blocking
from pdserve.router.images import ChatImages
from pdserve.router.legs import Legs, RouterStatus, left
from pdserve.router.lora import RouterAdapters
from pdserve.router.pause import RouterPause
from pdserve.router.peer_fetch import PeerFetch
from pdserve.router.pool import ROLES, NoWorker, WorkerPool
from pdserve.router.text import BadRequest, PromptEncoder, opens_reasoning

SCHEDULING_POLICIES = ("fcfs", "priority")
POOLING_KINDS = ("last", "mean")  # engine/request.py's (the router may not import the engine)
NO_GENERATION = (
    "this model is a classifier: it scores and classifies (Embed with task CLASSIFY; /v1/score, "
    "/v1/rerank and /classify over HTTP) and does not generate"
)
NO_HEAD = (
    "this model has no classification head: serve a *ForSequenceClassification checkpoint, or "
    "name a generative model's label tokens (hf_overrides.classifier_from_token in the "
    "deployment YAML)"
)
MAX_EMBED_INPUTS = 2048  # inputs of one Embed call (OpenAI's limit; worker_common/embed.py's)


def check_priority(priority: int, policy: str) -> Refusal | None:
    """A request's priority under the router's scheduling policy: only 0 unless "priority"."""
    if priority and policy != "priority":
        return invalid(
            f"priority={priority} needs the router's scheduling_policy 'priority' (this one's is "
            f"{policy!r}): leave priority unset or 0"
        )
    return None


# a Batch API line's priority on the internal calls: BATCH_PRIORITY_BASE plus its own, clamped to
# [-2^29, 2^30), so every batch line sorts after every interactive call below 2^29 (fcfs sends 0)
BATCH_PRIORITY_BASE = 1 << 30


def batch_priority(priority: int) -> int:
    """The priority a batch line's call travels with (the decode queue, both engines): after
    every interactive call's, in the order of the line's own."""
    return BATCH_PRIORITY_BASE + max(-(1 << 29), min(priority, (1 << 30) - 1))


# worker statuses that describe the client's request: passed on unchanged
_CLIENT_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
}


# the initial metadata key of the prompt's token count (the HTTP front's continuous usage)
PROMPT_TOKENS_KEY = "pdserve-prompt-tokens"
# a reasoning model's chat (engine/tokenizer.py reasoning_tags): "open" when the output starts
# inside its reasoning (the prompt ends with <think>), else "closed"; "harmony" for gpt-oss's
# (router/chat_tools.py tool_call_format), whose output's messages say; the HTTP front splits it
REASONING_KEY = "pdserve-reasoning"
# a chat with tools: how the model writes its calls (router/chat_tools.py tool_call_format), for
# the HTTP front's parser
TOOL_FORMAT_KEY = "pdserve-tool-format"
# the end of a Harmony chat's prompt where the model writes a new message: gpt-oss's generation
# prompt, after which its structured output's grammar starts (`_structured_reasoning`)
HARMONY_GENERATION = "<|start|>assistant"


@dataclass(frozen=True)
class ServiceOptions:
    model_id: str
    max_model_len: int
    vocab_size: int
    dtype: str
    model_root: str = ""  # the model as the deployment names it (ModelCard.root)
    max_inflight: int = 64
    max_queued: int = 1024  # past max_inflight: calls that wait to be admitted, at most
    max_queue_wait_s: float = 60.0  # the longest a call waits to be admitted
    lease_ms: int = 10_000
    rpc_timeout_s: float = 10.0  # Reserve
    abort_timeout_s: float = 0.5  # best-effort Abort calls
    request_timeout_s: float = 3600.0  # the whole stream when the client sets no deadline_ms
    prefill_result_wait_s: float = 5.0  # Prefill's reply may trail its committed first token
    max_resumes: int = 2  # new decode workers one request may move to
    decode_queue_timeout_s: float = 120.0  # disaggregated: longest wait for decode KV blocks
    # the decode workers' stream interval, sent with every Reserve (decode_worker/streams.py
    # Interval): a stream's tokens in groups of this many, its first and its end at once
    stream_interval: int = 1
    colocated: bool = False  # workers prefill and decode themselves (no prefill pool)
    # disaggregated: which prompts their decode worker runs itself (planner/local_prefill.py)
    local_prefill: LocalPrefill = LocalPrefill()
    # disaggregated: when a turn's prefill worker pulls its decode worker's cached prefix
    peer_fetch: PeerFetch = PeerFetch()
    # "fcfs": a request's priority must be 0; "priority": honoured, lower first (vLLM's
    # --scheduling-policy), in the admission queue, the decode queue and both workers' engines
    scheduling_policy: str = "fcfs"
    # embeddings (Embed, /v1/embeddings): "last" token or "mean" pooling, L2-normalised or not
    embedding_pooling: str = "last"
    embedding_normalize: bool = True
    # the classification head's labels (Embed's task CLASSIFY; engine/score_head.py), empty for
    # none; `generates` False: a *ForSequenceClassification checkpoint (Generate is refused)
    labels: tuple[str, ...] = ()
    generates: bool = True
    # a scoring pair is encoded by the tokenizer as a pair (text, text_pair), not joined as one
    # text: config.json's use_pad_token, true unless it says false (vLLM's rule: a reranker
    # converted from a generative model says false)
    pair_encoding: bool = True
    # a Matryoshka model (EmbedRequest.dimensions): True (any width up to hidden_size) or the
    # widths allowed; False: none
    matryoshka: bool | tuple[int, ...] = False
    hidden_size: int = 0
    # the model's default sampling (engine/loader/generation_config.py, vLLM's
    # --generation-config): (field, value) pairs a request that leaves the field unset runs with
    sampling_defaults: tuple[tuple[str, float | int], ...] = ()
    # a vision-language model's image token and the directory its processor loads from
    # (router/images.py); None: a model of text only
    image_token_id: int | None = None
    model_dir: str = ""
    max_images: int = MAX_IMAGES  # the images one prompt may hold (router.limit_mm_per_prompt)
    # more arguments of the processor's call for a chat's images (router.mm_processor_kwargs)
    mm_processor_kwargs: dict = field(default_factory=dict)


def request_finish(last: pdserve_pb2.Finish, earlier: list[pdserve_pb2.Finish]):
    """The request's figures for the metrics: `last` (the sequence that ended the request) with
    the completion tokens of all its sequences (n>1: each Finish counts its own, pdserve.proto)."""
    if not earlier:
        return last
    total = pdserve_pb2.Finish()
    total.CopyFrom(last)
    total.usage.completion_tokens += sum(f.usage.completion_tokens for f in earlier)
    return total


def fit_to_context(
    sampling: pdserve_pb2.SamplingParams,
    prompt_len: int,
    max_model_len: int,
    prompt_is: str,
    up_to_context: bool = False,
) -> pdserve_pb2.SamplingParams | Refusal:
    """The sampling a request runs with once its prompt is `prompt_len` tokens, or the Refusal of a
    completion the context cannot hold (protos/limits.check_context, the workers' check too).

    An explicit max_tokens must fit beside the prompt. Two values ask for whatever the context has
    room for instead: an unset max_tokens (the default, DEFAULT_MAX_TOKENS, ends where the context
    does, as it always has) and max_tokens = max_model_len, which no prompt leaves room for and
    which the HTTP front sends for a chat without max_tokens (OpenAI's and vLLM's "until the
    context is full"). Where that is more than the prompt leaves, max_tokens becomes what it
    leaves, set explicitly (a copy; `sampling` itself is returned when nothing changes), so every
    leg of the call, resumes included, carries a budget the workers accept. `up_to_context`
    (GenerateRequest.max_tokens_up_to_context) reads any max_tokens so: as a cap."""
    fill = (
        up_to_context or not sampling.HasField("max_tokens") or sampling.max_tokens == max_model_len
    )
    if not fill:
        return check_context(prompt_len, sampling, max_model_len, prompt_is) or sampling
    refusal = check_context(prompt_len, _without_max_tokens(sampling), max_model_len, prompt_is)
    if refusal:  # a min_tokens the prompt leaves no room for
        return refusal
    room = max_model_len - prompt_len
    wanted = sampling.max_tokens if sampling.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    if wanted <= room:
        return sampling
    fitted = pdserve_pb2.SamplingParams()
    fitted.CopyFrom(sampling)
    fitted.max_tokens = room
    return fitted


def with_model_defaults(
    sampling: pdserve_pb2.SamplingParams,
    defaults: dict,
    max_model_len: int,
    up_to_context: bool = False,
) -> tuple[pdserve_pb2.SamplingParams, bool]:
    """(the sampling with the model's `defaults` (ServiceOptions.sampling_defaults) in the fields
    the client left unset, whether max_tokens is now the model's), as vLLM's server applies a
    generation config's: the client's own value always wins. max_tokens counts as unset where
    it is max_model_len, the HTTP front's "until the context is full" for a chat without
    max_tokens (fit_to_context), unless `up_to_context` makes it the client's cap; the model's
    max_tokens, at most max_model_len, is a cap too (vLLM: the least of it and the room the
    prompt leaves), so the caller fits it with up_to_context. `sampling` itself is returned when
    nothing changes."""
    unset = [name for name in defaults if name != "max_tokens" and not sampling.HasField(name)]
    default_max = defaults.get("max_tokens")
    takes_max = default_max is not None and (
        not sampling.HasField("max_tokens")
        or (sampling.max_tokens == max_model_len and not up_to_context)
    )
    if not unset and not takes_max:
        return sampling, False
    out = pdserve_pb2.SamplingParams()
    out.CopyFrom(sampling)
    for name in unset:
        setattr(out, name, defaults[name])
    if takes_max:
        out.max_tokens = min(default_max, max_model_len)
    return out, takes_max


def special_ends(with_special: list[int], without: list[int]) -> tuple[int, int]:
    """(before, after): where a text's own ids `without` sit inside its ids `with_special`
    (those with the tokenizer's special tokens); where several places fit, the one with the
    most special tokens before; (0, 0) where none does."""
    extra = len(with_special) - len(without)
    for before in range(extra, -1, -1):
        if with_special[before : before + len(without)] == without:
            return before, extra - before
    return 0, 0


def first_tokens(ids: list[int], keep: int, ends: tuple[int, int]) -> list[int]:
    """A text's ids (its tokenizer's special tokens included, `ends` of them before and after
    its own) cut to `keep`: the special tokens kept and its first own tokens, as HF's
    truncation on the right gives them; plainly its first `keep` ids where fewer than the
    special tokens are kept."""
    before, after = ends
    if len(ids) <= keep:
        return ids
    if keep <= before + after:
        return ids[:keep]
    return ids[: keep - after] + ids[len(ids) - after :]


def _without_max_tokens(sampling: pdserve_pb2.SamplingParams) -> pdserve_pb2.SamplingParams:
    if not sampling.HasField("max_tokens"):
        return sampling
    copy = pdserve_pb2.SamplingParams()
    copy.CopyFrom(sampling)
    copy.ClearField("max_tokens")
    return copy


def _after_reasoning(sampling, reasoning: str):
    """A reasoning model's chat with structured output: the grammar holds for the answer after
    its reasoning (engine/structured/grammar.py `reasoned`, or `harmony_grammar` for gpt-oss's
    Harmony: `_structured_reasoning` says which), unless the client said otherwise."""
    if sampling.structured.reasoning or not reasoning:
        return sampling
    copy = pdserve_pb2.SamplingParams()
    copy.CopyFrom(sampling)
    copy.structured.reasoning = reasoning
    return copy


def _forced_call(schema_text: str, tools_json: str) -> bool:
    """Whether a structured json_schema is a forced tool call's (router/openai/protocol.py
    forced_spec): an object of exactly "name" (a const, one of the chat's tools) and "arguments",
    or an anyOf of such objects."""
    if not schema_text or not tools_json:
        return False
    try:
        schema = json.loads(schema_text)
    except ValueError:
        return False
    one = isinstance(schema, dict) and set(schema) == {"anyOf"}
    alternatives = schema["anyOf"] if one else [schema]
    names = set()
    for alt in alternatives if isinstance(alternatives, list) else ():
        props = alt.get("properties") if isinstance(alt, dict) else None
        if not isinstance(props, dict) or set(props) != {"name", "arguments"}:
            return False
        name = props["name"].get("const") if isinstance(props["name"], dict) else None
        if not isinstance(name, str) or alt.get("required") != ["name", "arguments"]:
            return False
        names.add(name)
    try:
        tools = json.loads(tools_json)
    except ValueError:
        return False
    if not isinstance(tools, list):
        return False
    functions = [t.get("function") for t in tools if isinstance(t, dict)]
    declared = {f.get("name") for f in functions if isinstance(f, dict)}
    return bool(names) and names <= declared


def _with_sampling(request: pdserve_pb2.GenerateRequest, sampling) -> pdserve_pb2.GenerateRequest:
    """A copy of the client's request with `sampling` in place of its own."""
    copy = pdserve_pb2.GenerateRequest()
    copy.CopyFrom(request)
    copy.sampling.CopyFrom(sampling)
    return copy


class PDServeServicer(pdserve_pb2_grpc.PDServeServicer):
    def __init__(
        self,
        pool: WorkerPool,
        tokenizer,
        options: ServiceOptions,
        executor: futures.ThreadPoolExecutor,
        metrics=None,
    ):
        self.pool = pool
        self.tokenizer = tokenizer
        self.options = options
        images = None
        if options.image_token_id is not None:
            images = ChatImages(
                options.model_dir,
                options.image_token_id,
                BadRequest,
                options.max_images,
                options.mm_processor_kwargs,
            )
        self.encoder = PromptEncoder(
            tokenizer, options.max_model_len, options.vocab_size, images=images
        )
        # the model's default sampling (generation_config.json): what unset fields run with
        self.sampling_defaults = dict(options.sampling_defaults)
        self.reasoning_tags = reasoning_tags(tokenizer)
        self.tool_format = tool_call_format(tokenizer)
        self.legs = Legs(pool, executor, options)
        self.metrics = metrics  # router/metrics.py RouterMetrics: every request's figures
        self.capture = None  # router/capture.py TraceCapture, when the deployment records traffic
        self.tracing = None  # protos/tracing.py Tracing: the router's spans (None: off)
        if metrics is not None:
            self.legs.on_tokens = metrics.on_tokens
            self.legs.on_local = metrics.local_prefills.inc
            self.legs.on_joined = metrics.joined_events.inc
            self.legs.on_stale_hint = metrics.stale_cache_hints.inc
            self.legs.on_reuse_path = metrics.on_reuse_path
        # the LoRA adapters served (router/lora.py); the router sets the deployment's
        self.loras = RouterAdapters(options.model_id)
        self._inflight: dict[tuple[str, str], ClientCall] = {}  # (client peer, request_id) ->
        self._lock = threading.Lock()
        self.admission = Admission(
            options.max_inflight,
            options.max_queued,
            options.max_queue_wait_s,
            on_admit=metrics.admission_wait.observe if metrics is not None else lambda s: None,
            on_shed=metrics.admission_shed.inc if metrics is not None else lambda: None,
        )
        # POST /pause and /resume (router/pause.py); the router turns them on where the
        # deployment sets router.pause_endpoints
        self.pause = RouterPause(self.admission, self.abort_all, enabled=False)
        # each API key a tenant of the admission queue (`flow_of`); the router sets it where the
        # deployment has keys (without, an `authorization` entry is not checked: no tenant)
        self.tenants_by_key = False
        self.weights = None  # router/weights.py RouterWeights, which the router sets
        self.sleep = None  # router/sleep.py RouterSleep, which the router sets
        # where Generate and Embed run what may block: the gRPC server's thread pool, which the
        # router sets (router/grpc_loop.py)
        self.executor: futures.Executor | None = None
        # (before, after): the special tokens the tokenizer adds around a text (_special_ends)
        self._ends: tuple[int, int] | None = None

    def close(self) -> None:
        self.encoder.close()
        self.legs.close()

    def num_inflight(self) -> int:
        with self._lock:
            return len(self._inflight)

    def abort_all(self) -> int:
        """Ends every admitted Generate call as PDServe.Abort does (its stream ends with
        finish_reason "abort"): how many were not already ending. Never blocks (router/pause.py)."""
        with self._lock:
            calls = [c for c in self._inflight.values() if not c.abort_requested]
        for call in calls:
            call.abort()
        return len(calls)

    # ---- Generate -------------------------------------------------------------------------------
    async def Generate(self, request, context):
        """On the server's event loop (router/grpc_loop.py): the call's generator, stepped there
        while it streams tokens and on the executor where it may block. The HTTP front's calls
        (its in-process channel: the one Unix socket the server listens on) step on the executor
        throughout, each waiting there for its leg: at many streams a call that waits off the
        loop joins more tokens into each of the front's chunks, whose JSON and socket writes
        cost more than the thread (BENCHMARKS.md, many streams)."""
        bridge = BridgeContext(context)
        from_front = bridge.peer().startswith("unix:")
        await drive(self._generate(request, bridge), bridge, context, self.executor, from_front)

    def _generate(self, request, context):
        try:
            yield from self._admit_and_generate(request, context)
        except Exception:
            code = context.code()  # set by context.abort; None for an unexpected exception
            if self.metrics is not None:
                self.metrics.observe_error(code or grpc.StatusCode.UNKNOWN)
            raise

    def _admit_and_generate(self, request, context):
        queued_ns, start = unix_ns(), time.monotonic()
        rid = request.request_id or uuid.uuid4().hex
        opts = self.options
        refusal = (
            check_id("request_id", rid)
            or check_sampling(request.sampling, opts.max_model_len, opts.vocab_size)
            or check_priority(request.priority, opts.scheduling_policy)
        )
        if refusal:
            refusal.abort(context)
        if not opts.generates:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, NO_GENERATION)
        lora = self.loras.adapter_for(request.model)
        if lora is None:
            served = ", ".join(self.loras.served())
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"model {request.model[:200]} is not served; served: {served[:2000]}",
            )
        try:
            prompt, images = self.encoder.encode_with_images(request)
        except BadRequest as e:
            context.abort(e.code, e.message)
        request, opened = self._as_run(request, prompt, context)
        for role in ("decode",) if opts.colocated else ROLES:
            if not self.pool.num_workers(role):
                context.abort(grpc.StatusCode.UNAVAILABLE, str(NoWorker(role)))
        budget_s = min(
            request.deadline_ms / 1000 if request.deadline_ms else opts.request_timeout_s,
            opts.request_timeout_s,
        )
        deadline = start + budget_s
        # a client that stops reading is cut there too, not only a leg (router/grpc_loop.py)
        context.deadline = deadline
        key = (context.peer(), rid)
        call = ClientCall(self.legs, self.tokenizer, request, rid, prompt, deadline, queued_ns)
        batch = _is_batch(context)
        call.priority = batch_priority(request.priority) if batch else request.priority
        call.lora = lora  # the adapter both legs run under (router/lora.py; "": the base)
        call.images = images  # a chat's images (router/images.py), sent with each leg
        ticket = self._admit(key, call, context, deadline, request.priority)
        call.share_tag = ticket.tag  # its order in every queue past the admission, by priority
        # admitted: no weight update starts before it ends (router/pause.py drains first)
        call.weight_version = self.weights.version if self.weights is not None else ""
        if self.tracing is not None:  # from its arrival: the admission queue's wait included
            call.span = self._start_span(call, context)
            call.admitted_ns = unix_ns()
        try:
            if not context.add_callback(lambda: self._on_rpc_end(call)):
                # the client left while this step validated, tokenized and admitted it (a step
                # under way runs on): no callback will come, so no leg may start
                self._on_rpc_end(call)
                return
            context.send_initial_metadata(self._initial_metadata(request, prompt, opened))
            yield from self._run(call, context)
        finally:
            with self._lock:
                if self._inflight.get(key) is call:
                    del self._inflight[key]
            self.admission.leave(ticket)
            if call.span is not None:  # not ended by a finish or a failure: the client left
                self._end_span(call, error="the client cancelled or went away")

    def _as_run(self, request, prompt: list[int], context):
        """(the request as it runs, whether a reasoning model's chat opens inside its reasoning:
        `_opens_reasoning`). Its sampling, where that differs from the client's: its text
        prediction as ids, the model's default sampling in the fields the client left unset
        (`with_model_defaults`), max_tokens fitted to the context (`fit_to_context`), and a
        reasoning chat's grammar held after the reasoning. A refusal ends the call."""
        opts = self.options
        try:
            asked = self.encoder.with_prediction(request)
        except BadRequest as e:
            context.abort(e.code, e.message)
        up_to_context = request.max_tokens_up_to_context
        asked, capped = with_model_defaults(
            asked, self.sampling_defaults, opts.max_model_len, up_to_context
        )
        prompt_is = "messages" if request.WhichOneof("input") == "chat" else "prompt"
        sampling = fit_to_context(
            asked, len(prompt), opts.max_model_len, prompt_is, up_to_context or capped
        )
        if isinstance(sampling, Refusal):
            sampling.abort(context)
        opened = self._opens_reasoning(request, prompt)
        if sampling.HasField("structured") and not sampling.structured.reasoning:
            reasoning = self._structured_reasoning(request, prompt, sampling.structured, opened)
            sampling = _after_reasoning(sampling, reasoning)
        if sampling is not request.sampling:
            request = _with_sampling(request, sampling)
        return request, opened

    def _structured_reasoning(
        self, request, prompt: list[int], structured, opened: bool | None
    ) -> str:
        """What a chat's grammar comes after (StructuredOutput.reasoning): a reasoning model's
        reasoning ("open" when the prompt opened it, else "optional"), gpt-oss's Harmony analysis
        messages where the prompt ends with the generation prompt <|start|>assistant ("harmony":
        the answer in the final channel; "harmony_call" for a forced tool call's grammar,
        written as Harmony's call); "" for another model or input."""
        if opened is not None:
            return "open" if opened else "optional"
        if self.tool_format != HARMONY or request.WhichOneof("input") != "chat":
            return ""
        tail = self.tokenizer.decode(prompt[-16:], skip_special_tokens=False)
        if not tail.endswith(HARMONY_GENERATION):
            return ""
        if _forced_call(structured.json_schema, request.chat.tools_json):
            return "harmony_call"
        return HARMONY

    def _opens_reasoning(self, request, prompt: list[int]) -> bool | None:
        """A reasoning model's chat: whether its output starts inside its reasoning (the prompt
        ends with <think>); None for another model or input."""
        if self.reasoning_tags is None or request.WhichOneof("input") != "chat":
            return None
        return opens_reasoning(prompt, self.reasoning_tags, self.tokenizer)

    def _initial_metadata(self, request, prompt: list[int], opened: bool | None) -> tuple:
        """The prompt's token count; a reasoning model's chat: whether its output starts inside
        its reasoning (REASONING_KEY), or a Harmony model's chat that it is one; a chat with
        tools: the model's call format."""
        out = ((PROMPT_TOKENS_KEY, str(len(prompt))),)
        if opened is not None:
            out += ((REASONING_KEY, "open" if opened else "closed"),)
        elif self.tool_format == HARMONY and request.WhichOneof("input") == "chat":
            out += ((REASONING_KEY, HARMONY),)
        if request.WhichOneof("input") == "chat" and request.chat.tools_json:
            out += ((TOOL_FORMAT_KEY, self.tool_format),)
        return out

    def _admit(
        self, key: tuple[str, str], call: ClientCall, context, deadline: float, priority: int = 0
    ) -> Ticket:
        """A slot for the call (waiting in the admission queue when every slot is taken), and
        the call registered under `key`; else the call ends with the status that says why. The
        caller leaves with the ticket returned."""
        ticket = self._admission_slot(priority, context, deadline)
        with self._lock:
            taken = key in self._inflight
            if not taken:
                self._inflight[key] = call
        if taken:
            self.admission.leave(ticket)
            context.abort(
                grpc.StatusCode.ALREADY_EXISTS, f"request_id {key[1]!r} is already in flight"
            )
        return ticket

    def _not_admitted(self, outcome: str, context) -> None:
        waited = self.options.max_queue_wait_s
        if outcome == CANCELLED:
            context.abort(grpc.StatusCode.CANCELLED, "the client left while the call was queued")
        if outcome == SHED:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the router's queue is full (max_queued={self.options.max_queued}) and this "
                f"request's tenant had the most requests waiting: a request of another tenant "
                f"took its place; retry later",
            )
        if outcome == DEADLINE:
            context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "the request's deadline passed while it waited to be admitted",
            )
        context.abort(
            grpc.StatusCode.UNAVAILABLE,
            f"the router is overloaded: the request waited max_queue_wait_s={waited:g} s to be "
            f"admitted; retry later",
        )

    def _run(self, call: ClientCall, context):
        """The call's responses; its last Finish after the metrics have it."""
        try:
            finish = yield from call.run()
        except CallFailed as failure:
            self._fail(call, failure, context)
        if finish is None:  # the client left
            return
        total = request_finish(finish, call.finishes)
        if call.span is not None:
            self._end_span(call, total)
        if self.metrics is not None:
            self.metrics.observe_finish(total, call, call.legs[0], unix_ns())
        if self.capture is not None:  # router/capture.py: a line of the replayable trace
            self.capture.record(call.queued_ns, call.prompt, total.usage.completion_tokens)
        yield pdserve_pb2.GenerateResponse(request_id=call.request_id, finish=finish)

    def _start_span(self, call: ClientCall, context):
        """The request's span (vLLM's `llm_request`, gen_ai.* attributes), continuing the
        client's trace when its metadata carries a valid traceparent (protos/tracing.py)."""
        s = call.sampling
        return self.tracing.start(
            "llm_request",
            tracing.extract(context.invocation_metadata()),
            call.queued_ns,
            {
                "gen_ai.request.id": call.request_id,
                "gen_ai.response.model": self.options.model_id,
                "gen_ai.request.max_tokens": s.max_tokens,
                "gen_ai.request.temperature": s.temperature,
                "gen_ai.request.top_p": s.top_p,
                "gen_ai.request.n": call.n,
                "gen_ai.usage.prompt_tokens": len(call.prompt),
            },
            server=True,
        )

    def _end_span(self, call: ClientCall, finish=None, error: str | None = None) -> None:
        """Ends the request's span with what its Finish says: the true TTFT and end-to-end time
        (seen by the router, the one process that sees every hop), the workers, the tokens."""
        span, call.span = call.span, None
        attrs = {}
        if finish is not None:
            t, now = finish.timings, unix_ns()
            first = t.first_token_unix_ns or call.first_token_ns
            attrs = {
                "gen_ai.usage.completion_tokens": finish.usage.completion_tokens,
                "gen_ai.usage.cached_prompt_tokens": finish.usage.cached_prompt_tokens,
                "gen_ai.latency.time_to_first_token": (first - call.queued_ns) / 1e9
                if first
                else None,
                "gen_ai.latency.e2e": (now - call.queued_ns) / 1e9,
                "gen_ai.latency.time_in_queue": (t.reserved_unix_ns - call.queued_ns) / 1e9
                if t.reserved_unix_ns
                else None,
                "pdserve.finish_reason": finish.finish_reason,
                "pdserve.prefill_worker": t.prefill_worker,
                "pdserve.decode_worker": t.decode_worker,
                "pdserve.resumes": call.num_resumes,
            }
        self._leg_spans(call, span)
        tracing.end(span, attributes=attrs, error=error)

    def _leg_spans(self, call: ClientCall, span) -> None:
        """The router's own child spans, from its stamps: the admission queue's wait, and each
        leg's Reserve and its decode stream (from its reservation to the next leg or the end)."""
        t, now = self.tracing, unix_ns()
        t.emit("admission", span, call.queued_ns, getattr(call, "admitted_ns", 0))
        legs = list(call.legs)
        # a leg's stream ends where the next leg (a resume) starts, the last one now
        ends = [nxt.reserve_start_ns or now for nxt in legs[1:]] + [now]
        for leg, end in zip(legs, ends):
            attrs = {"pdserve.leg": leg.number, "pdserve.local_prefill": leg.local}
            t.emit("reserve", span, leg.reserve_start_ns, leg.reserved_ns, attrs)
            t.emit("decode stream", span, leg.reserved_ns, end, attrs)

    def _fail(self, call: ClientCall, failure: CallFailed, context):
        """Ends the call with the status its failure maps to (the call let go of its workers)."""
        if self.metrics is not None:
            self.metrics.observe_unfinished("error")
        error, who = failure.error, failure.who
        if call.span is not None:
            self._end_span(call, error=f"the {who} failed: {getattr(error, 'details', str)()}")
        if error is None:
            context.abort(grpc.StatusCode.INTERNAL, f"the {who} stream ended without a final event")
        if isinstance(error, RouterStatus):  # already says what happened
            context.abort(error.code(), error.details())
        code = error.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            context.abort(
                code,
                f"request {call.request_id!r} did not finish within deadline_ms="
                f"{failure.deadline_ms or 'unset'} (at the {who})",
            )
        if code in _CLIENT_CODES:
            context.abort(code, error.details())
        if code == grpc.StatusCode.CANCELLED:
            code = grpc.StatusCode.ABORTED
        context.abort(code, f"{who} failed: {error.details()}")

    # ---- cancellation ---------------------------------------------------------------------------
    def _on_rpc_end(self, call: ClientCall) -> None:
        """Called on the event loop when the call ends for any reason (or by the call itself
        when it ended before the callback could be added); only an unfinished one needs work,
        and the call sends that work to the abort threads."""
        if call.cancel() and self.metrics is not None:
            self.metrics.observe_unfinished("abort")

    # ---- Embed ----------------------------------------------------------------------------------
    async def Embed(self, request, context):
        return await run_blocking(self._embed, request, context, self.executor)

    def _embed(self, request, context):
        start = time.monotonic()
        opts = self.options
        rid = request.request_id or uuid.uuid4().hex
        refusal = check_id("request_id", rid) or check_priority(
            request.priority, opts.scheduling_policy
        )
        if refusal:
            refusal.abort(context)
        lora = self.loras.adapter_for(request.model)  # "": the base model
        if lora is None:
            served = ", ".join(self.loras.served())
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"model {request.model[:200]} is not served; served: {served[:2000]}",
            )
        classify = request.task == pdserve_pb2.POOLING_TASK_CLASSIFY
        if not classify and request.task != pdserve_pb2.POOLING_TASK_EMBED:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"task {request.task} is not a PoolingTask: EMBED (0) or CLASSIFY (1)",
            )
        dims = request.dimensions if request.HasField("dimensions") else None
        if dims is not None:
            refusal = self._check_dimensions(dims, classify)
            if refusal:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal)
        if classify and not opts.labels:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, NO_HEAD)
        prompts = self._embed_prompts(request, context)
        role = "decode" if opts.colocated else "prefill"
        if not self.pool.num_workers(role):
            context.abort(grpc.StatusCode.UNAVAILABLE, str(NoWorker(role)))
        budget_s = min(
            request.deadline_ms / 1000 if request.deadline_ms else opts.request_timeout_s,
            opts.request_timeout_s,
        )
        deadline = start + budget_s
        ticket = self._admission_slot(request.priority, context, deadline)
        try:
            priority = batch_priority(request.priority) if _is_batch(context) else request.priority
            reply = self._embed_on_workers(
                rid, prompts, priority, deadline, context, classify, lora, ticket.tag
            )
        finally:
            self.admission.leave(ticket)
        out = pdserve_pb2.EmbedResponse(
            request_id=rid,
            prompt_tokens=sum(len(p) for p in prompts),
            cached_prompt_tokens=reply.num_cached_tokens,
        )
        out.embeddings.extend(reply.embeddings)
        if dims is not None:
            for e in out.embeddings:
                cut = list(e.values[:dims])
                if opts.embedding_normalize:
                    norm = math.sqrt(sum(v * v for v in cut)) or 1.0
                    cut = [v / norm for v in cut]
                e.values[:] = cut
        return out

    def _check_dimensions(self, dims: int, classify: bool) -> str | None:
        """Why EmbedRequest.dimensions cannot be served (None: it can)."""
        opts = self.options
        if classify:
            return "dimensions is for embeddings: leave it unset with task CLASSIFY"
        if not opts.matryoshka:
            return (
                "dimensions is not supported: the served model is not a Matryoshka model (its "
                "config has no is_matryoshka or matryoshka_dimensions; a deployment can say so "
                "in hf_overrides); leave it unset"
            )
        if isinstance(opts.matryoshka, tuple) and dims not in opts.matryoshka:
            allowed = ", ".join(map(str, opts.matryoshka))
            return f"dimensions={dims} is not one the model was trained for: one of {allowed}"
        if not 1 <= dims <= opts.hidden_size:
            return f"dimensions={dims} must be in [1, {opts.hidden_size}] (the model's width)"
        return None

    def _embed_prompts(self, request, context) -> list[list[int]]:
        """Each input's token ids, checked as a Generate prompt is (naming the input); with
        truncate_prompt_tokens, each input's first k tokens (`_truncated`)."""
        if not request.inputs:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "inputs is empty: send at least one")
        if len(request.inputs) > MAX_EMBED_INPUTS:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"inputs has {len(request.inputs)} entries; at most {MAX_EMBED_INPUTS}",
            )
        truncate = request.HasField("truncate_prompt_tokens")
        prompts = []
        for i, one in enumerate(request.inputs):
            as_generate = pdserve_pb2.GenerateRequest()
            kind = one.WhichOneof("input")
            try:
                if truncate:
                    # the ids already cut; the encoder checks k itself (and keeps them all)
                    as_generate.truncate_prompt_tokens = request.truncate_prompt_tokens
                    as_generate.token_ids.ids.extend(
                        self._truncated(one, request.truncate_prompt_tokens)
                    )
                elif kind == "text":
                    as_generate.text = one.text
                elif kind == "token_ids":
                    as_generate.token_ids.CopyFrom(one.token_ids)
                prompts.append(self.encoder.encode(as_generate))
            except BadRequest as e:
                context.abort(e.code, f"inputs[{i}]: {e.message}")
        return prompts

    def _truncated(self, one: pdserve_pb2.EmbedInput, k: int) -> list[int]:
        """An input's first k token ids (k = -1: max_model_len - 1 of them), as vLLM truncates a
        pooling model's inputs (its tokenizer's truncation_side is "right" for them): token ids as
        sent; a text tokenized whole first, keeping the special tokens its tokenizer adds at
        either end (`first_tokens`), as HF's truncation does. The text is not held to
        max_prompt_bytes, which would refuse the long documents truncation is for: the request's
        own size bounds it (the gRPC port takes at most max_request_bytes: router/server.py), so
        tokenizing it costs no more than a batch of inputs of as many bytes already does, and
        the tokenizer's queue bound still applies (router/text.py)."""
        if k < 1 and k != -1:  # refused by the encoder, which names k, before any tokenizing
            return []
        keep = k if k >= 1 else self.options.max_model_len - 1
        if one.WhichOneof("input") != "text":
            return list(one.token_ids.ids[:keep])
        if not one.text:  # refused as an empty prompt, as without truncation
            return []
        return first_tokens(self.encoder.tokenize_whole(one.text), keep, self._special_ends())

    def _special_ends(self) -> tuple[int, int]:
        """How many special tokens the tokenizer adds before a text's own tokens and after them
        ((1, 0) for a BOS, (1, 1) for BERT's CLS and SEP, (0, 1) for an appended EOS), found
        once by tokenizing a probe with them and without, on the encoder's thread."""
        if self._ends is None:
            probe = "a b"
            with_special = self.encoder.tokenize_whole(probe, True)
            self._ends = special_ends(with_special, self.encoder.tokenize_whole(probe, False))
        return self._ends

    def _admission_slot(self, priority: int, context, deadline: float) -> Ticket:
        """A slot in the admission queue, its ticket (Generate and Embed calls alike; the caller
        leaves with it), or the call ends with the status that says why."""
        flow = flow_of(context, self.tenants_by_key)
        try:
            ticket = self.admission.enter(priority, background=_is_batch(context), flow=flow)
        except QueueFull as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{e}: retry later")
        if not ticket.granted:
            # the client leaving (the event loop) only wakes the waiting handler; an RPC
            # that already ended takes no callback, and leaves at once
            if not context.add_callback(lambda: self.admission.cancel(ticket)):
                self.admission.cancel(ticket)
            outcome = self.admission.wait(ticket, deadline)
            if outcome != ADMITTED:
                self._not_admitted(outcome, context)
        return ticket

    def _embed_on_workers(
        self,
        rid: str,
        prompts,
        priority: int,
        deadline: float,
        context,
        classify: bool = False,
        lora: str = "",
        share_tag: int = 0,
    ):
        """The WorkerEmbedResponse from a prefill worker (colocated: a decode worker), the least
        loaded first among those that have the LoRA adapter `lora` ("": the base model); one more
        worker is tried when the first is unavailable."""
        opts = self.options
        call = worker_pb2.WorkerEmbedRequest(
            request_id=uuid.uuid4().hex,  # the workers never see the client's id
            priority=priority,
            share_tag=share_tag,
            pooling="classify" if classify else opts.embedding_pooling,
            normalize=opts.embedding_normalize and not classify,
            lora_name=lora,
        )
        for p in prompts:
            call.prompts.add().ids.extend(p)
        rest = sum(len(p) for p in prompts[1:])  # charged too; the first prompt picks (affinity)
        tried = None
        error = None
        for _ in range(2):
            try:
                if opts.colocated:
                    order = self.pool.decode_order(exclude=(tried,) if tried else (), adapter=lora)
                    worker, charge = order[0], 0
                else:
                    worker, charge = self.pool.pick_prefill(prompts[0], exclude=tried, adapter=lora)
                    self.pool.charge_queued(worker, rest)
                    charge += rest
            except NoWorker as e:
                context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            if worker is tried:  # the only one, and it failed already
                if not opts.colocated:
                    self.pool.end_prefill(worker, charge)
                break
            try:
                pending = worker.stub.Embed.future(call, timeout=left(deadline))
                # the client leaving cancels the worker's call (which aborts its prompts there);
                # cancel() never blocks gRPC's callback thread
                if not context.add_callback(pending.cancel):
                    pending.cancel()
                return pending.result()
            except grpc.FutureCancelledError:
                context.abort(grpc.StatusCode.CANCELLED, "the client left")
            except grpc.RpcError as e:
                error, tried = e, worker
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    break
            finally:
                if not opts.colocated:
                    self.pool.end_prefill(worker, charge)
        code = error.code() if error is not None else grpc.StatusCode.UNAVAILABLE
        details = error.details() if error is not None else "no other worker to try"
        if code in _CLIENT_CODES:
            context.abort(code, details)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            context.abort(code, f"request {rid!r} did not finish within its deadline")
        context.abort(
            grpc.StatusCode.UNAVAILABLE,
            f"{'decode' if opts.colocated else 'prefill'} worker failed: {details}",
        )

    # ---- Abort, ListModels ----------------------------------------------------------------------
    def Abort(self, request, context):
        refusal = check_id("request_id", request.request_id)
        if refusal:
            refusal.abort(context)
        with self._lock:  # only the caller's own requests: those its connection started
            call = self._inflight.get((context.peer(), request.request_id))
        if call is None:
            return pdserve_pb2.AbortResponse(found=False)
        call.abort()
        return pdserve_pb2.AbortResponse(found=True)

    def ListModels(self, request, context):
        opts = self.options
        base = pdserve_pb2.ModelCard(
            id=opts.model_id,
            max_model_len=opts.max_model_len,
            vocab_size=opts.vocab_size,
            dtype=opts.dtype,
            labels=opts.labels,
            root=opts.model_root,
        )
        return pdserve_pb2.ListModelsResponse(models=self.loras.cards(base))


def _is_batch(context) -> bool:
    """Whether the call is a Batch API line's (router/admission.py BATCH_METADATA_KEY)."""
    return any(key == BATCH_METADATA_KEY for key, _ in context.invocation_metadata() or ())


def flow_of(context, by_key: bool = True) -> tuple[str, str]:
    """The call's flow in the admission queue (router/admission.py): (its tenant, a hash of the
    client's API key where `by_key` (the deployment has keys, which the interceptor checked),
    else ""; its sub-flow, the x-gateway-inference-fairness-id entry, "" without one). An id
    longer than MAX_FAIRNESS_ID_CHARS ends the call INVALID_ARGUMENT."""
    tenant, sub = "", ""
    for key, value in context.invocation_metadata() or ():
        if key == API_KEY_METADATA_KEY and by_key:
            token = bearer_token(value)
            if token:
                tenant = hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()[:32]
        elif key == FAIRNESS_ID_KEY:
            sub = value
    if len(sub) > MAX_FAIRNESS_ID_CHARS:
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{FAIRNESS_ID_KEY} must have at most {MAX_FAIRNESS_ID_CHARS} characters, has "
            f"{len(sub)}",
        )
    return tenant, sub
