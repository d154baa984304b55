"""Where a tensor-parallel group's ranks come from.

    spawned here        `LLM(tensor_parallel_size=N)` / `kvpage serve --tensor-parallel-size N`: ranks
                        1..N-1 are started as `python -m kvpage.distributed.launch` on this machine
                        (127.0.0.1, a free port), stopped by pid when the engine closes
    launched per rank   torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment) or, across
                        machines, rank 0 with --master-addr/--master-port and every other rank as
                        `kvpage tp-rank --rank R --tensor-parallel-size N --master-addr A --master-port P`

Either way the other ranks receive rank 0's EngineConfig once joined, build their shard alike
(engine/builder.py: build_shard) and serve steps until told to stop (rank_runner.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from kvpage.distributed.group import DEFAULT_TIMEOUT_S, TPGroup

log = logging.getLogger("kvpage")


@dataclass(frozen=True, slots=True)
class Rendezvous:
    addr: str
    port: int
    rank: int
    size: int
    spawned: bool  # this process starts the other ranks itself


def rendezvous(config) -> Rendezvous:
    """Where rank 0 meets the others: torchrun's environment, the config's master address, or a free
    local port (the other ranks then spawned here)."""
    size = config.tensor_parallel_size
    env = os.environ
    if "RANK" in env and "MASTER_ADDR" in env and int(env.get("WORLD_SIZE", "0")) == size:
        return Rendezvous(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["RANK"]), size, False)
    if config.master_addr is not None:
        return Rendezvous(config.master_addr, config.master_port, 0, size, False)
    return Rendezvous("127.0.0.1", free_port(), 0, size, True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks:
    """The other ranks' processes when this one spawned them (none when they were launched per rank)."""

    def __init__(self, procs: list[subprocess.Popen], threads_before: int | None = None) -> None:
        self.procs = procs
        self.threads_before = threads_before  # this process's torch threads before it gave the ranks theirs

    def dead(self) -> list[int]:
        """The ranks whose process has exited."""
        return [r for r, p in enumerate(self.procs, start=1) if p.poll() is not None]

    def stop(self, grace_s: float = 10.0) -> None:
        """Wait for the ranks to leave (after a stop message), then terminate, then kill, by pid."""
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.threads_before is not None:
            _set_threads(self.threads_before)
            self.threads_before = None


def start_group(config) -> tuple[TPGroup, Ranks]:
    """Rank 0's side: the other ranks started (or awaited), the group formed, the config sent."""
    rv = rendezvous(config)
    if rv.rank != 0:
        raise ValueError(f"this process is rank {rv.rank} of a launched group: run it with `kvpage tp-rank` "
                         "(or `kvpage serve` under torchrun), not as an engine")  # fmt: skip
    procs, before = [], None
    if rv.spawned:  # the ranks share this machine's cores: each (this one too) takes 1/N of its threads
        before = _threads()
        per_rank = max(1, before // rv.size)
        _set_threads(per_rank)
        threads = str(per_rank)
        for r in range(1, rv.size):
            cmd = [sys.executable, "-m", "kvpage.distributed.launch", "--rank", str(r), "--tensor-parallel-size",
                   str(rv.size), "--master-addr", rv.addr, "--master-port", str(rv.port), "--threads", threads,
                   "--device", config.device, "--tp-timeout", str(_timeout(config)), "--die-with-parent"]  # fmt: skip
            procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL))
    ranks = Ranks(procs, before)
    try:
        group = TPGroup(0, rv.size, rv.addr, rv.port, config.device, _timeout(config))
        group.broadcast(config)
    except BaseException:
        for p in procs:
            p.kill()
        ranks.stop()
        raise
    return group, ranks


def _timeout(config) -> float:
    return float(getattr(config, "tp_timeout", None) or DEFAULT_TIMEOUT_S)


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def _die_with_parent() -> None:
    """A spawned rank ends with the process that spawned it, however that one ended (a thread watches
    the parent pid; PR_SET_PDEATHSIG would fire when the spawning *thread* ends)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def serve_as_rank(rank: int, size: int, addr: str, port: int, device: str = "cpu",
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> int:  # fmt: skip
    """A rank other than 0: join, take rank 0's config, build this rank's shard, serve its steps."""
    from kvpage.distributed.rank_runner import serve_steps
    from kvpage.engine.builder import build_shard

    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    group = TPGroup(rank, size, addr, port, device, timeout_s)
    try:
        config = group.broadcast()
        shard = build_shard(config, group)
        serve_steps(group, shard.runner)
        return 0
    finally:
        group.close()


def add_rank_args(p: argparse.ArgumentParser) -> None:
    """`kvpage tp-rank`'s options (and this module's, run as the spawned ranks are)."""
    p.add_argument("--rank", type=int, required=True, help="this process's rank, 1..N-1 (rank 0 is kvpage serve)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, required=True, metavar="N")
    p.add_argument("--master-addr", required=True, help="where rank 0 listens (its --master-addr)")
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda (this rank's GPU: LOCAL_RANK, else --rank)")
    p.add_argument("--threads", type=int, default=None, help="torch threads for this rank (default: torch's)")
    p.add_argument("--tp-timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds a collective may wait")
    p.add_argument("--die-with-parent", action="store_true", help=argparse.SUPPRESS)  # spawned by rank 0


def run_rank(a: argparse.Namespace) -> int:
    if not 0 < a.rank < a.tensor_parallel_size:
        raise ValueError(f"--rank must be in [1, {a.tensor_parallel_size}) (rank 0 is the engine: kvpage serve)")
    if a.die_with_parent:
        _die_with_parent()
    logging.basicConfig(level=logging.WARNING, format=f"[rank {a.rank}] %(levelname)s %(message)s")
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    try:
        return serve_as_rank(a.rank, a.tensor_parallel_size, a.master_addr, a.master_port, a.device, a.tp_timeout)
    except ValueError as e:  # a refusal rank 0 reports too (a head count the size does not divide, ...)
        log.error("stopped: %s", e)
        return 1


def launched_rank(tensor_parallel_size: int) -> Rendezvous | None:
    """Under torchrun, the rendezvous of a rank other than 0 (`kvpage serve` then serves steps, not HTTP)."""
    env = os.environ
    if tensor_parallel_size > 1 and "RANK" in env and "MASTER_ADDR" in env and int(env["RANK"]) > 0:
        if int(env.get("WORLD_SIZE", "0")) != tensor_parallel_size:
            raise ValueError(f"WORLD_SIZE={env.get('WORLD_SIZE')} but --tensor-parallel-size {tensor_parallel_size}")
        return Rendezvous(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["RANK"]), tensor_parallel_size, False)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvpage tp-rank", description="one rank (not 0) of a tensor-parallel group")
    add_rank_args(p)
    return run_rank(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
