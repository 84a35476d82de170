"""The migration service's metrics (OpenTelemetry instruments on the Prometheus endpoint).

Names and labels are the contract of ``ops/grafana/dashboards/thunderagent-migration.json``
(listed in ops/README.md): a counter gets ``_total`` appended by the exporter, a histogram with
unit ``s`` gets ``_seconds``.
"""

from __future__ import annotations

from collections.abc import Callable

from opentelemetry.metrics import Observation

from thunderagent.telemetry.setup import meter

TRANSFER_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""A 2 MiB block moves in ~1 ms at 2 GB/s, a long prefix in seconds, a warm-up prefill longer."""


class MigrationMetrics:
    def __init__(self, gauges: Callable[[], dict[str, float]]) -> None:
        """``gauges()`` returns the current ``inflight``, ``replicated_prefixes``,
        ``hot_prefixes`` and ``last_gbps`` values (read at scrape time)."""
        m = meter("thunderagent.migration")
        self.moves = m.create_counter(
            "thunderagent_migrations",
            description="Moves that ended, by mode (replicate, migrate, drop), transport and "
            "outcome (done, failed)",
        )
        self.decisions = m.create_counter(
            "thunderagent_migration_decisions",
            description="Moves started, by mode and origin (planner, order)",
        )
        self.bytes = m.create_counter(
            "thunderagent_migration_bytes", unit="By", description="KV bytes moved between workers"
        )
        self.transfer = m.create_histogram(
            "thunderagent_migration_transfer_duration",
            unit="s",
            description="Time of the KV copy itself (NIXL read, or the warm-up prefill)",
            explicit_bucket_boundaries_advisory=list(TRANSFER_BUCKETS_S),
        )
        self.skipped_ticks = m.create_counter(
            "thunderagent_migration_skipped_ticks",
            description="Planning ticks skipped because the index service did not answer",
        )
        self._gauges = gauges
        for name, description in (
            ("inflight", "Moves running now"),
            ("replicated_prefixes", "Prefixes holding a replica the planner made"),
            ("hot_prefixes", "Tracked prefixes requested at least min_rate per second"),
            ("last_gbps", "GB/s of the last NIXL move"),
        ):
            m.create_observable_gauge(
                f"thunderagent_migration_{name}",
                [self._reader(name)],
                description=description,
            )

    def _reader(self, name: str):
        def read(_options):
            return [Observation(self._gauges().get(name, 0.0))]

        return read
