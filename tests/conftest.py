"""Session fixtures: the real model (SmolLM2-135M-Instruct) and its transformers oracle, loaded once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvpage import cpu_kind

CPU_KIND = cpu_kind.apply_torch_env()  # KVPAGE_CPU_KIND: torch's kernels too must take that kind, so before torch

# `make test` runs pytest-xdist workers side by side (one per core pair of hands: Makefile's TEST_WORKERS):
# each takes its share of the cores, or their OpenMP threads would spin against each other. Subprocesses
# the tests start (servers, tensor-parallel ranks) inherit the same share.
if (workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))) > 1:
    threads = str(max(1, len(os.sched_getaffinity(0)) // workers))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, threads)

import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the oracle reads the local GGUF file; never the network
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
if not torch.cuda.is_available():  # the Triton kernels run in Triton's interpreter; read when triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_report_header(config):
    kind, _ = cpu_kind.machine()
    native = cpu_kind.kind_of(cpu_kind.read_flags())
    how = f"emulated by KVPAGE_CPU_KIND on a {native} machine" if kind != native else "this machine's own"
    return f"kvpage CPU kind: {kind} ({how}); torch dispatch {torch.backends.cpu.get_cpu_capability()}"


PROMPT_TEXTS = [
    ("chat", "What is the capital of France?"),
    ("chat", "Write a haiku about memory pages."),
    ("chat", "Explain in two sentences why the sky is blue, and mention Rayleigh scattering by name."),
    ("raw", "The quick brown fox"),
    ("raw", "def fibonacci(n):\n    "),
    ("raw", "In 1969, the first humans landed on the Moon. The mission was called"),
    ("chat", "List three prime numbers larger than 100 and say how you checked each one."),
    ("raw", "Once upon a time, in a kingdom far away, there lived a princess who loved to read. Every day she"),
]


@pytest.fixture(scope="session")
def smollm2():
    from kvpage.models import load_model

    return load_model("smollm2", dtype="float32")


@pytest.fixture(scope="session")
def smollm2_bf16():
    from kvpage.models import load_model

    return load_model("smollm2", dtype="bfloat16")


@pytest.fixture(scope="session")
def prompts(smollm2) -> list[list[int]]:
    tok = smollm2.tokenizer
    out = []
    for kind, text in PROMPT_TEXTS:
        if kind == "chat":
            text = tok.apply_chat_template([{"role": "user", "content": text}])
        out.append(tok.encode(text))
    return out


def _hf_weights(smollm2) -> Path | None:
    """transformers' own GGUF loader (the oracle's weights) takes ~15 s here: it parses the file twice and
    maps every tensor name 400 times. What it produced is kept: its float32 tensors as safetensors in kvpage's
    cache folder, named by the file's content and the versions of transformers and gguf, so every later load
    (the other worker, bfloat16, `make test-kinds`) reads the same tensors, bit for bit, in ~0.1 s. None when
    the cache folder cannot be written (each load then parses the file)."""
    import fcntl
    import importlib.metadata as md

    import safetensors.torch
    import transformers

    from kvpage.models.loader import cache_dir, weights_fingerprint

    key = f"{weights_fingerprint(smollm2.source)}-{transformers.__version__}-{md.version('gguf')}"
    out = cache_dir() / f"hf-oracle-{key}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.parent / f"hf-oracle-{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (out / "model.safetensors").exists():
                path = Path(smollm2.source)
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    str(path.parent), gguf_file=path.name, dtype=torch.float32
                )
                tmp = out.with_name(out.name + ".tmp")
                tmp.mkdir(exist_ok=True)
                model.config.save_pretrained(tmp)
                tied = model.config.tie_word_embeddings
                tensors = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
                safetensors.torch.save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
                tmp.rename(out)
    except OSError:
        return None
    return out


def _hf_model(smollm2, dtype):
    import transformers

    path = Path(smollm2.source)
    if (saved := _hf_weights(smollm2)) is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(saved), dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    model.generation_config.eos_token_id = None  # generate the full length, as our tests do
    model.generation_config.pad_token_id = 0
    return model.eval()


@pytest.fixture(scope="session")
def hf_f32(smollm2):
    return _hf_model(smollm2, torch.float32)


@pytest.fixture(scope="session")
def hf_bf16(smollm2):
    return _hf_model(smollm2, torch.bfloat16)


def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation of one unpadded prompt, and its last-token logits."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False)
        logits = model(ids).logits[0, -1].float()
    return out[0, len(prompt) :].tolist(), logits


@pytest.fixture(scope="session")
def hf_f32_greedy(request, prompts, tmp_path_factory):
    """transformers' 32 greedy tokens of every prompt (the oracle is ~0.1 s a token: ~30 s). Under
    xdist one worker computes them and the run's other workers read its file (a file lock)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return [hf_greedy(request.getfixturevalue("hf_f32"), p, 32) for p in prompts]
    import fcntl

    shared = tmp_path_factory.getbasetemp().parent  # this run's, shared by its workers
    path = shared / "hf_f32_greedy.pt"
    with open(shared / "hf_f32_greedy.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not path.exists():
                out = [hf_greedy(request.getfixturevalue("hf_f32"), p, 32) for p in prompts]
                torch.save(out, path.with_suffix(".tmp"))
                path.with_suffix(".tmp").rename(path)
            return torch.load(path)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def server():
    """One live kvpage server (tests/server/conftest.py), shared by the server and fleet tests."""
    from tests.server.conftest import start_server, stop_server

    s = start_server(app_kw={"tool_call_parser": "hermes"})  # (tool_choice "auto" served: Hermes' format)
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def one_ray_cluster_at_a_time(tmp_path_factory):
    """A local Ray cluster is one per machine at a time: the xdist workers take turns (a file lock)."""
    import fcntl

    lock = tmp_path_factory.getbasetemp().parent / "kvpage-ray.lock"  # (shared by the run's workers)
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def redis_server():
    """One real redis-server (tests/redis_server.py), shared by the shared-KV-tier tests."""
    from tests.redis_server import start_redis, stop_redis

    r = start_redis()
    yield r
    stop_redis(r)
