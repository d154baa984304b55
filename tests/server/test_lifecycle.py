"""The server's life: a signal stops it within seconds whatever runs; a dead engine is reported
(/health 503, every waiting client answered) and the process exits."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from tests.server.conftest import assert_pool_free, start_server, stop_server, wait_healthy

LONG = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 900, "min_tokens": 900, "ignore_eos": True}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_server_within_seconds_while_requests_run(sig):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvpage.cli", "serve", "--port", str(port), "--dtype", "float32",
                             "--num-kv-blocks", "256", "--max-model-len", "1024"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        answers: list = []

        def plain():
            answers.append(httpx.post(f"{url}/v1/completions", json=LONG, timeout=120))

        def streaming():
            with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}, timeout=120) as r:
                answers.append([line for line in r.iter_lines() if line.startswith("data: ")])

        def watching():  # an open dashboard must not hold the server past its shutdown either
            with httpx.stream("GET", f"{url}/dashboard/events", timeout=60) as r:
                answers.append(("dashboard", sum(line.startswith("data: ") for line in r.iter_lines())))

        clients = [threading.Thread(target=f) for f in (plain, plain, plain, streaming, watching)]
        for t in clients:
            t.start()
        time.sleep(2.0)  # the requests are running
        t0 = time.monotonic()
        proc.send_signal(sig)
        rc = proc.wait(timeout=30)
        took = time.monotonic() - t0
        for t in clients:
            t.join(timeout=10)
        # uvicorn re-raises the signal once it has shut down: the exit status says which signal ended it
        assert rc in (0, -sig, 128 + sig) and took < 15, (rc, took)  # 4 x 900 tokens would take minutes
        statuses = sorted(a.status_code for a in answers if isinstance(a, httpx.Response))
        assert statuses == [503, 503, 503]
        assert all("shutting down" in a.json()["error"]["message"] for a in answers if isinstance(a, httpx.Response))
        (events,) = [a for a in answers if isinstance(a, list)]
        (pictures,) = [a[1] for a in answers if isinstance(a, tuple)]
        assert pictures >= 1  # it was fed while the requests ran, then it ended with the server
        assert events[-1] == "data: [DONE]" and "shutting down" in json.loads(events[-2][6:])["error"]["message"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _crash_the_engine(s) -> None:
    """Fault injection: the engine's next step raises out of the engine loop, as a bug would."""

    def broken_step():
        raise RuntimeError("injected engine fault")

    s.engine.step = broken_step


def test_a_dead_engine_answers_503_and_every_waiting_client():
    s = start_server(server_kw={"exit_on_engine_death": False}, num_kv_blocks=64, max_model_len=512)
    try:
        answers: list = []
        t = threading.Thread(target=lambda: answers.append(httpx.post(
            f"{s.url}/v1/completions", json={**LONG, "max_tokens": 400, "min_tokens": 400}, timeout=60)))  # fmt: skip
        t.start()
        deadline = time.monotonic() + 30
        while not s.engine.num_generation_tokens:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        _crash_the_engine(s)
        t.join(timeout=30)
        assert answers[0].status_code == 503 and "injected engine fault" in answers[0].json()["error"]["message"]
        health = httpx.get(f"{s.url}/health")
        assert health.status_code == 503 and "injected engine fault" in health.json()["error"]
        c = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0, timeout=10)
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model="smollm2", prompt="hi", max_tokens=2)
        assert e.value.status_code == 503 and "engine stopped" in e.value.message
        r = httpx.post(f"{s.url}/v1/completions", json={"model": "smollm2", "prompt": "hi", "stream": True}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"  # not a 200 stream
    finally:
        stop_server(s)


def test_a_failed_model_step_is_a_500_and_the_server_goes_on(server):
    """Fault injection: one model step raises. Its request gets a 500 (the server's fault, not the
    client's), and the next request is served."""
    runner = server.engine.runner
    real = runner.execute

    def fails_once(step):
        runner.execute = real
        raise RuntimeError("injected model fault")

    runner.execute = fails_once
    try:
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "smollm2", "prompt": "hi", "max_tokens": 3},
                       timeout=60)  # fmt: skip
    finally:
        runner.execute = real
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "injected model fault" in r.json()["error"]["message"]
    ok = httpx.post(f"{server.url}/v1/completions", json={"model": "smollm2", "prompt": "hi", "max_tokens": 3},
                    timeout=60)  # fmt: skip
    assert ok.status_code == 200
    assert_pool_free(server)


def test_a_dead_engine_stops_the_server():
    s = start_server(num_kv_blocks=64, max_model_len=512)
    try:
        _crash_the_engine(s)
        httpx.post(f"{s.url}/v1/completions", json={"model": "smollm2", "prompt": "hi", "max_tokens": 2}, timeout=30)
        s.thread.join(timeout=15)
        assert not s.thread.is_alive() and s.server.engine_died
    finally:
        stop_server(s)
