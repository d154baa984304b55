"""The sampler on hand-made logits: each setting changes exactly what it should."""

from __future__ import annotations

import math

import pytest
import torch

from kvpage.worker.sampler import SamplingRow, _apply_penalties, _filter, exponential_noise, sample


def row(**kw) -> SamplingRow:
    kw.setdefault("logits_row", 0)
    return SamplingRow(**kw)


def test_greedy_takes_the_argmax_and_reports_logprobs():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    (tok,) = sample(logits, [row(temperature=0.0, num_logprobs=2)])
    assert tok.token_id == 1 and tok.rank == 1
    lp = torch.log_softmax(logits[0], -1)
    assert math.isclose(tok.logprob, float(lp[1]), rel_tol=1e-6)
    assert [t for t, _ in tok.top] == [1, 2]


def test_repetition_presence_frequency_penalties():
    x = torch.tensor([2.0, -2.0, 1.0, 0.5])
    out = _apply_penalties(x.clone(), row(repetition_penalty=2.0, prompt_token_ids=[0], output_token_ids=[1]))
    assert out.tolist() == [1.0, -4.0, 1.0, 0.5]  # positive divided, negative multiplied, unseen untouched
    out = _apply_penalties(x.clone(), row(presence_penalty=0.5, frequency_penalty=0.25, output_token_ids=[2, 2, 3]))
    assert out.tolist() == [2.0, -2.0, 1.0 - 0.5 - 0.5, 0.5 - 0.5 - 0.25]


def test_banned_tokens_cannot_be_chosen():
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    (tok,) = sample(logits, [row(temperature=0.0, banned_token_ids=[0])])
    assert tok.token_id == 1


def test_top_k_top_p_min_p_keep_the_right_support():
    x = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    keep = lambda r: (_filter(x.clone(), r) > float("-inf")).tolist()  # noqa: E731
    assert keep(row(top_k=2)) == [True, True, False, False]
    assert keep(row(top_p=0.7)) == [True, True, False, False]  # 0.5 < 0.7, 0.75 >= 0.7
    assert keep(row(top_p=0.5)) == [True, False, False, False]
    assert keep(row(min_p=0.35)) == [True, True, False, False]  # kept: p >= 0.35 * 0.5
    assert keep(row()) == [True, True, True, True]


def test_sampling_follows_the_distribution_and_the_generator():
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    logits = torch.log(probs)[None].expand(1, 4)
    g = torch.Generator().manual_seed(0)
    counts = [0] * 4
    for _ in range(3000):
        counts[sample(logits, [row(generator=g)])[0].token_id] += 1
    assert counts[3] == 0
    assert abs(counts[0] / 3000 - 0.6) < 0.04 and abs(counts[1] / 3000 - 0.3) < 0.04
    a = [sample(logits, [row(generator=torch.Generator().manual_seed(5))])[0].token_id for _ in range(5)]
    assert len(set(a)) == 1  # the same seed, the same draw
    # a row's draw does not depend on the other rows in the batch
    two = torch.cat([logits, torch.log(torch.tensor([[0.25, 0.25, 0.25, 0.25]]))])
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    alone = [sample(logits, [row(generator=g1)])[0].token_id for _ in range(20)]
    batched = [sample(two, [row(logits_row=1, generator=torch.Generator()), row(generator=g2)])[1].token_id
               for _ in range(20)]  # fmt: skip
    assert alone == batched


def test_random_draws_depend_on_the_seed_not_on_the_logits_device():
    old = torch.empty(6).exponential_(generator=torch.Generator().manual_seed(3))  # the draw before the fix
    g = torch.Generator().manual_seed(3)
    on_cpu = exponential_noise(6, g, "cpu")
    assert on_cpu.device.type == "cpu" and on_cpu.dtype == torch.float32 and torch.equal(on_cpu, old)
    assert torch.equal(exponential_noise(6, torch.Generator().manual_seed(3), torch.device("cpu")), old)
    # a CPU generator serves logits on any device: the draw still comes from it, and moves there
    g_meta, g_cpu = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    on_meta = exponential_noise(6, g_meta, "meta")
    assert on_meta.device.type == "meta" and on_meta.shape == (6,)
    exponential_noise(6, g_cpu, "cpu")
    assert torch.equal(g_meta.get_state(), g_cpu.get_state())  # the generator advanced exactly as on the CPU
    assert torch.equal(exponential_noise(4, g_meta, "cpu"), exponential_noise(4, g_cpu, "cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sampling_logits_on_cuda_gives_the_cpu_tokens():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    settings = [
        dict(temperature=0.8, top_k=10),
        dict(temperature=1.0, top_p=0.9, repetition_penalty=1.3, prompt_token_ids=[1, 2], output_token_ids=[3, 3]),
        dict(temperature=0.0, frequency_penalty=0.5, output_token_ids=[7], banned_token_ids=[4], num_logprobs=2),
    ]
    results = []
    for device in ("cpu", "cuda"):
        rows = [row(logits_row=i, generator=torch.Generator().manual_seed(i), **kw) for i, kw in enumerate(settings)]
        results.append([(t.token_id, t.rank) for t in sample(logits.to(device), rows)])
    assert results[0] == results[1]
