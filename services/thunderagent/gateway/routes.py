"""The routes that do not generate: models and workers (from the fleet the gateway watches),
health, and an OpenAI-shaped 404 / 405 for everything else.

Models are listed as SGLang lists them: each base model, then each LoRA adapter some worker of
it has loaded, as a card whose ``parent`` is the base model. An adapter's ``id`` is
``<model>:<adapter>``, the name this gateway (and SGLang's OpenAI API) takes to select it, so a
client can send any listed id as ``model`` (SGLang's own card names the adapter alone, which
as a ``model`` would select the base model)."""

from __future__ import annotations

import time

import msgspec
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
        """Model id -> its OpenAI model object (base models, then adapters; module doc);
        ``created`` is its earliest worker's start."""
        out: dict[str, dict] = {}
        adapters: dict[str, dict] = {}
        for state in self.registry.all():
            reg = state.registration
            created = int(reg.registered_at)
            _card(out, reg.model, created)
            for name in reg.lora_adapters:
                card = _card(adapters, f"{reg.model}:{name}", created)
                card.update(root=name, parent=reg.model)
        return out | adapters

    async def list(self, request: web.Request) -> web.Response:
        models = self._models()
        data = sorted(models.values(), key=lambda m: ("parent" in m, m["id"]))
        return web.json_response({"object": "list", "data": data})

    async def get(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        model = self._models().get(name)
        if model is None:
            known = ", ".join(sorted(self._models())) or "none"
            message = f"no worker serves model {name!r} (served: {known})"
            raise from_code(ErrorCode.UNKNOWN_MODEL, message)
        return web.json_response(model)

    async def workers(self, request: web.Request) -> web.Response:
        """The fleet as this gateway sees it (SMG's ``GET /workers`` in our terms): each
        worker's registration and its latest load report, with that report's age."""
        now = time.time()
        out = []
        for state in sorted(self.registry.all(), key=lambda s: s.registration.worker_id):
            load = state.load
            out.append({
                "registration": msgspec.to_builtins(state.registration),
                "load": None if load is None else msgspec.to_builtins(load),
                "load_age_s": None if load is None else round(now - load.ts, 3),
            })  # fmt: skip
        return web.json_response({"workers": out, "total": len(out)})

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


def _card(cards: dict[str, dict], model_id: str, created: int) -> dict:
    """The OpenAI model object for ``model_id`` in ``cards`` (made on first sight), dated by
    its earliest worker."""
    card = cards.get(model_id)
    if card is None:
        card = cards[model_id] = {"id": model_id, "object": "model", "created": created,
                                  "owned_by": "thunderagent"}  # fmt: skip
    else:
        card["created"] = min(card["created"], created)
    return card
