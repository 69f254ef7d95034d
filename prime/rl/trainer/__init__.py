"""The RL trainer role (trusted): GRPO steps on the orchestrator's batches, each new policy version
published through the broadcast. `python -m prime.rl.trainer --help`."""
