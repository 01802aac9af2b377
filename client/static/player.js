// streamsvc browser player: WebRTC video, signaling and control on the service's own endpoints.
//
// 1. WebSocket to /ws: {"type": "start", "prompt": ..., "transport": "webrtc"} -> "ready"
//    (or an "error" with code "refused", "unauthorized" or "too_many_streams": the page says why).
//    A server with access tokens needs one: the page takes it from its address's fragment,
//    /#token=..., which the browser never sends to any server (nor in a Referer).
// 2. RTCPeerConnection (no STUN/TURN), a recvonly H.264 video transceiver and a data channel
//    named "control"; the offer goes on the WebSocket once ICE gathering is complete, the
//    server's "answer" comes back there.
// 3. The data channel carries the same JSON messages as the WebSocket: "chunk" headers (stream
//    frame index -> prompt version), "ack", "error", "closed"; the page sends "set_prompt" on it.
// 4. requestVideoFrameCallback gives each frame's RTP timestamp; frame index = first chunk's pts
//    + (rtp - first rtp) * fps / 90000, and the chunk headers give its prompt version. getStats()
//    gives freezeCount / totalFreezesDuration.
//
// 5. Watching: the page at /#watch=ID&secret=W (the watch link: the stream's id and watch secret, which
//    the steerer's "ready" carries; an id alone is refused) sends {"type": "watch", "stream_id": ID,
//    "secret": W} instead of start and plays the same stream (from a keyframe); its prompt box is off
//    unless it takes the steer token ("take" with the steer secret, when the steerer left: the steer link
//    /#watch=ID&secret=W&steer=S, shown to the steerer alone, carries it). "audience" messages give the
//    role and the watcher count; the watch link of the stream is shown either way. The steer secret follows
//    the token: the audience that hands it to this page carries the stream's new one (the steer link shows
//    it), and a handover away revokes the one this page had. "record" (steerer) answers "recording" with
//    the MP4's address.
//
// 6. What the model understands: "ready" carries the model's vocabulary (the built-in model knows only its
//    caption words and draws noise for others; null for a model that reads any text) and the unknown words
//    of the stream's prompt, a set_prompt's "ack" those of the new prompt; shown under the prompt box.
//
// 7. The camera as input (issue 35): the video transceiver is always sendrecv (the server refuses renegotiation), so
//    turning the camera on is transceiver.sender.replaceTrack(track) (camera.js: picker, preview, strength). A stream
//    takes input only if its start asked for it ({"input": true, "strength": s}): a camera turned on before Start
//    does; turned on during a stream without input, the page starts a new one with it. The server answers the video
//    m-line sendrecv only then. "strength" steers live (set_strength, acked with the value snapped to the model's
//    schedule). Each chunk header's capture_ms (the input frame's capture time, this browser's clock as its RTCP
//    sender reports carry it) gives the frame on screen its glass-to-glass latency.
//
// 8. A start image and a style (options.js): the file picked goes in the start (inline, or uploaded first to
//    /images), and the stream's first frame is that image; the style picker lists ready's "loras" and switches the
//    stream's style live (set_lora).
//
// window.player holds the page's state (read by the end-to-end test).
"use strict";

(() => {
  const RTP_CLOCK_HZ = 90000;
  const H264_PROFILE = "42e01f";  // constrained baseline, what the server's encoder makes
  const START_REFUSALS = ["refused", "unauthorized", "too_many_streams", "not_found", "bad_image"];  // protocol's
  // protocol.RETRYABLE: a cluster's worker running the stream was lost; a new start is placed on another one
  const RETRYABLE = ["worker_lost"];
  const MAX_RECONNECTS = 3;  // in a row, without a chunk in between
  const GATHER_TIMEOUT_MS = 5000;
  const ANSWER_TIMEOUT_MS = 15000;
  const MAX_HEADERS = 256;
  const GLASS_KEPT = 256;

  const $ = (id) => document.getElementById(id);
  const video = $("video");
  const input = $("prompt");
  const button = $("send");

  const player = window.player = {
    phase: "idle",          // idle, connecting, negotiating, playing, closed, refused, failed
    streamId: null,
    fps: null,
    ttffMs: null,           // start pressed -> first frame on screen
    presentedFps: 0,        // frames on screen over the last second
    framesPresented: 0,
    framesDecoded: 0,       // getStats inbound-rtp
    freezeCount: 0,         // getStats inbound-rtp (W3C)
    totalFreezesDuration: 0,
    versionOnScreen: null,  // prompt version of the frame on screen
    promptVersion: 0,       // newest version acknowledged by the server
    steerLatenciesMs: [],   // set_prompt sent -> first frame under it on screen
    chunks: 0,
    acks: [],
    errors: [],
    message: null,          // the banner's text, if any
    closedReason: null,
    role: null,             // "steer" or "watch" (ready, then audience)
    viewerId: null,
    watchers: 0,            // viewers watching the stream, the steerer not counted
    steered: true,          // false: the steerer left and the token is free to take
    hostPaused: false,      // a watcher's: the steerer paused the stream (audience)
    recording: null,        // the recording's MP4 address, once one runs
    vocabulary: null,       // the words the model knows (ready); null: it reads any text
    unknownWords: [],       // words of the latest prompt outside the vocabulary (ready, then set_prompt's ack)
    input: false,           // the stream takes this page's camera (ready.input)
    strengths: null,        // the strengths the model allows (ready), the schedule's sigmas
    strength: null,         // the stream's strength, snapped (ready, then set_strength's ack)
    inputOnScreen: null,    // the frame on screen's input: "none", "frames", "missing" (its chunk header)
    glassToGlassMs: null,   // the frame on screen: its input frame's capture -> shown, in this browser's clock
    glassToGlass: [],       // the last GLASS_KEPT of those
  };

  let ws = null, pc = null, channel = null, videoTransceiver = null;
  // the stream's capabilities: its watch secret (the steerer's ready, or this watch link's) and its steer secret
  // (the steerer's ready, or a steer link's); kept out of window.player, and never sent but to the server
  let watchSecret = null, steerSecret = null;
  let headers = [];            // chunk headers, oldest first
  let rtp0 = null, pts0 = null;
  let startedAt = 0;
  let presentTimes = [];
  let pendingSteers = [];      // {sentAt, version|null}
  let ended = false;
  let reconnects = 0;  // reconnections after a retryable error since the last chunk played
  let statsTimer = null, answerTimer = null;
  let options = null;  // the start image and the style (options.js), set once the page is wired

  // ------------------------------------------------------------ UI

  function setPhase(phase) {
    player.phase = phase;
    const el = $("phase");
    el.textContent = phase;
    el.className = "phase " + phase;
    button.textContent = phase === "playing" || phase === "negotiating" || phase === "connecting" ? "Steer" : "Start";
  }

  function banner(text, kind = "error", reconnect = false) {
    player.message = text;
    const el = $("banner");
    el.hidden = !text;
    el.className = "banner " + (kind === "info" ? "info" : "");
    $("banner-text").textContent = text || "";
    $("reconnect").hidden = !reconnect;
  }

  function fmt(x, digits, unit) { return x === null || x === undefined ? "-" : x.toFixed(digits) + unit; }

  function renderAudience() {
    $("audience").hidden = player.streamId === null;
    if (player.streamId === null) return;
    $("role").textContent = player.role === "watch" ? "watching" : "steering";
    $("watchers").textContent = `${player.watchers} watching` + (player.role === "watch" && player.hostPaused
      ? ", paused by its steerer" : "");
    const link = `${location.origin}${location.pathname}#watch=${encodeURIComponent(player.streamId)}`
      + (watchSecret ? `&secret=${encodeURIComponent(watchSecret)}` : "");
    $("watch-link").href = link;
    $("watch-link").textContent = link;
    $("steer-link-box").hidden = !steerSecret;  // who holds it may take the stream once its steerer leaves
    $("steer-link").href = steerSecret ? `${link}&steer=${encodeURIComponent(steerSecret)}` : "#";
    $("take").hidden = player.role !== "watch" || player.steered || !steerSecret;
    $("record").hidden = player.role !== "steer" || player.recording !== null;
    $("recording").hidden = player.recording === null;
    if (player.recording !== null) $("recording").href = player.recording;
    input.disabled = player.role === "watch";
    button.disabled = player.role === "watch";
    if (options) options.render();
  }

  // "this model knows 57 words" (the list one click away) and, when the prompt has some, its unknown words
  function renderVocabulary() {
    const words = player.vocabulary;
    $("vocabulary").hidden = words === null;
    $("unknown-words").hidden = words === null || player.unknownWords.length === 0;
    if (words === null) return;
    const shown = words.filter((w) => /\w/.test(w));  // punctuation the captions use is no word to show
    $("vocabulary-summary").textContent = `this model knows ${shown.length} words; others draw noise`;
    $("vocabulary-words").textContent = shown.join(", ");
    $("unknown-words").textContent = `unknown to this model: ${player.unknownWords.join(", ")}`;
    if (player.unknownWords.length) $("vocabulary").open = true;  // what to use instead (never closed for the user)
  }

  function renderOverlay() {
    $("o-ttff").textContent = fmt(player.ttffMs === null ? null : player.ttffMs / 1000, 2, " s");
    $("o-fps").textContent = player.framesPresented ? player.presentedFps.toFixed(1) : "-";
    $("o-version").textContent = player.versionOnScreen === null ? "-" : "v" + player.versionOnScreen;
    $("o-freezes").textContent = `${player.freezeCount} (${player.totalFreezesDuration.toFixed(2)} s)`;
    const g2g = player.glassToGlass.slice(-16).sort((a, b) => a - b);
    $("o-g2g").textContent = g2g.length ? (g2g[g2g.length >> 1] / 1000).toFixed(2) + " s" : "-";
    $("o-input").textContent = player.input ? `${player.inputOnScreen || "-"}, strength ${fmt(player.strength, 3, "")}`
      : "none";
    const lat = player.steerLatenciesMs;
    $("o-steer").textContent = lat.length ? (lat[lat.length - 1] / 1000).toFixed(2) + " s" : "-";
    $("o-frames").textContent = `${player.framesPresented} shown, ${player.framesDecoded} decoded`;
  }

  // ------------------------------------------------------------ session

  function wsUrl() {
    return (location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/ws";
  }

  function reset() {
    ended = false;
    headers = []; rtp0 = null; pts0 = null; presentTimes = []; pendingSteers = [];
    Object.assign(player, {
      streamId: null, fps: null, ttffMs: null, presentedFps: 0, framesPresented: 0, framesDecoded: 0,
      freezeCount: 0, totalFreezesDuration: 0, versionOnScreen: null, promptVersion: 0,
      steerLatenciesMs: [], chunks: 0, acks: [], errors: [], closedReason: null,
      role: null, viewerId: null, watchers: 0, steered: true, hostPaused: false, recording: null, vocabulary: null, unknownWords: [],
      input: false, strengths: null, strength: null, inputOnScreen: null, glassToGlassMs: null, glassToGlass: [],
      imageStarted: false,
    });
    renderVocabulary();
    banner(null);
  }

  function start(prompt) {
    watchSecret = steerSecret = null;  // the new stream's come with its ready
    const pressed = performance.now(), withCamera = camera.startFields();
    setPhase("connecting");  // (an upload of its image may come first: TTFF counts from here)
    options.startFields(!!withCamera.input).then((fields) => {
      connect({ type: "start", prompt, ...withCamera, ...fields });
      startedAt = pressed;
    }, (e) => {
      setPhase("refused");
      banner(`The stream was not started: ${e.message}`, "error", true);
    });
  }

  // the stream the page's watch link names, with its watch secret (and a steer link's steer secret, for "take")
  function watch(streamId) {
    const args = new URLSearchParams(location.hash.slice(1));
    watchSecret = args.get("secret");
    steerSecret = args.get("steer");
    connect({ type: "watch", stream_id: streamId, ...(watchSecret ? { secret: watchSecret } : {}) });
  }

  function connect(first) {
    teardown();
    reset();
    startedAt = performance.now();
    setPhase("connecting");
    ws = new WebSocket(wsUrl());
    const token = new URLSearchParams(location.hash.slice(1)).get("token");
    ws.onopen = () => ws.send(JSON.stringify({ ...first, transport: "webrtc", ...(token ? { token } : {}) }));
    ws.onmessage = (e) => onMessage(e.data);
    ws.onerror = () => {};  // onclose follows with the code
    ws.onclose = (e) => {
      if (!ended) fail(`Lost the connection to the server (WebSocket closed, code ${e.code}${e.reason ? ": " + e.reason : ""}).`);
    };
  }

  async function negotiate() {
    setPhase("negotiating");
    pc = new RTCPeerConnection({ iceServers: [] });
    channel = pc.createDataChannel("control");
    channel.onmessage = (e) => onMessage(e.data);
    // sendrecv always: the camera goes on later with replaceTrack, never a renegotiation (the server refuses those)
    const transceiver = videoTransceiver = pc.addTransceiver("video", { direction: "sendrecv" });
    const codecs = RTCRtpReceiver.getCapabilities("video").codecs;
    const h264 = codecs.filter((c) => c.mimeType.toLowerCase() === "video/h264"
      && /packetization-mode=1/.test(c.sdpFmtpLine || "") && (c.sdpFmtpLine || "").includes("profile-level-id=" + H264_PROFILE));
    if (!h264.length) {
      fail("This browser cannot receive H.264 (constrained baseline) over WebRTC, the only codec the server sends.");
      return;
    }
    transceiver.setCodecPreferences([...h264, ...codecs.filter((c) => c.mimeType.toLowerCase() === "video/rtx")]);
    pc.ontrack = (e) => {
      video.srcObject = new MediaStream([e.track]);
      video.play().catch((err) => banner(`The browser would not start playback: ${err.message}`, "info"));
    };
    pc.onconnectionstatechange = () => {
      if (!pc || ended) return;
      const s = pc.connectionState;
      if (s === "failed") fail("The video connection failed (ICE/DTLS): no network path to the server.");
      else if (s === "disconnected") banner("The video connection is interrupted; waiting for it to come back...", "info");
      else if (s === "connected" && player.message && player.message.startsWith("The video connection is interrupted")) banner(null);
    };
    await camera.attach(transceiver.sender);  // a camera already on sends from the start
    await pc.setLocalDescription(await pc.createOffer());
    await gatheringComplete(pc, GATHER_TIMEOUT_MS);
    if (ended) return;
    ws.send(JSON.stringify({ type: "offer", sdp: pc.localDescription.sdp }));
    answerTimer = setTimeout(() => { if (player.phase === "negotiating") fail("The server did not answer the WebRTC offer in time."); }, ANSWER_TIMEOUT_MS);
    video.requestVideoFrameCallback(onVideoFrame);
    statsTimer = setInterval(pollStats, 1000);
  }

  function gatheringComplete(peer, timeoutMs) {
    if (peer.iceGatheringState === "complete") return Promise.resolve();
    return new Promise((resolve) => {
      const timer = setTimeout(done, timeoutMs);  // send what was gathered by then
      function done() { clearTimeout(timer); peer.removeEventListener("icegatheringstatechange", check); resolve(); }
      function check() { if (peer.iceGatheringState === "complete") done(); }
      peer.addEventListener("icegatheringstatechange", check);
    });
  }

  function send(msg) {
    const text = JSON.stringify(msg);
    if (channel && channel.readyState === "open") channel.send(text);
    else if (ws && ws.readyState === WebSocket.OPEN) ws.send(text);
    else return false;
    return true;
  }

  function steer(prompt) {
    if (!send({ type: "set_prompt", prompt })) return;
    pendingSteers.push({ sentAt: performance.now(), version: null });
    $("prompt-status").textContent = `Sent: "${prompt}"; waiting for the server...`;
  }

  function onMessage(raw) {
    let msg;
    try { msg = JSON.parse(raw); } catch (e) { player.errors.push("bad JSON from the server"); return; }
    switch (msg.type) {
      case "ready":
        player.streamId = msg.stream_id;
        player.fps = msg.fps;
        player.role = msg.role || "steer";
        player.viewerId = msg.viewer_id || null;
        if (msg.watch_secret) watchSecret = msg.watch_secret;  // a steerer's: its stream's links
        if (msg.steer_secret) steerSecret = msg.steer_secret;
        player.vocabulary = Array.isArray(msg.vocabulary) ? msg.vocabulary : null;
        player.unknownWords = msg.unknown_words || [];
        player.input = !!msg.input;
        player.strengths = msg.strengths || null;
        player.strength = msg.strength === undefined ? null : msg.strength;
        camera.streamReady();
        options.ready(msg);
        renderAudience();
        renderVocabulary();
        document.querySelector(".stage").style.aspectRatio = `${msg.width} / ${msg.height}`;
        negotiate().catch((e) => fail(`WebRTC setup failed: ${e.message}`));
        break;
      case "answer":
        clearTimeout(answerTimer);
        pc.setRemoteDescription({ type: "answer", sdp: msg.sdp })
          .then(() => setPhase("playing"))
          .catch((e) => fail(`The server's answer could not be applied: ${e.message}`));
        break;
      case "chunk":
        headers.push(msg);
        if (headers.length > MAX_HEADERS) headers.splice(0, headers.length - MAX_HEADERS);
        if (pts0 === null) pts0 = msg.pts;
        player.chunks += 1;
        reconnects = 0;
        break;
      case "audience":
        // the steer secret follows the token: the audience that gives it here carries the stream's new one, and the
        // one this page had is revoked once the token goes on (a handover)
        if (msg.steer_secret) steerSecret = msg.steer_secret;
        else if (player.role === "steer" && msg.role === "watch") steerSecret = null;
        player.role = msg.role;
        player.watchers = msg.watchers;
        player.steered = msg.steered;
        player.hostPaused = msg.paused === true;  // the steerer paused the stream: shown, not a stall
        renderAudience();
        camera.roleChanged();  // the input is the steerer's: handed over, the camera goes off
        break;
      case "recording": {
        // the recording page plays the MP4 with its chapters (it is complete once the stream has ended); the file
        // name, ID-SECRET, is the recording's link: it goes in the page's fragment, and the page asks for its files
        const id = msg.url.split("/").pop().replace(/\.mp4$/, "");
        const token = new URLSearchParams(location.hash.slice(1)).get("token");
        player.recording = `/recording.html#id=${encodeURIComponent(id)}${token ? "&token=" + encodeURIComponent(token) : ""}`;
        renderAudience();
        break;
      }
      case "ack":
        player.acks.push(msg);
        if (msg.request === "set_prompt") {
          const steer = pendingSteers.find((s) => s.version === null);
          if (steer) steer.version = msg.prompt_version;
          player.promptVersion = msg.prompt_version;
          player.unknownWords = msg.unknown_words || [];
          renderVocabulary();
          $("prompt-status").textContent = `Prompt v${msg.prompt_version} accepted; it shows up within a chunk or two.`;
        } else if (msg.request === "set_lora") {
          player.promptVersion = msg.prompt_version;
          options.acked(msg);
        } else if (msg.request === "set_strength" && msg.strength !== undefined && msg.strength !== null) {
          player.strength = msg.strength;
          camera.streamReady();
        }
        break;
      case "error":
        player.errors.push(`${msg.code}: ${msg.message}`);
        if (msg.request === "set_prompt") {  // this prompt got an error instead of an ack: it has no version
          const steer = pendingSteers.findIndex((s) => s.version === null);
          if (steer >= 0) pendingSteers.splice(steer, 1);
        }
        if (START_REFUSALS.includes(msg.code)) {
          ended = true;
          setPhase("refused");
          banner(`The server refused the stream: ${msg.message}`, "error", true);
          teardown();
        } else if (RETRYABLE.includes(msg.code) && reconnects < MAX_RECONNECTS) {
          ended = true;  // this stream is gone: start a new one (placed again), under the prompt in the box
          reconnects += 1;
          player.reconnects = (player.reconnects || 0) + 1;
          teardown();
          setTimeout(() => {
            start(input.value.trim() || "a red ball moving right");
            banner(`The worker running the stream was lost; a new stream started (reconnect ${reconnects}).`, "info");
          }, 250);
        } else {
          banner(`Server error (${msg.code}): ${msg.message}`, "info");
        }
        break;
      case "closed":
        if (ended) break;
        ended = true;
        player.closedReason = msg.reason;
        setPhase("closed");
        banner(`The stream ended: ${msg.reason}.`, "info", true);
        teardown();
        break;
    }
  }

  function fail(text) {
    if (ended) return;
    ended = true;
    setPhase("failed");
    banner(text, "error", true);
    teardown();
  }

  function teardown() {
    clearInterval(statsTimer); statsTimer = null;
    clearTimeout(answerTimer);
    if (channel) { channel.onmessage = null; try { channel.close(); } catch (e) {} }
    if (pc) { pc.onconnectionstatechange = null; pc.close(); }
    if (ws) {
      ws.onclose = null; ws.onmessage = null;
      ws.close();  // the server closes the stream and frees it
    }
    channel = null; pc = null; ws = null; videoTransceiver = null;
  }

  // ------------------------------------------------------------ frames and stats

  function headerOf(index) {
    for (let i = headers.length - 1; i >= 0; i--) {
      const h = headers[i];
      if (h.pts <= index && index < h.pts + h.frames) return h;
      if (h.pts + h.frames <= index) return null;
    }
    return null;
  }

  function versionOf(index) {
    const h = headerOf(index);
    return h === null ? null : h.prompt_version;
  }

  // the frame on screen's input and glass-to-glass latency: its input frame's capture time (the header's capture_ms,
  // this browser's clock) to the time it is shown (epoch ms); null without input
  function glassToGlass(index, shownAt) {
    const h = headerOf(index);
    if (h === null) return null;
    player.inputOnScreen = h.input || "none";
    const capture = Array.isArray(h.capture_ms) ? h.capture_ms[index - h.pts] : null;
    if (capture === null || capture === undefined || h.input !== "frames") return null;
    return performance.timeOrigin + shownAt - capture;
  }

  function onVideoFrame(now, meta) {
    if (!pc) return;
    const t = performance.now();
    player.framesPresented += 1;
    if (player.ttffMs === null) player.ttffMs = t - startedAt;
    presentTimes.push(t);
    while (presentTimes.length && presentTimes[0] <= t - 1000) presentTimes.shift();
    player.presentedFps = presentTimes.length;
    if (meta.rtpTimestamp !== undefined && player.fps && pts0 !== null) {
      if (rtp0 === null) rtp0 = meta.rtpTimestamp;
      const index = pts0 + Math.round(((meta.rtpTimestamp - rtp0) >>> 0) * player.fps / RTP_CLOCK_HZ);
      const version = versionOf(index);
      const g2g = glassToGlass(index, meta.expectedDisplayTime || now);
      if (g2g !== null) {
        player.glassToGlassMs = g2g;
        player.glassToGlass.push(g2g);
        if (player.glassToGlass.length > GLASS_KEPT) player.glassToGlass.shift();
      }
      grabbed(index, g2g);
      if (version !== null) {
        player.versionOnScreen = version;
        pendingSteers = pendingSteers.filter((s) => {
          if (s.version === null || version < s.version) return true;
          player.steerLatenciesMs.push(t - s.sentAt);
          return false;
        });
      }
    }
    video.requestVideoFrameCallback(onVideoFrame);
  }

  // player.grab(n): the next n frames shown, drawn into a canvas as they are presented: [{index, captureMs, width,
  // height, rgb (base64, row-major RGB)}] (the end-to-end test reads them with client/pixels.py)
  const grabCanvas = document.createElement("canvas");
  let grabbing = null;
  player.grab = (n) => new Promise((resolve) => { grabbing = { left: n, frames: [], resolve }; });

  function grabbed(index, g2g) {
    if (grabbing === null || !video.videoWidth) return;
    const w = grabCanvas.width = video.videoWidth, h = grabCanvas.height = video.videoHeight;
    const ctx = grabCanvas.getContext("2d", { willReadFrequently: true });
    ctx.drawImage(video, 0, 0, w, h);
    const rgba = ctx.getImageData(0, 0, w, h).data;
    const rgb = new Uint8Array(w * h * 3);
    for (let i = 0, j = 0; i < rgba.length; i += 4, j += 3) { rgb[j] = rgba[i]; rgb[j + 1] = rgba[i + 1]; rgb[j + 2] = rgba[i + 2]; }
    let text = "";
    for (let i = 0; i < rgb.length; i += 0x8000) text += String.fromCharCode.apply(null, rgb.subarray(i, i + 0x8000));
    const hdr = headerOf(index);
    const captureMs = hdr && Array.isArray(hdr.capture_ms) ? hdr.capture_ms[index - hdr.pts] : null;
    grabbing.frames.push({ index, captureMs, input: hdr ? hdr.input || "none" : null, g2gMs: g2g, width: w, height: h,
      rgb: btoa(text) });
    if (--grabbing.left <= 0) { const done = grabbing; grabbing = null; done.resolve(done.frames); }
  }

  async function pollStats() {
    if (!pc) return;
    const report = await pc.getStats();
    report.forEach((s) => {
      if (s.type === "inbound-rtp" && s.kind === "video") {
        player.framesDecoded = s.framesDecoded || 0;
        player.freezeCount = s.freezeCount || 0;
        player.totalFreezesDuration = s.totalFreezesDuration || 0;
      }
    });
  }

  // ------------------------------------------------------------ wiring

  $("prompt-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const prompt = input.value.trim();
    if (!prompt) return;
    if (player.streamId !== null && !ended) steer(prompt);  // admitted: steer the stream
    else if (player.phase !== "connecting") start(prompt);
  });
  const watchTarget = () => new URLSearchParams(location.hash.slice(1)).get("watch");
  $("reconnect").addEventListener("click", () => {
    if (watchTarget()) watch(watchTarget());
    else start(input.value.trim() || "a red ball moving right");
  });
  window.addEventListener("hashchange", () => { if (watchTarget()) watch(watchTarget()); });
  $("take").addEventListener("click", () => send({ type: "take", ...(steerSecret ? { secret: steerSecret } : {}) }));
  $("record").addEventListener("click", () => send({ type: "record" }));
  // the camera (camera.js) asks: the stream's sender, a message to the server, a new stream with input
  const camera = window.streamsvcCamera({
    sender: () => (videoTransceiver ? videoTransceiver.sender : null),
    send,
    canSteer: () => player.streamId !== null && !ended && player.role === "steer",
    restartWithInput: () => start(input.value.trim() || "a red ball moving right"),
    player,
  });
  options = window.streamsvcOptions({
    send, canSteer: () => player.streamId !== null && !ended && player.role === "steer", player,
    token: () => new URLSearchParams(location.hash.slice(1)).get("token"),
  });
  window.addEventListener("pagehide", teardown);
  setInterval(renderOverlay, 250);
  renderOverlay();

  const params = new URLSearchParams(location.search);
  if (params.has("prompt")) input.value = params.get("prompt");
  if (params.has("strength")) camera.setStrength(Number(params.get("strength")));
  const begin = () => {
    if (watchTarget()) watch(watchTarget());
    else if (params.get("autostart") !== "0") start(input.value.trim());
  };
  if (params.get("camera") === "1" && !watchTarget()) camera.turnOn().then(begin, begin);  // ?camera=1: with input
  else begin();
})();
