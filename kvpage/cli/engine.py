"""The engine's options (every EngineConfig field with a help) and the LLM a command builds from them."""

from __future__ import annotations

import argparse
from dataclasses import fields

from kvpage.cli.options import add_options
from kvpage.config import EngineConfig


def add_engine_options(p: argparse.ArgumentParser) -> None:
    add_options(p.add_argument_group("engine"), EngineConfig)


def engine_kwargs(args: argparse.Namespace) -> dict:
    kw = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if "help" in f.metadata}
    if kw["num_kv_blocks"] is not None:
        kw.pop("kv_cache_memory")  # the pool is sized in blocks
    return kw


def make_llm(args: argparse.Namespace):
    from kvpage import LLM

    llm = LLM(**engine_kwargs(args))
    cfg = llm.llm_engine.config
    if cfg.block_size_advice is not None:
        a = cfg.block_size_advice
        print(f"block_size auto: {cfg.block_size} for an average length of {a.average_length:.0f} tokens "
              f"(seed rule {a.seed_rule}; waste {a.best.waste:.1%}); {llm.cache_stats().total_blocks} blocks",
              flush=True)  # fmt: skip
    return llm
