"""Kernel pacing of a real Gloo group's TCP connections (elastic_mesh/wire/socket_pacing.py), over loopback."""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time

import pytest
import torch

from tests.conftest import member_processes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_MAX_PACING_RATE is Linux's")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rates(sockets) -> list[int]:
    from elastic_mesh.wire.socket_pacing import SO_MAX_PACING_RATE

    rates = []
    for fd, _ in sockets.connections:
        with socket.socket(fileno=os.dup(fd)) as s:
            rates.append(s.getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE) & 0xFFFFFFFF)
    return rates


def _member(rank, world, port, queue, intruder_port):
    import torch.distributed as dist

    from elastic_mesh.wire.socket_pacing import HEADROOM, UNLIMITED, NewConnections

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
    try:
        # As the mesh does: watch from before the device, whose own listener accepts half the connections.
        watch = NewConnections()
        options = dist.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=60)
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
        pg = dist.ProcessGroupGloo(store, rank, world, options)
        if intruder_port and rank == 0:  # another connection opened while the group formed
            extra = socket.create_connection(("127.0.0.1", intruder_port))  # noqa: F841 (kept open)
        sockets = watch.since(peers=world - 1)
        report = {"found": None if sockets is None else len(sockets.connections)}
        if not intruder_port:
            payload = torch.zeros(300_000, dtype=torch.uint8)
            times = {}
            for label, rate in (("plain", None), ("capped", 200_000.0)):
                report[f"paced {label}"] = sockets.pace(rate)
                report[f"rates {label}"] = _rates(sockets)
                pg.barrier().wait()
                started = time.perf_counter()
                if rank == 0:
                    pg.send([payload], 1, 0).wait()
                elif rank == 1:
                    pg.recv([payload], 0, 0).wait()
                pg.barrier().wait()
                times[label] = time.perf_counter() - started
            sockets.pace(None)
            report |= {"times": times, "after": _rates(sockets),
                       "expected": (UNLIMITED, int(200_000 * HEADROOM))}
        queue.put((rank, report))
    except BaseException as e:
        queue.put((rank, {"crashed": repr(e)}))
        raise


def _run(world, intruder_port=0):
    ctx = member_processes(__name__)
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_member, args=(r, world, port, queue, intruder_port)) for r in range(world)]
    for p in procs:
        p.start()
    reports = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return reports


def test_a_groups_connections_are_found_and_the_kernel_paces_them():
    """One connection per peer is found; a cap of 200 KB/s makes 300 KB take over a second where
    loopback otherwise moves it in milliseconds; the cap is lifted afterwards."""
    reports = _run(world=3)
    for rank, report in reports.items():
        assert "crashed" not in report, report
        assert report["found"] == 2, f"rank {rank} found {report['found']} connections, not one per peer"
        unlimited, capped = report["expected"]
        assert report["rates plain"] == [unlimited] * 2 and report["paced plain"] == 2
        assert report["rates capped"] == [capped] * 2 and report["paced capped"] == 2
        assert report["after"] == [unlimited] * 2, "the cap outlived the paced transfer"
    times = reports[1]["times"]
    assert times["capped"] >= 1.0, f"300 KB under a 200 KB/s cap took {times['capped']:.2f} s: the kernel did not pace"
    assert times["plain"] < times["capped"] / 3, times


def test_a_connection_opened_meanwhile_leaves_the_group_unpaced():
    """If anything else opened a connection while the group formed, the sockets cannot be told apart
    and none is touched (the token bucket alone paces)."""
    with socket.create_server(("127.0.0.1", 0)) as intruder:
        reports = _run(world=2, intruder_port=intruder.getsockname()[1])
    assert reports[0]["found"] is None, reports[0]
    assert reports[1]["found"] == 1, reports[1]
