"""`kvpage demo` (the real model on six chat prompts) and `kvpage core-demo` (the block core, no model)."""

from __future__ import annotations


def add_demo(sub) -> None:
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


def add_core_demo(sub) -> None:
    p = sub.add_parser("core-demo", help="show the block core on synthetic requests (no model)",
                       description="Run the paged KV-cache core on synthetic requests that share a system prompt, "
                       "fork one into parallel samples and finish some; print block tables, a pool map and "
                       "statistics.")  # fmt: skip
    p.add_argument("--block-size", type=int, default=8, help="token slots per block (default 8)")
    p.add_argument("--num-blocks", type=int, default=40, help="blocks in the pool (default 40)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic tokens (default 0)")
    p.set_defaults(func=_core_demo)


def _demo(args) -> int:
    from kvpage.demo import run_demo

    run_demo(model=args.model, dtype=args.dtype, max_tokens=args.max_tokens, deterministic=args.deterministic)
    return 0


def _core_demo(args) -> int:
    from kvpage.core_demo import run_demo

    run_demo(block_size=args.block_size, num_blocks=args.num_blocks, seed=args.seed)
    return 0
