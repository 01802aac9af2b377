"""The `streamsvc` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvcache import QUANT_MODES
from models import PRESETS, build_generator, fidelity
from models.build import DECODERS
from streamsvc import options


def _model_args(p: argparse.ArgumentParser, basics) -> None:
    """--preset and --device into `basics`, the model and weight flags into a group of their own."""
    basics.add_argument("--preset", default="tiny", choices=list(PRESETS),
                   help="model size and resolution (default: tiny, CPU-fast; wan2.1-1.3b and wan2.1-14b at 480x832; "
                        "a checkpoint's own dimensions win)")
    basics.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: cuda if present)")
    p = p.add_argument_group("model and weights (see README: Real weights, Fidelity tiers)")
    p.add_argument("--checkpoint", default=None,
                   help="local DiT weights: a .safetensors/.pt file (Self-Forcing, LongLive) or a Wan2.1 folder "
                        "(default: --wan-dir's own DiT, else random from --weights-seed)")
    p.add_argument("--wan-dir", default=None,
                   help="a Wan2.1 folder (T2V-1.3B, or T2V-14B with its sharded DiT), Wan's layout or Diffusers': the "
                        "umT5 text encoder, the VAE and the base DiT; its config.json gives the DiT's heads and is "
                        "checked against every checkpoint loaded with it (default: none: the built-in hashing text "
                        "encoder and tiny decoder)")
    p.add_argument("--lora", default=None, help="a LoRA file merged into the checkpoint (LongLive's lora.pt)")
    p.add_argument("--lora-alpha", type=float, default=None, help="the LoRA's alpha (default: its rank, scale 1)")
    p.add_argument("--wrapper", default="auto", choices=("auto", "generator", "generator_ema"),
                   help="which weights of a training checkpoint: auto = generator_ema if present (Self-Forcing), "
                        "else generator; LongLive's base wants generator")
    p.add_argument("--decoder", default="auto", choices=DECODERS,
                   help="latents to frames: tiny (built in), wan-vae (from --wan-dir), taehv (--taehv); "
                        "auto = wan-vae with --wan-dir, else tiny")
    p.add_argument("--taehv", default=None, help="TAEHV's taew2_1.pth for --decoder taehv")
    p.add_argument("--weights", default="auto", metavar="auto|builtin|random|FILE",
                   help="the model: builtin = the tiny preset's trained model, shipped with the package "
                        "(models/assets/tiny.safetensors: it draws the object, colour and motion a prompt asks for, "
                        "e.g. 'a red ball moving right', and with an input video follows its object and motion in the "
                        "prompt's colour, through its input adapter); random = random weights from --weights-seed (coloured noise; "
                        "what tests of speed and shapes use); FILE = a model file of `python -m models.train --export`; "
                        "auto (default) = builtin for the tiny preset unless --checkpoint or --wan-dir is given, "
                        "else random / the checkpoint's")
    p.add_argument("--weights-seed", type=int, default=0, help="seed of the random weights (--weights random, or no checkpoint)")
    p.add_argument("--kv-quant", default="none", choices=QUANT_MODES, help="KV cache storage (default: none = model dtype)")
    p.add_argument("--chunk-latent-frames", type=int, default=None, choices=options.CHUNK_LATENT_FRAMES,
                   help="latent frames a chunk (default 3, or the latency mode's: 1 under serve's --latency low). 3: "
                        "12 video frames, the size Self-Forcing and LongLive checkpoints are trained at; 1: 4 video "
                        "frames (the first chunk a single frame), so a new prompt or a camera frame reaches the screen "
                        "sooner, at a cost in streams per device (README: Latency). A Wan checkpoint at 1 needs one "
                        "trained frame-wise (Causal Forcing's); others run, for timing, on random weights")
    p.add_argument("--sink-frames", type=int, default=3, help="latent frames kept from the stream's start (default 3)")
    p.add_argument("--window-frames", type=int, default=9, help="most recent latent frames kept (default 9)")
    p.add_argument("--fidelity", default=None, choices=fidelity.TIERS,
                   help="the most the output may differ from the bf16 reference (docs/fidelity.md): exact = the "
                        "reference math only (and, for serve, no --degrade); quantized = the same work in lower precision "
                        "(FP8 linears, INT8 attention scores, int KV); approximate = less work too (fewer steps, no "
                        "commit forward). A tier turns on its options that pay on the device, unless --speed-options "
                        "names them. Default: none given: exact math in steady state, --kv-quant as asked, and serve's "
                        "--degrade auto may still cut a late chunk's steps instead of stalling")
    p.add_argument("--speed-options", default=None, metavar="LIST",
                   help="exactly these speed options (comma list, or none), each within --fidelity: "
                        f"{fidelity.help_text()}")


def _parallel_args(p: argparse.ArgumentParser) -> None:
    p = p.add_argument_group("one stream over several GPUs (see docs/parallel.md)")
    p.add_argument("--parallel", type=int, default=1, metavar="K",
                   help="split each forward over K processes, one per device (Ulysses sequence parallelism, exact): "
                        "K must divide the model's heads and tokens per frame; gloo on the CPU, NCCL on GPUs")
    p.add_argument("--devices", default=None, metavar="LIST",
                   help="the group's GPUs, one per rank (e.g. 0,1,2,3; default: all of them when there are exactly K; "
                        "on the CPU the count K or ids 0..K-1; with --cluster Ray picks them)")
    p.add_argument("--parallel-timeout", type=float, default=15.0, metavar="SECONDS",
                   help="a collective of the group waiting longer fails: a rank died or hung (default 15)")


def _generator(args):
    """The generator `generate` runs: the fastest configuration of its device that --fidelity allows."""
    import logging

    from streamsvc.engine.warmup import log_attention

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    device, kw = options.generator_args(args)
    gen = build_generator(args.preset, **kw)
    log_attention(device)
    logging.getLogger("streamsvc.cli").info("%s", fidelity.describe(gen.cfg, degrade=False))
    if device.type == "cuda":
        from models.dit_ops import compile_helpers

        compile_helpers()
    return gen


def cmd_generate(args) -> int:
    from streamsvc.offline import PromptChange, generate_video

    try:
        changes = [PromptChange.parse(t) for t in args.prompt_at]
    except ValueError as e:
        print(f"streamsvc generate: {e}", file=sys.stderr)
        return 2
    if args.seconds <= 0 or args.fps <= 0:
        print("streamsvc generate: --seconds and --fps must be positive", file=sys.stderr)
        return 2
    if args.strip_every < 1:
        print("streamsvc generate: --strip-every must be >= 1", file=sys.stderr)
        return 2
    strip = Path(args.strip) if args.strip else None
    if args.input and args.parallel != 1:
        print("streamsvc generate: --input runs on one process: drop --parallel", file=sys.stderr)
        return 2
    if args.image and (args.input or args.parallel != 1 or args.dump):
        print("streamsvc generate: --image goes without --input, --parallel and --dump", file=sys.stderr)
        return 2
    from streamsvc import preflight

    try:
        warning = preflight.check_args(args)
    except ValueError as e:
        print(f"streamsvc generate: {e}", file=sys.stderr)
        return 2
    if warning:
        print(f"streamsvc generate: warning: {warning}", file=sys.stderr)
    if args.parallel != 1:
        from streamsvc.offline import generate_parallel

        return generate_parallel(args, changes, strip, options.generator_args)
    try:
        gen = _generator(args)
    except (ValueError, OSError) as e:  # bad weight files or flags (CheckpointError is a ValueError)
        print(f"streamsvc generate: {e}", file=sys.stderr)
        return 2
    for prompt in [args.prompt, *(c.prompt for c in changes)]:
        unknown = gen.text_encoder.unknown_words(prompt)
        if unknown:  # as the player warns: the built-in model draws words it was never taught as noise
            print(f"streamsvc generate: warning: the model does not know {', '.join(repr(w) for w in unknown)} in "
                  f"{prompt!r} and draws them as noise; it knows: "
                  f"{', '.join(w for w in gen.text_encoder.vocabulary or [] if w.isalpha())}",
                  file=sys.stderr)
    from streamsvc.inputs.offline import open_input, read_image

    try:
        inputs = open_input(gen, args.input, args.strength, args.fps)
        image = read_image(args.image, gen.model_cfg.width, gen.model_cfg.height) if args.image else None
        if image is not None and not gen.can_take_input:
            raise ValueError("--image needs a model with an encoder; this model has none")
    except ValueError as e:
        print(f"streamsvc generate: {e}", file=sys.stderr)
        return 2
    n = generate_video(gen, args.prompt, args.seconds, args.fps, args.seed, Path(args.output), changes, not args.quiet,
                       strip=strip, strip_every=args.strip_every, dump=Path(args.dump) if args.dump else None,
                       inputs=inputs, strength=args.strength, image=image)
    if inputs is not None:
        inputs.close()
        print(inputs.summary())
    print(f"wrote {n} frames ({gen.model_cfg.width}x{gen.model_cfg.height}, {args.fps} fps, H.264) to {args.output}")
    if strip is not None:
        print(f"wrote a strip of frames 0, {args.strip_every}, ... to {strip}")
    return 0


def _check_weights(args) -> None:
    """Read the model file the flags name, if any, before anything starts: a missing or foreign file is a
    one-line error (CheckpointError, a ValueError), not a traceback from the engine thread."""
    from models.model_file import read_model_file, resolve_weights

    path = resolve_weights(args.weights, args.preset, args.checkpoint, args.wan_dir)
    if path is not None:
        read_model_file(path)


def _serve_args(p: argparse.ArgumentParser) -> None:
    from streamsvc.scheduling import POLICIES

    p = p.add_argument_group("scheduling: which stream runs next, admission, buffers, degradation")

    p.add_argument("--policy", default="slack", choices=POLICIES, help="which stream runs next (default: slack = least slack first)")
    p.add_argument("--latency", default=None, choices=tuple(options.LATENCY_MODES),
                   help="default: chunks of 3 latent frames (0.75 s), 2 s ahead at most, input due 0.5 s after its "
                        "last frame; low: chunks of 1 latent frame (0.25 s), a smaller buffer (--start-margin 0.15, "
                        "--buffer-cap 1), --max-batch 16 on CPU, --input-latency 0.25, --prompt-cut: a new prompt and a "
                        "camera frame "
                        "reach the screen in about half a second, with fewer streams a device (README: Latency). Both "
                        "are exact; a flag given explicitly wins over the mode")
    p.add_argument("--prompt-cut", action=argparse.BooleanOptionalAction, default=None,
                   help="a new prompt's first chunk cuts: its viewers drop the older frames they hold and have not "
                        "shown (a chunk header's 'cut'; over WebRTC the server drops them, and the chunk starts with a "
                        "keyframe), so the prompt reaches the screen a buffer sooner (default: on under --latency low, "
                        "else off)")
    p.add_argument("--buffer-cap", type=float, default=None,
                   help="seconds of video generated ahead of each viewer at most (default 2.0; 1.0 under --latency "
                        "low). It bounds how far ahead "
                        "a stream runs, so how much old video plays after a new prompt (steering latency), not "
                        "throughput: a chunk starts when the buffer falls to its measured latency plus a margin, and "
                        "that lead plus one chunk must fit under the cap (2 streams on an H200: ~0.75 + 0.75 s)")
    p.add_argument("--max-batch", type=int, default=None,
                   help="streams per forward when their work matches (default 1 on a GPU, where batching gains 3-4%% "
                        "and batched forwards run without CUDA graphs; 4 on CPU, where it halves the per-stream cost "
                        "of the tiny preset, 16 under --latency low)")
    p.add_argument("--utilization", type=float, default=None,
                   help="admit streams while the predicted engine load stays under this fraction (default 0.9 on a "
                        "GPU, 0.6 on CPU, where the engine shares its cores with the event loop and the encoders)")
    p.add_argument("--startup-slack", type=float, default=0.75,
                   help="seconds a new stream's first chunk may wait behind playing streams that are about to stall "
                        "(default 0.75: a viewer joining never makes another stall, and still sees video within about 1 s)")
    p.add_argument("--lead-percentile", type=float, default=None, metavar="Q",
                   help="a stream's next chunk starts when its viewer's buffer falls to this percentile of its recent "
                        "chunk latencies plus --start-margin (default 0.5 on CPU, 0.95 on a GPU)")
    p.add_argument("--start-margin", type=float, default=None, metavar="S",
                   help="seconds of video a chunk should arrive ahead of its viewer's need: what the latency estimate "
                        "misses (default 0.175 on CPU, 0.25 on a GPU; 0.15 under --latency low); less buffer is "
                        "lower steering latency")
    p.add_argument("--degrade", choices=("auto", "off"), default=None,
                   help="auto (default, but off under --fidelity exact): a chunk that would reach its viewer late runs "
                        "fewer denoising steps (3 or 2 of 4; the chunk header's 'steps' says so) instead of stalling, "
                        "and never while the stream has slack to spare; off: always every step, a stall when the "
                        "device falls behind")
    p.add_argument("--kv-budget-gib", type=float, default=None, help="KV pool budget (default: 4 GiB on CPU, 85%% of free GPU memory)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the DiT's elementwise helpers (default: on with CUDA, off on CPU)")
    p.add_argument("--park-budget-gib", type=float, default=8.0, metavar="GIB",
                   help="host memory all paused streams may hold (default 8): a paused stream's KV cache and decoder "
                        "state are parked in (pinned) host memory and its GPU memory serves other streams until it "
                        "resumes; a wan2.1-1.3b stream at sink 3 + window 9 parks about 3.3 GiB. A pause beyond the "
                        "budget is refused; 0 refuses every pause")
    p.add_argument("--park-timeout", type=float, default=300.0, metavar="S",
                   help="seconds a stream may stay paused (default 300); then it is closed and its host memory freed")
    p.add_argument("--input-latency", type=float, default=None, metavar="S",
                   help="input video: a chunk plays this long after its last input frame came (default "
                        "0.5; 0.25 under --latency low); one later is a stall. Glass-to-glass is about a chunk's "
                        "duration plus this")


def _style_args(p: argparse.ArgumentParser) -> None:
    p = p.add_argument_group("styles per stream (see README: Styles per stream)")
    p.add_argument("--lora-dir", default=None, metavar="DIR",
                   help="offer the style LoRAs of DIR, one per file (.safetensors, .pt, .pth, .bin; PEFT/LongLive, "
                        "diffusers', ComfyUI's or kohya's Wan keys), each named by its file's stem: a stream picks one "
                        "in its start (\"lora\": NAME, \"lora_scale\": S, 0 to 2, default 1) and its steerer switches "
                        "it live (set_lora); GET /loras and ready list them. The base weights stay shared, never "
                        "merged (--lora merges one LoRA for every stream). A bad file is logged at start and refused, "
                        "with its reason, to the stream that names it. Not with --parallel. Default: with the built-in "
                        "weights, the styles shipped for them in models/assets/styles, if any (`python -m "
                        "models.train_style` trains them), else none; 'none': no styles")
    p.add_argument("--lora-budget-gib", type=float, default=2.0, metavar="GIB",
                   help="device memory the loaded styles may hold (default 2), counted in the KV pool's budget: each "
                        "is loaded once and shared by its streams (at start, in name order while they fit); loading "
                        "one more evicts the least recently used style no open or paused stream uses, and a style that "
                        "still does not fit is refused with the figures")


def cmd_serve(args) -> int:
    import asyncio
    import logging

    from streamsvc import preflight
    from streamsvc.viewers.server import Server, ServerConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("websockets").setLevel(logging.WARNING)
    from streamsvc import library_logs

    library_logs.install()  # aiortc, aioice, av, aiohttp: their lines gated as ours are (a client decides how many)
    # the engine thread and the event loop share the GIL: hand it over sooner than the 5 ms default,
    # so an uninterruptible commit (forward + decode + encode) does not hold the loop's sends back
    sys.setswitchinterval(5e-4)
    static = Path(__file__).resolve().parents[1] / "client" / "static"
    try:
        warning = preflight.check_args(args)
        _check_weights(args)
        webrtc = _webrtc_config(args)
        access = _access_config(args)
        audience = _audience_config(args)
        front = _front_config(args)
    except (ValueError, OSError) as e:
        print(f"streamsvc serve: {e}", file=sys.stderr)
        return 2
    if warning:
        logging.getLogger("streamsvc.cli").warning("%s", warning)
    config = ServerConfig(host=args.host, port=args.port, static_dir=str(static) if static.is_dir() else None,
                          webrtc=webrtc, access=access, **audience, **front)
    if args.cluster is not None:  # beyond one GPU: this front as the gateway of Ray Serve engine replicas
        return _serve_cluster(args, config)
    from streamsvc.engine.group import GroupError

    try:
        asyncio.run(Server(options.engine_config(args), config).serve_forever())
    except KeyboardInterrupt:
        pass
    except (ValueError, OSError) as e:  # the engine could not start: bad weight files or flags (logged in full)
        print(f"streamsvc serve: {e}", file=sys.stderr)
        return 2
    except GroupError as e:  # --parallel K: a rank died or hung while the group started
        print(f"streamsvc serve: {e}", file=sys.stderr)
        return 1
    return 0


def _cluster_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster (the [cluster] extra, Ray Serve; see docs/parallel.md)")
    g.add_argument("--cluster", default=None, metavar="auto|local|ADDRESS",
                   help="run the engines as Ray Serve replicas, one per GPU, with this server as their gateway: "
                        "auto = the Ray cluster `ray start` made on this machine, local = a new one-machine Ray "
                        "instance on 127.0.0.1, or the head's HOST:PORT (default: none, one engine in this process)")
    g.add_argument("--gpus", type=int, default=1, metavar="N",
                   help="GPUs for engine replicas, one GPU each, or K each with --parallel K (G/K replicas, one "
                        "group each; default 1; 0 = attach this gateway to the replicas another gateway started)")
    g.add_argument("--drain-timeout", type=float, default=60.0, metavar="S",
                   help="seconds a stopping replica's streams play on before it is stopped (Serve's "
                        "graceful_shutdown_timeout_s; its viewers are then placed again; default 60)")
    g.add_argument("--warmup-nice", type=int, default=0, metavar="N",
                   help="niceness added to a replica's engine while it warms up (a replacement's warm-up then "
                        "yields the CPU to the streams of the other replicas on a shared host; default 0)")


def _serve_cluster(args, front) -> int:
    import functools

    try:
        from streamsvc.cluster.launch import DeployConfig, group_replicas, replica_config, serve_cluster
    except ImportError as e:
        print(f"streamsvc serve: --cluster needs the cluster extra (pip install -e '.[cluster]'): {e}", file=sys.stderr)
        return 2
    try:  # --parallel K: a replica per group of K GPUs, G/K of them
        replicas, gpus_each = group_replicas(args.gpus, args.parallel, args.devices)
    except ValueError as e:
        print(f"streamsvc serve: {e}", file=sys.stderr)
        return 2
    # each replica builds its engine config on its own host (its device decides the defaults)
    replica = replica_config(functools.partial(options.engine_config, args), front, warmup_nice=args.warmup_nice)
    deploy = DeployConfig(replicas=replicas, num_gpus=gpus_each, drain_timeout_s=args.drain_timeout)
    return serve_cluster(args.cluster, args.gpus, replica, front, deploy)


def _webrtc_args(p: argparse.ArgumentParser) -> None:
    p = p.add_argument_group("WebRTC (see docs/webrtc.md)")
    from streamsvc.wire.rtc import MAX_REMOTE_CANDIDATES

    p.add_argument("--ice-server", action="append", default=[], metavar="URL[,USER,CREDENTIAL]",
                   help="STUN/TURN server for WebRTC streams, e.g. stun:stun.example.org:3478 or "
                        "turn:turn.example.org:3478,user,secret (repeatable; default: none, host candidates only)")
    p.add_argument("--ice-address", action="append", default=[], metavar="IP",
                   help="gather WebRTC host candidates on this address only (repeatable; e.g. 127.0.0.1 keeps ICE "
                        "on loopback; default: every interface but loopback, and loopback too when --host is a "
                        "loopback address)")
    p.add_argument("--max-remote-candidates", type=int, default=MAX_REMOTE_CANDIDATES, metavar="N",
                   help="ICE candidates of a WebRTC viewer's offer the server keeps, and so probes (default "
                        f"{MAX_REMOTE_CANDIDATES}; a browser names 2 to 8). Link-local, multicast, unspecified and "
                        "broadcast addresses and mDNS names are never probed, nor loopback unless the server gathers "
                        "there itself")


def _webrtc_config(args):
    from streamsvc.wire.rtc import IceServer, WebRtcConfig

    return WebRtcConfig(ice_servers=tuple(IceServer.parse(s) for s in args.ice_server),
                        ice_addresses=tuple(args.ice_address) or None,
                        max_remote_candidates=args.max_remote_candidates)


def _access_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("access (see docs/public-address.md)")
    g.add_argument("--auth-token", action="append", default=[], metavar="TOKEN",
                   help="a stream starts only with this token (repeatable; also --auth-file; default: no token needed)")
    g.add_argument("--auth-file", default=None, metavar="PATH",
                   help="tokens, one 'TOKEN [MAX_STREAMS]' a line ('#' comments): MAX_STREAMS limits the streams the "
                        "token holds at once")
    g.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="let pages of ORIGIN (e.g. https://app.example.org) open streams from a browser (repeatable; "
                        "default: only the origin matching the request's Host, i.e. the server's own player)")
    g.add_argument("--max-streams-per-client", type=int, default=None, metavar="N",
                   help="streams one remote address may hold at once (default: no limit)")
    g.add_argument("--trust-proxy", action="store_true",
                   help="take the client address from X-Forwarded-For (only behind a reverse proxy that sets it)")
    g.add_argument("--control-rate", type=float, default=5.0, metavar="PER_S",
                   help="control messages (set_prompt, pause, resume) a stream may send a second (default 5)")
    g.add_argument("--control-burst", type=int, default=10,
                   help="control messages a stream may send at once before --control-rate applies (default 10)")
    g.add_argument("--stats-rate", type=float, default=4.0, metavar="PER_S",
                   help="stats messages a stream may send a second, counted apart (default 4, burst as many)")
    g.add_argument("--max-connections-per-client", type=int, default=256, metavar="N",
                   help="WebSockets one remote address may hold at once; past it an upgrade gets HTTP 429, and "
                        "sockets of any kind past twice it are dropped as they come (default 256: the load tests "
                        "open about 100 from one address)")
    g.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="WebSockets all clients may hold at once; past it an upgrade gets HTTP 503, and sockets "
                        "past half again as many are dropped as they come (default: from the file descriptor limit, "
                        "which serve raises to its hard limit: (limit - 128) / 3, at most 16384, leaving room for "
                        "the engine, recordings and WebRTC viewers' UDP sockets)")
    g.add_argument("--start-timeout", type=float, default=10.0, metavar="S",
                   help="seconds a WebSocket may stay open without 'start' or 'watch' before it is closed (default 10)")
    g.add_argument("--http-rate", type=float, default=20.0, metavar="PER_S",
                   help="HTTP requests (/metrics, /healthz, the player's files, recordings) one address may make a "
                        "second; more get HTTP 429 with Retry-After (default 20)")
    g.add_argument("--http-burst", type=int, default=50, metavar="N",
                   help="HTTP requests one address may make at once before --http-rate applies (default 50)")
    g.add_argument("--connect-rate", type=float, default=20.0, metavar="PER_S",
                   help="WebSocket upgrades one address may make a second (more get HTTP 429), and messages its "
                        "connections may send before 'start' or 'watch' (more close the connection); each with a "
                        "burst of --max-connections-per-client (default 20)")
    g.add_argument("--max-protocol-errors", type=int, default=10, metavar="N",
                   help="bad messages (unparseable, invalid, out of turn) within 10 s that close a connection "
                        "(default 10)")


def _front_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the port: TLS, metrics, downloads (see docs/public-address.md)")
    g.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="serve https and wss on the port with this certificate (chain); needs --tls-key (default: "
                        "plain http and ws; a browser's camera needs https off localhost)")
    g.add_argument("--tls-key", default=None, metavar="PEM", help="the private key of --tls-cert")
    g.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve /metrics alone on this port, without the access token (bind it where only your "
                        "scraper reaches); the main port then answers 404 for /metrics (default: /metrics on the "
                        "main port, behind the token when the server has tokens)")
    g.add_argument("--max-downloads-per-client", type=int, default=4, metavar="N",
                   help="recordings one client address may download at once; more get HTTP 429 with Retry-After "
                        "(default 4; each download holds a file and a 256 KiB piece, never the whole file)")


def _front_config(args) -> dict:
    """ServerConfig's fields of the port; a TLS certificate or key that does not load is an error here."""
    from streamsvc.door.front import tls_context

    if (args.tls_cert is None) is not (args.tls_key is None):
        raise ValueError("give both --tls-cert and --tls-key (a certificate and its private key), or neither")
    if args.tls_cert is not None:
        tls_context(args.tls_cert, args.tls_key)  # raises OSError (ssl.SSLError) with the reason
    if args.max_downloads_per_client < 1:
        raise ValueError(f"--max-downloads-per-client {args.max_downloads_per_client}: give at least 1")
    return {"tls_cert": args.tls_cert, "tls_key": args.tls_key, "metrics_port": args.metrics_port,
            "max_downloads_per_client": args.max_downloads_per_client}


def _audience_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("watchers and recording (see README: One stream, many viewers)")
    g.add_argument("--max-watchers", type=int, default=64, metavar="N",
                   help="viewers that may watch one stream through its watch link (/#watch=ID), its steerer not "
                        "counted (default 64; 0: no watching); admission also counts their send")
    g.add_argument("--orphan-timeout", type=float, default=60.0, metavar="S",
                   help="a stream whose steerer left goes on this long for its watchers, steerable by whoever takes "
                        "the token (default 60)")
    g.add_argument("--record", default=None, metavar="DIR",
                   help="record every stream to DIR as MP4 (no re-encode; a chapter per prompt); without it a "
                        "steerer's 'record' message records its stream to --recordings-dir")
    g.add_argument("--recordings-dir", default="recordings", metavar="DIR",
                   help="where 'record' messages record to, served at /recordings/ID-SECRET.mp4 (default ./recordings)")
    g.add_argument("--record-max-gib", type=float, default=4.0, metavar="GIB",
                   help="disk the recordings may use; a recording that reaches it stops, a new one is refused "
                        "(default 4)")


def _audience_config(args) -> dict:
    if args.max_watchers < 0 or not args.orphan_timeout >= 0 or not args.record_max_gib > 0:
        raise ValueError("--max-watchers and --orphan-timeout take numbers >= 0, --record-max-gib a number > 0")
    return dict(max_watchers=args.max_watchers, orphan_timeout_s=args.orphan_timeout,
                recordings_dir=args.record or args.recordings_dir, record_all=args.record is not None,
                record_max_bytes=int(args.record_max_gib * 2**30))


def _access_config(args):
    from streamsvc.door.access import AccessConfig, Rate, check_token, parse_auth_file

    if args.max_connections_per_client < 1:
        raise ValueError(f"--max-connections-per-client {args.max_connections_per_client}: give at least 1")
    tokens = {check_token(t): None for t in args.auth_token}
    if args.auth_file:
        tokens |= parse_auth_file(Path(args.auth_file).read_text(), source=args.auth_file)
    return AccessConfig(tokens=tokens, allowed_origins=tuple(args.allow_origin),
                        max_streams_per_client=args.max_streams_per_client, trust_proxy=args.trust_proxy,
                        control_rate=Rate(args.control_rate, args.control_burst),
                        stats_rate=Rate(args.stats_rate, max(1, round(args.stats_rate))),
                        max_connections_per_client=args.max_connections_per_client,
                        max_connections=args.max_connections, start_timeout_s=args.start_timeout,
                        http_rate=Rate(args.http_rate, args.http_burst),
                        connect_rate=Rate(args.connect_rate, args.max_connections_per_client),
                        max_protocol_errors=args.max_protocol_errors)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamsvc",
        description="Live autoregressive video generation for many viewers: serve streams, load-test them, "
        "or generate a video file offline.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate one video offline and write an H.264 MP4")
    g.add_argument("--prompt", required=True, help="what the video shows")
    g.add_argument("--seconds", type=float, default=3.0, help="length of the video (default 3)")
    g.add_argument("--fps", type=int, default=16, help="frames per second (default 16)")
    g.add_argument("--seed", type=int, default=0, help="noise seed: same seed and prompts give the same frames")
    g.add_argument("-o", "--output", default="out.mp4", help="output .mp4 path (default out.mp4)")
    g.add_argument(
        "--prompt-at", action="append", default=[], metavar="SECONDS:TEXT",
        help="switch to TEXT from the first chunk starting at SECONDS (repeatable)",
    )
    g.add_argument("--strip", default=None, metavar="PNG",
                   help="also write a strip of frames, side by side, to this PNG (e.g. docs/strip.png for the README)")
    g.add_argument("--strip-every", type=int, default=8, metavar="N",
                   help="the strip shows frame 0, N, 2N, ... (default 8: two frames a second at 16 fps)")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.add_argument("--dump", default=None, metavar="FILE",
                   help="also save every chunk's clean latents and decoded frames to FILE (torch.save), to compare runs exactly")
    g.add_argument("--input", default=None, metavar="VIDEO",
                   help="restyle this video (video-to-video): centre-cropped and scaled to the model's size, resampled "
                        "to --fps; output frame i is input frame i under the prompt")
    g.add_argument("--strength", type=float, default=0.6,
                   help="with --input: how much of it is redrawn, 0..1 (1: none of it is kept, text-to-video); snapped "
                        "to the nearest of the schedule's noise levels (default 0.6)")
    g.add_argument("--image", default=None, metavar="PNG",
                   help="start from this image (image-to-video): centre-cropped and scaled to the model's size, it is "
                        "the first frame, and the prompt's motion goes on from it")
    _model_args(g, g)
    _parallel_args(g)
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="serve live streams over WebSocket (player at /, /healthz, /metrics)",
                       usage="%(prog)s [--host 127.0.0.1] [--port 8000] [--preset tiny] [--device auto] [options]",
                       description="Serve live streams: the browser player at /, WebSocket streams at /ws, WHEP and "
                                   "WHIP, /healthz and /metrics, on one port. The defaults are the fast path of the "
                                   "device found; the groups below change them.")
    basics = s.add_argument_group("basics")
    basics.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    basics.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    _model_args(s, basics)
    _parallel_args(s)
    _style_args(s)
    _serve_args(s)
    _webrtc_args(s)
    _access_args(s)
    _audience_args(s)
    _front_args(s)
    _cluster_args(s)
    s.set_defaults(func=cmd_serve)

    from client import loadtest  # the one place streamsvc reaches into client

    lt = sub.add_parser("loadtest", help="run N viewers against a server and report TTFF, stalls and control latency")
    loadtest.add_arguments(lt)
    from streamsvc.inputs.synthetic import loadtest_sources  # --input synthetic: scenes rendered here, not in client

    lt.set_defaults(func=lambda args: loadtest.run(args, input_sources=loadtest_sources(args)))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
