"""Starting a coordinator over a state directory, and making tokens for it."""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
from pathlib import Path

from elastic_mesh.control.signing import RunSigner
from elastic_mesh.control.tls import RunAuthority
from elastic_mesh.control.token import create_token, read_token
from elastic_mesh.coordinator.config import CoordinatorConfig
from elastic_mesh.coordinator.core import Coordinator
from elastic_mesh.coordinator.server import CoordinatorServer
from elastic_mesh.coordinator.state import CoordinatorState

log = logging.getLogger(__name__)
TLS_MARK = "tls_fingerprint"  # present while the coordinator serves TLS: `token create` pins it


def _secret(state_dir: Path) -> bytes:
    path = state_dir / "secret"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return bytes.fromhex(path.read_text().strip())


def run_signer(state_dir: Path) -> RunSigner:
    """The run's signing key (made on first use); join tokens carry its fingerprint."""
    return RunSigner.load_or_create(Path(state_dir) / "signing_key.pem")


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]") if ":" in address else address
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: other machines may reach it


def start_coordinator(state_dir: str | Path, host: str = "127.0.0.1", port: int = 0,
                      config: CoordinatorConfig | None = None, advertise: str | None = None,
                      run_id: str | None = None, tls: bool | None = None) -> CoordinatorServer:
    """Serves in background threads; returns the server (stop() it). Restarting on the same state_dir
    continues the run. tls: serve HTTPS with the run's own certificate (control/tls.py); None (auto):
    yes unless the address nodes are told is loopback, where nothing crosses a network."""
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    state = CoordinatorState(state_dir / "coordinator.sqlite")
    existing = state.get_meta("run_id")
    if run_id and existing and run_id != existing:
        raise ValueError(f"{state_dir} holds run {existing!r}, not {run_id!r}; use another --state-dir")
    run_id = existing or run_id or f"run-{secrets.token_hex(4)}"
    config = config or CoordinatorConfig()
    placeholder = Coordinator.__new__(Coordinator)  # the server needs a coordinator before the port is known
    server = CoordinatorServer(host, port, placeholder, config.service)
    if advertise is None:
        # Listening on all interfaces says nothing about which address other machines can reach;
        # production passes --advertise, the single-machine default is loopback.
        visible = "127.0.0.1" if host in ("0.0.0.0", "localhost") else host
        advertise = f"{visible}:{server.port}"
    tls = not is_loopback(advertise) if tls is None else tls
    authority = RunAuthority.load_or_create(state_dir, run_id, advertise.rsplit(":", 1)[0]) if tls else None
    server.coordinator = Coordinator(state, _secret(state_dir), run_id, config, advertise,
                                     run_signer(state_dir), authority)
    mark = state_dir / TLS_MARK
    if authority is not None:
        server.tls = authority.server_context()
        mark.write_text(authority.fingerprint)
        log.info("serving TLS with the run's certificate %s... (join tokens pin it)", authority.fingerprint[:16])
    else:
        mark.unlink(missing_ok=True)
        log.info("serving plain HTTP%s", " (loopback: nothing leaves this machine)" if is_loopback(advertise)
                 else ": tokens, sessions and transfer keys cross the network in clear (--tls on to change)")
    # Atomically: launchers poll for this file and must never read it half-written.
    staging = state_dir / "address.tmp"
    staging.write_text(advertise)
    staging.replace(state_dir / "address")
    server.start()
    return server


def make_token(state_dir: str | Path, ttl_s: float, address: str | None = None, role: str = "node",
               max_nodes: int = 1, publish: bool = False, service: str = "",
               attributes: dict[str, str] | None = None) -> str:
    """A new join token of this run, recorded in its state (so it can be listed and revoked)."""
    state_dir = Path(state_dir)
    if not (state_dir / "secret").exists():
        raise FileNotFoundError(f"{state_dir} holds no run; start the coordinator with --state-dir {state_dir} first")
    state = CoordinatorState(state_dir / "coordinator.sqlite")
    run_id = state.get_meta("run_id")
    address = address or ((state_dir / "address").read_text().strip() if (state_dir / "address").exists() else None)
    if not run_id or not address:
        raise ValueError(f"the coordinator of {state_dir} has never started; start it, or pass --address HOST:PORT")
    mark = state_dir / TLS_MARK
    text = create_token(_secret(state_dir), address, run_id, ttl_s, role, max_nodes, publish,
                        run_signer(state_dir).fingerprint, mark.read_text().strip() if mark.exists() else "", service,
                        attributes)
    token = read_token(text)
    with state.transaction():
        state.put_token(token.token_id, token.role, token.max_nodes, token.expires_at)
    return text


def revoke_token(state_dir: str | Path, token_id: str) -> None:
    """Revokes a token of this run at once: the coordinator refuses it from its next request on, and
    ends the sessions of the nodes it admitted (they are told so with their next heartbeat)."""
    state = CoordinatorState(Path(state_dir) / "coordinator.sqlite")
    with state.transaction():
        if not state.revoke_token(token_id):
            raise ValueError(f"no token {token_id!r} in this run; `token list` shows them")


def list_tokens(state_dir: str | Path) -> list[dict]:
    return CoordinatorState(Path(state_dir) / "coordinator.sqlite").tokens()
