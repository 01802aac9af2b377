"""--fidelity and --speed-options on the command line: what they turn on, and how they meet --degrade."""

import pytest
import torch

from streamsvc import cli, offline, options


def engine_config(*flags):
    args = cli.build_parser().parse_args(["serve", "--device", "cpu", *flags])
    return options.engine_config(args)


def test_default_is_exact_math_with_the_overload_degrade():
    cfg = engine_config()
    g = cfg.generator
    assert not g.fp8_linears and g.attention_quant == "none" and not g.commit_reuse and len(g.timesteps) == 4
    assert cfg.degrade
    assert not engine_config("--degrade", "off").degrade


def test_explicit_exact_turns_degrade_off_and_refuses_it_asked_for():
    assert not engine_config("--fidelity", "exact").degrade
    with pytest.raises(ValueError, match="--fidelity exact"):
        engine_config("--fidelity", "exact", "--degrade", "auto")
    with pytest.raises(ValueError, match="over --fidelity exact"):
        engine_config("--fidelity", "exact", "--kv-quant", "int2")


def test_tiers_turn_their_options_on_and_speed_options_pick_exactly():
    q = engine_config("--fidelity", "quantized")
    assert q.degrade and not q.generator.commit_reuse  # on CPU FP8 and INT8 do not pay: not on by default
    a = engine_config("--fidelity", "approximate").generator
    assert a.commit_reuse and len(a.timesteps) == 3
    picked = engine_config("--fidelity", "approximate", "--speed-options", "fp8-linears,steps-2").generator
    assert picked.fp8_linears and len(picked.timesteps) == 2 and not picked.commit_reuse
    with pytest.raises(ValueError, match="over --fidelity quantized"):
        engine_config("--fidelity", "quantized", "--speed-options", "commit-reuse")
    none = engine_config("--fidelity", "approximate", "--speed-options", "none").generator
    assert not none.commit_reuse and len(none.timesteps) == 4


def test_generate_takes_the_same_flags():
    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--fidelity", "approximate",
                                          "--speed-options", "commit-reuse"])
    assert args.fidelity == "approximate" and args.speed_options == "commit-reuse"


def test_the_start_rule_defaults_by_device_and_its_flags_override_them(monkeypatch):
    cpu = engine_config().scheduler
    assert (cpu.lead_percentile, cpu.start_margin_s) == (0.5, 0.175)
    monkeypatch.setattr(offline, "default_device", lambda name: torch.device("cuda"))  # no GPU needed to build it
    gpu = options.engine_config(cli.build_parser().parse_args(["serve"])).scheduler
    assert (gpu.lead_percentile, gpu.start_margin_s) == (0.95, 0.25)
    both = engine_config("--lead-percentile", "0.9", "--start-margin", "0.3").scheduler
    assert (both.lead_percentile, both.start_margin_s) == (0.9, 0.3)
    with pytest.raises(ValueError, match="lead_percentile=1.5"):
        engine_config("--lead-percentile", "1.5")
