"""What a node's token answers for in rounds: a member that takes a place in an attempt and then holds
the others up is struck, left out of the retry of that round, and its token banned after
`max_strikes` strikes (its nodes evicted, its joins refused).

Only the coordinator's own evidence counts, never another member's word:
- no-show: the member did not say it began the attempt (/v1/present, sent before its rendezvous and
  transfer) while others did, for `show_up_grace_s` after the attempt opened (an honest member says so
  within a second of its go);
- silent: every other member voted ok (so the transfer, which needs all of them, completed), and this
  one has not voted `vote_grace_s` later, or as long as their transfer took if that is longer (an
  honest member votes right after the transfer; one behind a slow link may finish it last);
- work report: the member's vote reports work it does not hold (an honest member reports only what it
  leased), which would otherwise leave its vote missing and the attempt waiting.
Each costs the others one attempt at most: the attempt is aborted at once and retried without it.
"""

from __future__ import annotations

import logging

from elastic_mesh.coordinator.config import CoordinatorConfig
from elastic_mesh.coordinator.state import CoordinatorState

log = logging.getLogger(__name__)


class Strikes:
    def __init__(self, state: CoordinatorState, config: CoordinatorConfig, members) -> None:
        """members: the run's Membership (coordinator/membership.py): live nodes, eviction."""
        self.state, self.config, self.members = state, config, members

    def strike(self, node_id: str, kind: str, why: str) -> None:
        """Inside the caller's transaction: records the strike; bans the node's token at the limit."""
        node = self.state.node(node_id)
        holder = node.token_id or node.node_id
        count = self.state.add_strike(holder, node.name, kind, why)
        self.state.event(f"{node.name} struck ({kind}: {why}); strike {count} of {self.config.max_strikes} "
                         f"for token {holder}")
        log.warning("%s struck (%s: %s): strike %d of %d for token %s", node.name, kind, why, count,
                    self.config.max_strikes, holder)
        if count >= self.config.max_strikes:
            for other in self.members.live():
                if (other.token_id or other.node_id) == holder:
                    self.members.evict(other.node_id)
                    self.state.event(f"{other.name} evicted: token {holder} is banned after {count} strikes")
            log.warning("token %s banned after %d strikes", holder, count)
