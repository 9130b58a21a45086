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


def test_a_block_drafter_round_costs_one_pass_whatever_k():
    flat = {1: 1.0, 2: 1.0, 4: 1.1, 8: 1.2, 16: 1.5}
    pass_cost = {3: 0.30, 7: 0.32, 15: 0.36}  # k -> one drafter pass drafting k
    assert costmodel.block_round_cost(0.3, 3, flat) == pytest.approx(0.3 + 1.1)
    assert costmodel.predicted_block_speedup(0.8, 7, pass_cost, flat) == pytest.approx(
        costmodel.expected_tokens_per_round(0.8, 7) / (0.32 + 1.2))
    assert costmodel.predicted_block_speedup(0.8, 5, pass_cost, flat) == pytest.approx(
        costmodel.expected_tokens_per_round(0.8, 5) / (0.31 + 1.15))  # both interpolated
    assert costmodel.predicted_block_speedup(0.8, 0, pass_cost, flat) == 1.0
    # The same 0.3 paid per drafted token (a draft model) loses at k = 15; one pass gains.
    assert costmodel.predicted_speedup(0.8, 15, 0.3, flat) < 1.0
    assert costmodel.predicted_block_speedup(0.8, 15, pass_cost, flat) > 2.5
