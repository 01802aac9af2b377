"""serve's parking flags reach the engine's config."""

import pytest

from streamsvc import cli


def engine_config(*flags):
    return cli._engine_config(cli.build_parser().parse_args(["serve", "--device", "cpu", *flags]))


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
