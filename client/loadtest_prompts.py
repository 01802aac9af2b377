"""What the load test's viewers ask for, and when: each viewer's opening prompt and its changes, spread over the
viewers (``prompt_schedule``, ``viewer_prompt``).

A model with a vocabulary (the built-in one knows only its caption words, and draws noise for others) gets scene
captions made of those words (``caption``: colour, shape and motion, each prompt a new colour); a model without
(real weights, umT5) gets free text. ``probe_vocabulary`` asks the server which, from one short stream's ``ready``.
"""

from __future__ import annotations

from collections.abc import Sequence

from client.pixels import PALETTE
from client.viewer import ClientConfig, DecodeMode
from client.ws_client import StreamClient

SUBJECTS = (
    "a red fox running through snow", "waves breaking on a rocky shore", "a city street at night in the rain",
    "a hot air balloon over green hills", "a koi pond seen from above", "a train crossing a desert bridge",
    "clouds racing over a mountain ridge", "a campfire under the stars", "a cat watching birds at a window",
    "a jellyfish drifting in blue water", "autumn leaves falling in a park", "a lighthouse in a storm",
    "a field of sunflowers in the wind", "a robot walking through a market", "northern lights over a lake",
    "a waterfall in a tropical forest",
)
STYLES = ("at dawn", "in watercolour", "as a pencil sketch", "in slow motion", "in neon colours", "at dusk")
PROMPT_QUIET_TAIL_S = 2.0  # no new prompt in the last seconds of a session: it could not reach the screen in time
# a model with a vocabulary (the built-in one), and --verify-pixels: the viewers' prompts are scene captions
# (models/scenes.py's templates; the client keeps its own copy, as client/pixels.py keeps the palette, and uses the
# words of it the server's `ready` lists); each prompt's colour differs from the one before
CAPTION_SHAPES = ("ball", "square", "triangle")
CAPTION_MOTIONS = ("moving right", "moving left", "rising", "falling", "standing still")
PROBE_PROMPT = "a red ball"  # the probe stream's prompt (a caption of the built-in model, plain English for others)


def prompt_schedule(index: int, streams: int, every_s: float, duration_s: float, captions: bool = False,
                    vocabulary: Sequence[str] | None = None) -> list[tuple[float, str]]:
    """Viewer ``index``'s prompt changes: every ``every_s`` from a phase in [every_s, 2 every_s), spread over viewers.
    Each is ``viewer_prompt``'s (captions for a model with a ``vocabulary``, or with ``captions``)."""
    if every_s <= 0:
        return []
    t = every_s * (1.0 + index / max(1, streams))
    out = []
    for k in range(int(duration_s / every_s) + 2):
        if t > duration_s - PROMPT_QUIET_TAIL_S:
            break
        out.append((t, viewer_prompt(index, k + 1, captions, vocabulary)))
        t += every_s
    return out


def viewer_prompt(index: int, change: int, captions: bool = False, vocabulary: Sequence[str] | None = None) -> str:
    """Viewer ``index``'s prompt number ``change`` (0: its opening prompt): a scene caption in the words of the
    server model's ``vocabulary`` when it has one (or with ``captions``), else free text (a subject and a style)."""
    if captions or vocabulary:
        return caption(index, change, vocabulary)
    subject = SUBJECTS[index % len(SUBJECTS)]
    if change == 0:
        return f"{subject} (viewer {index})"
    return f"{subject}, {STYLES[(change - 1) % len(STYLES)]} (viewer {index}, change {change})"


def caption(index: int, change: int, vocabulary: Sequence[str] | None = None) -> str:
    """Viewer ``index``'s scene caption number ``change`` (0: its opening prompt): colour, shape and motion, the
    colour a step along the palette from the previous caption's, so that every prompt asks for a new colour.
    With a ``vocabulary`` (the server model's), only the colours, shapes and motions it has every word of; a
    vocabulary the template does not fit gets four of its own words in turn."""
    def fits(phrase: str) -> bool:
        return known is None or all(w in known for w in phrase.split())

    known = None if vocabulary is None else set(vocabulary)
    colours = [c for c in PALETTE if fits(c)]
    shapes = [s for s in CAPTION_SHAPES if fits(s)]
    motions = [m for m in CAPTION_MOTIONS if fits(m)]
    if not (colours and shapes and motions and fits("a")):
        words = sorted(known or ())
        return " ".join(words[(4 * (index + change) + i) % len(words)] for i in range(4)) if words else PROBE_PROMPT
    colour = colours[(index + change) % len(colours)]
    shape = shapes[(index // len(colours) + change) % len(shapes)]
    motion = motions[(index + 2 * change) % len(motions)]
    return f"a {colour} {shape} {motion}"


async def probe_vocabulary(url: str, token: str | None, timeout_s: float,
                           tls: dict | None = None) -> tuple[bool, list[str] | None]:
    """What the server's model understands, from the ``ready`` of one short stream (opened, and closed at once):
    (True, its vocabulary), or (True, None) for an open vocabulary (real weights); (False, None) when no stream
    was admitted (the server full or refusing: the viewers will be told why)."""
    probe = StreamClient(url, ClientConfig(prompt=PROBE_PROMPT, token=token, stats_every_s=0.0,
                                           decode=DecodeMode.NONE, open_timeout_s=timeout_s, **(tls or {})))
    async with probe:
        ready = probe.ready
    return ready is not None, None if ready is None else ready.vocabulary
