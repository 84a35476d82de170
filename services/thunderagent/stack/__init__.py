"""The embedded stack: NATS + Redis + every service + N simulated workers on one machine."""
