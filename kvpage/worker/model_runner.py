"""The model runner: executes one scheduled step on the model and the paged KV cache.

    SchedulerOutput -> (swap out, swap in, copy-on-write) -> build_inputs -> model -> ModelRunnerOutput

It returns the logits of each sequence's last scheduled token and prompt log-probabilities when
asked. Sequences are opaque names here (`ScheduledSequence.seq_id`); the worker never interprets them.
What a feature adds around the forward comes in as step hooks from the builder (step_hooks.py
says which there are and when each runs).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from kvpage.core.scheduler_output import SchedulerOutput, SeqKey
from kvpage.models.llama import LlamaForCausalLM
from kvpage.worker.fused_decode import step_forward
from kvpage.worker.input_builder import build_inputs
from kvpage.worker.kv_cache import KVCache
from kvpage.worker.step_hooks import StepHook

H = TypeVar("H", bound=StepHook)


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
        hooks: list[StepHook] | tuple[StepHook, ...] = (),  # what features add around the forward
        group=None,  # a tensor-parallel rank's group (kvpage/distributed)
        computes_logits: bool = True,  # False on the ranks other than 0: they run the layers, rank 0 samples
    ):
        self.model = model
        self.group, self.computes_logits = group, computes_logits
        # set once a step's last collective is done (under tensor parallelism a failure after it is rank
        # 0's alone: the batch fails, the ranks stay in step; before it, the group cannot go on)
        self.collectives_done = True
        self.kv_cache = kv_cache
        self.hooks = tuple(hooks)
        self.device = torch.device(device)
        # the fast path for pure decode steps on the CPU kernels where it can apply (fused_decode.py)
        self.forward = step_forward(model)
        self.timings = {"copy": 0.0, "prepare": 0.0, "forward": 0.0}  # seconds, summed over steps

    def add_hook(self, hook: StepHook) -> None:
        """One more step hook, after the builder's (the server's hand-off, kvpage/server/async_engine.py)."""
        self.hooks = (*self.hooks, hook)

    def hook(self, kind: type[H]) -> H | None:
        """Its step hook of this kind, if it has one (the engine's stats read their counters)."""
        return next((h for h in self.hooks if isinstance(h, kind)), None)

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
            self._after_step(step)
            return ModelRunnerOutput([], torch.empty(0))
        inputs = build_inputs(step.sequences, kv.block_size, self.device)
        t2 = time.perf_counter()
        layer_hook = next((h for h in (hook.layer_hook(inputs) for hook in self.hooks) if h is not None), None)
        meta = inputs.meta
        if inputs.group_metas:  # several KV-cache groups: each layer reads its group's tables
            metas = [inputs.meta, *inputs.group_metas]
            meta = [metas[g] for g in kv.layer_groups]
        for hook in self.hooks:
            hook.before_forward()
        if layer_hook is None:
            hidden = self.forward(inputs.input_ids, inputs.positions, kv.layers, meta)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, kv.layers, meta, layer_hook)
        for hook in self.hooks:
            hook.after_forward(inputs)  # (collectives under tensor parallelism: every rank)
        self.collectives_done = True
        if not self.computes_logits:
            self._after_step(step)
            return ModelRunnerOutput([], torch.empty(0))
        logits = self.model.compute_logits(hidden[inputs.logits_index]).float()
        out = ModelRunnerOutput(inputs.logits_seq_ids, logits)
        for hook in self.hooks:
            hook.report(inputs, out)
        start = 0
        for s in inputs.sequences:
            end = start + len(s.token_ids)
            if s.prompt_logprobs:
                chunk_logits = self.model.compute_logits(hidden[start:end]).float()
                out.prompt_logprobs[(s.seq_id, s.num_computed)] = torch.log_softmax(chunk_logits, dim=-1)
            start = end
        self._after_step(step)
        t3 = time.perf_counter()
        self.timings["copy"] += t1 - t0
        self.timings["prepare"] += t2 - t1
        self.timings["forward"] += t3 - t2
        return out

    def _after_step(self, step: SchedulerOutput) -> None:
        for hook in self.hooks:
            hook.after_step(step)
