"""A fleet's replica: one LLMEngine in its own AsyncEngine loop, a Ray Serve deployment, and the
request it takes from the ingress (`FleetRequest`, plain data). Its EventPublisher (publisher.py)
reports to the KV index between the engine's steps. Torch is imported when a replica starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from ray import serve

from kvpage.fleet.publisher import EventPublisher
from kvpage.sampling_params import BeamSearchParams, SamplingParams


@dataclass(slots=True)
class FleetRequest:
    """One engine request as it crosses from the ingress to a replica: plain data."""

    request_id: str
    prompt: str  # the prompt's text (Ray's prefix router reads `.prompt`)
    token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    cache_salt: str | None
    digests: tuple[str, ...]  # the prompt's chain digests (routing.RouteRequest.of)


class KVReplica:
    """One engine: an LLMEngine in its own AsyncEngine loop, publishing its KV events to the index."""

    def __init__(self, engine_kwargs: dict, index_name: str, threads: int | None = None, events: bool = True) -> None:
        import torch

        from kvpage.config import EngineConfig
        from kvpage.engine.llm_engine import LLMEngine
        from kvpage.server.async_engine import AsyncEngine
        from kvpage.server.metrics import Metrics

        if threads:
            torch.set_num_threads(threads)
        self.engine = LLMEngine(EngineConfig.from_kwargs(**engine_kwargs))
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.metrics = Metrics(self.engine, engine_kwargs.get("model", "kvpage"))
        self.aengine = AsyncEngine(self.engine, on_output=self.metrics.observe, on_abort=self.metrics.aborted)
        self.publisher = EventPublisher(self.replica, self.engine, self.metrics.families, index_name, events)
        self.aengine.between_steps.append(self.publisher)
        self.aengine.start()

    def describe(self):
        from kvpage.server.engine_client import EngineDescription

        return EngineDescription.of(self.engine)

    def replica_id(self) -> str:
        return self.replica

    async def generate(self, freq: FleetRequest):
        self.publisher.received += 1
        async for out in self.aengine.generate(freq.request_id, freq.token_ids, freq.params, freq.cache_salt):
            yield out

    def check_health(self) -> None:  # Ray Serve's health check: a dead engine thread restarts the replica
        if not self.aengine.alive:
            raise RuntimeError(f"the engine stopped: {self.aengine.error!r}")

    def __del__(self) -> None:
        aengine = getattr(self, "aengine", None)
        if aengine is not None:
            aengine.begin_shutdown()
            aengine.shutdown()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()  # a tensor-parallel replica's other ranks, by pid
