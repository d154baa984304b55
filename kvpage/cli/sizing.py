"""`kvpage estimate` (KV memory per token, per block, pre-allocated vs paged, and what fits a GPU) and
`kvpage blocks` (block-size advice from observed lengths): arithmetic only, no model is loaded."""

from __future__ import annotations

from pathlib import Path


def add_estimate(sub) -> None:
    p = sub.add_parser("estimate", help="KV-cache memory: per token, per block, pre-allocated vs paged, every dtype",
                       description="The KV memory formula, bytes = 2 x layers x kv_heads x head_dim x "
                       "bytes_per_element x tokens, for a model (preset, config.json, directory or GGUF): per token, "
                       "per block, and for a batch pre-allocated to the maximum length versus paged at the actual "
                       "lengths, for every KV dtype.")  # fmt: skip
    p.add_argument("--model", default="smollm2", help="llama-2-7b, llama-2-13b, llama-2-70b, llama-3-8b, "
                   "gpt-3-175b, gemma-3-27b, mistral-small-24b, mistral-7b, gpt-oss-20b, llama-4-scout, qwen3-32b, "
                   "a config.json, a directory, a .gguf or smollm2 (default)")  # fmt: skip
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


def add_blocks(sub) -> None:
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


def _estimate(args) -> int:
    from kvpage.core.kv_spec import FULL
    from kvpage.tools.kv_estimate import fit_report, group_report, report, resolve_shape

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
    if any(s is not FULL for s in shape.specs):  # layers that read a window or chunks: what each group holds
        print()
        print(group_report(shape, args.block_size, sorted({1024, 8192, 32768, args.max_len})))
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
