"""security.tls: router, workers and the KV channel speak mutual TLS. A deployment with it serves
the same tokens as one without; a process that knows the secret but has no certificate signed by
the deployment's CA gets no connection to any port, and plaintext gets none either."""

from __future__ import annotations

import grpc
import pytest

from helpers.chaos import RPC_TIMEOUT, SECRET, SECURITY, SecureCluster, stream
from helpers.tls import tls_files
from pdserve.protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.protos.security import ClusterSecurity, TLSConfig

SAMPLING = pdserve_pb2.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = list(range(2, 30))


@pytest.fixture(scope="module")
def clusters(tiny_models, tmp_path_factory):
    files = tls_files(tmp_path_factory.mktemp("tls"))
    tls = TLSConfig(files["ca"].read_bytes(), files["cert"].read_bytes(), files["key"].read_bytes())
    model_dir, _ = tiny_models("llama-gqa")
    secure = SecureCluster(model_dir, security=ClusterSecurity(SECRET, tls=tls))
    plain = SecureCluster(model_dir)
    yield secure, plain, tls
    secure.stop()
    plain.stop()


def test_a_mutual_tls_deployment_serves_the_same_tokens(clusters):
    secure, plain, _ = clusters
    ids, finish, how = stream(secure.api, PROMPT, SAMPLING)
    assert how == "finished" and len(ids) == 8
    assert ids == stream(plain.api, PROMPT, SAMPLING)[0]
    assert finish.timings.transfer_end_unix_ns > 0  # the KV went over the TLS channel


def test_without_a_signed_certificate_no_port_answers(clusters):
    secure, _, tls = clusters
    # the secret and the CA, but no client certificate: the handshake fails, whatever the call
    no_cert = grpc.ssl_channel_credentials(root_certificates=tls.ca_pem)
    for address, call in (
        (
            secure.router.address,
            lambda ch: worker_pb2_grpc.RegistryStub(ch).Heartbeat(
                worker_pb2.HeartbeatRequest(worker_id="d0"),
                metadata=SECURITY.metadata(),
                timeout=RPC_TIMEOUT,
            ),
        ),
        (
            secure.router.address,
            lambda ch: list(
                pdserve_pb2_grpc.PDServeStub(ch).Generate(
                    pdserve_pb2.GenerateRequest(
                        token_ids=pdserve_pb2.TokenIds(ids=PROMPT), sampling=SAMPLING
                    ),
                    timeout=RPC_TIMEOUT,
                )
            ),
        ),
        (
            secure.decode.address,
            lambda ch: worker_pb2_grpc.DecodeWorkerStub(ch).Stats(
                worker_pb2.StatsRequest(), metadata=SECURITY.metadata(), timeout=RPC_TIMEOUT
            ),
        ),
    ):
        for channel in (grpc.secure_channel(address, no_cert), grpc.insecure_channel(address)):
            with channel, pytest.raises(grpc.RpcError) as err:
                call(channel)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    # the workers are still registered and serving
    assert stream(secure.api, PROMPT, SAMPLING)[2] == "finished"
