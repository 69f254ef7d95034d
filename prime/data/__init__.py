"""Data: built-in corpus, tokenizers, shard readers and packing into fixed-length sequences."""
