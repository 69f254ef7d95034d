"""TLS for the run's HTTP: the coordinator, the members' snapshot servers and broadcast servers.

Zero set-up for the operator. The coordinator makes its own authority once per run (an ECDSA P-256
key and a self-signed certificate in its state directory) and serves with that certificate. Join
tokens carry the certificate's SHA-256 fingerprint, so a member trusts exactly that coordinator: it
reads the certificate the coordinator presents, compares the fingerprint with its token's before it
sends a byte, and from then on verifies every connection against that one certificate.

Members' chunk servers get certificates the authority signs: each process makes its own key, sends
the public half with its join (or broadcast hello) and receives a certificate naming it; the private
key never leaves the process. A member fetching from a peer trusts a certificate the run's authority
signed and nothing else. Host names are not checked: members are reached at whatever address they
claim, and what proves membership is the authority's signature, not a DNS name. The content of a
transfer is checked on its own (signed manifests, chunk hashes); TLS adds secrecy for tokens, session
secrets and the transfer keys, and keeps anyone off the path from reading or steering the control
plane. Gloo's all-reduce traffic is not covered: torch's Gloo transport has no TLS.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import socket
import ssl
import tempfile
import time
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_FILE, KEY_FILE = "tls_ca.pem", "tls_key.pem"
SERVICE_PREFIX = "prime-service:"  # a member certificate's organizational unit: this, then its service ("": none)
CERT_DAYS = 30  # a member's certificate; it re-joins (and gets a new one) far more often than that


class TLSError(RuntimeError):
    """The other end is not who the token says, or speaks no TLS where the run does; the message says which."""


def fingerprint_of(der: bytes) -> str:
    return hashlib.sha256(der).hexdigest()


def _pem_fingerprint(pem: str) -> str:
    return fingerprint_of(ssl.PEM_cert_to_DER_cert(pem))


def _server_context(cert_pem: bytes, key: ec.EllipticCurvePrivateKey) -> ssl.SSLContext:
    """load_cert_chain reads files only: the key goes to a private temporary file for the moment it takes."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    with tempfile.TemporaryDirectory() as folder:  # mode 0700
        cert_path, key_path = Path(folder) / "cert.pem", Path(folder) / "key.pem"
        cert_path.write_bytes(cert_pem)
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key_pem)
        context.load_cert_chain(cert_path, key_path)
    return context


def client_context(ca_pem: str) -> ssl.SSLContext:
    """Trusts certificates the run's authority signed, and nothing else."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = False  # see the module's docstring: the authority's signature is the check
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cadata=ca_pem)
    return context


class RunAuthority:
    """The coordinator's TLS key and certificate (also the authority members' certificates chain to)."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, certificate: x509.Certificate) -> None:
        self._key, self.certificate = key, certificate
        self.ca_pem = certificate.public_bytes(serialization.Encoding.PEM).decode()
        self.fingerprint = fingerprint_of(certificate.public_bytes(serialization.Encoding.DER))

    @classmethod
    def load_or_create(cls, state_dir: Path, run_id: str, host: str = "127.0.0.1") -> "RunAuthority":
        """host: the address nodes reach the coordinator at, named in the certificate so that tools that do
        check host names (curl --cacert STATE_DIR/tls_ca.pem https://HOST:PORT/status) accept it too."""
        state_dir = Path(state_dir)
        key_path, ca_path = state_dir / KEY_FILE, state_dir / CA_FILE
        if not key_path.exists():
            key = ec.generate_private_key(ec.SECP256R1())
            now = datetime.datetime.now(datetime.timezone.utc)
            name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"prime coordinator of {run_id}"[:64])])
            certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                           .public_key(key.public_key()).serial_number(x509.random_serial_number())
                           .not_valid_before(now - datetime.timedelta(hours=1))
                           .not_valid_after(now + datetime.timedelta(days=3650))
                           .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                           .add_extension(x509.SubjectAlternativeName(_names(host)), critical=False)
                           .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                        content_commitment=False, key_encipherment=False,
                                                        data_encipherment=False, key_agreement=False,
                                                        encipher_only=False, decipher_only=False), critical=True)
                           .sign(key, hashes.SHA256()))
            key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption())
            try:  # the coordinator and `token create` may both get here first: one wins, the other reads
                fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                pass
            else:
                with os.fdopen(fd, "wb") as f:
                    f.write(key_pem)
                staging = ca_path.with_suffix(".tmp")
                staging.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
                staging.replace(ca_path)
        for _ in range(100):  # the winner writes the certificate just after the key
            if ca_path.exists():
                break
            time.sleep(0.05)
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        certificate = x509.load_pem_x509_certificate(ca_path.read_bytes())
        if not isinstance(key, ec.EllipticCurvePrivateKey) or certificate.public_key() != key.public_key():
            raise TLSError(f"{key_path} and {ca_path} do not belong together; move both away to make new ones "
                           "(tokens made before then stop working)")
        return cls(key, certificate)

    def server_context(self) -> ssl.SSLContext:
        return _server_context(self.ca_pem.encode(), self._key)

    def issue(self, public_pem: str, subject: str, expires_at: float | None = None, service: str = "") -> str:
        """A server certificate for a member's own key (PEM in, PEM out), valid CERT_DAYS or until
        `expires_at` (unix time: its token's expiry), whichever is sooner: a member whose token has
        expired holds no certificate that peers still trust. `service`: the service its token names,
        written as the subject's organizational unit (certificate_service reads it back)."""
        try:
            public = serialization.load_pem_public_key(public_pem.encode())
        except (ValueError, TypeError, UnsupportedAlgorithm):
            raise ValueError("tls_public_key is not a PEM public key") from None
        if not isinstance(public, ec.EllipticCurvePublicKey):
            raise ValueError("tls_public_key must be an elliptic-curve key")
        now = datetime.datetime.now(datetime.timezone.utc)
        until = now + datetime.timedelta(days=CERT_DAYS)
        if expires_at is not None:
            until = max(now, min(until, datetime.datetime.fromtimestamp(expires_at, datetime.timezone.utc)))
        certificate = (x509.CertificateBuilder()
                       .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject[:64] or "member"),
                                                x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME,
                                                                   SERVICE_PREFIX + service)]))
                       .issuer_name(self.certificate.subject).public_key(public)
                       .serial_number(x509.random_serial_number())
                       .not_valid_before(now - datetime.timedelta(hours=1))
                       .not_valid_after(until)
                       .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                       .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                       .sign(self._key, hashes.SHA256()))
        return certificate.public_bytes(serialization.Encoding.PEM).decode()


def _names(host: str) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    try:
        address = ipaddress.ip_address(host.strip("[]"))
        if address != ipaddress.ip_address("127.0.0.1"):
            names.append(x509.IPAddress(address))
    except ValueError:
        if host and host != "localhost":
            names.append(x509.DNSName(host))
    return names


class MemberIdentity:
    """A member process's own TLS key, whose public half it sends to be certified."""

    def __init__(self) -> None:
        self._key = ec.generate_private_key(ec.SECP256R1())
        self.public_pem = self._key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()

    def server_context(self, cert_pem: str) -> ssl.SSLContext:
        certificate = x509.load_pem_x509_certificate(cert_pem.encode())
        if certificate.public_key() != self._key.public_key():
            raise TLSError("the coordinator certified another key than this process's")
        return _server_context(cert_pem.encode(), self._key)


def certificate_service(der: bytes) -> str | None:
    """The service a member certificate (DER) was issued for ("" for none); None for a certificate that
    names no service field at all (the coordinator's own, or one from before services)."""
    units = x509.load_der_x509_certificate(der).subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    found = [str(u.value) for u in units if str(u.value).startswith(SERVICE_PREFIX)]
    return found[0][len(SERVICE_PREFIX):] if len(found) == 1 else None


def check_service(sock: ssl.SSLSocket, expected: str, address: str) -> None:
    """Raises TLSError unless the certificate `sock`'s peer presented was issued for `expected`. Run after
    the handshake (which checked the run's authority signed it) and before a byte of the request: the
    request carries the client's bearer token."""
    found = certificate_service(sock.getpeercert(binary_form=True) or b"")
    if found != expected:
        raise TLSError(f"{address} presents a certificate of this run issued for "
                       f"{repr(found) if found else 'no service'}, not for the {expected} expected there: another "
                       "member posing as it, or the wrong address; nothing was sent")


def pinned_ca(address: str, expected: str, timeout_s: float = 10.0) -> str:
    """The certificate the coordinator at `address` presents (PEM), after checking it is the one whose
    fingerprint the join token carries. Nothing is sent before this check but the TLS hello."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
            probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            probe.check_hostname, probe.verify_mode = False, ssl.CERT_NONE  # read it, then compare below
            with probe.wrap_socket(sock) as tls:
                der = tls.getpeercert(binary_form=True)
    except ssl.SSLError as e:
        raise TLSError(f"the coordinator at {address} does not speak TLS ({e.reason}), but the join token says "
                       "the run uses it: wrong address, or someone in between") from None
    if fingerprint_of(der) != expected:
        raise TLSError(f"the server at {address} presents certificate {fingerprint_of(der)[:16]}..., not the "
                       f"{expected[:16]}... this token names: not this run's coordinator (or someone in "
                       "between); nothing was sent")
    return ssl.DER_cert_to_PEM_cert(der)


def accept(sock: socket.socket, context: ssl.SSLContext | None) -> socket.socket:
    """A server's accepted connection, wrapped when the server speaks TLS. The handshake is left to the
    handler's thread (its first read), so a slow or silent client never holds up the accepting one."""
    if context is None:
        return sock
    return context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)

