"""Engine settings, validated up front: a wrong value raises ValueError naming the field."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any

from kvpage import compat
from kvpage.core.eviction import NO_EVICTION, EvictionPolicy, parse_eviction
from kvpage.core.kv_bytes import KV_CACHE_DTYPES, MODEL_DTYPE_NAMES

DEFAULT_REMOTE_LANDING = 256 * 2**20  # CPU-tier bytes for blocks fetched from the shared tier
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(value: int | str, field_name: str) -> int:
    """512, "512MiB", "1GiB", "1.5GB" -> bytes."""
    if isinstance(value, bool):
        raise ValueError(f"{field_name} must be a size such as '512MiB', got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{field_name} must be a size such as '512MiB' or '1GiB', got {value!r}")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n < 0:
        raise ValueError(f"{field_name} must be >= 0, got {value!r}")
    return n


def _cli_block_size(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"a power of two or 'auto', got {text!r}") from None


def option(default: Any, help: str, **cli: Any) -> Any:
    """A field, its help and how the command line takes it (`type`, `choices`, `flag`, `aliases`: more
    spellings of it, such as vLLM's; `opposite`: a flag setting a bool field to its default; `action`,
    `metavar`; `app`: a serve option passed to the server's app): the one source of every option's
    name, default and help (kvpage/cli/options.py derives the command line from these fields)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass(slots=True)
class EngineConfig:
    model: str = option("smollm2", "model name, .gguf file or model directory (default smollm2)")
    dtype: str = option(
        "auto",
        "auto, float32, bfloat16 or float16 (default auto: bfloat16 where the CPU computes it natively, else float32)",
    )
    kv_cache_dtype: str = option(
        "auto",
        "KV blocks in the model's dtype (auto, the default), or int8 / fp8 with a "
        "float32 scale per token and kv head: ~1.9x the blocks of bfloat16 in the same memory",
        choices=["auto", "int8", "fp8"],
    )
    weight_dtype: str | None = option(
        None,
        "weight-only quantized linear layers: int8 (Q8_0-style) or int4 "
        "(Q4_1-style), groups of 32 (default: unquantized)",
        choices=["int8", "int4"],
    )
    block_size: int | str = option(
        16,
        "tokens per KV block (default 16), or 'auto': the advice of `kvpage blocks` for --block-size-lengths",
        type=_cli_block_size,
    )
    kv_cache_memory: int | str | None = option(None, "memory for the KV cache, e.g. 512MiB (default 512MiB)")
    num_kv_blocks: int | None = option(None, "size the KV cache in blocks instead", type=int)
    enable_prefix_caching: bool = option(True, "turn automatic prefix caching off", flag="--no-prefix-caching",
                                       aliases=("--no-enable-prefix-caching",),  # vLLM's spellings
                                       opposite="--enable-prefix-caching")  # fmt: skip
    swap_space: int | str = option(0, "CPU memory for swapped-out blocks, e.g. 1GiB (default 0)")
    cpu_offload_memory: int | str = option(
        0,
        "a CPU tier for the prefix cache, e.g. 2GiB: evicted prefix blocks "
        "are kept there and brought back on a hit instead of recomputed "
        "(default 0: none)",
    )
    remote_kv: str | None = option(
        None,
        "a KV tier shared by every replica, below the CPU tier: redis://HOST:PORT. "
        "Blocks are written through once computed and fetched (checked) on a prefix miss; "
        "they land in the CPU tier (256MiB unless --cpu-offload-memory says). Unreachable: skipped",
        metavar="URL",
    )
    preemption_mode: str | None = option(
        None,
        "how a preempted request gives its blocks back: recompute, or swap "
        "(to --swap-space); default: swap when it fits, else recompute",
        choices=["recompute", "swap"],
    )
    max_num_seqs: int = option(256, "sequences running at once (default 256)", type=int)
    max_num_batched_tokens: int = option(2048, "tokens per step (default 2048)", type=int)
    max_model_len: int | None = option(None, "longest prompt + output (default: the model's)", type=int)
    seed: int = option(0, "engine seed (default 0)", type=int)
    watermark: float = option(
        0.01,
        "share of the KV blocks kept free for running sequences to grow into when a request is admitted (default 0.01)",
        type=float,
    )
    device: str = option("cpu", "where the model and KV cache live: cpu (default) or cuda")
    gpu_memory_utilization: float = option(
        0.9,
        "on CUDA without --kv-cache-memory / --num-kv-blocks: the share of "
        "the GPU's memory to use, the KV pool sized into it after a profiling "
        "forward (default 0.9)",
        type=float,
    )
    attention_backend: str = option(
        "auto",
        "auto (default): kvpage's compiled CPU kernels where they build, the "
        "Triton kernels on CUDA, else the torch reference",
        choices=["auto", "cpu", "torch", "triton"],
    )
    # parsed once, in __post_init__: afterwards always an EvictionPolicy (NO_EVICTION when off); also a
    # mapping or a policy object from Python (kvpage/core/eviction/)
    kv_eviction: EvictionPolicy | Any = option(
        None,
        "every request's eviction policy for contexts longer than the "
        "budget: 'streaming[:sink_tokens=4,window_tokens=1020]' (StreamingLLM; "
        "runs past max_model_len) or 'h2o[:heavy_tokens=512,recent_tokens=512]' "
        "(default: none; a request's own overrides)",
    )
    kv_read_budget: int | None = option(
        None,
        "tokens each decode may read of the cache past the first layers: the first block, the last "
        "two and the rest chosen by their keys' min/max bounds (Quest; nothing is freed). Keeps the "
        "bounds (an eighth more per bfloat16 block of SmolLM2); 0 keeps them and reads all unless a request's own "
        "kv_read_budget says (default: no bounds, every block)",
        type=int,
        metavar="TOKENS",
    )
    block_size_lengths: Any = option(
        None,
        "with --block-size auto: the lengths to hold at once, LENGTH:COUNT,... or "
        "a JSONL file (as `kvpage blocks` reads; from Python also a {length: count} "
        "mapping); they size the pool too unless --kv-cache-memory or --num-kv-blocks "
        "is given",
    )
    block_size_advice: Any = field(default=None, init=False)  # the Advice behind an "auto" block size
    deterministic: bool = option(
        False,
        "bit-identical tokens and logprobs whatever the batch, prefix hits, chunking "
        "or preemption (kvpage/models/batch_invariant.py; slower prefill)",
    )
    jump_forward: bool = option(
        False,
        "structured outputs: where the grammar allows one continuation only, append its tokens at once and "
        "compute them as one chunk (SGLang's jump-forward decoding; not for requests that want logprobs)",
    )
    tensor_parallel_size: int = option(
        1,
        "split the model's heads and MLP over N processes (Megatron-style, torch.distributed: gloo on CPU, "
        "nccl on CUDA); rank 0 schedules, every rank holds 1/N of the KV cache (default 1)",
        type=int,
        aliases=("-tp",),
        metavar="N",
    )
    master_addr: str | None = option(
        None,
        "with --tensor-parallel-size: the address rank 0 listens on for ranks launched by hand on other "
        "machines (`kvpage tp-rank`); default: the ranks are spawned on this machine (torchrun's "
        "MASTER_ADDR/RANK/WORLD_SIZE are read when set)",
        metavar="HOST",
    )
    master_port: int | None = option(None, "with --master-addr: its port", type=int, metavar="PORT")
    verify_kv_every: int = option(
        0,
        "check the KV cache every N steps (finite values; with --deterministic a "
        "recompute of cached prefixes, bit for bit); mismatches are logged and counted in "
        "/metrics (default 0: never)",
        type=int,
        metavar="N",
    )

    def __post_init__(self) -> None:
        self._resolve_block_size()
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        v = self.verify_kv_every
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"verify_kv_every must be an integer >= 0 (steps; 0 never checks), got {v!r}")
        if self.block_size > 1024 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two up to 1024, got {self.block_size}")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks must be a positive integer, got {self.num_kv_blocks!r}")
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError("give either kv_cache_memory or num_kv_blocks, not both")
        if not isinstance(self.device, str) or self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda' (or 'cuda:N'), got {self.device!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {u!r}")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory, "kv_cache_memory")
        self.swap_space = parse_bytes(self.swap_space, "swap_space")
        self.cpu_offload_memory = parse_bytes(self.cpu_offload_memory, "cpu_offload_memory")
        if self.remote_kv is not None:
            if not isinstance(self.remote_kv, str) or not self.remote_kv.startswith(("redis://", "rediss://")):
                raise ValueError(f"remote_kv must be a redis://HOST:PORT URL, got {self.remote_kv!r}")
            self.cpu_offload_memory = self.cpu_offload_memory or DEFAULT_REMOTE_LANDING
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")
        if self.weight_dtype not in (None, "int8", "int4"):
            raise ValueError(f"weight_dtype must be int8, int4 or None; got {self.weight_dtype!r}")
        if self.dtype != "auto" and self.dtype not in MODEL_DTYPE_NAMES:
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16; got {self.dtype!r}")
        if self.preemption_mode not in (None, "recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute', 'swap' or None, got {self.preemption_mode!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise ValueError(f"max_model_len must be a positive integer, got {self.max_model_len!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark!r}")
        self.kv_eviction = parse_eviction(self.kv_eviction) or NO_EVICTION
        v = self.kv_read_budget
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ValueError(f"kv_read_budget must be an integer >= 0 (tokens; 0: every block), got {v!r}")
        self._check_deterministic()
        self._check_tensor_parallel()
        compat.check(self.setup())

    def setup(self, **request) -> compat.Setup:
        """The facts the compatibility table checks (compat.py), with a request's (its own eviction
        policy, read budget, segments) over the engine's."""
        facts = dict(
            prefix_caching=self.enable_prefix_caching, remote_kv=self.remote_kv is not None,
            cpu_offload=bool(self.cpu_offload_memory), preemption_mode=self.preemption_mode,
            swap_space=int(self.swap_space), tensor_parallel=self.tensor_parallel_size, device=self.device,
            attention_backend=self.attention_backend, dtype=self.dtype, kv_cache_dtype=self.kv_cache_dtype,
            weight_dtype=self.weight_dtype, deterministic=self.deterministic, verify_kv=bool(self.verify_kv_every),
            eviction=self.kv_eviction, demote_pools=bool(self.kv_eviction.demotes_to()),
            key_bounds=self.kv_read_budget is not None, read_budget=self.kv_read_budget or 0,
        )  # fmt: skip
        return compat.Setup(**{**facts, **request})

    def _check_tensor_parallel(self) -> None:
        n = self.tensor_parallel_size
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {n!r}")
        if (self.master_addr is None) != (self.master_port is None):
            raise ValueError("master_addr and master_port go together")
        if self.master_port is not None and not (isinstance(self.master_port, int) and 0 < self.master_port < 65536):
            raise ValueError(f"master_port must be a port number, got {self.master_port!r}")
        if n == 1:
            if self.master_addr is not None:
                raise ValueError("master_addr is where a tensor-parallel group meets: needs tensor_parallel_size>1")
            return
        if self.device.startswith("cuda:"):  # each rank takes its own device (LOCAL_RANK)
            raise ValueError(f"tensor_parallel_size > 1 takes device 'cuda' (rank r on GPU r), not {self.device!r}; "
                             "choose the GPUs with CUDA_VISIBLE_DEVICES")  # fmt: skip

    def _check_deterministic(self) -> None:
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"deterministic must be true or false, got {self.deterministic!r}")
        if not isinstance(self.jump_forward, bool):
            raise ValueError(f"jump_forward must be true or false, got {self.jump_forward!r}")

    def _resolve_block_size(self) -> None:
        if self.block_size != "auto":
            if self.block_size_lengths is not None:
                raise ValueError("block_size_lengths is read only with block_size='auto'")
            return
        if self.block_size_lengths is None:
            raise ValueError("block_size='auto' needs block_size_lengths: the sequence lengths to advise on "
                             "(a {length: count} mapping, 'LENGTH:COUNT,...' or a JSONL path)")  # fmt: skip
        from kvpage.core.block_advisor import advise, histogram_from

        try:
            advice = advise(histogram_from(self.block_size_lengths))
        except (ValueError, OSError) as e:
            raise ValueError(f"block_size_lengths: {e}") from None
        self.block_size, self.block_size_advice = advice.best.block_size, advice
        if self.num_kv_blocks is None and self.kv_cache_memory is None:
            self.num_kv_blocks = advice.best.blocks

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)
