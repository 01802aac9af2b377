"""Synthetic cameras for the load test and the service benchmark (issue 35): scenes of models/scenes.py rendered
as each viewer's input video.

The client may import only the wire modules, so the command line renders here and hands the client plain frame
sources (`source(i) -> [H, W, 3] uint8`, client/camera.py). Viewer i's camera shows a scene drawn with seed
`seed + i` from the held-out triples (colour x shape x motion the model was not trained on as a caption: what its
tests of following do not use), `frames` frames rendered once and looped.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

FrameSource = Callable[[int], np.ndarray]


def scene_sources(viewers: int, seed: int = 0, frames: int = 128, width: int = 128,
                  height: int = 128) -> list[FrameSource]:
    """One looping camera per viewer (rendered once; `viewers` x `frames` x height x width x 3 bytes)."""
    from models.scenes import Timeline, sample_scene

    sources = []
    for i in range(viewers):
        rng = np.random.default_rng(seed + i)
        scene = sample_scene(rng, held_out=True)
        timeline = Timeline(((0, scene, f"a {scene.colour} {scene.shape}"),), height=height, width=width)
        video = timeline.render(list(range(frames))).numpy()  # [frames, H, W, 3] uint8
        sources.append(lambda k, video=video: video[k % len(video)])
    return sources


def loadtest_sources(args) -> list[FrameSource] | None:
    """`streamsvc loadtest --input synthetic`: one rendered camera per viewer (None for any other --input)."""
    if getattr(args, "input", None) != "synthetic":
        return None
    return scene_sources(args.streams, seed=args.seed)
