"""The coordinator: admits nodes, fixes the members of every round, serves the rendezvous store.

It never sits on the data path. Its decisions are written to SQLite in the same transaction as they are
made, so a restarted coordinator continues the run.
"""
