"""The rendezvous store's rules: who may read and write which key of the Gloo rendezvous.

Gloo forms a global group by having each rank publish its address under "<prefix><seq>/<rank>" and read
everyone else's; the mesh prefixes the keys with the epoch ("e<epoch>/r<local rank>/[s<stream>/]").
Without rules any node of the run could overwrite another epoch's addresses (pointing its members at
itself, or at nothing) or fill the store. So: only the members of an epoch touch its keys, a key that
ends in a rank is written by that rank's member only, a key is written once (a retry of the same
value is fine), and keys and values are bounded.
"""

from __future__ import annotations

import re

from elastic_mesh.coordinator.config import Refused
from elastic_mesh.coordinator.state import CoordinatorState, Node

MAX_KEY_CHARS = 200
MAX_VALUE_BYTES = 64 << 10  # Gloo's address record is ~170 bytes
_KEY = re.compile(r"e(\d{1,12})/[A-Za-z0-9_/.-]{1,%d}" % MAX_KEY_CHARS)


class RendezvousRules:
    def __init__(self, state: CoordinatorState) -> None:
        self.state = state

    def rank_of(self, node: Node, key: str) -> int:
        """The rank of `node` in the epoch `key` belongs to; Refused unless it is one of its members."""
        match = _KEY.fullmatch(key) if len(key) <= MAX_KEY_CHARS else None
        if match is None:
            raise Refused(400, f"rendezvous keys are e<epoch>/... of at most {MAX_KEY_CHARS} characters "
                               f"(letters, digits, _ / . -), not {key[:80]!r}")
        epoch = int(match.group(1))
        for rank, member in enumerate(self.state.epoch_members(epoch)):
            if member["node_id"] == node.node_id:
                return rank
        raise Refused(403, f"{node.name} is not a member of epoch {epoch}: only its members use its rendezvous")

    def check_set(self, node: Node, key: str, value: bytes) -> bool:
        """Whether the write is new (False: the same value again, e.g. a retried request); Refused if the
        node may not write it."""
        rank = self.rank_of(node, key)
        if len(value) > MAX_VALUE_BYTES:
            raise Refused(413, f"a rendezvous value holds at most {MAX_VALUE_BYTES} bytes, not {len(value)}")
        last = key.rsplit("/", 1)[-1]
        if last.isdigit() and int(last) != rank:
            raise Refused(403, f"{key!r} is rank {last}'s address; {node.name} is rank {rank} of this epoch")
        current = self.state.store_get(key)
        if current is not None and current != value:
            raise Refused(409, f"rendezvous key {key!r} is set already; a key is written once")
        return current is None
