"""What travels between members during a collective: codecs, the quantized all-reduce, ring topology, pacing."""
