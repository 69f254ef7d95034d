"""The inference worker role (untrusted): leased prompts in, rollouts with TOPLOC proofs out, policy
versions followed through the broadcast. `python -m prime.rl.worker --help`."""
