"""Index service: the authoritative KV block index, fed from JetStream."""
