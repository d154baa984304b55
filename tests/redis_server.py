"""A real redis-server for the shared-KV-tier tests (installed by `make install`): 127.0.0.1, a free
port, no persistence, bounded memory; started and stopped by pid."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from types import SimpleNamespace

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(maxmemory: str = "512mb") -> SimpleNamespace:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip(
            "redis-server is not installed (`make test` installs Debian's redis-server as root, or prints the command)"
        )
    port = free_port()
    proc = subprocess.Popen([exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                             "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as c:
                c.sendall(b"PING\r\n")
                if c.recv(16).startswith(b"+PONG"):
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"redis-server did not start on 127.0.0.1:{port}")
        time.sleep(0.05)
    return SimpleNamespace(proc=proc, port=port, url=f"redis://127.0.0.1:{port}")


def stop_redis(r: SimpleNamespace) -> None:
    r.proc.kill()
    r.proc.wait(timeout=10)
