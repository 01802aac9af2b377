// streamsvc player: the camera as the stream's input (issue 35), its picker, its preview and the strength slider.
//
// player.js owns the peer connection; this file owns the camera. The page's video transceiver is always sendrecv,
// so turning the camera on or off is transceiver.sender.replaceTrack(track | null): no renegotiation (the server
// refuses those). A stream takes the camera only if its start asked for it ({"input": true, "strength": s}):
// startFields() adds those while the camera is on; a camera turned on during a stream without input starts a new
// stream with it (restartWithInput). Turning it off mid-stream leaves the stream running as text-to-video (its
// chunk headers say input "missing") until it comes back on.
//
// Browsers give the camera only to a secure context: the page over HTTPS, or at http://localhost (127.0.0.1 too).
// Elsewhere navigator.mediaDevices is missing, and the page says so instead of offering the button.
//
// Strength: 1 draws from noise (the camera is ignored), lower keeps more of the camera's picture. The server snaps
// it to the model's schedule (ready.strengths); the slider steers it live (set_strength, acked with the snapped
// value, applied from the next chunk).
"use strict";

window.streamsvcCamera = ({ sender, send, canSteer, restartWithInput, player }) => {
  const $ = (id) => document.getElementById(id);
  const button = $("camera"), picker = $("camera-select"), preview = $("preview"), status = $("camera-status");
  const slider = $("strength"), shown = $("strength-value"), ticks = $("strength-ticks");
  const media = navigator.mediaDevices;
  const available = !!(media && media.getUserMedia);
  let stream = null;       // the camera's MediaStream while on
  let strength = null;     // the strength asked (slider or ?strength=); null: the server's default
  Object.assign(player, { cameraOn: false, camera: null, cameraError: null });

  function say(text) { status.textContent = text || ""; status.hidden = !text; }

  function render() {
    button.textContent = player.cameraOn ? "Camera off" : "Camera on";
    button.disabled = !available || player.role === "watch";
    picker.disabled = !available || picker.options.length === 0;
    preview.hidden = !player.cameraOn;
    $("strength-box").hidden = !(player.cameraOn || player.input);
    const value = player.input && player.strength !== null ? player.strength : strength;
    if (value !== null && document.activeElement !== slider) slider.value = String(value);
    shown.textContent = value === null ? "server default" : Number(value).toFixed(3);
  }

  async function listCameras() {
    if (!available || !media.enumerateDevices) return;
    const chosen = picker.value;
    const cameras = (await media.enumerateDevices()).filter((d) => d.kind === "videoinput");
    picker.replaceChildren(...cameras.map((d, i) => new Option(d.label || `camera ${i + 1}`, d.deviceId)));
    if (cameras.some((d) => d.deviceId === chosen)) picker.value = chosen;
    render();
  }

  async function turnOn() {
    if (!available) throw new Error("no camera in this context");
    const id = picker.value;
    let next;
    try {
      next = await media.getUserMedia({
        audio: false,  // the server drops camera audio; never ask for the microphone
        video: { ...(id ? { deviceId: { exact: id } } : {}), width: { ideal: 640 }, height: { ideal: 480 },
                 frameRate: { ideal: 30, max: 30 } },
      });
    } catch (e) {
      player.cameraError = `${e.name}: ${e.message}`;
      say(`The camera could not be opened (${e.name}${e.message ? ": " + e.message : ""}).`);
      render();
      throw e;
    }
    const old = stream;
    stream = next;
    const track = stream.getVideoTracks()[0];
    track.addEventListener("ended", () => { if (stream === next) turnOff("The camera stopped (unplugged?)."); });
    preview.srcObject = stream;
    preview.play().catch(() => {});
    player.cameraOn = true;
    player.camera = track.label;
    player.cameraError = null;
    if (old) old.getTracks().forEach((t) => t.stop());
    await listCameras();  // labels come with the permission
    const s = sender();
    if (s && player.input) {
      await s.replaceTrack(track);  // no renegotiation: the transceiver is sendrecv from the start
      say("");
    } else if (canSteer()) {
      say("This stream was started without input: starting a new one with your camera.");
      restartWithInput();
    } else {
      say("");
    }
    render();
  }

  function turnOff(why) {
    const s = sender();
    if (s) s.replaceTrack(null).catch(() => {});
    if (stream) stream.getTracks().forEach((t) => t.stop());
    stream = null;
    preview.srcObject = null;
    player.cameraOn = false;
    player.camera = null;
    say(why || (player.input ? "Camera off: the stream goes on from the prompt alone until it is back on." : ""));
    render();
  }

  function setStrength(value) {
    if (!(value >= 0 && value <= 1)) return;
    strength = value;
    if (player.input && canSteer()) send({ type: "set_strength", strength: value });
    render();
  }

  button.addEventListener("click", () => {
    if (player.cameraOn) turnOff();
    else turnOn().catch(() => {});
  });
  picker.addEventListener("change", () => { if (player.cameraOn) turnOn().catch(() => {}); });
  slider.addEventListener("input", () => { shown.textContent = Number(slider.value).toFixed(3); });
  slider.addEventListener("change", () => setStrength(Number(slider.value)));
  if (available && media.addEventListener) media.addEventListener("devicechange", () => listCameras());

  if (!available) {
    say(`No camera here: browsers give the camera only to a secure context, this page over HTTPS or at ` +
        `http://localhost:${location.port || 80}/ (it is at ${location.origin}).`);
  }
  listCameras().catch(() => {});
  render();

  return {
    turnOn,
    turnOff,
    setStrength,
    // what a start adds: input while the camera is on, with the strength asked (else the server's default)
    startFields: () => (player.cameraOn ? { input: true, ...(strength !== null ? { strength } : {}) } : {}),
    // before the offer: a camera already on sends from the first packet
    attach: async (s) => { if (stream && player.cameraOn) await s.replaceTrack(stream.getVideoTracks()[0]); },
    // the viewer's role changed (audience): a watcher's camera is not the stream's input, so it goes off
    roleChanged: () => {
      if (player.role === "watch" && player.cameraOn) turnOff("You no longer steer this stream: your camera is off.");
      render();
    },
    // ready or an ack changed the stream's input or strength
    streamReady: () => {
      if (ticks && player.strengths) ticks.replaceChildren(...player.strengths.map((v) => new Option("", v)));
      render();
    },
  };
};
