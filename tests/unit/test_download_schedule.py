"""The download engine's scheduling core (elastic_mesh/transfer/schedule.py), called directly: no
socket, no thread, time passed in."""

import pytest

from elastic_mesh.transfer.schedule import DownloadSchedule, NoUsableSource, Request, endgame_patience
from elastic_mesh.transfer.sources import SourcePicker


def bits(*held: int, size: int = 8) -> bytes:
    out = bytearray((size + 7) // 8)
    for i in held:
        out[i // 8] |= 1 << (i % 8)
    return bytes(out)


def schedule(chunks: int, **options) -> DownloadSchedule:
    return DownloadSchedule(chunks, SourcePicker(streams_per_source=options.pop("per_source", 2), seed=0), seed=0,
                            **options)


def drain(s: DownloadSchedule, held: set[int], holders: dict, seeders=frozenset(), now: float = 0.0) -> list[Request]:
    """Every request the schedule starts now, until it has nothing more to start."""
    out = []
    while (request := s.next(held, holders, set(seeders), now)) is not None:
        out.append(request)
    return out


def test_rarest_chunks_first_and_never_two_requests_for_one_chunk():
    s = schedule(4, per_source=4)
    first = drain(s, set(), {"a": bits(0, 1, 2, 3), "b": bits(0)})
    assert [r.index for r in first][-1] == 0  # held by two sources: asked last
    assert sorted(r.index for r in first) == [0, 1, 2, 3] and all(r.source == "a" for r in first[:3])


def test_a_seeder_is_asked_only_for_what_no_peer_holds_and_chooses_among_it():
    s = schedule(6, per_source=4)
    requests = drain(s, set(), {"origin": None, "peer": bits(0, 1)}, seeders={"origin"})
    by_peer = [r for r in requests if r.source == "peer"]
    seeded = [r for r in requests if r.source == "origin"]
    assert sorted(r.index for r in by_peer) == [0, 1]
    assert len(seeded) >= 1 and seeded[0].seeded and set(seeded[0].chunks) == {2, 3, 4, 5}
    assert s.seeding == len(seeded)
    s.finished(seeded[0])
    assert s.seeding == len(seeded) - 1


def test_a_peer_still_fetching_gets_a_standing_request_when_nothing_else_can_start():
    s = schedule(4, wait_s=2.0, per_source=1)
    requests = drain(s, set(), {"origin": None, "peer": bits(size=4)}, seeders={"origin"})
    standing = [r for r in requests if r.standing]
    assert len(standing) == 1 and standing[0].source == "peer" and standing[0].wait_s == 2.0
    assert set(standing[0].chunks) == {0, 1, 2, 3} and s.standing == {"peer"}
    s.finished(standing[0])
    assert s.standing == set()


def test_with_streamed_answers_the_standing_stream_comes_first():
    s = schedule(4, wait_s=2.0, streamed=True, streams=6)
    first = s.next(set(), {"origin": None, "peer": bits(size=4)}, {"origin"}, 0.0)
    assert first.standing and first.source == "peer"
    second = s.next(set(), {"origin": None, "peer": bits(size=4)}, {"origin"}, 0.0)
    assert second.seeded and second.source == "origin" and s.streamed_from == {"origin"}


def test_the_endgame_asks_a_second_source_only_for_a_late_chunk():
    s = schedule(2, per_source=4)
    holders = {"a": bits(0, 1), "b": bits(0, 1)}
    started = drain(s, set(), holders, now=0.0)
    assert len(started) == 2
    s.settle(started[0].index, started[0].source, "ok", now=0.1)
    s.chunk_took(0.1)
    held = {started[0].index}
    assert drain(s, held, holders, now=0.2) == []  # the other is on its way at the usual pace
    assert endgame_patience(s.took) == pytest.approx(0.3) and endgame_patience([]) == 1.0
    late = drain(s, held, holders, now=0.31)
    assert len(late) == 1 and late[0].index == started[1].index and late[0].source != started[1].source


def test_a_source_that_failed_a_chunk_is_not_asked_for_it_again_and_the_download_ends_when_none_is_left():
    s = schedule(1, stall_s=5.0)
    holders = {"a": bits(0), "b": bits(0)}
    first = s.next(set(), holders, set(), 0.0)
    s.picker.failed(first.source)
    s.settle(0, first.source, "failed", now=0.1)
    second = s.next(set(), holders, set(), 0.2)
    assert second.source != first.source
    s.picker.failed(second.source)
    s.settle(0, second.source, "corrupt", now=0.3)
    assert s.next(set(), holders, set(), 1.0) is None  # nothing in flight, but the stall time is not over
    with pytest.raises(NoUsableSource, match="chunk 0: no usable source holds it"):
        s.next(set(), holders, set(), 5.1)


def test_busy_sources_leave_nothing_to_start_and_a_complete_download_asks_nothing():
    s = schedule(8, per_source=1)
    assert len(drain(s, set(), {"a": None})) == 1  # one stream per source
    assert s.next(set(range(8)), {"a": None}, set(), 0.0) is None


def test_a_holder_that_has_not_delivered_does_not_keep_chunks_from_the_seeder():
    """A bogus holder claims every chunk (issue 50: every honest download waited out a 10 s time-out on
    it). While its streams are busy, it has delivered nothing and a request of it is older than
    UNPROVEN_PATIENCE_S, the seeder is asked instead; once it is a suspect (a request of it failed in an earlier
    download of this member), it counts for nothing beside a seeder."""
    s = schedule(4, per_source=2)
    requests = drain(s, set(), {"origin": None, "bogus": None}, seeders={"origin"})
    assert [r.source for r in requests] == ["bogus", "bogus"]  # never tried: tried first; at once, waited for
    late = drain(s, set(), {"origin": None, "bogus": None}, seeders={"origin"}, now=0.6)  # past 0.5 s
    assert late and all(r.source == "origin" for r in late)  # ...but not past the patience
    honest = schedule(4, per_source=2)
    honest.picker.done("peer", 1000, 0.1)  # a peer that delivered: its busy streams are waited for
    honest.picker.stats["peer"].in_flight = 2
    assert drain(honest, set(), {"origin": None, "peer": None}, seeders={"origin"}) == []
    wary = DownloadSchedule(4, SourcePicker(streams_per_source=2, seed=0, suspects={"bogus"}), seed=0)
    requests = drain(wary, set(), {"origin": None, "bogus": None}, seeders={"origin"})
    assert requests and all(r.source == "origin" for r in requests) and requests[0].seeded
    alone = DownloadSchedule(2, SourcePicker(streams_per_source=2, seed=0, suspects={"bogus"}), seed=0)
    assert {r.source for r in drain(alone, set(), {"bogus": None})} == {"bogus"}  # nobody else: asked after all
