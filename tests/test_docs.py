"""The README and docs/*.md as a newcomer meets them: every Python block runs, every `kvpage` command line
parses, the README stays short, and its links to docs/ lead somewhere.

A fenced block is ```python (run), ```bash (its `kvpage ...` lines parsed by the real CLI parser, never run)
or ```text (output, or anything not meant to run). The Python blocks run in one subprocess, each in a fresh
namespace, compiled under the Markdown file's own name and line numbers so a traceback points into the page.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = {"python", "bash", "text"}
HEADLINE = ("<!-- headline:start -->", "<!-- headline:end -->")  # benchmarks/headline.py writes between them
README_MAX_LINES = 260
PROSE_MAX_CHARS = 200


@dataclass(slots=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    out, lines = [], path.read_text().split("\n")
    start = None
    for i, line in enumerate(lines, 1):
        if not line.startswith("```"):
            continue
        if start is None:
            start, language = i, line[3:].strip()
        else:
            out.append(Block(path, start, language, "\n".join(lines[start:i - 1])))  # fmt: skip
            start = None
    assert start is None, f"{path.relative_to(ROOT)}:{start}: a fence never closed"
    return out


def prose(path: Path) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced blocks, tables and the generated headline table."""
    out, fenced, generated = [], False, False
    for i, line in enumerate(path.read_text().split("\n"), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif line.strip() in HEADLINE:
            generated = line.strip() == HEADLINE[0]
        elif not fenced and not generated and not line.startswith("|"):
            out.append((i, line))
    return out


ALL_BLOCKS = [b for page in PAGES for b in blocks(page)]

# Runs each block in a fresh namespace and reports, as JSON on its last line, the blocks that raised.
DRIVER = r"""
import gc, json, sys, time, traceback
failures, seconds = [], []
for path, line, text in json.loads(sys.stdin.read()):
    began = time.perf_counter()
    try:
        exec(compile("\n" * line + text, path, "exec"), {"__name__": "__main__"})
    except BaseException:
        failures.append([path, line, traceback.format_exc(limit=-3)])
    seconds.append(round(time.perf_counter() - began, 1))
    gc.collect()
print(json.dumps({"failures": failures, "seconds": seconds}))
"""


def test_every_fence_names_python_bash_or_text():
    assert ALL_BLOCKS, "no fenced blocks found"
    wrong = [f"{b.where}: ```{b.language}" for b in ALL_BLOCKS if b.language not in LANGUAGES]
    assert wrong == [], wrong


def test_every_python_block_runs():
    python = [b for b in ALL_BLOCKS if b.language == "python"]
    assert len(python) >= 10, len(python)
    payload = json.dumps([[str(b.path), b.line, b.text] for b in python])
    # One OpenMP thread: the blocks' speed is not under test, and on a machine busy with other work torch's
    # threads wait at every barrier for a descheduled sibling (the run took 6 minutes instead of 35 s).
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", DRIVER], input=payload, capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().split("\n")[-1])
    assert len(report["seconds"]) == len(python)
    failed = [f"{Path(p).relative_to(ROOT)}:{line}: {tb}" for p, line, tb in report["failures"]]
    assert failed == [], "\n".join(failed)


def kvpage_command_lines(block: Block) -> list[tuple[int, list[str]]]:
    """(line number, arguments after `kvpage`) of every command in a bash block that runs kvpage; continued
    lines (and quotes going on past a line) joined, leading VAR=value assignments and a trailing `&` dropped."""
    out, pending, at = [], "", 0
    for i, line in enumerate(block.text.split("\n"), block.line + 1):
        at = at or i  # where the command began
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        try:
            words, began = shlex.split(pending + line, comments=True), at
        except ValueError:  # a quoted argument going on past the end of the line
            pending += line + "\n"
            continue
        pending, at = "", 0
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
            words = words[1:]
        if words and words[0] in ("kvpage", ".venv/bin/kvpage"):
            out.append((began, words[1:-1] if words[-1] == "&" else words[1:]))
    return out


def test_every_kvpage_command_line_parses():
    from kvpage.cli import build_parser

    commands = [(f"{b.path.relative_to(ROOT)}:{at}", args)
                for b in ALL_BLOCKS if b.language == "bash" for at, args in kvpage_command_lines(b)]  # fmt: skip
    assert len(commands) >= 20, len(commands)
    refused = []
    for where, args in commands:
        try:
            build_parser().parse_args(args)  # parsed only: `kvpage serve` never starts
        except SystemExit as e:
            refused.append(f"{where}: kvpage {shlex.join(args)} (exit {e.code})")
    assert refused == [], refused


def test_the_readme_is_short_and_prose_lines_are_wrapped():
    readme = PAGES[0].read_text()
    assert len(readme.split("\n")) <= README_MAX_LINES
    assert readme.count(HEADLINE[0]) == 1 and readme.count(HEADLINE[1]) == 1
    assert readme.index(HEADLINE[0]) < readme.index(HEADLINE[1])
    long = [f"{page.relative_to(ROOT)}:{i} ({len(line)} characters)"
            for page in PAGES for i, line in prose(page) if len(line) > PROSE_MAX_CHARS]  # fmt: skip
    assert long == [], long


def test_every_docs_link_leads_to_a_page_and_every_page_is_linked_from_the_readme():
    readme = PAGES[0].read_text()
    linked = set(re.findall(r"\]\((docs/[^)#\s]+)", readme))
    missing = sorted(link for link in linked if not (ROOT / link).is_file())
    assert missing == [], missing
    pages = {f"docs/{p.name}" for p in PAGES[1:]}
    assert pages - linked == set(), "pages the README does not link"
    between = [f"{p.relative_to(ROOT)}: {link}" for p in PAGES[1:]
               for link in re.findall(r"\]\(([\w-]+\.md)", p.read_text())
               if not (p.parent / link).is_file()]  # fmt: skip
    assert between == [], between
