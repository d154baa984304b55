"""Which features refuse which: one table, checked when an engine starts and when a request comes.

A `Setup` is the plain facts a check looks at: the engine's settings and, for a request, what the
request brings (its own eviction policy, read budget, segments). A `Refusal` names two features that
do not go together, the field its error names and why:

    feature a        x  feature b          ->  field              why
    remote_kv           no prefix caching      remote_kv          a tier of the prefix cache
    deterministic       fp8 KV                 deterministic      fp8 blocks are read by the torch path
    a read budget       an evicting policy     kv_read_budget     ...

`check(setup)` raises ParameterError (a ValueError naming the field) for the first refusal that
applies, in table order. Values out of range (a negative port, an unknown dtype) are each field's
own check (config.py, sampling_params.py); only what two settings do to each other is here.
Every pair is tested from `Feature.example` alone and together (tests/test_compat.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from kvpage.core.eviction import NO_EVICTION, EvictionPolicy
from kvpage.core.kv_spec import ChunkedLocal, LayerSpec, SlidingWindow, group_layers
from kvpage.errors import ParameterError


@dataclass(frozen=True, slots=True)
class Setup:
    prefix_caching: bool = True
    remote_kv: bool = False
    cpu_offload: bool = False  # a CPU tier of the prefix cache (cpu_offload_memory > 0)
    preemption_mode: str | None = None
    swap_space: int = 0
    tensor_parallel: int = 1
    device: str = "cpu"
    attention_backend: str = "auto"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    weight_dtype: str | None = None
    deterministic: bool = False
    verify_kv: bool = False  # verify_kv_every > 0
    eviction: EvictionPolicy = NO_EVICTION  # a request's own, else the engine's
    demote_pools: bool = True  # the engine has pools per precision (sized at start from its own policy)
    key_bounds: bool = False  # the engine keeps key bounds (started with kv_read_budget)
    read_budget: int = 0  # tokens a decode reads (a request's own, else the engine's; 0: every block)
    segments: bool = False  # a prompt of segments (engine/segment_prompts.py)
    recompute_ratio: float = 0.0  # CacheBlend's share (segments)
    window: int = 0  # the model's layers read a sliding window (or a chunk) of this many keys (known once loaded)
    kv_groups: int = 1  # the model's KV-cache groups (core/kv_spec.py: several where its layers' kinds mix)
    state_layers: bool = False  # the model has state-space layers (a recurrent state in its blocks)


@dataclass(frozen=True, slots=True)
class Feature:
    name: str
    on: Callable[[Setup], bool]
    example: dict = field(default_factory=dict)  # a Setup that has it (the pair test builds from it)


def _policy(text: str) -> EvictionPolicy:
    from kvpage.core.eviction import parse_eviction

    return parse_eviction(text)  # type: ignore[return-value]


NO_PREFIX_CACHING = Feature("no prefix caching", lambda s: not s.prefix_caching, {"prefix_caching": False})
REMOTE_KV = Feature("remote_kv", lambda s: s.remote_kv, {"remote_kv": True})
CPU_OFFLOAD = Feature("cpu_offload_memory", lambda s: s.cpu_offload, {"cpu_offload": True})
SWAP_PREEMPTION = Feature("preemption by swap", lambda s: s.preemption_mode == "swap",
                          {"preemption_mode": "swap", "swap_space": 1 << 30})  # fmt: skip
NO_SWAP_SPACE = Feature("no swap space", lambda s: not s.swap_space, {"swap_space": 0})
TENSOR_PARALLEL = Feature("tensor parallelism", lambda s: s.tensor_parallel > 1, {"tensor_parallel": 2})
TP_OVER_2 = Feature("tensor parallelism over 3+ ranks", lambda s: s.tensor_parallel > 2, {"tensor_parallel": 3})
DETERMINISTIC = Feature("deterministic", lambda s: s.deterministic, {"deterministic": True})
NOT_CPU = Feature("a device other than the CPU", lambda s: s.device.split(":")[0] != "cpu", {"device": "cuda"})
NOT_CPU_KERNELS = Feature("attention other than the CPU kernels", lambda s: s.attention_backend not in ("auto", "cpu"),
                          {"attention_backend": "torch"})  # fmt: skip
FP8_KV = Feature("fp8 KV", lambda s: s.kv_cache_dtype == "fp8", {"kv_cache_dtype": "fp8"})
QUANTIZED_KV = Feature("a quantized KV cache", lambda s: s.kv_cache_dtype != "auto", {"kv_cache_dtype": "int8"})
WEIGHT_QUANT = Feature("quantized weights", lambda s: s.weight_dtype is not None, {"weight_dtype": "int8"})
FLOAT16 = Feature("float16", lambda s: s.dtype in ("float16", "fp16", "half"), {"dtype": "float16"})
VERIFY_KV_DET = Feature("verify_kv_every under deterministic", lambda s: s.verify_kv and s.deterministic,
                        {"verify_kv": True, "deterministic": True})  # fmt: skip
MASS = Feature("an eviction policy by attention mass", lambda s: s.eviction.wants_mass, {"eviction": _policy("h2o")})
EVICTS = Feature("an evicting policy", lambda s: s.eviction.evicts, {"eviction": _policy("streaming")})
LADDER = Feature("a policy with a ladder of precisions", lambda s: bool(s.eviction.ladder),
                 {"eviction": _policy("demote:int8_tokens=0,int4_tokens=0")})  # fmt: skip
INT8_RUNG = Feature("a demoting policy with an int8 rung", lambda s: "int8" in s.eviction.demotes_to(),
                    {"eviction": _policy("demote")})  # fmt: skip
DEMOTES = Feature("a demoting policy", lambda s: bool(s.eviction.demotes_to()),
                  {"eviction": _policy("demote:int8_tokens=0")})  # fmt: skip
NO_DEMOTE_POOLS = Feature("an engine without demotion pools", lambda s: not s.demote_pools, {"demote_pools": False})
KEY_BOUNDS = Feature("key bounds", lambda s: s.key_bounds, {"key_bounds": True})
NO_KEY_BOUNDS = Feature("no key bounds", lambda s: not s.key_bounds, {"key_bounds": False})
READ_BUDGET = Feature("a read budget", lambda s: s.read_budget > 0, {"read_budget": 64, "key_bounds": True})
SEGMENTS = Feature("a prompt of segments", lambda s: s.segments, {"segments": True})
RECOMPUTE_RATIO = Feature("selective recompute", lambda s: s.recompute_ratio > 0, {"recompute_ratio": 0.3})
WINDOW = Feature("a model of local layers (sliding windows or chunks)", lambda s: s.window > 0, {"window": 4096})
GROUPS = Feature("a model of several KV-cache groups", lambda s: s.kv_groups > 1, {"kv_groups": 2})
STATE_LAYERS = Feature("a model of state-space layers", lambda s: s.state_layers, {"state_layers": True})
VERIFY_KV = Feature("verify_kv_every", lambda s: s.verify_kv, {"verify_kv": True})


@dataclass(frozen=True, slots=True)
class Refusal:
    a: Feature
    b: Feature
    field: str  # the field the error names (the OpenAI error's `param` for a request)
    why: Callable[[Setup], str]


def _det(what: Callable[[Setup], str]) -> Callable[[Setup], str]:
    return lambda s: f"deterministic=True does not go with {what(s)}"


REFUSALS: tuple[Refusal, ...] = (
    Refusal(REMOTE_KV, NO_PREFIX_CACHING, "remote_kv",
            lambda s: "remote_kv is a tier of the prefix cache: it needs enable_prefix_caching"),
    Refusal(CPU_OFFLOAD, NO_PREFIX_CACHING, "cpu_offload_memory",
            lambda s: "cpu_offload_memory is a tier of the prefix cache: it needs enable_prefix_caching"),
    Refusal(SWAP_PREEMPTION, NO_SWAP_SPACE, "preemption_mode", lambda s: "preemption_mode='swap' needs swap_space > 0"),
    Refusal(DEMOTES, NO_DEMOTE_POOLS, "kv_eviction",
            lambda s: f"kv_eviction: {s.eviction.describe()} needs an engine started with a demoting kv_eviction "
                      "(its pools per precision are sized at start)"),
    Refusal(INT8_RUNG, QUANTIZED_KV, "kv_eviction",
            lambda s: f"kv_eviction.int8_tokens must be 0 with kv_cache_dtype={s.kv_cache_dtype!r}: "
                      "blocks are demoted only to precisions below the cache's own"),
    Refusal(READ_BUDGET, NO_KEY_BOUNDS, "kv_read_budget",
            lambda s: "kv_read_budget: this engine keeps no key bounds; start it with kv_read_budget (0 keeps "
                      "them, reading every block unless asked)"),
    Refusal(READ_BUDGET, EVICTS, "kv_read_budget",
            lambda s: f"kv_read_budget does not go with kv_eviction {s.eviction.describe()}"),
    Refusal(KEY_BOUNDS, LADDER, "kv_read_budget",
            lambda s: f"kv_read_budget does not go with kv_eviction {s.eviction.describe()} (a decode reads its "
                      "demoted blocks in full)"),
    Refusal(SEGMENTS, EVICTS, "kv_eviction",
            lambda s: f"kv_eviction: {s.eviction.describe()} does not go with a prompt of segments"),
    Refusal(RECOMPUTE_RATIO, TENSOR_PARALLEL, "recompute_ratio",
            lambda s: "recompute_ratio > 0 does not go with tensor_parallel_size > 1 (each rank would keep other "
                      "rows, by its own heads)"),
    Refusal(DETERMINISTIC, NOT_CPU, "deterministic",
            _det(lambda s: f"device={s.device!r}: it runs on the CPU kernels")),
    Refusal(DETERMINISTIC, NOT_CPU_KERNELS, "deterministic",
            _det(lambda s: f"attention_backend={s.attention_backend!r}: it needs the 'cpu' kernels")),
    Refusal(DETERMINISTIC, FP8_KV, "deterministic",
            _det(lambda s: "kv_cache_dtype='fp8': fp8 blocks are read by the torch path")),
    Refusal(DETERMINISTIC, WEIGHT_QUANT, "deterministic",
            _det(lambda s: f"weight_dtype={s.weight_dtype!r}: the quantized kernel sums 1-4 rows and more in two "
                           "orders")),
    Refusal(DETERMINISTIC, FLOAT16, "deterministic",
            _det(lambda s: f"dtype={s.dtype!r}: the kernels compute float32 and bfloat16")),
    Refusal(DETERMINISTIC, MASS, "kv_eviction",
            _det(lambda s: f"kv_eviction {s.eviction.name}: its attention mass takes the torch path")),
    Refusal(TENSOR_PARALLEL, REMOTE_KV, "tensor_parallel_size",
            lambda s: "tensor_parallel_size > 1 does not go with remote_kv (yet): each rank's blocks would need "
                      "their own keys in the shared tier"),
    Refusal(DETERMINISTIC, TP_OVER_2, "tensor_parallel_size",
            lambda s: f"deterministic=True goes with tensor_parallel_size up to 2 on CPU, got {s.tensor_parallel}: "
                      "a ring all-reduce of 3+ ranks sums in an order that depends on the batch's size"),
    Refusal(EVICTS, WINDOW, "kv_eviction",
            lambda s: f"kv_eviction {s.eviction.describe()} does not go with a model whose layers read a sliding "
                      f"window (or a chunk) of {s.window} tokens: the cache releases what falls behind it already"),
    Refusal(KEY_BOUNDS, WINDOW, "kv_read_budget",
            lambda s: f"kv_read_budget does not go with a model of local layers (a window or chunk of "
                      f"{s.window} tokens) yet"),
    Refusal(SEGMENTS, WINDOW, "segments",
            lambda s: f"a prompt of segments does not go with a model of local layers (a window or chunk of "
                      f"{s.window} tokens) yet"),
    Refusal(DETERMINISTIC, WINDOW, "deterministic",
            _det(lambda s: f"a model of local layers (a window or chunk of {s.window} tokens): its attention takes "
                           "the torch path")),
    Refusal(EVICTS, STATE_LAYERS, "kv_eviction",
            lambda s: f"kv_eviction {s.eviction.describe()} does not go with state-space layers: a block of their "
                      "group holds the state every later token reads"),
    Refusal(KEY_BOUNDS, STATE_LAYERS, "kv_read_budget",
            lambda s: "kv_read_budget does not go with state-space layers yet"),
    Refusal(SEGMENTS, STATE_LAYERS, "segments",
            lambda s: "a prompt of segments does not go with state-space layers: a state cannot be re-positioned"),
    Refusal(DETERMINISTIC, STATE_LAYERS, "deterministic",
            _det(lambda s: "a model of state-space layers: its mixers are not batch-invariant kernels yet")),
    Refusal(CPU_OFFLOAD, STATE_LAYERS, "cpu_offload_memory",
            lambda s: "cpu_offload_memory does not go with state-space layers yet (a model of no attention "
                      "layers included: its one group holds states, not KV)"),
    Refusal(REMOTE_KV, STATE_LAYERS, "remote_kv",
            lambda s: "remote_kv does not go with state-space layers yet: the shared tier keeps KV blocks"),
    Refusal(VERIFY_KV, STATE_LAYERS, "verify_kv_every",
            lambda s: "verify_kv_every does not go with state-space layers yet: the check recomputes KV"),
    Refusal(CPU_OFFLOAD, GROUPS, "cpu_offload_memory",
            lambda s: f"cpu_offload_memory does not go with a model of {s.kv_groups} KV-cache groups (layers of "
                      "mixed kinds) yet: the CPU tier keeps one group's blocks"),
    Refusal(REMOTE_KV, GROUPS, "remote_kv",
            lambda s: f"remote_kv does not go with a model of {s.kv_groups} KV-cache groups (layers of mixed "
                      "kinds) yet: the shared tier keeps one group's blocks"),
    Refusal(VERIFY_KV, GROUPS, "verify_kv_every",
            lambda s: f"verify_kv_every does not go with a model of {s.kv_groups} KV-cache groups yet: the check "
                      "recomputes one group's blocks"),
    Refusal(TENSOR_PARALLEL, GROUPS, "tensor_parallel_size",
            lambda s: f"tensor_parallel_size > 1 does not go with a model of {s.kv_groups} KV-cache groups yet"),
    Refusal(TENSOR_PARALLEL, VERIFY_KV_DET, "verify_kv_every",
            lambda s: "tensor_parallel_size > 1 does not go with verify_kv_every under deterministic (the check "
                      "recomputes prefixes on rank 0 alone)"),
)  # fmt: skip


def model_facts(specs: Sequence[LayerSpec]) -> dict:
    """What a loaded model brings to the table (its layers' specs, core/kv_spec.py): its widest local
    reach (a sliding window, or a chunk: Llama 4's layers read at most their chunk), and its KV-cache groups."""
    windows = [s.window if isinstance(s, SlidingWindow) else s.chunk for s in specs
               if isinstance(s, SlidingWindow | ChunkedLocal)]  # fmt: skip
    return {
        "window": max(windows, default=0),
        "kv_groups": len(group_layers(specs)),
        "state_layers": any(s.kind == "state" for s in specs),
    }


def refusal_of(setup: Setup) -> tuple[Refusal, str] | None:
    """The first refusal that applies to `setup`, and its message; None if everything goes together."""
    for r in REFUSALS:
        if r.a.on(setup) and r.b.on(setup):
            return r, r.why(setup)
    return None


def check(setup: Setup) -> None:
    """ParameterError naming the field of the first refusal that applies."""
    found = refusal_of(setup)
    if found is not None:
        raise ParameterError(found[0].field, found[1])


def example(*features: Feature) -> Setup:
    """A Setup with these features on (and nothing else changed)."""
    s = Setup()
    for f in features:
        s = replace(s, **f.example)
    return s
