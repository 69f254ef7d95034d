"""Signed chunks: what a chunk server sent, in its own words, so that a bad chunk is evidence, not a vote.

A serving member makes its own Ed25519 key and sends the public half with its broadcast hello; the
coordinator answers a credential: {run_id, token_id, public_key, expires_at}, signed with the run's key.
The member's chunk server signs every chunk it sends (kind, version, index and the SHA-256 of the very
bytes it sends) and sends its credential with each answer.

A fetcher that receives a chunk whose hash is not the manifest's looks at the signature:
- signed by the sender's credentialed key, over the hash of the bytes received: the sender stated that
  it sent those bytes. With the signed manifest that is proof, checkable by anyone who trusts the run's
  key, that the sender served a bad chunk: the fetcher reports it with the signed statement, and the
  coordinator bans the credential's token (elastic_mesh/coordinator/broadcasts.py).
- no signature, or one over other bytes than those received: nothing anyone else can check (bytes that
  do not match the server's own signed hash may have been altered on the way, or the server lies in a
  way it cannot be held to). That is a failed transfer: the fetcher stops using the source for the
  version and remembers it, and nobody is banned on its word.
So a ban needs no second reporter and a reporter cannot frame an honest member: only the member's own
key signs a statement about its bytes, and an honest member signs only the hashes it verified.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import struct
import threading
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from elastic_mesh.control.signing import SignatureError, verify

SIGNATURE_HEADER = "X-Chunk-Signature"  # hex of the 64-byte signature of a /chunk or /fresh answer's chunk
CREDENTIAL_HEADER = "X-Chunk-Credential"  # the server's credential, url-safe base64 of its JSON
SIGNATURE_BYTES = 64
MAX_CREDENTIAL_CHARS = 1024
CREDENTIAL_FIELDS = ("run_id", "token_id", "public_key", "expires_at")


class EvidenceError(ValueError):
    """A signed statement about a chunk does not prove what it is offered for; the message says why."""


def statement(kind: str, version: int, index: int, sha256_hex: str) -> bytes:
    """The bytes a chunk server signs for one chunk it sends."""
    return b"prime-chunk-v1\0" + kind.encode() + b"\0" + struct.pack(">qq", version, index) + bytes.fromhex(sha256_hex)


def issue_credential(run_signer, run_id: str, token_id: str, public_hex: str, expires_at: float) -> dict:
    """The coordinator's word that `public_hex` is the chunk-signing key of a member holding `token_id`."""
    try:
        if len(bytes.fromhex(public_hex)) != 32:
            raise ValueError
    except (ValueError, TypeError):
        raise EvidenceError("chunk_key must be a 32-byte Ed25519 public key in hex") from None
    payload = {"run_id": run_id, "token_id": token_id, "public_key": public_hex, "expires_at": expires_at}
    return {**payload, "signature": run_signer.sign(payload)}


def encode_credential(credential: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(credential, sort_keys=True).encode()).decode()


def decode_credential(text: str | None) -> dict | None:
    """A credential as a header carries it, or None when there is none or it is not one (unchecked)."""
    if not text or len(text) > MAX_CREDENTIAL_CHARS:
        return None
    try:
        value = json.loads(base64.urlsafe_b64decode(text.encode()))
    except (ValueError, binascii.Error):
        return None
    if not isinstance(value, dict) or not all(k in value for k in (*CREDENTIAL_FIELDS, "signature")):
        return None
    return value


def check_credential(run_public_hex: str, run_id: str, credential: object) -> dict:
    """The credential's fields once the run's key is found to have signed them; EvidenceError otherwise."""
    if not isinstance(credential, dict):
        raise EvidenceError("the credential is not an object")
    try:
        payload = {k: credential[k] for k in CREDENTIAL_FIELDS}
        verify(run_public_hex, payload, str(credential["signature"]))
    except KeyError as e:
        raise EvidenceError(f"the credential lacks {e}") from None
    except SignatureError as e:
        raise EvidenceError(f"the credential is not the run's: {e}") from None
    if payload["run_id"] != run_id:
        raise EvidenceError("the credential belongs to another run")
    return payload


@dataclass(frozen=True)
class ChunkProof:
    """What a source said about one chunk it sent: its signature and its credential (both unchecked)."""

    signature: bytes
    credential: dict

    def check(self, run_public_hex: str, run_id: str, kind: str, version: int, index: int, data_sha256: str) -> str:
        """The token id whose key signed that it sent bytes hashing to `data_sha256` as chunk `index`;
        EvidenceError when the signature is not that statement under a credential of this run."""
        payload = check_credential(run_public_hex, run_id, self.credential)
        try:
            key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(str(payload["public_key"])))
            key.verify(self.signature, statement(kind, version, index, data_sha256))
        except InvalidSignature:
            raise EvidenceError("the chunk's signature is not its sender's statement of these bytes (altered on the "
                                "way, or signed for other bytes)") from None
        except (ValueError, TypeError) as e:
            raise EvidenceError(f"malformed chunk signature or key: {e}") from None
        return str(payload["token_id"])

    def as_json(self) -> dict:
        return {"signature": self.signature.hex(), "credential": self.credential}

    @classmethod
    def from_json(cls, value: object) -> "ChunkProof":
        if not isinstance(value, dict) or not isinstance(value.get("credential"), dict):
            raise EvidenceError("evidence must be {signature, credential}")
        try:
            signature = bytes.fromhex(str(value.get("signature", "")))
        except ValueError:
            raise EvidenceError("the evidence's signature is not hex") from None
        if len(signature) != SIGNATURE_BYTES:
            raise EvidenceError(f"the evidence's signature has {len(signature)} bytes, not {SIGNATURE_BYTES}")
        return cls(signature, value["credential"])


class ChunkSigner:
    """A serving member's chunk-signing key and the credential the coordinator gave it. An honest server
    signs the manifest's hash of a chunk it holds (it verified or made those bytes), once per chunk."""

    def __init__(self, key: Ed25519PrivateKey | None = None) -> None:
        self._key = key or Ed25519PrivateKey.generate()
        self.public_hex = self._key.public_key().public_bytes(serialization.Encoding.Raw,
                                                              serialization.PublicFormat.Raw).hex()
        self.credential_header = ""
        self._signed: dict[tuple[str, int, int, str], bytes] = {}
        self._lock = threading.Lock()

    def certify(self, credential: dict) -> None:
        if credential.get("public_key") != self.public_hex:
            raise EvidenceError("the coordinator credentialed another key than this member's")
        self.credential_header = encode_credential(credential)

    def sign(self, kind: str, version: int, index: int, sha256_hex: str) -> bytes:
        with self._lock:
            found = self._signed.get((kind, version, index, sha256_hex))
            if found is None:
                if len(self._signed) > 65536:  # bounded: versions come and go
                    self._signed.clear()
                found = self._signed[(kind, version, index, sha256_hex)] = self._key.sign(
                    statement(kind, version, index, sha256_hex))
            return found


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
