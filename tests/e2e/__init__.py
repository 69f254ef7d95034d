"""End-to-end runs: real torchrun nodes, clusters, network namespaces and a browser (pytest -m e2e)."""
