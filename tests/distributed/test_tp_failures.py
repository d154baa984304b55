"""A tensor-parallel group that loses a rank ends cleanly, never hangs: the engine raises
TensorParallelFailure (rank 0 sees the spawned rank's exit, or gloo the closed connection of a rank
launched per rank), and `kvpage serve` answers 503 and exits."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from kvpage import LLM, SamplingParams
from kvpage.errors import TensorParallelFailure
from tests.distributed.dummy import dummy_config, write_dummy_model

KW = dict(dtype="float32", num_kv_blocks=64, max_model_len=512)
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2):
    return str(write_dummy_model(tmp_path_factory.mktemp("dummy4x2"), dummy_config(4, 2), smollm2.tokenizer))


def _kill_rank_1(llm: LLM) -> int:
    proc = llm.llm_engine.runner.ranks.procs[0]
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    return proc.pid


@pytest.mark.parametrize("watched", [True, False], ids=["spawned", "launched-per-rank"])
def test_a_dead_rank_ends_the_engine(model_dir, watched):
    llm = LLM(model_dir, tensor_parallel_size=2, **KW)
    try:
        assert len(llm.generate(["Hello there"], GREEDY)[0].outputs[0].token_ids) == 16
        if not watched:  # as if launched by torchrun or `kvpage tp-rank`: no pid to watch, gloo must tell
            llm.llm_engine.runner.ranks.dead = lambda: []
        _kill_rank_1(llm)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelFailure, match="exited" if watched else "step failed"):
            llm.generate(["Hello again"], GREEDY)
        assert time.monotonic() - t0 < 30
        with pytest.raises(TensorParallelFailure):  # and stays failed
            llm.llm_engine.step() if llm.llm_engine.has_unfinished_requests() else llm.generate(["x"], GREEDY)
    finally:
        t0 = time.monotonic()
        llm.close()
        assert time.monotonic() - t0 < 15


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid), "-f", "kvpage.distributed.launch"], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def test_server_answers_503_and_exits_when_a_rank_dies(model_dir):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvpage.cli", "serve", "--model", model_dir, "--port", str(port),
                             "--served-model-name", "dummy", "--tensor-parallel-size", "2", "--dtype", "float32",
                             "--num-kv-blocks", "64", "--max-model-len", "512"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        first = client.completions.create(model="dummy", prompt="Hello", max_tokens=8, temperature=0)
        assert first.usage.completion_tokens == 8
        (rank1,) = _children(proc.pid)
        os.kill(rank1, signal.SIGKILL)
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model="dummy", prompt="Hello again", max_tokens=8, temperature=0)
        assert e.value.status_code == 503
        rc = proc.wait(timeout=30)
        assert rc != 0
        assert "the engine stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
