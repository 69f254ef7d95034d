"""What every role shares: the model, the inner optimizer, parallelisation, checkpoints, metrics, progress."""
