"""DiLoCo's outer loop attached to a trainer: the hook, the exchange, the outer optimizer, catching up."""
