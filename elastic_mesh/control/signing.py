"""The run's signing key (Ed25519, from `cryptography`): the coordinator signs what members must be able
to trust whoever delivered it (a broadcast version's manifest, above all), and every member checks
the signature against the public key it learned at hello, itself checked against the fingerprint its
join token carries (a token made by the run's operator, so a man in the middle cannot swap the key).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)


class SignatureError(ValueError):
    """A signature or a public key does not check out; the message says which and why."""


def canonical(value: object) -> bytes:
    """The one byte string a JSON value is signed as: sorted keys, no spaces."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def fingerprint(public_hex: str) -> str:
    """A short name of a public key, carried in join tokens."""
    return hashlib.sha256(bytes.fromhex(public_hex)).hexdigest()[:32]


class RunSigner:
    """The coordinator's private key, created once per run in its state directory (mode 0600)."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.public_hex = raw.hex()

    @classmethod
    def load_or_create(cls, path: Path) -> "RunSigner":
        path = Path(path)
        if not path.exists():
            pem = Ed25519PrivateKey.generate().private_bytes(serialization.Encoding.PEM,
                                                            serialization.PrivateFormat.PKCS8,
                                                            serialization.NoEncryption())
            try:  # two processes creating it at once (coordinator and `token create`): the first one wins
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(pem)
            except FileExistsError:
                pass
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise SignatureError(f"{path} does not hold an Ed25519 key; move it away and restart the coordinator")
        return cls(key)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public_hex)

    def sign(self, value: object) -> str:
        return base64.b64encode(self._key.sign(canonical(value))).decode()


def verify(public_hex: str, value: object, signature: str) -> None:
    """Raises SignatureError unless `signature` is the run key's signature of `value`."""
    try:
        key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_hex))
        key.verify(base64.b64decode(signature, validate=True), canonical(value))
    except InvalidSignature:
        raise SignatureError("the signature does not match: forged, altered, or signed by another run's "
                             "coordinator") from None
    except (ValueError, TypeError) as e:
        raise SignatureError(f"malformed signature or public key: {e}") from None
