"""The run token every RL role starts with, given on the command line or in a file."""

from __future__ import annotations

import sys
from pathlib import Path

from elastic_mesh import Flag, JoinToken

# The service an RL run's orchestrator offers: its token names it (token create --service orchestrator), so its
# TLS certificate does, and the trainer and workers accept no other member's certificate in its place.
ORCHESTRATOR_SERVICE = "orchestrator"

# A worker's compute dtype is its token's (token create --role worker --attributes dtype=bfloat16), not what
# its rollouts claim: a float32 worker cannot label its rollouts bfloat16 to be held to bfloat16's looser limits.
DTYPE_ATTRIBUTE = "dtype"


def worker_dtype(token: JoinToken) -> str:
    """The compute dtype a worker token admits its holder as (float32 where it names none)."""
    return token.attributes.get(DTYPE_ATTRIBUTE, "float32")


TOKEN_FLAGS = [
    Flag("token", "a run token (python -m elastic_mesh.coordinator token create)", metavar="TOKEN"),
    Flag("token-file", "read the token from this file instead (keeps it out of the process list)", type=Path,
         metavar="FILE"),
]


def token_of(flags: dict) -> str:
    """The token of --token-file or --token; exits 2 naming both when neither was given."""
    if flags.get("token_file"):
        try:
            return Path(flags["token_file"]).read_text().strip()
        except OSError as e:
            _exit(f"--token-file {flags['token_file']}: {e.strerror}")
    if flags.get("token"):
        return str(flags["token"]).strip()
    _exit("a run token is needed: --token TOKEN or --token-file FILE (from `python -m elastic_mesh.coordinator "
          "token create`)")


def _exit(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)
