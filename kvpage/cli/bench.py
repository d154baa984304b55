"""`kvpage bench`: offline throughput on a seeded synthetic workload or a JSONL of prompts, or with --suite
the benchmarks/ scripts that re-measure the seed documents' claims."""

from __future__ import annotations

import json
from pathlib import Path

from kvpage.cli.engine import add_engine_options, make_llm


def add_bench(sub) -> None:
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
    add_engine_options(p)
    p.set_defaults(func=_bench)


def _bench(args) -> int:
    if args.suite:
        from kvpage.tools.bench_suite import run_suite

        return run_suite(args.suite, quick=args.quick, smoke=args.smoke, no_results=args.no_results)
    from kvpage.tools.bench import run_bench

    result = run_bench(make_llm(args), num_requests=args.num_requests, input_len=args.input_len,
                       output_len=args.output_len, jsonl=args.jsonl, seed=args.seed)  # fmt: skip
    print(result.table())
    if args.output:
        Path(args.output).write_text(json.dumps(result.as_dict(), indent=2))
        print(f"wrote {args.output}")
    return 0
