"""What `pdserve up` and the CLI check against real listeners and processes: a busy router port
(which gRPC alone would bind again) and a host that is not this machine are refused before `up`
waits, and the first router keeps serving; a bad cluster secret is refused before Ray is imported
(the CLI in a process of its own); the CLI client reaches a TLS router with --tls-ca; and
--version answers from the command and from `python -m pdserve`. What `up` checks without a socket
or a process: tests/unit/test_deploy_checks.py."""

from __future__ import annotations

import pathlib
import sys
import time
from concurrent import futures

import grpc
import pytest

from helpers.ports import free_ports
from helpers.tls import tls_files
from pdserve.cli import main
from pdserve.deploy import launcher
from pdserve.deploy.launcher import DeployError


# ---- the router's port -----------------------------------------------------------------------------
def grpc_server_on(address: str) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(2))
    port = server.add_insecure_port(address)
    server.start()
    return server, port


def test_grpc_alone_binds_a_port_in_use_but_the_probe_does_not():
    """Why check_port_free exists: gRPC's SO_REUSEPORT lets a second server bind a busy port."""
    first, port = grpc_server_on("127.0.0.1:0")
    try:
        second = grpc.server(futures.ThreadPoolExecutor(1))
        assert second.add_insecure_port(f"127.0.0.1:{port}") == port  # no error from gRPC
        second.stop(None)
        with pytest.raises(DeployError) as e:
            launcher.check_port_free("127.0.0.1", port)
        assert str(e.value).startswith(f"router.port: 127.0.0.1:{port} is already in use")
        with pytest.raises(DeployError, match="router.port: 0.0.0.0"):  # wildcard covers loopback
            launcher.check_port_free("0.0.0.0", port)
    finally:
        first.stop(None)


def test_a_wildcard_listener_blocks_loopback_too():
    first, port = grpc_server_on("0.0.0.0:0")
    try:
        with pytest.raises(DeployError, match="already in use"):
            launcher.check_port_free("127.0.0.1", port)
    finally:
        first.stop(None)


def test_a_port_freed_by_a_stopped_router_is_free_again():
    server, port = grpc_server_on("127.0.0.1:0")
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # leaves connections behind
        grpc.channel_ready_future(channel).result(timeout=10)
    server.stop(None).wait(5)
    launcher.check_port_free("127.0.0.1", port)  # TIME_WAIT does not count as in use
    launcher.check_port_free("127.0.0.1", 0)  # 0: any free port, nothing to check


def test_a_host_that_is_not_this_machine_is_named():
    with pytest.raises(
        DeployError, match=r"router: cannot listen on 192\.0\.2\.1:\d+ .*router\.host"
    ):
        launcher.check_port_free("192.0.2.1", free_ports(1)[0])  # TEST-NET-1: nobody's address


def test_cli_up_on_a_busy_port_fails_at_once_and_the_first_router_keeps_serving(
    tmp_path, capsys, monkeypatch, tiny_models
):
    import ray

    from pdserve.protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc
    from pdserve.router.server import Router, RouterConfig

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray.init was called"))
    model_dir = tiny_models("llama-gqa")[0]
    first = Router(RouterConfig(model=model_dir, port=0)).start()
    try:
        port = int(first.address.rsplit(":", 1)[1])
        path = tmp_path / "second.yaml"
        path.write_text(f"model: {model_dir}\nrouter: {{host: 127.0.0.1, port: {port}}}\n")
        capsys.readouterr()  # the fixture's own output
        t0 = time.monotonic()
        assert main(["up", str(path)]) == 2
        assert time.monotonic() - t0 < 10
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            f"pdserve: router.port: 127.0.0.1:{port} is already in use (another pdserve "
            f"up?); stop that, or set router.port to a free port (0 picks one)"
        ]
        with grpc.insecure_channel(first.address) as channel:  # the first one answers as before
            models = pdserve_pb2_grpc.PDServeStub(channel).ListModels(
                pdserve_pb2.ListModelsRequest(), timeout=10
            )
        assert len(models.models) == 1
    finally:
        first.stop()


# ---- the cluster secret ----------------------------------------------------------------------------
def test_cli_up_refuses_a_bad_secret_without_importing_ray(tmp_path):
    import subprocess

    path = tmp_path / "bad.yaml"
    path.write_text("security: {cluster_secret: short-secret}\n")
    code = (
        "import sys; from pdserve.cli import main; rc = main(['up', sys.argv[1]]); "
        "assert 'ray' not in sys.modules, 'ray imported'; sys.exit(rc)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=pathlib.Path(__file__).parents[2],
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        f"pdserve: {path}: security.cluster_secret: must have at least "
        f"16 characters, has 12; leave it unset and pdserve up makes one"
    )


# ---- the CLI client against a router with router.tls -------------------------------------------------
def test_cli_client_reaches_a_tls_router_with_tls_ca(tmp_path, tiny_models, capsys):
    from pdserve.protos.security import TLSConfig
    from pdserve.router.server import Router, RouterConfig

    files = tls_files(tmp_path)
    tls = TLSConfig(b"", files["cert"].read_bytes(), files["key"].read_bytes())
    router = Router(RouterConfig(model=tiny_models("llama-gqa")[0], port=0, client_tls=tls)).start()
    try:
        capsys.readouterr()
        # through TLS the router itself answers: it has no worker yet
        assert (
            main(["generate", "t5 t6", "--router", router.address, "--tls-ca", str(files["ca"])])
            == 1
        )
        assert "worker is registered with the router" in capsys.readouterr().err
        # plaintext does not get through its TLS port: nothing was sent (2), and the line says
        # what to pass
        assert main(["generate", "t5 t6", "--router", router.address]) == 2
        err = capsys.readouterr().err
        assert "worker is registered" not in err and "--tls-ca" in err
        missing = str(tmp_path / "nope.pem")
        assert main(["generate", "t5", "--router", router.address, "--tls-ca", missing]) == 2
        assert f"cannot read {tmp_path / 'nope.pem'}" in capsys.readouterr().err
    finally:
        router.stop()


def test_version_from_the_command_and_from_python_m(capsys):
    import subprocess

    from pdserve import __version__

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"pdserve {__version__}"
    ran = subprocess.run(
        [sys.executable, "-m", "pdserve", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=pathlib.Path(__file__).parents[2],
    )
    assert ran.returncode == 0 and ran.stdout.strip() == f"pdserve {__version__}", ran.stderr
