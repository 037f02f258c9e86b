"""The gRPC definitions in protos/: the generated code imports through the protos package,
messages round-trip, and the services have the methods the workers and the router use. The
generated code against a fresh protoc run, and a real in-process server:
tests/integration/test_protos_server.py."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.protos.pdserve.v1 import pdserve_pb2, worker_pb2, worker_pb2_grpc


def test_generated_code_imports_through_the_protos_package():
    # The messages' module must be importable (pickle, Ray), not protoc's 'pdserve.v1...'.
    assert pdserve_pb2.GenerateRequest.__module__ == "pdserve.protos.pdserve.v1.pdserve_pb2"
    assert worker_pb2.ReserveRequest.__module__ == "pdserve.protos.pdserve.v1.worker_pb2"
    # Canonical file names, as other languages and reflection see them.
    assert pdserve_pb2.DESCRIPTOR.name == "pdserve/v1/pdserve.proto"
    assert [d.name for d in worker_pb2.DESCRIPTOR.dependencies] == ["pdserve/v1/pdserve.proto"]


# -- round trips -----------------------------------------------------------------------------


def _roundtrip(msg):
    parsed = type(msg).FromString(msg.SerializeToString())
    assert parsed == msg
    return parsed


@pytest.mark.parametrize("kind", ["text", "token_ids", "chat"])
def test_generate_request_roundtrip_each_input_kind(kind):
    inputs = {
        "text": dict(text="Hello"),
        "token_ids": dict(token_ids=pdserve_pb2.TokenIds(ids=[1, 2, 49151])),
        "chat": dict(
            chat=pdserve_pb2.ChatMessages(
                messages=[
                    pdserve_pb2.ChatMessage(role="system", content="Be brief."),
                    pdserve_pb2.ChatMessage(role="user", content="Hi"),
                ]
            )
        ),
    }
    req = pdserve_pb2.GenerateRequest(
        request_id="r1",
        model="smollm2",
        deadline_ms=2500,
        **inputs[kind],
        sampling=pdserve_pb2.SamplingParams(
            temperature=0.7,
            max_tokens=32,
            stop=["\n\n"],
            stop_token_ids=[2],
            seed=-3,
            logprobs=True,
        ),
    )
    parsed = _roundtrip(req)
    assert parsed.WhichOneof("input") == kind
    assert parsed.sampling.temperature == 0.7  # double: no float32 rounding of client values
    assert parsed.sampling.seed == -3


def test_sampling_params_unset_differs_from_zero():
    explicit_zero = pdserve_pb2.SamplingParams(
        temperature=0.0, top_k=0, min_tokens=0, ignore_eos=False
    )
    parsed = _roundtrip(explicit_zero)
    for name in ("temperature", "top_k", "min_tokens", "ignore_eos"):
        assert parsed.HasField(name), name
    unset = _roundtrip(pdserve_pb2.SamplingParams())
    for name in ("temperature", "top_k", "min_tokens", "ignore_eos", "seed", "max_tokens"):
        assert not unset.HasField(name), name
    assert parsed != unset
    parsed.ClearField("temperature")
    assert not parsed.HasField("temperature")


def test_sampling_params_mirror_the_engine():
    from pdserve.engine.sampling_params import (
        IN_PROCESS_FIELDS,
        SamplingParams as EngineSamplingParams,
    )

    proto_fields = {f.name: f for f in pdserve_pb2.SamplingParams.DESCRIPTOR.fields}
    engine_fields = {f.name for f in dataclasses.fields(EngineSamplingParams)}
    engine_fields -= set(IN_PROCESS_FIELDS)
    assert set(proto_fields) == engine_fields, (
        "pdserve.v1.SamplingParams and engine/sampling_params.py have drifted apart: "
        f"only in proto {sorted(set(proto_fields) - engine_fields)}, "
        f"only in engine {sorted(engine_fields - set(proto_fields))}"
    )
    for name, field in proto_fields.items():
        # Scalars must carry presence so the server can tell "unset" (engine default) from 0.
        assert field.is_repeated or field.has_presence, f"SamplingParams.{name} must be optional"


def test_generate_response_events_and_stop_reason():
    delta = pdserve_pb2.GenerateResponse(
        request_id="r1",
        delta=pdserve_pb2.TokenDelta(index=1, token_ids=[5, 6], text="ab", logprobs=[-0.5, -1.25]),
    )
    assert _roundtrip(delta).WhichOneof("event") == "delta"
    finish = pdserve_pb2.GenerateResponse(
        request_id="r1",
        finish=pdserve_pb2.Finish(
            index=1,
            finish_reason="stop",
            stop_token=0,
            usage=pdserve_pb2.Usage(prompt_tokens=7, completion_tokens=2, cached_prompt_tokens=4),
            timings=pdserve_pb2.Timings(
                queued_unix_ns=1_700_000_000_000_000_000, decode_worker="d0"
            ),
        ),
    )
    parsed = _roundtrip(finish)
    assert parsed.WhichOneof("event") == "finish"
    # stop_token 0 is a real token id: the oneof keeps it distinguishable from "no stop reason".
    assert parsed.finish.WhichOneof("stop_reason") == "stop_token"
    assert parsed.finish.stop_token == 0
    assert pdserve_pb2.Finish(finish_reason="length").WhichOneof("stop_reason") is None


def test_worker_messages_roundtrip():
    reservation = worker_pb2.ReserveResponse(
        request_id="r1",
        block_ids=[3, 9, 4],
        block_size=16,
        num_cached_tokens=16,
        endpoint=worker_pb2.KVEndpoint(
            backend="grpc",
            address="10.0.0.2:7100",
            layout_fingerprint="abc123",
            tp_size=3,
            rank_addresses=["a:1", "b:1", "c:1"],
        ),
        lease_deadline_unix_ns=2**63,
    )
    prefill = worker_pb2.PrefillRequest(
        request_id="r1",
        prompt_token_ids=list(range(40)),
        sampling=pdserve_pb2.SamplingParams(max_tokens=8),
        reservation=reservation,
    )
    assert _roundtrip(prefill).reservation.endpoint.rank_addresses == ["a:1", "b:1", "c:1"]

    running = _roundtrip(worker_pb2.TokenEvent(token_ids=[11], logprobs=[-0.1]))
    assert not running.HasField("finish_reason")
    done = _roundtrip(worker_pb2.TokenEvent(token_ids=[2], finish_reason="stop", stop_str="\n"))
    assert done.HasField("finish_reason") and done.WhichOneof("stop_reason") == "stop_str"

    register = worker_pb2.RegisterRequest(
        worker_id="d0",
        role="decode",
        address="10.0.0.2:7000",
        kv=reservation.endpoint,
        model=pdserve_pb2.ModelCard(
            id="smollm2", max_model_len=8192, vocab_size=49152, dtype="bfloat16"
        ),
    )
    assert _roundtrip(register).kv.backend == "grpc"
    beat = worker_pb2.HeartbeatRequest(
        worker_id="d0",
        stats=worker_pb2.WorkerStats(
            worker_id="d0", num_free_blocks=10, num_total_blocks=64, queued_prompt_tokens=2**40
        ),
    )
    assert _roundtrip(beat).stats.queued_prompt_tokens == 2**40


def test_worker_services_shape():
    def methods(service: str) -> dict[str, tuple[bool, bool]]:
        desc = worker_pb2.DESCRIPTOR.services_by_name[service]
        return {m.name: (m.client_streaming, m.server_streaming) for m in desc.methods}

    unary = (False, False)
    assert methods("DecodeWorker") == {
        "Reserve": unary,
        "Stream": (False, True),
        "Streams": (True, True),
        "Embed": unary,
        "Abort": unary,
        "Stats": unary,
        "FetchKV": (False, True),
        "LoadLoRA": unary,
        "UnloadLoRA": unary,
        "UpdateWeights": unary,
        "InitWeightsGroup": unary,
        "UpdateWeightsFromGroup": unary,
        "DestroyWeightsGroup": unary,
        "Sleep": unary,
        "WakeUp": unary,
        "ResetPrefixCache": unary,
    }
    assert methods("PrefillWorker") == {
        "Prefill": unary,
        "Embed": unary,
        "Abort": unary,
        "Stats": unary,
        "LoadLoRA": unary,
        "UnloadLoRA": unary,
        "UpdateWeights": unary,
        "InitWeightsGroup": unary,
        "UpdateWeightsFromGroup": unary,
        "DestroyWeightsGroup": unary,
        "Sleep": unary,
        "WakeUp": unary,
        "ResetPrefixCache": unary,
    }
    assert methods("Registry") == {"Register": unary, "Heartbeat": unary}
    for name in (
        "DecodeWorkerServicer",
        "PrefillWorkerServicer",
        "RegistryServicer",
        "DecodeWorkerStub",
        "PrefillWorkerStub",
        "RegistryStub",
    ):
        assert hasattr(worker_pb2_grpc, name), name
