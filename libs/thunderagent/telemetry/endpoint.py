"""The Prometheus scrape endpoint: ``/metrics`` and nothing else.

``prometheus_client.start_http_server`` answers every path with the metrics, so a typo in a
scrape config or a health probe pointed at the wrong port looks like success. Here any other
path is a 404 naming where the metrics are, and requests are not logged to stderr one line each.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

METRICS_PATH = "/metrics"

StartResponse = Callable[..., object]
WsgiApp = Callable[[dict, StartResponse], Iterable[bytes]]


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """A scrape every few seconds is not worth a log line."""


def metrics_only(app: WsgiApp) -> WsgiApp:
    """``app`` on ``/metrics`` (with or without a trailing slash), a 404 on every other path."""

    def serve(environ: dict, start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "").rstrip("/") == METRICS_PATH:
            return app(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [f"not found; the metrics are at {METRICS_PATH}\n".encode()]

    return serve


def start_metrics_server(port: int, addr: str) -> tuple[ThreadingWSGIServer, threading.Thread]:
    """Serve the default registry on ``addr:port`` (0: a free port) from a daemon thread."""
    server = make_server(
        addr, port, metrics_only(make_wsgi_app()), ThreadingWSGIServer, handler_class=_QuietHandler
    )
    thread = threading.Thread(target=server.serve_forever, name="metrics", daemon=True)
    thread.start()
    return server, thread
