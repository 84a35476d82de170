"""docker-compose.yml, ops/ and ops/k8s/ checked against the code, without Docker.

Static checks: every ThunderAgent command parses with the real CLI parser, every THUNDERAGENT_* /
OTEL_* variable is one the code reads, ports and hosts agree across services and prometheus.yml,
the gpu profile is complete, nats.conf passes ``nats-server -t``, the dashboard only queries the
metric names ops/README.md lists, and the Kubernetes manifests hold together. A live check then
runs the compose stack's own commands as local processes against nats-server started from
ops/nats.conf, each service with its role's credentials, and sends a request through them.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from thunderagent.cli.main import build_parser
from thunderagent.embedded import find_nats_server, free_port, spawn, wait_for_port
from thunderagent.sglang.zmq_publisher import publisher_binds

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
OPS = ROOT / "ops"
ROLES = ("router", "scheduler", "index", "worker", "client", "gateway", "migration")
SOURCE_DIRS = ("schemas", "libs", "services")
ENV_PREFIXES = ("THUNDERAGENT_", "OTEL_")

_VAR = re.compile(r"\$\{(\w+)(?:(:?)([-?])([^}]*))?\}")


def interpolate(value, env: dict[str, str]):
    """Compose's ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?error}``."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        name, colon, op, arg = m.groups()
        current = env.get(name)
        unset = current is None or (colon and current == "")
        if op == "-" and unset:
            return arg
        if op == "?" and unset:
            raise ValueError(f"{name} is required: {arg}")
        return current or ""

    return _VAR.sub(sub, value)


def raw_compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def compose(env: dict[str, str] | None = None) -> dict:
    return interpolate(raw_compose(), env or {})


def ta_services(data: dict, *, include_profiles: bool = False) -> dict[str, dict]:
    """Services built from ops/Dockerfile (the ``thunderagent`` entrypoint)."""
    return {
        name: svc
        for name, svc in data["services"].items()
        if svc.get("build", {}).get("dockerfile") == "ops/Dockerfile"
        and (include_profiles or not svc.get("profiles"))
    }


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def k8s_docs() -> list[dict]:
    docs = []
    for path in sorted((OPS / "k8s").glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def parse_cli(argv: list[str]):
    try:
        return build_parser().parse_args(argv)
    except SystemExit as err:  # argparse exits on an unknown flag or a missing argument
        raise AssertionError(f"`thunderagent {' '.join(argv)}` does not parse ({err})") from None


# --- compose ---------------------------------------------------------------------------------


def test_compose_has_the_whole_stack():
    services = compose()["services"]
    for name in ("nats", "redis", "jaeger", "prometheus", "grafana", "index", "scheduler",
                 "router", "engine-0", "engine-1", "worker-0", "worker-1"):  # fmt: skip
        assert name in services, name
    assert services["nats"]["image"].startswith("nats:2.10")
    assert services["nats"]["command"] == ["-c", "/etc/nats/nats.conf"]
    assert services["redis"]["image"].startswith("redis:7")
    assert services["jaeger"]["image"] == "jaegertracing/all-in-one:1.57"
    assert services["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    assert any(p.endswith(":4318") for p in services["jaeger"]["ports"])
    assert any(p.endswith(":16686") for p in services["jaeger"]["ports"])
    assert services["router"]["deploy"]["replicas"] >= 2
    assert "x-thunderagent" in raw_compose(), "the shared service settings are an anchor"


@pytest.mark.parametrize("name", sorted(ta_services(compose(), include_profiles=True)))
def test_service_command_parses_with_the_real_cli(name):
    svc = compose()["services"][name]
    args = parse_cli(svc["command"])
    assert callable(args.func)
    if args.command != "simengine":  # the only command without --metrics-port
        assert args.metrics_port == 9464, f"{name}: --metrics-port 9464"
        url = svc["environment"]["THUNDERAGENT_NATS_URL"]
        assert urlsplit(url).username in ROLES, f"{name}: NATS user is a role in nats.conf"


def _source_text() -> str:
    return "\n".join(
        path.read_text(errors="replace")
        for folder in SOURCE_DIRS
        for path in (ROOT / folder).rglob("*.py")
    )


def _env_names_in(text: str) -> set[str]:
    return set(re.findall(r"\b((?:THUNDERAGENT|OTEL)_[A-Z0-9_]+)\b", text))


def test_every_env_var_is_read_by_the_code():
    names = _env_names_in(COMPOSE.read_text())
    for svc in ta_services(compose(), include_profiles=True).values():
        names |= {k for k in svc.get("environment", {}) if k.startswith(ENV_PREFIXES)}
    names |= _env_names_in((OPS / "k8s" / "configmap.yaml").read_text())
    assert "THUNDERAGENT_NATS_URL" in names
    source = _source_text()
    unread = sorted(n for n in names if f'"{n}"' not in source and f"'{n}'" not in source)
    assert not unread, f"named in the compose file / k8s but read nowhere in the code: {unread}"


def test_ports_and_hosts_agree():
    data = compose()
    services = data["services"]
    nats_ports = {p.split(":")[-1] for p in services["nats"]["ports"]}
    redis = urlsplit(services["index"]["environment"]["THUNDERAGENT_REDIS_URL"])
    assert redis.hostname in services and services[redis.hostname]["image"].startswith("redis")
    assert redis.port == 6379
    nats_env = services["nats"]["environment"]
    for name, svc in ta_services(data, include_profiles=True).items():
        argv = svc["command"]
        if argv[0] == "simengine":
            continue
        url = urlsplit(svc["environment"]["THUNDERAGENT_NATS_URL"])
        assert url.hostname == "nats" and str(url.port) in nats_ports, name
        assert url.port == 4222, name
        assert url.password == nats_env[f"NATS_{url.username.upper()}_PASSWORD"], (
            f"{name}: password of user {url.username} differs from the nats service's"
        )
        if argv[0] == "worker":
            engine = urlsplit(flag(argv, "--engine-url"))
            events = urlsplit(flag(argv, "--kv-events"))
            engine_svc = services[engine.hostname]
            assert events.hostname == engine.hostname, name
            assert engine.hostname in svc["depends_on"], f"{name} starts after its engine"
            eng_argv = engine_svc["command"]
            if eng_argv[0] == "simengine":
                assert engine.port == int(flag(eng_argv, "--port")), name
                assert flag(eng_argv, "--host") == "0.0.0.0", "reachable from other containers"
            else:  # sglang
                assert engine.port == int(eng_argv[eng_argv.index("--port") + 1]), name
            config = json.loads(flag(eng_argv, "--kv-events-config"))
            assert config["publisher"] == "zmq"
            assert urlsplit(config["endpoint"]).port == events.port, name
            # the adapter connects its subscriber: the engine's publisher has to bind
            assert publisher_binds(config["endpoint"], config.get("bind")), name


def _prometheus_targets() -> set[str]:
    prom = yaml.safe_load((OPS / "prometheus.yml").read_text())
    targets = set()
    for job in prom["scrape_configs"]:
        for sc in job.get("static_configs", []):
            targets |= set(sc["targets"])
        for sd in job.get("dns_sd_configs", []):
            targets |= {f"{n}:{sd['port']}" for n in sd["names"]}
    return targets


def test_every_metrics_port_is_scraped():
    targets = _prometheus_targets()
    for name, svc in ta_services(compose(), include_profiles=True).items():
        port = flag(svc["command"], "--metrics-port")
        if port is not None:
            assert f"{name}:{port}" in targets, f"prometheus.yml does not scrape {name}:{port}"
    prom = yaml.safe_load((OPS / "prometheus.yml").read_text())
    for job in prom["scrape_configs"]:  # a `service` target label would clash with metric labels
        for sc in job.get("static_configs", []):
            assert "service" not in sc.get("labels", {}), job["job_name"]


def test_gpu_profile_runs_sglang_behind_an_adapter():
    data = raw_compose()
    sglang = data["services"]["sglang"]
    assert sglang["profiles"] == ["gpu"]
    assert sglang["image"] == "lmsysorg/sglang:latest"
    cmd = sglang["command"]
    assert cmd[:3] == ["python", "-m", "sglang.launch_server"]
    assert "SGLANG_MODEL_PATH" in flag(cmd, "--model-path")
    assert flag(cmd, "--page-size") == "16"
    devices = sglang["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    gpu_workers = [
        n for n, s in ta_services(compose(), include_profiles=True).items()
        if s.get("profiles") == ["gpu"] and "http://sglang:" in " ".join(s["command"])
    ]  # fmt: skip
    assert gpu_workers == ["worker-gpu"]
    assert "sglang" not in ta_services(compose()), "sglang is opt-in"


# --- nats.conf -------------------------------------------------------------------------------


def _nats_passwords() -> dict[str, str]:
    return dict(compose()["services"]["nats"]["environment"])


def test_nats_conf_passes_nats_server_t():
    env = {**os.environ, **_nats_passwords()}
    conf = OPS / "nats.conf"
    ok = subprocess.run([find_nats_server(), "-c", str(conf), "-t"], env=env,
                        capture_output=True, text=True, timeout=30)  # fmt: skip
    assert ok.returncode == 0, ok.stdout + ok.stderr
    text = conf.read_text()
    for needle in ("store_dir: /data/jetstream", "max_payload: 8MB", "http_port: 8222"):
        assert needle in text
    for role in ROLES:
        assert f"user: {role}" in text and f"$NATS_{role.upper()}_PASSWORD" in text
    env.pop("NATS_CLIENT_PASSWORD")
    missing = subprocess.run([find_nats_server(), "-c", str(conf), "-t"], env=env,
                             capture_output=True, text=True, timeout=30)  # fmt: skip
    assert missing.returncode != 0, "a missing password must stop the server"
    assert "NATS_CLIENT_PASSWORD" in missing.stdout + missing.stderr


# --- dashboard -------------------------------------------------------------------------------

_HIST_SUFFIXES = ("_bucket", "_sum", "_count")


def readme_metric_names() -> set[str]:
    text = (OPS / "README.md").read_text()
    section = text.split("## Metrics the dashboard expects", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `thunderagent_")]
    return {re.match(r"\| `(thunderagent_\w+)`", row).group(1) for row in rows}


def test_dashboard_queries_only_documented_metrics():
    listed = readme_metric_names()
    assert len(listed) >= 7
    dash = json.loads((OPS / "grafana" / "dashboards" / "thunderagent.json").read_text())
    titles = {p["title"].lower() for p in dash["panels"]}
    for wanted in ("cache hit rate", "cache reuse rate", "prefill recompute rate",
                   "false-hit rate", "queue depth per worker", "routing decision latency",
                   "dead letters"):  # fmt: skip
        assert wanted in titles, wanted
    used = set()
    for panel in dash["panels"]:
        exprs = [t["expr"] for t in panel["targets"]]
        assert exprs, panel["title"]
        for expr in exprs:
            names = set(re.findall(r"\bthunderagent_\w+", expr))
            assert names, f"{panel['title']}: {expr} reads no thunderagent_ metric"
            used |= names
    undocumented = {
        n for n in used
        if n not in listed and not any(n.removesuffix(s) in listed for s in _HIST_SUFFIXES)
    }  # fmt: skip
    assert not undocumented, f"not listed in ops/README.md: {sorted(undocumented)}"
    unused = listed - {n for n in listed if any(u.startswith(n) for u in used)}
    assert not unused, f"listed in ops/README.md but no panel reads them: {sorted(unused)}"
    ds = yaml.safe_load((OPS / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert ds["datasources"][0]["uid"] == dash["panels"][0]["datasource"]["uid"]


# --- kubernetes ------------------------------------------------------------------------------


def test_k8s_manifests_hold_together():
    docs = k8s_docs()
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for wanted in [("StatefulSet", "nats"), ("Deployment", "redis"), ("Deployment", "router"),
                   ("Deployment", "scheduler"), ("Deployment", "index"),
                   ("Deployment", "worker-sim"), ("ConfigMap", "nats-config")]:  # fmt: skip
        assert wanted in kinds, wanted
    for d in docs:
        assert d["apiVersion"] and d["metadata"]["name"]
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert by_name[("Deployment", "router")]["spec"]["replicas"] >= 2
    conf = by_name[("ConfigMap", "nats-config")]["data"]["nats.conf"]
    assert conf == (OPS / "nats.conf").read_text(), "k8s nats.conf is a copy of ops/nats.conf"
    worker_pod = by_name[("Deployment", "worker-sim")]["spec"]["template"]["spec"]
    assert [c["name"] for c in worker_pod["containers"]] == ["engine", "worker"]
    engine, worker = worker_pod["containers"]
    events = json.loads(flag(engine["args"], "--kv-events-config"))
    assert publisher_binds(events["endpoint"], events.get("bind")), "nothing would bind"
    assert urlsplit(events["endpoint"]).port == urlsplit(flag(worker["args"], "--kv-events")).port
    kustomize = yaml.safe_load((OPS / "k8s" / "kustomization.yaml").read_text())
    files = {p.name for p in (OPS / "k8s").glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomize["resources"]) == files
    for d in docs:
        if d["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for c in d["spec"]["template"]["spec"]["containers"]:
            if c["image"] == "thunderagent":
                # Kubernetes expands $(VAR) from the container's env before the process starts
                parse_cli(
                    [a.replace("$(POD_NAME)", "worker-sim-7d9f8b6c4-x2k9z") for a in c["args"]]
                )


# --- live: the compose commands as local processes, per-role NATS credentials ---------------


def _localize(argv: list[str], hosts: dict[str, str]) -> list[str]:
    out = []
    for arg in argv:
        for old, new in hosts.items():
            arg = arg.replace(old, new)
        out.append(arg)
    return out


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_compose_commands_serve_a_request_with_role_permissions(tmp_path, redis_server):
    data = compose()
    passwords = _nats_passwords()
    nats_port, monitor_port = free_port(), free_port()
    conf = tmp_path / "nats.conf"
    conf.write_text(
        (OPS / "nats.conf").read_text().replace("/data/jetstream", str(tmp_path / "js"))
    )
    nats_log = tmp_path / "nats.log"
    argv = [find_nats_server(), "-c", str(conf), "-a", "127.0.0.1",
            "-p", str(nats_port), "-m", str(monitor_port)]  # fmt: skip
    nats = spawn("nats", argv, log_path=nats_log, env=passwords)
    children = [nats]
    try:
        wait_for_port(nats_port)
        hosts = {"nats:4222": f"127.0.0.1:{nats_port}",
                 "redis:6379": f"127.0.0.1:{redis_server.port}"}  # fmt: skip
        services = ta_services(data)
        for name, svc in services.items():
            if svc["command"][0] == "simengine":
                hosts[f"{name}:30000"] = f"127.0.0.1:{free_port()}"
                hosts[f"{name}:5557"] = f"127.0.0.1:{free_port()}"
        for name, svc in services.items():
            cmd = list(svc["command"])
            if cmd[0] == "simengine":
                cmd[cmd.index("--host") + 1] = "127.0.0.1"
                cmd[cmd.index("--port") + 1] = hosts[f"{name}:30000"].split(":")[1]
                events = hosts[f"{name}:5557"]
                cmd = [a.replace("tcp://*:5557", f"tcp://{events}") for a in cmd]
                cmd += ["--speedup", "50"]
            else:
                cmd = _localize(cmd, hosts)
                cmd[cmd.index("--metrics-port") + 1] = "0"
                if cmd[0] == "gateway":  # loopback and a free port here
                    cmd[cmd.index("--host") + 1] = "127.0.0.1"
                    gateway_port = free_port()
                    cmd[cmd.index("--port") + 1] = str(gateway_port)
            env = {k: _localize([v], hosts)[0] for k, v in svc.get("environment", {}).items()}
            env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)  # no collector here
            replicas = svc.get("deploy", {}).get("replicas", 1)
            for i in range(replicas):
                children.append(spawn(
                    f"{name}-{i}", [sys.executable, "-m", "thunderagent.cli.main", *cmd],
                    log_path=tmp_path / f"{name}-{i}.log", env=env,
                ))  # fmt: skip
        client_url = f"nats://client:{passwords['NATS_CLIENT_PASSWORD']}@127.0.0.1:{nats_port}"
        final, violation = asyncio.run(_request_and_probe(client_url, children))
        assert final.worker_id in {"w0", "w1"}
        assert final.usage.completion_tokens == 4
        assert violation, "the client user must not publish to a worker's generate subject"
        assert _gateway_chat(gateway_port)["usage"]["completion_tokens"] == 4
    finally:
        for child in reversed(children):
            child.stop(grace_s=5)
    logs = {p.name: p.read_text(errors="replace") for p in tmp_path.glob("*.log")}
    bad = [
        f"{name}: {line}"
        for name, text in logs.items()
        for line in text.splitlines()
        if "violation" in line.lower() and "user:client" not in line
        and "thunderagent-client" not in line
    ]  # fmt: skip
    assert not bad, "permission violations:\n" + "\n".join(bad[:20])


def _gateway_chat(port: int) -> dict:
    """One chat request through the gateway (its role's permissions: requests, inbox)."""
    import urllib.request

    body = {"model": "sim/llama-3.1-8b", "max_tokens": 4,
            "messages": [{"role": "user", "content": "hello " * 40}]}  # fmt: skip
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


async def _request_and_probe(client_url: str, children) -> tuple:
    import nats

    from thunderagent.client import RequestFailed, ThunderClient
    from thunderagent.schemas import ErrorCode, GenerateRequest

    client = await ThunderClient.connect(client_url, idle_timeout_s=10)
    give_up_at = time.monotonic() + 120
    try:
        while True:
            dead = [c.name + ":\n" + c.tail() for c in children if not c.alive()]
            assert not dead, "exited early: " + "\n".join(dead)
            request = GenerateRequest(model="sim/llama-3.1-8b", text="hello " * 40, max_tokens=4)
            try:
                done = await client.generate(request)
                break
            except RequestFailed as err:
                retry = (ErrorCode.UNKNOWN_MODEL, ErrorCode.UNAVAILABLE)
                if err.error.code not in retry or time.monotonic() > give_up_at:
                    raise
                await asyncio.sleep(0.5)
    finally:
        await client.close()

    errors: list[str] = []

    async def on_error(err: Exception) -> None:
        errors.append(str(err))

    nc = await nats.connect(client_url, error_cb=on_error)
    try:
        await nc.publish("thunderagent.worker.w0.generate", b"{}")
        await nc.flush()
        for _ in range(40):
            if errors:
                break
            await asyncio.sleep(0.05)
    finally:
        await nc.close()
    return done.final, any("permissions violation" in e.lower() for e in errors)
