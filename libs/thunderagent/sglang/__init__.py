"""SGLang wire formats: KV-event batches, the ZMQ publisher/subscriber framing, block hashes.

`kv_wire` and `seq` are pure (no I/O). `zmq_publisher` and `zmq_subscriber` are I/O helpers:
the simulated engine publishes through the first, the worker adapter subscribes with the second.
"""
