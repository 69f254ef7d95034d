"""Join tokens: who may join a run, as what, and how many. Signed with the run's secret (HMAC-SHA256).

A token names the coordinator's address and the run, so a node needs nothing else to start. It has a
role (`node`: joins as a training node; `worker`: an inference worker; `observer`: reads the status and
the dashboard only), a cap on the live nodes it may admit at once (1 by default: each contributor gets
its own, and a leaked one adds one node, not a majority), an expiry and an id by which the operator
revokes it. `publish` grants the right to publish broadcast versions; `key_fp` is the fingerprint of
the coordinator's signing key, so a member trusts exactly that coordinator's signatures; `tls_fp` the
fingerprint of its TLS certificate ("" when the run speaks plain HTTP). `service` names a service its
holder offers the run (e.g. `orchestrator`): the TLS certificate the coordinator gives that holder names
it, and a client that expects the service accepts no other certificate, so a member's own certificate
cannot pass for it. `attributes` are what the run's application admits its holder as, in the
application's own words (prime's RL: `dtype=bfloat16`, the compute dtype whose limits its rollouts are
held to): signed with the rest, so a holder cannot change them. A forged, expired or foreign token is refused with a reason that reveals nothing about the
run it was tried on.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import secrets
import time
from dataclasses import asdict, dataclass, field

PREFIX = "prime1"
ROLES = ("node", "worker", "observer")
SERVICE = re.compile(r"[a-z][a-z0-9-]{0,31}")
ATTRIBUTE_KEY = re.compile(r"[a-z][a-z0-9_-]{0,31}")
ATTRIBUTE_VALUE = re.compile(r"[A-Za-z0-9._-]{1,64}")
MAX_ATTRIBUTES = 8


class TokenError(ValueError):
    """The token cannot be used; the message says why and what to do."""


@dataclass(frozen=True)
class JoinToken:
    coordinator: str  # host:port
    run_id: str
    expires_at: float  # unix time, judged by the coordinator that made it
    token_id: str
    role: str = "node"
    max_nodes: int = 1  # live nodes it may admit at once (tokens made before roles existed: 1 too)
    publish: bool = False  # may publish broadcast versions (the coordinator signs their manifests)
    key_fp: str = ""  # fingerprint of the coordinator's signing key ("" in tokens made before it existed)
    tls_fp: str = ""  # SHA-256 of the coordinator's TLS certificate ("": the run speaks plain HTTP)
    service: str = ""  # a service its holder offers, named in its certificate ("": none)
    attributes: dict[str, str] = field(default_factory=dict)  # what the application admits it as (checked)


def check_attributes(attributes: object) -> dict[str, str]:
    """`attributes` if well-formed (at most 8 short key=value pairs); ValueError naming the problem."""
    if not isinstance(attributes, dict) or len(attributes) > MAX_ATTRIBUTES:
        raise ValueError(f"attributes must be at most {MAX_ATTRIBUTES} key=value pairs")
    for key, value in attributes.items():
        if not isinstance(key, str) or not ATTRIBUTE_KEY.fullmatch(key):
            raise ValueError(f"attribute name {str(key)[:40]!r} must be 1-32 of a-z, 0-9, _ and -, starting with a letter")
        if not isinstance(value, str) or not ATTRIBUTE_VALUE.fullmatch(value):
            raise ValueError(f"attribute {key}'s value {str(value)[:40]!r} must be 1-64 of letters, digits, . _ and -")
    return dict(attributes)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def create_token(secret: bytes, coordinator: str, run_id: str, ttl_s: float, role: str = "node",
                 max_nodes: int = 1, publish: bool = False, key_fp: str = "", tls_fp: str = "",
                 service: str = "", attributes: dict[str, str] | None = None) -> str:
    attributes = check_attributes(attributes or {})
    if role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {', '.join(ROLES)}")
    if service and not SERVICE.fullmatch(service):
        raise ValueError(f"service {service!r} must be 1-32 of a-z, 0-9 and -, starting with a letter")
    if max_nodes < 1:
        raise ValueError(f"max_nodes {max_nodes} must be at least 1")
    if publish and role == "observer":
        raise ValueError("an observer token only reads the status; it cannot carry the publish right")
    payload = JoinToken(coordinator, run_id, time.time() + ttl_s, secrets.token_hex(8), role, max_nodes, publish,
                        key_fp, tls_fp, service, attributes)
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
        token = JoinToken(str(fields["coordinator"]), str(fields["run_id"]), float(fields["expires_at"]),
                          str(fields["token_id"]), str(fields.get("role", "node")), int(fields.get("max_nodes", 1)),
                          bool(fields.get("publish", False)), str(fields.get("key_fp", "")),
                          str(fields.get("tls_fp", "")), str(fields.get("service", "")),
                          check_attributes(fields.get("attributes", {})))
        if token.role not in ROLES or token.max_nodes < 1 or (token.service and not SERVICE.fullmatch(token.service)):
            raise ValueError
        return token
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
