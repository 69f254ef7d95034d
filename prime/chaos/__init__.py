"""Fault injection that production code may carry: a node's self-inflicted faults (`--chaos.*`),
installed as a hook of their own only when one is set. Test helpers that production never imports
live in prime/testing/."""
