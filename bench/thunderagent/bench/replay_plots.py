"""``thunderagent bench replay --plot DIR``: TTFT CDFs, hit ratios, per-worker load and the
capacity plot (TTFT p99 and goodput against speed), as PNGs (matplotlib, the ``bench`` extra).
"""

from __future__ import annotations

import sys
from pathlib import Path

from thunderagent.replay import ReplayResult


def write_plots(doc: dict, results: dict[tuple[str, float], ReplayResult], out: Path) -> list[Path]:
    try:
        import matplotlib
    except ModuleNotFoundError:
        print("--plot needs matplotlib (pip install 'thunderagent[bench]')", file=sys.stderr)
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    stem = Path(doc["trace"]).stem
    speeds = sorted({s for _, s in results})
    policies = list(dict.fromkeys(p for p, _ in results))
    paths: list[Path] = []
    for speed in speeds:
        tag = out / f"{stem}_x{speed:g}"
        title = f"{stem}, speed x{speed:g}"
        runs = {policy: results[(policy, speed)] for policy in policies}
        entries = [e for e in doc["results"] if e["speed"] == speed]
        paths.append(_ttft_cdf(runs, title, Path(f"{tag}_ttft_cdf.png"), plt))
        paths.append(_hit_ratios(entries, title, Path(f"{tag}_hit_ratio.png"), plt))
        paths.append(_worker_load(runs, title, Path(f"{tag}_worker_load.png"), plt))
    if len(speeds) > 1:
        paths.append(_capacity_plot(doc, policies, stem, out, plt))
    return paths


def _ttft_cdf(runs: dict[str, ReplayResult], title: str, path: Path, plt) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, result in runs.items():
        ttft = sorted(r.first_token - r.arrival for r in result.records if r.status == "completed")
        ys = [(i + 1) / len(ttft) for i in range(len(ttft))]
        ax.plot(ttft, ys, label=policy)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF: {title}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return _save(fig, path, plt)


def _hit_ratios(entries: list[dict], title: str, path: Path, plt) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.bar([e["policy"] for e in entries], [e["prefix_hit_ratio"] for e in entries])
    ax.axhline(entries[0]["ideal_hit_ratio"], color="k", ls="--", label="ideal (unlimited)")
    ax.axhline(entries[0]["pooled_hit_ratio"], color="r", ls=":", label="pooled LRU")
    ax.set_ylabel("prefix hit ratio (tokens)")
    ax.set_title(f"Cache hits: {title}")
    ax.tick_params(axis="x", labelrotation=20)
    ax.legend()
    return _save(fig, path, plt)


def _worker_load(runs: dict[str, ReplayResult], title: str, path: Path, plt) -> Path:
    n = len(runs)
    fig, axes = plt.subplots(n, 1, figsize=(8, 1.8 * n), sharex=True)
    axes = axes if n > 1 else [axes]
    for ax, (policy, result) in zip(axes, runs.items(), strict=True):
        tl = result.timeline
        ts = [t / 60 for t, _ in tl]
        for w in range(len(tl[0][1]) if tl else 0):
            ax.plot(ts, [v[w] for _, v in tl], lw=0.7)
        ax.set_ylabel(policy, fontsize=8)
    axes[-1].set_xlabel("virtual minutes")
    axes[0].set_title(f"Per-worker requests (running + waiting): {title}")
    return _save(fig, path, plt)


def _capacity_plot(doc: dict, policies: list[str], stem: str, out: Path, plt) -> Path:
    """TTFT p99 (every request; an unanswered one counts as never) and goodput vs speed."""
    slo_s = doc["slo_ttft_p99_ms"] / 1000
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    for policy in policies:
        mine = [e for e in doc["results"] if e["policy"] == policy]
        mine.sort(key=lambda e: e["speed"])
        speeds = [e["speed"] for e in mine]
        p99 = [min(e["ttft_p99_all_ms"] / 1000, 10 * slo_s) for e in mine]
        top.plot(speeds, p99, marker="o", label=policy)
        bottom.plot(speeds, [e["goodput_rps"] for e in mine], marker="o", label=policy)
    top.axhline(slo_s, color="k", ls="--", lw=0.8, label="SLO")
    ceiling = (doc.get("work_ceiling") or {}).get("pooled", {}).get("speed")
    if ceiling is not None and ceiling <= 1.1 * max(e["speed"] for e in doc["results"]):
        for ax in (top, bottom):  # past it even one pooled cache cannot keep up (steady state)
            ax.axvline(ceiling, color="grey", ls=":", lw=1.0, label="work ceiling, pooled LRU")
    top.set_yscale("log")
    top.set_ylabel("TTFT p99 (s)")
    top.set_title(f"Capacity: {stem}")
    bottom.set_ylabel("goodput (requests/s within the SLO)")
    bottom.set_xlabel("speed (arrival-rate multiplier)")
    for ax in (top, bottom):
        ax.grid(True, which="both", alpha=0.3)
    top.legend(fontsize=8)
    return _save(fig, out / f"{stem}_capacity.png", plt)


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
