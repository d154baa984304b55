"""A minimal greedy generation loop over the real core and the real model runner, for tests.

It plays the scheduler's part in the simplest way (no preemption, a pool big enough for all):
each step every sequence gets its next prompt chunk, or its last sampled token; blocks come from
`KVCacheManager.allocate_slots`, prefix-cache hits from `find_cached_prefix`. As the scheduler does,
it registers the full blocks a step computes (`cache_blocks`) as soon as the step is planned, so a
prompt arriving later in the same step hits them, and commits after the step ran. A partial prefix
hit's block copy goes to the worker with the step. The driver owns
each sequence's tokens (the manager only counts them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpage.core import KVCacheManager
from kvpage.core.scheduler_output import ScheduledSequence, SchedulerOutput
from kvpage.worker.model_runner import ModelRunner


@dataclass
class GreedyResult:
    tokens: list[list[int]]  # generated tokens per prompt
    first_logits: list[torch.Tensor]  # logits of each prompt's last token
    hit_tokens: list[int] = field(default_factory=list)  # prompt tokens served from the prefix cache


def greedy_generate(
    runner: ModelRunner,
    mgr: KVCacheManager,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    chunk_size: int | None = None,
    free_at_end: bool = True,
    start_steps: list[int] | None = None,
) -> GreedyResult:
    """`start_steps[i]`: the step at which prompt i arrives, so prefills and decodes share forwards."""
    ids = [f"g{i}" for i in range(len(prompts))]
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    generated: list[list[int]] = [[] for _ in prompts]
    first: list[torch.Tensor | None] = [None] * len(prompts)
    hits = [0] * len(prompts)
    start_steps = start_steps or [0] * len(prompts)
    step_no = -1
    while any(len(g) < max_new_tokens for g in generated):
        step_no += 1
        step, copies = [], []
        for i, seq_id in enumerate(ids):
            if len(generated[i]) >= max_new_tokens or start_steps[i] > step_no:
                continue
            prefix = None
            if not mgr.has_sequence(seq_id):
                if mgr.num_groups > 1:  # (several groups start from every group's hits: admission's way)
                    computed[i] = hits[i] = _admit_groups(mgr, seq_id, tokens[i], chunk_size)
                else:
                    prefix = mgr.find_cached_prefix(tokens[i])
                    computed[i] = hits[i] = prefix.num_tokens
            end = len(tokens[i]) if chunk_size is None else min(len(tokens[i]), computed[i] + chunk_size)
            num_slots = mgr.num_tokens(seq_id) if prefix is None else prefix.num_tokens
            alloc = mgr.allocate_slots(seq_id, max(0, end - num_slots), prefix)
            assert alloc is not None, "the test pool must be large enough"
            assert prefix is not None or not alloc.copies  # (no forks here; a partial prefix hit copies)
            copies.extend(alloc.copies)
            mgr.cache_blocks(seq_id, tokens[i], end)  # hits for prompts planned after this one
            step.append(entry(mgr, seq_id, tokens[i][computed[i] : end], computed[i], end == len(tokens[i])))
        out = runner.execute(SchedulerOutput(step, copies=copies))
        mgr.commit()
        for s in step:
            i = ids.index(s.seq_id)
            computed[i] = s.seq_len
            if s.return_logits:
                logits = out.logits_of(s.seq_id)
                if first[i] is None:
                    first[i] = logits
                nxt = int(torch.argmax(logits))
                generated[i].append(nxt)
                tokens[i].append(nxt)
        mgr.check_invariants({seq_id: t for seq_id, t in zip(ids, tokens, strict=True) if mgr.has_sequence(seq_id)})
    if free_at_end:
        for seq_id in ids:
            mgr.free(seq_id)
    return GreedyResult(generated, first, hits)  # type: ignore[arg-type]


def make_runner(lm, num_blocks: int, block_size: int, **mgr_kw) -> tuple[ModelRunner, KVCacheManager]:
    """A model runner with a KV cache of `num_blocks` blocks, and the manager that owns those blocks
    (one block table per KV-cache group of the model's layers)."""
    from kvpage.worker.kv_cache import KVCache

    dtype = next(lm.model.parameters()).dtype
    kv = KVCache(lm.config, num_blocks, block_size, dtype, num_cpu_blocks=mgr_kw.get("num_cpu_blocks", 0))
    mgr_kw.setdefault("watermark", 0.0)
    mgr_kw.setdefault("group_specs", [g.spec for g in lm.config.kv_groups])
    return ModelRunner(lm.model, kv), KVCacheManager(num_blocks, block_size, **mgr_kw)


def entry(mgr: KVCacheManager, seq_id, token_ids: list[int], num_computed: int, return_logits: bool = True,
          **kw) -> ScheduledSequence:  # fmt: skip
    """A step's entry for a sequence as the manager holds it: group 0's table, and every other group's
    resident blocks after the tokens its window released (as `KVCacheManager.prepare_step` gives them)."""
    groups = []
    for g in range(1, mgr.num_groups):
        table = mgr.block_table(seq_id, g)
        resident = [b for b in table if b is not None]
        groups.append((resident, (len(table) - len(resident)) * mgr.block_size))
    view, num_evicted = mgr.attention_table(seq_id)
    return ScheduledSequence(seq_id, list(token_ids), num_computed, view, return_logits, num_evicted=num_evicted,
                             group_tables=groups, **kw)  # fmt: skip


def _admit_groups(mgr: KVCacheManager, seq_id, tokens: list[int], chunk_size: int | None) -> int:
    """A new sequence of a model of several groups, admitted with its hits in every group and slots up to
    its first chunk's end (no partial hit: nothing to copy). Returns the tokens it hits."""
    adm = mgr.check_admission([tokens])
    hit = adm.prefix.num_tokens
    if chunk_size is not None and hit + chunk_size < len(tokens):  # (the same hits: at least one token more)
        adm = mgr.check_admission([tokens[: hit + chunk_size]])
        assert adm.prefix.num_tokens == hit
    assert mgr.admit([seq_id], [tokens[: hit + (chunk_size or len(tokens))]], adm) == []
    return hit


def assert_pool_clean(mgr: KVCacheManager) -> None:
    mgr.check_invariants()
    st = mgr.stats()
    assert st.used_blocks == 0 and st.cpu_used_blocks == 0 and st.num_seqs == 0


def decode_logits(lm, tokens: list[int], prompt_len: int, block_size: int = 16) -> torch.Tensor:
    """float32 logits [len(tokens) - prompt_len + 1, vocab]: the prompt's last position from one
    prefill, then each later token fed alone as a decode step (teacher forcing: the given tokens,
    not sampled ones), so every decode-path kernel runs."""
    from kvpage.worker.input_builder import build_inputs
    from kvpage.worker.kv_cache import KVCache

    assert len(lm.config.kv_groups) == 1, "decode_logits runs a model of one KV-cache group"
    num_blocks = -(-len(tokens) // block_size)
    mgr = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
    kv = KVCache(lm.config, num_blocks, block_size, next(lm.model.parameters()).dtype)
    out, done = [], 0
    with torch.inference_mode():
        while done < len(tokens):
            new = tokens[done:prompt_len] if done == 0 else tokens[done : done + 1]
            assert mgr.allocate_slots("s", len(new)) is not None
            inputs = build_inputs([ScheduledSequence("s", list(new), done, mgr.block_table("s"))], block_size, "cpu")
            hidden = lm.model(inputs.input_ids, inputs.positions, kv.layers, inputs.meta)
            out.append(lm.model.compute_logits(hidden[inputs.logits_index]).float()[0])
            done += len(new)
    mgr.free("s")
    assert_pool_clean(mgr)
    return torch.stack(out)
