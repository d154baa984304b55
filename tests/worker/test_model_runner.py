"""The model runner on the real model: prompt log-probabilities, and the KV copies that the core
plans for copy-on-write and swap, performed in the real KV tensors, against transformers."""

from __future__ import annotations

import torch

from kvpage.core.scheduler_output import ScheduledSequence, SchedulerOutput
from tests.worker.driver import assert_pool_clean, make_runner


def hf_continue(hf, tokens: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([tokens]), max_new_tokens=n, do_sample=False)
    return out[0, len(tokens) :].tolist()


def run(runner, mgr, seqs, seq_id, new_tokens, *, swap_out=(), swap_in=(), prompt_logprobs=False):
    """Allocate, register and execute one step for one sequence; returns (output, copies).
    `seqs` maps each sequence to its token ids: the test owns them, as a request would."""
    start = mgr.num_tokens(seq_id) if mgr.has_sequence(seq_id) else 0
    alloc = mgr.allocate_slots(seq_id, len(new_tokens))
    assert alloc is not None
    seqs.setdefault(seq_id, []).extend(new_tokens)
    seq = ScheduledSequence(seq_id, new_tokens, start, mgr.block_table(seq_id), prompt_logprobs=prompt_logprobs)
    mgr.cache_blocks(seq_id, seqs[seq_id], seq.seq_len)
    out = runner.execute(SchedulerOutput([seq], alloc.copies, list(swap_out), list(swap_in)))
    mgr.commit()
    mgr.check_invariants(seqs)
    return out, alloc.copies


def argmax(out, seq_id) -> int:
    return int(torch.argmax(out.logits_of(seq_id)))


def test_prompt_logprobs_match_transformers(smollm2, prompts, hf_f32):
    runner, mgr = make_runner(smollm2, 16, 16)
    seqs: dict[str, list[int]] = {}
    p = prompts[2]
    out, _ = run(runner, mgr, seqs, "p", p, prompt_logprobs=True)
    with torch.no_grad():
        ref = torch.log_softmax(hf_f32(torch.tensor([p])).logits[0].float(), -1)
    assert out.prompt_logprobs[("p", 0)].shape == (len(p), smollm2.config.vocab_size)
    torch.testing.assert_close(out.prompt_logprobs[("p", 0)], ref, atol=2e-4, rtol=1e-4)
    mgr.free("p")
    assert_pool_clean(mgr)


def test_forked_sequences_copy_the_shared_partial_block_and_stay_correct(smollm2, prompts, hf_f32):
    runner, mgr = make_runner(smollm2, 32, 16)
    seqs: dict[str, list[int]] = {}
    p = prompts[3] + prompts[5]  # 4 + 15 tokens: the last block is partly filled
    assert len(p) % 16 != 0
    out, _ = run(runner, mgr, seqs, "a", p)
    first = argmax(out, "a")
    mgr.fork("a", "b")
    seqs["b"] = list(seqs["a"])
    assert mgr.stats().shared_blocks == len(mgr.block_table("a"))
    # the two samples continue with different tokens; the first writer gets a copy of the shared block
    out_a, copies_a = run(runner, mgr, seqs, "a", [first])
    out_b, copies_b = run(runner, mgr, seqs, "b", [first + 1])
    assert len(copies_a) == 1 and copies_b == []
    tokens = {"a": [first, argmax(out_a, "a")], "b": [first + 1, argmax(out_b, "b")]}
    for _ in range(6):
        for s in ("a", "b"):
            out, copies = run(runner, mgr, seqs, s, [tokens[s][-1]])
            assert copies == []
            tokens[s].append(argmax(out, s))
    assert tokens["a"][1:] == hf_continue(hf_f32, p + [first], 7)
    assert tokens["b"][1:] == hf_continue(hf_f32, p + [first + 1], 7)
    mgr.free("a")
    mgr.free("b")
    assert_pool_clean(mgr)


def test_swap_out_overwrite_swap_in_continues_correctly(smollm2, prompts, hf_f32):
    runner, mgr = make_runner(smollm2, 6, 16, num_cpu_blocks=4, enable_prefix_caching=False)
    seqs: dict[str, list[int]] = {}
    p = prompts[0]  # about 40 tokens: 3 blocks
    out, _ = run(runner, mgr, seqs, "a", p)
    tokens = [argmax(out, "a")]
    pairs = mgr.swap_out(["a"])
    assert pairs is not None and len(pairs) == 3
    # another request takes every device block, overwriting a's KV there
    other = (prompts[7] + prompts[6] + prompts[2])[:90]
    out_o, _ = run(runner, mgr, seqs, "o", other, swap_out=pairs)
    assert sorted(mgr.block_table("o")) == list(range(6))
    mgr.free("o")
    del seqs["o"]
    back = mgr.swap_in(["a"])
    out, _ = run(runner, mgr, seqs, "a", [tokens[-1]], swap_in=back)
    tokens.append(argmax(out, "a"))
    for _ in range(4):
        out, _ = run(runner, mgr, seqs, "a", [tokens[-1]])
        tokens.append(argmax(out, "a"))
    assert tokens[1:] == hf_continue(hf_f32, p + tokens[:1], 5)
    mgr.free("a")
    assert_pool_clean(mgr)
