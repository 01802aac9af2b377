"""The cross-attention K/V of prompts: computed once per prompt (and per style, where a style changes them),
kept for the streams that switch back and forth, and stacked for a batched forward.

A prompt's K/V go through the text embedding and each block's cross-attention k and v. A style whose adapter
adapts any of those (models/adapters.py `Adapter.touches_text`) gives the prompt other K/V, kept under the
prompt, the adapter and the scale; any other style shares the prompt's own.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from models.adapters import AdapterUse
from models.dit import CausalWanModel, TextKV
from models.text import TextEncoder

PROMPT_CACHE_PROMPTS = 256  # prompts whose cross-attention K/V a generator keeps beyond the streams using them
PROMPT_CACHE_BYTES = 2 * 2**30  # and at most this much of them (device memory no KV budget counts)


class PromptCache:
    """Recent prompts' cross-attention K/V, the least recently used dropped first."""

    def __init__(self, model: CausalWanModel, text_encoder: TextEncoder) -> None:
        self.model, self.text_encoder = model, text_encoder
        self.entries: OrderedDict[str | tuple, TextKV] = OrderedDict()  # by `text_key`, newest last

    def encode(self, prompt: str, lora: AdapterUse | None = None) -> TextKV:
        """The K/V of `prompt` under the style `lora`, computed once. The most recent ones are kept (at most
        PROMPT_CACHE_PROMPTS, and PROMPT_CACHE_BYTES of them: a wan2.1-14b prompt's K/V are 420 MB, 2 x 40
        layers x 512 tokens x 5120 x 2 B); a stream holds its own prompt's whatever the cache drops."""
        key = text_key(prompt, lora)
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key]
        with torch.inference_mode():
            kv = self.model.text_kv(self.text_encoder.encode([prompt]), lora)
        self.entries[key] = kv
        size = sum(t.numel() * t.element_size() for pair in kv for t in pair)
        while len(self.entries) > max(1, min(PROMPT_CACHE_PROMPTS, PROMPT_CACHE_BYTES // max(1, size))):
            self.entries.popitem(last=False)
        return kv

    def cached(self, prompt: str, lora: AdapterUse | None = None) -> TextKV | None:
        """The K/V of `prompt` under `lora` if the cache has them (nothing is computed, nothing moves)."""
        return self.entries.get(text_key(prompt, lora))


def text_key(prompt: str, lora: AdapterUse | None) -> str | tuple:
    """The cache's key for a prompt's K/V: the prompt, and the style where it changes them."""
    return prompt if lora is None or not lora.adapter.touches_text else (prompt, lora.adapter.uid, lora.scale)


def batch_text(texts: list[TextKV]) -> TextKV:
    """Streams' K/V (each batch 1) stacked along the batch, per layer."""
    if len(texts) == 1:
        return texts[0]
    return [(torch.cat([t[i][0] for t in texts]), torch.cat([t[i][1] for t in texts])) for i in range(len(texts[0]))]
