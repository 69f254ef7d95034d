"""Chunked, hashed transfer of named tensors between processes: manifests, a server, a resumable multi-source fetcher."""
