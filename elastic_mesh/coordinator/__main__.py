"""Coordinator command line.

    python -m elastic_mesh.coordinator serve --port 29400 --state-dir coord/
    python -m elastic_mesh.coordinator token create --state-dir coord/ --ttl 24h [--role node] [--max-nodes 1] [--publish]
    python -m elastic_mesh.coordinator token list --state-dir coord/
    python -m elastic_mesh.coordinator token revoke ID --state-dir coord/
"""

from __future__ import annotations

import argparse
import logging
import re
import signal
import sys
import threading
import time

from elastic_mesh.control.token import ROLES, read_token
from elastic_mesh.coordinator.config import CoordinatorConfig
from elastic_mesh.coordinator.run import (
    list_tokens,
    make_token,
    revoke_token,
    start_coordinator,
)


def _duration(text: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd]?)", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration; write e.g. 90s, 30m, 24h or 7d")
    return float(match[1]) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match[2]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elastic_mesh.coordinator",
                                     description="The coordinator of a prime run, and its join tokens.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the coordinator",
                           epilog="example: python -m elastic_mesh.coordinator serve --port 29400 --state-dir coord/")
    serve.add_argument("--state-dir", required=True, help="SQLite state and the run secret live here")
    serve.add_argument("--host", default="0.0.0.0", help="address to listen on (default all)")
    serve.add_argument("--port", type=int, default=29400, help="port (0: any free port; see STATE_DIR/address)")
    serve.add_argument("--advertise", default=None, help="host:port that nodes use to reach this coordinator")
    serve.add_argument("--run-id", default=None, help="name of the run (default: a new random one)")
    serve.add_argument("--tls", choices=("auto", "on", "off"), default="auto",
                       help="serve HTTPS with the run's own certificate, which join tokens pin (made in "
                            "STATE_DIR on first use; nodes' snapshot and broadcast servers get certificates "
                            "from it at join). auto (default): on unless the advertised address is loopback")
    for name, field in CoordinatorConfig.model_fields.items():
        if isinstance(field.default, bool):
            serve.add_argument(f"--{name.replace('_', '-')}", action="store_true", help=field.description)
        else:
            serve.add_argument(f"--{name.replace('_', '-')}", type=type(field.default), default=field.default,
                               help=f"{field.description} (default {field.default})")
    token = sub.add_parser("token", help="join tokens")
    token_sub = token.add_subparsers(dest="token_command", required=True)
    create = token_sub.add_parser("create", help="print a new join token",
                                  epilog="example: python -m elastic_mesh.coordinator token create --state-dir coord/ --ttl 24h")
    create.add_argument("--state-dir", required=True)
    create.add_argument("--ttl", type=_duration, default=_duration("24h"), help="lifetime, e.g. 30m, 24h (default 24h)")
    create.add_argument("--address", default=None, help="coordinator host:port to put in the token "
                                                         "(default: what the running coordinator advertises)")
    create.add_argument("--role", choices=ROLES, default="node",
                        help="node: joins as a training node; worker: an inference worker; observer: reads the "
                             "status and dashboard only (default node)")
    create.add_argument("--max-nodes", type=int, default=1,
                        help="live nodes this token may admit at once (default 1: one token per contributor; "
                             "a hash backed by several nodes of one token counts once at commit); for a worker "
                             "token, the broadcast members that may serve with it at once")
    create.add_argument("--publish", action="store_true",
                        help="may publish broadcast versions (python -m elastic_mesh.broadcast publish); "
                             "not for observer tokens")
    revoke = token_sub.add_parser("revoke", help="revoke a token at once: refused from now on, and the nodes "
                                                 "it admitted are dropped",
                                  epilog="example: python -m elastic_mesh.coordinator token revoke 3f9a0c1d2e4b5a69 "
                                         "--state-dir coord/")
    revoke.add_argument("token_id", help="the id `token create` printed (or `token list` shows)")
    revoke.add_argument("--state-dir", required=True)
    listing = token_sub.add_parser("list", help="the run's tokens: id, role, cap, expiry, revoked")
    listing.add_argument("--state-dir", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [coordinator] %(message)s", datefmt="%H:%M:%S")

    if args.command == "token":
        try:
            if args.token_command == "create":
                text = make_token(args.state_dir, args.ttl, args.address, args.role, args.max_nodes,
                                  args.publish)
                token = read_token(text)
                print(f"token {token.token_id}: role {token.role}, at most {token.max_nodes} live node(s), "
                      f"expires {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(token.expires_at))}"
                      + (", may publish broadcasts" if token.publish else ""), file=sys.stderr)
                print(text)
            elif args.token_command == "revoke":
                revoke_token(args.state_dir, args.token_id)
                print(f"token {args.token_id} revoked; the nodes it admitted are dropped at their next request",
                      file=sys.stderr)
            else:
                for t in list_tokens(args.state_dir):
                    state = "revoked" if t["revoked_at"] else ("expired" if t["expires_at"] < time.time() else "valid")
                    print(f"{t['token_id']}  {t['role']:8s}  max {t['max_nodes']:<4d}  "
                          f"expires {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(t['expires_at']))}  {state}")
        except (FileNotFoundError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0

    config = CoordinatorConfig(**{k: getattr(args, k) for k in CoordinatorConfig.model_fields})
    server = start_coordinator(args.state_dir, args.host, args.port, config, args.advertise, args.run_id,
                               tls={"auto": None, "on": True, "off": False}[args.tls])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    logging.info("serving run %s on %s (state in %s)", server.coordinator.run_id, server.coordinator.address,
                 args.state_dir)
    stop.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
