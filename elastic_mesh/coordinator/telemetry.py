"""What members report for the dashboard: which fields are kept, and how a record is cleaned.

Telemetry is for people watching the run; nothing the coordinator decides depends on it, and it knows
none of the fields' meanings (a trainer sends its loss and steps; the dashboard plots what it finds). A
node can send anything, so only short lower-case names with finite numbers survive (JSON has no NaN
and the browser would choke on it), a record keeps at most MAX_FIELDS of them, and a heartbeat
carries a bounded number of records.
"""

from __future__ import annotations

import math
import re

MAX_RECORDS_PER_HEARTBEAT = 500
MAX_FIELDS = 32
_NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")


def clean_records(raw: object) -> list[dict]:
    """The usable part of a heartbeat's `telemetry` list; anything malformed is skipped, not refused."""
    if not isinstance(raw, list):
        return []
    records = []
    for item in raw[:MAX_RECORDS_PER_HEARTBEAT]:
        if not isinstance(item, dict):
            continue
        fields = [(k, v) for k, v in item.items() if isinstance(k, str) and _NAME.fullmatch(k) and _finite_number(v)]
        record = dict(fields[:MAX_FIELDS])
        if len(record) > ("time" in record):
            records.append(record)
    return records


def _finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class TelemetryLog:
    """Each node's latest values and last heartbeat (in memory), its full history (in the state's SQLite)."""

    def __init__(self, state) -> None:
        self.state = state
        self.latest: dict[str, dict] = {}
        self.last_heartbeat: dict[str, float] = {}

    def received(self, node_id: str, raw: object, now: float) -> None:
        self.last_heartbeat[node_id] = now
        records = clean_records(raw)
        if not records:
            return
        latest = self.latest.setdefault(node_id, {})
        for record in records:
            latest.update(record)
        if "allreduce_s" in latest and latest["allreduce_s"] > 0 and "bytes_sent" in latest:
            # What this node's uplink carried during its last all-reduce, as seen by the transfer itself.
            latest["link_mbit_s"] = round(8 * latest["bytes_sent"] / latest["allreduce_s"] / 1e6, 2)
        with self.state.transaction():
            self.state.telemetry_add(node_id, records)

    def node_summary(self, node_id: str, now: float) -> dict:
        seen = self.last_heartbeat.get(node_id)
        return {"last_heartbeat_s": round(now - seen, 1) if seen else None, **self.latest.get(node_id, {})}

    def history(self, after_id: int, names: dict[str, str], limit: int = 5000) -> dict:
        rows = self.state.telemetry_since(after_id, limit)
        return {"last_id": rows[-1][0] if rows else after_id, "more": len(rows) == limit,
                "records": [{"node": names.get(n, "?"), **r} for _, n, r in rows]}
