import math

import pytest

from ssd.sampling_params import MAX_LOGPROBS, SamplingParams


def test_defaults():
    sp = SamplingParams()
    assert sp.temperature == 1.0
    assert sp.top_p == 1.0
    assert sp.top_k == 0
    assert sp.seed is None
    assert sp.max_tokens == 16
    assert sp.min_tokens == 0
    assert sp.stop == []
    assert sp.stop_token_ids == []
    assert sp.ignore_eos is False
    assert sp.logprobs is None
    assert sp.include_stop_str_in_output is False
    assert sp.skip_special_tokens is True
    assert sp.is_greedy is False


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop": 3}, "stop"),
        ({"stop_token_ids": [1, 2.0]}, "stop_token_ids"),
        ({"stop_token_ids": [1, -2]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        ({"logprobs": 1.0}, "logprobs"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
        ({"skip_special_tokens": None}, "skip_special_tokens"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert message.startswith(field), message
    bad = kwargs[field]
    assert repr(bad) in message or str(bad) in message, message


def test_normalisation():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(top_k=-1).top_k == 0
    sp = SamplingParams(temperature=1, top_p=1)
    assert isinstance(sp.temperature, float) and isinstance(sp.top_p, float)


def test_valid_edges():
    SamplingParams(temperature=0.0, top_p=1e-9, top_k=1, seed=0, max_tokens=1, min_tokens=1)
    SamplingParams(seed=2**64 - 1, logprobs=0)
    SamplingParams(logprobs=MAX_LOGPROBS, min_tokens=16)


@pytest.mark.parametrize(
    "kwargs, greedy",
    [
        ({"temperature": 0.0}, True),
        ({"temperature": 0.7, "top_k": 1}, True),
        ({"temperature": 0.7, "top_k": 2}, False),
        ({"temperature": 1e-6}, False),
        ({"temperature": 0.0, "top_p": 0.5}, True),
    ],
)
def test_is_greedy(kwargs, greedy):
    assert SamplingParams(**kwargs).is_greedy is greedy


def test_clone_is_deep():
    sp = SamplingParams(stop=["x"], stop_token_ids=[7], seed=3)
    cp = sp.clone()
    assert cp == sp and cp is not sp
    cp.stop.append("y")
    cp.stop_token_ids.append(8)
    assert sp.stop == ["x"] and sp.stop_token_ids == [7]
