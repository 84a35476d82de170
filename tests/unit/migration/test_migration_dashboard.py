"""The migration dashboard reads exactly the metrics ops/README.md lists for it, and those are
the instruments the migration service creates."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "ops" / "grafana" / "dashboards" / "thunderagent-migration.json"
METRICS = ROOT / "services" / "thunderagent" / "migrator" / "metrics.py"
SUFFIXES = ("_bucket", "_sum", "_count")


def listed() -> set[str]:
    text = (ROOT / "ops" / "README.md").read_text()
    section = text.split("## Migration metrics", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(thunderagent_\w+)`", section, flags=re.M))


def test_every_panel_reads_listed_metrics_and_every_listed_metric_is_read() -> None:
    names = listed()
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "thunderagent-migration"
    used: set[str] = set()
    for panel in dash["panels"]:
        exprs = [t["expr"] for t in panel["targets"]]
        assert exprs, panel["title"]
        for expr in exprs:
            found = set(re.findall(r"\bthunderagent_\w+", expr))
            assert found, f"{panel['title']}: {expr}"
            used |= {next((n.removesuffix(s) for s in SUFFIXES if n.endswith(s)), n) for n in found}
    assert used == names


def test_listed_metrics_are_the_instruments_the_service_creates() -> None:
    source = METRICS.read_text()
    created = set(re.findall(r'"(thunderagent_migration\w*)"', source))
    created |= {f"thunderagent_migration_{g}" for g in re.findall(r'\("(\w+)", "', source)}
    exported = set()
    for name in created:
        if name in ("thunderagent_migrations", "thunderagent_migration_decisions",
                    "thunderagent_migration_bytes",
                    "thunderagent_migration_skipped_ticks"):  # fmt: skip
            exported.add(name + "_total")
        elif name == "thunderagent_migration_transfer_duration":
            exported.add(name + "_seconds")
        else:
            exported.add(name)
    assert exported == listed()
