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

import openai
import pytest

from kvpage import LLM, SamplingParams
from kvpage.errors import TensorParallelFailure
from tests.distributed.dummy import dummy_config, write_dummy_model
from tests.server.conftest import wait_healthy

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


def test_an_idle_engine_keeps_its_ranks_past_the_group_timeout(model_dir, monkeypatch):
    """The ranks wait for the next step inside a collective that times out; rank 0 pings them while idle."""
    monkeypatch.setenv("KVPAGE_TP_TIMEOUT_S", "2")  # (read by rank 0's group and the spawned ranks')
    with LLM(model_dir, tensor_parallel_size=2, **KW) as llm:
        first = llm.generate(["Hello there"], GREEDY)[0].outputs[0].token_ids
        time.sleep(5)  # idle for two and a half timeouts
        assert not llm.llm_engine.runner.ranks.dead()
        assert llm.generate(["Hello there"], GREEDY)[0].outputs[0].token_ids == first


def test_a_failure_after_the_steps_collectives_fails_only_its_batch(model_dir, monkeypatch):
    """Rank 0's logits come after the step's last all-reduce: if they fail, the ranks are still in step
    and the engine goes on, as in one process (before it, the group could not)."""
    with LLM(model_dir, tensor_parallel_size=2, **KW) as llm:
        model = llm.llm_engine.runner.model
        real = model.compute_logits
        calls = []

        def once(hidden):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("out of memory (simulated) in rank 0's logits")
            return real(hidden)

        monkeypatch.setattr(model, "compute_logits", once)
        failed = llm.generate(["Hello there"], GREEDY)[0]
        assert failed.error is not None and "simulated" in failed.error
        monkeypatch.undo()
        again = llm.generate(["Hello there"], GREEDY)[0]
        assert again.error is None and len(again.outputs[0].token_ids) == 16
        assert len(set(llm.llm_engine.runner.digests())) == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid), "-f", "kvpage.engine.tp_rank"], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def test_server_answers_503_and_exits_when_a_rank_dies(model_dir):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvpage.cli", "serve", "--model", model_dir, "--port", str(port),
                             "--served-model-name", "dummy", "--tensor-parallel-size", "2", "--dtype", "float32",
                             "--num-kv-blocks", "64", "--max-model-len", "512"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
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


def _greedy_text(model_dir: str, prompt: str, n: int) -> str:
    with LLM(model_dir, **KW) as one:
        return one.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0].outputs[0].text


def test_ranks_launched_by_hand_join_rank_0_at_its_master_address(model_dir):
    """As across machines: `kvpage tp-rank` started apart, rank 0 told --master-addr / --master-port."""
    port = _free_port()
    rank1 = subprocess.Popen([sys.executable, "-m", "kvpage.cli", "tp-rank", "--rank", "1", "-tp", "2",
                              "--master-addr", "127.0.0.1", "--master-port", str(port), "--threads", "1"])  # fmt: skip
    try:
        with LLM(model_dir, tensor_parallel_size=2, master_addr="127.0.0.1", master_port=port, **KW) as llm:
            assert llm.llm_engine.runner.ranks.procs == []  # nothing spawned here
            got = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
            assert got[0].outputs[0].text == _greedy_text(model_dir, "The quick brown fox", 12)
        assert rank1.wait(timeout=30) == 0  # told to stop, it left
    finally:
        if rank1.poll() is None:
            rank1.kill()
            rank1.wait()


def test_kvpage_serve_under_torchrun(model_dir):
    """torchrun starts two `kvpage serve`: rank 0 serves HTTP, rank 1 its share of every step."""
    port, master = _free_port(), _free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                "--master-port", str(master), "-m", "kvpage.cli", "serve", "--model", model_dir, "--port", str(port),
                "--served-model-name", "dummy", "--tensor-parallel-size", "2", "--dtype", "float32",
                "--num-kv-blocks", "64", "--max-model-len", "512"]  # fmt: skip
    proc = subprocess.Popen(torchrun, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        got = client.completions.create(model="dummy", prompt="The quick brown fox", max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})  # fmt: skip
        assert got.choices[0].text == _greedy_text(model_dir, "The quick brown fox", 12)
        proc.send_signal(signal.SIGTERM)  # torchrun passes it on to both ranks
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
