"""Coordinator command line.

    python -m elastic_mesh.coordinator serve --port 29400 --state-dir coord/
    python -m elastic_mesh.coordinator token create --state-dir coord/ --ttl 24h [--role node] [--max-nodes 1] [--publish]
    python -m elastic_mesh.coordinator token list --state-dir coord/
    python -m elastic_mesh.coordinator token revoke ID --state-dir coord/
"""

from __future__ import annotations

import logging
import re
import signal
import sys
import threading
import time
from types import SimpleNamespace

from elastic_mesh.cli import CommandLine, Commands, Flag, Positional
from elastic_mesh.control.token import ROLES, check_attributes, read_token
from elastic_mesh.coordinator.config import CoordinatorConfig
from elastic_mesh.coordinator.run import (
    list_tokens,
    make_token,
    revoke_token,
    start_coordinator,
)


def duration(text: str) -> float:
    """Seconds of a duration written as 90s, 30m, 24h or 7d (a bare number: seconds)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd]?)", text.strip())
    if not match:
        raise ValueError(f"{text!r} is not a duration; write e.g. 90s, 30m, 24h or 7d")
    return float(match[1]) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match[2]]


def attribute_list(text: str) -> dict[str, str]:
    """KEY=VALUE,... as a token's attributes (checked as create_token checks them)."""
    pairs = [p.strip() for p in text.split(",") if p.strip()]
    if not all("=" in p for p in pairs):
        raise ValueError(f"{text!r}: write attributes as KEY=VALUE, comma-separated (e.g. dtype=bfloat16)")
    return check_attributes(dict(p.split("=", 1) for p in pairs))


STATE_DIR = Flag("state-dir", "SQLite state and the run secret live here", required=True, metavar="DIR")
PROG = "python -m elastic_mesh.coordinator"
COMMANDS = Commands(PROG, "The coordinator of a prime run, and its join tokens.", {
    "serve": CommandLine(
        f"{PROG} serve", "Run the coordinator.", CoordinatorConfig,
        [STATE_DIR,
         Flag("host", "address to listen on", default="0.0.0.0", metavar="HOST"),
         Flag("port", "port (0: any free port; see STATE_DIR/address)", type=int, default=29400, metavar="PORT"),
         Flag("advertise", "host:port that nodes use to reach this coordinator", metavar="HOST:PORT"),
         Flag("run-id", "name of the run (default: a new random one)", metavar="NAME"),
         Flag("tls", "serve HTTPS with the run's own certificate, which join tokens pin (made in STATE_DIR on first "
                     "use; nodes' snapshot and broadcast servers get certificates from it at join). auto: on unless "
                     "the advertised address is loopback", choices=("auto", "on", "off"), default="auto",
              metavar="auto|on|off")],
        examples=[f"{PROG} serve --port 29400 --state-dir coord/ --lease_s 10"]),
    "token": Commands(f"{PROG} token", "Join tokens: create, list, revoke.", {
        "create": CommandLine(
            f"{PROG} token create", "Print a new join token.", None,
            [STATE_DIR,
             Flag("ttl", "lifetime, e.g. 30m, 24h", type=duration, default=duration("24h"), metavar="DURATION"),
             Flag("address", "coordinator host:port to put in the token (default: what the running coordinator "
                             "advertises)", metavar="HOST:PORT"),
             Flag("role", "node: joins as a training node; worker: an inference worker; observer: reads the status "
                          "and dashboard only", choices=ROLES, default="node", metavar="ROLE"),
             Flag("max-nodes", "live nodes this token may admit at once (1: one token per contributor; a hash backed "
                               "by several nodes of one token counts once at commit); for a worker token, the "
                               "broadcast members that may serve with it at once", type=int, default=1, metavar="N"),
             Flag("publish", "may publish broadcast versions (python -m elastic_mesh.broadcast publish); not for "
                             "observer tokens", switch=True),
             Flag("service", "a service its holder offers the run (e.g. orchestrator, for an RL run's orchestrator): "
                             "its TLS certificate names it, and clients that expect the service accept no other",
                  default="", metavar="NAME"),
             Flag("attributes", "what the run's application admits the holder as, signed into the token: "
                                "comma-separated KEY=VALUE (prime's RL: dtype=bfloat16 for a worker computing in "
                                "bfloat16; a worker token without it is a float32 worker)", type=attribute_list,
                  default={}, metavar="KEY=VALUE,...")],
            examples=[f"{PROG} token create --state-dir coord/ --ttl 24h",
                      f"{PROG} token create --state-dir coord/ --role worker --attributes dtype=bfloat16"]),
        "revoke": CommandLine(
            f"{PROG} token revoke", "Revoke a token at once: refused from now on, and the nodes it admitted are "
                                    "dropped.", None, [STATE_DIR],
            positionals=[Positional("token_id", "the id `token create` printed (or `token list` shows)")],
            examples=[f"{PROG} token revoke 3f9a0c1d2e4b5a69 --state-dir coord/"]),
        "list": CommandLine(f"{PROG} token list", "The run's tokens: id, role, cap, expiry, revoked.", None,
                            [STATE_DIR]),
    }),
})


def main(argv: list[str] | None = None) -> int:
    words, parsed = COMMANDS.parse(argv)
    args = SimpleNamespace(**parsed.flags, **parsed.positionals)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [coordinator] %(message)s", datefmt="%H:%M:%S")

    if words[0] == "token":
        try:
            if words[1] == "create":
                text = make_token(args.state_dir, args.ttl, args.address, args.role, args.max_nodes,
                                  args.publish, args.service, args.attributes)
                token = read_token(text)
                print(f"token {token.token_id}: role {token.role}, at most {token.max_nodes} live node(s), "
                      f"expires {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(token.expires_at))}"
                      + (", may publish broadcasts" if token.publish else "")
                      + (f", offers the service {token.service}" if token.service else "")
                      + "".join(f", {k}={v}" for k, v in token.attributes.items()), file=sys.stderr)
                print(text)
            elif words[1] == "revoke":
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

    server = start_coordinator(args.state_dir, args.host, args.port, parsed.config, args.advertise, args.run_id,
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
