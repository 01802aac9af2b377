"""Streams that start from an image (``start``'s ``image``; the carrier: streamsvc/wire/image.py), on the engine thread.

The image is the stream's chunk 0. At its admission the engine encodes it with the model's encoder and commits it to
the stream's cache as its clean first latent frame, under its prompt (`ChunkGenerator.start_from_image`: one encoder
call, one forward of one latent frame at timestep 0, the decode of one frame), and hands that frame to the output
stage as chunk 0 (header ``input`` "image"). Generation goes on from chunk 1 under the prompt, as the scheduler plans
it. A one-frame chunk 0 goes out with chunk 1 (alone it would play and stall: `Engine._handed_over`). The image is in
the stream's cache from then on, like any committed frame: a pause parks it with the rest, a resume goes on from
where the stream stopped, and no image is applied again; watchers and recordings get chunk 0 as any chunk.

The scheduler's accounting: the stream is admitted as one whose first chunk has one frame
(``StreamRequest.first_chunk_frames`` 1), and `Scheduler.started` counts that chunk committed at admission and in
flight until it is delivered, so the frames, chunks and deliveries it counts are the stream's. Admission charges a
starting stream's first delivery, two chunks here, as two chunks on every stage: on the device that is more than the
image costs (one commit-sized forward of one latent frame and the encoder, against a chunk's denoising forwards and
commit); on the output stage and the send it is what it costs (two chunks encoded and sent). The image's work runs on
the engine thread between two launches, like a command, outside any timed plan: it is no sample of the forwards'
costs, and other streams wait for it as for one forward. `warm_up` runs it once at start-up (so that nothing runs
for the first time on the serving path: the one-frame forward, the encoder) and logs what it takes.

Refused, with the reason: on a model without an encoder, under --parallel (a forward split over a device group
takes no image, as it takes no input video), and where the warm-up's image start failed (logged; the server serves
without images rather than not at all).
"""

from __future__ import annotations

import logging
import statistics
import time

import numpy as np
import torch

from models.stream import Chunk

log = logging.getLogger("streamsvc.engine")

NO_ENCODER = ("this model has no encoder, so it cannot start a stream from an image (start without \"image\"); the "
              "built-in model and those with a Wan VAE or TAEHV encoder can")
IMAGE_AND_INPUT = ("a stream starts from an image or restyles input video, not both (its first frame would be both): "
                   "leave out the image or the input")
PARALLEL = ("a start image is not built for a stream split over a group of devices (--parallel): serve without "
            "--parallel to start streams from images")


class StartImages:
    """Start images on one engine's generator `gen` (module docstring); `parallel`: a --parallel group's."""

    def __init__(self, gen=None, parallel: bool = False) -> None:
        self.refusal = (PARALLEL if parallel else None if getattr(gen, "can_take_input", False) else NO_ENCODER)
        self.start_s: float | None = None  # what an image start took at the warm-up (None: not run)

    def warm_up(self, gen, runs: int = 2) -> None:
        """Run image starts on throwaway streams (the serving path's first run of them is here) and log their time."""
        if self.refusal is not None:
            return
        image = np.full((gen.model_cfg.height, gen.model_cfg.width, 3), 128, np.uint8)
        took = []
        for _ in range(runs):
            state = gen.open_stream("image-warmup", "warm up", seed=0)
            try:
                t0 = time.perf_counter()
                self.start(gen, state, image)
                if gen.device.type == "cuda":
                    torch.cuda.synchronize(gen.device)
                took.append(time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - the server serves without images rather than not at all
                log.exception("a start image failed at the warm-up: streams are refused an image")
                self.refusal = f"start images failed on this server at start-up ({type(e).__name__}: {e})"
                return
            finally:
                gen.close_stream(state)
        self.start_s = statistics.median(took)
        log.info("start images: %.1f ms each (encode, a forward of one latent frame, decode; median of %d)",
                 1e3 * self.start_s, runs)

    @staticmethod
    def start(gen, state, image: np.ndarray) -> Chunk:
        """Stream `state`'s chunk 0 from `image` ([H, W, 3] uint8 at the model's frame size), committed to its cache."""
        return gen.start_from_image(state, torch.from_numpy(np.ascontiguousarray(image)).to(gen.device))
