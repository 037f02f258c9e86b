"""A throwaway certificate authority and a server certificate for 127.0.0.1, written as PEM files,
for the tests of mutual TLS between router and workers."""

from __future__ import annotations

import pytest


def tls_files(tmp_path) -> dict:
    """A CA and a certificate it signed for 127.0.0.1, as PEM files."""
    x509 = pytest.importorskip("cryptography.x509")
    import datetime

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def issue(subject, key, issuer, issuer_key, ca: bool):
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            import ipaddress

            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False,
            )
        return builder.sign(issuer_key, hashes.SHA256())

    name = lambda cn: x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])  # noqa: E731
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = issue(name("pdserve-test-ca"), ca_key, name("pdserve-test-ca"), ca_key, ca=True)
    cert = issue(name("router"), key, ca.subject, ca_key, ca=False)
    files = {"ca": tmp_path / "ca.pem", "cert": tmp_path / "cert.pem", "key": tmp_path / "key.pem"}
    files["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files["key"].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return files
