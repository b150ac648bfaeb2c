"""PathCosts: the fits recover a line, start from the priors, and the backlog and ITL-target
books balance."""

import pytest

from services.scheduler.path_costs import CostPriors, LinearFit, PathCosts, TtftCorrection


def test_fit_starts_from_the_prior_and_recovers_a_line() -> None:
    fit = LinearFit(prior_fixed_s=0.5, prior_per_token_s=0.1)
    assert fit.predict(10) == pytest.approx(1.5)
    for n in (10, 100, 1000, 50, 500):
        fit.observe(n, 0.02 + 0.001 * n)
    fixed, slope = fit.params()
    assert fixed == pytest.approx(0.02) and slope == pytest.approx(0.001)


def test_samples_of_one_size_keep_the_prior_fixed_part_and_charge_the_rest_to_tokens() -> None:
    fit = LinearFit(prior_fixed_s=0.1, prior_per_token_s=0.5)
    for _ in range(5):
        fit.observe(100, 0.3)
    assert fit.params() == pytest.approx((0.1, 0.002))
    fast = LinearFit(prior_fixed_s=1.0, prior_per_token_s=0.5)
    fast.observe(100, 0.3)  # faster than the prior's fixed part alone
    assert fast.params() == pytest.approx((0.3, 0.0))


def test_recent_samples_outweigh_old_ones_and_bad_samples_are_ignored() -> None:
    fit = LinearFit(prior_fixed_s=0.0, prior_per_token_s=0.0, decay=0.5)
    for n in (100, 200):
        fit.observe(n, 1.0 * n)
    for _ in range(10):
        for n in (100, 200):
            fit.observe(n, 0.001 * n)
    fit.observe(100, float("nan"))
    fit.observe(100, -1.0)
    assert fit.params()[1] == pytest.approx(0.001, rel=0.05)
    assert fit.num_samples == 22


def test_prefill_fit_predicts_wait_plus_compute_and_the_compute_alone() -> None:
    costs = PathCosts(CostPriors(prefill_fixed_s=0.0, prefill_per_token_s=1.0))
    assert costs.compute_s(3) == pytest.approx(3.0)
    for n in (10, 1000):
        costs.observe_prefill(n, 0.05 + 0.001 * n)
    assert costs.prefill_s(500) == pytest.approx(0.55)
    assert costs.compute_s(500) == pytest.approx(0.5)
    assert costs.compute_s(-5) == 0.0


def test_itl_is_an_exponentially_weighted_mean() -> None:
    costs = PathCosts(decay=0.5)
    assert costs.itl_s is None
    costs.observe_itl(0.1)
    costs.observe_itl(0.3)
    costs.observe_itl(float("inf"))
    assert costs.itl_s == pytest.approx(0.2)


def test_a_pair_without_samples_borrows_the_fit_over_all_pairs() -> None:
    costs = PathCosts(CostPriors(transfer_fixed_s=0.0, transfer_per_token_s=1.0))
    for n in (100, 1000):
        costs.observe_transfer("p0", "d0", n, 0.01 + 0.0001 * n)
    assert costs.transfer_s("p0", "d1", 1000) == pytest.approx(0.11)
    costs.forget_engine("d0")
    assert ("p0", "d0") not in costs.transfer


def test_backlog_and_itl_targets_balance() -> None:
    costs = PathCosts()
    first = costs.add_backlog("p", 100)
    second = costs.add_backlog("p", 50)
    costs.add_itl_target("d", 0.05)
    costs.add_itl_target("d", 0.02)
    costs.add_itl_target("d", 0.02)
    assert costs.backlog_tokens["p"] == 150 and costs.tightest_itl_target("d") == 0.02
    assert costs.leaks()
    costs.settle_backlog("p", first, None)
    costs.remove_itl_target("d", 0.02)
    assert costs.tightest_itl_target("d") == 0.02
    costs.remove_itl_target("d", 0.02)
    costs.remove_itl_target("d", 0.3)  # never added: no-op
    assert costs.tightest_itl_target("d") == 0.05
    costs.settle_backlog("p", second, 0.1)
    costs.remove_itl_target("d", 0.05)
    assert costs.leaks() == [] and costs.tightest_itl_target("d") is None


def test_ttft_correction_learns_the_ratio_fast_and_shrugs_off_an_outlier() -> None:
    c = TtftCorrection()
    assert c.factor == 1.0
    for _ in range(3):
        c.observe(0.1, 0.3)  # the model predicts 3x too fast
    assert c.factor == pytest.approx(3.0)
    c.observe(0.1, 30.0)  # one stalled request: 100x
    assert 3.0 < c.factor <= 3.0 * 4 ** 0.25 + 1e-9  # moved by at most weight (1/4 here) x log(4)
    for _ in range(30):
        c.observe(0.1, 0.3)
    assert c.factor == pytest.approx(3.0, rel=0.01)
    c.observe(0.0, 1.0)
    c.observe(0.1, float("inf"))  # ignored
    assert c.factor == pytest.approx(3.0, rel=0.01)
    far = TtftCorrection()
    far.observe(0.001, 10.0)
    assert far.factor == pytest.approx(16.0)  # clamped


def test_corrections_are_per_engine_and_path_and_forgotten_with_the_engine() -> None:
    costs = PathCosts()
    costs.observe_ttft("d0", "decode_local", 0.1, 0.2)
    assert costs.correction("d0", "decode_local") == pytest.approx(2.0)
    assert costs.correction("d0", "remote") == 1.0  # a path never tried: as its fits say
    assert costs.correction("d1", "decode_local") == pytest.approx(2.0)  # borrowed from the path's engines
    costs.observe_ttft("d1", "decode_local", 0.1, 0.05)
    assert costs.correction("d1", "decode_local") == pytest.approx(0.5)
    assert costs.correction("d2", "decode_local") == pytest.approx(1.0)  # the mean of 2x and 0.5x
    costs.forget_engine("d0")
    assert costs.correction("d0", "decode_local") == pytest.approx(0.5)
