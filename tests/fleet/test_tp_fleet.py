"""A fleet whose replica is a tensor-parallel group: Ray reserves one placement group per replica (a
CPU bundle per rank, STRICT_PACK), the replica spawns its second rank, and the answer equals one
process's (a real local Ray cluster on 127.0.0.1, the official openai client)."""

from __future__ import annotations

import socket
import subprocess

import openai
import pytest

ray = pytest.importorskip("ray")

from kvpage import LLM, SamplingParams  # noqa: E402
from kvpage.fleet.ray_app import Fleet, FleetSpec  # noqa: E402
from tests.distributed.dummy import dummy_config, write_dummy_model  # noqa: E402

ENGINE = dict(dtype="float32", num_kv_blocks=64, max_model_len=512)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_replica_is_a_tp_group_in_its_own_placement_group(one_ray_cluster_at_a_time, tmp_path, smollm2):
    model = str(write_dummy_model(tmp_path / "dummy4x2", dummy_config(4, 2), smollm2.tokenizer))
    prompt = "The quick brown fox"
    with LLM(model, **ENGINE) as one:
        want = one.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    spec = FleetSpec({**ENGINE, "model": model, "tensor_parallel_size": 2}, replicas=1, router="round_robin",
                     cpus_per_replica=1.8, port=_free_port(), app_kwargs={"served_model_name": "dummy"})  # fmt: skip
    with Fleet(spec, num_cpus=2) as fleet:
        c = openai.OpenAI(base_url=fleet.url, api_key="x", max_retries=0, timeout=120)
        got = c.completions.create(model="dummy", prompt=prompt, max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True})  # fmt: skip
        assert got.choices[0].text == want.outputs[0].text
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
        assert len(groups) == 1 and groups[0]["strategy"] == "STRICT_PACK"
        assert [b.get("CPU") for b in groups[0]["bundles"].values()] == [0.9, 0.9]
        # the replica's second rank runs, spawned by the replica's own Ray worker
        ranks = subprocess.run(["pgrep", "-f", "kvpage.engine.tp_rank --rank 1"], capture_output=True, text=True)
        parents = [subprocess.run(["ps", "-o", "ppid=", "-p", pid], capture_output=True, text=True).stdout.strip()
                   for pid in ranks.stdout.split()]  # fmt: skip
        titles = [subprocess.run(["ps", "-o", "args=", "-p", pp], capture_output=True, text=True).stdout
                  for pp in parents if pp]  # fmt: skip
        assert any("KVReplica" in t for t in titles), titles
