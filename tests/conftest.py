import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models import ChunkGenerator, GeneratorConfig, Work, build_generator


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
            gen.run(Work.DENOISE, batch)
        for j, ch in enumerate(gen.run(Work.COMMIT, batch)):
            batch_out[j].append(ch)
    return solo, batch, solo_out, batch_out
