"""Generation: the engine interface that rollout workers use, a CPU engine on HF transformers, and the
seeded sampler whose choices a verifier can recompute."""
