"""serve's parking flags reach the engine's config."""

import pytest

from streamsvc import cli, options


def engine_config(*flags):
    return options.engine_config(cli.build_parser().parse_args(["serve", "--device", "cpu", *flags]))


def test_park_flags_default_and_override():
    cfg = engine_config()
    assert (cfg.park_budget_bytes, cfg.park_timeout_s) == (8 * 2**30, 300.0)
    cfg = engine_config("--park-budget-gib", "0.5", "--park-timeout", "30")
    assert (cfg.park_budget_bytes, cfg.park_timeout_s) == (2**29, 30.0)
    assert engine_config("--park-budget-gib", "0").park_budget_bytes == 0  # no pausing


@pytest.mark.parametrize("flags", [("--park-budget-gib", "-1"), ("--park-timeout", "0")])
def test_bad_park_flags_say_which_and_what(flags):
    with pytest.raises(ValueError, match="--park-budget-gib takes a number >= 0 .* and --park-timeout one > 0"):
        engine_config(*flags)


def test_a_tiny_park_budget_is_told_in_kib_not_as_0_00_gib():
    """--park-budget-gib 0.0001 is 105 KiB; the refusal said "needs 0.00 GiB ... 0.00 GiB free of 0.00 GiB" (#33)."""
    from kvcache import ParkBudget

    budget = ParkBudget(engine_config("--park-budget-gib", "0.0001").park_budget_bytes)
    assert budget.refusal(520 * 2**10).startswith(
        "parking needs 520 KiB of host memory but the park budget has 105 KiB free of 105 KiB (0 streams parked)")
