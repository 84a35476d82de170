"""Simulated SGLang engine: SGLang's HTTP API (and KV-event wire format) on a CPU."""
