"""Command line options from dataclass fields declared with `kvpage.config.option`: the field gives the
option's name, default and help, so adding an option means adding one field (EngineConfig's, ServeOptions',
FleetOptions').

Read from a field's metadata: `help` (a field without one is no option), `flag` (default --field-name),
`aliases`, `type` (int, float, or a parser raising ValueError), `choices`, `metavar`, `action` ("append"),
and for a bool field, which is a switch away from its default, `opposite` (a flag setting it back).
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields


def add_options(g: argparse.ArgumentParser | argparse._ArgumentGroup, declared: type) -> None:
    """Every field of the dataclass `declared` that has a help, as an option of `g`, in field order."""
    for f in fields(declared):
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
        g.add_argument(*flags, dest=f.name, action=meta.get("action", "store"),
                       default=None if f.default is MISSING else f.default, type=convert, choices=meta.get("choices"),
                       metavar=meta.get("metavar"), help=meta["help"])  # fmt: skip


def _argparse_type(parse):
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = getattr(parse, "__name__", "value").strip("_").removeprefix("cli_")
    return convert
