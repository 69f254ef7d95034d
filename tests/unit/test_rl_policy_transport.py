"""How policy versions are cut for the broadcast (prime/rl/transport/policy_files.py)."""

from __future__ import annotations

from elastic_mesh.broadcast.member import BroadcastSettings
from prime.rl.transport.policy_files import (
    SMALL_POLICY_BYTES,
    policy_broadcast_settings,
    prune_policies,
)


def test_small_policies_travel_in_small_chunks_and_large_ones_in_the_default():
    default = BroadcastSettings().chunk_mb
    assert policy_broadcast_settings(2, None, payload_bytes=1_200_000).chunk_mb == 1 / 32  # 37 chunks of 32 KiB
    assert policy_broadcast_settings(2, None, payload_bytes=4 << 20).chunk_mb == 1 / 16  # 64 of 64 KiB
    assert policy_broadcast_settings(2, None, payload_bytes=(4 << 20) + 1).chunk_mb == 1 / 8
    assert policy_broadcast_settings(2, None, payload_bytes=SMALL_POLICY_BYTES - 1).chunk_mb == default
    assert policy_broadcast_settings(2, None, payload_bytes=SMALL_POLICY_BYTES).chunk_mb == default
    assert policy_broadcast_settings(2, None).chunk_mb == default  # a fetcher: it publishes nothing


def test_versions_below_the_oldest_kept_are_pruned_with_their_staging_directories(tmp_path):
    for name in ("v00000001", "v00000002", "v00000002.k3x9", "v00000003", "v00000004", "v00000005.q1", "vault"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    prune_policies(tmp_path, below=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000004", "v00000005.q1", "vault"]
