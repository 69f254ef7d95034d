"""How policy versions are cut for the broadcast (prime/rl/transport/policy_files.py)."""

from __future__ import annotations

import time

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


def test_a_publish_that_fails_is_retried_in_the_background_and_the_trainer_goes_on(tmp_path):
    """The trainer never dies of the broadcast (issue 50): with the coordinator gone, a publish returns
    at once and is retried; its weights are copied (the model trains on); when the coordinator is back
    on its port the version goes out with the weights it had, and a newer version supersedes a waiting one."""
    import torch

    from elastic_mesh.broadcast.member import BroadcastMember
    from elastic_mesh.coordinator.run import make_token, start_coordinator
    from prime.rl.policy import new_digit_policy
    from prime.rl.transport.policy_files import fetch_policy
    from prime.rl.transport.weights import BroadcastPublisher, RetryingPublisher
    from transformers import AutoModelForCausalLM

    policy = new_digit_policy(tmp_path / "policy", seed=0)
    model = AutoModelForCausalLM.from_pretrained(policy)
    coordinator = start_coordinator(tmp_path / "coord")
    port = coordinator.port
    member = BroadcastMember(make_token(tmp_path / "coord", 3600, publish=True), "policy", tmp_path / "b",
                             BroadcastSettings(host="127.0.0.1"))
    member.client.retry_s = 0.5  # a coordinator away answers at once here (the trainer's own waits 60 s)
    publisher = RetryingPublisher(BroadcastPublisher(member, policy, {}), first_retry_s=0.2, max_retry_s=0.5)
    try:
        publisher.publish(0, model)
        coordinator.stop()
        publisher.publish(1, model)  # fails: returns, waits for a retry
        assert publisher.waiting == 1 and publisher.failures == 1
        sent = {name: t.clone() for name, t in model.state_dict().items()}
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # the model trains on meanwhile
        coordinator = start_coordinator(tmp_path / "coord", port=port)
        deadline = time.monotonic() + 30
        while publisher.waiting is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert publisher.waiting is None and publisher.newest() == 1
        reader = BroadcastMember(make_token(tmp_path / "coord", 3600, role="worker"), "policy", tmp_path / "r",
                                 BroadcastSettings(host="127.0.0.1", stall_s=10), serve=False)
        out = fetch_policy(reader, reader.manifest(1), tmp_path / "fetched")
        reader.stop()
        fetched = AutoModelForCausalLM.from_pretrained(out).state_dict()
        assert all(torch.equal(fetched[name], t) for name, t in sent.items() if name in fetched)
        coordinator.stop()
        publisher.publish(2, model)
        publisher.publish(3, model)  # supersedes 2, which never goes out
        coordinator = start_coordinator(tmp_path / "coord", port=port)
        deadline = time.monotonic() + 30
        while publisher.waiting is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert publisher.newest() == 3 and publisher.failures == 3
    finally:
        member.stop()
        coordinator.stop()
