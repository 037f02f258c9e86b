"""Scoring, reranking and classification over HTTP, in vLLM's shapes (and Jina's and Cohere's for
rerank): POST /v1/score (and /score), /v1/rerank (and /rerank, /v2/rerank), /classify (and
/v1/classify). Every one runs through the router's gRPC Embed (router/service.py) on the prefill
pool, as /v1/embeddings does, and keeps no state of its own.

    /v1/score  {"text_1" | "queries" | "data_1": str | [str], "text_2" | "documents" | "items" |
                "data_2": str | [str], "model"?, "use_activation"?, "truncate_prompt_tokens"?,
                "priority"?, "user"?}   1:1, 1:N or N:N pairs
      -> {"id", "object": "list", "created", "model", "data": [{"index", "object": "score",
          "score"}], "usage": {"prompt_tokens", "total_tokens", "completion_tokens": 0}}
    /v1/rerank {"query": str, "documents": [str | {"text": str}], "top_n"? (0: all),
                "return_documents"? (true), "model"?, "use_activation"?, ...}
      -> {"id", "model", "usage", "results": [{"index", "document": {"text"},
          "relevance_score"}]}, best first
    /classify  {"input": str | [str] | [ids] | [[ids]], "model"?, "use_activation"?, ...}
      -> {"id", "object": "list", "created", "model", "data": [{"index", "label", "probs",
          "num_classes"}], "usage"}

How a pair is scored depends on the model. One with a classification head (a
*ForSequenceClassification checkpoint, or `classifier_from_token`: engine/score_head.py) is a
cross-encoder, and each pair is one prompt, made as vLLM makes it: where the deployment gives a
chat_template, the pair rendered by it as a "query" and a "document" message (vLLM's score
template); else, where the model's config.json leaves use_pad_token true, the tokenizer's pair
encoding of the two texts (a BERT-like tokenizer's separators, a Llama one's second BOS: how a
cross-encoder trained on pairs reads them); else (use_pad_token false: a reranker converted from
a generative model, whose own template, e.g. Qwen3-Reranker's, is in the texts the client
sends) the query's text followed by the document's. Its score is the last label's probability:
sigmoid of a single label's logit, or of
the last label's logit less the first's for two labels (softmax's: "yes" of ["no", "yes"]). A
model without one is a bi-encoder: the score is the cosine similarity of the two texts'
embeddings (vLLM's way for an embedding model). `use_activation: false` gives the logit (the
log-odds) instead of the probability, and raw logits from /classify instead of softmax.

`model` may name a LoRA adapter, under which every prompt runs, and the answer's `model` is the
name sent, as /v1/embeddings'. Usage counts a cross-encoder's pair prompts; a bi-encoder's as
vLLM does, each pair's two texts (and a pad token between them where the tokenizer has one),
though each distinct text is embedded once. Each input, pair prompt or text is held to
max_model_len's bytes on its own, unless truncate_prompt_tokens is set (each then keeps its
first k tokens after tokenizing, as /v1/embeddings').
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from typing import Annotated

import torch
from fastapi import APIRouter, Request
from pydantic import Field, StrictBool, StrictInt, StrictStr, model_validator

from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.openai.embeddings import IdLists, Ids, Texts, check_texts, embed_inputs
from pdserve.router.openai.errors import ApiError, request_too_large
from pdserve.router.openai.generate import _cancel_on_disconnect, _from_router
from pdserve.router.openai.protocol import (
    Priority,
    ShortStr,
    TruncatePromptTokens,
    _field_names,
    _Strict,
)
from pdserve.router.openai.state import state_of

router = APIRouter()

# documents of one rerank, and pairs of one score, at most (Cohere's limit on documents); a bi-
# encoder's texts (2 per pair at most) stay within the router's inputs per Embed call
MAX_DOCUMENTS = 1000
Docs = Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_DOCUMENTS)]
Side = StrictStr | Docs
# (the pair fields' names in the order vLLM tries them: first side, second side)
PAIR_FIELDS = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"))
PAIR_FIELDS += (("data_1", "data_2"),)


class _ScoringCommon(_Strict):
    model: ShortStr | None = None
    user: ShortStr | None = None
    priority: Priority = 0
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    # vLLM's: None or true, the probability; false, the logit it comes from
    use_activation: StrictBool | None = None


class ScoreRequest(_ScoringCommon):
    text_1: Side | None = None
    text_2: Side | None = None
    queries: Side | None = None
    documents: Side | None = None
    items: Side | None = None
    data_1: Side | None = None
    data_2: Side | None = None

    @model_validator(mode="after")
    def _one_pair_of_fields(self):
        given = [(a, b) for a, b in PAIR_FIELDS if getattr(self, a) is not None]
        set_fields = {n for a, b in PAIR_FIELDS for n in (a, b) if getattr(self, n) is not None}
        pairs = [(a, b) for a, b in given if getattr(self, b) is not None]
        if len(pairs) != 1 or set_fields != set(pairs[0]):
            raise ValueError(
                "name the texts as one pair of fields: text_1 and text_2, queries and documents, "
                "queries and items, or data_1 and data_2"
            )
        first, second = (getattr(self, n) for n in pairs[0])
        first = [first] if isinstance(first, str) else first
        second = [second] if isinstance(second, str) else second
        if len(first) > 1 and len(first) != len(second):
            raise ValueError(
                f"{pairs[0][0]} has {len(first)} texts and {pairs[0][1]} {len(second)}: pair them "
                "1:1, 1:N or N:N"
            )
        return self

    def fields(self) -> tuple[str, str]:
        """The pair of fields the texts came in."""
        return next(
            (a, b)
            for a, b in PAIR_FIELDS
            if getattr(self, a) is not None and getattr(self, b) is not None
        )

    def pairs(self) -> list[tuple[str, str]]:
        """The (first, second) texts of each pair, in order."""
        a, b = self.fields()
        first, second = getattr(self, a), getattr(self, b)
        first = [first] if isinstance(first, str) else first
        second = [second] if isinstance(second, str) else second
        if len(first) == 1:
            first = first * len(second)
        return list(zip(first, second, strict=True))


class RerankDocument(_Strict):
    text: StrictStr


class RerankRequest(_ScoringCommon):
    query: StrictStr
    documents: Annotated[
        list[StrictStr | RerankDocument], Field(min_length=1, max_length=MAX_DOCUMENTS)
    ]
    top_n: Annotated[StrictInt, Field(ge=0)] = 0  # 0: every document
    return_documents: StrictBool = True  # Cohere's: false leaves each result's document out

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ClassifyRequest(_ScoringCommon):
    input: StrictStr | Texts | Ids | IdLists


SCORE_FIELDS = _field_names(ScoreRequest)
RERANK_FIELDS = _field_names(RerankRequest)
CLASSIFY_FIELDS = _field_names(ClassifyRequest)


def _sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


def pair_logit(logits, labels: int) -> float:
    """A cross-encoder's relevance as a logit: one label's own, or the last less the first of
    two (the log-odds of the last label under softmax)."""
    if labels == 1:
        return float(logits[0])
    return float(logits[-1]) - float(logits[0])


def probabilities(logits) -> list[float]:
    """softmax of a classifier's logits; sigmoid for a single label."""
    if len(logits) == 1:
        return [_sigmoid(float(logits[0]))]
    top = max(logits)
    exps = [math.exp(float(v) - top) for v in logits]
    total = sum(exps)
    return [e / total for e in exps]


async def _embed(request: Request, front, body, metadata, inputs, task: int, param: str):
    """Embed's reply for `inputs` (EmbedInput messages, of the body's field `param`), cancelled
    if the client leaves."""
    call = pdserve_pb2.EmbedRequest(
        request_id=f"http-{uuid.uuid4().hex}",
        model=body.model or "",
        priority=body.priority,
        task=task,
    )
    call.inputs.extend(inputs)
    if body.truncate_prompt_tokens is not None:
        call.truncate_prompt_tokens = body.truncate_prompt_tokens
    front.check_request_size(call, param)
    rpc = front.stub.Embed(call, metadata=metadata)
    watcher = asyncio.create_task(_cancel_on_disconnect(request, rpc))
    try:
        return await _from_router(rpc, watcher)
    finally:
        watcher.cancel()


async def _scores(request: Request, front, body, metadata, pairs, param: str):
    """(each pair's score, prompt tokens): a cross-encoder's where the model has a head, else
    the cosine similarity of the two embeddings (module docstring)."""
    labels = front.settings.labels
    activation = body.use_activation is not False
    if labels:
        if len(labels) > 2:
            raise ApiError(
                400,
                f"scoring needs a model with one or two labels; this one has {len(labels)} "
                f"({', '.join(labels[:8])}): use /classify",
                param=param,
            )
        _check_pair_bytes(front, pairs, param)
        inputs = [
            await _pair_input(front, body, f"{param}[{i}]", a, b) for i, (a, b) in enumerate(pairs)
        ]
        task = pdserve_pb2.POOLING_TASK_CLASSIFY
        reply = await _embed(request, front, body, metadata, inputs, task, param)
        logits = [pair_logit(e.values, len(labels)) for e in reply.embeddings]
        scores = [_sigmoid(v) if activation else v for v in logits]
        return scores, reply.prompt_tokens
    unique = list(dict.fromkeys(t for pair in pairs for t in pair))
    if body.truncate_prompt_tokens is None:  # else cut to k tokens (router/service.py)
        for text in unique:
            front.check_prompt_size([text], param)
    inputs = [pdserve_pb2.EmbedInput(text=t) for t in unique]
    task = pdserve_pb2.POOLING_TASK_EMBED
    reply = await _embed(request, front, body, metadata, inputs, task, param)
    where = {t: i for i, t in enumerate(unique)}
    index = [(where[a], where[b]) for a, b in pairs]
    # off the event loop: up to MAX_DOCUMENTS pairs of model-wide vectors
    scores = await asyncio.to_thread(_cosines, [list(e.values) for e in reply.embeddings], index)
    return scores, _pair_tokens(front, reply, index)


async def _pair_input(front, body, param: str, query: str, document: str):
    """One cross-encoder pair as the Embed input its model reads (module docstring): the
    deployment's score template's rendering, the tokenizer's pair encoding, or the two texts
    joined."""
    settings, k = front.settings, body.truncate_prompt_tokens
    if settings.score_template:
        text = await front.encode(param, settings.encoder.render_pair, query, document)
    elif settings.pair_encoding:
        keep = None if k is None else k if k >= 1 else settings.max_model_len - 1
        ids = await front.encode(param, settings.encoder.tokenize_pair, query, document, keep)
        return pdserve_pb2.EmbedInput(token_ids=pdserve_pb2.TokenIds(ids=ids))
    else:
        text = query + document
    if k is None:  # else cut to k tokens (router/service.py)
        front.check_prompt_size([text], param)
    return pdserve_pb2.EmbedInput(text=text)


def _pair_tokens(front, reply, index: list[tuple[int, int]]) -> int:
    """A bi-encoder's usage as vLLM counts it (its BiEncoderIOProcessor): each pair's first
    text's tokens, a pad token where the tokenizer has one, and its second text's tokens, a text
    counted once per pair it is in, though each distinct text is embedded once."""
    sizes = [e.prompt_tokens for e in reply.embeddings]
    pad = int(getattr(front.settings.tokenizer, "pad_token_id", None) is not None)
    return sum(sizes[i] + pad + sizes[j] for i, j in index)


def _check_pair_bytes(front, pairs: list[tuple[str, str]], param: str) -> None:
    """Refuses (413) a cross-encoder's pairs whose texts come to more than one request to the
    router takes (the front's body limit where it does not know the router's), before any pair
    is built: each pair repeats its first text, so a long query with many documents would make
    a request about a thousand times the body's size. Each distinct text is measured once."""
    limit = front.max_request_bytes or front.settings.max_body_bytes
    sizes: dict[str, int] = {}
    total = 0
    for pair in pairs:
        for text in pair:
            size = sizes.get(text)
            if size is None:
                size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
                sizes[text] = size
            total += size
    if total > limit:
        raise request_too_large(
            f"its {len(pairs)} pairs (each with its own copy of the first text) come to {total} "
            f"bytes of text, more than the {limit} one request to the router takes",
            param,
            f"send fewer {param} or a shorter first text (the query)",
        )


def _cosines(vectors: list[list[float]], pairs: list[tuple[int, int]]) -> list[float]:
    """The cosine similarity of each pair (i, j) of `vectors` (0 where one is all zeros)."""
    unit = torch.nn.functional.normalize(torch.tensor(vectors, dtype=torch.float32), dim=-1)
    first = torch.tensor([i for i, _ in pairs])
    second = torch.tensor([j for _, j in pairs])
    return (unit[first] * unit[second]).sum(-1).tolist()


def _input_error(err: ApiError, param: str) -> ApiError:
    """The router's 400 on `inputs[i]` named as the request's field."""
    if err.status == 400 and err.message.startswith("inputs"):
        err.message, err.param = param + err.message[len("inputs") :], param
    return err


@router.post("/v1/score")
@router.post("/score")
async def score(request: Request):
    front = state_of(request)
    body, metadata = await front.parse(request, ScoreRequest, SCORE_FIELDS)
    front.check_model(body.model)
    pairs = body.pairs()
    param = body.fields()[1]
    try:
        scores, tokens = await _scores(request, front, body, metadata, pairs, param)
    except ApiError as err:
        raise _input_error(err, param) from None
    return {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": body.model or front.settings.model_id,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
    }


@router.post("/v1/rerank")
@router.post("/rerank")
@router.post("/v2/rerank")
async def rerank(request: Request):
    front = state_of(request)
    body, metadata = await front.parse(request, RerankRequest, RERANK_FIELDS)
    front.check_model(body.model)
    docs = body.texts()
    try:
        scores, tokens = await _scores(
            request, front, body, metadata, [(body.query, d) for d in docs], "documents"
        )
    except ApiError as err:
        raise _input_error(err, "documents") from None
    order = sorted(range(len(docs)), key=lambda i: -scores[i])
    if body.top_n:
        order = order[: body.top_n]
    results = []
    for i in order:
        one = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            one["document"] = {"text": docs[i]}
        results.append(one)
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": body.model or front.settings.model_id,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "results": results,
    }


@router.post("/classify")
@router.post("/v1/classify")
async def classify(request: Request):
    front = state_of(request)
    body, metadata = await front.parse(request, ClassifyRequest, CLASSIFY_FIELDS)
    front.check_model(body.model)
    labels = front.settings.labels
    inputs = embed_inputs(body.input)
    # each input on its own, as /v1/embeddings: the call's whole work is bounded as that one's
    # is, by MAX_EMBED_INPUTS inputs and the request's size (_embed: check_request_size)
    check_texts(front, body, inputs, "input")
    try:
        task = pdserve_pb2.POOLING_TASK_CLASSIFY
        reply = await _embed(request, front, body, metadata, inputs, task, "input")
    except ApiError as err:
        raise _input_error(err, "input") from None
    data = []
    for e in reply.embeddings:
        values = list(e.values)
        probs = probabilities(values) if body.use_activation is not False else values
        best = max(range(len(values)), key=values.__getitem__)
        data.append(
            {
                "index": e.index,
                "label": labels[best] if best < len(labels) else str(best),
                "probs": probs,
                "num_classes": len(values),
            }
        )
    tokens = reply.prompt_tokens
    return {
        "id": f"classify-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": body.model or front.settings.model_id,
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
    }
