"""`kvpage`'s parser: its commands in the order `kvpage --help` lists them, each added by its own module."""

from __future__ import annotations

import argparse

from kvpage.cli import bench, demos, generate, serve, sizing

COMMANDS = (demos.add_demo, demos.add_core_demo, generate.add_generate, generate.add_chat, serve.add_serve,
            bench.add_bench, sizing.add_estimate, serve.add_tp_rank, sizing.add_blocks)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpage", description="kvpage: an LLM inference engine with a paged KV cache."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser
