import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models import ChunkGenerator, GeneratorConfig, build_generator


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
