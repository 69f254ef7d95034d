"""Join tokens: who may join a run. Signed with the run's secret (HMAC-SHA256), with an expiry.

A token names the coordinator's address and the run, so a node needs nothing else to start. A forged,
expired or foreign token is refused with a reason that reveals nothing about the run it was tried on.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import asdict, dataclass

PREFIX = "prime1"


class TokenError(ValueError):
    """The token cannot be used; the message says why and what to do."""


@dataclass(frozen=True)
class JoinToken:
    coordinator: str  # host:port
    run_id: str
    expires_at: float  # unix time, judged by the coordinator that made it
    token_id: str


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def create_token(secret: bytes, coordinator: str, run_id: str, ttl_s: float) -> str:
    payload = JoinToken(coordinator, run_id, time.time() + ttl_s, secrets.token_hex(8))
    body = _b64(json.dumps(asdict(payload), sort_keys=True).encode())
    signature = _b64(hmac.new(secret, body.encode(), hashlib.sha256).digest())
    return f"{PREFIX}.{body}.{signature}"


def read_token(text: str) -> JoinToken:
    """Parses a token without checking its signature (a node needs the coordinator address from it)."""
    try:
        prefix, body, _ = text.strip().split(".")
        if prefix != PREFIX:
            raise ValueError
        fields = json.loads(_unb64(body))
        return JoinToken(str(fields["coordinator"]), str(fields["run_id"]), float(fields["expires_at"]),
                         str(fields["token_id"]))
    except (ValueError, KeyError, TypeError, json.JSONDecodeError, UnicodeDecodeError):
        raise TokenError("this is not a prime join token; ask the run's operator for one "
                         "(python -m elastic_mesh.coordinator token create)") from None


def verify_token(secret: bytes, run_id: str, text: str, now: float | None = None) -> JoinToken:
    token = read_token(text)
    _, body, signature = text.strip().split(".")
    expected = _b64(hmac.new(secret, body.encode(), hashlib.sha256).digest())
    if token.run_id != run_id:
        raise TokenError("this token belongs to another run; ask this run's operator for a token")
    if not hmac.compare_digest(expected, signature):
        raise TokenError("the token's signature is invalid (forged or altered); ask the run's operator for a new one")
    if (now if now is not None else time.time()) > token.expires_at:
        expired = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(token.expires_at))
        raise TokenError(f"the token expired at {expired}; ask the run's operator for a new one")
    return token
