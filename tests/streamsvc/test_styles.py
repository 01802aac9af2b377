"""The style library of a server (streamsvc/engine/styles.py): files offered by stem, checked at start, loaded once
under a budget, the least recently used unused one evicted, their bytes held in the KV pool, switches versioned.

LoRA files are written by the tests in the layouts served (tests/models/test_adapters.py's writers), over the tiny
model's Linears (CPU, fp32).
"""

import logging

import pytest
import torch

from kvcache import CachePool
from models.adapters import AdapterSet
from streamsvc.engine.config import EngineConfig
from streamsvc.engine.styles import NO_STYLES, PARALLEL, StyleBusy, StyleLibrary
from tests.conftest import tiny_generator
from tests.models.test_adapters import make_pairs, save_comfy, save_diffusers, save_kohya, save_peft


@pytest.fixture(scope="module")
def gen():
    return tiny_generator()


def write_styles(folder, model, rank=4):
    """Three good styles of one size, in three layouts, over every Linear: (a, b, c) -> their files."""
    save_peft(folder / "a.pt", make_pairs(model, rank, 1))
    save_diffusers(folder / "b.safetensors", make_pairs(model, rank, 2), alpha=rank)
    save_comfy(folder / "c.safetensors", make_pairs(model, rank, 3), alpha=rank)
    return folder


def library(gen, folder, budget, pool=None, max_rank=64) -> StyleLibrary:
    """A fresh library over its own adapter set (the generator's own is left alone)."""
    lib = StyleLibrary.from_folder(AdapterSet(gen.model, max_rank=max_rank), folder, budget, pool)
    lib.load_at_start()
    return lib


def one_style_bytes(gen, rank=4) -> int:
    return sum((m.in_features + m.out_features) * rank * 4 for m in gen.model.modules()
               if isinstance(m, torch.nn.Linear))


def test_the_least_recently_used_unused_style_is_evicted_and_one_in_use_never(gen, tmp_path):
    write_styles(tmp_path, gen.model)
    size = one_style_bytes(gen)
    pool = CachePool(2**30)
    lib = library(gen, tmp_path, budget=2 * size, pool=pool)
    assert [(s.name, s.rank, s.bytes, s.loaded, s.error) for s in lib.listing] == [
        ("a", 4, size, True, None), ("b", 4, size, True, None), ("c", 4, size, False, None)]  # c: read, checked, out
    assert lib.offered == ("a", "b", "c") and pool.reserved == {"style a": size, "style b": size}
    assert lib.take("s1", "a") is None  # a: used, so b is the least recently used
    assert lib.take("s2", "c") is None  # b evicted (nobody holds it), c loaded
    assert sorted(lib.adapters.names) == ["a", "c"] and set(pool.reserved) == {"style a", "style c"}
    refusal = lib.take("s3", "b")  # a and c are held: nothing to evict
    assert "style budget (--lora-budget-gib)" in refusal and "try again" in refusal and "s3" not in lib.streams
    assert sorted(lib.adapters.names) == ["a", "c"]
    lib.release("s2")
    assert lib.take("s3", "b") is None  # c is free now: evicted for b, a (held) stays
    assert sorted(lib.adapters.names) == ["a", "b"] and set(pool.reserved) == {"style a", "style b"}
    assert lib.take("s4", None) is None and lib.cost_of("s4") == 0.0 and lib.cost_of("s1") > 0


def test_a_pending_switch_holds_both_styles_until_the_plan_that_brings_it(gen, tmp_path, monkeypatch):
    write_styles(tmp_path, gen.model)
    lib = library(gen, tmp_path, budget=2 * one_style_bytes(gen))
    assert lib.take("s1", "a") is None
    assert lib.switch("s1", "b", 0.5, version=lambda cost: 7) == 7  # a and b both held until it is applied
    assert "style budget" in lib.take("s2", "c")  # refused: nothing unused to evict
    state = gen.open_stream("s1", "a prompt", seed=0)
    monkeypatch.setattr(gen, "adapters", lib.adapters)  # the generator runs the library's styles (an engine's does)
    lib.apply(gen, state, 6)
    assert state.pending_lora is None  # version 6 brings nothing of it
    lib.apply(gen, state, 7)
    assert state.pending_lora == ("b", 0.5) and state.pending_version == 7 and lib.streams["s1"].pending == {}
    assert lib.take("s2", "c") is None  # a is no longer held: evicted for c


def test_a_bad_file_is_logged_at_start_listed_with_its_error_and_refused_with_its_reason(gen, tmp_path, caplog):
    write_styles(tmp_path, gen.model)
    pairs = make_pairs(gen.model, 4, 4)
    pairs["blocks.0.nonexistent"] = pairs.pop(next(iter(pairs)))
    save_kohya(tmp_path / "wrong.safetensors", pairs, alpha=4)
    (tmp_path / "garbage.safetensors").write_bytes(b"not a safetensors file")
    save_peft(tmp_path / "big.pt", make_pairs(gen.model, 8, 5))
    with caplog.at_level(logging.WARNING, logger="streamsvc.engine"):
        lib = library(gen, tmp_path, budget=2**30, max_rank=4)
    logged = caplog.text
    assert "'wrong' is not offered" in logged and "match no Linear" in logged
    assert "'garbage' is not offered" in logged and "cannot be read" in logged
    assert "'big' is not offered" in logged and "over the maximum 4" in logged
    assert lib.offered == ("a", "b", "c")
    errors = {s.name: s.error for s in lib.listing}
    assert errors["a"] is None and "match no Linear" in errors["wrong"]
    refusal = lib.take("s1", "wrong")
    assert refusal.startswith("style 'wrong' cannot be used:") and "blocks_0_nonexistent" in refusal
    assert "rank 8, over the maximum 4" in lib.take("s1", "big")
    assert lib.take("s1", "nope") == "no style named 'nope' (offered: a, b, c)"
    assert "lora_scale must be a number in [0.0, 2.0], got 3.0" in lib.take("s1", "a", 3.0)
    assert lib.streams == {}
    save_peft(tmp_path / "big.pt", make_pairs(gen.model, 4, 5))  # fixed: read again at its next use
    assert lib.take("s1", "big") is None and "big" in lib.offered


def test_a_switch_that_cannot_be_given_changes_nothing(gen, tmp_path):
    write_styles(tmp_path, gen.model)
    lib = library(gen, tmp_path, budget=one_style_bytes(gen))
    assert lib.take("s1", "a") is None
    versions = []
    with pytest.raises(StyleBusy, match="style budget"):
        lib.switch("s1", "b", 1.0, version=versions.append)  # a is held: b has no room
    with pytest.raises(ValueError, match="lora_scale"):
        lib.switch("s1", None, -1.0, version=versions.append)
    assert versions == [] and lib.streams["s1"].name == "a" and lib.streams["s1"].pending == {}


def test_no_folder_or_parallel_refuses_styles_with_the_reason(gen, tmp_path):
    assert StyleLibrary.from_folder(gen.adapters, None).take("s1", "a") == NO_STYLES
    write_styles(tmp_path, gen.model)
    lib = StyleLibrary.from_folder(gen.adapters, tmp_path, parallel=True)
    lib.load_at_start()
    assert lib.take("s1", "a") == PARALLEL and lib.offered == () and lib.take("s1", None) is None
    with pytest.raises(ValueError, match="--lora-dir does not go with --parallel"):
        EngineConfig(lora_dir=str(tmp_path), group=object())
    (tmp_path / "x.pt").write_bytes(b"")
    (tmp_path / "x.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="several files for the style"):
        StyleLibrary.from_folder(gen.adapters, tmp_path)


def test_a_styled_chunk_costs_what_was_measured_and_more_for_a_higher_rank(gen, tmp_path, monkeypatch):
    save_peft(tmp_path / "low.pt", make_pairs(gen.model, 2, 1))
    save_peft(tmp_path / "high.pt", make_pairs(gen.model, 8, 2))
    lib = StyleLibrary.from_folder(AdapterSet(gen.model), tmp_path, budget_bytes=one_style_bytes(gen, 8))
    lib.load_at_start()  # high alone fits (name order: high first)
    assert lib.recent == ["high"]
    monkeypatch.setattr(gen, "adapters", lib.adapters)
    lib.ready(gen)  # times chunks with and without "high" (on CPU: no graphs)
    assert lib.cost_rank == 8 and lib.cost >= 0
    lib.cost, lib.budget_bytes = 0.25, 2**30  # (the measured value is the host's; the charge follows it)
    assert lib.take("s1", "high") is None and lib.take("s2", "low") is None
    assert lib.cost_of("s1") == lib.cost_of("s2") == 0.25  # a lower rank: charged what was measured (a bound)
    lib.cost_rank = 4
    assert lib.cost_of("s1") == 0.5 and lib.cost_of("s2") == 0.25


def test_a_stream_whose_input_runs_the_input_adapter_is_charged_its_measured_share(tmp_path):
    gen = tiny_generator()
    gen.set_input_adapter({m: (a, b, 4.0) for m, (a, b) in make_pairs(gen.model, 4, 5).items()}, kinds=("video",))
    lib = StyleLibrary.from_folder(gen.adapters, None)
    lib.ready(gen)  # no style offered: the input adapter alone is timed against the base weights
    assert lib.input_kinds == ("video",) and lib.input_cost >= 0 and lib.cost_rank == 0
    parallel = StyleLibrary.from_folder(gen.adapters, None, parallel=True)
    parallel.ready(gen)  # under --parallel no input runs the adapter (refused): no throwaway stream is run
    assert parallel.input_kinds == () and parallel.input_cost == 0.0
    lib.input_cost = 0.2  # (the measured value is the host's; the charge follows it)
    assert lib.take("v", None, input_kind="video") is None and lib.cost_of("v") == 0.2
    assert lib.take("t", None) is None and lib.cost_of("t") == 0.0  # text alone: the base weights
    assert lib.take("i", None, input_kind="image") is None and lib.cost_of("i") == 0.0  # a kind it was not trained for
    save_peft(tmp_path / "s.pt", make_pairs(gen.model, 2, 1))
    styled = StyleLibrary.from_folder(gen.adapters, tmp_path, budget_bytes=2**30)
    styled.load_at_start()
    styled.input_kinds, styled.input_cost, styled.cost, styled.cost_rank = ("video",), 0.2, 0.1, 2
    assert styled.take("vs", "s", input_kind="video") is None
    assert styled.cost_of("vs") == 0.2  # the dearer of the two: a switch to no style runs the input adapter again
    styled.cost = 0.3
    assert styled.cost_of("vs") == 0.3


def test_the_wire_carries_a_style_in_start_set_lora_and_ready():
    from streamsvc.wire import protocol as P

    start = P.parse_client('{"type": "start", "prompt": "a ball", "lora": "ink", "lora_scale": 0.5}')
    assert (start.lora, start.lora_scale) == ("ink", 0.5)
    plain = P.parse_client('{"type": "start", "prompt": "a ball"}')
    assert (plain.lora, plain.lora_scale) == (None, 1.0)
    assert P.parse_client('{"type": "set_lora", "lora": null}') == P.SetLora(lora=None)
    too_long = "x" * (P.MAX_LORA_NAME_CHARS + 1)
    for bad, field in (('{"type": "set_lora"}', "lora"),
                       ('{"type": "set_lora", "lora": "x", "lora_scale": "1"}', "lora_scale"),
                       (f'{{"type": "set_lora", "lora": "{too_long}"}}', "lora")):
        with pytest.raises(P.ProtocolError) as e:
            P.parse_client(bad)
        assert e.value.code == P.ErrorCode.INVALID_FIELD and field in e.value.message
    ready = P.Ready(stream_id="s0", fps=16, width=128, height=128, first_chunk_frames=9, chunk_frames=12,
                    prompt_version=0, steps=4, loras=["ink", "neon"], lora="ink", lora_scale=0.5)
    assert P.parse_server(P.encode(ready)) == ready
    assert P.parse_server(P.encode(P.Ack(request="set_lora", prompt_version=3))).request == "set_lora"


def test_admission_charges_a_styled_stream_its_share_more_from_its_start_or_its_switch():
    from streamsvc.scheduling import CostEstimates, Scheduler, SchedulerConfig, StreamRequest

    costs = CostEstimates(SchedulerConfig())
    plain, styled = StreamRequest("a", fps=16.0), StreamRequest("b", fps=16.0, style_cost=0.25)
    assert costs.stream_load(styled) == pytest.approx(1.25 * costs.stream_load(plain))
    with pytest.raises(ValueError, match="style_cost"):
        StreamRequest("c", fps=16.0, style_cost=-0.1)
    sched = Scheduler(SchedulerConfig())
    assert sched.admit(plain, 0.0).accepted
    before = sched.predicted_load()
    assert sched.set_prompt("a", 0.1, "the same prompt", style_cost=0.5) == 1  # a switch to a style: a version
    assert sched.predicted_load() == pytest.approx(1.5 * before)


def test_serve_flags_give_the_engine_its_styles_or_a_clear_error(tmp_path):
    from models.model_file import BUILTIN_WEIGHTS, shipped_styles
    from streamsvc import options
    from streamsvc.cli import build_parser

    def config(*flags):
        return options.engine_config(build_parser().parse_args(["serve", "--device", "cpu", *flags]))

    cfg = config("--lora-dir", str(tmp_path), "--lora-budget-gib", "0.5")
    assert (cfg.lora_dir, cfg.lora_budget_bytes) == (str(tmp_path), 2**29)
    shipped = shipped_styles(BUILTIN_WEIGHTS)  # the built-in model's styles, when this checkout has them
    assert (config().lora_dir, config().lora_budget_bytes) == (shipped and str(shipped), 2 * 2**30)
    assert config("--lora-dir", "none").lora_dir is None and config("--weights", "random").lora_dir is None
    for flags, message in ((("--lora-dir", str(tmp_path / "none")), "not a directory"),
                           (("--lora-budget-gib", "-1"), "--lora-budget-gib takes a number")):
        with pytest.raises(ValueError, match=message):
            config(*flags)


def test_a_recordings_chapter_names_the_style_its_prompt_ran_under():
    from streamsvc.viewers.streams import chapter_title

    assert chapter_title("a red ball", None, 1.0) == "a red ball"
    assert chapter_title("a red ball", "ink", 0.0) == "a red ball"  # scale 0: no style
    assert chapter_title("a red ball", "ink", 0.75) == "a red ball [style ink x0.75]"
