"""A rank other than 0 of a tensor-parallel group: `kvpage tp-rank` (by hand, on another machine),
`python -m kvpage.engine.tp_rank` (spawned by rank 0: kvpage/distributed/launch.py) or `kvpage serve`
under torchrun.

    join rank 0 -> receive its EngineConfig -> build this rank's shard (builder.build_shard) -> serve steps
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

log = logging.getLogger("kvpage")


def serve_as_rank(rank: int, size: int, addr: str, port: int, device: str = "cpu",
                  timeout_s: float | None = None) -> int:  # fmt: skip
    """Join, take rank 0's config, build this rank's shard, serve its steps until told to stop."""
    # (torch and the engine are imported here, not at the top: `kvpage --help` builds this command's
    # parser from add_rank_args below, and a help or `kvpage estimate` should not wait a second for torch)
    from kvpage.distributed.group import TPGroup
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
    p.add_argument(
        "--tp-timeout",
        type=float,
        default=None,
        help="seconds a collective may wait (default: KVPAGE_TP_TIMEOUT_S, else 300; rank 0's own)",
    )
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)  # spawned: end with rank 0


def run_rank(a: argparse.Namespace) -> int:
    if not 0 < a.rank < a.tensor_parallel_size:
        raise ValueError(f"--rank must be in [1, {a.tensor_parallel_size}) (rank 0 is the engine: kvpage serve)")
    if a.parent_pid is not None:
        from kvpage.distributed.launch import watch_parent

        watch_parent(a.parent_pid)
    logging.basicConfig(level=logging.WARNING, format=f"[rank {a.rank}] %(levelname)s %(message)s")
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    try:
        return serve_as_rank(a.rank, a.tensor_parallel_size, a.master_addr, a.master_port, a.device, a.tp_timeout)
    except ValueError as e:  # a refusal rank 0 reports too (a head count the size does not divide, ...)
        log.error("stopped: %s", e)
        return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvpage tp-rank", description="one rank (not 0) of a tensor-parallel group")
    add_rank_args(p)
    return run_rank(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
