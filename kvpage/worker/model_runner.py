"""The model runner: executes one scheduled step on the model and the paged KV cache.

    SchedulerOutput -> (swap out, swap in, copy-on-write) -> build_inputs -> model -> ModelRunnerOutput

It returns the logits of each sequence's last scheduled token and prompt log-probabilities when
asked. Sequences are opaque names here (`ScheduledSequence.seq_id`); the worker never interprets them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvpage.core.remote_tier import RemoteTier
from kvpage.core.scheduler_output import SchedulerOutput, SeqKey
from kvpage.models.llama import LlamaForCausalLM
from kvpage.worker.fused_decode import step_forward
from kvpage.worker.input_builder import build_inputs
from kvpage.worker.kv_cache import KVCache
from kvpage.worker.selective import selective_recompute


@dataclass(slots=True)
class ModelRunnerOutput:
    seq_ids: list[SeqKey]  # the sequences whose last-token logits are returned, in row order
    logits: torch.Tensor  # [len(seq_ids), vocab] float32
    # (seq_id, position of the chunk's first token) -> [len(chunk), vocab] float32 log-softmax; row i is
    # the distribution of the token after token i (a sequence may run several chunks in a step: segments)
    prompt_logprobs: dict[tuple[SeqKey, int], torch.Tensor] = field(default_factory=dict)
    # H2O: seq_id -> attention mass each entry of its block table received, per head and layer
    attention_mass: dict[SeqKey, list[float]] = field(default_factory=dict)

    def logits_of(self, seq_id: SeqKey) -> torch.Tensor:
        return self.logits[self.seq_ids.index(seq_id)]


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        device: str | torch.device = "cpu",
        remote: RemoteTier | None = None,  # the shared tier the step's new blocks are written through to
        group=None,  # a tensor-parallel rank's group (kvpage/distributed): H2O's mass is summed over it
        computes_logits: bool = True,  # False on the ranks other than 0: they run the layers, rank 0 samples
    ):
        self.model = model
        self.group, self.computes_logits = group, computes_logits
        # set once a step's last collective is done (under tensor parallelism a failure after it is rank
        # 0's alone: the batch fails, the ranks stay in step; before it, the group cannot go on)
        self.collectives_done = True
        self.kv_cache = kv_cache
        self.remote = remote
        self.device = torch.device(device)
        # the fast path for pure decode steps on the CPU kernels where it can apply (fused_decode.py)
        self.forward = step_forward(model)
        self.timings = {"copy": 0.0, "prepare": 0.0, "forward": 0.0}  # seconds, summed over steps
        # CacheBlend (selective.py): reused tokens that took part, and those recomputed past its check layer
        self.selective_tokens = {"candidates": 0, "recomputed": 0}
        # decodes within a read budget (attention/key_bounds.py): the blocks each read per bounded layer
        # and kv head, and those in its context, summed over such decodes
        self.budget_blocks = {"read": 0, "context": 0}

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        kv = self.kv_cache
        t0 = time.perf_counter()
        kv.demote(step.demotions)  # blocks an eviction policy demoted: their sources may be reused below
        kv.offload(step.offload)  # evicted prefix blocks to the CPU tier, before they are reused
        kv.land(step.fetched)  # blocks fetched from the shared tier, into the CPU tier
        kv.restore(step.restore)  # CPU-tier hits into their new blocks
        kv.swap_out(step.swap_out)  # read the victims' blocks before anything can overwrite them
        kv.swap_in(step.swap_in)
        kv.copy_blocks(step.copies)
        kv.rotate_blocks(step.rotations, self.model.rotary.inv_freq)  # sources are resident by now
        kv.copy_slots(step.slot_copies, self.model.rotary.inv_freq)  # a prompt's segments, reused
        t1 = time.perf_counter()
        if not step.sequences:
            self._write_through(step)
            return ModelRunnerOutput([], torch.empty(0))
        inputs = build_inputs(step.sequences, kv.block_size, self.device)
        t2 = time.perf_counter()
        selective = selective_recompute(inputs.sequences, inputs.meta, self.model.config.num_layers)
        if selective is None:
            hidden = self.forward(inputs.input_ids, inputs.positions, kv.layers, inputs.meta)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, kv.layers, inputs.meta, selective)
            self.selective_tokens["candidates"] += selective.num_candidates
            self.selective_tokens["recomputed"] += selective.num_kept
        mass, cold = self._attention_mass(inputs.meta)  # (a collective under tensor parallelism: every rank)
        self.collectives_done = True
        if not self.computes_logits:
            self._write_through(step)
            return ModelRunnerOutput([], torch.empty(0))
        logits = self.model.compute_logits(hidden[inputs.logits_index]).float()
        self._count_budget_blocks(inputs.meta)
        out = ModelRunnerOutput(inputs.logits_seq_ids, logits)
        if mass is not None:
            cfg = self.model.config
            heads = cfg.num_heads * (self.group.size if self.group is not None else 1)  # every rank's heads
            per = mass / (cfg.num_layers * heads)
            cold = cold / (cfg.num_layers * heads) if cold is not None else None
            for row, s in enumerate(inputs.sequences):
                if s.want_mass:  # the table's entries, then the demoted blocks (read in that order)
                    out.attention_mass[s.seq_id] = per[row, : len(s.block_table)].tolist() + (
                        cold[row, : len(s.cold_blocks)].tolist() if cold is not None else [])  # fmt: skip
        start = 0
        for s in inputs.sequences:
            end = start + len(s.token_ids)
            if s.prompt_logprobs:
                chunk_logits = self.model.compute_logits(hidden[start:end]).float()
                out.prompt_logprobs[(s.seq_id, s.num_computed)] = torch.log_softmax(chunk_logits, dim=-1)
            start = end
        self._write_through(step)
        t3 = time.perf_counter()
        self.timings["copy"] += t1 - t0
        self.timings["prepare"] += t2 - t1
        self.timings["forward"] += t3 - t2
        return out

    def _attention_mass(self, meta):
        """H2O's attention mass of the step's blocks (and demoted blocks), summed over this rank's heads
        and layers, then over every rank's: eviction ranks blocks by all heads, on every rank alike."""
        mass, cold = meta.block_mass, meta.cold_mass
        if mass is not None and self.group is not None:
            self.group.all_reduce(mass)
            if cold is not None:
                self.group.all_reduce(cold)
        return mass, cold

    def _count_budget_blocks(self, meta) -> None:
        if meta.read_blocks is None:
            return
        bs = meta.block_size
        for want, n in zip(meta.read_blocks.tolist(), meta.seq_lens_list, strict=True):
            if want:
                blocks = -(-n // bs)
                self.budget_blocks["read"] += min(want, blocks)
                self.budget_blocks["context"] += blocks

    def _write_through(self, step: SchedulerOutput) -> None:
        """The blocks this step wrote, to the shared tier (their KV is complete once the forward ran)."""
        if self.remote is None or not step.write_through:
            return
        payloads = self.kv_cache.read_blocks([b for b, _, _ in step.write_through])
        self.remote.store([(d, t, p) for (_, d, t), p in zip(step.write_through, payloads, strict=True)])
