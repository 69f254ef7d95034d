"""The RL run's dashboard, served by the orchestrator: rollouts/s, reward, staleness, and every worker's
verified and rejected rollouts.

The page (dashboard/index.html, with the coordinator dashboard's charts and style) holds no data; it
asks POST /v1/rl/dashboard with the token from its URL's #fragment, which never reaches a server. Any
token that may read the run's status may read it (observer tokens are made for this). Answers are
incremental: the events after the last id the page has.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import asdict
from pathlib import Path

from elastic_mesh import DASHBOARD_DIR
from prime.rl.orchestrator.core import Orchestrator

_HERE = Path(__file__).parent / "dashboard"
PAGES = {
    "/": (_HERE / "index.html", "text/html; charset=utf-8"),
    "/index.html": (_HERE / "index.html", "text/html; charset=utf-8"),
    "/rl.js": (_HERE / "rl.js", "text/javascript; charset=utf-8"),
    "/charts.js": (DASHBOARD_DIR / "charts.js", "text/javascript; charset=utf-8"),
    "/dashboard.css": (DASHBOARD_DIR / "dashboard.css", "text/css; charset=utf-8"),
}
PATH = "/v1/rl/dashboard"
# What a chart needs of an event; the rest (a batch's prompt numbers, say) stays in metrics.jsonl.
_FIELDS = {"batch": ("step", "time_s", "reward_mean", "staleness_mean", "staleness_max", "groups", "groups_kept",
                     "rollouts_accepted", "rollouts_rejected", "rollouts_stale", "workers", "leased_to_arrived_s",
                     "arrived_to_verified_s", "verified_to_batch_s", "asked_to_built_s"),
           "eval": ("version", "time_s", "eval_reward"),
           "evicted": ("worker", "reason", "time_s")}


class RunHistory:
    """The last `keep` events of the run (batches, evaluations, evictions), numbered from 1."""

    def __init__(self, keep: int = 20000) -> None:
        self._events: deque[dict] = deque(maxlen=keep)
        self._next = 1
        self._lock = threading.Lock()

    def add(self, event: dict) -> None:
        fields = _FIELDS.get(event.get("event", ""))
        if fields is None:
            return
        with self._lock:
            self._events.append({"id": self._next, "event": event["event"],
                                 **{k: event[k] for k in fields if k in event}})
            self._next += 1

    def after(self, after_id: int, limit: int = 5000) -> tuple[list[dict], int]:
        with self._lock:
            events = [e for e in self._events if e["id"] > after_id][:limit]
            last = events[-1]["id"] if events else max(after_id, 0)
        return events, last


def dashboard_answer(orchestrator: Orchestrator, history: RunHistory, body: dict) -> dict:
    after = int(body.get("after", 0))
    events, last = history.after(after)
    held = orchestrator.leases_by_worker()
    with orchestrator.lock:
        workers = [{"worker": name, "leases_held": held.get(name, 0), **asdict(stats),
                    "share": orchestrator.config.shares.allowed(stats), "evicted": orchestrator.counters.evicted.get(name)}
                   for name, stats in sorted(orchestrator.counters.workers.items())]
    config = orchestrator.config
    run = {"elapsed_s": orchestrator.elapsed(), "newest_version": orchestrator.versions.newest,
           "next_step": orchestrator.next_step, "async_level": config.async_level, "done": orchestrator.done,
           "prompts_per_step": config.prompts_per_step, "group_size": config.group_size,
           "environment": config.env.name, **orchestrator.totals()}
    return {"run": run, "workers": workers, "events": events, "last_id": last}
