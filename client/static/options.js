// streamsvc player: what a stream starts from and how it looks: a start image (a file picker) and a style (a picker of
// the styles the server offers).
//
// Start image (streamsvc/wire/image.py): the file picked (PNG, JPEG or WebP, at most 4 MiB) is the stream's first
// frame; generation goes on from it under the prompt. startFields() is what the next "start" adds: the image inline
// as a data: URL when the file is at most 45 KiB, else uploaded first (POST /images, the page's token as a Bearer
// header) and named by the id the server answers. A file too large or of another type is refused here, before
// anything is sent; the server refuses what it cannot use with "bad_image" and the reason, which the page shows. An
// image and the camera do not go together (the camera is the other way to give a stream its first frames): with the
// camera on, no image is sent.
//
// Style: the "ready" message lists the styles the server offers (loras, from serve --lora-dir) and the stream's own;
// the picker shows them. Changing it while the page steers a stream switches the stream's style live ("set_lora",
// acked with the prompt version its chunks carry); otherwise it is what the next start asks for.
"use strict";

window.streamsvcOptions = ({ send, canSteer, player, token }) => {
  const $ = (id) => document.getElementById(id);
  const file = $("start-image"), clear = $("start-image-clear"), status = $("start-image-status");
  const styleBox = $("style-box"), style = $("style"), scale = $("style-scale"), scaleShown = $("style-scale-value");
  const TYPES = ["image/png", "image/jpeg", "image/webp"];
  const MAX_BYTES = 4 * 1024 * 1024, MAX_INLINE_BYTES = 45 * 1024;  // wire.image: MAX_IMAGE_BYTES, MAX_INLINE_...
  Object.assign(player, { startImage: null, imageStarted: false, loras: [], lora: null, loraScale: null });

  function say(text) { status.textContent = text || ""; status.hidden = !text; }

  function picked() {
    const f = file.files && file.files[0];
    player.startImage = f ? f.name : null;
    clear.hidden = !f;
    if (!f) say("");
    else if (!TYPES.includes(f.type)) say(`${f.name}: not a PNG, JPEG or WebP image`);
    else if (f.size > MAX_BYTES) say(`${f.name}: ${(f.size / 1048576).toFixed(1)} MB; the server takes at most 4 MB`);
    else say(`The next stream starts from ${f.name}.`);
  }

  function dataUrl(f) {
    return new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(reader.result);
      reader.onerror = () => reject(new Error(`${f.name} could not be read`));
      reader.readAsDataURL(f);
    });
  }

  async function upload(f) {
    const headers = { "Content-Type": f.type, ...(token() ? { Authorization: `Bearer ${token()}` } : {}) };
    const r = await fetch("/images", { method: "POST", body: f, headers });
    if (r.status !== 201) throw new Error(`the server refused the image (${r.status}): ${(await r.text()).trim()}`);
    return (await r.json()).image;
  }

  // the fields the next start adds: {image} from the file picked (uploaded first if large), and the style chosen
  async function startFields(withCamera) {
    const fields = style.value ? { lora: style.value, lora_scale: Number(scale.value) } : {};
    const f = file.files && file.files[0];
    if (!f || withCamera) return fields;
    if (!TYPES.includes(f.type) || f.size > MAX_BYTES) throw new Error(status.textContent);
    say(`Sending ${f.name}...`);
    const image = f.size <= MAX_INLINE_BYTES ? await dataUrl(f) : await upload(f);
    say(`The stream starts from ${f.name}.`);
    return { ...fields, image };
  }

  // a stream's ready: the styles offered, the stream's own, and whether it started from the image
  function ready(msg) {
    player.imageStarted = !!msg.image;
    player.loras = Array.isArray(msg.loras) ? msg.loras : [];
    player.lora = msg.lora || null;
    player.loraScale = msg.lora_scale === undefined ? null : msg.lora_scale;
    style.replaceChildren(new Option("no style", ""), ...player.loras.map((name) => new Option(name, name)));
    style.value = player.lora || "";
    if (player.loraScale !== null) scale.value = String(player.loraScale);
    render();
  }

  function acked(msg) { player.lora = style.value || null; player.loraScale = Number(scale.value); render(); }

  function render() {
    styleBox.hidden = player.loras.length === 0;
    style.disabled = player.role === "watch";
    scaleShown.textContent = Number(scale.value).toFixed(2);
  }

  function switchStyle() {
    render();
    if (canSteer()) send({ type: "set_lora", lora: style.value || null, lora_scale: Number(scale.value) });
  }

  file.addEventListener("change", picked);
  clear.addEventListener("click", () => { file.value = ""; picked(); });
  style.addEventListener("change", switchStyle);
  scale.addEventListener("change", switchStyle);
  scale.addEventListener("input", render);
  picked();
  render();
  return { startFields, ready, acked, render };
};
