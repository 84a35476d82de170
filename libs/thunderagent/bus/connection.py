"""Connect to NATS with exponential backoff on the first connection and reconnects after it.

Credentials and TLS are found the same way by every process (services, the client, benchmarks,
tests), so none of them takes a password on its command line:

1. user and password in the URL (``nats://user:pass@host:4222``), as nats-py reads them;
2. ``creds``: a credentials file written by ``thunderagent up`` (JSON: ``user``, ``password``,
   optionally ``ca``), or a folder of them, where ``<identity>.json`` is used (falling back to
   ``client.json``); the argument, else ``$THUNDERAGENT_NATS_CREDS``;
3. ``$NATS_USER`` / ``$NATS_PASSWORD`` (the names the ``nats`` CLI reads);
4. nothing: a development bus without authentication (``thunderagent up --no-auth``).

TLS: a ``tls://`` URL, or a CA file (``ca`` in the credentials file, ``$THUNDERAGENT_NATS_CA`` or
``$NATS_CA``) turns it on; the server's certificate is checked against that CA (the system's
when none is given). ``$NATS_CERT`` / ``$NATS_KEY`` add a client certificate (mutual TLS).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from nats.aio.client import Client as NATS

from thunderagent.bus.fastpath import FastClient

log = logging.getLogger(__name__)

CREDS_ENV = "THUNDERAGENT_NATS_CREDS"
"""A credentials file, or a folder of ``<identity>.json`` files (``thunderagent up`` prints it)."""
CA_ENV = "THUNDERAGENT_NATS_CA"
"""CA certificate (PEM) that signed the NATS server's certificate."""
CLIENT_IDENTITY = "client"
"""The identity whose file a credentials folder falls back to."""


@dataclass(frozen=True, slots=True)
class Credentials:
    """What a connection presents: user and password, and the TLS files to trust / show."""

    user: str | None = None
    password: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    source: str = "none"
    """Where they came from (logged, never the secret itself)."""


def load_credentials_file(path: Path) -> Credentials:
    """Read one ``thunderagent up`` credentials file (JSON)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConnectionError(f"cannot read NATS credentials {path}: {err}") from err
    if not isinstance(data, dict) or not isinstance(data.get("user"), str):
        raise ConnectionError(f"NATS credentials {path}: expected a JSON object with 'user'")
    return Credentials(
        user=data["user"],
        password=data.get("password"),
        ca_file=data.get("ca"),
        source=str(path),
    )


def _creds_path(creds: str, identity: str) -> Path:
    path = Path(creds).expanduser()
    if not path.is_dir():
        return path
    role = identity.split("-", 1)[0]  # worker-w9 -> worker: a role's shared login
    names = list(dict.fromkeys((identity, role, CLIENT_IDENTITY)))
    for name in names:
        candidate = path / f"{name}.json"
        if candidate.exists():
            if name != identity:
                log.warning("no NATS credentials for %r in %s: using %s", identity, path, name)
            return candidate
    raise ConnectionError(f"no NATS credentials for any of {names} in {path}")


def resolve_credentials(
    url: str,
    identity: str,
    *,
    creds: str | None = None,
    env: Mapping[str, str] | None = None,
) -> Credentials:
    """The credentials a process with this ``identity`` presents to ``url`` (see the module
    docstring for the order). Pure but for reading the credentials file."""
    env = os.environ if env is None else env
    found = Credentials()
    creds = creds or env.get(CREDS_ENV) or None
    if urlsplit(url).username:
        found = Credentials(source="url")
    elif creds:
        found = load_credentials_file(_creds_path(creds, identity))
    elif env.get("NATS_USER"):
        found = Credentials(
            user=env["NATS_USER"], password=env.get("NATS_PASSWORD"), source="NATS_USER"
        )
    ca = found.ca_file or env.get(CA_ENV) or env.get("NATS_CA") or None
    return Credentials(
        user=found.user,
        password=found.password,
        ca_file=ca,
        cert_file=env.get("NATS_CERT") or None,
        key_file=env.get("NATS_KEY") or None,
        source=found.source,
    )


def tls_context(url: str, creds: Credentials) -> ssl.SSLContext | None:
    """A client TLS context when the URL or the credentials ask for TLS, else None."""
    if urlsplit(url).scheme != "tls" and not creds.ca_file and not creds.cert_file:
        return None
    context = ssl.create_default_context(cafile=creds.ca_file)
    if creds.cert_file:
        context.load_cert_chain(creds.cert_file, creds.key_file)
    return context


def _identity_of(name: str) -> str:
    """``thunderagent-worker-w0`` -> ``worker-w0``: the service name is the identity."""
    return name.removeprefix("thunderagent-")


def _is_auth_error(err: BaseException) -> bool:
    text = str(err).lower()
    return "authorization violation" in text or "authentication" in text


async def connect(
    url: str,
    *,
    name: str,
    identity: str | None = None,
    creds: str | None = None,
    deadline_s: float = 30.0,
    first_delay_s: float = 0.05,
    max_delay_s: float = 2.0,
) -> NATS:
    """Connect, retrying with jittered exponential backoff until ``deadline_s`` has passed.

    nats-py reconnects by itself once connected (forever here, every ``reconnect_time_wait`` with
    jitter), but it gives up on a failed *first* connection, which is common while an embedded
    server is still starting; hence the loop. A refused login is not retried: the credentials
    will not get better by waiting.
    """
    identity = identity or _identity_of(name)
    found = resolve_credentials(url, identity, creds=creds)
    options = _login_options(url, found)
    log.debug("nats %s: credentials from %s, tls %s", name, found.source, "tls" in options)
    events = _ConnectionEvents(name)
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + deadline_s
    delay = first_delay_s
    while True:
        client = FastClient()
        try:
            # nats-py retries a refused first connection itself when reconnects are allowed,
            # without a deadline: the attempt is bounded here, and retried with our backoff.
            attempt = client.connect(url, **_connect_options(name, events, options))
            timeout = max(0.05, min(give_up_at - loop.time(), 5.0))
            await _until_connected_or_refused(attempt, events.login_refused, timeout)
            return client
        except Exception as err:  # nats-py raises several unrelated types for a refused connect
            await _discard(client)
            _raise_if_refused(err, events, url, identity, found)
            if loop.time() + delay > give_up_at:
                raise ConnectionError(_unreachable(url, err, deadline_s)) from err
            log.info("nats %s: connect failed (%r), retry in %.2fs", name, err, delay)
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, max_delay_s)


def _login_options(url: str, found: Credentials) -> dict:
    """nats-py's connect options for ``found``: user and password, TLS."""
    options: dict = {}
    if found.user is not None:
        options["user"] = found.user
        options["password"] = found.password or ""
    tls = tls_context(url, found)
    if tls is not None:
        options["tls"] = tls
    return options


def _connect_options(name: str, events: _ConnectionEvents, login: dict) -> dict:
    """nats-py's options for one attempt: bounded, reconnecting forever after, our callbacks."""
    return {
        "name": name,
        "connect_timeout": 2,
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        "error_cb": events.on_error,
        "disconnected_cb": events.on_disconnect,
        "reconnected_cb": events.on_reconnect,
        **login,
    }


def _raise_if_refused(
    err: Exception, events: _ConnectionEvents, url: str, identity: str, found: Credentials
) -> None:
    """Stop the connect loop on a refused login (or an untrusted certificate): neither gets
    better by waiting."""
    # nats-py reports them to error_cb and keeps retrying until our timeout
    refused = events.refused
    if refused or _is_auth_error(err):
        raise ConnectionError(
            f"NATS at {_safe(url)} refused {identity!r} (credentials from "
            f"{found.source}, CA {found.ca_file or 'system'}): "
            f"{refused[0] if refused else err}"
        ) from err


class _ConnectionEvents:
    """nats-py's callbacks for one connection: logged, and a refused login (or an untrusted
    certificate) kept, so the connect loop stops retrying at once."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.refused: list[Exception] = []
        self.login_refused = asyncio.Event()

    async def on_error(self, err: Exception) -> None:
        if _is_auth_error(err) or isinstance(err, ssl.SSLCertVerificationError):
            self.refused.append(err)
            self.login_refused.set()
        log.info("nats %s: %s", self.name, err)

    async def on_disconnect(self) -> None:
        log.info("nats %s: disconnected", self.name)

    async def on_reconnect(self) -> None:
        log.info("nats %s: reconnected", self.name)


def _unreachable(url: str, err: Exception, deadline_s: float) -> str:
    why = f"no server answered in {deadline_s:g} s (is it running?)"
    return f"cannot connect to NATS at {_safe(url)}: " + (
        why if isinstance(err, TimeoutError | OSError) else repr(err)
    )


async def _until_connected_or_refused(
    attempt,
    refused: asyncio.Event,
    timeout: float,  # noqa: ASYNC109 - one bounded attempt
) -> None:
    """Run one connect attempt; a refused login ends it at once (nats-py would retry it)."""
    task = asyncio.ensure_future(attempt)
    waiter = asyncio.ensure_future(refused.wait())
    try:
        done, _ = await asyncio.wait({task, waiter}, timeout=timeout,
                                     return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        if task in done:
            task.result()
            return
        raise ConnectionError("login refused") if waiter in done else TimeoutError()
    finally:
        for pending in (task, waiter):
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(BaseException):
                    await pending


def _safe(url: str) -> str:
    """The URL without its password, for error messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{parts.username}:***@{host}{port}"


async def _discard(client: NATS) -> None:
    try:
        await client.close()
    except Exception:  # never connected: nothing to close
        pass
