"""Control plane, client side: the coordinator client, join tokens, the rendezvous store, kept HTTP connections."""
