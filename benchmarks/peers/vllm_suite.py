"""Runs vLLM's own OpenAI-server tests against `kvpage serve`: by default the structured-output and tool tests that
do not hang on one model's taste (vLLM 0.10.0's tests/entrypoints/openai/test_chat.py and test_completion.py:
guided_json / regex / choice / grammar, their 400s, response_format, named / required tool_choice and its 400s;
tests/tool_use/test_chat_completion_request_validations.py), unmodified, through a shim:

* tests/utils.py is replaced: its RemoteOpenAIServer starts `kvpage serve` (SmolLM2-135M-Instruct, float32,
  127.0.0.1, a free port, --served-model-name the model the test names, --tool-call-parser hermes unless the
  test names another that kvpage has) instead of `vllm serve`, maps the vLLM flags kvpage has and ignores (logs)
  the rest; one server at a time, each under `timeout 3000`, stopped by its pid;
* tests/conftest.py is replaced: no network (the LoRA fixtures' snapshot_download gives an empty folder,
  AutoTokenizer.from_pretrained of a hub id gives the served model's tokenizer), LoRA / prompt-adapter
  parametrisations and tests of vLLM's internals deselected;
* a stub `vllm` package holds only what collection needs: get_tokenizer (SmolLM2's tokenizer as transformers'
  fast tokenizer, built from kvpage's GGUF as kvpage/structured/grammars.py builds it), current_platform, a
  version, and protocol.ChatCompletionRequest, which is kvpage's own request model (kvpage.server.protocol:
  the one `kvpage serve` validates every chat body with), so the request-validation tests check kvpage's.

    python benchmarks/peers/vllm_suite.py [--work DIR] [--timeout 180] [-- PYTEST_ARGS...]

PYTEST_ARGS are passed on (e.g. `-- -k guided`); if they name tests (a path under tests/ or a node id) those run
instead of the default selection. The exit code is pytest's. Downloads vLLM's sdist (~9 MB, it holds tests/) once
from the package index pip uses ($PIP_INDEX_URL, else pip's default), checking its sha256, into $KVPAGE_PEERS_DIR
(default ~/.cache/kvpage/peers). Writes into --work (default $KVPAGE_PEERS_DIR/vllm-suite): venv/ (a venv that
reuses this interpreter's site-packages through a .pth, plus `pip install --no-deps` of pytest-asyncio,
pytest-timeout, lark where missing), run/ (the tests, the shim, stubs/, pytest.ini; laid anew each run) and
logs/ (junit.xml, pytest.log, summary.md, server-NN.log and servers.jsonl: each server's vLLM arguments, the
kvpage command and the arguments ignored). Run it with the interpreter kvpage is installed in (.venv/bin/python).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import html
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import sysconfig
import tarfile
import threading
import time
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VLLM_VERSION = "0.10.0"
MODEL = "smollm2"

# vLLM's structured-output and tool tests whose verdict is kvpage's, not one model's (node ids; the server
# fixtures' parameters run each of them 2x, the guided_decoding_backend parameter 3x)
DEFAULT_SELECTION = [
    *(f"tests/entrypoints/openai/test_chat.py::{t}" for t in (
        "test_guided_choice_chat", "test_guided_json_chat", "test_guided_regex_chat",
        "test_guided_decoding_type_error", "test_guided_choice_chat_logprobs", "test_named_tool_use",
        "test_required_tool_use", "test_inconsistent_tool_choice_and_tools", "test_response_format_json_object",
        "test_response_format_json_schema")),
    *(f"tests/entrypoints/openai/test_completion.py::{t}" for t in (
        "test_guided_json_completion", "test_guided_regex_completion", "test_guided_choice_completion",
        "test_guided_grammar", "test_guided_decoding_type_error")),
    "tests/tool_use/test_chat_completion_request_validations.py",
]  # fmt: skip
# module -> the distribution that brings it, installed into the runner's venv where the kvpage venv lacks it
RUNNER_PACKAGES = {"pytest_asyncio": "pytest-asyncio", "pytest_timeout": "pytest-timeout", "lark": "lark",
                   "jsonschema": "jsonschema", "regex": "regex"}  # fmt: skip


# ---------------------------------------------------------------------------------------------------- the sources
def peers_dir() -> Path:
    return Path(os.environ.get("KVPAGE_PEERS_DIR") or Path.home() / ".cache" / "kvpage" / "peers")


def index_url() -> str:
    """The simple index pip reads: $PIP_INDEX_URL, else pip's default."""
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"].rstrip("/")
    from pip._internal.models.index import PyPI

    return PyPI.simple_url.rstrip("/")


def _open(url: str):
    ctx = ssl.create_default_context(cafile=os.environ.get("PIP_CERT") or None)
    req = urllib.request.Request(url, headers={"Accept": "text/html", "User-Agent": "kvpage-vllm-suite"})
    return urllib.request.urlopen(req, timeout=120, context=ctx)


def vllm_sdist(version: str) -> Path:
    """vLLM `version`'s sdist, downloaded once (its sha256 checked against the index's). `pip download` cannot
    fetch it (it builds the metadata, which needs CUDA tooling), so the index page is read directly."""
    base = peers_dir()
    dest = base / f"vllm-{version}.tar.gz"
    if dest.exists():
        return dest
    base.mkdir(parents=True, exist_ok=True)
    page_url = f"{index_url()}/vllm/"
    with _open(page_url) as r:
        page = r.read().decode("utf-8", "replace")
    links = re.findall(r'href="([^"]*vllm-' + re.escape(version) + r'\.tar\.gz[^"]*)"', page)
    if not links:
        raise SystemExit(f"no vllm-{version}.tar.gz on {page_url}")
    url = urllib.parse.urljoin(page_url, html.unescape(links[0]))
    want = urllib.parse.urlsplit(url).fragment.partition("sha256=")[2]
    if not want:
        raise SystemExit(f"the index gives no sha256 for {url}")
    print(f"downloading vllm-{version}.tar.gz into {base}", flush=True)
    part = dest.with_suffix(".part")
    digest = hashlib.sha256()
    with _open(url.split("#")[0]) as r, open(part, "wb") as f:
        while chunk := r.read(1 << 20):
            digest.update(chunk)
            f.write(chunk)
    if digest.hexdigest() != want:
        part.unlink()
        raise SystemExit(f"vllm-{version}.tar.gz: sha256 {digest.hexdigest()}, the index says {want}")
    part.rename(dest)
    return dest


def vllm_tests(version: str) -> Path:
    """The sdist's tests/ (and pyproject.toml), extracted once beside it; read-only for the runs."""
    src = peers_dir() / f"vllm-{version}"
    if not (src / "tests" / "utils.py").exists():
        tarball = vllm_sdist(version)
        tmp = src.with_name(src.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        prefix = f"vllm-{version}/"
        with tarfile.open(tarball) as tar:
            members = [m for m in tar.getmembers()
                       if m.name.startswith(prefix + "tests/") or m.name == prefix + "pyproject.toml"]  # fmt: skip
            tar.extractall(tmp, members=members, filter="data")
        shutil.rmtree(src, ignore_errors=True)
        (tmp / f"vllm-{version}").rename(src)
        tmp.rmdir()
    return src


# ----------------------------------------------------------------------------------------------- the runner venv
def runner_venv(work: Path) -> Path:
    """A venv whose .pth adds this interpreter's site-packages (kvpage, torch, transformers, openai, pytest) after
    its own, holding only what that lacks (by name, --no-deps). Its python."""
    venv = work / "venv"
    py = venv / "bin" / "python"
    if not py.exists():
        base = getattr(sys, "_base_executable", None) or sys.executable
        subprocess.run([base, "-m", "venv", str(venv)], check=True)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    ours = sysconfig.get_paths()["purelib"]
    # (addsitedir, not a bare path line: the kvpage venv's own .pth files, e.g. kvpage's editable install, count)
    (Path(site) / "zz_kvpage_venv.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    probe = "import importlib.util, sys; print(' '.join(m for m in sys.argv[1:] if not importlib.util.find_spec(m)))"
    missing = subprocess.run([str(py), "-c", probe, *RUNNER_PACKAGES], check=True, capture_output=True,
                             text=True).stdout.split()  # fmt: skip
    if missing:
        print(f"installing into {venv}: {', '.join(RUNNER_PACKAGES[m] for m in missing)}", flush=True)
        subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--no-deps",
                        *(RUNNER_PACKAGES[m] for m in missing)], check=True)  # fmt: skip
    return py


# ------------------------------------------------------------------------------------------------------ the shim
SHIM_UTILS = r'''"""vLLM's tests/utils.py, replaced by benchmarks/peers/vllm_suite.py (kvpage):
RemoteOpenAIServer starts `kvpage serve` instead of `vllm serve`. Only the names the selected tests import."""

import atexit
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import openai
import requests

VLLM_PATH = Path(__file__).parent.parent
"""Path to root of the vLLM repository (here: the folder the tests were copied into)."""

KVPAGE = json.loads(os.environ["VLLM_SUITE_KVPAGE"])  # the command that runs kvpage's CLI
LOGS = Path(os.environ["VLLM_SUITE_LOGS"])
MODEL = os.environ.get("VLLM_SUITE_MODEL", "smollm2")
LIFETIME = int(os.environ.get("VLLM_SUITE_SERVER_LIFETIME", "3000"))  # seconds, then `timeout` ends the server

# vLLM's flags that kvpage serve has (taking one value), and its switches
VALUE_FLAGS = {"--max-model-len": "--max-model-len", "--max-num-seqs": "--max-num-seqs",
               "--max-num-batched-tokens": "--max-num-batched-tokens", "--seed": "--seed",
               "--root-path": "--root-path", "--block-size": "--block-size",
               "--gpu-memory-utilization": None, "--kv-cache-dtype": None}
SWITCHES = {"--return-tokens-as-token-ids": "--return-tokens-as-token-ids",
            "--enable-auto-tool-choice": "--enable-auto-tool-choice",
            "--enable-prefix-caching": "--enable-prefix-caching",
            "--no-enable-prefix-caching": "--no-enable-prefix-caching",
            "--enable-force-include-usage": "--enable-force-include-usage"}
PARSERS = ("hermes", "llama3_json", "mistral")  # kvpage's --tool-call-parser choices
_current = None  # the one server alive


def get_open_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _is_value(tok: str) -> bool:
    if not tok.startswith("-"):
        return True
    try:
        float(tok)
        return True
    except ValueError:
        return False


def kvpage_args(model: str, vllm_args: list, env: dict) -> tuple:
    """(kvpage serve's arguments, what was ignored) for `vllm serve model *vllm_args`."""
    out, ignored = [], []
    served, parser, api_key = model, "hermes", env.get("VLLM_API_KEY")
    i = 0
    while i < len(vllm_args):
        tok = str(vllm_args[i])
        if not tok.startswith("-"):
            ignored.append(tok)
            i += 1
            continue
        name, eq, val = tok.partition("=")
        if name.startswith("--"):
            name = "--" + name[2:].replace("_", "-")
        j = i + 1
        vals = [val] if eq else []
        while not eq and j < len(vllm_args) and _is_value(str(vllm_args[j])):
            vals.append(str(vllm_args[j]))
            j += 1
        i = j
        given = [tok] + ([] if eq else vals)
        if name in SWITCHES:
            out.append(SWITCHES[name])
            ignored += vals  # (a switch takes none)
        elif name in VALUE_FLAGS and VALUE_FLAGS[name] and vals:
            out += [VALUE_FLAGS[name], vals[0]]
            ignored += vals[1:]
        elif name == "--served-model-name" and vals:
            served = vals[0]
            ignored += vals[1:]  # (kvpage serves one name)
        elif name == "--tool-call-parser" and vals:
            if vals[0] in PARSERS:
                parser = vals[0]
            else:
                ignored += given
        elif name == "--api-key" and vals:
            api_key = vals[0]
        elif name in ("--port", "--host"):
            pass  # the shim's own
        else:
            ignored += given
    cmd = ["--model", MODEL, "--dtype", "float32", "--served-model-name", served, "--tool-call-parser", parser,
           "--metrics-prefix", "vllm", *out]
    if api_key:
        cmd += ["--api-key", api_key]
    return cmd, ignored


class RemoteOpenAIServer:
    DUMMY_API_KEY = "token-abc123"  # vLLM's OpenAI server does not need API key

    def __init__(self, model: str, vllm_serve_args: list, *, env_dict=None, seed=0, auto_port=True,
                 max_wait_seconds=None) -> None:
        global _current
        if auto_port and ("-p" in vllm_serve_args or "--port" in vllm_serve_args):
            raise ValueError("You have manually specified the port when `auto_port=True`.")
        if seed is not None:
            if "--seed" in vllm_serve_args:
                raise ValueError(f"You have manually specified the seed when `seed={seed}`.")
            vllm_serve_args = [*vllm_serve_args, "--seed", str(seed)]
        if not auto_port:
            i = vllm_serve_args.index("--port")
            self.port = int(vllm_serve_args[i + 1])
        else:
            self.port = get_open_port()
        self.host = "127.0.0.1"
        self.show_hidden_metrics = any(str(a).startswith("--show-hidden-metrics-for-version")
                                       for a in vllm_serve_args)
        env = os.environ.copy()
        if env_dict is not None:
            env.update(env_dict)
        args, ignored = kvpage_args(model, list(vllm_serve_args), env)
        if _current is not None:
            _current.stop()
        LOGS.mkdir(parents=True, exist_ok=True)
        n = len(list(LOGS.glob("server-*.log")))
        self.log_path = LOGS / f"server-{n:02d}.log"
        cmd = ["timeout", "-k", "10", str(LIFETIME), *KVPAGE, "serve", *args, "--host", self.host,
               "--port", str(self.port)]
        with open(LOGS / "servers.jsonl", "a") as f:
            f.write(json.dumps({"log": self.log_path.name, "model": model, "vllm_args": list(vllm_serve_args),
                                "env": env_dict or {}, "kvpage": cmd, "ignored": ignored}) + "\n")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        (LOGS / "server.pid").write_text(str(self.proc.pid))
        _current = self
        try:
            self._wait_for_server(url=self.url_for("health"), timeout=max_wait_seconds or 240)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Terminate the server (`timeout` passes it on), then kill its process group after a few seconds."""
        global _current
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(8)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # (the group `timeout` leads: it and kvpage)
                self.proc.wait(5)
        self._log.close()
        if _current is self:
            _current = None
            (LOGS / "server.pid").unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        self.stop()

    def _wait_for_server(self, *, url: str, timeout: float) -> None:
        start = time.time()
        while True:
            try:
                if requests.get(url, timeout=5).status_code == 200:
                    return
            except Exception:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvpage server exited ({self.proc.returncode}); see {self.log_path}")
            if time.time() - start > timeout:
                raise RuntimeError(f"kvpage server not healthy after {timeout} s; see {self.log_path}")
            time.sleep(0.5)

    @property
    def url_root(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        return self.url_root + "/" + "/".join(parts)

    def get_client(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)

    def get_async_client(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0,
                                  **kwargs)


@atexit.register
def _stop_current() -> None:
    if _current is not None:
        _current.stop()
'''

SHIM_CONFTEST = r'''"""vLLM's tests/conftest.py, replaced by benchmarks/peers/vllm_suite.py (kvpage): no
network, and what cannot run against kvpage deselected."""

import os
import tempfile

import huggingface_hub
import transformers

import served_model

# (patched at import, before the test modules bind these names with `from ... import`)
_EMPTY = tempfile.mkdtemp(prefix="vllm-suite-hub-")


def _snapshot_download(repo_id=None, *args, **kwargs):
    """The LoRA / prompt-adapter fixtures' downloads: an empty folder (kvpage has no LoRA; those tests are
    deselected, but their module-scoped fixtures are still set up for the server)."""
    return tempfile.mkdtemp(dir=_EMPTY)


huggingface_hub.snapshot_download = _snapshot_download
_from_pretrained = transformers.AutoTokenizer.from_pretrained


def _auto_tokenizer(name, *args, **kwargs):
    """A local folder as transformers reads it; a hub id: the served model's tokenizer (whatever the id)."""
    if os.path.isdir(str(name)):
        return _from_pretrained(name, *args, **kwargs)
    return served_model.hf_tokenizer()


transformers.AutoTokenizer.from_pretrained = staticmethod(_auto_tokenizer)

DESELECT = (
    "zephyr-lora", "zephyr-pa",  # LoRA / prompt-adapter parametrisations: kvpage has no LoRA
    "test_added_lora_tokens",  # LoRA adapters' added tokens
    "test_metrics_exist_run_batch",  # runs vllm.entrypoints.openai.run_batch in-process
)


def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    for item in items:
        (drop if any(d in item.nodeid for d in DESELECT) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
'''

SERVED_MODEL = r'''"""The served model's tokenizer as transformers' fast tokenizer, built as kvpage builds it for
xgrammar (kvpage/structured/grammars.py): kvpage's Tokenizer from the GGUF, its backend in PreTrainedTokenizerFast."""

import functools
import os

MODEL = os.environ.get("VLLM_SUITE_MODEL", "smollm2")


@functools.cache
def kvpage_tokenizer():
    from gguf import GGUFReader

    from kvpage.models.gguf_loader import _metadata
    from kvpage.models.loader import resolve_model_path
    from kvpage.models.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(_metadata(GGUFReader(str(resolve_model_path(MODEL)))))


def hf_tokenizer():
    """A new one each call (callers add tokens to theirs)."""
    from transformers import PreTrainedTokenizerFast

    tok = kvpage_tokenizer()
    special = {}
    if tok.bos_token_id is not None:
        special["bos_token"] = tok.token_text(tok.bos_token_id)
    if tok.eos_token_ids:
        special["eos_token"] = tok.token_text(tok.eos_token_ids[0])
    return PreTrainedTokenizerFast(tokenizer_object=tok.backend, chat_template=tok.chat_template, **special)
'''

STUBS = {
    "vllm/__init__.py": (
        '"""A stub of vLLM (benchmarks/peers/vllm_suite.py): only what collection of the selected tests needs."""\n\n'
        "from vllm.version import __version__  # noqa: F401\n"
    ),
    "vllm/version.py": f'__version__ = "{VLLM_VERSION}"\n_prev_minor_version = "0.9"\n',
    "vllm/platforms/__init__.py": '''"""What the tests ask of the platform: a CPU, neither CUDA nor ROCm."""


class _CpuPlatform:
    device_type = "cpu"

    def is_cuda(self) -> bool:
        return False

    def is_rocm(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return True

    def is_tpu(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False


current_platform = _CpuPlatform()
''',
    "vllm/transformers_utils/__init__.py": "",
    "vllm/transformers_utils/tokenizer.py": '''"""get_tokenizer: the served model's tokenizer, whatever model is
named (so expected ids are SmolLM2's)."""

import served_model


def get_tokenizer(tokenizer_name=None, *args, **kwargs):
    return served_model.hf_tokenizer()
''',
    "vllm/entrypoints/__init__.py": "",
    "vllm/entrypoints/openai/__init__.py": "",
    "vllm/entrypoints/openai/protocol.py": '''"""ChatCompletionRequest is kvpage's own request model, the one
`kvpage serve` validates every /v1/chat/completions body with (a pydantic ValidationError is a ValueError):
vLLM's request-validation tests check kvpage's validation, in process. The resolved tool mode is its
`tool_mode`; `tool_choice` is as sent."""

from kvpage.server.protocol import ChatCompletionRequest  # noqa: F401
''',
}


def pytest_ini(src: Path) -> str:
    """asyncio in strict mode (the tests mark theirs), vLLM's markers, the shim's pythonpath."""
    markers = []
    pyproject = src / "pyproject.toml"
    if pyproject.exists():
        import tomllib

        markers = tomllib.loads(pyproject.read_text()).get("tool", {}).get("pytest", {}).get("ini_options", {})
        markers = markers.get("markers", [])
    lines = ["[pytest]", "pythonpath = . stubs", "asyncio_mode = strict",
             "asyncio_default_fixture_loop_scope = function", "junit_family = xunit2", "markers ="]  # fmt: skip
    lines += [f"    {m}" for m in markers]
    return "\n".join(lines) + "\n"


def lay_out(src: Path, run: Path) -> None:
    """run/: the sdist's tests/ as they are, but utils.py and conftest.py; stubs/; pytest.ini."""
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(src / "tests", run / "tests")
    (run / "tests" / "utils.py").write_text(SHIM_UTILS)
    (run / "tests" / "conftest.py").write_text(SHIM_CONFTEST)
    (run / "stubs").mkdir()
    (run / "stubs" / "served_model.py").write_text(SERVED_MODEL)
    for rel, text in STUBS.items():
        (run / "stubs" / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / "stubs" / rel).write_text(text)
    (run / "pytest.ini").write_text(pytest_ini(src))


def kvpage_command() -> list[str]:
    script = Path(sys.executable).parent / "kvpage"
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvpage.cli"]


# ---------------------------------------------------------------------------------------------------- the report
def _node_id(run: Path, classname: str, name: str) -> str:
    parts = classname.split(".")
    for k in range(len(parts), 0, -1):
        if (run / Path(*parts[:k])).with_suffix(".py").exists():
            return "::".join(["/".join(parts[:k]) + ".py", *parts[k:], name])
    return f"{classname}::{name}"


def summarize(junit: Path, run: Path, out: Path, header: list[str], tail: str) -> dict:
    """summary.md: the counts and every test's outcome, with the first line of its failure."""
    rows, counts = [], {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (el.get("message") or el.text or "").strip()
                break
        counts[outcome] += 1
        first = " ".join(message.split())[:300].replace("|", "\\|")
        rows.append(f"| `{_node_id(run, case.get('classname', ''), case.get('name', ''))}` | {outcome} | "
                    f"{float(case.get('time') or 0):.1f} | {first} |")  # fmt: skip
    m = re.search(r"(\d+) deselected", tail)
    counts["deselected"] = int(m.group(1)) if m else 0
    text = [*header, "", "| " + " | ".join(counts) + " |", "|" + "---|" * len(counts),
            "| " + " | ".join(str(v) for v in counts.values()) + " |", "",
            "| test | outcome | s | failure (first line) |", "|---|---|---|---|", *rows]  # fmt: skip
    out.write_text("\n".join(text) + "\n")
    return counts


def _git(*args: str) -> str:
    r = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    return r.stdout.strip()


def main() -> int:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=None, help="work folder (default $KVPAGE_PEERS_DIR/vllm-suite)")
    ap.add_argument("--version", default=VLLM_VERSION, help="vLLM sdist whose tests run (the shim is for 0.10.0)")
    ap.add_argument("--timeout", type=int, default=180, help="seconds per test (pytest-timeout)")
    ap.add_argument("--run-timeout", type=int, default=2700, help="seconds for the whole pytest run")
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    work = (args.work or peers_dir() / "vllm-suite").resolve()
    logs, run = work / "logs", work / "run"

    src = vllm_tests(args.version)
    py = runner_venv(work)
    lay_out(src, run)
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)

    names_tests = any(a.startswith("tests/") or "::" in a or a.endswith(".py") for a in extra)
    junit = logs / "junit.xml"
    cmd = [str(py), "-m", "pytest", "-c", "pytest.ini", "--rootdir", ".", "-p", "no:cacheprovider", "-q", "-rA",
           f"--timeout={args.timeout}", f"--junitxml={junit}", *([] if names_tests else DEFAULT_SELECTION),
           *extra]  # fmt: skip
    env = dict(os.environ, VLLM_SUITE_KVPAGE=json.dumps(kvpage_command()), VLLM_SUITE_LOGS=str(logs),
               VLLM_SUITE_MODEL=MODEL, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")  # fmt: skip
    print(f"cd {run} && {' '.join(cmd)}", flush=True)
    # (the server runs the working tree: which one, taken before; a HEAD that moves during the run is said)
    head = _git("rev-parse", "--short", "HEAD")
    dirty = " (with uncommitted changes)" if _git("status", "--porcelain", "--untracked-files=no") else ""
    t0 = time.time()
    tail: list[str] = []
    with open(logs / "pytest.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=run, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        # past --run-timeout: SIGINT (pytest stops, its teardown stops the server), a minute later SIGKILL
        stop = threading.Timer(args.run_timeout, proc.send_signal, (signal.SIGINT,))
        kill = threading.Timer(args.run_timeout + 60, proc.kill)
        stop.start(), kill.start()
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
            tail = (tail + [line])[-5:]
        rc = proc.wait()
        timed_out = not stop.is_alive() and time.time() - t0 >= args.run_timeout
        stop.cancel(), kill.cancel()
    pid_file = logs / "server.pid"  # a server the run left (pytest killed): stopped by its pid
    if pid_file.exists():
        pid = int(pid_file.read_text())
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        pid_file.unlink()
    wall = time.time() - t0
    if not junit.exists():
        print(f"no junit XML (pytest exit {rc})")
        return rc or 1
    moved = _git("rev-parse", "--short", "HEAD")
    moved = f" (HEAD moved to {moved} during the run)" if moved != head else ""
    dists = ("pytest", "pytest-asyncio", "pytest-timeout", "openai", "transformers", "xgrammar", "lark")
    probe = "import importlib.metadata as m, sys; print(', '.join(f'{d} {m.version(d)}' for d in sys.argv[1:]))"
    versions = subprocess.run([str(py), "-c", probe, *dists], capture_output=True, text=True).stdout.strip()
    header = [
        f"# vLLM {args.version}'s tests against `kvpage serve`",
        "",
        f"kvpage {head}{dirty}{moved}, model {MODEL} (float32), {time.strftime('%Y-%m-%d')}; "
        f"wall {wall:.0f} s; pytest exit {rc}{' (run timed out)' if timed_out else ''}.",
        f"Command (in {run}): `{' '.join(cmd[1:])}`",
        f"Packages: {versions}.",
        f"Server logs and arguments: {logs}/server-NN.log, servers.jsonl.",
    ]
    counts = summarize(junit, run, logs / "summary.md", header, "".join(tail))
    print(f"\n{counts} in {wall:.0f} s; {logs / 'summary.md'}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
