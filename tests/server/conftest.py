"""A live kvpage server on loopback (uvicorn in a thread of the test process), real model, real engine."""

from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvpage.config import EngineConfig
from kvpage.engine.llm_engine import LLMEngine
from kvpage.server.app import build_app
from kvpage.server.serve import KvpageServer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(api_key: str | list[str] | None = None, app_kw: dict | None = None, server_kw: dict | None = None,
                 **engine_kw):  # fmt: skip
    """The same server as `kvpage serve` (KvpageServer), in a thread; `app_kw` goes to build_app."""
    engine_kw.setdefault("dtype", "float32")  # greedy text does not depend on the batch (bf16 can, at near-ties)
    engine_kw.setdefault("num_kv_blocks", 256)
    engine_kw.setdefault("max_model_len", 1024)
    engine = LLMEngine(EngineConfig(**engine_kw))
    app_kw = {"max_body_bytes": 64 * 1024, **(app_kw or {})}
    app = build_app(engine, served_model_name="smollm2", api_key=api_key, **app_kw)
    port = _free_port()
    server = KvpageServer(app, host="127.0.0.1", port=port, **(server_kw or {}))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    return SimpleNamespace(
        url=url,
        base_url=f"{url}/v1",
        engine=engine,
        server=server,
        thread=thread,
        metrics=app.fastapi.state.metrics,
        aengine=app.fastapi.state.async_engine,
    )


def wait_healthy(proc, url: str, timeout: float = 120.0) -> None:
    """Until the `kvpage serve` subprocess `proc` answers /health 200 (its stderr shown if it exits first)."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.2)


def stop_server(s) -> None:
    s.server.should_exit = True
    s.thread.join(timeout=30)


def scrape(s, headers: dict | None = None) -> dict[str, float]:
    """/metrics as {name{labels}: value}, the model_name label left out."""
    text = httpx.get(f"{s.url}/metrics", headers=headers).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k != "model_name")
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def wait_idle(s, timeout: float = 30.0, headers: dict | None = None) -> None:
    """Until the engine has no request left (checked from outside, as an operator would: /metrics)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = scrape(s, headers)
        if m['kvpage:kv_cache_blocks{state="used"}'] == 0 and m["kvpage:num_requests_running"] == 0 \
                and m["kvpage:num_requests_waiting"] == 0:  # fmt: skip
            return
        time.sleep(0.05)
    raise AssertionError("the engine did not go idle")


def assert_pool_free(s, headers: dict | None = None) -> None:
    wait_idle(s, headers=headers)
    s.engine.kv_manager.check_invariants()
    st = s.engine.cache_stats()
    assert st.used_blocks == 0 and st.free_blocks == st.total_blocks
    assert st.demoted_used_blocks == dict.fromkeys(st.demoted_total_blocks, 0)  # a demoting server's pools
    assert not s.engine.has_unfinished_requests()
    deadline = time.monotonic() + 5  # the metrics forget a request once its end has been seen
    while s.metrics.tracked and time.monotonic() < deadline:
        time.sleep(0.02)
    assert s.metrics.tracked == 0
