"""The kinds of forward a stream's chunks are made of: what the scheduler plans (streamsvc/scheduling/) and the
generator runs (models/generator.py). One enum for both, in a module of its own that imports nothing (not torch):
the scheduler is pure, and takes it without the model."""

from __future__ import annotations

import enum


class WorkKind(enum.Enum):
    """One forward of one stream (or of a batch of streams at the same kind and step)."""

    RECACHE = "recache"  # recompute the cached frames' K/V under a new prompt (one forward, no frames)
    DENOISE = "denoise"  # one denoising step of the chunk in progress
    COMMIT = "commit"  # write the clean chunk's K/V, decode its frames
