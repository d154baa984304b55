"""Step hooks: what a feature does around the model runner's forward, plugged in by the builder.

The runner knows no feature; it calls each hook at five points of a step:

    layer_hook(inputs)        before the forward: a LayerHook for the model's layers, or None
                              (CacheBlend, worker/selective.py; a step with one runs the model
                              layer by layer instead of the fused decode)
    before_forward()          the last thing before the forward, which runs without the GIL: work
                              given to another Python thread here runs beside the forward, not
                              between steps (the server hands out the last step's outputs here)
    after_forward(inputs)     every rank, right after the forward (H2O's mass summed over ranks)
    report(inputs, out)       where the logits are computed (rank 0): add to the step's output
    after_step(step)          every step, with a forward or without (the remote tier's write-through)

Each hook owns its own counters (read by the engine's stats: `ModelRunner.hook(kind)`).
"""

from __future__ import annotations

from kvpage.core.scheduler_output import SchedulerOutput


class StepHook:
    """Does nothing at every point: a hook overrides the points it needs."""

    def layer_hook(self, inputs):
        return None

    def before_forward(self) -> None:
        pass

    def after_forward(self, inputs) -> None:
        pass

    def report(self, inputs, out) -> None:
        pass

    def after_step(self, step: SchedulerOutput) -> None:
        pass


class AttentionMass(StepHook):
    """H2O's attention mass (core/eviction): summed over every rank's heads (a collective: every rank
    takes part), then per sequence that wants it, averaged over heads and layers, into the output in
    the order the eviction windows read it (ReadPlan.reported_mass)."""

    def __init__(self, num_layers: int, heads: int, group=None) -> None:
        self.divisor = num_layers * heads * (group.size if group is not None else 1)  # every rank's heads
        self.group = group

    def after_forward(self, inputs) -> None:
        if self.group is not None and inputs.meta.reads.mass is not None:
            inputs.meta.reads.all_reduce(self.group)

    def report(self, inputs, out) -> None:
        reads = inputs.meta.reads
        if reads.mass is None:
            return
        for row, s in enumerate(inputs.sequences):
            if s.want_mass:
                out.attention_mass[s.seq_id] = reads.reported_mass(row, len(s.block_table), self.divisor)


class ReadBudgetCount(StepHook):
    """Decodes within a read budget (attention/key_bounds.py): the blocks each read per bounded layer
    and kv head, and those in its context, summed over such decodes."""

    def __init__(self) -> None:
        self.blocks = {"read": 0, "context": 0}

    def report(self, inputs, out) -> None:
        meta = inputs.meta
        if meta.reads.budgets is None:
            return
        bs = meta.block_size
        for want, n in zip(meta.reads.budgets.tolist(), meta.seq_lens_list, strict=True):
            if want:
                blocks = -(-n // bs)
                self.blocks["read"] += min(want, blocks)
                self.blocks["context"] += blocks


class WriteThrough(StepHook):
    """The blocks a step wrote, to the shared tier (core/remote_tier.py: their KV is complete once
    the forward ran)."""

    def __init__(self, remote, kv_cache) -> None:
        self.remote, self.kv_cache = remote, kv_cache

    def after_step(self, step: SchedulerOutput) -> None:
        if not step.write_through:
            return
        payloads = self.kv_cache.read_blocks([b for b, _, _ in step.write_through])
        self.remote.store([(d, t, p) for (_, d, t), p in zip(step.write_through, payloads, strict=True)])
