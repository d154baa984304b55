"""`kvpage serve`: the OpenAI API over one engine in this process (over a fleet: fleet.py; as a rank of a
tensor-parallel group under torchrun: that rank's steps), and `kvpage tp-rank`, a rank on another machine."""

from __future__ import annotations

import sys

from kvpage.cli.engine import add_engine_options, make_llm
from kvpage.cli.fleet import add_fleet_options, serve_fleet
from kvpage.cli.serve_options import add_serve_options, api_keys, app_kwargs


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI API (completions, chat, models) with /health and /metrics",
                       description="An OpenAI-compatible HTTP server: /v1/models, /v1/completions, "
                       "/v1/chat/completions (streaming too), /health, and Prometheus /metrics.")  # fmt: skip
    add_serve_options(p)
    add_fleet_options(p)
    add_engine_options(p)
    p.set_defaults(func=_serve)


def add_tp_rank(sub) -> None:
    p = sub.add_parser("tp-rank", help="one rank (1..N-1) of a tensor-parallel group whose rank 0 is `kvpage serve "
                       "--tensor-parallel-size N --master-addr A --master-port P` on another machine",
                       description="Joins rank 0 at --master-addr:--master-port, receives its engine config, "
                       "loads this rank's shard of the model and KV cache, and executes every step rank 0 "
                       "broadcasts until rank 0 stops. (Ranks on rank 0's own machine are spawned by it.)")  # fmt: skip
    from kvpage.engine.tp_rank import add_rank_args, run_rank

    add_rank_args(p)
    p.set_defaults(func=run_rank)


def _serve(args) -> int:
    keys = api_keys(args)
    if args.max_prompts_per_request < 1:
        raise ValueError("--max-prompts-per-request must be at least 1")
    if args.replicas is not None:
        return serve_fleet(args, keys)
    from kvpage.distributed.launch import launched_rank
    from kvpage.engine.tp_rank import serve_as_rank

    rank = launched_rank(args.tensor_parallel_size)
    if rank is not None:  # torchrun started this process as a rank other than 0: it serves rank 0's steps
        return serve_as_rank(rank.rank, rank.size, rank.addr, rank.port, args.device)
    llm = in_passing_thread(lambda: make_llm(args))
    try:
        return _serve_engine(args, llm, keys)
    finally:
        llm.close()  # a tensor-parallel group's other ranks, by pid


def _serve_engine(args, llm, keys: list[str]) -> int:
    from kvpage.server.app import build_app
    from kvpage.server.serve import serve

    app = build_app(llm.llm_engine, **app_kwargs(args, keys))
    engine = llm.llm_engine
    auth = f"{len(keys)} API key(s) required" if keys else "no API key"
    if args.salt_cache_per_key:
        auth += ", prefix cache salted per key"
    print(f"kvpage serve: {args.model} on http://{args.host}:{args.port} ({auth}); dtype {engine.dtype_name} "
          f"({engine.dtype_reason}); {engine.kernels}", flush=True)  # fmt: skip
    if engine.kv_pool_note:
        print(f"kvpage serve: {engine.kv_pool_note}", flush=True)
    key_hint = "?api_key=KEY" if keys else ""
    print(f"kvpage serve: the KV cache, live: http://{args.host}:{args.port}{args.root_path}/dashboard{key_hint}",
          flush=True)  # fmt: skip
    status = serve(app, host=args.host, port=args.port, log_level=args.log_level, root_path=args.root_path)
    if status:
        print(f"kvpage serve: error: the engine stopped: {app.fastapi.state.async_engine.error!r}", file=sys.stderr)
    return status


def in_passing_thread(fn):
    """fn() run in a thread that exits when it returns: the server's model is loaded there.

    libgomp (torch's OpenMP) gives every thread that starts parallel work its own pool of workers, and
    once it manages more threads than there are CPUs it spins only ~100 times before sleeping at each
    barrier, so every parallel region pays a wake-up. The engine steps in its own thread; loading the
    model in the main thread would leave a second pool behind it for good (on 2 cores one decode step
    of SmolLM2 in bfloat16 went from ~18 to ~22 ms). A thread that exits takes its pool with it."""
    import threading

    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name="kvpage-load", daemon=True)  # Ctrl-C while loading still exits
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
