"""Where a tensor-parallel group's ranks come from.

    spawned here        `LLM(tensor_parallel_size=N)` / `kvpage serve --tensor-parallel-size N`: ranks
                        1..N-1 are started as `python -m kvpage.engine.tp_rank` on this machine
                        (127.0.0.1, a free port), stopped by pid when the engine closes
    launched per rank   torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment) or, across
                        machines, rank 0 with --master-addr/--master-port and every other rank as
                        `kvpage tp-rank --rank R --tensor-parallel-size N --master-addr A --master-port P`

Either way the other ranks (kvpage/engine/tp_rank.py) receive rank 0's EngineConfig once joined,
build their shard alike (engine/builder.py: build_shard) and serve steps until told to stop
(rank_runner.py).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import torch

from kvpage.distributed.group import TPGroup


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
    launched = torchrun_rendezvous(size)
    if launched is not None:
        return launched
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
            torch.set_num_threads(self.threads_before)
            self.threads_before = None


def start_group(config) -> tuple[TPGroup, Ranks]:
    """Rank 0's side: the other ranks started (or awaited), the group formed, the config sent."""
    rv = rendezvous(config)
    if rv.rank != 0:
        raise ValueError(f"this process is rank {rv.rank} of a launched group: run it with `kvpage tp-rank` "
                         "(or `kvpage serve` under torchrun), not as an engine")  # fmt: skip
    ranks = Ranks([])
    try:
        if rv.spawned:  # the ranks share this machine's cores: each (this one too) takes 1/N of its threads
            ranks.threads_before = torch.get_num_threads()
            per_rank = max(1, ranks.threads_before // rv.size)
            torch.set_num_threads(per_rank)
            for r in range(1, rv.size):
                cmd = [sys.executable, "-m", "kvpage.engine.tp_rank", "--rank", str(r), "--tensor-parallel-size",
                       str(rv.size), "--master-addr", rv.addr, "--master-port", str(rv.port), "--threads",
                       str(per_rank), "--device", config.device, "--parent-pid", str(os.getpid())]  # fmt: skip
                ranks.procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL))
        group = _form_group(rv, config.device, ranks)
        group.broadcast(config)
    except BaseException:
        for p in ranks.procs:
            p.kill()
        ranks.stop()
        raise
    return group, ranks


def _form_group(rv: Rendezvous, device: str, ranks: Ranks) -> TPGroup:
    """The group, formed in a thread while the spawned ranks are watched: one that exits before
    joining (a bad option, an import error) fails the start now, not at the store's timeout."""
    box: dict = {}

    def form() -> None:
        try:
            box["group"] = TPGroup(0, rv.size, rv.addr, rv.port, device)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["error"] = e

    t = threading.Thread(target=form, name="kvpage-tp-rendezvous", daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.2)
        dead = ranks.dead()
        if t.is_alive() and dead:
            codes = [ranks.procs[r - 1].returncode for r in dead]
            raise RuntimeError(f"rank(s) {dead} of the tensor-parallel group exited (status {codes}) before "
                               "joining; their messages are above")  # fmt: skip
    if "error" in box:
        raise box["error"]
    return box["group"]


def watch_parent(parent_pid: int) -> None:
    """A spawned rank ends with the process that spawned it, however that one ended (a thread watches
    its pid, given on the command line so that a parent gone before the watch starts counts too;
    PR_SET_PDEATHSIG would fire when the spawning *thread* ends)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def torchrun_rendezvous(size: int) -> Rendezvous | None:
    """This process's place in a group torchrun launched (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), if
    it was launched so for a group of `size`; a WORLD_SIZE that is not `size` is refused."""
    env = os.environ
    if size == 1 or "RANK" not in env or "MASTER_ADDR" not in env:
        return None
    if int(env.get("WORLD_SIZE", "0")) != size:
        raise ValueError(f"WORLD_SIZE={env.get('WORLD_SIZE')} but --tensor-parallel-size {size}")
    return Rendezvous(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["RANK"]), size, False)


def launched_rank(tensor_parallel_size: int) -> Rendezvous | None:
    """Under torchrun, the rendezvous of a rank other than 0 (`kvpage serve` then serves steps, not HTTP)."""
    rv = torchrun_rendezvous(tensor_parallel_size)
    return rv if rv is not None and rv.rank > 0 else None
