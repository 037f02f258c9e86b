"""A worker's Embed call (PrefillWorker.Embed, and DecodeWorker.Embed in colocated deployments):
each prompt runs through the worker's engine as a pooling request (engine/request.py
PoolingParams: the final hidden state of its last token, or the mean, L2-normalised when asked),
under the call's LoRA adapter when it names one (`lora_name`, as a Reserve or Prefill does:
worker_common/lora.py; one this worker lacks is FAILED_PRECONDITION), nothing is sampled, no KV
leaves the worker, and each prompt's blocks are freed when it ends (full ones stay in the prefix
cache, so a repeated prompt is mostly cached).

Lifecycle of one call: checks (id, prompts, pooling) -> one engine request per prompt, named
`<request_id>/<index>`, at the call's priority, all added in one call on the engine's loop
thread (all or none) -> wait for all of them -> the vectors in prompt
order. The deadline, the client leaving or an engine refusal aborts every prompt still in the
engine before the call ends with its status. No state outlives the call.
"""

from __future__ import annotations

import threading
import time

import grpc

from pdserve.engine.request import POOLING_KINDS, PoolingParams
from pdserve.engine.sampling_params import SamplingParams
from pdserve.protos.convert import engine_priority
from pdserve.protos.limits import check_id, check_token_ids, invalid
from pdserve.protos.pdserve.v1 import pdserve_pb2, worker_pb2
from pdserve.worker_common.errors import abort_for_engine_error
from pdserve.worker_common.lora import adapter_of

# prompts in one Embed call at most (OpenAI's limit on /v1/embeddings inputs)
MAX_EMBED_INPUTS = 2048


def check_embed(request, max_model_len: int, vocab_size: int):
    """What is wrong with a WorkerEmbedRequest, before any work (None: nothing)."""
    refusal = check_id("request_id", request.request_id)
    if refusal:
        return refusal
    if not request.prompts:
        return invalid("prompts is empty: send at least one")
    if len(request.prompts) > MAX_EMBED_INPUTS:
        return invalid(f"prompts has {len(request.prompts)} entries; at most {MAX_EMBED_INPUTS}")
    if request.pooling not in POOLING_KINDS:
        return invalid(
            f"pooling must be one of {', '.join(POOLING_KINDS)}, got {request.pooling!r}"
        )
    for i, prompt in enumerate(request.prompts):
        refusal = check_token_ids(f"prompts[{i}]", prompt.ids, max_model_len, vocab_size)
        if refusal:
            return refusal
    return None


def run_embed(loop, request, context, budget_s: float, poll_s: float = 0.1):
    """The WorkerEmbedResponse of `request` on `loop`'s engine (module docstring)."""
    engine = loop.engine
    refusal = check_embed(request, engine.config.max_model_len, engine.model_config.vocab_size)
    if refusal:
        refusal.abort(context)
    # what every prompt's engine request takes beside its ids: under the adapter it names, if any
    how = {
        "pooling": PoolingParams(request.pooling, request.normalize),
        "priority": engine_priority(request.priority, request.share_tag),
    }
    lora = adapter_of(engine, request.lora_name, context)  # None: the base model
    if lora is not None:
        how["lora_request"] = lora
    params = SamplingParams(max_tokens=1)
    n = len(request.prompts)
    outputs: list = [None] * n
    left = [n]
    done = threading.Event()
    lock = threading.Lock()

    def on_output(i):
        def cb(out) -> None:  # on the loop thread: cheap
            if not out.finished:
                return
            outputs[i] = out
            with lock:
                left[0] -= 1
                if not left[0]:
                    done.set()

        return cb

    rids = [f"{request.request_id}/{i}" for i in range(n)]

    def add_all() -> None:
        """On the loop thread, so no step runs between the adds: every prompt, or none."""
        engine = loop.engine
        for i, prompt in enumerate(request.prompts):
            try:
                engine.add_request(rids[i], list(prompt.ids), params, **how)
            except Exception:
                for rid in rids[:i]:
                    engine.abort(rid)
                raise
        for i in range(n):
            loop.watch(rids[i], on_output(i))

    added = 0
    try:
        loop.call(add_all)
        added = n
        deadline = time.monotonic() + budget_s
        while not done.wait(poll_s):
            if time.monotonic() > deadline or not context.is_active():
                context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"embedding of {request.request_id!r} did not finish in time; raise the "
                    f"deadline",
                )
    except Exception as e:
        for i in range(added):
            if outputs[i] is None:
                loop.abort(rids[i], "embedding call ended")
        abort_for_engine_error(context, e)
        raise
    reply = worker_pb2.WorkerEmbedResponse()
    for i, out in enumerate(outputs):
        if out.pooled is None:  # aborted inside the engine (a role flip, a shutdown)
            context.abort(
                grpc.StatusCode.ABORTED,
                f"embedding of prompts[{i}] ended without a vector: {out.outputs[0].finish_reason}",
            )
        reply.embeddings.append(
            pdserve_pb2.Embedding(
                index=i, values=out.pooled.tolist(), prompt_tokens=len(out.prompt_token_ids)
            )
        )
        reply.num_cached_tokens += out.num_cached_tokens
    return reply
