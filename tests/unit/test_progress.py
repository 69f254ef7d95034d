"""The node's terminal display: a live rich line on a terminal, plain log lines otherwise, quiet on request."""

from __future__ import annotations

import io
import logging

from rich.console import Console

from prime.core.progress import ProgressDisplay


def feed(display: ProgressDisplay, steps: range, step_s: float = 0.5) -> None:
    for step in steps:
        display.observe({"step": step, "loss": 3.0 - step / 100, "tokens_per_s": 2048.0, "step_s": step_s})
        if step % 5 == 0:
            display.observe({"outer_step": step // 5, "bytes_sent": 2_500_000, "allreduce_s": 0.2})


def test_terminal_line_shows_inner_step_loss_outer_step_eta_and_bytes():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=200, color_system=None)
    display = ProgressDisplay(total=20, start=0, enabled=True, every=5, prefix="[node0]", console=console)
    display.sync_every = 5
    feed(display, range(1, 13))
    assert display.detail() == "inner 2/5 · loss 2.880 · 2,048 tok/s · outer 2 · sync in 0:02 · 5.0 MB sent"
    display.note("step 10 eval_loss 2.9000")
    display.close()
    text = out.getvalue()
    assert "[node0]" in text and "12/20" in text and "inner 2/5" in text and "step 10 eval_loss 2.9000" in text


def test_plain_log_lines_when_not_a_terminal(caplog):
    display = ProgressDisplay(total=20, start=0, enabled=True, every=5, prefix="[node0]")
    display.sync_every = 5
    with caplog.at_level(logging.INFO, logger="prime.core.progress"):
        feed(display, range(1, 11))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["[node0] step 5/20 inner 5/5 · loss 2.950 · 2,048 tok/s · outer 0 · 0.0 MB sent",
                     "[node0] step 10/20 inner 5/5 · loss 2.900 · 2,048 tok/s · outer 1 · 2.5 MB sent"]


def test_quiet_drops_step_lines_but_keeps_events(caplog):
    display = ProgressDisplay(total=20, start=0, enabled=True, every=1, prefix="[n]", quiet=True)
    with caplog.at_level(logging.INFO, logger="prime.core.progress"):
        feed(display, range(1, 6))
        display.note("checkpoint step 5 written")
    assert [r.getMessage() for r in caplog.records] == ["[n] checkpoint step 5 written"]
