"""Two baselines that the seed documents measure a KV cache against, as real code on the same model,
the same attention backend and the same sampler as the engine. They exist to be measured against
(benchmarks/), never to serve.

    NoCacheGenerator      seed 003 §2: no KV cache. Every step runs the model over each whole
                          sequence again (prompt and everything generated so far), recomputing every
                          key and value, and keeps nothing between steps.
    StaticCacheGenerator  seed 003 §3: a contiguous cache pre-allocated per request to a maximum
                          length (`cache_k[:b, start:end]`): one slab of max_len slots per batch
                          slot and layer, reserved whether a request fills it or not. The slab is
                          a run of consecutive blocks of the backend's layout (one contiguous
                          piece of memory per request), so the same attention kernels read it at
                          the same speed; only what is reserved differs from the paged cache.

Both generate a batch together, one token per sequence per step, for `max_tokens` tokens (stopping
early only at an end-of-sequence token unless `ignore_eos`), sampling with the engine's sampler and
its per-request seeded generators: greedy output equals the paged engine's (tests check it), and a
seeded request draws the same random numbers.
"""

from __future__ import annotations

import torch

from kvpage.attention import AttentionMetadata
from kvpage.attention.layer_kv import LayerKV
from kvpage.core.block import cdiv
from kvpage.models.llama import LlamaForCausalLM
from kvpage.sampling_params import SamplingParams
from kvpage.worker.fused_decode import step_forward
from kvpage.worker.sampler import SamplingRow, sample, seeded_generator


class _Generator:
    def __init__(self, model: LlamaForCausalLM, eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.model = model
        self._forward = step_forward(model)  # fused decode steps where the runner fuses them too
        self.cfg = model.config
        self.dtype = model.dtype
        self.device = model.device
        self.eos = eos_token_ids

    def _allocate(self, num_slots: int, slot_len: int) -> list[LayerKV]:
        backend, cfg = self.model.attention_backend, self.cfg
        return [backend.allocate_kv(num_slots, cfg.num_kv_heads, slot_len, cfg.head_dim, self.dtype, "auto",
                                    self.device) for _ in range(cfg.num_layers)]  # fmt: skip

    def _run(self, chunks: list[list[int]], starts: list[int], tables: list[list[int]], block_size: int,
             kv) -> torch.Tensor:  # fmt: skip
        """Run `chunks[i]` at positions starts[i].. of the sequence whose blocks are `tables[i]`: last-token logits."""
        order = sorted(range(len(chunks)), key=lambda i: len(chunks[i]) > 1)  # one-token queries first
        ids = [t for i in order for t in chunks[i]]
        positions = [p for i in order for p in range(starts[i], starts[i] + len(chunks[i]))]
        meta = AttentionMetadata.build([len(chunks[i]) for i in order], [starts[i] + len(chunks[i]) for i in order],
                                       [tables[i] for i in order], block_size, self.device)  # fmt: skip
        hidden = self._forward(torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device),
                               kv, meta)  # fmt: skip
        last = torch.tensor(meta.query_start_loc[1:], device=self.device) - 1
        logits = self.model.compute_logits(hidden[last]).float()
        out = torch.empty_like(logits)
        out[torch.tensor(order, device=self.device)] = logits
        return out

    def _sample(self, logits, params: list[SamplingParams], seqs, prompts, gens) -> list[int]:
        rows = [SamplingRow(logits_row=i, temperature=q.temperature, top_p=q.top_p, top_k=q.top_k, min_p=q.min_p,
                            presence_penalty=q.presence_penalty, frequency_penalty=q.frequency_penalty,
                            repetition_penalty=q.repetition_penalty, prompt_token_ids=list(p),
                            output_token_ids=s[len(p):], generator=g)
                for i, (q, s, p, g) in enumerate(zip(params, seqs, prompts, gens, strict=True))]  # fmt: skip
        return [t.token_id for t in sample(logits, rows)]

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Each prompt's generated token ids (`params`: one for all, or one per prompt)."""
        plist = list(params) if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        for q in plist:
            if q.n != 1:
                raise ValueError("the baselines generate one sequence per prompt (n=1)")
            if q.max_tokens is None:
                raise ValueError("the baselines need max_tokens")
        gens = [seeded_generator(q.seed if q.seed is not None else 0, 0) for q in plist]
        self._begin(prompts, max(q.max_tokens for q in plist))
        seqs = [list(p) for p in prompts]
        live = list(range(len(prompts)))
        logits = self._first_logits(seqs)
        while True:
            tokens = self._sample(logits, [plist[i] for i in live], [seqs[i] for i in live],
                                  [prompts[i] for i in live], [gens[i] for i in live])  # fmt: skip
            for i, tok in zip(live, tokens, strict=True):
                seqs[i].append(tok)
            live = [i for i, tok in zip(live, tokens, strict=True)
                    if (plist[i].ignore_eos or tok not in self.eos)
                    and len(seqs[i]) - len(prompts[i]) < plist[i].max_tokens]  # fmt: skip
            if not live:
                break
            logits = self._next_logits(seqs, live)
        return [s[len(p) :] for s, p in zip(seqs, prompts, strict=True)]


class NoCacheGenerator(_Generator):
    """No KV cache: each step recomputes every key and value of every live sequence."""

    def _begin(self, prompts, max_tokens) -> None:
        pass

    def _first_logits(self, seqs) -> torch.Tensor:
        return self._next_logits(seqs, list(range(len(seqs))))

    @torch.inference_mode()
    def _next_logits(self, seqs, live) -> torch.Tensor:
        longest = max(len(seqs[i]) for i in live)
        scratch = self._allocate(len(live), longest)  # the attention API writes K/V; dropped at once
        return self._run([seqs[i] for i in live], [0] * len(live), [[i] for i in range(len(live))], longest, scratch)


class StaticCacheGenerator(_Generator):
    """A contiguous cache of `max_len` slots per batch slot, allocated for `max_batch` requests up front."""

    def __init__(self, model, max_batch: int, max_len: int, eos_token_ids: frozenset[int] = frozenset(),
                 block_size: int = 16) -> None:  # fmt: skip
        super().__init__(model, eos_token_ids)
        self.max_batch, self.block_size = max_batch, block_size
        self.blocks_per_slot = cdiv(max_len, block_size)
        self.max_len = self.blocks_per_slot * block_size
        self.kv = self._allocate(max_batch * self.blocks_per_slot, block_size)
        self.used_tokens = 0  # slots holding KV at the last step of the last generate()

    def _slab(self, i: int) -> list[int]:
        """Batch slot i's slab: its consecutive blocks."""
        return list(range(i * self.blocks_per_slot, (i + 1) * self.blocks_per_slot))

    @property
    def reserved_slots(self) -> int:
        return self.max_batch * self.max_len

    def _begin(self, prompts, max_tokens) -> None:
        if len(prompts) > self.max_batch:
            raise ValueError(f"{len(prompts)} prompts, but the static cache has {self.max_batch} slots")
        longest = max(len(p) for p in prompts) + max_tokens
        if longest > self.max_len:
            raise ValueError(f"a sequence of {longest} tokens does not fit a static slot of {self.max_len}")

    @torch.inference_mode()
    def _first_logits(self, seqs) -> torch.Tensor:
        self.used_tokens = sum(map(len, seqs))
        return self._run(seqs, [0] * len(seqs), [self._slab(i) for i in range(len(seqs))], self.block_size, self.kv)

    @torch.inference_mode()
    def _next_logits(self, seqs, live) -> torch.Tensor:
        self.used_tokens = sum(map(len, seqs))
        return self._run([seqs[i][-1:] for i in live], [len(seqs[i]) - 1 for i in live], [self._slab(i) for i in live],
                         self.block_size, self.kv)  # fmt: skip
