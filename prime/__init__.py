"""prime: decentralized DiLoCo pretraining. The trainer; it uses `elastic_mesh` for cross-node traffic."""
