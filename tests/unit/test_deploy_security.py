"""The deployment YAML's security settings: the cluster secret (never shown, its precedence, its
file) and the TLS certificate and key files, read at load, with errors that name key and file."""

from __future__ import annotations

import pathlib

import pytest

from helpers.deploy_config import error_of, write
from pdserve.deploy.config.load import load_config
from pdserve.deploy.config.schema import DeployConfig

SECRET = "s3cret-value-that-is-long-enough"


def make_pems(tmp_path) -> dict[str, str]:
    """PEM-shaped certificate and key files (loading checks the markers, not the crypto)."""
    (tmp_path / "cert.pem").write_text(
        "-----BEGIN CERTIFICATE-----\nMIIBcert\n-----END CERTIFICATE-----\n"
    )
    (tmp_path / "key.pem").write_text(
        "-----BEGIN PRIVATE KEY-----\nMIIBkey\n-----END PRIVATE KEY-----\n"
    )
    return {"cert": str(tmp_path / "cert.pem"), "key": str(tmp_path / "key.pem")}


def test_security_defaults_to_nothing_set():
    sec = DeployConfig().security
    assert sec.cluster_secret is None and sec.cluster_secret_file is None and sec.tls is None
    assert sec.secret({}) == (None, "")
    assert DeployConfig().router.tls is None


def test_cluster_secret_is_never_shown(tmp_path):
    cfg = load_config(write(tmp_path, f"security:\n  cluster_secret: {SECRET}\n"))
    assert cfg.security.secret({}) == (SECRET, "security.cluster_secret")
    for text in (repr(cfg), str(cfg), repr(cfg.security), cfg.model_dump_json()):
        assert SECRET not in text


@pytest.mark.parametrize(
    "value, words",
    [
        ("tooshort1", "at least 16 characters, has 9"),
        ("12345678901234567890", "valid string"),  # a YAML number is not a secret
    ],
)
def test_bad_cluster_secret_names_the_key_without_echoing_it(tmp_path, value, words):
    msg = error_of(write(tmp_path, f"security:\n  cluster_secret: {value}\n"))
    assert msg.startswith(f"{tmp_path / 'deploy.yaml'}: security.cluster_secret: "), msg
    assert words in msg and value not in msg


def test_cluster_secret_file_is_read_at_load_relative_to_the_yaml(tmp_path):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "secret.txt").write_text(SECRET + "\n")
    path = write(tmp_path / "conf", "security:\n  cluster_secret_file: secret.txt\n")
    cfg = load_config(path)
    (tmp_path / "conf" / "secret.txt").unlink()  # read at load: the file is not needed after
    secret, source = cfg.security.secret({"PDSERVE_CLUSTER_SECRET": "x" * 20})
    assert secret == SECRET  # the trailing newline is not part of it
    assert source == f"security.cluster_secret_file ({tmp_path / 'conf' / 'secret.txt'})"
    assert SECRET not in repr(cfg)


@pytest.mark.parametrize(
    "content, words",
    [(None, "cannot read"), ("short\n", "at least 16 characters, has 5"), ("", "has 0")],
)
def test_bad_cluster_secret_file_names_key_and_file(tmp_path, content, words):
    if content is not None:
        (tmp_path / "secret.txt").write_text(content)
    msg = error_of(write(tmp_path, "security:\n  cluster_secret_file: secret.txt\n"))
    assert msg.startswith(f"{tmp_path / 'deploy.yaml'}: security.cluster_secret_file: "), msg
    assert str(tmp_path / "secret.txt") in msg and words in msg
    if content:
        assert content.strip() not in msg


def test_secret_and_secret_file_together_are_refused(tmp_path):
    (tmp_path / "secret.txt").write_text(SECRET)
    msg = error_of(
        write(
            tmp_path, f"security:\n  cluster_secret: {SECRET}\n  cluster_secret_file: secret.txt\n"
        )
    )
    assert "security: set cluster_secret or cluster_secret_file, not both" in msg
    assert SECRET not in msg


def test_secret_precedence_file_then_yaml_then_environment(tmp_path):
    env = {"PDSERVE_CLUSTER_SECRET": "from-the-environment-123"}
    (tmp_path / "secret.txt").write_text("from-the-file-0123456789")
    from_file = load_config(write(tmp_path, "security: {cluster_secret_file: secret.txt}\n"))
    from_yaml = load_config(
        write(tmp_path, "security: {cluster_secret: from-the-yaml-0123456789}\n")
    )
    assert from_file.security.secret(env)[0] == "from-the-file-0123456789"
    assert from_yaml.security.secret(env)[0] == "from-the-yaml-0123456789"
    assert DeployConfig().security.secret(env) == (
        "from-the-environment-123",
        "PDSERVE_CLUSTER_SECRET",
    )
    assert DeployConfig().security.secret({"PDSERVE_CLUSTER_SECRET": "  "}) == (None, "")


def test_tls_files_are_read_into_pem_bytes_at_load(tmp_path):
    pems = make_pems(tmp_path)
    cfg = load_config(
        write(
            tmp_path,
            "security:\n  cluster_secret: " + SECRET + "\n"
            "  tls: {ca_file: cert.pem, cert_file: cert.pem, key_file: key.pem,"
            " server_name: pdserve-test}\n"
            "router:\n  tls: {cert_file: cert.pem, key_file: key.pem}\n",
        )
    )
    cert, key = (pathlib.Path(pems[k]).read_bytes() for k in ("cert", "key"))
    for name in pems.values():  # the bytes travel with the config, not the paths
        pathlib.Path(name).unlink()
    tls = cfg.security.tls.tls_config()
    assert (tls.ca_pem, tls.cert_pem, tls.key_pem, tls.server_name) == (
        cert,
        cert,
        key,
        "pdserve-test",
    )
    client = cfg.router.tls.tls_config()
    assert (client.ca_pem, client.cert_pem, client.key_pem) == (b"", cert, key)
    security = cfg.security.cluster_security(SECRET)
    assert security.tls == tls and security.secret == SECRET
    for text in (repr(cfg), repr(security), cfg.model_dump_json(), str(cfg.model_dump())):
        assert "PRIVATE KEY" not in text and SECRET not in text
    assert cfg.model_dump()["security"]["tls"]["key_file"] == str(tmp_path / "key.pem")


@pytest.mark.parametrize(
    "tls, key, words",
    [
        (
            "{ca_file: nope.pem, cert_file: cert.pem, key_file: key.pem}",
            "security.tls.ca_file",
            "cannot read",
        ),
        (
            "{ca_file: cert.pem, cert_file: key.pem, key_file: key.pem}",
            "security.tls.cert_file",
            "not a PEM certificate",
        ),
        (
            "{ca_file: cert.pem, cert_file: cert.pem, key_file: cert.pem}",
            "security.tls.key_file",
            "not a PEM private key",
        ),
        ("{ca_file: cert.pem, cert_file: cert.pem}", "security.tls.key_file", "Field required"),
        (
            "{ca_file: cert.pem, cert_file: cert.pem, key_file: key.pem, cafile: x}",
            "security.tls.cafile",
            "allowed here: ca_file, cert_file, key_file, server_name",
        ),
    ],
)
def test_bad_tls_settings_name_key_and_file(tmp_path, tls, key, words):
    make_pems(tmp_path)
    msg = error_of(write(tmp_path, f"security:\n  tls: {tls}\n"))
    assert msg.startswith(f"{tmp_path / 'deploy.yaml'}: {key}: "), msg
    assert words in msg


def test_router_tls_names_its_key(tmp_path):
    make_pems(tmp_path)
    msg = error_of(
        write(
            tmp_path, "router:\n  tls: {cert_file: cert.pem, key_file: key.pem, ca_file: ca.pem}\n"
        )
    )
    assert msg.startswith(
        f"{tmp_path / 'deploy.yaml'}: router.tls.ca_file: cannot read {tmp_path / 'ca.pem'}"
    )


def test_router_tls_needs_cluster_tls_for_the_workers_to_register(tmp_path):
    make_pems(tmp_path)
    path = write(tmp_path, "router:\n  tls: {cert_file: cert.pem, key_file: key.pem}\n")
    assert error_of(path).startswith(
        f"{path}: router.tls: the workers register through the "
        f"router's TLS port, so set security.tls too"
    )
