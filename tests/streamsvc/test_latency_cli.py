"""--latency and --chunk-latent-frames: the latency mode's defaults reach the engine's config, and a flag given
explicitly wins over the mode (streamsvc/options.py)."""

from streamsvc import cli, options


def engine_config(*flags):
    return options.engine_config(cli.build_parser().parse_args(["serve", "--device", "cpu", *flags]))


def serving_choices(cfg) -> tuple:
    return (cfg.latency, cfg.generator.frames_per_chunk, cfg.scheduler.start_margin_s, cfg.scheduler.buffer_cap_s,
            cfg.input_latency_s, cfg.scheduler.prompt_cut, cfg.scheduler.degrade_margin_s, cfg.scheduler.max_batch)


def test_the_default_mode_keeps_the_released_checkpoints_chunk_size_and_today_s_buffer():
    assert serving_choices(engine_config()) == ("default", 3, 0.175, 2.0, 0.5, False, 0.1, 4)
    assert serving_choices(engine_config("--latency", "default")) == ("default", 3, 0.175, 2.0, 0.5, False, 0.1, 4)


def test_latency_low_takes_one_latent_frame_chunks_a_smaller_buffer_and_a_lower_input_latency():
    assert serving_choices(engine_config("--latency", "low")) == ("low", 1, 0.15, 1.0, 0.25, True, 0.05, 16)


def test_a_flag_given_explicitly_wins_over_the_mode():
    cfg = engine_config("--latency", "low", "--chunk-latent-frames", "3", "--start-margin", "0.2",
                        "--buffer-cap", "1.5", "--input-latency", "0.4", "--no-prompt-cut", "--max-batch", "2")
    assert serving_choices(cfg) == ("low", 3, 0.2, 1.5, 0.4, False, 0.05, 2)
    assert engine_config("--prompt-cut").scheduler.prompt_cut  # and the default mode's cut, asked for
    assert engine_config("--chunk-latent-frames", "1").generator.frames_per_chunk == 1  # no mode: the flag alone


def test_generate_takes_the_chunk_size_too():
    args = cli.build_parser().parse_args(["generate", "--prompt", "a red ball", "--chunk-latent-frames", "1"])
    assert options.generator_config(args).frames_per_chunk == 1
    args = cli.build_parser().parse_args(["generate", "--prompt", "a red ball"])
    assert options.generator_config(args).frames_per_chunk == 3


def test_the_mode_s_start_up_line_says_what_it_chose():
    line = engine_config("--latency", "low").describe_latency()
    assert line.startswith("latency low: chunks of 1 latent frame,") and "1 s ahead" in line and "0.25 s" in line
    assert "cuts to its first chunk" in line and "plays after" in engine_config().describe_latency()
