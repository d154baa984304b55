"""The command line end to end, as a user runs it (a subprocess per command)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

COMMANDS = ["demo", "core-demo", "generate", "chat", "serve", "bench", "estimate", "blocks", "tp-rank"]


def kvpage(*args: str, input: str | None = None, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpage.cli", *args], capture_output=True, text=True, input=input,
                          timeout=timeout)  # fmt: skip


ENGINE_HELP = ["--model", "smollm2", "--dtype", "bfloat16 where the CPU computes it natively", "--weight-dtype",
               "--block-size", "--kv-cache-memory", "--num-kv-blocks", "--swap-space", "--max-num-seqs",
               "--max-model-len", "--no-prefix-caching", "--block-size-lengths"]  # fmt: skip
HELP_MUST_SAY = {  # what a user reading only `kvpage COMMAND --help` needs to find there
    "demo": ["six chat prompts", "system prompt", "prefix-cache hit rate", "pre-allocated", "--max-tokens"],
    "core-demo": ["block tables", "parallel samples", "--block-size", "--num-blocks", "--seed"],
    "generate": ["one per line", "--file", "--chat", "chat template", "--temperature", "0 is greedy", "--top-p",
                 "--top-k", "completions per prompt", "--sampling-seed", *ENGINE_HELP],
    "chat": ["/stats", "/reset", "/exit", "--system", "--temperature", *ENGINE_HELP],
    "serve": ["/v1/completions", "/v1/chat/completions", "/health", "/metrics", "--host", "127.0.0.1", "--port",
              "--api-key", "every path but /health", "KVPAGE_API_KEY", "empty key is refused",
              "--salt-cache-per-key", "--served-model-name", "--max-body-bytes", "--body-timeout", "408",
              "--max-prompts-per-request", "--tensor-parallel-size", "--master-addr", "--master-port",
              *ENGINE_HELP],
    "bench": ["offline throughput", "seeded", "JSONL", "--num-requests", "--input-len", "LOW:HIGH", "--output-len",
              "--output", *ENGINE_HELP],
    "estimate": ["2 x layers x kv_heads x head_dim", "pre-allocated", "paged", "llama-2-7b", "--batch", "--max-len",
                 "--actual-len", "--lengths", "--block-size", "--tensor-parallel-size", "per rank"],
    "tp-rank": ["--rank", "--master-addr", "--master-port", "--tensor-parallel-size", "receives its engine config",
                "--device", "--threads"],
    "blocks": ["max(64, 2^floor(log2(avg/4)))", "least cost", "pre-allocate", "--block-cost", "--shared-prefix",
               "--lengths-file", "--histogram", "--min-block-size", "--max-block-size"],
}  # fmt: skip


@pytest.mark.parametrize("command", COMMANDS)
def test_help_says_what_each_command_does_and_takes(command):
    r = kvpage(command, "--help")
    assert r.returncode == 0 and "usage: kvpage " + command in r.stdout
    text = " ".join(r.stdout.split())  # argparse wraps lines anywhere
    missing = [phrase for phrase in HELP_MUST_SAY[command] if phrase not in text]
    assert not missing, f"kvpage {command} --help does not say: {missing}"


def test_top_level_help_lists_every_command():
    r = kvpage("--help")
    assert r.returncode == 0
    for command in COMMANDS:
        assert command in r.stdout, command


def test_help_and_the_sizing_commands_answer_without_importing_torch():
    # torch takes a second or two to import: `kvpage --help`, `estimate` and `blocks` do not wait for it
    code = ("import sys; from kvpage.cli import main; main(['estimate', '--model', 'llama-3-8b']); "
            "main(['blocks', '--histogram', '128:10']); assert 'torch' not in sys.modules")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-c", "import sys; from kvpage.cli import build_parser; build_parser(); "
                        "assert 'torch' not in sys.modules"], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr


def test_estimate_answers_per_tensor_parallel_rank():
    whole = kvpage("estimate", "--model", "llama-3-8b", "--batch", "1", "--max-len", "1024")
    rank = kvpage("estimate", "--model", "llama-3-8b", "--batch", "1", "--max-len", "1024", "-tp", "4")
    assert whole.returncode == 0 and rank.returncode == 0, rank.stderr
    # bf16: 2 x 32 layers x 8 kv heads x 128 x 2 bytes = 128 KiB per token; a rank of 4 holds 2 kv heads
    assert "| bfloat16 | 128.00 KiB |" in whole.stdout and "| bfloat16 | 32.00 KiB |" in rank.stdout
    assert "one rank of 4" in rank.stdout
    # 16 ranks for 8 kv heads: each holds one, replicated on two ranks
    assert "| bfloat16 | 16.00 KiB |" in kvpage("estimate", "--model", "llama-3-8b", "-tp", "16").stdout
    bad = kvpage("estimate", "--model", "smollm2", "-tp", "2")
    assert bad.returncode == 1 and "tensor_parallel_size=2 does not divide the model's 9 attention heads" in bad.stderr


def test_estimate_matches_the_formula_by_hand():
    r = kvpage("estimate", "--model", "llama-2-13b", "--batch", "8", "--max-len", "2048", "--actual-len", "500")
    assert r.returncode == 0, r.stderr
    # fp16: 2 x 40 layers x 40 kv heads x 128 x 2 bytes = 819,200 B = 800 KiB per token
    # per 16-token block 12.5 MiB; 8 x 2048 pre-allocated = 13,421,772,800 B = 12.50 GiB
    # paged: ceil(500 / 16) * 16 = 512 slots x 8 = 4096 tokens = 3,355,443,200 B = 3.12 GiB, saving 75.0%
    assert "| float16 | 800.00 KiB | 12.50 MiB | 12.50 GiB | 3.12 GiB | 75.0% |" in r.stdout
    # int8: 2 x 40 x 40 x (128 values x 1 byte + a 4-byte scale) = 422,400 B = 412.50 KiB per token;
    # a block 6,758,400 B = 6.45 MiB; 16,384 tokens 6.45 GiB; 4,096 slots 1,730,150,400 B = 1.61 GiB
    assert "| int8 | 412.50 KiB | 6.45 MiB | 6.45 GiB | 1.61 GiB | 75.0% |" in r.stdout
    # the default model, read from its GGUF metadata: 2 x 30 x 3 x 64 x 2 = 23,040 B = 22.50 KiB per token
    r = kvpage("estimate", "--batch", "1", "--max-len", "100", "--lengths", "50")
    assert r.returncode == 0, r.stderr
    assert "30 layers x 3 kv heads x head_dim 64" in r.stdout and "| bfloat16 | 22.50 KiB | 360.00 KiB |" in r.stdout


def test_estimate_counts_each_kv_cache_group_by_hand():
    r = kvpage("estimate", "--model", "gemma-3-27b", "--max-len", "32768", "--batch", "1", "--gpu-memory", "80")
    assert r.returncode == 0, r.stderr
    # 10 global layers in 2 groups of 5, 52 local ones (window 1024) in 11 groups (the last of 2): a block
    # holds 5 layers' K and V, 5 x 2 x 16 kv heads x 128 x 2 bytes x 16 tokens = 655,360 B. At 32,768 tokens
    # each global group holds all 2,048 blocks, each local one the 64 of its last 1,024 tokens: 4,800 blocks
    # = 3,145,728,000 B = 2.93 GiB, against 62 layers x 2,048 x 131,072 B = 15.50 GiB: 0.189
    assert "| 32768 | 4096 | 704 | 2.93 GiB | 15.50 GiB | 0.189 |" in r.stdout
    # at 1,024 tokens nothing is behind any window: 13 groups x 64 blocks of 5 layers (3 slots of 65 unused)
    assert "| 1024 | 128 | 704 | 520.00 MiB | 496.00 MiB | 1.048 |" in r.stdout
    # what fits an 80 GiB GPU beside bfloat16 weights (20.69 GiB): 20.69 GiB // 2.93 GiB = 7 sequences
    assert "| bfloat16 | 50.31 GiB | 20.69 GiB | 7 | 7 |" in r.stdout


def test_the_estimate_of_groups_is_what_the_manager_holds():
    """`group_blocks` (the estimate's arithmetic) against the KV-cache manager itself on gpt-oss's and
    Llama 4 Scout's layers, at lengths around the window and the chunk."""
    from kvpage.core import KVCacheManager
    from kvpage.core.kv_spec import group_layers
    from kvpage.tools.kv_estimate import group_blocks, resolve_shape

    for name in ("gpt-oss-20b", "llama-4-scout"):
        shape = resolve_shape(name)
        groups = group_layers(shape.specs)
        for n in (100, 128, 129, 1000, 8192, 8200):
            mgr = KVCacheManager(8192, 16, group_specs=[g.spec for g in groups], watermark=0.0)
            adm = mgr.check_admission([list(range(n))])
            mgr.admit(["s"], [list(range(n))], adm)
            mgr.finish_step([("s", n, None)])
            held = tuple(sum(b is not None for b in mgr.block_table("s", g)) for g in range(len(groups)))
            assert held == group_blocks(shape, 16, n).blocks, (name, n)


def test_blocks_advice_matches_hand_computation(tmp_path):
    f = tmp_path / "lengths.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in [100, 100, {"length": 300}, {"prompt_len": 200, "output_len": 60}]))
    r = kvpage("blocks", "--lengths-file", str(f), "--block-cost", "16")
    assert r.returncode == 0, r.stderr
    # lengths 100, 100, 300, 260: average 190 -> rule max(64, 2^floor(log2(47.5))) = max(64, 32) = 64
    assert "average length 190.0" in r.stdout and "block_size = 64" in r.stdout
    # block 16: 7 + 7 + 19 + 17 = 50 blocks = 800 slots for 760 tokens -> waste 5.0%
    # block 16: 7 + 7 + 19 + 17 = 50 blocks = 800 slots for 760 tokens -> waste 5.0%; cost 800 + 16 x 50
    assert "| 16 | 50 | 800 | 5.0% | 0 | 1600 |" in r.stdout
    assert "| 64 | 14 | 896 | 15.2% | 0 | 1120 |" in r.stdout and "| 128 | 8 | 1024 | 25.8% | 0 | 1152 |" in r.stdout
    # the least waste would be a block of 1; priced per block and clamped to the seed's 64-256, 64 wins
    assert "least cost with block_size in [64, 256]" in r.stdout and "block_size = 64, waste 15.2%" in r.stdout
    assert "blocks to pre-allocate for these sequences at block_size 64: 14" in r.stdout
    r = kvpage("blocks", "--histogram", "128:10", "--block-cost", "16")
    assert "| 128 | 10 | 1280 | 0.0% | 0 | 1440 |" in r.stdout
    # ten 1,000-token sequences opening with the same 400 tokens: 128 shares 3 whole blocks of it (x 9 sharers)
    r = kvpage("blocks", "--histogram", "1000:10", "--shared-prefix", "400", "--block-cost", "16")
    assert (
        "| 128 | 53 | 10240 | 2.3% | 3456 | 7632 |" in r.stdout
        and "| 256 | 31 | 10240 | 2.3% | 2304 | 8432 |" in r.stdout
    )
    assert "block_size = 128, waste 2.3%" in r.stdout
    r = kvpage("blocks", "--histogram", "1000:10", "--block-cost", "0", "--min-block-size", "1")
    assert "[1, 256] (waste + 0 slots per block" in r.stdout and "block_size = 8, waste 0.0%" in r.stdout


def test_generate_prints_completions_and_stats():
    r = kvpage("generate", "The capital of France is", "--max-tokens", "6", "--dtype", "float32",
               "--num-kv-blocks", "64")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "=== The capital of France is" in r.stdout and "(6 tokens, length)" in r.stdout
    assert "cache: 0/64 blocks used" in r.stdout


def test_chat_streams_and_shows_stats():
    r = kvpage("chat", "--max-tokens", "8", "--temperature", "0", "--num-kv-blocks", "64",
               input="What is 2+2?\n/stats\n/exit\n")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "assistant> " in r.stdout and "cache: 0/64 blocks used" in r.stdout


def test_bench_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    r = kvpage("bench", "--num-requests", "4", "--input-len", "8:16", "--output-len", "4:8", "--num-kv-blocks", "64",
               "--output", str(out))  # fmt: skip
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["requests"] == 4 and data["failed"] == 0 and 16 <= data["output_tokens"] <= 32
    assert "| output tokens/s |" in r.stdout


def test_core_demo_runs():
    r = kvpage("core-demo")
    assert r.returncode == 0 and "copy-on-write copied 2 shared partial blocks" in r.stdout


def test_errors_are_one_clear_line():
    cases = (
        ["estimate", "--model", "no-such-model"],
        ["blocks", "--histogram", "abc"],
        ["generate", "hi", "--block-size", "12"],
        ["bench", "--input-len", "9:3", "--num-kv-blocks", "8"],
        ["bench", "--suite", "no-such-benchmark"],
        ["generate", "hi", "--block-size", "auto"],
    )
    for args in cases:
        r = kvpage(*args)
        assert r.returncode == 1, args
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"kvpage {args[0]}: error: "), r.stderr


def test_demo_answers_and_reports_the_cache():
    r = kvpage("demo", "--max-tokens", "6")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("\nQ: ") == 6 and "prefix cache" in r.stdout and "pre-allocated to max_model_len" in r.stdout
    assert "after the run: 0 blocks used" in r.stdout


def test_the_server_loads_its_model_in_a_thread_that_then_exits():
    """`kvpage serve` loads off the main thread (so the engine thread's OpenMP pool is the only one):
    the value comes back, an error is raised in the caller, and the loading thread is gone after."""
    import threading

    from kvpage.cli import _in_passing_thread

    seen = []
    assert _in_passing_thread(lambda: seen.append(threading.current_thread()) or 42) == 42
    assert seen[0] is not threading.main_thread() and not seen[0].is_alive()
    with pytest.raises(ValueError, match="no such model"):
        _in_passing_thread(lambda: (_ for _ in ()).throw(ValueError("no such model")))


def test_vllm_serve_spellings_are_the_same_options():
    from kvpage.cli import _engine_kwargs, build_parser

    p = build_parser()
    args = p.parse_args(["serve", "--no-enable-prefix-caching", "--gpu-memory-utilization", "0.5", "--max-model-len",
                         "512", "--kv-cache-dtype", "int8", "--served-model-name", "foo"])  # fmt: skip
    kw = _engine_kwargs(args)
    assert kw["enable_prefix_caching"] is False and kw["gpu_memory_utilization"] == 0.5
    assert kw["max_model_len"] == 512 and kw["kv_cache_dtype"] == "int8" and args.served_model_name == "foo"
    for flags, on in ([], True), (["--enable-prefix-caching"], True), (["--no-prefix-caching"], False):
        assert _engine_kwargs(p.parse_args(["serve", *flags]))["enable_prefix_caching"] is on


def test_serve_options_reach_the_app():
    from kvpage.cli import _app_kwargs, build_parser

    args = build_parser().parse_args(["serve", "--root-path", "/kv", "--metrics-prefix", "vllm",
                                      "--return-tokens-as-token-ids", "--enable-force-include-usage"])  # fmt: skip
    kw = _app_kwargs(args, [])
    assert kw["metrics_prefix"] == "vllm" and kw["return_tokens_as_token_ids"] and kw["force_include_usage"]
    assert args.root_path == "/kv" and kw["api_key"] is None


def test_estimate_answers_whether_a_model_fits_a_gpu_by_hand():
    r = kvpage("estimate", "--model", "llama-2-70b", "--gpu-memory", "80", "--max-len", "4096", "--batch", "8")
    assert r.returncode == 0, r.stderr
    # linears 80 x (8192 x (8192 + 2 x 1024) + 8192 x 8192 + 3 x 8192 x 28672) = 68,451,041,280; embedding
    # and head 32000 x 8192 each, norms 161 x 8192: 68.98 B parameters
    assert "68.98 B parameters" in r.stdout
    # int4: linears x 0.625 + head x 1.0625 (int8) + embedding x 2 + norms x 2 = 43,587,354,624 B = 40.59 GiB;
    # 80 GiB x 0.9 - 1 GiB = 71 GiB leaves 32,648,314,880 B = 30.41 GiB; a 4096-token sequence is
    # 4096 x 327,680 B (float16) -> 24 of them, 4096 x 168,960 B (int8) -> 47
    assert "| int4 | 40.59 GiB | 30.41 GiB | 24 | 24 | 47 | 47 |" in r.stdout
    # bfloat16: 68.98 B x 2 bytes = 128.48 GiB; int8 (1.0625 bytes a weight): 73,534,685,184 B = 68.48 GiB,
    # leaving 2,700,984,320 B: 2 float16 sequences, 3 int8 ones
    assert "| bfloat16 | 128.48 GiB | none | 0 | 0 | 0 | 0 | no |" in r.stdout
    assert "| int8 | 68.48 GiB | 2.52 GiB | 2 | 2 | 3 | 3 | no |" in r.stdout
    assert "8 concurrent requests of 4096 tokens: fit with int4 weights with" in r.stdout
    r = kvpage("estimate", "--model", "llama-2-70b", "--gpu-memory", "80", "--gpu-memory-utilization", "1.5")
    assert r.returncode != 0 and "--gpu-memory-utilization" in r.stderr
