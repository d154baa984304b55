"""A live kvpage server on loopback (uvicorn in a thread of the test process), real model, real engine."""

from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import uvicorn

from kvpage.config import EngineConfig
from kvpage.engine.llm_engine import LLMEngine
from kvpage.server.app import build_app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(api_key: str | None = None, **engine_kw):
    engine_kw.setdefault("dtype", "float32")  # greedy text does not depend on the batch (bf16 can, at near-ties)
    engine_kw.setdefault("num_kv_blocks", 256)
    engine_kw.setdefault("max_model_len", 1024)
    engine = LLMEngine(EngineConfig(**engine_kw))
    app = build_app(engine, served_model_name="smollm2", api_key=api_key, max_body_bytes=64 * 1024)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    return SimpleNamespace(url=url, base_url=f"{url}/v1", engine=engine, server=server, thread=thread)


def stop_server(s) -> None:
    s.server.should_exit = True
    s.thread.join(timeout=30)


@pytest.fixture(scope="session")
def server():
    s = start_server()
    yield s
    stop_server(s)


def wait_idle(s, timeout: float = 30.0) -> None:
    """Until the engine has no request left (checked from outside, as an operator would: /metrics)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(f"{s.url}/metrics").text
        if 'kvpage:kv_cache_blocks{state="used"} 0.0' in text and "kvpage:num_requests_running 0.0" in text:
            return
        time.sleep(0.05)
    raise AssertionError("the engine did not go idle")


def assert_pool_free(s) -> None:
    wait_idle(s)
    s.engine.kv_manager.check_invariants()
    st = s.engine.cache_stats()
    assert st.used_blocks == 0 and st.free_blocks == st.total_blocks
    assert not s.engine.has_unfinished_requests()
