"""What the KV cache holds, checked (seed 003 §6.1's `verify_cache`).

Two checks, on the blocks of the GPU pool that hold KV someone may read (blocks of running
sequences and cached prefix blocks, free or not):

    range       every filled slot of every layer is finite (int8 blocks: levels within -127..127,
                scales finite and >= 0): a NaN or Inf written once would be served to every hit
    recompute   deterministic mode only, where it must hold bit for bit: a sample of cached prefix
                chains (a registered block and every registered block before it) is computed again
                from its tokens into a scratch cache, in one chunk, and compared with the pool:
                the proof that a hit serves exactly what a miss would compute

A mismatch names the block, the sequences holding it and the layer. The engine counts checked
blocks and mismatches (`/metrics`: kvpage:kv_verify_*), and `kvpage serve --verify-kv-every N`
runs a check every N steps on the engine thread, between steps (never while one runs).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from kvpage.core.scheduler_output import ScheduledSequence
from kvpage.worker.input_builder import build_inputs
from kvpage.worker.kv_cache import KVCache


@dataclass(slots=True, frozen=True)
class KVMismatch:
    block_id: int
    layer: int
    check: str  # "range" | "recompute"
    holders: tuple[str, ...]  # the sequences whose tables hold the block ("request#index"); empty: cached only
    detail: str

    def __str__(self) -> str:
        who = ", ".join(self.holders) if self.holders else "no sequence (a cached prefix block)"
        return f"block {self.block_id}, layer {self.layer} ({who}): {self.check}: {self.detail}"


@dataclass(slots=True)
class KVVerifyReport:
    blocks_checked: int = 0  # blocks whose values were range-checked
    blocks_recomputed: int = 0  # blocks compared with a recompute (deterministic mode)
    mismatches: list[KVMismatch] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches


def verify_kv_cache(engine, sample: int = 4, seed: int = 0) -> KVVerifyReport:
    """Range-check every used block; in deterministic mode recompute `sample` cached chains too."""
    kv, cache, bs = engine.kv_manager, engine.kv_cache, engine.kv_cache.block_size
    holders: dict[int, list[str]] = {}
    written: dict[int, int] = {}  # slots of a block whose KV some step wrote (allocated slots may be stale)
    for seq_id in kv.seq_ids():
        if kv.is_swapped(seq_id):
            continue
        req = engine.scheduler.requests.get(seq_id.request_id)
        computed = req.sequences[seq_id.index].num_computed if req is not None else 0
        for j, b in enumerate(kv.block_table(seq_id)):
            if b is not None:  # (a hole: an eviction policy released it)
                holders.setdefault(b, []).append(f"{seq_id.request_id}#{seq_id.index}")
                written[b] = max(written.get(b, 0), min(bs, max(0, computed - j * bs)))
    cached = [b for _, b in kv.prefix_cache.items()] if kv.prefix_cache is not None else []
    for b in cached:  # a registered block is written: all of it, or a tail block's leading tokens
        written[b.block_id] = len(b.cache_key.token_ids)
    used = sorted(set(holders) | {b.block_id for b in cached})
    report = KVVerifyReport(blocks_checked=len(used))
    if used:
        filled = torch.tensor([written.get(b, 0) for b in used])
        for layer, lkv in enumerate(cache.layers):
            for block_id, detail in _out_of_range(lkv, used, filled):
                report.mismatches.append(KVMismatch(block_id, layer, "range", tuple(holders.get(block_id, ())), detail))
    if engine.config.deterministic and sample > 0 and cached:
        # the ends of chains (no registered block continues them): their chains cover every other block
        parents = {b.cache_key.parent for b in cached}
        leaves = [b for b in cached if b.cache_key.digest not in parents]
        random.Random(seed).shuffle(leaves)
        chains = [c for c in (kv.prefix_cache.chain(b) for b in leaves[:sample]) if c is not None]
        compared: set[int] = set()  # a block shared by several chains is compared once
        for chain in chains:
            fresh = [i for i, b in enumerate(chain) if b.block_id not in compared]
            compared.update(chain[i].block_id for i in fresh)
            report.blocks_recomputed += len(fresh)
            for block_id, layer, detail in _recompute(engine, chain, fresh):
                report.mismatches.append(KVMismatch(block_id, layer, "recompute", tuple(holders.get(block_id, ())),
                                                    detail))  # fmt: skip
    return report


def _out_of_range(lkv, ids: list[int], filled: torch.Tensor):
    """(block id, why) for the blocks of `ids` with a bad value in a filled slot of this layer."""
    index = torch.tensor(ids, device=lkv.k.device)
    bs = lkv.k.shape[2]
    mask = torch.arange(bs)[None, :] < filled[:, None]  # [blocks, slots]
    for name, t in zip(("K", "V"), lkv.tensors()[:2], strict=True):  # (fp8 as its bytes: torch cannot index it)
        x = t.index_select(0, index).cpu()  # [blocks, kv_heads, block_size, head_dim]
        # [blocks, slots]: a value that is not finite (int8: a level outside the quantizer's -127..127;
        # fp8 e4m3fn: the NaN bytes 0x7f / 0xff, it has no infinity)
        if lkv.kv_dtype == "int8":
            bad = (x == -128).any(-1).any(1)
        elif lkv.kv_dtype == "fp8":
            bad = ((x & 0x7F) == 0x7F).any(-1).any(1)
        else:
            bad = ~torch.isfinite(x).all(-1).all(1)
        if lkv.quantized:
            scale = (lkv.k_scale if name == "K" else lkv.v_scale).index_select(0, index).cpu()
            bad = bad | ~(torch.isfinite(scale) & (scale >= 0)).all(1)
        for row in (bad & mask).any(1).nonzero().flatten().tolist():
            slot = int((bad[row] & mask[row]).nonzero()[0])
            yield ids[row], f"{name} of slot {slot} is not a finite value in range"


def _recompute(engine, chain, compare: list[int]) -> list[tuple[int, int, str]]:
    """Compute the chain's tokens again into a scratch cache, one chunk, and compare every layer of
    the chain's blocks at the positions `compare`."""
    bs, model = engine.kv_cache.block_size, engine.runner.model
    tokens = [t for b in chain for t in b.cache_key.token_ids]
    first = engine.kv_cache.layers[0]
    scratch = KVCache(model.config, len(chain), bs, model.dtype, first.k.device,
                      kv_cache_dtype=engine.kv_cache.kv_cache_dtype, backend=model.attention_backend)  # fmt: skip
    step = ScheduledSequence("verify", tokens, 0, list(range(len(chain))), return_logits=False)
    inputs = build_inputs([step], bs, first.k.device)
    with torch.no_grad():
        model(inputs.input_ids, inputs.positions, scratch.layers, inputs.meta)
    out = []
    for layer, (real, fresh) in enumerate(zip(engine.kv_cache.layers, scratch.layers, strict=True)):
        for i in compare:
            block = chain[i]
            n = len(block.cache_key.token_ids)  # (a tail block: only its leading slots are written)
            for name, a, b in zip(("K", "V", "K scales", "V scales"), real.tensors(), fresh.tensors(), strict=False):
                x, y = a[block.block_id][:, :n], b[i][:, :n]  # [kv_heads, slots, ...]
                if not torch.equal(x, y):
                    diff = (x.float() - y.float()).abs().max().item()
                    out.append((block.block_id, layer, f"{name} differ from a recompute of its {len(tokens)}-token "
                                                       f"prefix (max |diff| {diff:.3g})"))  # fmt: skip
                    break
    return out
