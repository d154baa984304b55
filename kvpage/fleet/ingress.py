"""A fleet's ingress: the OpenAI API (server/app.py) over a FleetClient, one Ray Serve deployment.

The app applies the chat template; the client tokenizes once, hashes the prompt's blocks with the core's
chain and its cache_salt, and sends a FleetRequest through the replicas' DeploymentHandle, whose router
(ray_routing.py) picks the replica; outputs stream back. /metrics is a FleetMetrics (fleet_metrics.py),
/dashboard a FleetFeed (fleet_feed.py).
"""

from __future__ import annotations

from kvpage.fleet.fleet_feed import FleetFeed
from kvpage.fleet.fleet_metrics import FleetMetrics
from kvpage.fleet.index_actor import index_actor
from kvpage.fleet.replica import FleetRequest
from kvpage.fleet.routing import RouteRequest


class FleetClient:
    """The engine client (server/engine_client.py) of a fleet: requests go through the replicas'
    DeploymentHandle (routed by the deployment's router), outputs stream back."""

    def __init__(self, handle, description, index_name: str | None) -> None:
        self.engine = description
        self._handle = handle.options(stream=True)
        self.index_name = index_name
        self.closing = False
        self.error = None
        self.on_death = None
        self.alive = True

    def start(self) -> None:
        pass

    def begin_shutdown(self) -> None:
        self.closing = True

    def shutdown(self) -> None:
        pass

    async def generate(self, request_id: str, prompt, params, cache_salt: str | None = None):
        tok = self.engine.tokenizer
        ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
        text = prompt if isinstance(prompt, str) else tok.decode(ids, skip_special_tokens=False)
        digests = RouteRequest.of(ids, self.engine.block_size, cache_salt).digests
        gen = self._handle.generate.remote(FleetRequest(request_id, text, ids, params, cache_salt, digests))
        finished = False
        try:
            async for out in gen:
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                gen.cancel()


class FleetIngress:
    """The OpenAI API of the fleet (server/app.py over a FleetClient)."""

    async def __init__(self, replicas, index_name: str | None, router: str, app_kwargs: dict) -> None:
        description = await replicas.describe.remote()
        self.client = FleetClient(replicas, description, index_name)
        self.metrics = FleetMetrics(index_name, router)
        self.app_kwargs = app_kwargs

    def __serve_build_asgi_app__(self):
        from kvpage.server.app import build_app

        name = self.client.index_name
        feed = None if name is None else FleetFeed(lambda: index_actor(name).stats.remote())
        return build_app(client=self.client, metrics=self.metrics, dashboard=feed, **self.app_kwargs)
