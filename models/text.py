"""Text encoders. Built in: a deterministic hashing encoder that needs no weights.

An encoder says what it understands: `vocabulary` is the words it was trained with (the built-in model's
caption words), or None for an open vocabulary (umT5, or the hashing encoder of random weights, to which
every word means as little); `unknown_words(prompt)` the words of a prompt outside it, which a model with
a vocabulary draws as noise. The server passes both on to the viewer.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Sequence
from typing import Protocol

import torch


class TextEncoder(Protocol):
    text_dim: int  # width of each token embedding
    text_len: int  # tokens per prompt, zero-padded
    vocabulary: tuple[str, ...] | None  # the words the model was trained with; None: an open vocabulary

    def encode(self, prompts: list[str]) -> torch.Tensor:
        """[B, text_len, text_dim] float32 embeddings, zero past each prompt's tokens."""
        ...

    def unknown_words(self, prompt: str) -> list[str]:
        """The words of `prompt` the encoder reads (as it reads them: lower case, within text_len) that are
        outside `vocabulary`, each once, in order of appearance; [] for an open vocabulary."""
        ...


_WORD = re.compile(r"\w+|[^\w\s]")


class HashTextEncoder:
    """Each word maps to a fixed pseudo-random vector seeded by its hash, plus a position code.

    Same prompt, same embedding, on any machine; different words give near-orthogonal
    vectors, so prompts steer a randomly initialised model in a repeatable way.
    """

    vocabulary: tuple[str, ...] | None = None  # any word hashes to a vector: none is more known than another

    def __init__(self, text_dim: int, text_len: int) -> None:
        self.text_dim, self.text_len = text_dim, text_len
        self._words: dict[str, torch.Tensor] = {}

    def tokenize(self, prompt: str) -> list[str]:
        return _WORD.findall(prompt.lower())[: self.text_len]

    def unknown_words(self, prompt: str) -> list[str]:
        if self.vocabulary is None:
            return []
        known = self._known
        return list(dict.fromkeys(w for w in self.tokenize(prompt) if w not in known))

    @functools.cached_property
    def _known(self) -> frozenset[str]:
        return frozenset(self.vocabulary or ())

    def word_vector(self, word: str) -> torch.Tensor:
        """[text_dim]: `word`'s vector, before the position code (a model file stores these for its words)."""
        if word not in self._words:
            seed = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little") & (2**63 - 1)
            vec = torch.randn(self.text_dim, generator=torch.Generator().manual_seed(seed))
            if len(self._words) > 50_000:
                self._words.clear()
            self._words[word] = vec
        return self._words[word]

    def encode(self, prompts: list[str]) -> torch.Tensor:
        out = torch.zeros(len(prompts), self.text_len, self.text_dim)
        for b, prompt in enumerate(prompts):
            words = self.tokenize(prompt)
            if words:
                out[b, : len(words)] = torch.stack([self.word_vector(w) for w in words]) + self._positions[: len(words)]
        return out

    @functools.cached_property
    def _positions(self) -> torch.Tensor:
        """[text_len, text_dim]: 0.1 x the sinusoidal code of each token position (zero-padded to text_dim)."""
        pos = torch.arange(self.text_dim // 2, dtype=torch.float32)
        angle = torch.arange(self.text_len, dtype=torch.float32)[:, None] / 10000 ** (2 * pos / self.text_dim)
        code = torch.cat([angle.sin(), angle.cos()], dim=1)
        return torch.nn.functional.pad(0.1 * code, (0, self.text_dim - code.shape[1]))


class VocabTextEncoder(HashTextEncoder):
    """The hashing encoder with a trained model's own word vectors: each word of `words` maps to its row of
    `vectors` (as a model file stores them: the vectors the model was trained with, whatever this machine's
    hashing or random generator would give), any other word to its hashed vector, as before. `words` are
    its vocabulary: the model never saw the others, and draws noise for them."""

    def __init__(self, text_dim: int, text_len: int, words: Sequence[str], vectors: torch.Tensor) -> None:
        super().__init__(text_dim, text_len)
        if tuple(vectors.shape) != (len(words), text_dim):
            raise ValueError(f"vectors {tuple(vectors.shape)} do not fit {len(words)} words of width {text_dim}")
        self.vocabulary = tuple(words)
        self._vectors: dict[str, torch.Tensor] = {w: v for w, v in zip(words, vectors.float().clone())}

    def word_vector(self, word: str) -> torch.Tensor:
        vec = self._vectors.get(word)
        return vec if vec is not None else super().word_vector(word)
