"""Numbered rounds as a member takes part in them: it declares itself ready, the coordinator fixes who
takes part, every member votes, all commit the hash of the state they hold (plan.py). The coordinator's
side of the same protocol is elastic_mesh/coordinator/barrier.py."""
