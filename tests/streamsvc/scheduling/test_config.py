"""SchedulerConfig and StreamRequest: validated at construction, with the value and the fix."""

from __future__ import annotations

import math

import pytest

from streamsvc.scheduling import SchedulerConfig, StreamRequest
from tests.streamsvc.scheduling.helpers import FPS


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"policy": "edf"}, "policy 'edf' is unknown; use one of slack, least_slack, round_robin, fifo"),
        ({"denoise_steps": 0}, "denoise_steps=0"),
        ({"buffer_cap_s": 0.0}, "buffer_cap_s=0.0"),
        ({"max_batch": 0}, "max_batch=0"),
        ({"utilization_target": 0.0}, "math.inf turns admission off"),
        ({"initial_forward_s": -1.0}, "initial_forward_s=-1.0"),
        ({"cost_percentile": 1.5}, "cost_percentile=1.5"),
        ({"cost_min_samples": 65}, "cost_min_samples=65"),
        ({"restart_margin_chunks": -1.0}, "restart_margin_chunks=-1.0"),
        ({"startup_slack_s": math.inf}, "startup_slack_s=inf"),
        ({"stall_guard_chunks": -0.5}, "or None for off"),
        ({"start_margin_s": -0.1}, "start_margin_s=-0.1: must be >= 0 s (e.g. 0.25), or math.inf for no start rule"),
        ({"latency_window": 0}, "latency_window=0"),
        ({"latency_min_samples": 33}, "latency_min_samples=33: must be in [0, latency_window=32]"),
        ({"degrade_steps": (4,)}, "degrade_steps=(4,): each must be in [1, 3], fewer than denoise_steps=4"),
        ({"pressure_hold_s": -1.0}, "pressure_hold_s=-1.0"),
        ({"degrade_margin_s": math.inf}, "degrade_margin_s=inf"),
    ],
)
def test_config_is_validated_with_the_value_and_the_fix(kwargs, needle):
    with pytest.raises(ValueError) as err:
        SchedulerConfig(**kwargs)
    assert needle in str(err.value)


def test_stream_request_is_validated():
    with pytest.raises(ValueError, match="fps=0"):
        StreamRequest("a", 0.0)
    with pytest.raises(ValueError, match="chunk_frames=0"):
        StreamRequest("a", FPS, chunk_frames=0)
