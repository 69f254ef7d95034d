"""Helpers for tests and benchmarks that production never imports: a trained tiny policy, what a
cheating worker sends (toploc_attacks), a worker process with a tamper hook (rogue_worker)."""
