"""Proves (or disproves) exactly-once data: reads the coordinator's ledger of committed ranges and
counts, by document id, how often each document's tokens entered a committed outer step.

    python -m prime.tools.audit STATE_DIR/coordinator.sqlite --config configs/debug.toml [--set data.path=...]

For every shard and pass the committed ranges must chain from the top of the shard without gap or
overlap; every document whose first token lies in the consumed part must have entered exactly one
committed range per pass, with all of its tokens. Tokens after the last full window of a shard are
dropped by design (fewer than seq_len + 1 per shard and pass) and counted separately.
"""

from __future__ import annotations

import sqlite3
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from prime.data.leased import cursor_position
from prime.data.shards import Shard, iter_records
from prime.data.tokenizer import Tokenizer

Position = tuple[int, int]


@dataclass
class AuditReport:
    ranges: int = 0
    shard_passes: int = 0
    finished_passes: int = 0
    documents: int = 0  # (document, pass) pairs that entered a committed step
    tokens: int = 0
    duplicated: list[str] = field(default_factory=list)  # documents that entered twice in one pass
    partial: list[str] = field(default_factory=list)  # documents some of whose consumed tokens are missing
    chain_errors: list[str] = field(default_factory=list)  # gaps and overlaps between committed ranges
    tail_tokens_dropped: int = 0

    @property
    def ok(self) -> bool:
        return not (self.duplicated or self.partial or self.chain_errors)

    def summary(self) -> str:
        verdict = "exactly once" if self.ok else "NOT exactly once"
        lines = [f"data audit: {verdict}: {self.documents} document passes, {self.tokens} tokens in {self.ranges} "
                 f"committed ranges over {self.shard_passes} shard passes ({self.finished_passes} read to the end)",
                 f"  duplicated: {len(self.duplicated)}, incomplete: {len(self.partial)}, gaps/overlaps: "
                 f"{len(self.chain_errors)}, tokens dropped at shard ends (by design): {self.tail_tokens_dropped}"]
        for kind, items in (("duplicated", self.duplicated), ("incomplete", self.partial),
                            ("gap/overlap", self.chain_errors)):
            lines += [f"  {kind}: {item}" for item in items[:10]]
        return "\n".join(lines)


def audit_ledger(state: Path, shards: list[Shard], tokenizer: Tokenizer, text_field: str = "text") -> AuditReport:
    """Audits the committed ranges in a coordinator's state file (read-only: the run may still be going)."""
    from elastic_mesh import WorkLedger

    db = sqlite3.connect(f"file:{state}?mode=ro", uri=True)
    try:
        return audit(in_prime_words(WorkLedger(db, "data").log()), shards, tokenizer, text_field)
    finally:
        db.close()


def in_prime_words(log: list[dict]) -> list[dict]:
    """The coordinator leases items of kind "data" in rounds: for prime, shards and outer steps."""
    return [{**e, "shard": e["item"], "outer_step": e["round"]} for e in log]


def audit(log: list[dict], shards: list[Shard], tokenizer: Tokenizer, text_field: str = "text") -> AuditReport:
    """`log`: the ledger's committed ranges (WorkLedger.log() in prime's words: shard, outer_step); `shards`: the run's shards, in order."""
    report = AuditReport(ranges=len(log))
    by_pass: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for entry in log:
        by_pass[(entry["shard"], entry["pass"])].append(entry)
    seen: dict[tuple[str, int], int] = defaultdict(int)  # (document id, pass) -> committed ranges it entered
    for (shard, pass_), entries in sorted(by_pass.items()):
        report.shard_passes += 1
        entries.sort(key=lambda e: e["outer_step"])
        expected: Position = (0, 0)
        for e in entries:
            if cursor_position(e["start"]) != expected:
                report.chain_errors.append(f"shard {shard} pass {pass_}: outer step {e['outer_step']} read from "
                                           f"{cursor_position(e['start'])}, the previous range ended at {expected}")
            expected = cursor_position(e["end"])
        finished = entries[-1]["finished"]
        report.finished_passes += finished
        if any(e["finished"] for e in entries[:-1]):
            report.chain_errors.append(f"shard {shard} pass {pass_}: read again after it was finished")
        bounds = [(cursor_position(e["start"]), cursor_position(e["end"])) for e in entries]
        _count_documents(shards[shard], tokenizer, text_field, pass_, bounds, finished, seen, report)
    report.duplicated += [f"{doc} (pass {p}): {n} times" for (doc, p), n in seen.items() if n > 1]
    report.documents = len(seen)
    return report


def _count_documents(shard: Shard, tokenizer: Tokenizer, text_field: str, pass_: int,
                     bounds: list[tuple[Position, Position]], finished: bool,
                     seen: dict[tuple[str, int], int], report: AuditReport) -> None:
    """Walks the shard's documents once and charges each committed range's tokens to them."""
    end_of_reading = bounds[-1][1]
    for index, text, doc_id in iter_records(shard, text_field):
        if (index, 0) >= end_of_reading:
            if finished:
                report.tail_tokens_dropped += len(tokenizer.encode(text)) + 1
                continue
            break
        length = len(tokenizer.encode(text)) + 1  # the EOS that follows every document
        covered = 0
        for start, end in bounds:
            lo = start[1] if start[0] == index else (0 if start[0] < index else length)
            hi = end[1] if end[0] == index else (length if end[0] > index else 0)
            if hi > lo:
                covered += hi - lo
                if lo == 0:
                    seen[(doc_id, pass_)] += 1
        report.tokens += covered
        last = end_of_reading[0] == index  # the document the reading stopped in
        if last and finished:
            report.tail_tokens_dropped += length - covered
        elif covered != length and not last:
            report.partial.append(f"{doc_id} (pass {pass_}): {covered} of {length} tokens")


def main(argv: list[str] | None = None) -> int:
    from elastic_mesh import CommandLine, Flag, Positional
    from prime.config import JobConfig
    from prime.data.loader import train_and_eval_files
    from prime.data.shards import make_shards
    from prime.data.tokenizer import load_tokenizer

    line = CommandLine(
        "python -m prime.tools.audit",
        "Check that every document of a multi-node run entered exactly one committed outer step per pass\n"
        "(from the coordinator's data ledger). The run's config gives its data settings.",
        JobConfig,
        [Flag("config", "the run's config (for its data settings)", type=Path, default=Path("configs/debug.toml"),
              metavar="FILE")],
        positionals=[Positional("state", "the coordinator's STATE_DIR/coordinator.sqlite", type=Path)],
        examples=["python -m prime.tools.audit runs/x/coordinator/coordinator.sqlite --config configs/debug.toml "
                  "--data.path /data/corpus"])
    parsed = line.parse(argv)
    state, config = parsed.positionals["state"], parsed.config
    if not state.is_file():
        print(f"error: {state} does not exist; give the coordinator's state file (STATE_DIR/coordinator.sqlite)",
              file=sys.stderr)
        return 2
    files, _ = train_and_eval_files(config.data)
    shards = make_shards(files, config.data.parts_per_file)
    report = audit_ledger(state, shards, load_tokenizer(config.data.tokenizer), config.data.text_field)
    print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
