"""Generation's sampling (packlora.generate) at its edges, and its settings checked up front."""
import math

import numpy as np
import pytest
from packlora.errors import ConfigError
from packlora.generate import _sample, check_settings

# softmax: p(1) = p(4) = 0.34 (token 4 a hair lower), p(2) = 0.31, the rest ~0.01
LOGITS = np.array([0.5, 3.0, 2.9, -1.0, 3.0 - 1e-3], np.float32)


def _draws(n, temperature, top_k, top_p):
    rng = np.random.default_rng(0)
    return [_sample(LOGITS, temperature, top_k, top_p, rng) for _ in range(n)]


def test_top_p_zero_keeps_the_most_likely_token():
    """top_p = 0 kept no token at all: every probability 0, then NaN, then numpy's error."""
    assert set(_draws(50, 1.0, 0, 0.0)) == {1}


def test_top_k_and_top_p_keep_what_they_say():
    assert set(_draws(300, 1.0, 2, 1.0)) == {1, 4}
    assert set(_draws(300, 1.0, 0, 0.5)) == {1, 4}  # 0.34 + 0.34 reach 0.5 at the second
    assert set(_draws(2000, 1.0, 0, 1.0)) == set(range(5))


def test_tiny_and_huge_temperatures_stay_finite():
    """logits / 1e-300 were inf, and inf - inf NaN."""
    assert set(_draws(20, 1e-300, 0, 1.0)) == {1}
    assert set(_draws(2000, 1e300, 0, 1.0)) == set(range(5))  # every token as likely


GOOD = {"max_new_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 1}


@pytest.mark.parametrize("name, value", [
    ("max_new_tokens", -1), ("max_new_tokens", 2.5), ("max_new_tokens", True),
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf),
    ("temperature", "0.7"), ("top_p", -0.01), ("top_p", 1.01), ("top_p", math.nan),
    ("top_k", -5), ("top_k", 1.5), ("seed", -1), ("seed", "1"),
])
def test_bad_settings_name_themselves(name, value):
    with pytest.raises(ConfigError, match=rf"generation: {name} must be .*, got {value!r}"):
        check_settings(**{**GOOD, name: value})


def test_edge_settings_pass():
    check_settings(0, 0.0, 0.0, 0, None)
    check_settings(np.int64(3), np.float32(1.0), 1, np.int32(2), np.uint32(7), batch_size=1)
    with pytest.raises(ConfigError, match="batch_size must be a whole number >= 1, got 0"):
        check_settings(**GOOD, batch_size=0)
