"""The cost model's small formulas."""

import random

import pytest

from mlx_spec import costmodel


def test_expected_tokens_per_round_matches_the_closed_form():
    assert costmodel.expected_tokens_per_round(0.8, 4) == pytest.approx((1 - 0.8**5) / 0.2)
    assert costmodel.expected_tokens_per_round(1.0, 4) == 5
    assert costmodel.expected_tokens_per_round(0.0, 4) == 1


def test_iid_acceptance_recovers_the_true_rate_where_accepted_over_drafted_does_not():
    rng, k, a = random.Random(0), 6, 0.8
    accepted = full = 0
    rounds = 20000
    for _ in range(rounds):
        n = 0
        while n < k and rng.random() < a:
            n += 1
        accepted, full = accepted + n, full + (n == k)
    assert costmodel.iid_acceptance(accepted, rounds, full) == pytest.approx(a, abs=0.01)
    assert accepted / (rounds * k) < a - 0.1  # the naive rate underestimates a


def test_best_k_is_zero_when_verification_is_linear():
    linear = {1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0}
    assert costmodel.best_k(0.8, 0.1, linear) == (0, 1.0)
    flat = {1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1}
    k, speedup = costmodel.best_k(0.8, 0.05, flat)
    assert k >= 3 and speedup > 2
