"""Wan2.1's text encoder: umT5-XXL's encoder (transformers' `UMT5EncoderModel`) and its tokenizer.

Loads from a local folder in either layout users have (nothing is fetched from a hub):

- Wan's original layout: `models_t5_umt5-xxl-enc-bf16.pth` (Wan's own key names, renamed here to
  transformers' by `wan_key_map`) and the tokenizer in `google/umt5-xxl/`;
- the Diffusers layout: `text_encoder/` (config.json + safetensors) and `tokenizer/`.

Prompts are cleaned and tokenized as Wan's references do, padded/truncated to `text_len` tokens with
EOS, and the output is zeroed past each prompt's tokens (the DiT's cross-attention has no mask: the
zero tail is part of the conditioning). transformers, tokenizers, ftfy are the `real` extra and are
imported only when an encoder is built.
"""

from __future__ import annotations

import html
import re
from collections import OrderedDict
from pathlib import Path

import torch
from torch import nn

from models.weights import CheckpointError

WAN_CHECKPOINT = "models_t5_umt5-xxl-enc-bf16.pth"  # Wan's layout: the encoder's tensors, Wan's names
WAN_TOKENIZER = "google/umt5-xxl"  # Wan's layout: tokenizer.json / spiece.model ...
DIFFUSERS_ENCODER = "text_encoder"  # Diffusers' layout: config.json + *.safetensors
DIFFUSERS_TOKENIZER = "tokenizer"

TEXT_LEN = 512  # tokens per prompt, as Wan2.1 encodes them

# umT5-XXL, the encoder Wan2.1 uses (Wan's `umt5_xxl(encoder_only=True)`)
XXL = dict(
    vocab_size=256384,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_heads=64,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
)

# Wan's per-block names -> transformers' names under `encoder.block.{i}.`
_BLOCK_RENAMES = {
    "attn.q.weight": "layer.0.SelfAttention.q.weight",
    "attn.k.weight": "layer.0.SelfAttention.k.weight",
    "attn.v.weight": "layer.0.SelfAttention.v.weight",
    "attn.o.weight": "layer.0.SelfAttention.o.weight",
    # umT5: every layer has its own relative position bias table [buckets, heads]
    "pos_embedding.embedding.weight": "layer.0.SelfAttention.relative_attention_bias.weight",
    "norm1.weight": "layer.0.layer_norm.weight",
    "norm2.weight": "layer.1.layer_norm.weight",
    "ffn.gate.0.weight": "layer.1.DenseReluDense.wi_0.weight",  # the GELU branch
    "ffn.fc1.weight": "layer.1.DenseReluDense.wi_1.weight",  # the linear branch
    "ffn.fc2.weight": "layer.1.DenseReluDense.wo.weight",
}


def wan_key_map(num_layers: int) -> dict[str, tuple[str, ...]]:
    """Wan's key -> transformers' key(s) for an encoder of `num_layers` blocks (10 * layers + 2 keys)."""
    out: dict[str, tuple[str, ...]] = {
        "token_embedding.weight": ("shared.weight", "encoder.embed_tokens.weight"),  # tied
        "norm.weight": ("encoder.final_layer_norm.weight",),
    }
    for i in range(num_layers):
        for wan, hf in _BLOCK_RENAMES.items():
            out[f"blocks.{i}.{wan}"] = (f"encoder.block.{i}.{hf}",)
    return out


def clean_prompt(text: str) -> str:
    """Wan's cleaning: ftfy.fix_text, HTML unescaped twice, whitespace collapsed and stripped."""
    import ftfy

    text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


def _layout_error(path: Path) -> CheckpointError:
    return CheckpointError(
        f"{path} holds no text encoder in a known layout: expected either Wan's layout "
        f"({WAN_CHECKPOINT} and {WAN_TOKENIZER}/ with tokenizer.json or spiece.model) or the Diffusers "
        f"layout ({DIFFUSERS_ENCODER}/config.json with *.safetensors and {DIFFUSERS_TOKENIZER}/)"
    )


def config_from_wan_state_dict(sd: dict[str, torch.Tensor]):
    """A `UMT5Config` inferred from the shapes of a Wan-layout state dict (any size, XXL included)."""
    from transformers import UMT5Config

    needed = ("token_embedding.weight", "blocks.0.attn.q.weight", "blocks.0.ffn.fc1.weight", "blocks.0.pos_embedding.embedding.weight")
    absent = [k for k in needed if k not in sd]
    if absent:
        raise CheckpointError(f"checkpoint lacks {', '.join(absent)} (needed to infer the encoder's size); is this Wan's umT5 file?")
    blocks = {int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))}
    vocab, d_model = sd["token_embedding.weight"].shape
    buckets, heads = sd["blocks.0.pos_embedding.embedding.weight"].shape
    inner = sd["blocks.0.attn.q.weight"].shape[0]
    if inner % heads:
        raise CheckpointError(f"blocks.0.attn.q.weight has {inner} rows, not a multiple of the {heads} heads of the position bias")
    return UMT5Config(
        vocab_size=vocab,
        d_model=d_model,
        d_kv=inner // heads,
        d_ff=sd["blocks.0.ffn.fc1.weight"].shape[0],
        num_layers=max(blocks) + 1,
        num_heads=heads,
        relative_attention_num_buckets=buckets,
        relative_attention_max_distance=XXL["relative_attention_max_distance"],
        feed_forward_proj="gated-gelu",
        is_encoder_decoder=False,
        use_cache=False,
    )


def _meta_model(config) -> nn.Module:
    from transformers import UMT5EncoderModel

    with torch.device("meta"):
        return UMT5EncoderModel(config)


def _problems(missing: list[str], unexpected: list[str], shapes: list[str]) -> str:
    """'2 missing key(s): a, b; 1 unexpected key(s): c' (as models/weights.py words it); '' if none."""
    out = []
    for what, keys in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", shapes)):
        if keys:
            shown = ", ".join(keys[:8]) + (f", ... ({len(keys) - 8} more)" if len(keys) > 8 else "")
            out.append(f"{len(keys)} {what} key(s): {shown}")
    return "; ".join(out)


def _check_wan_keys(sd: dict[str, torch.Tensor], keymap: dict[str, tuple[str, ...]], own: dict[str, torch.Tensor]) -> None:
    """Raise CheckpointError naming every missing, unexpected or mis-shaped key (Wan's names)."""
    missing = sorted(set(keymap) - set(sd))
    unexpected = sorted(set(sd) - set(keymap))
    shapes = sorted(
        f"{k}: checkpoint {tuple(sd[k].shape)} vs model {tuple(own[keymap[k][0]].shape)}"
        for k in set(keymap) & set(sd)
        if sd[k].shape != own[keymap[k][0]].shape
    )
    problems = _problems(missing, unexpected, shapes)
    if problems:
        raise CheckpointError(f"umT5 checkpoint does not match the encoder: {problems}")


def encoder_from_wan_state_dict(
    sd: dict[str, torch.Tensor], device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16
) -> nn.Module:
    """A `UMT5EncoderModel` holding a Wan-layout state dict, built on the meta device (no random init)."""
    config = config_from_wan_state_dict(sd)
    model = _meta_model(config)
    keymap = wan_key_map(config.num_layers)
    _check_wan_keys(sd, keymap, model.state_dict())
    hf: dict[str, torch.Tensor] = {}
    for wan, names in keymap.items():
        t = sd[wan].to(device=device, dtype=dtype)
        for name in names:
            hf[name] = t
    model.load_state_dict(hf, strict=True, assign=True)
    model.tie_weights()  # one Parameter for shared / encoder.embed_tokens
    return model.eval().requires_grad_(False)


def _load_wan_layout(path: Path, device, dtype):
    from transformers import AutoTokenizer

    sd = torch.load(path / WAN_CHECKPOINT, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(sd, dict):
        raise CheckpointError(f"{path / WAN_CHECKPOINT}: expected a dict of tensors, got {type(sd).__name__}")
    model = encoder_from_wan_state_dict(sd, device, dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(path / WAN_TOKENIZER), local_files_only=True)
    return model, tokenizer


def _load_diffusers_layout(path: Path, device, dtype):
    import transformers
    from transformers import AutoTokenizer, UMT5EncoderModel

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    dtype_arg = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    # mismatched sizes come back in `info` (and are raised below, named) rather than as transformers' error
    model, info = UMT5EncoderModel.from_pretrained(
        str(path / DIFFUSERS_ENCODER),
        local_files_only=True,
        output_loading_info=True,
        ignore_mismatched_sizes=True,
        **{dtype_arg: dtype},
    )
    shapes = [  # (key, checkpoint shape, model shape) tuples
        f"{m[0]}: checkpoint {tuple(m[1])} vs model {tuple(m[2])}" if isinstance(m, tuple) else str(m)
        for m in info.get("mismatched_keys", ())
    ]
    problems = _problems(sorted(info.get("missing_keys", ())), sorted(info.get("unexpected_keys", ())), sorted(shapes))
    if problems:
        raise CheckpointError(f"{path / DIFFUSERS_ENCODER} does not match UMT5EncoderModel: {problems}")
    tokenizer = AutoTokenizer.from_pretrained(str(path / DIFFUSERS_TOKENIZER), local_files_only=True)
    return model.to(device).eval().requires_grad_(False), tokenizer


def detect_layout(path: str | Path) -> str:
    """'wan' or 'diffusers' for a local folder; CheckpointError naming both layouts' files otherwise."""
    path = Path(path)
    if (path / WAN_CHECKPOINT).is_file() and (path / WAN_TOKENIZER).is_dir():
        return "wan"
    if (path / DIFFUSERS_ENCODER / "config.json").is_file() and (path / DIFFUSERS_TOKENIZER).is_dir():
        return "diffusers"
    raise _layout_error(path)


class UMT5TextEncoder:
    """`TextEncoder` of Wan2.1: umT5 hidden states of the cleaned prompt, zero past its tokens.

    Runs in the model's dtype on its device; `encode` returns float32 on that device. Encoded
    prompts are kept in an LRU of `cache_size` entries, each only its own tokens' rows.
    """

    vocabulary: tuple[str, ...] | None = None  # open: its tokenizer spells any word out of subword pieces

    def __init__(self, model: nn.Module, tokenizer, text_len: int = TEXT_LEN, cache_size: int = 64) -> None:
        if text_len < 1 or cache_size < 0:
            raise ValueError(f"text_len must be >= 1 and cache_size >= 0, got text_len={text_len}, cache_size={cache_size}")
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token (umT5's is <pad>, id 0)")
        self.model, self.tokenizer = model, tokenizer
        self.text_len = text_len
        self.text_dim: int = model.config.d_model
        self.cache_size = cache_size
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()  # cleaned prompt -> [n_tokens, text_dim], model dtype

    @classmethod
    def from_wan_dir(
        cls,
        path: str | Path,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        text_len: int = TEXT_LEN,
        cache_size: int = 64,
    ) -> UMT5TextEncoder:
        """Load from a local Wan2.1 folder in Wan's original layout or the Diffusers layout."""
        path = Path(path)
        layout = detect_layout(path)
        load = _load_wan_layout if layout == "wan" else _load_diffusers_layout
        model, tokenizer = load(path, torch.device(device), dtype)
        return cls(model, tokenizer, text_len=text_len, cache_size=cache_size)

    @property
    def device(self) -> torch.device:
        return self.model.shared.weight.device

    def unknown_words(self, prompt: str) -> list[str]:
        """Always []: umT5 reads any text (its 256k subword pieces are no list of words to show a viewer)."""
        return []

    def tokenize(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, mask: [B, L] with L <= text_len the longest prompt's tokens (EOS included); cleaned first."""
        return self._tokenize([clean_prompt(p) for p in prompts])

    def _tokenize(self, cleaned: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.tokenizer(
            cleaned,
            padding="longest",
            truncation=True,
            max_length=self.text_len,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        return batch["input_ids"], batch["attention_mask"]

    @torch.inference_mode()
    def _run(self, cleaned: list[str]) -> list[torch.Tensor]:
        """Each cleaned prompt's hidden states, [n_tokens, text_dim] in the model's dtype."""
        ids, mask = self._tokenize(cleaned)
        ids, mask = ids.to(self.device), mask.to(self.device)
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, L, text_dim]
        lens = mask.sum(dim=1).tolist()
        return [h[:n].clone() for h, n in zip(hidden, lens)]

    def encode(self, prompts: list[str]) -> torch.Tensor:
        """[B, text_len, text_dim] float32 on the model's device, exactly zero past each prompt's tokens."""
        cleaned = [clean_prompt(p) for p in prompts]
        todo = list(dict.fromkeys(c for c in cleaned if c not in self._cache))
        fresh = dict(zip(todo, self._run(todo))) if todo else {}
        out = torch.zeros(len(prompts), self.text_len, self.text_dim, device=self.device)
        for b, c in enumerate(cleaned):
            h = fresh[c] if c in fresh else self._cache[c]
            out[b, : h.shape[0]] = h.float()
            self._remember(c, h)
        return out

    def _remember(self, cleaned: str, h: torch.Tensor) -> None:
        if self.cache_size == 0:
            return
        self._cache[cleaned] = h
        self._cache.move_to_end(cleaned)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
