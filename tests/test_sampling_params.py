"""Tests for manylora.sampling_params.SamplingParams: defaults, normalization, validation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from manylora.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert p.n == 1
    assert p.temperature == 1.0
    assert p.top_p == 1.0
    assert p.top_k == 0
    assert p.min_p == 0.0
    assert p.seed is None
    assert p.max_tokens == 16
    assert p.min_tokens == 0
    assert p.stop == []
    assert p.stop_token_ids == []
    assert p.ignore_eos is False
    assert p.skip_special_tokens is True
    assert p.include_stop_str_in_output is False
    assert not p.greedy


def test_normalization():
    p = SamplingParams(stop="###", stop_token_ids=[np.int64(2), 7], top_k=-1, seed=np.int32(3))
    assert p.stop == ["###"]
    assert p.stop_token_ids == [2, 7] and all(type(t) is int for t in p.stop_token_ids)
    assert p.top_k == 0
    assert p.seed == 3 and type(p.seed) is int
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(temperature=1).temperature == 1.0
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(max_tokens=None, min_tokens=100).min_tokens == 100


def test_greedy_property():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy
    assert not SamplingParams(temperature=0.7).greedy


def test_valid_edges():
    SamplingParams(top_p=1.0, min_p=1.0, top_k=1, max_tokens=1, min_tokens=1)
    SamplingParams(min_p=0.0, top_p=1e-9, temperature=0.0, seed=0)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"n": 2}, "n"),
        ({"n": 0}, "n"),
        ({"n": 1.5}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": math.nan}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17}, "min_tokens"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids"),
        ({"seed": 1.5}, "seed"),
        ({"seed": "42"}, "seed"),
    ],
)
def test_invalid_values_raise_naming_parameter(kwargs, name):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    msg = str(info.value)
    assert name in msg
    bad = kwargs[name]
    if isinstance(bad, list):
        bad = bad[-1]
    if isinstance(bad, float) and math.isnan(bad):
        assert "nan" in msg
    else:
        assert str(bad) in msg or repr(bad) in msg


def test_n_message_says_not_supported():
    with pytest.raises(ValueError, match="not supported"):
        SamplingParams(n=3)
