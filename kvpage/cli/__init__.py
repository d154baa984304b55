"""The `kvpage` command line: demo, core-demo, generate, chat, serve, bench, estimate, tp-rank, blocks.

One module per group of commands, each declaring its commands' options beside what they run; parser.py
lists the commands. Errors are one line on stderr ("kvpage <command>: error: ...") and exit status 1;
usage errors exit 2.
"""

from __future__ import annotations

import sys

from kvpage.cli.engine import engine_kwargs as _engine_kwargs
from kvpage.cli.parser import build_parser
from kvpage.cli.serve import in_passing_thread as _in_passing_thread
from kvpage.cli.serve_options import app_kwargs as _app_kwargs

# the last three under the names tests import them by
__all__ = ["build_parser", "main", "_engine_kwargs", "_app_kwargs", "_in_passing_thread"]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, RuntimeError, OSError) as e:
        print(f"kvpage {args.command}: error: {e}", file=sys.stderr)
        return 1
