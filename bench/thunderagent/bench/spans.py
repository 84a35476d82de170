"""Spans of sampled requests, received in-process over OTLP/HTTP, turned into a per-service
breakdown of one request's wall time.

Every service on one machine stamps its spans from the same clock, so the gap between the start
of one service's span and the next one's is what that service (plus one NATS or HTTP hop) took.
"""

from __future__ import annotations

import gzip
import threading
from collections import defaultdict
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import pairwise

from thunderagent.stats import percentile


@dataclass(frozen=True, slots=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int


class SpanReceiver:
    """A minimal OTLP/HTTP ``/v1/traces`` endpoint (protobuf, optionally gzipped)."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path.rstrip("/") == "/v1/traces":
                    receiver._ingest(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}"

    def __enter__(self) -> SpanReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _ingest(self, body: bytes) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        out = []
        for rs in request.resource_spans:
            attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
            service = attrs.get("service.name", "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    ids = (s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex())
                    out.append(
                        Span(service, s.name, *ids, s.start_time_unix_nano, s.end_time_unix_nano)
                    )
        with self._lock:
            self.spans.extend(out)

    def snapshot(self) -> list[Span]:
        with self._lock:
            return list(self.spans)


def _label(span: Span) -> str:
    """Span name with the worker id left out (``worker-w3 worker`` -> ``worker worker``), so
    every adapter's hop counts as one stage."""
    first, _, rest = span.name.partition(" ")
    return f"worker {rest}" if first.startswith("worker-") else span.name


def critical_path(trace: list[Span]) -> list[Span] | None:
    """The chain of spans from the client's down to the engine's, parent by parent: the hops
    that one request actually waited on (observers, progress notices and the like are off it),
    whichever way it was dispatched. None when the trace is incomplete."""
    by_id = {s.span_id: s for s in trace}
    engine = [s for s in trace if s.name == "engine generate"]
    if not engine:
        return None
    chain = [min(engine, key=lambda s: s.start_ns)]
    while chain[-1].parent_span_id:
        parent = by_id.get(chain[-1].parent_span_id)
        if parent is None:
            return None
        chain.append(parent)
    chain.reverse()
    return chain if chain[0].name == "client generate" else None


def breakdown(spans: list[Span]) -> dict:
    """Per stage p50 / p99 in µs over the complete sampled traces: from each span on the
    critical path to the next one's start (that service's work before the hop, plus the hop),
    the engine's own span, and the way back (engine span end -> the client's final reply)."""
    traces: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        traces[s.trace_id].append(s)
    stages: dict[str, list[float]] = defaultdict(list)
    paths: dict[str, int] = defaultdict(int)
    complete = 0
    for trace in traces.values():
        chain = critical_path(trace)
        if chain is None:
            continue
        complete += 1
        names = [_label(s) for s in chain]
        paths[" -> ".join(names)] += 1
        for (a, b), (na, nb) in zip(pairwise(chain), pairwise(names), strict=True):
            stages[f"{na} -> {nb}"].append((b.start_ns - a.start_ns) / 1e3)
        client, engine = chain[0], chain[-1]
        stages["engine generate (its own span)"].append((engine.end_ns - engine.start_ns) / 1e3)
        stages["engine end -> client's final reply"].append((client.end_ns - engine.end_ns) / 1e3)
        stages["total (client span)"].append((client.end_ns - client.start_ns) / 1e3)
    return {
        "sampled_traces": complete,
        "paths": dict(paths),
        "stages_us": {
            label: {
                "n": len(v),
                "p50": round(percentile(v, 50), 1),
                "p99": round(percentile(v, 99), 1),
            }
            for label, v in stages.items()
        },
    }
