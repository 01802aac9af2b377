"""What a text encoder says it understands: its vocabulary and a prompt's unknown words (issue 33)."""

import torch

from models import HashTextEncoder, build_generator
from models.scenes import vocabulary
from models.text import VocabTextEncoder


def vocab_encoder(text_len: int = 16) -> VocabTextEncoder:
    words = vocabulary()
    return VocabTextEncoder(8, text_len, words, torch.randn(len(words), 8, generator=torch.Generator().manual_seed(0)))


def test_a_trained_vocabulary_names_the_words_of_a_prompt_outside_it():
    enc = vocab_encoder()
    assert enc.vocabulary == tuple(vocabulary())
    assert enc.unknown_words("a red ball moving right") == []
    assert enc.unknown_words("Show me a small blue box, on a white background") == []  # "," is a caption word
    # the load test's old default prompt: every noun and the style are unknown, each named once, lower case
    assert enc.unknown_words("A red Fox running through snow, in watercolour; a fox") == [
        "fox", "running", "through", "snow", "watercolour", ";"]


def test_only_the_words_the_encoder_reads_count():
    enc = vocab_encoder(text_len=4)
    assert enc.unknown_words("a red ball rising fox") == []  # "fox" is past text_len: never encoded


def test_an_open_vocabulary_has_no_unknown_words():
    enc = HashTextEncoder(8, 16)
    assert enc.vocabulary is None and enc.unknown_words("a red fox running through snow") == []


def test_the_built_in_model_knows_its_caption_words_and_random_weights_none():
    builtin = build_generator("tiny", device="cpu", weights="builtin").text_encoder
    assert builtin.vocabulary == tuple(vocabulary()) and builtin.unknown_words("a green fox") == ["fox"]
    random = build_generator("tiny", device="cpu", weights="random").text_encoder
    assert random.vocabulary is None and random.unknown_words("a green fox") == []
