"""The pretraining loop of one node: the Trainer and its config section."""
