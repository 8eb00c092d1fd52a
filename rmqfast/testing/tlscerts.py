"""Certificates for TLS tests, made at test time (a CA, server and client certificates).

Keys are written as unencrypted PKCS#8 PEM: what Netty's ``SslContextBuilder`` (RocketMQ's
``tls.server.keyPath``/``tls.client.keyPath``) and Python's ``ssl`` both read.  Needs the
``cryptography`` package (the ``test`` extra).
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CertSet:
    ca: Path  # CA certificate (PEM)
    ca_key: Path
    server_cert: Path  # for localhost, 127.0.0.1 and ::1, signed by the CA
    server_key: Path
    client_cert: Path  # a client certificate signed by the CA
    client_key: Path


def _name(cn: str):  # type: ignore[no-untyped-def]
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key():  # type: ignore[no-untyped-def]
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key, path: Path) -> None:  # type: ignore[no-untyped-def]
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


def _write_cert(cert, path: Path) -> None:  # type: ignore[no-untyped-def]
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def make_certs(directory: Path, prefix: str = "", hosts: tuple[str, ...] = ("localhost", "127.0.0.1", "::1"),
               days: int = 30) -> CertSet:
    """A fresh CA and a server and client certificate it signed, written into ``directory``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=days)
    ca_key = _key()
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name(f"{prefix}rmqfast test CA"))
        .issuer_name(_name(f"{prefix}rmqfast test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    p = directory
    out = CertSet(p / f"{prefix}ca.pem", p / f"{prefix}ca.key", p / f"{prefix}server.pem",
                  p / f"{prefix}server.key", p / f"{prefix}client.pem", p / f"{prefix}client.key")
    _write_cert(ca, out.ca)
    _write_key(ca_key, out.ca_key)
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    for cn, cert_path, key_path, usage, alt in (
        ("localhost", out.server_cert, out.server_key, x509.ExtendedKeyUsageOID.SERVER_AUTH, sans),
        (f"{prefix}rmqfast test client", out.client_cert, out.client_key, x509.ExtendedKeyUsageOID.CLIENT_AUTH,
         None),
    ):
        key = _key()
        b = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        )
        if alt:
            b = b.add_extension(x509.SubjectAlternativeName(alt), critical=False)
        _write_cert(b.sign(ca_key, hashes.SHA256()), cert_path)
        _write_key(key, key_path)
    return out


def serial_of(cert_pem_or_der: bytes) -> int:
    """The serial number of a certificate (PEM or DER), to tell two certificates apart."""
    from cryptography import x509

    if cert_pem_or_der.lstrip().startswith(b"-----"):
        return int(x509.load_pem_x509_certificate(cert_pem_or_der).serial_number)
    return int(x509.load_der_x509_certificate(cert_pem_or_der).serial_number)


def rocketmq_server_opts(certs: CertSet, mode: str = "permissive") -> list[str]:
    """JVM options for a RocketMQ name server or broker serving TLS with ``certs`` (its
    ``tls.server.*`` system properties; later ``-D`` options override the harness defaults)."""
    return [
        f"-Dtls.server.mode={mode}",
        "-Dtls.test.mode.enable=false",  # else Netty serves a self-signed certificate of its own
        f"-Dtls.server.certPath={certs.server_cert}",
        f"-Dtls.server.keyPath={certs.server_key}",
        "-Dtls.server.need.client.auth=none",
        f"-Dtls.config.file={certs.ca.parent / 'no-tls.properties'}",  # not /etc/rocketmq/tls.properties
    ]


def java_client_opts(certs: CertSet) -> list[str]:
    """JVM options for a RocketMQ Java client that speaks TLS and checks the server against ``certs.ca``."""
    return [
        "-Dtls.enable=true",
        "-Dtls.test.mode.enable=false",
        "-Dtls.client.authServer=true",
        f"-Dtls.client.trustCertPath={certs.ca}",
        f"-Dtls.config.file={certs.ca.parent / 'no-tls.properties'}",
    ]
