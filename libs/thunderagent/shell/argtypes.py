"""argparse types that refuse an out-of-range value when the command line is parsed, with the
flag's usage line, instead of a traceback from inside a service or an engine after the stack has
started (a block size of 0 divided by zero in the engine; a negative worker count started none)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from urllib.parse import urlsplit

from thunderagent.schemas.ids import is_valid_worker_id


def at_least(minimum: int) -> Callable[[str], int]:
    """An int flag that must be ``>= minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def positive(text: str) -> float:
    """A finite float flag that must be ``> 0``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite positive number, got {text}")
    return value


def _items(text: str) -> list[str]:
    """The comma-separated items of a list flag, none empty and none twice (a repeat would run
    twice and be reported once; an empty item is a typo that used to vanish)."""
    items = [x.strip() for x in text.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"an empty item in {text!r}")
    repeated = sorted({x for x in items if items.count(x) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"{', '.join(repeated)} given twice in {text!r}")
    return items


def positive_list(text: str) -> list[float]:
    """Comma-separated finite numbers ``> 0``, in the order given: a sweep's speeds or rates."""
    values = [positive(x) for x in _items(text)]
    if len(set(values)) < len(values):  # "1,1.0": the same number written twice
        raise argparse.ArgumentTypeError(f"a number given twice in {text!r}")
    return values


def name_list(names: Iterable[str]) -> Callable[[str], list[str]]:
    """Comma-separated names out of ``names``, in the order given."""
    known = list(names)

    def parse(text: str) -> list[str]:
        items = _items(text)
        unknown = [x for x in items if x not in known]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(map(repr, unknown))}; choose from {', '.join(known)}"
            )
        return items

    parse.__name__ = "comma list"
    return parse


def worker_id(text: str) -> str:
    """A worker id: it names NATS subjects, so 1-64 of ``[A-Za-z0-9_-]``."""
    if not is_valid_worker_id(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not 1-64 of [A-Za-z0-9_-] (it names subjects)"
        )
    return text


def http_url(text: str) -> str:
    """An engine's base URL: ``http(s)://host[:port][/prefix]``."""
    url = urlsplit(text)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise argparse.ArgumentTypeError(f"{text!r} is not a base URL like http://127.0.0.1:30000")
    return text.rstrip("/")


def nats_url(text: str) -> str:
    """One NATS server URL or a comma list of them: ``nats://host[:port]`` (or tls, ws, wss)."""
    for item in text.split(","):
        url = urlsplit(item.strip())
        if url.scheme not in ("nats", "tls", "ws", "wss") or not url.hostname:
            raise argparse.ArgumentTypeError(
                f"{item.strip()!r} is not a NATS URL like nats://127.0.0.1:4222"
            )
        try:
            url.port  # noqa: B018 - parsing the port is the check
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item.strip()!r} has a bad port") from None
    return text


def readable_file(text: str) -> Path:
    """A file the command reads when it starts something (a certificate, a key)."""
    path = Path(text)
    if not path.is_file() or not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not a file this process can read")
    return path


def zmq_endpoint(text: str) -> str:
    """A ZMQ endpoint the adapter connects to: ``tcp://host:port`` or ``ipc://path``."""
    scheme, sep, rest = text.partition("://")
    if not sep or not rest or scheme not in ("tcp", "ipc"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a ZMQ endpoint like tcp://127.0.0.1:5557"
        )
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not host or not port.isdigit():
            raise argparse.ArgumentTypeError(f"{text!r} needs a host and a port: tcp://HOST:PORT")
    return text


def _writable_parent(path: Path) -> None:
    """The nearest existing folder above ``path`` must be a folder this process can write in
    (the command creates the missing ones)."""
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{str(path)!r}: {str(parent)!r} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{str(path)!r}: cannot write in {str(parent)!r}")


def output_file(text: str) -> Path:
    """A file the command writes, often only when a long run ends: checked when the command
    line is parsed, so a path that cannot be written fails now, not after the run."""
    path = Path(text)
    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    if path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r} exists and cannot be written")
    _writable_parent(path)
    return path


def output_dir(text: str) -> Path:
    """A folder the command writes files into (created if missing), checked as ``output_file``."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a folder")
    if path.is_dir():
        if not os.access(path, os.W_OK | os.X_OK):
            raise argparse.ArgumentTypeError(f"cannot write in {text!r}")
    else:
        _writable_parent(path)
    return path


def param_value(raw: str) -> object:
    """An override's VALUE: JSON (a number, true, null), else the string as given."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def field_values(items: Iterable[str]) -> dict[str, object]:
    """``FIELD=VALUE`` items -> keyword parameters (``param_value``); ``ValueError`` names a
    malformed item."""
    out: dict[str, object] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or not name:
            raise ValueError(f"{item!r}: expected FIELD=VALUE")
        out[name] = param_value(raw)
    return out


def sched_params(items: Iterable[str], scheduler: str = "thunder") -> dict[str, object]:
    """``FIELD=VALUE`` items -> the knobs of ``scheduler``, built as it will build them:
    ``ValueError`` names a malformed item, a knob it does not have or a bad value."""
    from thunderagent.scheduling import SCHEDULERS

    params = field_values(items)
    try:
        SCHEDULERS.create(scheduler, **params)
    except TypeError as err:
        raise ValueError(str(err)) from None
    return params
