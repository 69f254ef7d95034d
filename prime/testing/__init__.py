"""Fault injection for tests and the chaos harness; never installed into a job by its config."""
