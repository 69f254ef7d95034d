"""How policy versions are cut for the broadcast (prime/rl/policy_transport.py)."""

from __future__ import annotations

from elastic_mesh.broadcast.member import BroadcastSettings
from prime.rl.policy_transport import SMALL_POLICY_BYTES, policy_broadcast_settings


def test_small_policies_travel_in_small_chunks_and_large_ones_in_the_default():
    default = BroadcastSettings().chunk_mb
    assert policy_broadcast_settings(2, None, payload_bytes=1_200_000).chunk_mb == 0.125
    assert policy_broadcast_settings(2, None, payload_bytes=SMALL_POLICY_BYTES).chunk_mb == default
    assert policy_broadcast_settings(2, None).chunk_mb == default  # a fetcher: it publishes nothing
