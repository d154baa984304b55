"""Perplexity through the engine: the corpus is real text on the machine, the engine's figure
equals transformers' on the same windows, and weight quantization stays inside its gate."""

from __future__ import annotations

import math

import pytest
import torch

from kvpage.tools.perplexity import english_corpus, perplexity, windows_of
from tests.engine.helpers import assert_clean, make_llm

WINDOW, WINDOWS = 256, 3


@pytest.fixture(scope="module")
def tokens(smollm2) -> list[int]:
    return smollm2.tokenizer.encode(english_corpus())


def test_the_corpus_is_real_english_long_enough_and_the_same_each_time(tokens):
    text = english_corpus()
    assert text == english_corpus()
    assert len(tokens) >= 20_000
    assert "Python Software Foundation" in text and "Return a new" in text
    words = text.split()
    assert sum(w.isalpha() for w in words) / len(words) > 0.6  # mostly words, not code


def hf_nll(hf, wins: list[list[int]]) -> tuple[float, int]:
    nll, count = 0.0, 0
    with torch.no_grad():
        for win in wins:
            logits = hf(torch.tensor([win])).logits[0].float()
            lp = torch.log_softmax(logits[:-1], dim=-1)
            nll -= float(lp.gather(1, torch.tensor(win[1:])[:, None]).sum())
            count += len(win) - 1
    return nll, count


def test_engine_perplexity_equals_transformers_with_chunked_prefill(tokens, hf_f32):
    """Prefill chunks of 64 tokens: every later chunk reads the earlier ones back from the paged cache."""
    llm = make_llm(max_num_batched_tokens=64)
    ids = tokens[: WINDOW * WINDOWS]
    ours = perplexity(llm, ids, window=WINDOW)
    ref_nll, ref_count = hf_nll(hf_f32, windows_of(ids, WINDOW))
    assert ours.tokens == ref_count == WINDOWS * (WINDOW - 1)
    assert ours.nll_sum == pytest.approx(ref_nll, rel=1e-4)
    assert 2 < ours.perplexity < 60  # a trained model on English, not noise (vocabulary 49,152)
    assert_clean(llm)


@pytest.mark.parametrize("weight_dtype", ["int8", "int4"])
def test_quantized_weights_change_perplexity_by_under_one_percent(tokens, weight_dtype):
    ids = tokens[: WINDOW * WINDOWS]
    base = perplexity(make_llm(), ids, window=WINDOW).perplexity
    llm = make_llm(weight_dtype=weight_dtype)
    quant = perplexity(llm, ids, window=WINDOW).perplexity
    assert math.isfinite(quant) and abs(quant / base - 1) < 0.01, (base, quant)
    assert_clean(llm)


def test_bad_windows_are_refused():
    with pytest.raises(ValueError, match="window must be at least 2"):
        windows_of([1, 2, 3], 1)
    assert windows_of([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4]]


def test_decode_nlls_are_the_prompt_logprobs_of_the_same_text_and_a_budget_changes_only_the_decodes(smollm2, tokens):
    from kvpage.tools.perplexity import decode_nlls, token_nlls

    text = tokens[:420]
    start = 300
    llm = make_llm()
    model = llm.llm_engine.runner.model
    full = decode_nlls(model, text, start, batch=50)  # three forwards of up to 50 decodes
    assert len(full) == len(text) - 1 - start
    prompt = token_nlls(llm, text, window=len(text))[0][start:]  # the same positions, from one prefill
    assert max(abs(a - b) for a, b in zip(full, prompt, strict=True)) < 1e-3
    assert decode_nlls(model, text, start, read_budget=4096, batch=50) == full  # a budget covering it all
    sparse = decode_nlls(model, text, start, read_budget=64, batch=50)
    assert sparse != full and sum(sparse) / len(sparse) > 0  # 4 of 19-27 blocks read past layer 2
    assert_clean(llm)
