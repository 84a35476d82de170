"""Who may publish and subscribe to what on the bus: one permission table per role, the NATS
``authorization`` block rendered from it, and the credentials files clients read.

The table is the single source of the roles' permissions: ``thunderagent up`` renders it with one
user per service role and one per worker (a worker may publish only its own ``kv.events.<id>``,
``worker.<id>.load`` and registration), and ``ops/nats.conf`` (compose, Kubernetes: one shared
``worker`` user) is checked against it by ``tests/integration/test_auth.py``.

Why user/password and not NKEYs: nats-py needs the ``nkeys`` package (and libsodium) for NKEYs,
while passwords need nothing new, are what ``ops/nats.conf`` already uses, and are 32 random
URL-safe bytes here (never guessed). Their weakness, a secret in the server's config, is bounded
by writing that config and every credentials file with mode 0600 in the stack's own folder.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from thunderagent.schemas import dp_rank_worker_ids, subjects

INBOX: Final = "_INBOX.>"
"""Request/reply answers and streamed tokens go to reply inboxes."""
JS_ALL: Final = ("$JS.API.>", "$JS.FC.>", "$JS.ACK.>")
"""JetStream for services that create consumers: management API, flow control, acks."""
ROLES: Final = ("router", "scheduler", "index", "worker", "migration", "gateway", "client")
"""Roles of ``ops/nats.conf``; ``thunderagent up`` adds ``admin`` (itself) and a user per worker."""
ADMIN: Final = "admin"
CREDS_MODE: Final = 0o600


@dataclass(frozen=True, slots=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class NatsUser:
    """One login; ``permissions`` None: everything (the stack's own admin connection)."""

    user: str
    password: str = field(repr=False)
    permissions: Permissions | None


def _worker_js(worker_id: str) -> tuple[str, ...]:
    """A worker's JetStream: open (or create) the KV-event stream and the workers bucket, and
    write its own registration; read a registration (a live adapter already on its worker id
    makes it refuse to start). No consumers, no deletes, no other keys written."""
    bucket = subjects.WORKERS_BUCKET
    return (
        f"$KV.{bucket}.{subjects.worker_key(worker_id)}",
        f"$JS.API.STREAM.INFO.{subjects.KV_EVENTS_STREAM}",
        f"$JS.API.STREAM.CREATE.{subjects.KV_EVENTS_STREAM}",
        f"$JS.API.STREAM.INFO.KV_{bucket}",
        f"$JS.API.STREAM.CREATE.KV_{bucket}",
        f"$JS.API.STREAM.MSG.GET.KV_{bucket}",
    )


def worker_permissions(worker_id: str = "*", dp_size: int = 1) -> Permissions:
    """One worker adapter (``*``: any worker, the shared user of ``ops/nats.conf``); in front of
    an engine of ``dp_size`` ranks, the adapter process speaks for a worker per rank."""
    health = subjects.health("*" if worker_id == "*" else f"worker-{worker_id}")
    ids = [worker_id] if worker_id == "*" else dp_rank_worker_ids(worker_id, dp_size)
    return Permissions(
        publish=tuple(p for w in ids for p in _worker_publishes(w)) + _WORKER_SHARED_PUBLISH,
        subscribe=tuple(s for w in ids for s in _worker_subscribes(w)) + (health, INBOX),
    )


def _worker_publishes(w: str) -> tuple[str, ...]:
    return (subjects.worker_load(w), subjects.kv_events(w), subjects.worker_progress(w),
            *_worker_js(w))  # fmt: skip


def _worker_subscribes(w: str) -> tuple[str, ...]:
    return (
        subjects.worker_generate(w),
        subjects.worker_abort(w),
        subjects.worker_resync(w),
        subjects.worker_kv_import(w),
        subjects.worker_kv_export(w),
        subjects.worker_kv_pull(w),
        subjects.worker_kv_release(w),
    )


_WORKER_SHARED_PUBLISH: tuple[str, ...] = (
    subjects.SCHED_RUN_FAILED_WILDCARD,  # the engine failed a run: resume it elsewhere
    # PD hand-off: a prefill worker gives a decode worker the KV and the rest of the run (or,
    # under SGLang's PD, the paired run, which it aborts there when its own prefill fails)
    subjects.worker_kv_import("*"),
    subjects.worker_generate("*"),
    subjects.worker_abort("*"),
    # a pull at dispatch: the run's worker asks the holder to export the prefix and, once
    # copied into its own engine, to release it
    subjects.worker_kv_export("*"),
    subjects.worker_kv_release("*"),
    subjects.dead_letter("*"),
    INBOX,  # acks, resync answers, and the tokens it streams to the client's inbox
)


def role_permissions(role: str) -> Permissions:
    """Permissions of a service role (``worker``: any worker, see :func:`worker_permissions`)."""
    if role == "worker":
        return worker_permissions("*")
    try:
        return _SERVICE_ROLES[role]()
    except KeyError:
        raise ValueError(f"unknown NATS role {role!r} (roles: {', '.join(ROLES)})") from None


_COMMON_PUBLISH: Final = (subjects.dead_letter("*"), INBOX)
_COMMON_SUBSCRIBE: Final = (subjects.health("*"), INBOX)


def _router() -> Permissions:
    """Routers hand requests to the scheduler, or on credit straight to a worker (and tell the
    scheduler they did); they announce themselves to get credit."""
    s = subjects
    return Permissions(
        publish=(
            s.SCHED_SUBMIT_WILDCARD,
            s.SCHED_DIRECT_WILDCARD,
            s.ROUTER_PRESENCE,
            s.worker_generate("*"),
            s.ROUTE_DECISIONS,
            *_COMMON_PUBLISH,
            *JS_ALL,
        ),
        subscribe=(
            s.REQUESTS_WILDCARD,
            s.WORKER_LOAD_WILDCARD,
            s.KV_EVENTS_WILDCARD,
            s.PROGRESS_WILDCARD,
            s.router_dispatched("*"),
            s.router_dropped("*"),
            s.router_credits("*"),
            *_COMMON_SUBSCRIBE,
        ),
    )


def _scheduler() -> Permissions:
    s = subjects
    return Permissions(
        publish=(
            s.worker_generate("*"),
            s.worker_abort("*"),
            s.router_dispatched("*"),
            s.router_dropped("*"),
            s.router_credits("*"),
            *_COMMON_PUBLISH,
            *JS_ALL,
        ),
        subscribe=(
            s.SCHED_SUBMIT_WILDCARD,
            s.SCHED_DIRECT_WILDCARD,
            s.ROUTER_PRESENCE,
            s.SCHED_RUN_FAILED_WILDCARD,
            s.SCHED_CANCEL,
            s.PROGRESS_WILDCARD,
            s.PROGRAM_RELEASE,
            s.KV_EVENTS_WILDCARD,
            s.WORKER_LOAD_WILDCARD,
            *_COMMON_SUBSCRIBE,
        ),
    )


def _index() -> Permissions:
    s = subjects
    return Permissions(
        publish=(s.worker_resync("*"), *_COMMON_PUBLISH, *JS_ALL),
        subscribe=(
            s.KV_EVENTS_WILDCARD,
            s.WORKER_LOAD_WILDCARD,
            s.INDEX_HOLDERS,
            *_COMMON_SUBSCRIBE,
        ),
    )


def _migration() -> Permissions:
    s = subjects
    return Permissions(
        publish=(
            s.worker_kv_export("*"),
            s.worker_kv_pull("*"),
            s.worker_kv_release("*"),
            s.MIGRATION_EVENTS,
            s.INDEX_HOLDERS,
            *_COMMON_PUBLISH,
            *JS_ALL,
        ),
        subscribe=(
            s.WORKER_LOAD_WILDCARD,
            s.ROUTE_DECISIONS,
            s.MIGRATION_REQUEST,
            s.MIGRATION_DRAIN,
            *_COMMON_SUBSCRIBE,
        ),
    )


def _gateway() -> Permissions:
    """A gateway may embed a router replica (``--embed-router``): it holds a router's
    permissions as well as its own."""
    s, router = subjects, _router()
    return Permissions(
        publish=(
            s.REQUESTS_WILDCARD,
            s.SCHED_CANCEL,
            s.PROGRAM_RELEASE,
            s.HEALTH_WILDCARD,
            *router.publish,
        ),
        subscribe=router.subscribe,
    )


def _client() -> Permissions:
    """Clients send, cancel and release requests, probe health, read their inbox and may watch
    routing decisions and run ends. No JetStream, no worker subject."""
    s = subjects
    return Permissions(
        publish=(s.REQUESTS_WILDCARD, s.SCHED_CANCEL, s.PROGRAM_RELEASE, s.HEALTH_WILDCARD),
        subscribe=(INBOX, s.ROUTE_DECISIONS, s.PROGRESS_WILDCARD),
    )


_SERVICE_ROLES: Final = {
    "router": _router,
    "scheduler": _scheduler,
    "index": _index,
    "migration": _migration,
    "gateway": _gateway,
    "client": _client,
}
"""Every role of ``ROLES`` but ``worker``, and what it may do."""


def new_password() -> str:
    return secrets.token_urlsafe(32)


def stack_users(worker_ids: Iterable[str], dp_size: int = 1) -> list[NatsUser]:
    """Every login of an embedded stack: admin, each service role, one user per worker it
    starts (engines of ``dp_size`` ranks each), and the shared ``worker`` role of
    ``ops/nats.conf`` for adapters started by hand in front of other engines (they find it when
    there is no login of their own)."""
    users = [NatsUser(ADMIN, new_password(), None)]
    users += [NatsUser(r, new_password(), role_permissions(r)) for r in ROLES]
    users += [
        NatsUser(f"worker-{w}", new_password(), worker_permissions(w, dp_size)) for w in worker_ids
    ]
    return users


def _strings(items: Iterable[str]) -> str:
    # quoted: NATS would read an unquoted $JS... as a variable
    return ", ".join(json.dumps(x) for x in items)


def render_authorization(users: Iterable[NatsUser]) -> str:
    """The server config's ``authorization`` block for these users."""
    lines = ["authorization {", "  users = ["]
    for u in users:
        entry = f"    {{user: {json.dumps(u.user)}, password: {json.dumps(u.password)}"
        if u.permissions is not None:
            p = u.permissions
            entry += (
                f", permissions: {{publish: {{allow: [{_strings(p.publish)}]}}, "
                f"subscribe: {{allow: [{_strings(p.subscribe)}]}}}}"
            )
        lines.append(entry + "}")
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to a file only its owner can read (created 0600, never world-readable)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, CREDS_MODE)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.chmod(path, CREDS_MODE)  # an older file keeps its mode through O_TRUNC


def write_credentials(folder: Path, users: Iterable[NatsUser], *, ca: Path | None = None) -> Path:
    """One ``<user>.json`` per login (mode 0600) in ``folder`` (mode 0700); returns ``folder``.

    ``thunderagent.bus.connect`` reads them (``--creds``, ``THUNDERAGENT_NATS_CREDS``)."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(folder, 0o700)
    for u in users:
        data = {"user": u.user, "password": u.password}
        if ca is not None:
            data["ca"] = str(ca)
        write_private(folder / f"{u.user}.json", json.dumps(data) + "\n")
    return folder
