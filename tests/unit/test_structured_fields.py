"""The structured-output fields at the edges, without sockets: the gRPC bounds
(protos/limits.py check_structured), the proto <-> engine conversion (protos/convert.py), and the
HTTP bodies' fields (router/openai/protocol.py): what each becomes, and the 400 naming the field
for bad values, including a workers' compile refusal renamed to the body's field."""

from __future__ import annotations

import json

import grpc
import pytest
from pydantic import ValidationError

from pdserve.engine import SamplingParams
from pdserve.engine.structured.spec import StructuredSpec
from pdserve.protos.convert import sampling_kwargs, structured_dict, structured_message
from pdserve.protos.limits import MAX_CHOICES, MAX_REGEX_CHARS, check_sampling
from pdserve.protos.pdserve.v1 import pdserve_pb2
from pdserve.router.openai.errors import ApiError, validation_error
from pdserve.router.openai.protocol import (
    KNOWN_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    name_field,
    sampling_params,
)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
MESSAGES = [{"role": "user", "content": "hi"}]


def _sampling(**structured) -> pdserve_pb2.SamplingParams:
    s = pdserve_pb2.SamplingParams()
    s.structured.CopyFrom(pdserve_pb2.StructuredOutput(**structured))
    return s


@pytest.mark.parametrize(
    "structured, words",
    [
        ({}, "exactly one of"),
        (dict(regex="a", json_object=True), "exactly one of"),
        (dict(regex="a" * (MAX_REGEX_CHARS + 1)), "sampling.structured.regex"),
        (dict(choice=["x"] * (MAX_CHOICES + 1)), "sampling.structured.choice"),
        (dict(choice=["x", ""]), "sampling.structured.choice"),
        (dict(json_schema="x" * (1 << 20)), "sampling.structured.json_schema"),
    ],
)
def test_grpc_bounds_refuse_naming_the_field(structured, words):
    refusal = check_sampling(_sampling(**structured), 256, 1000)
    assert refusal is not None and refusal.code == grpc.StatusCode.INVALID_ARGUMENT
    assert words in refusal.message


@pytest.mark.parametrize(
    "spec",
    [
        {"json_schema": SCHEMA},
        {"json_object": True},
        {"regex": r"\d+"},
        {"choice": ["a", "b c"]},
    ],
)
def test_proto_round_trip_to_the_engine(spec):
    s = pdserve_pb2.SamplingParams(max_tokens=5)
    structured_message(s.structured, spec)
    assert check_sampling(s, 256, 1000) is None
    back = pdserve_pb2.SamplingParams.FromString(s.SerializeToString())
    params = SamplingParams(**sampling_kwargs(back))
    assert params.structured == StructuredSpec(**spec) or params.structured.key == (
        StructuredSpec(**spec).key
    )
    assert structured_dict(back.structured).keys() == spec.keys()


def test_unset_field_is_no_structure():
    assert "structured" not in sampling_kwargs(pdserve_pb2.SamplingParams(max_tokens=3))
    assert SamplingParams().structured is None


def _body(cls, **fields):
    base = {"messages": MESSAGES} if cls is ChatCompletionRequest else {"prompt": "hi"}
    return cls.model_validate_json(json.dumps({**base, **fields}))


@pytest.mark.parametrize(
    "cls, fields, spec, param",
    [
        (
            ChatCompletionRequest,
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": SCHEMA, "strict": True},
                }
            },
            {"json_schema": SCHEMA},
            "response_format.json_schema.schema",
        ),
        (
            ChatCompletionRequest,
            {"response_format": {"type": "json_object"}},
            {"json_object": True},
            "response_format",
        ),
        (
            CompletionRequest,
            {"response_format": {"type": "json_object"}},
            {"json_object": True},
            "response_format",
        ),
        (
            CompletionRequest,
            {"structured_outputs": {"json": SCHEMA}},
            {"json_schema": SCHEMA},
            "structured_outputs.json",
        ),
        (
            CompletionRequest,
            {"structured_outputs": {"json": json.dumps(SCHEMA)}},
            {"json_schema": SCHEMA},
            "structured_outputs.json",
        ),
        (
            ChatCompletionRequest,
            {"structured_outputs": {"regex": "a+"}},
            {"regex": "a+"},
            "structured_outputs.regex",
        ),
        (
            ChatCompletionRequest,
            {"structured_outputs": {"choice": ["x"]}},
            {"choice": ["x"]},
            "structured_outputs.choice",
        ),
        (
            CompletionRequest,
            {"structured_outputs": {"json_object": True}},
            {"json_object": True},
            "structured_outputs.json_object",
        ),
        (CompletionRequest, {"guided_json": SCHEMA}, {"json_schema": SCHEMA}, "guided_json"),
        (CompletionRequest, {"guided_regex": "b"}, {"regex": "b"}, "guided_regex"),
        (
            ChatCompletionRequest,
            {"guided_choice": ["p", "q"]},
            {"choice": ["p", "q"]},
            "guided_choice",
        ),
    ],
)
def test_http_fields_become_the_spec(cls, fields, spec, param):
    body = _body(cls, **fields)
    assert body.structured_spec() == (spec, param)
    s = sampling_params(body, 10)
    assert structured_dict(s.structured) == StructuredSpec(**spec).to_wire() or (
        StructuredSpec(**structured_dict(s.structured)).key == StructuredSpec(**spec).key
    )


def test_text_format_is_no_structure():
    body = _body(ChatCompletionRequest, response_format={"type": "text"})
    assert body.structured_spec() is None
    assert not sampling_params(body, 10).HasField("structured")


@pytest.mark.parametrize(
    "fields, param",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": [1]},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "bad name!", "schema": {}},
                }
            },
            "response_format.json_schema.name",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_object", "extra": 1}}, "response_format.extra"),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
        ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice[1]"),
        ({"structured_outputs": {"json": "{nope"}}, "structured_outputs.json"),
        ({"structured_outputs": {"grammar": ""}}, "structured_outputs.grammar"),
        ({"guided_grammar": "x" * (64 * 1024 + 1)}, "guided_grammar"),
        ({"guided_grammar": "start: x", "guided_regex": "a"}, None),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"guided_choice": "ab"}, "guided_choice"),
        ({"guided_json": [1]}, "guided_json"),
        ({"guided_json": {"x": "y" * 70000}}, "guided_json"),
        ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, None),
        ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, None),
    ],
)
def test_bad_http_values_name_the_field(fields, param):
    with pytest.raises(ValidationError) as e:
        _body(ChatCompletionRequest, **fields)
    err = validation_error(e.value, KNOWN_FIELDS)
    assert err.status == 400 and err.param == param, err.message
    if param:
        assert err.message.startswith(f"{param}: "), err.message


def test_worker_refusal_is_renamed_to_the_bodys_field():
    body = _body(CompletionRequest, structured_outputs={"regex": "("})
    err = ApiError(400, "sampling: structured.regex cannot be compiled: parenthesis not closed")
    name_field(err, body)
    assert err.param == "structured_outputs.regex"
    assert err.message == "structured_outputs.regex: cannot be compiled: parenthesis not closed"
    other = ApiError(400, "sampling.n=0: at least 1 sequence per prompt")
    name_field(other, body)
    assert other.param is None and other.message.startswith("sampling.n")
    plain = ApiError(400, "sampling: structured.regex cannot be compiled: x")
    name_field(plain, _body(CompletionRequest))  # no structure asked: left alone
    assert plain.param is None
