"""RL post-training (PRIME-RL style): the trainer, worker and orchestrator roles (sibling packages),
the transports between them (transport/), the tasks (environments/), the GRPO objective and the
synchronous reference loop they are measured against."""
