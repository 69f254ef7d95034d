"""Task sources with their own verifiers: the interface and the built-in tasks."""
