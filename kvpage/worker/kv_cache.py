"""The physical KV cache: per layer, a `LayerKV` of every block, on the device and on the CPU.

The attention backend owns the layout (`AttentionBackend.allocate_kv`; the reference one is
[num_blocks, num_kv_heads, block_size, head_dim], head-major inside a block, so one head's blocks
gather into contiguous matrices; see attention/torch_ref.py). Everything here moves whole blocks
along dimension 0, whatever the layout. Repeated K/V heads of grouped-query attention are never
stored: a cache holds num_kv_heads heads only.

With a quantized KV dtype ("int8", "fp8"; kvpage/attention/kv_quant.py) each layer also holds the
scales, [num_blocks, num_kv_heads, block_size] float32 for K and for V: they belong to the block,
so copy-on-write, swap and every other move of a block carry them with it, bit for bit. The same
holds for the key bounds a read budget chooses blocks by (attention/key_bounds.py), kept past the
first DENSE_LAYERS layers when `key_bounds`; a slot copy (segments, sink rotation) recomputes them.

An engine whose eviction policy demotes blocks (core/eviction: Demote) also holds, per layer, a pool
of each lower precision (`cold_blocks`: {"int8": n, "int4": m, "cpu": c}; "cpu" holds int4 blocks
in host memory, the CPU-tier rung), hung on the layer as `LayerKV.cold`
so attention reads them; `demote` moves blocks down (read as float32, quantized into the new pool).

A model of several KV-cache groups (kv_spec.group_layers: Gemma's windows beside its global layers)
stores a block id's KV in a page of `page_layers` tensors (`pages`): the layer at slot j of its group
keeps its KV in page tensor j, so a block id names the same slots in every group's layers and the
block moves below (copy-on-write, swap) move whatever group holds it. `layers` are the model's
per-layer views of those tensors, each with its own window; for one group they are the pages.

For the shared tier (core/remote_tier.py) a block travels as bytes: every layer's tensors' slices of
it, in order (`read_blocks`), written back into CPU-tier blocks by `land`; `layout()` names that
format, so only caches of the same layout exchange blocks.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvpage.attention.backend import AttentionBackend
from kvpage.attention.int4_kv import Int4KV
from kvpage.attention.key_bounds import DENSE_LAYERS, refresh_bounds
from kvpage.attention.kv_quant import dequantize, quantize
from kvpage.attention.layer_kv import LayerKV, read_named_blocks
from kvpage.attention.torch_ref import TorchReferenceBackend
from kvpage.core.kv_bytes import demoted_bytes_per_block, kv_bytes_per_block
from kvpage.core.kv_spec import ChunkedLocal, SlidingWindow, page_layers
from kvpage.models.config import ModelConfig


def kv_dtype_name(kv_cache_dtype: str, dtype: torch.dtype) -> str:
    """The KV dtype a cache stores: the model's dtype for "auto", else the quantized one asked for."""
    if kv_cache_dtype == "auto":
        return str(dtype).removeprefix("torch.")
    return kv_cache_dtype


def check_state_fits(cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str) -> None:
    """A state-space layer keeps its state in its block's page (models/mamba.py): ParameterError naming
    block_size when a page is too small for it, with the smallest block size that fits (vLLM likewise
    raises the attention block size of hybrid models until a page holds a state)."""
    from kvpage.errors import ParameterError
    from kvpage.models.mamba import fits

    if kv_cache_dtype != "auto":
        raise ParameterError("kv_cache_dtype", f"kv_cache_dtype={kv_cache_dtype!r} does not go with state-space "
                             "layers yet: their state is kept in the model's dtype")  # fmt: skip
    per_token, size = cfg.num_kv_heads * cfg.head_dim, torch.empty(0, dtype=dtype).element_size()
    if not fits(cfg.mamba, per_token * block_size, size):
        need = next(b for b in range(block_size, 1 << 20) if fits(cfg.mamba, per_token * b, size))
        raise ParameterError("block_size", f"a block of {block_size} tokens cannot hold this model's state-space "
                             f"state in its page; use block_size >= {need}")  # fmt: skip


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        num_cpu_blocks: int = 0,
        kv_cache_dtype: str = "auto",
        num_tier_blocks: int = 0,
        backend: AttentionBackend | None = None,  # whose layout the blocks take (default: the reference's)
        key_bounds: bool = False,  # keep per-block key bounds past the dense layers (a read budget)
        cold_blocks: dict[str, int] | None = None,  # pools of demoted blocks per precision (Demote)
    ) -> None:
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        allocate = (backend or TorchReferenceBackend).allocate_kv
        pin = torch.device(device).type == "cuda"
        self.groups = cfg.kv_groups
        if len(self.groups) > 1 and (key_bounds or cold_blocks):
            raise ValueError("key bounds and demoted pools are for a model of one KV-cache group")
        if cfg.mamba is not None:
            check_state_fits(cfg, block_size, dtype, kv_cache_dtype)
        self.layer_groups = [0] * cfg.num_layers  # each model layer's group
        slots = list(range(cfg.num_layers))  # each model layer's page slot
        for g in self.groups:
            for j, layer in enumerate(g.layers):
                self.layer_groups[layer], slots[layer] = g.index, j

        def pool(n: int, where, pinned: bool = False) -> list[LayerKV]:
            pages = [allocate(n, cfg.num_kv_heads, block_size, cfg.head_dim, dtype, kv_cache_dtype, where, pinned)
                     for _ in range(page_layers(self.groups))]  # fmt: skip
            for page in pages[DENSE_LAYERS:] if key_bounds else []:
                page.keep_bounds()
            return pages

        self.pages = pool(num_blocks, device)
        windows = [spec.window if isinstance(spec, SlidingWindow) else 0 for spec in cfg.layer_specs]
        chunks = [spec.chunk if isinstance(spec, ChunkedLocal) else 0 for spec in cfg.layer_specs]
        softcap = float(cfg.attn_logit_softcapping or 0.0)
        if len(self.groups) == 1:  # (page slot j is layer j)
            for page, window, chunk in zip(self.pages, windows, chunks, strict=True):
                page.window, page.chunk, page.softcap = window, chunk, softcap
            self.layers = self.pages
        else:
            self.layers = [replace(self.pages[j], window=w, chunk=c, softcap=softcap)
                           for j, w, c in zip(slots, windows, chunks, strict=True)]  # fmt: skip
        self.cpu_layers = pool(num_cpu_blocks, "cpu", pin)  # (pages: the CPU pools hold blocks, read by no layer)
        self.tier_layers = pool(num_tier_blocks, "cpu", pin)  # the CPU tier of the prefix cache
        for precision, n in (cold_blocks or {}).items():
            for layer in self.layers:
                shape = (n, cfg.num_kv_heads, block_size, cfg.head_dim)
                if precision == "int8":
                    store = LayerKV.allocate(shape, dtype, precision, device)
                else:  # int4 on the device, or the CPU-tier rung's int4 in host memory
                    store = Int4KV.allocate(*shape, device, False) if precision == "int4" else \
                        Int4KV.allocate(*shape, "cpu", pin)  # fmt: skip
                layer.cold = {**(layer.cold or {}), precision: store}

    @staticmethod
    def bytes_per_block(
        cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto", key_bounds: bool = False
    ) -> int:
        name = kv_dtype_name(kv_cache_dtype, dtype)
        page = page_layers(cfg.kv_groups)  # (a block id's KV: one layer per page slot)
        bounded = max(0, page - DENSE_LAYERS) if key_bounds else 0
        return kv_bytes_per_block(page, cfg.num_kv_heads, cfg.head_dim, name, block_size, bounded)

    @staticmethod
    def demoted_bytes_per_block(cfg: ModelConfig, block_size: int, precision: str) -> int:
        return demoted_bytes_per_block(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, precision, block_size)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: device block src -> device block dst, every layer (scales included)."""
        if not pairs:
            return
        src, dst = self._index(pairs, self.pages[0].k.device)
        for layer in self.pages:
            for t in layer.tensors():
                t.index_copy_(0, dst, t.index_select(0, src))

    def demote(self, moves: list[tuple[str, int, str, int]]) -> None:
        """(src precision, src block, dst precision, dst block), "hot" naming the cache's own pool:
        each source read as float32 and written, quantized, into its destination, every layer. All
        sources are read before any destination is written (a move may free a block a later move of
        the same step writes: core/eviction/windows.py)."""
        if not moves:
            return
        device = self.layers[0].k.device
        for layer in self.layers:
            stores = {"hot": layer, **(layer.cold or {})}
            k, v = read_named_blocks(stores, [(m[0], m[1]) for m in moves], device)
            for precision in {m[2] for m in moves}:
                rows = [j for j, m in enumerate(moves) if m[2] == precision]
                ids = torch.tensor([moves[j][3] for j in rows], dtype=torch.int64, device=device)
                stores[precision].put(ids, k[rows], v[rows])

    def rotate_blocks(self, rotations: list[tuple[int, int, int]], inv_freq: torch.Tensor) -> None:
        """(src, dst, positions): dst's keys = src's keys rotated by `positions` more (RoPE, the
        model's rotate-half convention), values copied; every layer. StreamingLLM's sink blocks, seen
        at cache positions. Always from the unrotated original, in float32 (requantized if int8/fp8)."""
        bs = self.block_size  # (a block's rotation is a run of all its slots)
        self.copy_slots([(s * bs, d * bs, bs, p) for s, d, p in rotations], inv_freq)

    def copy_slots(self, runs: list[tuple[int, int, int, int]], inv_freq: torch.Tensor) -> None:
        """(src slot, dst slot, length, shift): `length` slots copied, keys rotated by `shift` positions
        more, every layer (a prompt's segments, reused where they now stand: core/segments.py).
        Rotated in float32 from the cached key, requantized if int8/fp8; values (and their scales)
        copied bit for bit. StreamingLLM's sink blocks are rotated as whole-block runs."""
        if not runs:
            return
        device = self.pages[0].k.device
        src = torch.cat([torch.arange(s, s + n) for s, _, n, _ in runs]).to(device)
        dst = torch.cat([torch.arange(d, d + n) for _, d, n, _ in runs]).to(device)
        shift = torch.cat([torch.full((n,), p, dtype=torch.float64) for _, _, n, p in runs]).to(device)
        bs = self.block_size
        sb, so, db, do = src // bs, src % bs, dst // bs, dst % bs
        angles = shift[:, None] * inv_freq.to(device=device, dtype=torch.float64)[None, :]  # [slots, d/2]
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]  # [slots, 1, d]
        cos, sin = angles.cos().float(), angles.sin().float()
        for layer in self.pages:
            k = layer.k[sb, :, so]  # [slots, kv_heads, d]
            k = dequantize(k, layer.k_scale[sb, :, so], torch.float32) if layer.quantized else k.float()
            half = k.shape[-1] // 2
            rotated = k * cos + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * sin
            if layer.quantized:
                q, scale = quantize(rotated, layer.kv_dtype)
                layer.k[db, :, do], layer.k_scale[db, :, do] = q, scale  # type: ignore[index]
                layer.v_scale[db, :, do] = layer.v_scale[sb, :, so]  # type: ignore[index]
            else:
                layer.k[db, :, do] = rotated.to(layer.k.dtype)
            values = layer.tensors()[1]
            values[db, :, do] = values[sb, :, so]
            if layer.bounded:
                refresh_bounds(layer, dst)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, cpu block) pairs."""
        self._transfer(self.pages, self.cpu_layers, pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(cpu block, device block) pairs."""
        self._transfer(self.cpu_layers, self.pages, pairs)

    def offload(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, tier block) pairs: evicted prefix blocks kept in the CPU tier."""
        self._transfer(self.pages, self.tier_layers, pairs)

    def restore(self, pairs: list[tuple[int, int]]) -> None:
        """(tier block, device block) pairs: CPU-tier prefix hits brought back."""
        self._transfer(self.tier_layers, self.pages, pairs)

    def layout(self) -> str:
        """The byte format of one block: each layer's tensors' dtype and per-block shape, runs of equal
        layers counted (the first layers keep no key bounds where the rest do)."""
        runs: list[list] = []
        for layer in self.pages:
            desc = ",".join(f"{t.dtype}{tuple(t.shape[1:])}" for t in layer.tensors())
            if runs and runs[-1][1] == desc:
                runs[-1][0] += 1
            else:
                runs.append([1, desc])
        return "+".join(f"{n}x[{desc}]" for n, desc in runs)

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        """The bytes of these device blocks (after the step that wrote them)."""
        if not block_ids:
            return []
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.pages[0].k.device)
        n = len(block_ids)
        parts = [t.index_select(0, idx).reshape(n, -1).view(torch.uint8).cpu() for layer in self.pages
                 for t in layer.tensors()]  # fmt: skip
        rows = torch.cat(parts, dim=1).numpy()
        return [rows[i].tobytes() for i in range(n)]

    def land(self, blocks: list[tuple[int, bytes]]) -> None:
        """(tier block, bytes from `read_blocks`): blocks fetched from the shared tier into the CPU tier."""
        if not blocks:
            return
        n = len(blocks)
        size = sum(t[0].numel() * t.element_size() for layer in self.tier_layers for t in layer.tensors())
        if any(len(p) != size for _, p in blocks):
            raise ValueError(f"a shared-tier block is not {size} bytes, the size of this cache's layout")
        rows = torch.frombuffer(bytearray().join(p for _, p in blocks), dtype=torch.uint8).view(n, size)
        idx = torch.tensor([b for b, _ in blocks], dtype=torch.int64)
        pos = 0
        for layer in self.tier_layers:
            for t in layer.tensors():
                width = t[0].numel() * t.element_size()
                part = rows[:, pos : pos + width].contiguous().view(t.dtype).view(n, *t.shape[1:])
                t.index_copy_(0, idx, part)
                pos += width

    @staticmethod
    def _index(pairs, device) -> tuple[torch.Tensor, torch.Tensor]:
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=device)
        return src, dst

    @classmethod
    def _transfer(cls, src_layers, dst_layers, pairs) -> None:
        if not pairs:
            return
        src, _ = cls._index(pairs, src_layers[0].k.device)
        _, dst = cls._index(pairs, dst_layers[0].k.device)
        for s_layer, d_layer in zip(src_layers, dst_layers, strict=True):
            for s, d in zip(s_layer.tensors(), d_layer.tensors(), strict=True):
                d.index_copy_(0, dst, s.index_select(0, src).to(d.device))
