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
