"""The `kvpage` command line."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from kvpage.demo import run_demo

    run_demo(model=args.model, dtype=args.dtype, max_tokens=args.max_tokens)
    return 0


def _core_demo(args: argparse.Namespace) -> int:
    from kvpage.core_demo import run_demo

    run_demo(block_size=args.block_size, num_blocks=args.num_blocks, seed=args.seed)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpage", description="kvpage: a paged-KV-cache LLM inference engine.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="answer a batch of chat prompts with the real model and show where the KV memory went",
        description="Answer six chat prompts that share one system prompt with the real model, then print "
        "the cache statistics: blocks used and shared, prefix-cache hit rate, waste, and what a cache "
        "pre-allocated to the maximum length would have reserved.",
    )
    demo.add_argument("--model", default="smollm2", help="model name or path (default smollm2)")
    demo.add_argument("--dtype", default="bfloat16", help="float32 or bfloat16 (default bfloat16)")
    demo.add_argument("--max-tokens", type=int, default=64, help="tokens per answer at most (default 64)")
    demo.set_defaults(func=_demo)

    core = sub.add_parser(
        "core-demo",
        help="show the block core on synthetic requests (no model)",
        description="Run the paged KV-cache core on synthetic requests that share a system prompt, "
        "fork one into parallel samples and finish some; print block tables, a pool map and statistics.",
    )
    core.add_argument("--block-size", type=int, default=8, help="token slots per block (default 8)")
    core.add_argument("--num-blocks", type=int, default=40, help="blocks in the pool (default 40)")
    core.add_argument("--seed", type=int, default=0, help="seed of the synthetic tokens (default 0)")
    core.set_defaults(func=_core_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, RuntimeError) as e:
        print(f"kvpage {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
