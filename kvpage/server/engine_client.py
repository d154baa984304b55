"""What the OpenAI endpoints need of an engine, wherever it runs.

The endpoints (serving*.py) read the engine's description (`client.engine`: tokenizer, config,
model_config, max_model_len, check_width) and run requests through `client.generate`. Two clients
provide it: `AsyncEngine` (an LLMEngine in this process; its `engine` is the LLMEngine itself) and
the fleet's client (kvpage/fleet/ingress.py: replicas on Ray Serve; its `engine` is an
`EngineDescription` a replica sent, so the ingress tokenizes, templates and checks exactly as the
replicas would, without loading a model).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpage.config import EngineConfig
from kvpage.core.limits import StepLimits
from kvpage.models.config import ModelConfig
from kvpage.models.tokenizer import Tokenizer


@dataclass(slots=True)
class EngineDescription:
    """An engine as the endpoints see it, as plain data (picklable: it crosses processes)."""

    tokenizer: Tokenizer
    config: EngineConfig
    model_config: ModelConfig
    max_model_len: int
    block_size: int
    limits: StepLimits

    def check_width(self, name: str, width: int) -> None:
        self.limits.check_width(name, width)

    @staticmethod
    def of(engine) -> EngineDescription:
        """An LLMEngine's description."""
        return EngineDescription(engine.tokenizer, engine.config, engine.model_config, engine.max_model_len,
                                 engine.kv_events.block_size, engine.scheduler.limits)  # fmt: skip
