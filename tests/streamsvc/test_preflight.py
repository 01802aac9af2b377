"""Start-up mistakes: one line naming the value and the fix, exit code 2, before any model is loaded
(streamsvc/preflight.py, called by `serve` and `generate`)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
import torch

from streamsvc import preflight


def test_device_cpu_and_auto_pass_and_a_bad_name_is_named():
    preflight.check_device("cpu")
    preflight.check_device("auto")
    with pytest.raises(ValueError, match="--device gpu0: not a device"):
        preflight.check_device("gpu0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine has what --device cuda needs")
def test_cuda_without_cuda_says_so():
    with pytest.raises(ValueError, match="--device cuda: this torch .* --device cpu"):
        preflight.check_device("cuda")


def test_port_out_of_range_and_in_use():
    with pytest.raises(ValueError, match="--port 99999: a port is a number from 0 to 65535"):
        preflight.check_port("127.0.0.1", 99999)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ValueError, match=f"port {port} on 127.0.0.1 is already in use.*--port"):
            preflight.check_port("127.0.0.1", port)
    preflight.check_port("127.0.0.1", port)  # free again: no error
    preflight.check_port("127.0.0.1", 0)


def test_paths_are_named_by_their_flag(tmp_path):
    with pytest.raises(ValueError, match="--wan-dir /nonexistent/wan: does not exist; give the Wan2.1 folder"):
        preflight.check_paths(wan_dir="/nonexistent/wan")
    (tmp_path / "f.pth").write_bytes(b"x")
    with pytest.raises(ValueError, match="--wan-dir .*f.pth: is a file, not a folder"):
        preflight.check_paths(wan_dir=str(tmp_path / "f.pth"))
    with pytest.raises(ValueError, match="--checkpoint /nonexistent/model.pt: does not exist"):
        preflight.check_paths(checkpoint="/nonexistent/model.pt")
    with pytest.raises(ValueError, match="--taehv /nonexistent/taew2_1.pth: does not exist"):
        preflight.check_paths(taehv="/nonexistent/taew2_1.pth")
    preflight.check_paths(wan_dir=str(tmp_path), checkpoint=str(tmp_path / "f.pth"))


def test_tls_files_are_named(tmp_path):
    preflight.check_tls(None, None)
    with pytest.raises(ValueError, match="give both --tls-cert and --tls-key"):
        preflight.check_tls("cert.pem", None)
    with pytest.raises(ValueError, match="--tls-cert /nonexistent.pem: cannot be read"):
        preflight.check_tls("/nonexistent.pem", "/nonexistent.key")
    (tmp_path / "c.pem").write_text("not a certificate")
    with pytest.raises(ValueError, match="--tls-cert .*c.pem --tls-key .*c.pem: not a certificate"):
        preflight.check_tls(str(tmp_path / "c.pem"), str(tmp_path / "c.pem"))


GiB = 2**30


def test_memory_a_gpu_preset_over_the_host_is_refused_with_the_figures_and_what_fits():
    from models.stream import GeneratorConfig

    assert preflight.check_memory("tiny", GeneratorConfig(), "cpu", batch=4, kv_budget_bytes=4 * GiB,
                                  available=1 * GiB) is None
    with pytest.raises(ValueError) as err:
        preflight.check_memory("wan2.1-1.3b", GeneratorConfig(), "cpu", batch=4, kv_budget_bytes=4 * GiB,
                               available=24 * 10**9)
    said = str(err.value)
    assert said.startswith("--preset wan2.1-1.3b on this CPU needs about 26.9 GB (the DiT's weights 5.7, ")
    assert "24.0 GB available; wan2.1-1.3b is meant for a GPU: use --kv-quant int2 (about 11.9 GB)" in said
    assert "--preset tiny" in said
    # int2 fits 24 GB, but its one stream's cache (3.7 GB) is over a 1 GiB pool: no stream could ever start
    with pytest.raises(ValueError, match="KV cache .* is 3.7 GB, over the KV budget of 1 GiB.*--kv-budget-gib 4"):
        preflight.check_memory("wan2.1-1.3b", GeneratorConfig(kv_quant="int2"), "cpu", batch=4,
                               kv_budget_bytes=1 * GiB, available=24 * 10**9)
    warning = preflight.check_memory("wan2.1-1.3b", GeneratorConfig(kv_quant="int2"), "cpu", batch=4,
                                     kv_budget_bytes=4 * GiB, available=24 * 10**9)
    assert warning.startswith("--preset wan2.1-1.3b is meant for a GPU: on this CPU it needs about 11.9 GB")
    assert preflight.check_memory("wan2.1-1.3b", GeneratorConfig(), "cuda", available=1) is None  # the GPU's own


def test_memory_the_footprint_counts_the_workspace_and_the_stream_exactly():
    from kvcache import CacheSpec
    from models.config import ModelConfig
    from models.footprint import dit_parameters, estimate
    from models.stream import GeneratorConfig
    from dataclasses import replace

    fp = estimate("wan2.1-1.3b", GeneratorConfig(), "cpu", batch=4)
    mc = ModelConfig.from_name("wan2.1-1.3b")
    spec: CacheSpec = mc.cache_spec(sink_frames=3, window_frames=9, dtype="float32", quant="none")
    assert fp.stream_kv == spec.stream_bytes() and fp.workspace == replace(spec, staging_frames=3).stream_bytes()
    assert fp.weights == 4 * dit_parameters(mc) and 1.3e9 < dit_parameters(mc) < 1.5e9
    assert estimate("wan2.1-1.3b", GeneratorConfig(), "cuda").weights == fp.weights // 2  # bf16 on a GPU


def _cli(*argv: str) -> tuple[int, list[str], float]:
    """Run `streamsvc ARGV` (bounded at 120 s): its exit code, its stderr's lines, its wall time."""
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "streamsvc.cli", *argv], capture_output=True, text=True,
                          timeout=120)
    return done.returncode, done.stderr.strip().splitlines(), time.monotonic() - t0


CASES = [
    (("serve", "--port", "99999"), "streamsvc serve: --port 99999: a port is a number from 0 to 65535"),
    (("serve", "--wan-dir", "/nonexistent"), "streamsvc serve: --wan-dir /nonexistent: does not exist"),
    (("serve", "--tls-cert", "/nonexistent.pem", "--tls-key", "/nonexistent.key"),
     "streamsvc serve: --tls-cert /nonexistent.pem: cannot be read"),
    (("serve", "--preset", "wan2.1-1.3b", "--kv-quant", "int2", "--kv-budget-gib", "0.5"), "streamsvc serve: "),
    (("serve", "--checkpoint", "/nonexistent.pt"), "streamsvc serve: --checkpoint /nonexistent.pt: does not exist"),
    (("generate", "--prompt", "a red ball", "--wan-dir", "/nonexistent"),
     "streamsvc generate: --wan-dir /nonexistent: does not exist"),
    (("loadtest", "--streams", "1", "--url", "http://127.0.0.1:8000/ws"),
     "streamsvc loadtest: --url http://127.0.0.1:8000/ws: the server's WebSocket URL starts with ws:// or wss://"),
]
if not torch.cuda.is_available():
    CASES.append((("serve", "--device", "cuda"), "streamsvc serve: --device cuda: this torch"))


@pytest.mark.slow
@pytest.mark.parametrize("argv,line", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_cli_mistake_is_one_line_and_exit_2(argv, line):
    code, lines, _ = _cli(*argv)
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith(line), lines
    assert "Traceback" not in lines[0]


@pytest.mark.slow
def test_cli_port_in_use_is_said_before_the_model_loads():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        code, lines, _ = _cli("serve", "--port", str(port))
    assert code == 2, lines
    assert len(lines) == 1 and f"port {port} on 127.0.0.1 is already in use" in lines[0] and "--port" in lines[0]
    assert not any("model ready" in line for line in lines)


def test_generate_warns_of_words_the_built_in_model_does_not_know(tmp_path, capsys):
    from streamsvc.cli import main

    args = ["generate", "--seconds", "0.5", "--quiet", "--device", "cpu", "-o", str(tmp_path / "x.mp4")]
    assert main(args + ["--prompt", "a cat playing piano", "--prompt-at", "0.25:a red ball"]) == 0
    err = capsys.readouterr().err
    assert "warning: the model does not know 'cat', 'playing', 'piano' in 'a cat playing piano'" in err
    assert "it knows: a, against, background, ball" in err and "'a red ball'" not in err
    assert main(args + ["--prompt", "a red ball moving right"]) == 0
    assert "does not know" not in capsys.readouterr().err


def test_memory_counts_a_checkpoint_at_its_config_s_shapes(tmp_path):
    """A small DiT in the 14B's layout, its config.json giving its shapes: counted at those, not the preset's
    143 GB; without a config.json that says its heads, nothing is estimated (the loader says what is wrong)."""
    import json

    from models import CausalWanModel, ModelConfig
    from models.stream import GeneratorConfig
    from tests.models.test_weights import wan_dir

    mc = ModelConfig.from_name("wan2.1-14b", dim=96, num_heads=3, ffn_dim=128, num_layers=2, text_dim=32)
    d = wan_dir(tmp_path, CausalWanModel(mc).init_weights(3), heads=3, shards=3)
    assert preflight.check_memory("wan2.1-14b", GeneratorConfig(), "cpu", checkpoint=str(d),
                                  available=2 * GiB).startswith("--preset wan2.1-14b is meant for a GPU")
    with pytest.raises(ValueError, match="needs about 143"):
        preflight.check_memory("wan2.1-14b", GeneratorConfig(), "cpu", available=2 * GiB)
    config = json.loads((d / "config.json").read_text())
    del config["num_heads"]
    (d / "config.json").write_text(json.dumps(config))
    assert preflight.check_memory("wan2.1-14b", GeneratorConfig(), "cpu", checkpoint=str(d), available=1) is None
