"""The chunk generator: Self-Forcing's few-step causal inference, one forward at a time.

A chunk of `frames_per_chunk` latent frames is denoised from noise in `len(timesteps)`
forwards (each reading the stream's KV cache), then one commit forward at timestep 0
writes its K/V into the cache, and the decoder turns it into video frames. A prompt
switch re-caches the window under the new prompt (LongLive) before the next chunk.

Each forward is a method call (`recache`, `denoise`, `commit`) so a scheduler can
interleave streams forward by forward; `stream()` strings them together for offline use.
The types it runs on (its config, a stream's state, a chunk) are models/stream.py's;
models/build.py builds a generator from local files.

Video-to-video (issue 35; SDEdit inside the causal loop): a stream may give each chunk input video
frames (`set_input`), which the model's encoder (models/encoder.py) turns into latents z; the chunk then
starts at step k = `start_step(strength)` from x = (1 - sigma_k) z + sigma_k noise and runs steps
k .. steps-1, committed and decoded as usual, so output frame i is input frame i restyled.

Strength SNAPS to the schedule's sigmas, never an off-schedule first step: the models are few-step
distilled and Self-Forcing trains the schedule's exits only, so a first step at another sigma is a
timestep the model never saw (drift for nothing), and a snapped strength keeps a chunk's forward count
an integer number of the trained steps. Strength s picks the step whose sigma is nearest s (ties: the
noisier); strength 1.0 is step 0, the input pure noise (text-to-video). At least one step always runs;
degrading drops steps after the start step (n steps with start k run k .. max(n, k+1) - 1).

Image-to-video (causal, as Wan's and Self-Forcing's): `start_from_image` makes a new stream's latent frame 0 an
image's (Wan's lone first frame), committed at timestep 0 as clean context, a block of its own (a sink frame
while the cache has sinks); chunks then follow from latent frame 1, their blocks one frame later (`_block`).

Styles (issue 47; models/adapters.py): a stream may run under a LoRA adapter of `adapters` at a scale, whose
low-rank terms its forwards add to its rows only; `set_lora` switches it live, re-caching as a prompt switch.
The same way, a model file may hold an input adapter (models/model_file.py INPUT_ADAPTER, `input_adapter`): the
streams opened with an input of a kind it was trained for (`input_kind`: "video" to follow, "image" to start from)
run under it unless they have a style; a stream without one runs the base weights, bit for bit.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import replace

import torch

from kvcache import CacheSpec, HostCopier, StreamCache, Workspace, park_cache, restore_cache
from models.adapters import Adapter, AdapterSet, AdapterUse
from models.config import ModelConfig
from models.decoder import StreamingDecoder, TinyStreamingDecoder, frames_per_chunk
from models.dit import CacheAccess, CausalWanModel, TextKV, in_place
from models.encoder import BlockPCAEncoder, StreamingEncoder, check_frames
from models.graphs import GraphedForward, capture_serving
from models.prompts import PromptCache, batch_text
from models.stream import INPUT_KINDS, PARKED_FIELDS, Chunk, GeneratorConfig, ParkedStream, StreamState, field_tensors, with_tensors
from models.text import HashTextEncoder, TextEncoder
from models.work import WorkKind


def apply_speed_options(model: CausalWanModel, cfg: GeneratorConfig) -> CausalWanModel:
    """Make `model` run the model-side speed options `cfg` asks for (models/fidelity.py): FP8 linears
    (quantized once, the bf16 weights dropped) and the INT8 attention. Idempotent (FP8 weights stay FP8); returns the model."""
    if cfg.fp8_linears:
        from models.fp8 import quantize_linears

        quantize_linears(model)
    model.attention_quant = cfg.attention_quant
    return model


class ChunkGenerator:
    """Runs the causal DiT forward by forward for any number of streams."""

    def __init__(
        self,
        model: CausalWanModel,
        cfg: GeneratorConfig = GeneratorConfig(),
        text_encoder: TextEncoder | None = None,
        decoder: StreamingDecoder | None = None,
        encoder: StreamingEncoder | None = None,
    ) -> None:
        """`encoder`: the input encoder of video-to-video (None: none, unless `decoder` is None too: the
        built-in random decoder comes with a random BlockPCA encoder, `BlockPCAEncoder.random`)."""
        self.model, self.cfg = apply_speed_options(model, cfg), cfg
        mc: ModelConfig = model.cfg
        self.model_cfg = mc
        self.text_encoder = text_encoder or HashTextEncoder(mc.text_dim, mc.text_len)
        if decoder is None:
            decoder = TinyStreamingDecoder(mc).init_weights(seed=0).to(model.device, model.dtype)
            encoder = encoder or BlockPCAEncoder.random(mc, seed=0, device=model.device)
        self.decoder = decoder
        self.encoder = encoder
        self.sigmas = cfg.sigmas
        self.device = model.device
        self._sigmas = torch.tensor(self.sigmas, dtype=torch.float64, device=self.device)  # [steps], read by index
        self.prompts = PromptCache(model, self.text_encoder)  # recent prompts' cross-attention K/V
        # the device's working copy of one stream's cache at a time (dense storage only)
        self.workspace = Workspace(self.workspace_spec(), self.device) if cfg.stage_kv and cfg.kv_quant == "none" else None
        self.copier = HostCopier(self.device)  # parks streams in host memory and brings them back
        self.adapters = AdapterSet(self.model, max_rank=cfg.lora_max_rank)  # the styles (`adapters.load` / `load_dir`)
        self.input_adapter: Adapter | None = None  # the streams with an input run under it (`set_input_adapter`)
        self.input_kinds: tuple[str, ...] = ()  # the inputs it was trained for (INPUT_KINDS)
        self._input_use: AdapterUse | None = None
        # what `forward` runs: CUDA graphs on CUDA, the model itself elsewhere
        self.runner = GraphedForward(model, self.adapters) if cfg.cuda_graphs and model.device.type == "cuda" else model

    # -- streams ------------------------------------------------------------------------------

    def cache_spec(self) -> CacheSpec:
        """What each stream's own cache holds (what the pool allocates per stream)."""
        c = self.cfg
        return self.model_cfg.cache_spec(
            sink_frames=c.sink_frames,
            window_frames=c.window_frames,
            dtype={torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}[self.model.dtype],
            quant=c.kv_quant,
        )

    def workspace_spec(self) -> CacheSpec:
        """The device's workspace: a stream's cache with room for a chunk's own K/V before its slots."""
        return replace(self.cache_spec(), quant="none", staging_frames=self.cfg.frames_per_chunk)

    def decoder_state_bytes(self) -> int:
        """Device memory one stream's decoder state holds (the Wan VAE's causal cache: 1.9 GB at 480x832)."""
        return self.decoder.state_bytes(self.model_cfg.height, self.model_cfg.width)

    @property
    def can_take_input(self) -> bool:
        """Whether streams may have input video (the model has an encoder)."""
        return self.encoder is not None

    def encoder_state_bytes(self) -> int:
        """Device memory one stream's input encoder state holds (0 without an encoder, or a stateless one)."""
        return 0 if self.encoder is None else self.encoder.state_bytes(self.model_cfg.height, self.model_cfg.width)

    def open_stream(self, stream_id: str, prompt: str, seed: int, cache: StreamCache | None = None,
                    lora: str | None = None, lora_scale: float = 1.0, input_kind: str | None = None) -> StreamState:
        """A new stream; `cache` comes from the device's pool (a private one is made if None); `lora`: its style,
        one of `adapters` (None: none), at `lora_scale` (an unknown style or a bad scale: a ValueError);
        `input_kind`: it will have an input, "video" or "image" (a start image): it runs under `input_adapter` if that
        was trained for such inputs."""
        if input_kind not in INPUT_KINDS + (None,):
            raise ValueError(f"input_kind must be one of {', '.join(INPUT_KINDS)} or None, got {input_kind!r}")
        use = self._use(lora, lora_scale, input_kind)
        mc = self.model_cfg
        cache = cache if cache is not None else StreamCache(self.cache_spec(), self.device)
        noise = torch.Generator(device=self.device).manual_seed(seed)
        return StreamState(
            stream_id=stream_id,
            cache=cache,
            noise=noise,
            prompt=prompt,
            text=self.encode_prompt(prompt, use),
            decoder=self.decoder.init_state(),
            clean=torch.zeros(cache.spec.capacity_frames, mc.in_channels, mc.latent_height, mc.latent_width, device=self.device),
            steps=len(self.sigmas),
            encoder=None if self.encoder is None else self.encoder.init_state(),
            lora=lora,
            lora_scale=float(lora_scale),
            input_kind=input_kind,
        )

    def close_stream(self, state: StreamState) -> None:
        """The stream is done: the workspace forgets it (its cache goes back to the pool)."""
        if self.workspace is not None and state.cache is not None:  # (a parked stream holds none)
            self.workspace.release(state.cache)

    # -- parking ------------------------------------------------------------------------------

    def park_bytes(self, state: StreamState) -> int:
        """Host memory parking `state` takes now: its cache's storage and the tensors of its other fields."""
        fields = {name: getattr(state, name) for name in PARKED_FIELDS}
        return state.cache.spec.stream_bytes() + sum(t.numel() * t.element_size() for t in field_tensors(fields))

    def park(self, state: StreamState) -> ParkedStream:
        """Start moving the stream's device memory to the host (pinned, on the copier's side stream, after what
        the device has queued: a commit just launched included). The state keeps its scalars and its noise
        generator; its cache (which the caller gives back to the pool) and its tensor fields are taken off it.
        Any point of a chunk works (x, x0 and the step move too); the engine parks between chunks. The device
        memory is free once `done()` and the caller drops the cache."""
        if self.workspace is not None and self.workspace.owner is state.cache:
            self.workspace.detach()  # what the stream wrote there goes home first (queued before the copies)
        fields = {name: getattr(state, name) for name in PARKED_FIELDS}
        cache = park_cache(state.cache, self.copier)
        moved = self.copier.to_host(field_tensors(fields))
        parked = ParkedStream(state, cache, with_tensors(fields, iter(moved.tensors)), moved)
        state.cache = None
        for name in PARKED_FIELDS:
            setattr(state, name, None)
        return parked

    def restore(self, parked: ParkedStream, cache: StreamCache) -> StreamState:
        """The parked stream again, with `cache` (fresh from the pool, of `cache_spec()`) holding what its cache
        held. Copies run on the side stream; the device's next work waits for them. Its prompt's text K/V
        come from the prompt cache when it still has them (the same tensors), else back from the host."""
        state = parked.state
        if state.cache is not None:
            raise ValueError(f"stream {state.stream_id} is not parked")
        parked.restored = [restore_cache(parked.cache, cache, self.copier)]
        parked.moved.wait()
        fields = dict(parked.fields)
        text = self.prompts.cached(state.prompt, self.lora_use(state))
        if text is not None:
            del fields["text"]
        back = self.copier.to_device(field_tensors(fields))
        parked.restored.append(back)
        fields = with_tensors(fields, iter(back.tensors))
        if text is not None:
            fields["text"] = text
        for name in PARKED_FIELDS:
            setattr(state, name, fields[name])
        state.cache = cache
        return state

    @torch.inference_mode()
    def start_from_image(self, state: StreamState, image: torch.Tensor) -> Chunk:
        """Start a new stream at `image` ([H, W, 3] uint8 RGB at the model's frame size, any device): its encoding
        (with a fresh encoder state) becomes latent frame 0, committed to the cache by a forward at timestep 0
        under the stream's prompt, as a chunk's commit is, then decoded (the decoder's causal state is then the
        image's). Returns it as chunk 0: one latent frame, one video frame, decoded from the latent the model
        continues from (not the image as given). The chunks that follow are numbered from 1, from latent frame 1."""
        if self.encoder is None:
            raise ValueError(f"stream {state.stream_id}: this model has no encoder, it takes no start image")
        if state.chunks_done or state.step or state.cache.num_frames:
            raise ValueError(f"stream {state.stream_id}: a start image comes before the stream's first chunk")
        mc = self.model_cfg
        check_frames(image[None], mc.height, mc.width)
        z = self.encoder.encode(image[None], self.encoder.init_state()).to(self.device, torch.float32)  # [C, 1, h, w]
        if tuple(z.shape) != (mc.in_channels, 1, mc.latent_height, mc.latent_width):
            raise ValueError(f"the encoder gave latents {tuple(z.shape)} for one image")
        if state.pending_prompt is not None:
            self._apply_prompt(state)
        slots = state.cache.plan_commit(1)
        self.forward(z[None], torch.zeros(1, 1, device=self.device), state.text, [CacheAccess(state.cache, 0, write_slots=slots, lora=self.lora_use(state))])
        state.cache.advance(slots)
        state.clean[_rows(slots, self.device)] = z.transpose(0, 1)
        state.forwards[WorkKind.COMMIT.value] += 1
        frames = self.decoder.decode(z, state.decoder)
        state.start_frames, state.chunks_done, state.frames_done = 1, 1, frames.shape[0]
        return Chunk(0, 0, frames, z, state.prompt_version, steps=0)

    def encode_prompt(self, prompt: str, lora: AdapterUse | None = None) -> TextKV:
        """Cross-attention K/V of a prompt under a style (`prompts`: computed once, the recent ones kept)."""
        return self.prompts.encode(prompt, lora)

    def set_prompt(self, state: StreamState, prompt: str, version: int | None = None) -> None:
        """Steer the stream: the next chunk (after a recache) follows `prompt`, tagged `version`."""
        state.pending_prompt, state.pending_version = prompt, version

    def set_lora(self, state: StreamState, name: str | None, scale: float = 1.0, version: int | None = None) -> None:
        """Switch the stream's style live: from the next chunk on, adapter `name` (None: none) at `scale`, after a recache
        as a prompt switch's (it is one, to the same prompt unless another is pending), tagged `version`. A bad name or scale: ValueError."""
        self.adapters.use(name, scale)
        state.pending_lora = (name, float(scale))
        if state.pending_prompt is None:
            self.set_prompt(state, state.prompt, version)
        elif version is not None:
            state.pending_version = version

    def lora_use(self, state: StreamState) -> AdapterUse | None:
        """The stream's adapter as its forwards run it: its style, else the input adapter for a stream with an
        input (None: the base weights, bit for bit)."""
        return self._use(state.lora, state.lora_scale, state.input_kind)

    def _use(self, lora: str | None, scale: float, input_kind: str | None) -> AdapterUse | None:
        if lora is None and input_kind in self.input_kinds and self._input_use is not None:
            return self._input_use
        return self.adapters.use(lora, scale)

    def set_input_adapter(self, pairs: dict[str, tuple], path: str = "", kinds: Sequence[str] = INPUT_KINDS) -> Adapter:
        """The model's input adapter (models/model_file.py INPUT_ADAPTER: {Linear: (A, B, alpha)}), checked against
        the model as a style is; the streams opened with an `input_kind` of `kinds` (those it was trained for) run
        under it. Set it before any stream opens."""
        self.input_adapter = self.adapters.adapter_of("input", pairs, path)
        self._input_use = AdapterUse(self.input_adapter, 1.0)  # one object: the input streams' rows share its product
        self.input_kinds = tuple(kinds)
        return self.input_adapter

    def abandon_chunk(self, state: StreamState) -> None:
        """Drop the chunk in progress (e.g. to restart it under a new prompt)."""
        if state.reused_slots is not None and any(s < state.cache.num_frames for s in state.reused_slots):
            # commit reuse wrote the dropped chunk's K/V over the oldest window frames: recompute them (a
            # recache before the next chunk, under the pending prompt if there is one, else the same one)
            if state.pending_prompt is None:
                self.set_prompt(state, state.prompt, version=state.prompt_version)
            state.recache_all = True
            state.cache.touch()
        state.reused_slots = None
        state.step, state.steps, state.x, state.x0, state.start = 0, len(self.sigmas), None, None, 0
        # its input (set_input's latents) stays: the chunk restarts from the same frames

    # -- video-to-video -----------------------------------------------------------------------

    def input_strengths(self) -> tuple[float, ...]:
        """The strengths a stream may have: the schedule's sigmas, noisiest (1.0, text-to-video) first."""
        return tuple(self.sigmas)

    def start_step(self, strength: float) -> int:
        """The step a chunk of input at `strength` starts at: the one whose sigma is nearest (ties: the
        noisier, i.e. the earlier step). Strength must be in [0, 1]; 0 still runs the last step."""
        if not 0.0 <= strength <= 1.0:  # NaN too
            raise ValueError(f"strength must be in [0, 1] (1: text-to-video, lower: closer to the input), got {strength}")
        best = 0
        for k, sigma in enumerate(self.sigmas):
            if abs(sigma - strength) < abs(self.sigmas[best] - strength) - 1e-9:
                best = k
        return best

    def set_strength(self, state: StreamState, strength: float) -> float:
        """Steer the stream's strength (live): from its next chunk on, snapped to the schedule's sigmas.
        Returns the snapped value."""
        state.strength = self.sigmas[self.start_step(strength)]
        return state.strength

    def set_input(self, state: StreamState, frames: torch.Tensor | None) -> None:
        """The next chunk's input video frames ([N, H, W, 3] uint8 at the model's frame size, any device, N =
        `frames_in_chunk` of the chunk), encoded now (the encoder's causal state advances); or None: the
        input is missing for that chunk, which runs as text-to-video, and the encoder state is reset, so the
        next frames start a new causal run. Once per chunk, between chunks (before its first denoise); the
        input stays with the chunk through `abandon_chunk` until its commit."""
        if self.encoder is None:
            raise ValueError(f"stream {state.stream_id}: this model has no encoder, it takes no input video")
        if state.step != 0:
            raise ValueError(f"stream {state.stream_id}: input for a chunk at step {state.step}: set it between chunks")
        if state.input != "none":
            raise ValueError(f"stream {state.stream_id}: chunk {state.chunks_done} has its input already ({state.input})")
        if frames is None:
            state.encoder, state.input_latents, state.input = self.encoder.init_state(), None, "missing"
            return
        mc = self.model_cfg
        check_frames(frames, mc.height, mc.width)
        want = self.frames_in_chunk(state.chunks_done)
        if frames.shape[0] != want:
            raise ValueError(f"stream {state.stream_id}: chunk {state.chunks_done} takes {want} input frames, got {frames.shape[0]}")
        z = self.encoder.encode(frames, state.encoder)
        shape = (mc.in_channels, self.cfg.frames_per_chunk, mc.latent_height, mc.latent_width)
        if tuple(z.shape) != shape:
            raise ValueError(f"the encoder gave latents {tuple(z.shape)} for a chunk of {tuple(shape)}")
        state.input_latents, state.input = z.to(self.device, torch.float32), "frames"

    def set_steps(self, state: StreamState, steps: int) -> None:
        """Run the chunk in progress (or, between chunks, the next one) with `steps` denoising steps: the
        schedule's own number, or one of `cfg.degraded_steps` instead of a stall. A chunk in progress can
        only be cut short, down to the steps it has already run (its commit is then next)."""
        full = len(self.sigmas)
        if steps != full and steps not in self.cfg.shorter_steps:
            raise ValueError(f"stream {state.stream_id}: {steps} steps; use {full} or one of {self.cfg.shorter_steps}")
        if state.step > 0:  # a chunk that started at step k runs at least step k
            steps = max(steps, state.start + 1)
        if state.step > 0 and not state.step <= steps <= state.steps:
            raise ValueError(
                f"stream {state.stream_id}: {steps} steps for a chunk at step {state.step} of {state.steps}: "
                "a chunk in progress can only be cut short"
            )
        state.steps = steps

    def next_work(self, state: StreamState) -> WorkKind:
        if state.step == 0 and state.pending_prompt is not None and self._needs_recache(state):
            return WorkKind.RECACHE
        return WorkKind.COMMIT if state.step == state.steps else WorkKind.DENOISE

    def frames_in_chunk(self, chunk_index: int) -> int:
        return frames_per_chunk(self.cfg.frames_per_chunk, chunk_index == 0, self.model_cfg.temporal_upsample)

    # -- the three forwards -------------------------------------------------------------------

    def forward(self, x: torch.Tensor, t: torch.Tensor, text: TextKV, access: Sequence[CacheAccess]) -> torch.Tensor:
        """Every forward of the generator. One stream's forward runs in the workspace (its cache is
        copied in if another stream's is there); a batch reads each stream's own cache. A forward
        that reads in place reuses the keys rotated by an earlier one if the cache has not changed
        since (a chunk's later steps and its commit). The bookkeeping is here, outside the model,
        since a graph replay skips the model's host code."""
        self._place(access)
        if in_place(access, x.shape[2] // self.model_cfg.patch[0]):
            acc = access[0]
            rotated = acc.cache.keys_rotated(acc.read_slots)
            out = self.runner(x, t, text, [replace(acc, keys_rotated=rotated)])
            acc.cache.note_rotated(acc.read_slots)
        else:
            out = self.runner(x, t, text, access)
        for acc in access:
            if acc.write_slots is not None:  # what a graph replay wrote, the host did not see
                acc.cache.touch()
                if self.workspace is not None:
                    self.workspace.written(acc.cache, acc.write_slots)
        return out

    def _place(self, access: Sequence[CacheAccess]) -> None:
        """One stream: into the workspace. Several: each reads its own storage, which must be current."""
        ws = self.workspace
        if ws is None:
            return
        caches = [acc.cache for acc in access if acc.cache is not None]
        if len(access) == 1 and caches and ws.fits(caches[0]):
            ws.attach(caches[0])
        elif ws.owner is not None and any(c is ws.owner for c in caches):
            ws.detach()

    @torch.inference_mode()
    def run(self, work: WorkKind, states: Sequence[StreamState]) -> list[Chunk | None]:
        """One forward of `work` for `states` (batched where shapes allow). Commit returns chunks."""
        if work is WorkKind.RECACHE:
            for s in states:
                self.recache(s)
            return [None] * len(states)
        if work is WorkKind.DENOISE:
            self.denoise(states)
            return [None] * len(states)
        return self.commit(states)

    @torch.inference_mode()
    def recache(self, state: StreamState) -> None:
        """Apply the pending prompt and recompute the cached frames' K/V under it.

        One forward per chunk of cached frames, oldest first, each reading the cache up to it: the
        block-causal attention of one forward over the whole window (each chunk sees the sinks, the
        chunks before it and itself), without a mask, in the shapes of a commit (so the commit's
        CUDA graphs replay it). At sink 3 + window 9 on the H200: forwards over 3, 6 and 9 cached
        frames, about 125 ms, where the masked forward over the window took about 320.

        With `cfg.recache_chunks` = N > 0 (recache-last: 1) only the window's newest N chunks are
        recomputed, reading the older ones as they are: those keep the K/V they had under the old
        prompt. The window is laid out again in time order from slot S (`relayout_window`, which moves
        only the bookkeeping), so the kept frames' K/V are first moved to their new slots (nothing
        moves when the ring's head is at 0)."""
        if state.pending_prompt is None:
            raise ValueError(f"stream {state.stream_id}: recache without a pending prompt")
        self._apply_prompt(state)
        state.forwards[WorkKind.RECACHE.value] += 1
        cache, nf = state.cache, self.cfg.frames_per_chunk
        sinks = cache.sinks_filled
        old_window = cache.window_slots_in_order()
        new_window = cache.relayout_window()
        if old_window:
            state.clean[_rows(new_window, self.device)] = state.clean[_rows(old_window, self.device)].clone()
        blocks = [_block(cache.frame_ids[s], state.start_frames, nf) for s in new_window]  # ascending
        kept = _older_frames(blocks, 0 if state.recache_all else self.cfg.recache_chunks)
        state.recache_all = False
        self._move_kv(cache, old_window[:kept], new_window[:kept])
        slots = (list(range(sinks)) if self.cfg.recache_sinks else []) + new_window[kept:]
        blocks = [_block(cache.frame_ids[s], state.start_frames, nf) for s in slots]
        for _, group in itertools.groupby(zip(blocks, slots), key=lambda b_s: b_s[0]):
            part = [slot for _, slot in group]  # one chunk's frames, in consecutive slots
            x = state.clean[_rows(part, self.device)].transpose(0, 1)[None]  # [1, C, F, h, w]
            t = torch.zeros(1, len(part), device=self.device)
            # slots are in time order from 0: the chunk reads every slot before its own (recomputed or kept)
            self.forward(x, t, state.text, [CacheAccess(cache, part[0], write_slots=part, lora=self.lora_use(state))])

    def _move_kv(self, cache: StreamCache, src: Sequence[int], dst: Sequence[int]) -> None:
        """Move the K/V of slots `src` to slots `dst` (in time order), every layer, through the cache's own
        read and write, in the storage the cache has now (the workspace if it is attached there): exact for
        dense storage; int4 / int2 storage quantizes again what it dequantized."""
        if list(src) == list(dst):
            return
        index = torch.tensor(list(src)).to(self.device, non_blocking=True)
        for layer in range(cache.spec.num_layers):
            k, v = cache.read(layer, max(src) + 1)  # a view or a scratch buffer: copied out before the write
            cache.write(layer, dst, k.index_select(0, index), v.index_select(0, index))
        if self.workspace is not None:
            self.workspace.written(cache, dst)  # copied home when another stream takes the workspace

    def start_chunk(self, state: StreamState) -> None:
        """Start `state`'s next chunk without a denoising step: its pending prompt applied (recached where the
        cache holds frames), its starting noise drawn and, with input video, the input noised to the strength's
        step, where the chunk then starts. `denoise` calls it at a chunk's step 0; the training rollout calls it
        for a chunk's starting point without a step."""
        if state.pending_prompt is not None:
            if self._needs_recache(state):
                self.recache(state)
            else:
                self._apply_prompt(state)
        mc = self.model_cfg
        shape = (mc.in_channels, self.cfg.frames_per_chunk, mc.latent_height, mc.latent_width)
        state.x = torch.randn(shape, generator=state.noise, device=self.device)
        state.chunk_version = state.prompt_version
        state.start = 0
        if state.input_latents is not None:  # SDEdit: the input noised to the strength's step, which it starts at
            k = self.start_step(state.strength)
            sigma = self.sigmas[k]
            state.x = ((1 - sigma) * state.input_latents.double() + sigma * state.x.double()).float()
            state.start = state.step = k
            state.steps = max(state.steps, k + 1)

    @torch.inference_mode()
    def denoise(self, states: Sequence[StreamState]) -> None:
        """One denoising step for each stream (each at its own step)."""
        for s in states:
            if s.step >= s.steps:
                raise ValueError(f"stream {s.stream_id}: chunk is denoised, commit it first")
            if s.step == 0:
                self.start_chunk(s)
        nf = self.cfg.frames_per_chunk
        x = torch.stack([s.x for s in states])  # [B, C, F, h, w]
        sig = torch.stack([self._sigmas[s.step] for s in states])  # [B] float64, no copy from the host
        t = (sig * 1000).float()[:, None].expand(-1, nf)
        # commit reuse: a chunk's last step writes its K/V where the commit would (after attention reads)
        writes = [s.cache.plan_commit(nf) if self.cfg.commit_reuse and s.step + 1 == s.steps else None for s in states]
        access = [CacheAccess(s.cache, s.cache.num_frames, write_slots=w, lora=self.lora_use(s)) for s, w in zip(states, writes)]
        v = self.forward(x, t, batch_text([s.text for s in states]), access)
        x0 = (x.double() - sig.view(-1, 1, 1, 1, 1) * v.double()).float()
        for j, s in enumerate(states):
            s.reused_slots = writes[j]
            s.forwards[WorkKind.DENOISE.value] += 1
            s.x0 = x0[j]
            s.step += 1
            if s.step < s.steps:  # re-noise to the next level with fresh noise
                nxt = self.sigmas[s.step]
                eps = torch.randn(x0[j].shape, generator=s.noise, device=self.device)
                s.x = ((1 - nxt) * x0[j].double() + nxt * eps.double()).float()

    @torch.inference_mode()
    def commit(self, states: Sequence[StreamState]) -> list[Chunk]:
        """Write each denoised chunk's K/V into its cache (a forward at timestep 0), then decode it. A chunk
        whose last step already wrote them (commit reuse) runs no forward: its frames only advance the ring."""
        for s in states:
            if s.step == 0 or s.step != s.steps:
                raise ValueError(f"stream {s.stream_id}: commit at step {s.step} of {s.steps}, the chunk is not denoised")
        nf = self.cfg.frames_per_chunk
        x0 = torch.stack([s.x0 for s in states])
        slots = [s.reused_slots or s.cache.plan_commit(nf) for s in states]
        run = [j for j, s in enumerate(states) if s.reused_slots is None]  # chunks cut short before their last step
        if run:
            access = [CacheAccess(states[j].cache, states[j].cache.num_frames, write_slots=slots[j], lora=self.lora_use(states[j]))
                      for j in run]
            t = torch.zeros(len(run), nf, device=self.device)
            self.forward(x0[run] if len(run) < len(states) else x0, t, batch_text([states[j].text for j in run]), access)
        chunks = []
        for j, s in enumerate(states):
            s.cache.advance(slots[j])
            s.clean[_rows(slots[j], self.device)] = x0[j].transpose(0, 1)
            s.forwards[WorkKind.COMMIT.value] += s.reused_slots is None
            s.reused_slots = None
            frames = self.decoder.decode(x0[j], s.decoder)
            chunks.append(Chunk(s.chunks_done, s.frames_done, frames, x0[j], s.chunk_version, s.steps, s.input, s.start))
            s.chunks_done += 1
            s.frames_done += frames.shape[0]
            s.step, s.steps, s.x, s.x0, s.start = 0, len(self.sigmas), None, None, 0
            s.input, s.input_latents = "none", None
        return chunks

    @torch.inference_mode()
    def capture_graphs(self) -> int:
        """Capture every CUDA graph that serving replays, before serving (models/graphs.py `capture_serving`; load
        the styles first). Returns the number of graphs captured (0 off CUDA)."""
        return capture_serving(self) if isinstance(self.runner, GraphedForward) else 0

    # -- offline ------------------------------------------------------------------------------

    def stream(self, state: StreamState, prompt_at: dict[int, str] | None = None) -> Iterator[Chunk]:
        """Chunks forever (the caller stops); `prompt_at` maps chunk index -> new prompt."""
        prompt_at = dict(prompt_at or {})
        while True:
            if state.step == 0 and state.chunks_done in prompt_at:
                self.set_prompt(state, prompt_at.pop(state.chunks_done))
            work = self.next_work(state)
            out = self.run(work, [state])
            if out[0] is not None:
                yield out[0]

    # -- internals ----------------------------------------------------------------------------

    def _needs_recache(self, state: StreamState) -> bool:
        return state.cache.num_frames > 0

    def _apply_prompt(self, state: StreamState) -> None:
        if state.pending_lora is not None:
            (state.lora, state.lora_scale), state.pending_lora = state.pending_lora, None
        state.prompt, state.pending_prompt = state.pending_prompt, None
        state.text = self.encode_prompt(state.prompt, self.lora_use(state))
        state.prompt_version = state.prompt_version + 1 if state.pending_version is None else state.pending_version
        state.pending_version = None


def _block(frame_id: int, start_frames: int, frames_per_chunk: int) -> int:
    """The block of a stream's latent frame `frame_id`: its chunk's, counted from the frames after the stream's
    `start_frames` (a start image's frame, block -1); the frames of a block see each other."""
    return (frame_id - start_frames) // frames_per_chunk


def _older_frames(blocks: Sequence[int], newest_chunks: int) -> int:
    """How many of the window's frames (`blocks`: each one's block, in time order) are older than its newest
    `newest_chunks` chunks (0 for 0: every chunk is recomputed)."""
    if not newest_chunks or not blocks:
        return 0
    first = sorted(set(blocks))[-newest_chunks:][0]
    return sum(b < first for b in blocks)


def _rows(slots: Sequence[int], device: torch.device) -> slice | torch.Tensor:
    """An index of `slots` along a tensor's first dimension that never waits for the device: a slice
    when they are consecutive, else an index tensor sent without a synchronize."""
    slots = list(slots)
    if slots == list(range(slots[0], slots[0] + len(slots))):
        return slice(slots[0], slots[0] + len(slots))
    return torch.tensor(slots).to(device, non_blocking=True)
