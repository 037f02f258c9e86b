"""The router's default sampling from the model's generation_config.json (router/server.py
service_options, router/service.py with_model_defaults), as vLLM's server applies its
`--generation-config auto`: a Generate request, over gRPC or from the HTTP front, that leaves
temperature, top_p, top_k, min_p, repetition_penalty or max_tokens unset runs with the model's
value; its own value always wins, even one equal to the engine's default. The model's max_tokens
stands in for an unset one and for the HTTP front's "until the context is full" (a chat without
max_tokens), capped by the room the prompt leaves. "vllm" takes none, and the router's start
log says which it took."""

from __future__ import annotations

import json
import logging
import types

import pytest

from pdserve.engine.loader.generation_config import FILE_NAME
from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.openai.chat import chat_request
from pdserve.router.openai.protocol import ChatCompletionRequest
from pdserve.router.server import Router, RouterConfig, service_options
from pdserve.router.service import PDServeServicer, ServiceOptions, with_model_defaults

MAX_MODEL_LEN = 512
DEFAULTS = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 100}


class _Aborted(Exception):
    pass


class _Context:
    def abort(self, code, details):
        raise _Aborted(code, details)


@pytest.fixture
def model_dir(tiny_models, tmp_path):
    """A folder with the tiny llama's config.json and a generation_config.json with defaults."""
    src, _ = tiny_models("llama-gqa")
    (tmp_path / "config.json").write_text(open(f"{src}/config.json").read())
    gen = {"eos_token_id": 1, "temperature": 0.6, "top_k": 20, "top_p": 0.95}
    (tmp_path / FILE_NAME).write_text(json.dumps({**gen, "max_new_tokens": 100}))
    return tmp_path


def servicer(defaults: dict) -> PDServeServicer:
    """The servicer as a request's sampling needs it: its options, no pool, no tokenizer."""
    one = object.__new__(PDServeServicer)
    one.options = ServiceOptions(
        model_id="m",
        max_model_len=MAX_MODEL_LEN,
        vocab_size=256,
        dtype="float32",
        sampling_defaults=tuple(defaults.items()),
    )
    one.sampling_defaults = dict(defaults)
    one.encoder = types.SimpleNamespace(with_prediction=lambda request: request.sampling)
    one.reasoning_tags = None
    return one


def run_sampling(defaults: dict, request, prompt_len: int = 10) -> pdserve_pb2.SamplingParams:
    request, _ = servicer(defaults)._as_run(request, [5] * prompt_len, _Context())
    return request.sampling


def test_the_router_reads_the_models_defaults_unless_vllm(model_dir, caplog):
    options = service_options(RouterConfig(model=str(model_dir)), model_dir)
    assert dict(options.sampling_defaults) == DEFAULTS
    config = RouterConfig(model=str(model_dir), generation_config="vllm")
    assert service_options(config, model_dir).sampling_defaults == ()
    router = object.__new__(Router)
    router.config = RouterConfig(model=str(model_dir))
    with caplog.at_level(logging.INFO, logger="pdserve.router.server"):
        router._log_sampling_defaults(options)
    assert "overridden by the model's Hugging Face generation config" in caplog.text
    assert "temperature=0.6, top_k=20, top_p=0.95, max_tokens=100" in caplog.text
    with pytest.raises(ValueError, match="RouterConfig.generation_config must be"):
        RouterConfig(model=str(model_dir), generation_config="")


def test_a_grpc_request_gets_the_defaults_only_where_it_left_a_field_unset():
    unset = pdserve_pb2.GenerateRequest(text="t5")
    s = run_sampling(DEFAULTS, unset)
    assert (s.temperature, s.top_k, s.max_tokens) == (0.6, 20, 100)
    assert s.top_p == pytest.approx(0.95)
    assert not s.HasField("min_p") and not s.HasField("repetition_penalty")
    own = pdserve_pb2.GenerateRequest(
        text="t5", sampling=pdserve_pb2.SamplingParams(temperature=1.0, top_k=0, max_tokens=7)
    )
    s = run_sampling(DEFAULTS, own)  # its own values win, the engine's defaults among them
    assert (s.temperature, s.top_k, s.max_tokens) == (1.0, 0, 7)
    assert s.top_p == pytest.approx(0.95)
    assert run_sampling({}, unset) == unset.sampling  # no defaults: as sent


def test_the_models_max_tokens_is_a_cap_on_what_the_prompt_leaves():
    s = run_sampling(DEFAULTS, pdserve_pb2.GenerateRequest(text="t5"), MAX_MODEL_LEN - 30)
    assert s.max_tokens == 30
    big = {"max_tokens": 10 * MAX_MODEL_LEN}
    assert (
        run_sampling(big, pdserve_pb2.GenerateRequest(text="t5")).max_tokens == MAX_MODEL_LEN - 10
    )


def test_an_http_chat_without_max_tokens_gets_the_models_defaults():
    front = types.SimpleNamespace(
        settings=types.SimpleNamespace(max_model_len=MAX_MODEL_LEN),
        check_prompt_size=lambda texts, param: None,
        think_special=False,
        tags_special=False,
    )
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "t5"}]})
    s = run_sampling(DEFAULTS, chat_request(front, body))
    assert (s.temperature, s.top_k, s.max_tokens) == (0.6, 20, 100)
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "t5"}], "temperature": 0.2, "max_tokens": 9}
    )
    s = run_sampling(DEFAULTS, chat_request(front, body))
    assert (s.temperature, s.top_k, s.max_tokens) == (pytest.approx(0.2), 20, 9)


def test_a_cap_the_client_set_up_to_the_context_is_its_own():
    sampling = pdserve_pb2.SamplingParams(max_tokens=MAX_MODEL_LEN)
    kept, capped = with_model_defaults(sampling, DEFAULTS, MAX_MODEL_LEN, up_to_context=True)
    assert kept.max_tokens == MAX_MODEL_LEN and not capped and kept.temperature == 0.6
    same, capped = with_model_defaults(sampling, {}, MAX_MODEL_LEN)
    assert same is sampling and not capped
