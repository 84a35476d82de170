"""Drive every subscribed subject of a running in-process stack with fuzz payloads and record
what came back: replies per inbox, dead letters per service and subject.

One target is one subject with the message type its subscribers decode, the services that
subscribe to it, and how it is used: ``request`` (every message that has a reply subject must
be answered: the normal reply or an ``ErrorReply``), ``event`` (publish-only: a message that is
rejected and has a reply subject gets an ``ErrorReply``) or ``stream`` (captured by JetStream
and consumed by several services; there is no reply). Payloads go out in batches; after each
batch the harness waits until every expected reply and dead letter has arrived (or a timeout,
which is a finding), so no subscriber is ever buried under more than one batch.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import msgspec

from tests.fuzz.payloads import Shaper, random_bytes
from tests.fuzz.seeds import seed_for
from thunderagent.bus.bus import decoder_for
from thunderagent.bus.errors import DECODE_ERRORS
from thunderagent.schemas import DeadLetter

Kind = Literal["request", "event", "stream", "raw"]
INBOX_PREFIX = "_INBOX.fuzz"
MAX_CASE_BYTES = 2 << 20
"""A dead letter carries the case base64-encoded (4/3 larger) next to its reason."""


@dataclass(frozen=True)
class Target:
    subject: str
    message_type: Any
    """What the subscribers decode (None: a raw handler, such as the health probe)."""
    kind: Kind
    services: tuple[str, ...]
    """Bus names of the services that subscribe (each dead-letters what it rejects)."""
    decoded_as: Any = None
    """The type the subscribers decode where it is not ``message_type``, the wire's (the
    scheduler's relayed forms); None: ``message_type``."""


@dataclass
class TargetResult:
    target: Target
    sent: int = 0
    with_reply: int = 0
    invalid: int = 0
    """Payloads the message type's decoder refuses (each must become a dead letter)."""
    unanswered: list[str] = field(default_factory=list)
    missing_dead_letters: dict[str, int] = field(default_factory=dict)
    unanswered_rejections: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class Observer:
    """The test's own connection: every reply to a fuzz inbox, every dead letter."""

    nc: Any
    replies: Counter = field(default_factory=Counter)
    error_replies: set[str] = field(default_factory=set)
    dead: dict[tuple[str, str], list[DeadLetter]] = field(default_factory=lambda: defaultdict(list))
    bad_dead_letters: list[str] = field(default_factory=list)

    async def start(self) -> None:
        await self.nc.subscribe(f"{INBOX_PREFIX}.>", cb=self._on_reply)
        await self.nc.subscribe("thunderagent.deadletter.>", cb=self._on_dead)
        await self.nc.flush()

    async def _on_reply(self, msg) -> None:
        self.replies[msg.subject] += 1
        if b'"code"' in msg.data[:200] or b'"type":"error"' in msg.data[:200]:
            self.error_replies.add(msg.subject)

    async def _on_dead(self, msg) -> None:
        try:
            record = msgspec.json.decode(msg.data, type=DeadLetter)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            self.bad_dead_letters.append(f"undecodable dead letter on {msg.subject}: {err}")
            return
        if not record.reason.strip():
            self.bad_dead_letters.append(f"dead letter without a reason from {record.service}")
        self.dead[(record.service, record.subject)].append(record)

    def dead_count(self, service: str, subject: str) -> int:
        return len(self.dead.get((service, subject), ()))


def cases(rng: random.Random, message_type: Any, n: int, big: int) -> list[bytes]:
    """Half random bytes, half schema-shaped payloads (mostly a valid seed message with a few
    leaves bent to extremes), interleaved."""
    shaper = Shaper(rng, big=big)
    seed = seed_for(message_type) if message_type is not None else None
    out = []
    for i in range(n):
        payload = b""
        for _ in range(10):  # under NATS's max_payload (8 MB here), dead letter included
            if message_type is None or i % 2 == 0:
                payload = random_bytes(rng, big)
            else:
                payload = shaper.message(message_type, seed)
            if len(payload) <= MAX_CASE_BYTES:
                break
        out.append(payload[:MAX_CASE_BYTES])
    return out


def is_invalid(message_type: Any, payload: bytes) -> bool:
    if message_type is None:
        return False
    try:
        decoder_for(message_type).decode(payload)
    except DECODE_ERRORS:
        return True
    return False


async def fuzz_target(
    nc,
    observer: Observer,
    target: Target,
    payloads: list[bytes],
    *,
    tag: str,
    alive=lambda service: True,
    batch: int = 100,
    settle_s: float = 10.0,
) -> TargetResult:
    """Send ``payloads`` to ``target`` in batches; wait for what each batch must produce
    (from the services still ``alive``: a crash is its own finding, not a cascade of them)."""
    result = TargetResult(target)
    started = time.monotonic()
    js = nc.jetstream() if target.kind == "stream" else None
    for start in range(0, len(payloads), batch):
        chunk = payloads[start : start + batch]
        inboxes, invalid_before = [], result.invalid
        base = {s: observer.dead_count(s, target.subject) for s in target.services}
        for i, payload in enumerate(chunk, start):
            reply = "" if target.kind == "stream" or i % 5 == 4 else f"{INBOX_PREFIX}.{tag}.{i}"
            if is_invalid(target.decoded_as or target.message_type, payload):
                result.invalid += 1
            if js is not None:
                await js.publish(target.subject, payload, timeout=5)
            else:
                await nc.publish(target.subject, payload, reply=reply)
            if reply:
                inboxes.append(reply)
        result.sent += len(chunk)
        result.with_reply += len(inboxes)
        await nc.flush()
        want_dead = result.invalid - invalid_before
        live = replace(target, services=tuple(s for s in target.services if alive(s)))
        if not await _settle(observer, live, inboxes, base, want_dead, settle_s):
            settle_s = 1.0  # once late, do not wait the full time for every later batch
        _account(observer, live, inboxes, base, want_dead, result)
    result.seconds = time.monotonic() - started
    return result


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, ``>`` the rest."""
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(p) == len(s)


async def wait_subscribed(stack, targets: list[Target], timeout_s: float = 30.0) -> None:
    """Until every service subscribes to every core-NATS target it should (a service subscribes
    after its start-up work, such as replaying the KV stream)."""
    give_up_at = time.monotonic() + timeout_s
    missing: list[str] = []
    while time.monotonic() < give_up_at:
        missing = [
            f"{name} {t.subject}"
            for t in targets if t.kind in ("request", "event")
            for name in t.services
            if not any(matches(p, t.subject) for p in stack.services[name].bus.stats)
        ]  # fmt: skip
        if not missing:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not subscribed after {timeout_s}s: {missing}")


def _answered(observer: Observer, target: Target, inboxes: list[str]) -> bool:
    if target.kind in ("request", "raw"):
        return all(observer.replies[i] for i in inboxes)
    return True


def _dead_done(observer: Observer, target: Target, base: dict, want: int) -> bool:
    return all(observer.dead_count(s, target.subject) - base[s] >= want for s in target.services)


async def _settle(observer, target, inboxes, base, want_dead, settle_s) -> bool:
    give_up_at = time.monotonic() + settle_s
    while time.monotonic() < give_up_at:
        if _answered(observer, target, inboxes) and _dead_done(observer, target, base, want_dead):
            return True
        await asyncio.sleep(0.01)
    return False


def _account(observer, target, inboxes, base, want_dead, result: TargetResult) -> None:
    if target.kind in ("request", "raw"):
        result.unanswered += [i for i in inboxes if not observer.replies[i]]
    for s in target.services:
        short = want_dead - (observer.dead_count(s, target.subject) - base[s])
        if short > 0:
            result.missing_dead_letters[s] = result.missing_dead_letters.get(s, 0) + short
    # a rejected message that had a reply subject must have been told why
    for s in target.services:
        for record in observer.dead.get((s, target.subject), [])[base[s] :]:
            if record.reply.startswith(INBOX_PREFIX) and record.reply not in observer.error_replies:
                result.unanswered_rejections.append(f"{s}: {record.reply}: {record.reason[:80]}")
