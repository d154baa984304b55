"""The `kvpage` command line: demo, core-demo, generate, chat, serve, bench, estimate, blocks.

Errors are one line on stderr ("kvpage <command>: error: ...") and exit status 1; usage errors exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def _engine_args(p: argparse.ArgumentParser) -> None:
    """Every EngineConfig field as an option: its name, default and help come from the config."""
    from dataclasses import MISSING, fields

    from kvpage.config import EngineConfig

    g = p.add_argument_group("engine")
    for f in fields(EngineConfig):
        meta = f.metadata
        if "help" not in meta:
            continue
        flags = [meta.get("flag", "--" + f.name.replace("_", "-")), *meta.get("aliases", ())]
        if isinstance(f.default, bool):
            action = "store_false" if f.default else "store_true"
            g.add_argument(*flags, dest=f.name, action=action, default=f.default, help=meta["help"])
            if "opposite" in meta:
                g.add_argument(meta["opposite"], dest=f.name, action="store_true" if f.default else "store_false",
                               help=f"(the default; {flags[0]} undoes it)")  # fmt: skip
            continue
        kind = meta.get("type")
        convert = kind if kind in (int, float, None) else _argparse_type(kind)  # argparse's own messages for numbers
        g.add_argument(*flags, dest=f.name, default=None if f.default is MISSING else f.default, type=convert,
                       choices=meta.get("choices"), metavar=meta.get("metavar"), help=meta["help"])  # fmt: skip


def _argparse_type(parse):
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = getattr(parse, "__name__", "value").strip("_").removeprefix("cli_")
    return convert


def _make_llm(args: argparse.Namespace):
    from kvpage import LLM

    llm = LLM(**_engine_kwargs(args))
    cfg = llm.llm_engine.config
    if cfg.block_size_advice is not None:
        a = cfg.block_size_advice
        print(f"block_size auto: {cfg.block_size} for an average length of {a.average_length:.0f} tokens "
              f"(seed rule {a.seed_rule}; waste {a.best.waste:.1%}); {llm.cache_stats().total_blocks} blocks",
              flush=True)  # fmt: skip
    return llm


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens per completion at most (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1.0)")
    g.add_argument("--top-k", type=int, default=0, help="0 turns top-k off (default 0)")
    g.add_argument("-n", type=int, default=1, help="completions per prompt (default 1)")
    g.add_argument("--sampling-seed", type=int, default=None, help="seed of the sampling (default: none)")


def _sampling(args):
    from kvpage import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, n=args.n, seed=args.sampling_seed)  # fmt: skip


def _print_stats(st, out=sys.stdout) -> None:
    print(f"cache: {st.used_blocks}/{st.total_blocks} blocks used, {st.shared_blocks} shared, "
          f"{st.cached_blocks} cached, waste {st.waste:.1%}, prefix hits {st.prefix_hit_tokens}/"
          f"{st.prefix_query_tokens} tokens ({st.prefix_hit_rate:.0%})", file=out)  # fmt: skip


# ---------------------------------------------------------------------- commands
def _demo(args) -> int:
    from kvpage.demo import run_demo

    run_demo(model=args.model, dtype=args.dtype, max_tokens=args.max_tokens, deterministic=args.deterministic)
    return 0


def _core_demo(args) -> int:
    from kvpage.core_demo import run_demo

    run_demo(block_size=args.block_size, num_blocks=args.num_blocks, seed=args.seed)
    return 0


def _generate(args) -> int:
    prompts = list(args.prompts)
    if args.file:
        prompts += [line for line in Path(args.file).read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError("give prompts as arguments or with --file")
    params = _sampling(args)
    llm = _make_llm(args)
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=len(prompts) > 1)
    else:
        outs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    for p, out in zip(prompts, outs, strict=True):
        print(f"=== {p}")
        if out.error:
            print(f"(failed: {out.error})")
        for c in out.outputs:
            label = f"[{c.index}] " if len(out.outputs) > 1 else ""
            print(f"{label}{c.text}  ({len(c.token_ids)} tokens, {c.finish_reason})")
    _print_stats(llm.cache_stats())
    return 0


def _chat(args) -> int:
    from kvpage import SamplingParams

    llm = _make_llm(args)
    engine, tok = llm.llm_engine, llm.get_tokenizer()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("kvpage chat: type a message; /stats shows the cache, /reset starts over, /exit or Ctrl-D quits")
    turn = 0
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            print()
            return 0
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/stats":
            _print_stats(llm.cache_stats())
            continue
        if line == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": line})
        rid = f"chat-{turn}"
        turn += 1
        engine.add_request(rid, tok.encode_chat(history), params)
        print("assistant> ", end="", flush=True)
        shown, text = 0, ""
        while engine.has_unfinished_requests():
            for out in engine.step():
                text = out.outputs[0].text
                print(text[shown:], end="", flush=True)
                shown = len(text)
        print()
        history.append({"role": "assistant", "content": text})


def _engine_kwargs(args: argparse.Namespace) -> dict:
    from dataclasses import fields

    from kvpage.config import EngineConfig

    kw = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if "help" in f.metadata}
    if kw["num_kv_blocks"] is not None:
        kw.pop("kv_cache_memory")  # the pool is sized in blocks
    return kw


def _app_kwargs(args: argparse.Namespace, keys: list[str]) -> dict:
    """build_app's options from `kvpage serve`'s (one server or a fleet's ingress)."""
    return dict(served_model_name=args.served_model_name or args.model, api_key=keys or None,
                max_body_bytes=args.max_body_bytes, body_timeout=args.body_timeout,
                max_prompts_per_request=args.max_prompts_per_request, salt_cache_per_key=args.salt_cache_per_key,
                force_include_usage=args.enable_force_include_usage, metrics_prefix=args.metrics_prefix,
                return_tokens_as_token_ids=args.return_tokens_as_token_ids)  # fmt: skip


def _serve_fleet(args, keys: list[str]) -> int:
    """`kvpage serve --replicas N`: N engines on Ray Serve behind --router (kvpage/fleet/ray_app.py)."""
    import signal
    import threading

    from kvpage.fleet.ray_app import Fleet, FleetSpec

    if args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
    spec = FleetSpec(_engine_kwargs(args), args.replicas, args.router, args.host, args.port,
                     events=not args.no_kv_events, app_kwargs=_app_kwargs(args, keys),
                     root_path=args.root_path)  # fmt: skip
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    fleet = Fleet(spec, ray_address=args.ray_address)
    try:
        where = args.ray_address or "a local Ray cluster"
        print(f"kvpage serve: {args.model} x {args.replicas} replicas on {where}, router {args.router}, "
              f"on http://{args.host}:{args.port}", flush=True)  # fmt: skip
        stop.wait()
    finally:
        fleet.stop()
    return 0


def _serve(args) -> int:
    keys = list(args.api_key or [])
    env_key = os.environ.get("KVPAGE_API_KEY")
    if env_key is not None:
        keys.append(env_key)
    if any(not k for k in keys):
        raise ValueError("--api-key / KVPAGE_API_KEY must not be empty (leave both unset to serve without a key)")
    if args.salt_cache_per_key and not keys:
        raise ValueError("--salt-cache-per-key needs --api-key: without keys every client is the same tenant")
    if args.max_prompts_per_request < 1:
        raise ValueError("--max-prompts-per-request must be at least 1")
    if args.replicas is not None:
        return _serve_fleet(args, keys)
    from kvpage.distributed.launch import launched_rank
    from kvpage.engine.tp_rank import serve_as_rank

    rank = launched_rank(args.tensor_parallel_size)
    if rank is not None:  # torchrun started this process as a rank other than 0: it serves rank 0's steps
        return serve_as_rank(rank.rank, rank.size, rank.addr, rank.port, args.device)
    llm = _in_passing_thread(lambda: _make_llm(args))
    try:
        return _serve_engine(args, llm, keys)
    finally:
        llm.close()  # a tensor-parallel group's other ranks, by pid


def _serve_engine(args, llm, keys: list[str]) -> int:
    from kvpage.server.app import build_app
    from kvpage.server.serve import serve

    app = build_app(llm.llm_engine, **_app_kwargs(args, keys))
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


def _in_passing_thread(fn):
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


def _bench(args) -> int:
    if args.suite:
        from kvpage.tools.bench_suite import run_suite

        return run_suite(args.suite, quick=args.quick, smoke=args.smoke, no_results=args.no_results)
    from kvpage.tools.bench import run_bench

    result = run_bench(_make_llm(args), num_requests=args.num_requests, input_len=args.input_len,
                       output_len=args.output_len, jsonl=args.jsonl, seed=args.seed)  # fmt: skip
    print(result.table())
    if args.output:
        Path(args.output).write_text(json.dumps(result.as_dict(), indent=2))
        print(f"wrote {args.output}")
    return 0


def _estimate(args) -> int:
    from kvpage.tools.kv_estimate import fit_report, report, resolve_shape

    if args.batch < 1 or args.max_len < 1 or args.block_size < 1:
        raise ValueError("--batch, --max-len and --block-size must be positive")
    if args.lengths:
        try:
            lens = [int(x) for x in args.lengths.split(",")]
        except ValueError:
            raise ValueError(f"--lengths takes comma-separated integers, got {args.lengths!r}") from None
    else:
        lens = [args.actual_len or max(1, args.max_len // 2)] * args.batch
    shape = resolve_shape(args.model).per_rank(args.tensor_parallel_size)
    print(report(shape, args.block_size, args.batch, args.max_len, lens))
    if args.gpu_memory is not None:
        print()
        print(fit_report(shape, args.gpu_memory, args.gpu_memory_utilization, args.reserve, args.batch, args.max_len,
                         args.block_size))  # fmt: skip
    return 0


def _blocks(args) -> int:
    from kvpage.core.block_advisor import BLOCK_COST, advise, parse_histogram, read_lengths

    if bool(args.lengths_file) == bool(args.histogram):
        raise ValueError("give exactly one of --lengths-file and --histogram")
    hist = read_lengths(Path(args.lengths_file)) if args.lengths_file else parse_histogram(args.histogram)
    shared_count = args.shared_count if args.shared_count is not None else sum(hist.values())
    cost = BLOCK_COST if args.block_cost is None else args.block_cost
    a = advise(hist, args.min_block_size, args.max_block_size, block_cost=cost, shared_prefix=args.shared_prefix,
               shared_count=shared_count if args.shared_prefix else 0)  # fmt: skip
    print(f"{sum(hist.values())} sequences, average length {a.average_length:.1f} tokens")
    print(
        "| block size | blocks | slots | waste | slots shared | cost (slots + per-block) |\n|---|---|---|---|---|---|"
    )
    for c in a.table:
        print(f"| {c.block_size} | {c.blocks} | {c.slots} | {c.waste:.1%} | {c.shared_slots} | {c.cost:.0f} |")
    rule_choice = next((c for c in a.table if c.block_size == a.seed_rule), None)
    rule_waste = f", waste {rule_choice.waste:.1%}" if rule_choice else ""
    print(f"seed documents' rule max(64, 2^floor(log2(avg/4))): block_size = {a.seed_rule}{rule_waste}")
    print(f"least cost with block_size in [{a.min_block_size}, {a.max_block_size}] (waste + {a.block_cost:g} slots "
          f"per block - shared prefix): block_size = {a.best.block_size}, waste {a.best.waste:.1%}")  # fmt: skip
    print(f"blocks to pre-allocate for these sequences at block_size {a.best.block_size}: {a.best.blocks}")
    return 0


# ---------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpage", description="kvpage: an LLM inference engine with a paged KV cache."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("demo", help="answer chat prompts with the real model and show where the KV memory went",
                       description="Answer six chat prompts that share one system prompt with the real model, then "
                       "print the cache statistics: blocks used and shared, prefix-cache hit rate, waste, and what a "
                       "cache pre-allocated to the maximum length would have reserved.")  # fmt: skip
    p.add_argument("--model", default="smollm2", help="model name or path (default smollm2)")
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto, float32 or bfloat16 (default auto: bfloat16 where the CPU computes it natively, else float32)",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per answer at most (default 64)")
    p.add_argument("--deterministic", action="store_true", help="the batch-invariant kernels (see kvpage serve -h)")
    p.set_defaults(func=_demo)

    p = sub.add_parser("core-demo", help="show the block core on synthetic requests (no model)",
                       description="Run the paged KV-cache core on synthetic requests that share a system prompt, "
                       "fork one into parallel samples and finish some; print block tables, a pool map and "
                       "statistics.")  # fmt: skip
    p.add_argument("--block-size", type=int, default=8, help="token slots per block (default 8)")
    p.add_argument("--num-blocks", type=int, default=40, help="blocks in the pool (default 40)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic tokens (default 0)")
    p.set_defaults(func=_core_demo)

    p = sub.add_parser("generate", help="complete prompts and print the cache statistics",
                       description="Complete prompts given as arguments or in a file (one per line), "
                       "print the completions and the KV-cache statistics.")  # fmt: skip
    p.add_argument("prompts", nargs="*", help="prompts to complete")
    p.add_argument("--file", help="a text file with one prompt per line")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    _sampling_args(p)
    _engine_args(p)
    p.set_defaults(func=_generate)

    p = sub.add_parser("chat", help="chat interactively, streaming; /stats shows the cache",
                       description="An interactive chat with the model's chat template, streamed token by token. "
                       "Commands: /stats (cache statistics), /reset (forget the conversation), /exit.")  # fmt: skip
    p.add_argument("--system", default=None, help="a system prompt")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per answer at most (default 256)")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling (default 0.95)")
    _engine_args(p)
    p.set_defaults(func=_chat)

    p = sub.add_parser("serve", help="serve the OpenAI API (completions, chat, models) with /health and /metrics",
                       description="An OpenAI-compatible HTTP server: /v1/models, /v1/completions, "
                       "/v1/chat/completions (streaming too), /health, and Prometheus /metrics.")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every path but /health; repeat for several "
                   "clients' keys (also KVPAGE_API_KEY); an empty key is refused")  # fmt: skip
    p.add_argument("--salt-cache-per-key", action="store_true",
                   help="keep each API key's prefix cache apart, so no client can tell from /metrics or "
                   "timing what another client's prompts began with")  # fmt: skip
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: --model)")
    p.add_argument("--root-path", default="", metavar="PATH",
                   help="served under this path prefix by a proxy that strips it (vLLM's --root-path); "
                   "the OpenAPI document names it")  # fmt: skip
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help='logprobs name each token "token_id:N" instead of its text (vLLM\'s; a request may '
                   "say otherwise)")  # fmt: skip
    p.add_argument(
        "--metrics-prefix",
        choices=["kvpage", "vllm"],
        default="kvpage",
        help="name /metrics' families kvpage:* (default) or vllm:*, for a vLLM dashboard as it is",
    )
    p.add_argument("--enable-force-include-usage", action="store_true",
                   help="every stream ends with a usage chunk, asked for or not (vLLM's flag)")  # fmt: skip
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request body may take to arrive, else 408 (default 30)")  # fmt: skip
    p.add_argument("--max-prompts-per-request", type=int, default=256,
                   help="most prompts in one /v1/completions request (default 256)")  # fmt: skip
    p.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")
    g = p.add_argument_group("fleet (Ray Serve)")
    g.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="N",
        help="serve from N engine replicas on Ray Serve (a local Ray cluster, unless --ray-address)",
    )
    g.add_argument("--router", default="kv", choices=["kv", "round_robin", "pow2", "ray_prefix"],
                   help="how the fleet routes: kv (by the blocks each replica holds, from its KV events; the "
                   "default), round_robin, pow2 (Ray Serve's default) or ray_prefix (Ray Serve LLM's "
                   "PrefixCacheAffinityRouter)")  # fmt: skip
    g.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="join this Ray cluster (e.g. auto, or HOST:6379) instead of starting one",
    )
    g.add_argument(
        "--no-kv-events",
        action="store_true",
        help="replicas publish no KV events (the kv router then trusts none and falls back)",
    )
    _engine_args(p)
    p.set_defaults(func=_serve)

    p = sub.add_parser("bench", help="offline throughput on a seeded synthetic workload or a JSONL of prompts",
                       description="Measure offline throughput: a seeded synthetic workload (random prompt "
                       "tokens, greedy, ignore_eos) or prompts from a JSONL file; prints a table and can write "
                       "JSON. With --suite: the seed documents' claims re-measured by the scripts in benchmarks/ "
                       "(JSON and PNG in benchmarks/results/, sections of benchmarks/RESULTS.md, the README's "
                       "headline table).")  # fmt: skip
    from kvpage.tools.bench_suite import SUITE

    p.add_argument("--suite", nargs="+", default=None, metavar="NAME",
                   help=f"run suite benchmarks instead: all, or any of {', '.join(SUITE)}")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="with --suite: smaller runs, a few minutes in all")
    p.add_argument("--smoke", action="store_true", help="with --suite: the tiniest runs (what the tests run)")
    p.add_argument("--no-results", action="store_true", help="with --suite: do not write RESULTS.md or README")
    p.add_argument("--num-requests", type=int, default=64, help="synthetic requests (default 64)")
    p.add_argument("--input-len", default="32:512", help="prompt length range LOW:HIGH (default 32:512)")
    p.add_argument("--output-len", default="32:256", help="output length range LOW:HIGH (default 32:256)")
    p.add_argument("--jsonl", default=None, help='JSONL with {"prompt": ..., "max_tokens": ...} per line')
    p.add_argument("--output", default=None, help="write the results as JSON here")
    _engine_args(p)
    p.set_defaults(func=_bench)

    p = sub.add_parser("estimate", help="KV-cache memory: per token, per block, pre-allocated vs paged, every dtype",
                       description="The KV memory formula, bytes = 2 x layers x kv_heads x head_dim x "
                       "bytes_per_element x tokens, for a model (preset, config.json, directory or GGUF): per token, "
                       "per block, and for a batch pre-allocated to the maximum length versus paged at the actual "
                       "lengths, for every KV dtype.")  # fmt: skip
    p.add_argument("--model", default="smollm2", help="llama-2-7b, llama-2-13b, llama-2-70b, llama-3-8b, "
                   "gpt-3-175b, a config.json, a directory, a .gguf or smollm2 (default)")  # fmt: skip
    p.add_argument("--batch", type=int, default=8, help="sequences (default 8)")
    p.add_argument("--max-len", type=int, default=2048, help="length each is pre-allocated for (default 2048)")
    p.add_argument("--actual-len", type=int, default=None, help="actual length of every sequence (default max-len/2)")
    p.add_argument("--lengths", default=None, help="actual lengths, comma-separated (instead of --actual-len)")
    p.add_argument("--block-size", type=int, default=16, help="block size of the paged cache (default 16)")
    p.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                   help="a GPU's memory in GiB: also the weights per weight dtype and how many sequences of --max-len "
                   "fit beside them (e.g. 80)")  # fmt: skip
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="share of it to use (default 0.9)")
    p.add_argument("--reserve", type=float, default=1.0, metavar="GIB",
                   help="GiB kept for activations and the runtime (default 1)")  # fmt: skip
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        metavar="N",
        help="answer per rank of a tensor-parallel group of N: its heads' KV, its weights (default 1)",
    )
    p.set_defaults(func=_estimate)

    p = sub.add_parser("tp-rank", help="one rank (1..N-1) of a tensor-parallel group whose rank 0 is `kvpage serve "
                       "--tensor-parallel-size N --master-addr A --master-port P` on another machine",
                       description="Joins rank 0 at --master-addr:--master-port, receives its engine config, "
                       "loads this rank's shard of the model and KV cache, and executes every step rank 0 "
                       "broadcasts until rank 0 stops. (Ranks on rank 0's own machine are spawned by it.)")  # fmt: skip
    from kvpage.engine.tp_rank import add_rank_args, run_rank

    add_rank_args(p)
    p.set_defaults(func=run_rank)

    p = sub.add_parser("blocks", help="block-size advice from observed sequence lengths",
                       description="From a JSONL of request lengths or a histogram: the seed documents' rule "
                       "max(64, 2^floor(log2(avg/4))) next to the block size with the least cost (empty slots of "
                       "each last block, unshared prefix tail, and a per-block cost), and the blocks to "
                       "pre-allocate.")  # fmt: skip
    p.add_argument("--lengths-file", default=None, help='JSONL: a number, or {"length": N}, per line')
    p.add_argument("--histogram", default=None, help="LENGTH:COUNT,LENGTH:COUNT,...")
    p.add_argument(
        "--min-block-size",
        type=int,
        default=64,
        help="smallest block size to choose (default 64, the seed documents' range 64-256)",
    )
    p.add_argument(
        "--block-cost",
        type=float,
        default=None,
        help="what one block's management costs, in token slots (default: the measured BLOCK_COST)",
    )
    p.add_argument("--shared-prefix", type=int, default=0, help="tokens of a prefix common to the sequences")
    p.add_argument("--shared-count", type=int, default=None, help="sequences that share it (default: all)")
    p.add_argument("--max-block-size", type=int, default=256, help="largest block size (default 256)")
    p.set_defaults(func=_blocks)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, RuntimeError, OSError) as e:
        print(f"kvpage {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
