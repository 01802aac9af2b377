import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models import (
    CacheAccess,
    ChunkGenerator,
    GeneratorConfig,
    WorkKind,
    build_generator,
)

# `pytest -m quick`: a first check in about 2 minutes on 2 cores (the whole suite takes 20-30): the pure parts
# (scheduler, KV accounting, wire protocol, sessions, access rules, input framing and gates, the client's playback
# and report) and the model's and server's fastest tests; no server process, no browser, no training.
QUICK = (
    "tests/streamsvc/scheduling/",
    "tests/kvcache/test_units.py", "tests/kvcache/test_cache.py",
    "tests/streamsvc/test_protocol.py", "tests/streamsvc/test_session.py", "tests/streamsvc/test_access.py",
    "tests/streamsvc/test_guard.py", "tests/streamsvc/test_outbox.py", "tests/streamsvc/test_bitstream.py",
    "tests/streamsvc/test_input_gate.py", "tests/streamsvc/test_inputs.py", "tests/streamsvc/test_wire_input.py",
    "tests/streamsvc/test_cli_help.py", "tests/streamsvc/test_engine.py",
    "tests/streamsvc/test_encode.py", "tests/streamsvc/test_output.py", "tests/streamsvc/test_input_ws.py",
    "tests/streamsvc/test_library_logs.py", "tests/streamsvc/test_record.py", "tests/streamsvc/test_cluster_pure.py",
    "tests/client/test_playback.py", "tests/client/test_pixels.py", "tests/client/test_verify.py",
    "tests/client/test_ws_client.py",
    "tests/kvcache/test_quant.py", "tests/models/test_scenes.py", "tests/models/test_dit.py",
    "tests/models/test_generator.py", "tests/models/test_decoder.py", "tests/models/test_text.py",
    "tests/models/test_weights.py", "tests/models/test_model_file.py", "tests/models/test_fidelity.py",
    "tests/models/test_long_stream.py",
    "tests/test_imports.py",
)


def pytest_collection_modifyitems(config, items):
    root = Path(__file__).resolve().parents[1]
    for item in items:
        where = Path(item.fspath).resolve().relative_to(root).as_posix()
        if where.startswith(QUICK) and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.quick)


@pytest.fixture(autouse=True)
def _deterministic_threads():
    torch.set_num_threads(1)


def tiny_generator(**cfg) -> ChunkGenerator:
    return build_generator("tiny", device="cpu", dtype=torch.float32, seed=0, cfg=GeneratorConfig(**cfg))


def cuda_only():
    return pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def run_interpreted(test_file: str, selection: str) -> subprocess.CompletedProcess:
    """The tests of `test_file` matching `selection` (pytest -k) in a child process with TRITON_INTERPRET=1:
    Triton picks its interpreter per process at import, so kernels run on the CPU only in a fresh one."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test_file, "-k", selection]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)


def solo_and_batched(gen: ChunkGenerator, prompts: list[str], chunks: int = 2):
    """The same streams twice, stream i with i + 1 chunks committed first (different cache fills); then `chunks`
    more chunks each, the solo ones one stream at a time, the others in batched forwards. Returns
    (solo states, batched states, solo chunks, batched chunks), the chunks per stream."""
    solo = [gen.open_stream(f"s{i}", p, seed=10 + i) for i, p in enumerate(prompts)]
    batch = [gen.open_stream(f"b{i}", p, seed=10 + i) for i, p in enumerate(prompts)]
    for i in range(len(prompts)):
        for s in (solo[i], batch[i]):
            it = gen.stream(s)
            for _ in range(i + 1):
                next(it)
    solo_out = []
    for s in solo:
        it = gen.stream(s)
        solo_out.append([next(it) for _ in range(chunks)])
    batch_out = [[] for _ in prompts]
    for _ in range(chunks):
        for _ in range(len(gen.sigmas)):
            gen.run(WorkKind.DENOISE, batch)
        for j, ch in enumerate(gen.run(WorkKind.COMMIT, batch)):
            batch_out[j].append(ch)
    return solo, batch, solo_out, batch_out


def reference_latents(gen, prompt, seed, n_chunks, image=None):
    """No cache: every forward recomputes all visible frames with full block-causal attention. With `image` (a
    clean latent frame [C, 1, h, w]) the stream starts from it: a block of its own (-1), chunk c the frames
    1 + c nf ..; the chunks alone are returned."""
    model, nf, sig = gen.model, gen.cfg.frames_per_chunk, gen.sigmas
    mc = gen.model_cfg
    noise = torch.Generator().manual_seed(seed)
    text = gen.encode_prompt(prompt)
    lead = 0 if image is None else 1
    clean = [] if image is None else [image]  # committed clean frames, each [C, F, h, w]
    for c in range(n_chunks):
        x = torch.randn((mc.in_channels, nf, mc.latent_height, mc.latent_width), generator=noise)
        for k, s in enumerate(sig):
            frames = torch.cat(clean + [x], dim=1)[None]  # [1, C, past + F, h, w]
            past = frames.shape[2] - nf
            t = torch.tensor([[0.0] * past + [1000 * s] * nf])
            blocks = [(i - lead) // nf for i in range(frames.shape[2])]
            v = model(frames, t, text, [CacheAccess(None, 0, block_ids=blocks)])[0, :, past:]
            x0 = (x.double() - s * v.double()).float()
            if k + 1 < len(sig):
                eps = torch.randn(x0.shape, generator=noise)
                x = ((1 - sig[k + 1]) * x0.double() + sig[k + 1] * eps.double()).float()
        clean.append(x0)
    return clean[lead:]
