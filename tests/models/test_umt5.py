"""umT5 text encoder: both on-disk layouts, strict loading, the zero tail, the XXL key set, cleaning.

Tiny random models and a word-level tokenizer written to tmp dirs; CPU only, nothing downloaded.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("ftfy")

from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel  # noqa: E402

from models.umt5 import (  # noqa: E402
    WAN_CHECKPOINT,
    XXL,
    UMT5TextEncoder,
    clean_prompt,
    config_from_wan_state_dict,
    detect_layout,
    encoder_from_wan_state_dict,
    wan_key_map,
)
from models.weights import CheckpointError  # noqa: E402

WORDS = "a an the cat dog runs fast over hill red blue sky sea boat at night in rain snow".split()
TINY = dict(vocab_size=64, d_model=16, d_kv=4, d_ff=24, num_layers=2, num_heads=4, relative_attention_num_buckets=32)
TEXT_LEN = 12

# Wan's per-block tensor names and shapes (wan/modules/t5.py: T5SelfAttention, T5Attention, T5FeedForward,
# T5RelativeEmbedding), written here independently of models/umt5.py's rename table
def wan_block_shapes(dim: int, dim_attn: int, dim_ffn: int, heads: int, buckets: int) -> dict[str, tuple[int, ...]]:
    return {
        "norm1.weight": (dim,),
        "attn.q.weight": (dim_attn, dim),
        "attn.k.weight": (dim_attn, dim),
        "attn.v.weight": (dim_attn, dim),
        "attn.o.weight": (dim, dim_attn),
        "norm2.weight": (dim,),
        "ffn.gate.0.weight": (dim_ffn, dim),
        "ffn.fc1.weight": (dim_ffn, dim),
        "ffn.fc2.weight": (dim, dim_ffn),
        "pos_embedding.embedding.weight": (buckets, heads),
    }


def wan_shapes(vocab: int, dim: int, dim_attn: int, dim_ffn: int, heads: int, layers: int, buckets: int) -> dict[str, tuple[int, ...]]:
    out = {"token_embedding.weight": (vocab, dim), "norm.weight": (dim,)}
    for i in range(layers):
        for name, shape in wan_block_shapes(dim, dim_attn, dim_ffn, heads, buckets).items():
            out[f"blocks.{i}.{name}"] = shape
    return out


def make_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2} | {w: i + 3 for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def wan_state_dict(model: UMT5EncoderModel) -> dict[str, torch.Tensor]:
    """The model's tensors under Wan's names (the file Wan's T5EncoderModel loads)."""
    own = model.state_dict()
    return {wan: own[hf[0]].clone() for wan, hf in wan_key_map(model.config.num_layers).items()}


@pytest.fixture(scope="module")
def tiny_model() -> UMT5EncoderModel:
    torch.manual_seed(0)
    model = UMT5EncoderModel(UMT5Config(**TINY, feed_forward_proj="gated-gelu")).eval()
    with torch.no_grad():  # layer norms away from 1 so a swapped norm shows
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tiny_model):
    """Two folders laid out as users have them: Wan's original one and Diffusers'."""
    tok = make_tokenizer()
    wan = tmp_path_factory.mktemp("wan")
    torch.save(wan_state_dict(tiny_model), wan / WAN_CHECKPOINT)
    tok.save_pretrained(str(wan / "google" / "umt5-xxl"))
    diffusers = tmp_path_factory.mktemp("diffusers")
    tiny_model.save_pretrained(str(diffusers / "text_encoder"))
    tok.save_pretrained(str(diffusers / "tokenizer"))
    return wan, diffusers


def wan_reference(
    sd: dict[str, torch.Tensor], ids: torch.Tensor, mask: torch.Tensor, heads: int, buckets: int = 32, max_dist: int = 128
) -> torch.Tensor:
    """Wan's umT5 encoder forward on Wan's key names (float32): relative bias per layer, no QK scaling."""

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    length = ids.shape[1]
    rel = torch.arange(length)[None, :] - torch.arange(length)[:, None]  # key - query
    half = buckets // 2
    exact = half // 2
    dist = rel.abs()
    far = exact + (torch.log(dist.float().clamp(min=1) / exact) / math.log(max_dist / exact) * (half - exact)).long()
    bucket = (rel > 0).long() * half + torch.where(dist < exact, dist, far.clamp(max=half - 1))
    neg = torch.finfo(torch.float32).min
    x = sd["token_embedding.weight"][ids]
    b = ids.shape[0]
    for i in range(1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))):
        w = {k[len(f"blocks.{i}.") :]: v for k, v in sd.items() if k.startswith(f"blocks.{i}.")}
        h = rms(x, w["norm1.weight"])
        q, k, v = (F.linear(h, w[f"attn.{n}.weight"]).view(b, length, heads, -1) for n in "qkv")
        bias = w["pos_embedding.embedding.weight"][bucket].permute(2, 0, 1)[None]  # [1, H, L, L]
        att = torch.einsum("binc,bjnc->bnij", q, k) + bias
        att = att.masked_fill(mask[:, None, None, :] == 0, neg).softmax(-1)
        x = x + F.linear(torch.einsum("bnij,bjnc->binc", att, v).reshape(b, length, -1), w["attn.o.weight"])
        h = rms(x, w["norm2.weight"])
        gate = F.gelu(F.linear(h, w["ffn.gate.0.weight"]), approximate="tanh")
        x = x + F.linear(gate * F.linear(h, w["ffn.fc1.weight"]), w["ffn.fc2.weight"])
    return rms(x, sd["norm.weight"])


PROMPTS = ["a red boat at  sea", "the dog runs fast over the hill in rain at night", "&amp;amp; a cat"]


# -- layouts -------------------------------------------------------------------------------


def test_both_layouts_load_and_agree(dirs, tiny_model):
    wan_dir, diffusers_dir = dirs
    assert detect_layout(wan_dir) == "wan" and detect_layout(diffusers_dir) == "diffusers"
    a = UMT5TextEncoder.from_wan_dir(wan_dir, "cpu", torch.float32, text_len=TEXT_LEN)
    b = UMT5TextEncoder.from_wan_dir(diffusers_dir, "cpu", torch.float32, text_len=TEXT_LEN)
    assert (a.text_dim, a.text_len) == (TINY["d_model"], TEXT_LEN)
    assert a.vocabulary is None and a.unknown_words("a red fox running through snow") == []  # open vocabulary
    ea, eb = a.encode(PROMPTS), b.encode(PROMPTS)
    assert ea.shape == (3, TEXT_LEN, TINY["d_model"]) and ea.dtype == torch.float32
    assert ea.abs().sum() > 0
    torch.testing.assert_close(ea, eb, atol=1e-5, rtol=1e-5)


def test_wan_layout_matches_wans_forward(dirs, tiny_model):
    """The rename is checked against Wan's semantics (a swapped gate/fc1 or norm1/norm2 would show)."""
    enc = UMT5TextEncoder.from_wan_dir(dirs[0], "cpu", torch.float32, text_len=TEXT_LEN)
    ids, mask = enc.tokenize(PROMPTS)
    ref = wan_reference(wan_state_dict(tiny_model), ids, mask, heads=TINY["num_heads"])
    out = enc.encode(PROMPTS)
    for row, n in enumerate(mask.sum(1).tolist()):
        torch.testing.assert_close(out[row, :n], ref[row, :n], atol=1e-5, rtol=1e-5)


def test_bf16_runs_in_model_dtype_returns_float32(dirs):
    enc32 = UMT5TextEncoder.from_wan_dir(dirs[0], "cpu", torch.float32, text_len=TEXT_LEN)
    enc16 = UMT5TextEncoder.from_wan_dir(dirs[0], "cpu", torch.bfloat16, text_len=TEXT_LEN)
    assert all(p.dtype == torch.bfloat16 for p in enc16.model.parameters())
    assert enc16.model.shared.weight is enc16.model.encoder.embed_tokens.weight
    out = enc16.encode(PROMPTS[:1])
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, enc32.encode(PROMPTS[:1]), atol=0.1, rtol=0.05)


def test_unknown_layout_names_both_layouts_files(tmp_path):
    with pytest.raises(CheckpointError) as e:
        UMT5TextEncoder.from_wan_dir(tmp_path)
    msg = str(e.value)
    for name in (WAN_CHECKPOINT, "google/umt5-xxl", "text_encoder/config.json", "tokenizer/"):
        assert name in msg


# -- strictness ----------------------------------------------------------------------------


def test_missing_key_is_named(tiny_model):
    sd = wan_state_dict(tiny_model)
    del sd["blocks.1.ffn.fc1.weight"]
    with pytest.raises(CheckpointError, match=r"1 missing key\(s\): blocks\.1\.ffn\.fc1\.weight"):
        encoder_from_wan_state_dict(sd, dtype=torch.float32)


def test_unexpected_key_is_named(tiny_model):
    sd = wan_state_dict(tiny_model)
    sd["head.weight"] = torch.zeros(3, 3)
    with pytest.raises(CheckpointError, match=r"1 unexpected key\(s\): head\.weight"):
        encoder_from_wan_state_dict(sd, dtype=torch.float32)


def test_misshaped_key_is_named(tiny_model):
    sd = wan_state_dict(tiny_model)
    sd["blocks.1.attn.o.weight"] = torch.zeros(16, 8)
    with pytest.raises(CheckpointError, match=r"mis-shaped key\(s\): blocks\.1\.attn\.o\.weight: checkpoint \(16, 8\) vs model \(16, 16\)"):
        encoder_from_wan_state_dict(sd, dtype=torch.float32)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("missing", r"1 missing key\(s\): encoder\.block\.1\.layer\.1\.DenseReluDense\.wo\.weight"),
        ("extra", r"1 unexpected key\(s\): encoder\.extra\.weight"),
        ("shape", r"mis-shaped key\(s\): encoder\.block\.1\.layer\.0\.SelfAttention\.o\.weight: checkpoint \(16, 8\) vs model \(16, 16\)"),
    ],
)
def test_diffusers_layout_is_strict(tmp_path, tiny_model, edit, message):
    from safetensors.torch import load_file, save_file

    tiny_model.save_pretrained(str(tmp_path / "text_encoder"))
    make_tokenizer().save_pretrained(str(tmp_path / "tokenizer"))
    (file,) = (tmp_path / "text_encoder").glob("*.safetensors")
    sd = load_file(str(file))
    if edit == "missing":
        del sd["encoder.block.1.layer.1.DenseReluDense.wo.weight"]
    elif edit == "extra":
        sd["encoder.extra.weight"] = torch.zeros(2)
    else:
        sd["encoder.block.1.layer.0.SelfAttention.o.weight"] = torch.zeros(16, 8)
    save_file(sd, str(file), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=message):
        UMT5TextEncoder.from_wan_dir(tmp_path, "cpu", torch.float32)


def test_key_needed_to_infer_size_is_named(tiny_model):
    sd = wan_state_dict(tiny_model)
    del sd["token_embedding.weight"]
    with pytest.raises(CheckpointError, match=r"token_embedding\.weight"):
        encoder_from_wan_state_dict(sd, dtype=torch.float32)


def test_loaded_on_meta_then_assigned(tiny_model):
    """No random init: every tensor is the checkpoint's own (tied embedding included)."""
    sd = wan_state_dict(tiny_model)
    model = encoder_from_wan_state_dict(sd, dtype=torch.float32)
    assert not any(p.is_meta for p in model.parameters())
    assert model.shared.weight.data_ptr() == sd["token_embedding.weight"].data_ptr()
    assert model.encoder.embed_tokens.weight is model.shared.weight


# -- the zero tail, padding, the LRU -------------------------------------------------------


def test_zero_tail_and_padding_invariance(dirs):
    enc = UMT5TextEncoder.from_wan_dir(dirs[0], "cpu", torch.float32, text_len=TEXT_LEN, cache_size=0)
    short, long = "a cat", "the dog runs fast over the hill in rain at night"
    alone = enc.encode([short])
    both = enc.encode([short, long])
    n_short = len(short.split()) + 1  # + EOS
    assert (alone[0, n_short:] == 0).all() and (alone[0, :n_short].abs().sum(-1) > 0).all()
    assert (both[0, n_short:] == 0).all()
    torch.testing.assert_close(alone[0], both[0], atol=1e-5, rtol=1e-5)
    # the long prompt is truncated to text_len with EOS last: no zero tail left
    ids, mask = enc.tokenize([long + " sky sea"])
    assert ids.shape == (1, TEXT_LEN) and ids[0, -1].item() == 1 and mask.all()
    assert (both[1].abs().sum(-1) > 0).sum() == len(long.split()) + 1


def test_lru_is_bounded_and_reuses(dirs, monkeypatch):
    enc = UMT5TextEncoder.from_wan_dir(dirs[0], "cpu", torch.float32, text_len=TEXT_LEN, cache_size=2)
    runs: list[list[str]] = []
    real = enc._run
    monkeypatch.setattr(enc, "_run", lambda cleaned: runs.append(list(cleaned)) or real(cleaned))
    first = enc.encode(["a cat", "a  cat", "a dog"])  # the same prompt after cleaning runs once
    assert runs == [["a cat", "a dog"]]
    torch.testing.assert_close(first[0], first[1])
    again = enc.encode(["a dog", "a cat"])
    assert runs == [["a cat", "a dog"]]
    torch.testing.assert_close(again[1], first[0])
    enc.encode(["the sky"])  # evicts the least recently used ("a dog")
    assert list(enc._cache) == ["a cat", "the sky"]
    enc.encode(["a dog"])
    assert runs[-1] == ["a dog"]


# -- the full-size key set -----------------------------------------------------------------


def test_rename_covers_the_xxl_encoder_exactly():
    config = UMT5Config(**XXL)
    with torch.device("meta"):
        model = UMT5EncoderModel(config)
    own = model.state_dict()
    expected = wan_shapes(
        vocab=256384, dim=4096, dim_attn=4096, dim_ffn=10240, heads=64, layers=config.num_layers, buckets=32
    )
    keymap = wan_key_map(config.num_layers)
    assert len(expected) == 242 and set(keymap) == set(expected)
    assert {hf for names in keymap.values() for hf in names} == set(own)
    for wan, names in keymap.items():
        for hf in names:
            assert tuple(own[hf].shape) == expected[wan], (wan, hf)
    # and the config inferred from Wan's file (shapes only) is XXL's
    inferred = config_from_wan_state_dict({k: torch.empty(s, device="meta") for k, s in expected.items()})
    for field, value in XXL.items():
        assert getattr(inferred, field) == value, field


# -- cleaning ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("  a   cat\n\tin the  rain ", "a cat in the rain"),
        ("Tom &amp; Jerry", "Tom & Jerry"),
        ("&amp;lt;b&amp;gt;", "<b>"),  # unescaped twice
        ("cafÃ© at night", "café at night"),  # mojibake fixed by ftfy
        ("", ""),
    ],
)
def test_clean_prompt(raw, clean):
    assert clean_prompt(raw) == clean
