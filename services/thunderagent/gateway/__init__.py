"""OpenAI-compatible HTTP gateway in front of the NATS request subject."""
