"""Authentication and authorization on the bus, against real nats-server processes.

The embedded server runs with the logins ``thunderagent up`` generates (one per role, one per
worker): an anonymous or wrong login is refused at once, a client cannot publish KV events, load
reports or a worker's generate subject, a worker cannot publish another worker's events or
registration, and ``ops/nats.conf`` grants each role exactly what the permission table says.
The last test runs ``thunderagent up`` as a process and serves requests with auth on.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import yaml

from thunderagent.bus import Bus, connect
from thunderagent.bus.bus import encode
from thunderagent.bus.connection import Credentials, resolve_credentials, tls_context
from thunderagent.embedded import (
    NatsServer,
    find_nats_server,
    free_port,
    role_permissions,
    stack_users,
    wait_for_port,
    write_credentials,
)
from thunderagent.embedded.auth import ROLES, render_authorization
from thunderagent.schemas import KvEventBatch, LoadReport, subjects

ROOT = Path(__file__).resolve().parents[2]
OPS = ROOT / "ops"
MODEL = "sim/llama-3.1-8b"

pytestmark = pytest.mark.integration


# --- the permission table and ops/nats.conf --------------------------------------------------


def _ops_users(text: str) -> dict[str, dict[str, set[str]]]:
    """user -> {"publish": allow set, "subscribe": allow set}, read from a nats.conf."""
    users: dict[str, dict[str, set[str]]] = {}
    for block in re.split(r"\n\s*\{\s*\n\s*user:", text)[1:]:
        name = block.split()[0]
        perms = {}
        for kind in ("publish", "subscribe"):
            m = re.search(kind + r":\s*\{\s*allow:\s*\[(.*?)\]", block, re.S)
            assert m, f"{name}: no {kind} allow list"
            perms[kind] = set(re.findall(r'"([^"]+)"', m.group(1)))
        users[name] = perms
    return users


def test_ops_nats_conf_grants_what_the_permission_table_says():
    users = _ops_users((OPS / "nats.conf").read_text())
    assert set(users) == set(ROLES)
    for role in ROLES:
        table = role_permissions(role)
        assert users[role]["publish"] == set(table.publish), role
        assert users[role]["subscribe"] == set(table.subscribe), role


def test_k8s_carries_the_tls_config_too():
    docs = [d for d in yaml.safe_load_all((OPS / "k8s" / "configmap.yaml").read_text()) if d]
    data = next(d for d in docs if d["metadata"]["name"] == "nats-config")["data"]
    assert data["nats-tls.conf"] == (OPS / "nats-tls.conf").read_text()
    assert "include ./nats.conf" in data["nats-tls.conf"]


def test_credentials_are_found_in_order(tmp_path):
    users = stack_users(["w0"])
    folder = write_credentials(tmp_path / "creds", users)
    by_name = {u.user: u for u in users}
    env = {"THUNDERAGENT_NATS_CREDS": str(folder), "NATS_USER": "x", "NATS_PASSWORD": "y"}
    # the URL's own user wins, then the folder (own identity, else client), then NATS_USER
    assert resolve_credentials("nats://u:p@h:4222", "router", env=env).source == "url"
    got = resolve_credentials("nats://h:4222", "worker-w0", env=env)
    assert (got.user, got.password) == ("worker-w0", by_name["worker-w0"].password)
    assert resolve_credentials("nats://h:4222", "bench", env=env).user == "client"
    # an adapter started by hand on an id `up` did not start: the shared worker login
    assert resolve_credentials("nats://h:4222", "worker-w9", env=env).user == "worker"
    explicit = str(folder / "router.json")
    assert resolve_credentials("nats://h:4222", "x", creds=explicit, env=env).user == "router"
    env.pop("THUNDERAGENT_NATS_CREDS")
    assert resolve_credentials("nats://h:4222", "router", env=env).user == "x"
    assert resolve_credentials("nats://h:4222", "router", env={}) == Credentials()
    assert tls_context("nats://h:4222", Credentials()) is None
    assert tls_context("tls://h:4222", Credentials()) is not None
    for path in [folder, *folder.iterdir()]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))


# --- a live server with the stack's logins ---------------------------------------------------


@pytest.fixture
def auth_server(tmp_path):
    users = stack_users(["w0", "w1"])
    server = NatsServer(tmp_path / "nats", users=users).start()
    creds = write_credentials(tmp_path / "creds", users)
    yield server, creds
    server.stop()


class Violations:
    """Collects a connection's async errors (NATS reports permission violations there)."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    async def cb(self, err: Exception) -> None:
        self.errors.append(str(err).lower())

    def about(self, subject: str) -> bool:
        return any("permissions violation" in e and subject in e for e in self.errors)


async def _as(server: NatsServer, creds: Path, identity: str) -> tuple:
    nc = await connect(server.url, name=f"test-{identity}", creds=str(creds / f"{identity}.json"))
    seen = Violations()
    nc._error_cb = seen.cb  # nats-py's hook for async errors; connect() set a logging one
    return nc, seen


async def _collect(nc, subject: str) -> list:
    got: list = []

    async def on_msg(msg) -> None:
        got.append(msg.subject)

    await nc.subscribe(subject, cb=on_msg)
    await nc.flush()
    return got


async def _settle(*conns) -> None:
    for nc in conns:
        await nc.flush()
    await asyncio.sleep(0.3)


async def test_anonymous_and_wrong_logins_are_refused(auth_server, tmp_path):
    server, creds = auth_server
    started = time.monotonic()
    with pytest.raises(ConnectionError, match="refused"):
        await connect(server.url, name="anonymous", deadline_s=10)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"user": "client", "password": "not-the-password"}))
    with pytest.raises(ConnectionError, match="Authorization Violation"):
        await connect(server.url, name="guess", creds=str(bad), deadline_s=10)
    assert time.monotonic() - started < 5, "a refused login is not retried until the deadline"
    nc, _ = await _as(server, creds, "client")
    assert nc.is_connected
    await nc.close()


async def test_a_client_cannot_publish_worker_or_kv_subjects(auth_server):
    server, creds = auth_server
    admin, _ = await _as(server, creds, "admin")
    client, seen = await _as(server, creds, "client")
    forbidden = [subjects.kv_events("w0"), subjects.worker_load("w0"),
                 subjects.worker_generate("w0"), subjects.sched_submit("any-model"),
                 subjects.progress("w0", ended=True)]  # fmt: skip
    try:
        got = await _collect(admin, "thunderagent.>")
        for subject in forbidden:
            await client.publish(subject, b"{}")
        await client.publish(subjects.requests(MODEL), b"{}")  # allowed: the request itself
        await client.subscribe(subjects.KV_EVENTS_WILDCARD)  # nor may it read the KV events
        await _settle(client, admin)
        assert seen.about(subjects.KV_EVENTS_WILDCARD), seen.errors
        for subject in forbidden:
            assert seen.about(subject), f"client published {subject}: {seen.errors}"
        assert got == [subjects.requests(MODEL)], got
    finally:
        await client.close()
        await admin.close()


async def test_a_worker_publishes_only_its_own_events_load_progress_and_registration(auth_server):
    server, creds = auth_server
    admin, _ = await _as(server, creds, "admin")
    w0, seen = await _as(server, creds, "worker-w0")
    try:
        await Bus(admin, service="test").ensure_kv_events_stream()
        got = await _collect(admin, "thunderagent.>")
        load = LoadReport(worker_id="w1", ts=time.time(), running=0, queued=0,
                          kv_used_blocks=0, kv_total_blocks=1)  # fmt: skip
        await w0.publish(subjects.worker_load("w1"), encode(load))
        await w0.publish(subjects.kv_events("w1"), b"{}")
        own_load = msgspec.structs.replace(load, worker_id="w0")
        await w0.publish(subjects.worker_load("w0"), encode(own_load))
        await w0.publish(subjects.progress("w1", ended=True), b"{}")  # another worker's runs
        await w0.publish(subjects.progress("w0", ended=True), b"{}")
        own = KvEventBatch(worker_id="w0", seq=0, ts=time.time(), events=[])
        js = w0.jetstream()
        ack = await js.publish(subjects.kv_events("w0"), encode(own), timeout=2)
        assert ack.stream == subjects.KV_EVENTS_STREAM
        with pytest.raises(Exception):  # noqa: B017 - nats-py: a timeout, the publish is dropped
            await js.publish(subjects.kv_events("w1"), encode(own), timeout=0.5)
        bucket = await Bus(w0, service="worker-w0").bucket(subjects.WORKERS_BUCKET)
        await bucket.put("w0", b"{}")
        with pytest.raises(Exception):  # noqa: B017 - another worker's registration
            await bucket.put("w1", b"{}")
        with pytest.raises(Exception):  # noqa: B017 - no consumers on the stream for workers
            await js.subscribe(subjects.KV_EVENTS_WILDCARD, stream=subjects.KV_EVENTS_STREAM)
        await _settle(w0, admin)
        assert seen.about(subjects.worker_load("w1")) and seen.about(subjects.kv_events("w1"))
        assert seen.about(subjects.progress("w1", ended=True))
        assert subjects.worker_load("w1") not in got and subjects.kv_events("w1") not in got
        assert subjects.progress("w1", ended=True) not in got
        assert subjects.worker_load("w0") in got and subjects.kv_events("w0") in got
        assert subjects.progress("w0", ended=True) in got
    finally:
        await w0.close()
        await admin.close()


async def test_a_worker_may_ask_another_for_a_prefix_copy_but_not_make_it_pull(auth_server):
    """A pull at dispatch: the target's adapter asks the source's adapter to export the prefix
    and then to release it; the pull itself runs in the target's own engine. Another worker's
    pull subject (a copy into its engine) stays the migration service's."""
    server, creds = auth_server
    admin, _ = await _as(server, creds, "admin")
    w0, seen = await _as(server, creds, "worker-w0")
    asked = [subjects.worker_kv_export("w1"), subjects.worker_kv_release("w1")]
    try:
        got = await _collect(admin, "thunderagent.worker.>")
        for subject in [*asked, subjects.worker_kv_pull("w1")]:
            await w0.publish(subject, b"{}")
        await _settle(w0, admin)
        assert got == asked, (got, seen.errors)
        assert seen.about(subjects.worker_kv_pull("w1")), seen.errors
    finally:
        await w0.close()
        await admin.close()


async def test_an_adapter_started_by_hand_joins_with_the_shared_worker_login(auth_server):
    """`up` wrote logins only for the workers it started: an adapter started by hand in front
    of another engine fell back to the client login and died on a permission timeout."""
    server, creds = auth_server
    port = free_port()
    engine = subprocess.Popen(
        [sys.executable, "-m", "thunderagent.cli.main", "simengine", "--port", str(port),
         "--profile", "tiny"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    adapter = None
    try:
        wait_for_port(port, timeout_s=30)
        adapter = subprocess.Popen(
            [sys.executable, "-m", "thunderagent.cli.main", "worker", "--worker-id", "w9",
             "--engine-url", f"http://127.0.0.1:{port}", "--nats", server.url,
             "--creds", str(creds)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        nc, _ = await _as(server, creds, "router")
        js = nc.jetstream()
        give_up = time.monotonic() + 30
        while True:
            assert adapter.poll() is None, adapter.stderr.read()
            try:
                kv = await js.key_value(subjects.WORKERS_BUCKET)
                if "w9" in await kv.keys():
                    break
            except Exception:  # the bucket or its first key is not there yet
                pass
            assert time.monotonic() < give_up, "w9 never registered"
            await asyncio.sleep(0.2)
        await nc.close()
    finally:
        for proc in (adapter, engine):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=15)


async def test_a_load_report_must_name_the_worker_whose_subject_it_came_on(auth_server):
    """NATS keeps w0 to worker.w0.load; the fleet watcher keeps the report's worker_id to the
    subject, so w0 cannot renew w1's lease or rewrite its load either."""
    from thunderagent.fleet import WorkerRegistry
    from thunderagent.shell import FleetWatcher

    server, creds = auth_server
    admin, _ = await _as(server, creds, "admin")
    w0, _ = await _as(server, creds, "worker-w0")
    dead = await _collect(admin, subjects.dead_letter("fleet"))
    stop = asyncio.Event()
    watcher = FleetWatcher(Bus(admin, service="fleet"), WorkerRegistry())
    task = asyncio.create_task(watcher.run(stop))
    try:
        await asyncio.wait_for(watcher.ready.wait(), 10)
        load = LoadReport(worker_id="w1", ts=time.time(), running=0, queued=0,
                          kv_used_blocks=0, kv_total_blocks=1)  # fmt: skip
        await w0.publish(subjects.worker_load("w0"), encode(load))  # names w1
        own = msgspec.structs.replace(load, worker_id="w0")
        await w0.publish(subjects.worker_load("w0"), encode(own))
        await _settle(w0, admin)
        assert dead == [subjects.dead_letter("fleet")], dead  # the spoofed one only
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
        await w0.close()
        await admin.close()


def test_the_rendered_block_quotes_jetstream_subjects():
    block = render_authorization(stack_users(["w0"]))
    assert '"$JS.API.>"' in block
    assert re.search(r'user: "worker-w0".*"thunderagent\.kv\.events\.w0"', block)
    assert '"thunderagent.kv.events.*"' not in block.split('user: "worker-w0"')[1].split("}")[0]


# --- TLS ---------------------------------------------------------------------------------------


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A throwaway certificate for 127.0.0.1 (openssl CLI; no Python crypto dependency)."""
    cert, key = folder / "tls.crt", folder / "tls.key"
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


async def test_tls_with_a_self_signed_certificate(tmp_path):
    from thunderagent.embedded import TlsFiles

    cert, key = self_signed(tmp_path / "tls")
    users = stack_users([])
    tls = TlsFiles(cert, key)
    server = NatsServer(tmp_path / "nats", users=users, tls=tls).start()
    creds = write_credentials(tmp_path / "creds", users, ca=tls.trust)
    try:
        assert server.url.startswith("tls://")
        nc = await connect(server.url, name="tls-client", creds=str(creds / "admin.json"))
        try:
            sub = await nc.subscribe("thunderagent.health.echo", cb=None)
            await nc.publish("thunderagent.health.echo", b"over tls")
            msg = await sub.next_msg(timeout=2)
            assert msg.data == b"over tls"
            with socket.create_connection(("127.0.0.1", server.port), timeout=2) as raw:
                info = raw.recv(4096).decode()  # the greeting is plain; all after it is TLS
            assert info.startswith("INFO ") and json.loads(info[5:])["tls_required"] is True
        finally:
            await nc.close()
        # the system's trust store does not know a self-signed certificate
        plain = {"user": "admin", "password": users[0].password}
        (tmp_path / "no-ca.json").write_text(json.dumps(plain))
        with pytest.raises(ConnectionError):
            await connect(server.url, name="no-ca", creds=str(tmp_path / "no-ca.json"),
                          deadline_s=2)  # fmt: skip
    finally:
        server.stop()


def test_ops_tls_config_passes_nats_server_t(tmp_path):
    cert, key = self_signed(tmp_path / "tls")
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    (conf_dir / "nats.conf").write_text(
        (OPS / "nats.conf").read_text().replace("/data/jetstream", str(tmp_path / "js"))
    )
    (conf_dir / "nats-tls.conf").write_text(
        (OPS / "nats-tls.conf").read_text()
        .replace("/etc/nats/tls/tls.crt", str(cert)).replace("/etc/nats/tls/tls.key", str(key))
    )  # fmt: skip
    env = {**os.environ, **{f"NATS_{r.upper()}_PASSWORD": "x" for r in ROLES}}
    out = subprocess.run([find_nats_server(), "-c", str(conf_dir / "nats-tls.conf"), "-t"],
                         env=env, capture_output=True, text=True, timeout=30)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


# --- `thunderagent up` with auth on, as a process ---------------------------------------------


def _start_up(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, dict[str, str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "thunderagent.cli.main", "up", "--workers", "2", "--gateways",
         "0", "--run-dir", str(tmp_path / "run"), "--speedup", "20", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("THUNDERAGENT_NATS")},
    )  # fmt: skip
    lines, found = [], {}
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and "Try:" not in found:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        words = line.split()
        if words:
            found[words[0]] = words[1] if len(words) > 1 else ""
    if "Try:" not in found:
        proc.kill()
        raise AssertionError("thunderagent up did not start:\n" + "".join(lines))
    return proc, found


def _request(nats_url: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("THUNDERAGENT_NATS", "NATS_"))}
    return subprocess.run(
        [sys.executable, "-m", "thunderagent.cli.main", "request", "--nats", nats_url,
         "--model", MODEL, "--max-tokens", "8", "--json", *args],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_up_serves_requests_with_auth_and_tls_on(tmp_path):
    """Logins are on by default (tests/integration/test_processes.py runs the plain default);
    here with TLS as well, every service and the client over tls:// with the printed CA."""
    cert, key = self_signed(tmp_path / "tls")
    proc, found = _start_up(tmp_path, "--tls-cert", str(cert), "--tls-key", str(key))
    try:
        nats_url, creds = found["NATS"], Path(found["creds"])
        assert nats_url.startswith("tls://127.0.0.1:"), nats_url
        assert json.loads((creds / "client.json").read_text())["ca"] == str(cert)
        assert creds == tmp_path / "run" / "creds"
        names = {p.stem for p in creds.iterdir()}
        assert {"admin", "client", "router", "scheduler", "index", "worker-w0",
                "worker-w1"} <= names  # fmt: skip
        for path in [*creds.iterdir(), tmp_path / "run" / "nats" / "nats-server.conf"]:
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        for i in range(3):
            ok = _request(nats_url, "--creds", str(creds / "client.json"), f"hello {i} " * 20)
            assert ok.returncode == 0, ok.stdout + ok.stderr
            final = json.loads(ok.stdout.strip().splitlines()[-1])
            assert final["type"] == "final" and final["usage"]["completion_tokens"] == 8
        login = json.loads((creds / "client.json").read_text())
        no_ca = tmp_path / "no-ca.json"
        no_ca.write_text(json.dumps({"user": login["user"], "password": login["password"]}))
        untrusting = _request(nats_url, "--creds", str(no_ca), "the system CAs do not know it")
        assert untrusting.returncode == 3 and "CERTIFICATE_VERIFY_FAILED" in untrusting.stderr
        anonymous = _request(nats_url, "--nats-ca", str(cert), "no credentials")
        assert anonymous.returncode == 3 and "refused" in anonymous.stderr, anonymous.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    log = (tmp_path / "run" / "nats" / "nats-server.log").read_text().splitlines()
    # no service lacks a permission it uses; the anonymous request is the only refusal
    assert not [line for line in log if "Violation" in line]
    assert len([line for line in log if "authentication error" in line]) == 1, log
