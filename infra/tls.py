"""The embedded services' certificate authority (``lambdalake up --secure``).

One CA under the state folder signs one server certificate that every embedded service presents
(the broker's client listener, Cassandra's native port, the registry, serving over HTTPS). Its
subject alternative names are the loopback addresses a three-node cluster listens on and
``localhost``, so hostname checks pass for every node. Keys are PKCS#8 PEM without a passphrase:
the files are the secret, kept owner-only, as a company's secret store would hand them out.

Files (all PEM), written once and reused while valid:

- ``ca.pem``: the CA certificate; what a client is given to trust (``*_ca_location`` settings);
- ``server.pem`` / ``server.key``: the server's certificate and key;
- ``server-bundle.pem``: the key followed by the certificate, the one-file keystore Kafka's and
  Cassandra's PEM factories read.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import pkcs12
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from lambdalake import secure

#: What the server certificate names: each address a node of three listens on, and localhost.
LOOPBACK_NAMES = ("127.0.0.1", "127.0.0.2", "127.0.0.3", "localhost")

#: A server certificate is issued again this long before it expires.
RENEW_BEFORE = dt.timedelta(days=7)


@dataclass(frozen=True)
class TlsFiles:
    """Where the CA and the server's certificate, key and bundle are."""

    folder: Path

    @property
    def ca(self) -> Path:
        return self.folder / secure.ca_file(Path()).name

    @property
    def ca_key(self) -> Path:
        return self.folder / "ca.key"

    @property
    def cert(self) -> Path:
        return self.folder / secure.server_cert(Path()).name

    @property
    def key(self) -> Path:
        return self.folder / secure.server_key(Path()).name

    @property
    def bundle(self) -> Path:
        return self.folder / "server-bundle.pem"

    @property
    def keystore(self) -> Path:
        """The key and certificate as PKCS#12, for Kafka (its PEM key store needs an encrypted key)."""
        return self.folder / "server.p12"

    @property
    def keystore_password(self) -> Path:
        return self.folder / "server.p12.password"


@dataclass(frozen=True)
class Issued:
    """A certificate and its key, as PEM bytes."""

    cert: bytes
    key: bytes


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def new_ca(common_name: str = "lambdalake embedded CA", *, days: int = 3650) -> Issued:
    """A self-signed CA certificate (P-256) and its key."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    start = _now() - dt.timedelta(minutes=5)  # a clock a little behind still accepts it
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def issue(
    ca: Issued,
    names: tuple[str, ...] = LOOPBACK_NAMES,
    *,
    common_name: str = "lambdalake embedded services",
    days: int = 825,
    not_before: dt.datetime | None = None,
) -> Issued:
    """A server (and client) certificate for ``names`` (IP addresses or DNS names), signed by ``ca``.
    ``not_before``/``days`` can make one already expired (the tests' bad certificates)."""
    ca_cert = x509.load_pem_x509_certificate(ca.cert)
    ca_key = serialization.load_pem_private_key(ca.key, password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    alt: list[x509.GeneralName] = []
    for name in names:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alt.append(x509.DNSName(name))
    start = not_before or _now() - dt.timedelta(minutes=5)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def _write_secret(path: Path, data: bytes) -> None:
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_bytes(data)


def _still_valid(path: Path) -> bool:
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError):
        return False
    return cert.not_valid_after_utc - RENEW_BEFORE > _now()


def ensure(state_dir: Path) -> TlsFiles:
    """The CA and the server certificate of ``state_dir``'s embedded services: made on the first
    call, the server's issued again when it nears its end (the CA, which clients trust, is kept)."""
    folder = secure.folder(state_dir)
    files = TlsFiles(folder)
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    if not (_still_valid(files.ca) and files.ca_key.exists()):
        ca = new_ca()
        _write_secret(files.ca_key, ca.key)
        files.ca.write_bytes(ca.cert)
        files.cert.unlink(missing_ok=True)
    if not (_still_valid(files.cert) and all(p.exists() for p in (files.key, files.bundle, files.keystore))):
        server = issue(Issued(files.ca.read_bytes(), files.ca_key.read_bytes()))
        _write_secret(files.key, server.key)
        _write_secret(files.bundle, server.key + server.cert)
        password = secrets.token_urlsafe(24)
        _write_secret(files.keystore_password, password.encode())
        _write_secret(files.keystore, _pkcs12(server, password))
        files.cert.write_bytes(server.cert)
    return files


def _pkcs12(server: Issued, password: str) -> bytes:
    key = serialization.load_pem_private_key(server.key, password=None)
    cert = x509.load_pem_x509_certificate(server.cert)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return pkcs12.serialize_key_and_certificates(
        b"server", key, cert, None, serialization.BestAvailableEncryption(password.encode())
    )
