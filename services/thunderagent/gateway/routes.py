"""The routes that do not generate: models (from the fleet the gateway watches), health, and
an OpenAI-shaped 404 / 405 for everything else."""

from __future__ import annotations

from aiohttp import web

from thunderagent.bus import Bus
from thunderagent.fleet import WorkerRegistry
from thunderagent.gateway.errors import HttpError, from_code
from thunderagent.schemas import ErrorCode

POST_ONLY = frozenset({"/v1/chat/completions", "/v1/completions"})


class ModelRoutes:
    def __init__(self, registry: WorkerRegistry, bus: Bus) -> None:
        self.registry = registry
        self.bus = bus

    def _models(self) -> dict[str, dict]:
        """Model id -> its OpenAI model object; ``created`` is its earliest worker's start."""
        out: dict[str, dict] = {}
        for state in self.registry.all():
            reg = state.registration
            created = int(reg.registered_at)
            entry = out.get(reg.model)
            if entry is None:
                out[reg.model] = {"id": reg.model, "object": "model", "created": created,
                                  "owned_by": "thunderagent"}  # fmt: skip
            else:
                entry["created"] = min(entry["created"], created)
        return out

    async def list(self, request: web.Request) -> web.Response:
        models = self._models()
        data = [models[name] for name in sorted(models)]
        return web.json_response({"object": "list", "data": data})

    async def get(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        model = self._models().get(name)
        if model is None:
            known = ", ".join(sorted(self._models())) or "none"
            message = f"no worker serves model {name!r} (served: {known})"
            raise from_code(ErrorCode.UNKNOWN_MODEL, message)
        return web.json_response(model)

    async def health(self, request: web.Request) -> web.Response:
        connected = self.bus.is_connected
        body = {
            "status": "ok" if connected else "unavailable",
            "nats": "connected" if connected else "disconnected",
            "workers": len(self.registry),
            "models": sorted(self.registry.models()),
        }
        return web.json_response(body, status=200 if connected else 503)

    async def ready(self, request: web.Request) -> web.Response:
        """Readiness, not liveness: 503 while this gateway could serve nothing (NATS away, or
        no worker registered), so a load balancer sends it no traffic; ``/health`` stays 200
        while the process is fine, so a liveness probe does not restart it for want of
        workers."""
        connected = self.bus.is_connected
        workers = len(self.registry)
        why = "" if connected else "NATS disconnected"
        why = why or ("" if workers else "no worker registered")
        body = {"ready": not why, "reason": why, "workers": workers,
                "models": sorted(self.registry.models())}  # fmt: skip
        return web.json_response(body, status=503 if why else 200)

    async def no_route(self, request: web.Request) -> web.Response:
        if request.path in POST_ONLY:
            raise HttpError(405, f"{request.method} is not allowed on {request.path}: use POST",
                            code="method_not_allowed", headers={"Allow": "POST"})  # fmt: skip
        raise HttpError(404, f"no route {request.method} {request.path}", code="not_found")
