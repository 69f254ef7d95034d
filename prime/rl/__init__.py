"""RL post-training (PRIME-RL style): environments, the GRPO objective, and the loop around them."""
