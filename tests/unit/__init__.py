"""Fast tests: one module or one process at a time, real sockets and SQLite; the unit part runs in under 2 minutes."""
