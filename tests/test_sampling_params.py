"""`SamplingParams` / `BeamSearchParams` validation: NaN, infinities and too many logprobs are
rejected with a ValueError naming the field; good values still construct."""

from __future__ import annotations

import pytest

from kvpage.sampling_params import MAX_LOGPROBS, BeamSearchParams, SamplingParams

NAN, INF = float("nan"), float("inf")
FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
def test_non_finite_sampling_values_are_rejected(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be a finite number, got {value!r}$"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
def test_non_finite_length_penalty_is_rejected(value):
    with pytest.raises(ValueError, match=rf"^length_penalty must be a finite number, got {value!r}$"):
        BeamSearchParams(length_penalty=value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(logprobs=21), "logprobs must be <= 20, got 21"),
        (dict(prompt_logprobs=21), "prompt_logprobs must be <= 20, got 21"),
        (dict(logprobs=1000, prompt_logprobs=0), "logprobs must be <= 20, got 1000"),
        (dict(temperature=-0.5), "temperature must be >= 0.0, got -0.5"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be > 0.0, got 0.0"),
        (dict(top_p=0.0), r"top_p must be in \(0.0, 1.0\], got 0.0"),
        (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2.0, 2.0\], got 2.5"),
        (dict(logit_bias={5: 100.5}), r"logit_bias\[5\] must be in \[-100.0, 100.0\], got 100.5"),
        (dict(logit_bias={-1: 1.0}), r"logit_bias token id must be an integer >= 0, got -1"),
        (dict(logit_bias={"5": 1.0}), r"logit_bias token id must be an integer >= 0, got '5'"),
        (dict(logit_bias=[(5, 1.0)]), r"logit_bias must be a map of token id to bias, got \[\(5, 1.0\)\]"),
        (dict(seed=2**63), f"seed must fit in a signed 64-bit integer, got {2**63}"),
        (dict(seed=-(2**63) - 1), f"seed must fit in a signed 64-bit integer, got {-(2**63) - 1}"),
    ],
)
def test_out_of_range_values_name_the_field_and_the_bound(kwargs, message):
    with pytest.raises(ValueError, match=rf"^{message}$"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.0),
        dict(temperature=1e6, top_p=1e-9, min_p=1.0),
        dict(temperature=2, top_p=1, repetition_penalty=1e-3),  # ints are numbers too
        dict(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=1e9),
        dict(logprobs=MAX_LOGPROBS, prompt_logprobs=MAX_LOGPROBS),
        dict(logprobs=0, prompt_logprobs=0),
        dict(logit_bias={0: -100, 7: 100.0, 9: 0.5}),
    ],
)
def test_good_sampling_values_construct(kwargs):
    params = SamplingParams(**kwargs)
    assert all(getattr(params, k) == v for k, v in kwargs.items())


@pytest.mark.parametrize("value", [-1e9, -1.0, 0.0, 2.5, 1e9])
def test_finite_length_penalties_construct(value):
    assert BeamSearchParams(length_penalty=value).length_penalty == value
