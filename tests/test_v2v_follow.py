"""The built-in model follows its input video (issue 35), read off its pixels by client/pixels.py.

Inputs rendered from models/scenes.py that neither training nor the other tests use as input ("a red ball
moving right" from the centre; a green ball moving left from an off-centre start on gray, a triple held out
of training), under prompts naming another colour and no motion ("a blue ball", "a yellow ball"). The model
is the built-in one after models/train.py's follow stage (models/assets/tiny_follow.safetensors; the shipped
tiny.safetensors follows at no strength: 33-40 px off, benchmarks/RESULTS.md). At strengths 0.625 and 0.357
(it starts at steps 2 and 3 of 4) the output's object is where the input's is: a mean error of at most 8 px,
half the big object's radius. Over the input object's region the output shows the prompt's colour in at
least 90 % of the frames, except the held-out input at 0.357: one step from so little noise leaves its
yellow dull (about (200, 180, 25)), and client/pixels.py reads 12-19 % of those frames as the nearest
palette entry, orange; at least 75 % read yellow and none green. At strength 1.0 (text-to-video: the input
is pure noise) the object is not where the input's is. CPU, seconds.
"""

import pytest

from benchmarks.v2v_follow import FOLLOW_PX, cases, run
from models import build_generator
from models.model_file import FOLLOW_WEIGHTS

NOT_SHIPPED = pytest.mark.skipif(not FOLLOW_WEIGHTS.is_file(), reason=f"{FOLLOW_WEIGHTS} is not in this checkout")


@pytest.fixture(scope="module")
def gen():
    return build_generator("tiny", weights=str(FOLLOW_WEIGHTS))


@NOT_SHIPPED
@pytest.mark.parametrize("strength", [0.625, 0.357])
@pytest.mark.parametrize("case", cases(), ids=lambda c: c.name)
def test_the_built_in_model_follows_its_input_in_the_prompts_colour(gen, case, strength):
    r = run(gen, case, strength, chunks=6, seed=0)
    assert r.start_step == gen.start_step(strength) > 0 and r.frames == 69
    assert r.found >= 0.9, r
    assert r.error_px <= FOLLOW_PX, r
    held_out_low = strength < 0.5 and "held out" in case.name
    assert r.colour >= (0.75 if held_out_low else 0.9) and r.input_colour == 0, r


@NOT_SHIPPED
@pytest.mark.parametrize("case", cases(), ids=lambda c: c.name)
def test_at_strength_one_the_input_is_not_followed(gen, case):
    r = run(gen, case, 1.0, chunks=6, seed=0)  # text-to-video: the prompt's object, still, where it starts
    assert r.start_step == 0 and r.error_px > 3 * FOLLOW_PX and not r.follows, r
