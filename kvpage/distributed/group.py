"""A tensor-parallel process group: torch.distributed's process groups (gloo on CPU, nccl on CUDA) over
its TCPStore, with the time spent in the activations' all-reduces counted (the benchmark's share of a
step spent in collectives).

The groups are standalone objects, not torch.distributed's process-global default group, so one
process may hold several engines' groups (a test module's, a refusal's, a dead-rank test's) and a
closed one leaves nothing behind. Collectives with a rank that has died raise (gloo: the peer's socket
closes) or time out after `timeout_s`; either way the caller's step fails instead of hanging.
"""

from __future__ import annotations

import os
import pickle
import time
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0


def group_timeout_s() -> float:
    """How long a collective may wait: KVPAGE_TP_TIMEOUT_S, else DEFAULT_TIMEOUT_S (an idle engine's
    ranks never wait that long: rank 0 pings them, rank_runner.py)."""
    return float(os.environ.get("KVPAGE_TP_TIMEOUT_S") or DEFAULT_TIMEOUT_S)


class TPGroup:
    def __init__(self, rank: int, size: int, addr: str, port: int, device: str = "cpu",
                 timeout_s: float | None = None) -> None:  # fmt: skip
        self.rank, self.size = rank, size
        self.timeout_s = timeout_s = timeout_s or group_timeout_s()
        timeout = timedelta(seconds=timeout_s)
        self.device = torch.device(device)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        # rank 0 listens; the others connect (waiting up to the timeout for it). Under torchrun's static
        # rendezvous its agent already serves a store at MASTER_PORT: every rank connects to that one.
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(addr, port, size, rank == 0 and not agent, timeout, wait_for_workers=not agent)
        self._store = dist.PrefixStore("kvpage", store)
        # plain data (steps, counts) goes over gloo even beside nccl: it lives in host memory
        self._host = dist.ProcessGroupGloo(dist.PrefixStore("host", self._store), rank, size, timeout)
        if self.backend == "nccl":
            self._dev = dist.ProcessGroupNCCL(dist.PrefixStore("dev", self._store), rank, size)
        else:
            self._dev = self._host
        self.collective_s = 0.0  # seconds spent in all-reduces of activations, summed
        self.num_all_reduces = 0
        self.closed = False

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns it."""
        t0 = time.perf_counter()
        self._dev.allreduce([x]).wait()
        self.collective_s += time.perf_counter() - t0
        self.num_all_reduces += 1
        return x

    def broadcast(self, obj=None):
        """Rank 0's `obj` on every rank (plain picklable data)."""
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self._host.broadcast([size]).wait()
        if self.rank != 0:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._host.broadcast([data]).wait()
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order (on every rank)."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self._host.allgather([sizes], [torch.tensor([data.numel()], dtype=torch.int64)]).wait()
        longest = max(int(s.item()) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: data.numel()] = data
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]
        self._host.allgather([out], [padded]).wait()
        return [pickle.loads(t[: int(s.item())].numpy().tobytes()) for t, s in zip(out, sizes, strict=True)]

    def min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self._host.allreduce([t], opts).wait()
        return int(t.item())

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._dev = self._host = self._store = None
