"""A throwaway certificate authority for ``specdec up --tls``: a CA, one server certificate the
three services share (valid for localhost, 127.0.0.1, ::1 and the host they listen on) and one
client certificate (the coordinator's, for mutual TLS to the draft and verify services), written
as PEM files with the ``cryptography`` package. For a machine's own use: in a cluster, certificates
come from cert-manager or your PKI (docs/security.md)."""

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 30


@dataclass(frozen=True)
class LocalCertificates:
    """The PEM files of :func:`write_local_certificates`."""

    ca_file: Path
    server_cert_file: Path
    server_key_file: Path
    client_cert_file: Path
    client_key_file: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "specdec local"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _subject_alt_names(hosts: list[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(["localhost", "127.0.0.1", "::1", *hosts]):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _certificate(subject: x509.Name, key, issuer: x509.Name, issuer_key, extensions) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
    )
    for extension, critical in extensions:
        builder = builder.add_extension(extension, critical=critical)
    return builder.sign(issuer_key, hashes.SHA256())


def _leaf(common_name: str, usage, ca_name: x509.Name, ca_key, alt_names: list[x509.GeneralName]):
    key = ec.generate_private_key(ec.SECP256R1())
    extensions = [
        (x509.BasicConstraints(ca=False, path_length=None), True),
        (x509.ExtendedKeyUsage([usage]), False),
        (x509.SubjectAlternativeName(alt_names), False),
    ]
    return _certificate(_name(common_name), key, ca_name, ca_key, extensions), key


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    os.chmod(path, 0o600)
    return path


def _key_pem(key) -> bytes:
    encoding, key_format = serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8
    return key.private_bytes(encoding, key_format, serialization.NoEncryption())


def write_local_certificates(directory: Path, hosts: list[str]) -> LocalCertificates:
    """Makes a new CA and a server and a client certificate signed by it (ECDSA P-256, valid
    VALID_DAYS days; the server one for ``hosts`` besides localhost, 127.0.0.1 and ::1) and writes
    them to ``directory`` (created if missing; files readable by this user only) as ca.pem,
    server.pem, server-key.pem, client.pem, client-key.pem. Raises OSError when it cannot write."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("specdec local CA")
    ca = _certificate(
        ca_name,
        ca_key,
        ca_name,
        ca_key,
        [
            (x509.BasicConstraints(ca=True, path_length=0), True),
            (
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                True,
            ),
        ],
    )
    server, server_key = _leaf(
        "specdec server", ExtendedKeyUsageOID.SERVER_AUTH, ca_name, ca_key, _subject_alt_names(hosts)
    )
    client, client_key = _leaf(
        "specdec coordinator", ExtendedKeyUsageOID.CLIENT_AUTH, ca_name, ca_key, [x509.DNSName("specdec-coordinator")]
    )
    pem = serialization.Encoding.PEM
    return LocalCertificates(
        _write(directory / "ca.pem", ca.public_bytes(pem)),
        _write(directory / "server.pem", server.public_bytes(pem)),
        _write(directory / "server-key.pem", _key_pem(server_key)),
        _write(directory / "client.pem", client.public_bytes(pem)),
        _write(directory / "client-key.pem", _key_pem(client_key)),
    )
