"""The scrape endpoint answers /metrics and 404s everything else (prometheus_client's own server
answers any path with the metrics)."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client import Counter

from thunderagent.telemetry.endpoint import start_metrics_server

PROBE = Counter("thunderagent_endpoint_probe", "a counter this test reads back")


@pytest.fixture
def base_url():
    server, thread = start_metrics_server(0, "127.0.0.1")
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)
    assert not thread.is_alive()


@pytest.mark.parametrize("path", ["/metrics", "/metrics/", "/metrics?debug=1"])
def test_the_metrics_path_serves_the_registry(base_url: str, path: str) -> None:
    PROBE.inc()
    with urllib.request.urlopen(base_url + path, timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    assert "thunderagent_endpoint_probe_total" in text


@pytest.mark.parametrize("path", ["/", "/healthz", "/metricsx", "/favicon.ico", "/x/metrics"])
def test_any_other_path_is_not_found(base_url: str, path: str) -> None:
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(base_url + path, timeout=10)
    assert err.value.code == 404
    assert b"/metrics" in err.value.read()
