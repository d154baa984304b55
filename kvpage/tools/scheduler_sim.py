"""A model-free simulation of the scheduler: random workloads, no torch, every step checked.

It plays the engine's and the worker's parts with plain Python. The worker is a token-level model of
the KV memory (each slot holds the token id whose K/V it stores): it applies the step's swaps and
copy-on-write copies, writes every scheduled token into its slot, and only then reads back, through
its block table, the whole context each scheduled sequence attends to — exactly the order the model
uses (each layer writes the step's K/V before any sequence attends). The engine's part samples
random tokens, forks parallel samples, runs a toy beam search (forks and prunes), stops sequences at
random and aborts requests. Some workloads give requests an eviction policy (StreamingLLM, H2O, or
Demote, with pools of lower precisions: the worker makes the step's demotions first of all, then the
swaps, copies, sink rotations and a prompt's segment copies, in its own order) and H2O's attention
mass at random; some send documents, then prompts made of them as segments (core/segments.py), whose
cached KV is copied slot by slot instead of computed. Some run on layers that read a sliding window or
chunks (kv_spec.py): the manager releases what no later query reads. After every step it checks:

    the scheduler raised nothing;  check_invariants() holds;  every context read back is the
    sequence's own tokens (those of its resident blocks, then of its demoted ones), every key its
    layers' window reads among them;  a step with
    work left made progress (tokens, swaps, or an ending) within a few steps;  a request fails only
    with a reason and only when it really cannot fit

and at the end: every request finished or failed, and no block is in use (nor any demoted one).

    python -m kvpage.tools.scheduler_sim --seeds 5000      # the long fuzz (make test-slow)
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass, field

from kvpage.core.block import cdiv
from kvpage.core.eviction import H2O, Demote, EvictionPolicy, StreamingLLM
from kvpage.core.kv_cache_manager import KVCacheManager
from kvpage.core.kv_spec import FULL, ChunkedLocal, LayerSpec, RecurrentState, SlidingWindow
from kvpage.core.request import Request
from kvpage.core.scheduler import Scheduler
from kvpage.core.scheduler_output import SchedulerOutput
from kvpage.core.segments import segment_spans
from kvpage.core.seq_plan import plan_of
from kvpage.core.step_update import RequestUpdate, SeqUpdate

EOS = 0
MAX_IDLE_STEPS = 3  # steps in a row with work left and nothing happening before it counts as a hang


class SimulationError(AssertionError):
    """The scheduler broke a promise; the message names the seed and the step."""


def copy_slots(mem: dict[int, int], runs: list[tuple[int, int, int, int]]) -> None:
    """A prompt's segments copied slot by slot (src slot, dst slot, length, shift): the shift rotates
    keys, so in token terms a copy."""
    for src, dst, n, _ in runs:
        for i in range(n):
            if src + i in mem:
                mem[dst + i] = mem[src + i]
            else:
                mem.pop(dst + i, None)


def copy_blocks(src: dict[int, int], dst: dict[int, int], pairs: list[tuple[int, int]], block_size: int) -> None:
    """Copy whole blocks between slot -> token maps, as the worker copies K/V (empty slots too)."""
    for s, d in pairs:
        for off in range(block_size):
            if s * block_size + off in src:
                dst[d * block_size + off] = src[s * block_size + off]
            else:
                dst.pop(d * block_size + off, None)


@dataclass(slots=True)
class Workload:
    seed: int
    num_blocks: int
    block_size: int
    num_cpu_blocks: int
    enable_prefix_caching: bool
    preemption_mode: str | None
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    watermark: float
    # id, prompt, width, beam, max_tokens, arrive, abort_at, salt; optional: eviction (a policy),
    # segments (lengths of the prompt's segments), recompute_blocks, recompute_ratio
    requests: list[dict] = field(default_factory=list)
    cold_blocks: dict[str, int] = field(default_factory=dict)  # pools of the precisions Demote demotes to
    layer_spec: LayerSpec = FULL  # what the layers read (a window or chunks: the manager releases blocks)
    # a model of several KV-cache groups: what each group's layers read (then `layer_spec` is unused)
    group_specs: tuple[LayerSpec, ...] = ()

    @property
    def specs(self) -> tuple[LayerSpec, ...]:
        return self.group_specs or (self.layer_spec,)


def make_workload(seed: int) -> Workload:
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 8, 16])
    num_blocks = rng.randint(3, 48)
    swap = rng.random() < 0.5
    w = Workload(
        seed=seed,
        num_blocks=num_blocks,
        block_size=bs,
        num_cpu_blocks=rng.randint(num_blocks // 2, 2 * num_blocks) if swap else 0,
        enable_prefix_caching=rng.random() < 0.7,
        preemption_mode=rng.choice(["swap", None]) if swap else rng.choice(["recompute", None]),
        max_num_seqs=rng.choice([3, 6, 8, 16, 64]),
        max_num_batched_tokens=rng.choice([1, 3, 8, 16, 32, 64, 512, 512]),
        max_model_len=rng.randint(4, num_blocks * bs + 8),
        watermark=rng.choice([0.0, 0.0, 0.05, 0.2]),
    )
    shared = [rng.randrange(1, 50) for _ in range(rng.randint(0, 3 * bs))]  # a common system prompt
    for i in range(rng.randint(1, 12)):
        own = [rng.randrange(1, 50) for _ in range(rng.randint(1, 3 * bs + 4))]
        prompt = (shared if rng.random() < 0.6 else []) + own
        beam = rng.random() < 0.25
        width = rng.choice([1, 1, 2, 3, 4, 6]) if rng.random() < 0.6 else 1
        w.requests.append(
            dict(
                id=f"r{i}",
                prompt=prompt,
                width=width,
                beam=beam,
                max_tokens=rng.randint(1, 6 * bs + 8),
                arrive=rng.randint(0, 12),
                abort_at=rng.randint(1, 60) if rng.random() < 0.15 else None,
                salt=rng.choice([None, None, "s"]),
            )
        )
    _add_features(w, random.Random(seed * 104729 + 17))
    _add_layer_window(w, random.Random(seed * 15485863 + 5))
    # a pool most requests fit alone, but not all together: preemption is the rule, not the exception
    need = [r["width"] * cdiv(len(r["prompt"]) + r["max_tokens"], bs) for r in w.requests]
    w.num_blocks = rng.randint(max(3, min(need)), max(4, max(need), sum(need) // 2))
    w.num_cpu_blocks = rng.randint(w.num_blocks // 2, 2 * w.num_blocks) if swap else 0
    w.max_model_len = rng.randint(4, w.num_blocks * bs + 8) if rng.random() < 0.3 else w.num_blocks * bs
    return w


def _policy(rng: random.Random, bs: int) -> EvictionPolicy:
    """A tiny eviction policy (windows of a block or two, so that it bites)."""
    kind = rng.choice(["streaming", "h2o", "demote", "demote"])
    if kind == "streaming":
        return StreamingLLM(sink_tokens=rng.randint(0, bs), window_tokens=rng.randint(1, 2 * bs))
    if kind == "h2o":
        return H2O(heavy_tokens=rng.randint(0, 2 * bs), recent_tokens=rng.randint(1, 2 * bs))
    return Demote(hot_tokens=rng.randint(0, bs), int8_tokens=rng.randint(0, 2 * bs), int4_tokens=rng.randint(0, 2 * bs),
                  recent_tokens=rng.randint(1, 2 * bs), cpu_tokens=rng.choice([0, 0, bs]))  # fmt: skip


def _add_features(w: Workload, rng: random.Random) -> None:
    """Eviction policies and prompts of segments, for some workloads: drawn from their own stream, so
    that the others stay what they were."""
    bs = w.block_size
    if rng.random() < 0.3:  # some requests bound their memory
        for r in w.requests:
            if rng.random() < 0.6:
                r["eviction"] = _policy(rng, bs)
        if any(isinstance(r.get("eviction"), Demote) for r in w.requests):
            w.cold_blocks = {"int8": rng.randint(0, 4), "int4": rng.randint(0, 4), "cpu": rng.randint(0, 2)}
    if rng.random() < 0.3:  # documents first, then prompts that give them as segments
        docs = [[rng.randrange(1, 50) for _ in range(rng.randint(1, 3 * bs + 2))] for _ in range(rng.randint(1, 3))]
        salt = rng.choice([None, None, "s"])
        for j, doc in enumerate(docs):
            w.requests.append(dict(id=f"d{j}", prompt=list(doc), width=1, beam=False, max_tokens=rng.randint(1, 4),
                                   arrive=rng.randint(0, 4), abort_at=None, salt=salt))  # fmt: skip
        for i in range(rng.randint(1, 4)):
            first = [rng.randrange(1, 50) for _ in range(rng.randint(1, bs + 1))]
            middle = [rng.choice(docs) for _ in range(rng.randint(1, 2))]
            question = [rng.randrange(1, 50) for _ in range(rng.randint(1, bs + 1))]
            parts = [first, *middle, question]
            w.requests.append(dict(
                id=f"g{i}", prompt=[t for g in parts for t in g], segments=[len(g) for g in parts],
                recompute_blocks=rng.choice([0, 0, 1]), recompute_ratio=rng.choice([0.0, 0.0, 0.25]),
                width=rng.choice([1, 1, 2]), beam=rng.random() < 0.2, max_tokens=rng.randint(1, 2 * bs + 4),
                arrive=rng.randint(2, 14), abort_at=rng.randint(3, 60) if rng.random() < 0.1 else None, salt=salt,
            ))  # fmt: skip


def _add_layer_window(w: Workload, rng: random.Random) -> None:
    """For some workloads without eviction policies or segments: layers that read a sliding window
    or chunks of a few blocks, or keep a recurrent state (their own stream: the other workloads stay what they were)."""
    if rng.random() < 0.3 and not any(r.get("eviction") or r.get("segments") for r in w.requests):
        reach = rng.randint(1, 3 * w.block_size)
        kind = rng.random()  # (a state-space layer's state: a window of two tokens, whatever the reach)
        w.layer_spec = SlidingWindow(reach) if kind < 0.5 else ChunkedLocal(reach) if kind < 0.8 else RecurrentState()
        if rng.random() < 0.5:  # a full-attention group beside it (Gemma's, Qwen2's layers)
            w.group_specs = (FULL, w.layer_spec)


@dataclass(slots=True)
class _ReqSim:
    spec: dict
    pending: dict[int, int] = field(default_factory=dict)  # beams: index -> proposed token
    num_generated: int = 0


class Simulation:
    def __init__(self, w: Workload) -> None:
        self.w = w
        self.rng = random.Random(w.seed * 7919 + 1)
        self.kv = KVCacheManager(
            w.num_blocks,
            w.block_size,
            num_cpu_blocks=w.num_cpu_blocks,
            enable_prefix_caching=w.enable_prefix_caching,
            watermark=w.watermark,
            cold_blocks=w.cold_blocks,
            layer_spec=w.layer_spec,
            group_specs=w.group_specs,
        )
        self.sched = Scheduler(
            self.kv,
            max_num_seqs=w.max_num_seqs,
            max_num_batched_tokens=w.max_num_batched_tokens,
            max_model_len=w.max_model_len,
            preemption_mode=w.preemption_mode,
        )
        self.gpu: dict[int, int] = {}  # slot -> token id
        self.cpu: dict[int, int] = {}
        self.cold: dict[str, dict[int, int]] = {p: {} for p in w.cold_blocks}  # demoted blocks, per precision
        self.sims: dict[str, _ReqSim] = {}
        self.ended: dict[str, str | None] = {}  # request id -> failure reason (None: finished or aborted)
        self.step_no = 0

    def fail(self, message: str) -> SimulationError:
        return SimulationError(f"seed {self.w.seed}, step {self.step_no}: {message}")

    # ------------------------------------------------------------------ the driver
    def run(self, max_steps: int = 3000) -> dict:
        idle = 0
        specs = sorted(self.w.requests, key=lambda r: r["arrive"])
        while self.step_no < max_steps:
            for spec in [s for s in specs if s["arrive"] == self.step_no]:
                self._add(spec)
            for rid, sim in list(self.sims.items()):
                if sim.spec["abort_at"] == self.step_no and rid in self.sched.requests:
                    self.sched.abort_request(rid)
                    self.ended[rid] = None
                    del self.sims[rid]
            if not self.sched.has_unfinished() and self.step_no > max(r["arrive"] for r in specs):
                break
            before = len(self.ended)
            out = self.sched.schedule()
            self.sched.check_invariants()
            self._execute(out)
            updates = self._decide(out)
            result = self.sched.update_from_output(out, updates, self._mass(out))
            self.sched.check_invariants()
            for rid in result.finished:
                self.ended[rid] = None
                self.sims.pop(rid, None)
            for rid, reason in result.failed.items():
                self._check_failure(rid, reason)
                self.ended[rid] = reason
                self.sims.pop(rid, None)
            progressed = out.num_tokens or out.swap_in or out.swap_out or len(self.ended) > before
            idle = 0 if progressed or not self.sched.has_unfinished() else idle + 1
            if idle >= MAX_IDLE_STEPS:
                raise self.fail(f"no progress for {idle} steps with work left: {self._state()}")
            self.step_no += 1
        else:
            raise self.fail(f"not done after {max_steps} steps: {self._state()}")
        missing = {r["id"] for r in specs} - set(self.ended)
        if missing:
            raise self.fail(f"requests never ended: {sorted(missing)}")
        st = self.kv.stats()
        cold = {p: pool.num_total - pool.num_free for p, pool in self.kv.eviction.cold.items()}
        if st.used_blocks or st.cpu_used_blocks or self.kv.seq_ids() or any(cold.values()):
            raise self.fail(f"blocks still in use at the end: {st}, demoted {cold}")
        self.kv.check_invariants()
        failed = sum(r is not None for r in self.ended.values())
        ev = self.kv.eviction
        return {"steps": self.step_no, "failed": failed, "preemptions": self.sched.num_preemptions,
                "evicted_tokens": ev.num_evicted_tokens, "demoted_blocks": sum(ev.num_demoted.values()),
                "segment_tokens_copied": self.kv.num_segment_tokens_copied}  # fmt: skip

    def _state(self) -> str:
        s = self.sched
        return (
            f"running={[r.request_id for r in s.running]} waiting={[r.request_id for r in s.waiting]} "
            f"swapped={[r.request_id for r in s.swapped]} free={self.kv.pool.num_free}/{self.kv.pool.num_total}"
        )

    def _add(self, spec: dict) -> None:
        spans = segment_spans(spec["segments"]) if spec.get("segments") else ()
        req = Request(
            spec["id"],
            list(spec["prompt"]),
            self.step_no,
            cache_salt=spec["salt"],
            width=spec["width"],
            independent=spec["width"] > 1 and not spec["beam"],  # as the engine makes parallel samples
            eviction=spec.get("eviction"),
            plan=plan_of(spans, spec.get("recompute_blocks", 1), spec.get("recompute_ratio", 0.0)),
        )
        self.sched.add_request(req)
        self.sims[spec["id"]] = _ReqSim(spec)

    def _check_failure(self, rid: str, reason: str) -> None:
        """A failure must say why, and only a request that cannot fit (or be scheduled) may fail."""
        if not reason:
            raise self.fail(f"{rid} failed without a reason")
        spec = next(r for r in self.w.requests if r["id"] == rid)
        w, bs = self.w, self.w.block_size
        longest = min(len(spec["prompt"]) + spec["max_tokens"], w.max_model_len)
        at_once = 1 if spec["width"] > 1 and not spec["beam"] else spec["width"]  # a sample need only fit alone
        fits = at_once * cdiv(longest, bs) * len(w.specs) <= w.num_blocks  # (every group, the whole prompt)
        schedulable = len(spec["prompt"]) <= w.max_model_len and spec["width"] <= min(
            w.max_num_seqs, w.max_num_batched_tokens
        )
        if fits and schedulable:
            raise self.fail(f"{rid} fits the pool but failed: {reason}")

    # ------------------------------------------------------------------ the worker
    def _execute(self, out: SchedulerOutput) -> None:
        """The worker's order (worker/model_runner.py): demotions first of all (their sources may be
        reused below), swaps, copy-on-write, sink rotations, segment copies, then the forward."""
        bs = self.w.block_size
        for src_p, src, dst_p, dst in out.demotions:  # one after another: a block a move frees may be a later one's
            pools = {"hot": self.gpu, **self.cold}
            copy_blocks(pools[src_p], pools[dst_p], [(src, dst)], bs)
        copy_blocks(self.gpu, self.cpu, out.swap_out, bs)
        copy_blocks(self.cpu, self.gpu, out.swap_in, bs)
        copy_blocks(self.gpu, self.gpu, out.copies, bs)
        copy_blocks(self.gpu, self.gpu, [(s, d) for s, d, _ in out.rotations], bs)  # (rotated keys: same tokens)
        copy_slots(self.gpu, out.slot_copies)
        for s in out.sequences:  # every layer writes the step's K/V first (positions past the evicted ones) ...
            for table, missing in [(s.block_table, s.num_evicted), *s.group_tables]:  # (each group's layers)
                for pos, tok in enumerate(s.token_ids, start=s.num_computed - missing):
                    self.gpu[table[pos // bs] * bs + pos % bs] = tok
        for s in out.sequences:  # ... then each sequence attends to its whole context: resident blocks, then demoted
            req = self.sched.requests[s.seq_id.request_id]
            tokens = req.sequences[s.seq_id.index].token_ids
            want, demoted = tokens[: s.seq_len], {}
            if s.num_evicted:  # holes: blocks its policy dropped or demoted (which: the table's own record)
                logical = self.kv.block_table(s.seq_id)
                want = [t for i, t in enumerate(want) if logical[i // bs] is not None]
                demoted = self.kv._table(s.seq_id).demoted
            seen = [self.gpu.get(s.block_table[p // bs] * bs + p % bs) for p in range(s.kv_len)]
            if seen != want:
                raise self.fail(f"{s.seq_id} attends to {seen}, not its tokens {want}")
            for spec, (table, missing) in zip(self.w.specs, [(s.block_table, s.num_evicted), *s.group_tables],
                                              strict=True):  # fmt: skip
                first = spec.first_visible(s.num_computed)  # the step's first query reads from here
                if spec is not FULL and missing > first // bs * bs:
                    raise self.fail(f"{s.seq_id} lost keys its window reads: {missing} missing, reads from {first}")
                if table is not s.block_table:  # (group 0 was read above: a policy's holes too)
                    seen = [self.gpu.get(table[p // bs] * bs + p % bs) for p in range(s.seq_len - missing)]
                    if seen != tokens[missing : s.seq_len]:  # (a window's group: from its first held block)
                        raise self.fail(f"{s.seq_id} attends to {seen} in a group, not its tokens {tokens[missing:]}")
            if len(s.cold_blocks) != len(demoted):
                raise self.fail(f"{s.seq_id} attends to demoted blocks {s.cold_blocks}, not its {demoted}")
            for (p, b), i in zip(s.cold_blocks, sorted(demoted), strict=True):
                seen = [self.cold[p].get(b * bs + o) for o in range(bs)]
                if seen != tokens[i * bs : (i + 1) * bs]:
                    raise self.fail(f"{s.seq_id} attends to {seen} in its demoted block {i} ({p} {b}), "
                                    f"not its tokens {tokens[i * bs : (i + 1) * bs]}")  # fmt: skip

    def _mass(self, out: SchedulerOutput) -> dict:
        """H2O's (and Demote's) attention mass: a random share for each entry the step read."""
        return {s.seq_id: [self.rng.random() for _ in range(len(s.block_table) + len(s.cold_blocks))]
                for s in out.sequences if s.want_mass}  # fmt: skip

    # ------------------------------------------------------------------ the engine
    def _decide(self, out: SchedulerOutput) -> dict[str, RequestUpdate]:
        rows: dict[str, list[int]] = {}
        for s in out.sequences:
            if s.return_logits:
                rows.setdefault(s.seq_id.request_id, []).append(s.seq_id.index)
        updates = {}
        for rid, indices in rows.items():
            req, sim = self.sched.requests[rid], self.sims[rid]
            update = RequestUpdate(rid)
            if sim.spec["beam"]:
                self._beam(req, sim, indices, update)
            else:
                self._sample(req, sim, indices, update)
            updates[rid] = update
        return updates

    def _token(self) -> int:
        return EOS if self.rng.random() < 0.015 else self.rng.randrange(1, 50)

    def _finish(self, sim: _ReqSim, seq, token: int) -> str | None:
        n_out = len(seq.output_token_ids) + 1
        if token == EOS:
            return "stop"
        if n_out >= sim.spec["max_tokens"] or len(seq.token_ids) + 1 >= self.w.max_model_len:
            return "length"
        return None

    def _sample(self, req, sim: _ReqSim, indices: list[int], update: RequestUpdate) -> None:
        targets = [(i, None, req.sequences[i]) for i in indices]
        if sim.spec["width"] > 1 and len(req.sequences) == 1 and not req.sequences[0].output_token_ids:
            targets += [(i, 0, req.sequences[0]) for i in range(1, sim.spec["width"])]
        for index, parent, seq in targets:
            tok = self._token()
            update.sequences.append(SeqUpdate(index, tok, parent, self._finish(sim, seq, tok)))

    def _beam(self, req, sim: _ReqSim, indices: list[int], update: RequestUpdate) -> None:
        """A toy beam search with the real one's shape: wait until every live beam has logits, then
        keep up to `width` continuations, several of them forks of one parent, and prune the rest."""
        for i in indices:
            sim.pending[i] = self._token()
        live = req.live_sequences
        if any(s.index not in sim.pending for s in live):
            return
        sim.num_generated += 1
        width = sim.spec["width"]
        if sim.num_generated >= sim.spec["max_tokens"] or any(
            len(s.token_ids) + 1 >= self.w.max_model_len for s in live
        ):
            for s in live:
                update.sequences.append(SeqUpdate(s.index, None, None, "stop"))
            sim.pending.clear()
            return
        parents = [self.rng.choice(live) for _ in range(self.rng.randint(1, width))]
        used: set[int] = set()
        next_index = len(req.sequences)
        for parent in parents:
            tok = self.rng.randrange(1, 50)
            if parent.index not in used:
                used.add(parent.index)
                update.sequences.append(SeqUpdate(parent.index, tok))
            else:
                update.sequences.append(SeqUpdate(next_index, tok, parent.index))
                next_index += 1
        for s in live:
            if s.index not in used:
                update.sequences.append(SeqUpdate(s.index, None, None, "abort"))
        sim.pending.clear()


def simulate(seed: int) -> dict:
    return Simulation(make_workload(seed)).run()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=1000)
    ap.add_argument("--start", type=int, default=0)
    args = ap.parse_args(argv)
    totals: dict[str, int] = {}
    for seed in range(args.start, args.start + args.seeds):
        for k, v in simulate(seed).items():
            totals[k] = totals.get(k, 0) + v
    print(f"{args.seeds} workloads: {totals['steps']} steps, {totals['preemptions']} preemptions, "
          f"{totals['failed']} requests failed alone (each could never fit), {totals['evicted_tokens']} tokens "
          f"evicted, {totals['demoted_blocks']} blocks demoted, {totals['segment_tokens_copied']} segment tokens "
          f"copied; every check held")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
