"""Start-up checks that run before any model is loaded: a user's mistake costs one line and exit code 2, not a
warm-up followed by a traceback.

Each check raises `ValueError` with a message that names the value and the fix; the command line prints it
after the command's name (`check_args` runs them all on `serve`'s or `generate`'s flags). What each catches:

- `check_device`: `--device cuda` on a torch built without CUDA, or a GPU index past the last one;
- `check_port`: a port outside 0..65535, a host that does not resolve, or an address already in use (it
  binds the address once and lets go, as the server will, so a second server on the port is said at once);
- `check_tls`: a `--tls-cert` or `--tls-key` missing, unreadable, or not a certificate and its key;
- `check_memory`: a model that would not fit the host's available memory on a CPU (the kernel would kill the
  server half loaded), or whose one stream's KV cache is over the KV budget, with the figures and what would
  fit; and a plain warning when a GPU preset will run, slowly, on a CPU;
- `check_paths`: a `--wan-dir`, `--checkpoint`, `--taehv` or `--lora` that does not exist, each called by its
  flag's name (a Wan folder is a folder, the others may be files or folders).
"""

from __future__ import annotations

import errno
import socket
from dataclasses import replace
from pathlib import Path

GB = 1e9


def check_device(name: str) -> None:
    """`name` (auto, cpu, cuda, cuda:N) is a device this torch can use."""
    import torch

    if name in ("auto", "cpu"):
        return
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name}: not a device; give cpu, cuda, cuda:N or auto") from None
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        build = "was built without CUDA" if torch.version.cuda is None else "finds no CUDA GPU"
        raise ValueError(f"--device {name}: this torch ({torch.__version__}) {build}; run with --device cpu, or "
                         "install a CUDA build of torch on a machine with an NVIDIA GPU")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(f"--device {name}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")


def check_port(host: str, port: int) -> None:
    """`host`:`port` can be listened on now (0: any free port)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port}: a port is a number from 0 to 65535 (0: any free port)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: cannot be resolved ({e.strerror}); give an address such as 127.0.0.1 "
                         "or 0.0.0.0") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: TIME_WAIT is no conflict
        try:
            sock.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ValueError(f"port {port} on {host} is already in use (another server?): pass --port with "
                                 "another port, or --port 0 for any free one") from None
            if e.errno in (errno.EACCES, errno.EPERM):
                raise ValueError(f"port {port} on {host}: permission denied (ports below 1024 need root); pass "
                                 "--port 1024 or above") from None
            raise ValueError(f"--host {host} --port {port}: cannot listen there ({e.strerror})") from None


def check_tls(cert: str | None, key: str | None) -> None:
    """--tls-cert and --tls-key: both or neither, each a readable file that loads as a certificate and its key."""
    import ssl

    if (cert is None) is not (key is None):
        raise ValueError("give both --tls-cert and --tls-key (a certificate and its private key), or neither")
    if cert is None:
        return
    for flag, path in (("--tls-cert", cert), ("--tls-key", key)):
        try:
            Path(path).open("rb").close()
        except OSError as e:
            raise ValueError(f"{flag} {path}: cannot be read ({e.strerror}); give a PEM file") from None
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except ssl.SSLError as e:
        raise ValueError(f"--tls-cert {cert} --tls-key {key}: not a certificate and its private key in PEM "
                         f"({e.reason or e})") from None


def check_paths(*, wan_dir: str | None = None, checkpoint: str | None = None, taehv: str | None = None,
                lora: str | None = None) -> None:
    """Each path given exists: weights load from a local path only, so a typo is said before anything loads."""
    if wan_dir is not None and not Path(wan_dir).is_dir():
        what = "is a file, not a folder" if Path(wan_dir).exists() else "does not exist"
        raise ValueError(f"--wan-dir {wan_dir}: {what}; give the Wan2.1 folder (Wan's layout or Diffusers') that "
                         "holds the text encoder, the VAE and the DiT")
    for flag, path, what in (("--checkpoint", checkpoint, "the DiT weights: a .safetensors or .pt file, or a "
                                                          "Wan2.1 folder"),
                             ("--taehv", taehv, "TAEHV's taew2_1.pth"),
                             ("--lora", lora, "the LoRA file (e.g. LongLive's lora.pt)")):
        if path is not None and not Path(path).exists():
            raise ValueError(f"{flag} {path}: does not exist; give {what} (weights load from a local path only)")


def available_memory() -> int | None:
    """The host's available memory in bytes (Linux's MemAvailable; None where /proc/meminfo is not)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_memory(preset: str, cfg, device_type: str, *, batch: int = 1, kv_budget_bytes: int | None = None,
                 wan_dir: str | None = None, checkpoint: str | None = None,
                 available: int | None = None) -> str | None:
    """On a CPU: the model `preset` under `cfg` (models.GeneratorConfig) fits the host's `available` memory
    (default: what /proc/meminfo says) with one stream, and one stream's KV cache fits `kv_budget_bytes` (serve's
    pool; None: no pool, as `generate`). A checkpoint's or Wan folder's DiT counts at the dimensions its
    config.json gives; one that has none (a bare .pt) is not estimated. Raises ValueError with the figures and
    what would fit; returns a warning to log when a GPU preset fits but will be slow, else None. A GPU checks
    its own memory as the model loads."""
    from models.footprint import SHAPE_FIELDS, estimate
    from models.weights import dit_configs

    if device_type != "cpu":
        return None
    shapes = None
    if checkpoint or wan_dir:
        configs = dit_configs(checkpoint or wan_dir, wan_dir)
        if not configs:
            return None  # its shapes are in its tensors: the loader checks them
        shapes = {k: getattr(configs[0], k) for k in SHAPE_FIELDS if getattr(configs[0], k) is not None}
    try:
        fp = estimate(preset, cfg, device_type, batch, wan_dir, shapes)
    except ValueError:
        return None  # shapes that make no model: the loader says what is wrong with them
    available = available_memory() if available is None else available
    need = fp.with_streams(1)
    parts = (f"the DiT's weights {fp.weights / GB:.1f}, " + (f"the Wan encoders {fp.encoders / GB:.1f}, " if
                                                            fp.encoders else "")
             + f"the workspace {fp.workspace / GB:.1f}, activations {fp.activations / GB:.1f} at batch {batch}, "
             f"one stream's KV cache {fp.stream_kv / GB:.1f} GB")
    gpu_preset = preset != "tiny"
    fixes = []
    if cfg.kv_quant == "none":
        smaller = estimate(preset, replace(cfg, kv_quant="int2"), device_type, batch, wan_dir, shapes)
        if available is None or smaller.with_streams(1) <= available:
            fixes.append(f"--kv-quant int2 (about {smaller.with_streams(1) / GB:.1f} GB)")
    if gpu_preset:
        fixes += ["--preset tiny (the CPU demo)", "a GPU (--device cuda)"]
    if available is not None and need > available:
        meant = f"; {preset} is meant for a GPU" if gpu_preset else ""
        raise ValueError(f"--preset {preset} on this CPU needs about {need / GB:.1f} GB ({parts}) and the machine has "
                         f"{available / GB:.1f} GB available{meant}: use " + (", or ".join(fixes) or "a larger "
                                                                                 "machine"))
    if kv_budget_bytes is not None and fp.stream_kv > kv_budget_bytes:
        raise ValueError(f"one stream's KV cache of --preset {preset} is {fp.stream_kv / GB:.1f} GB, over the KV "
                         f"budget of {kv_budget_bytes / 2**30:g} GiB, so no stream could start: pass --kv-budget-gib "
                         f"{-(-fp.stream_kv // 2**30)} or more" + (", or --kv-quant int2" if cfg.kv_quant == "none"
                                                                  else ""))
    if gpu_preset:
        return (f"--preset {preset} is meant for a GPU: on this CPU it needs about {need / GB:.1f} GB and a chunk "
                "takes minutes, not the fraction of a second a stream needs to play live (the CPU demo is --preset "
                "tiny)")
    return None


def check_args(args) -> str | None:
    """Every check on the flags of `streamsvc serve` or `generate` (an argparse namespace): ValueError, one line.
    Returns a warning to show (a GPU preset that will run slowly on this CPU), or None."""
    from streamsvc.options import generator_config, latency_mode
    from streamsvc.offline import default_device

    serve = hasattr(args, "port")
    cluster = getattr(args, "cluster", None) is not None
    if not cluster:  # a gateway's replicas have the devices, not this process
        check_device(args.device)
    check_paths(wan_dir=args.wan_dir, checkpoint=args.checkpoint, taehv=args.taehv, lora=args.lora)
    if serve:
        check_tls(args.tls_cert, args.tls_key)
        check_port(args.host, args.port)
        if args.metrics_port is not None:
            check_port(args.host, args.metrics_port)
    if cluster or args.parallel != 1:
        return None  # the memory is each replica's or rank's, on its own device
    device = default_device(args.device)
    cfg = generator_config(args)
    batch = (args.max_batch or latency_mode(args).max_batch[device.type == "cuda"]) if serve else 1
    budget = (int(args.kv_budget_gib * 2**30) if args.kv_budget_gib else 4 * 2**30) if serve else None
    return check_memory(args.preset, cfg, device.type, batch=batch, kv_budget_bytes=budget, wan_dir=args.wan_dir,
                        checkpoint=args.checkpoint)
