// The synthesis page: fills the form from /api/options, posts it to /api/synthesize,
// shows the wav and its spectrogram, or the server's error message next to the form.
"use strict";

const $ = (id) => document.getElementById(id);
const NUMBER_FIELDS = ["top_k", "top_p", "temperature", "num_candidates", "seed"];

function option(value, text) {
  const o = document.createElement("option");
  o.value = value;
  o.textContent = text ?? value;
  return o;
}

function clearErrors() {
  $("error").hidden = true;
  $("error").textContent = "";
  document.querySelectorAll(".field-error").forEach((e) => (e.textContent = ""));
  document.querySelectorAll(".invalid").forEach((e) => e.classList.remove("invalid"));
}

// An error of one field goes under it; any other error (and every error) in the box by the button.
function showError(message, field) {
  $("error").textContent = message;
  $("error").hidden = false;
  const slot = field && document.querySelector(`.field-error[data-field="${field}"]`);
  if (slot) {
    slot.textContent = message;
    const input = document.querySelector(`[name="${field}"]`);
    if (input) input.classList.add("invalid");
  }
}

async function getJSON(url, init) {
  const response = await fetch(url, init);
  let body;
  try {
    body = await response.json();
  } catch (e) {
    body = { error: `${response.status} ${response.statusText}` };
  }
  if (!response.ok) {
    const err = new Error(body.error || `${response.status} ${response.statusText}`);
    err.field = body.field;
    throw err;
  }
  return body;
}

// The text may also be "auto": each sentence in the language its script and the checkpoint choose.
function fillLanguages(languages) {
  for (const id of ["language", "prompt-language"]) {
    const select = $(id);
    const keep = select.value;
    // A server started with --language auto lists "auto" already: offer it once.
    const choices = languages.filter((l) => l !== "auto").map((l) => option(l));
    if (id === "language") choices.push(option("auto", "auto (by script)"));
    select.replaceChildren(...choices);
    if (choices.some((o) => o.value === keep)) select.value = keep;
  }
  $("prompt-language-box").hidden = languages.length < 2;
}

async function loadLanguages() {
  const checkpoint = $("checkpoint").value;
  if (!checkpoint) return;
  $("checkpoint-status").textContent = "loading the checkpoint…";
  try {
    const body = await getJSON(`/api/languages?checkpoint=${encodeURIComponent(checkpoint)}`);
    fillLanguages(body.languages);
    $("checkpoint-status").textContent = body.languages.length > 1
      ? `multilingual: ${body.languages.join(", ")}` : "loaded";
  } catch (e) {
    $("checkpoint-status").textContent = "";
    showError(e.message, "checkpoint");
  }
}

function showPrompt(url) {
  $("prompt-player").src = url || "";
  $("prompt-player").hidden = !url;
}

async function init() {
  const options = await getJSON("/api/options");
  const select = $("checkpoint");
  select.replaceChildren(...options.checkpoints.map((c) => option(c.id)));
  if (options.default_checkpoint) select.value = options.default_checkpoint;
  if (!options.checkpoints.length) showError("no checkpoint found under --exp-dir", "checkpoint");
  for (const p of options.prompts) {
    const o = option(p.name);
    o.dataset.transcript = p.transcript;
    o.dataset.url = p.url || "";  // a VALL-E X .npz prompt: nothing to play
    $("prompt-name").append(o);
  }
  // an example prompt, when there is one, so that the page synthesises as it opens
  if (options.prompts.length) {
    $("prompt-name").value = options.prompts[0].name;
    $("prompt-name").dispatchEvent(new Event("change"));
  }
  fillLanguages([options.defaults.language]);
  for (const name of NUMBER_FIELDS) $(name).value = options.defaults[name];
  await loadLanguages();
}

$("checkpoint").addEventListener("change", () => { clearErrors(); loadLanguages(); });

$("prompt-name").addEventListener("change", () => {
  const chosen = $("prompt-name").selectedOptions[0];
  if (chosen.value) {
    $("prompt").value = "";
    $("prompt-text").value = chosen.dataset.transcript || "";
    showPrompt(chosen.dataset.url);
  } else {
    showPrompt("");
  }
});

$("prompt").addEventListener("change", () => {
  const file = $("prompt").files[0];
  if (!file) return;
  $("prompt-name").value = "";
  showPrompt(file.name.toLowerCase().endsWith(".npz") ? "" : URL.createObjectURL(file));
});

function formData() {
  const data = new FormData();
  data.append("checkpoint", $("checkpoint").value);
  data.append("text", $("text").value);
  data.append("prompt_text", $("prompt-text").value);
  const file = $("prompt").files[0];
  if (file) data.append("prompt", file, file.name);
  else data.append("prompt_name", $("prompt-name").value);
  data.append("language", $("language").value);
  if (!$("prompt-language-box").hidden) data.append("prompt_language", $("prompt-language").value);
  for (const name of NUMBER_FIELDS) {
    const value = $(name).value.trim();
    if (value !== "") data.append(name, value);
    else if (name === "top_k") data.append(name, "off"); // an empty top-k means off, not "default"
  }
  return data;
}

function showResult(body) {
  $("output").src = body.wav_url;
  $("download").href = body.wav_url;
  $("download").download = `valle-${body.id.slice(0, 8)}.wav`;
  $("spectrogram").src = body.spectrogram_url;
  const waited = body.waited > 0.05 ? `, queued ${body.waited.toFixed(1)} s` : "";
  const batch = body.batch_rows > 1 ? `, decoded with ${body.batch_rows - 1} other text(s)` : "";
  $("result-info").textContent =
    `${body.duration.toFixed(2)} s of audio in ${body.elapsed.toFixed(1)} s${waited}${batch} (${body.checkpoint})`;
  $("result").hidden = false;
}

$("form").addEventListener("submit", async (event) => {
  event.preventDefault();
  clearErrors();
  $("synthesize").disabled = true;
  $("busy").hidden = false;
  $("busy").textContent = "synthesising…";
  try {
    showResult(await getJSON("/api/synthesize", { method: "POST", body: formData() }));
  } catch (e) {
    showError(e.message, e.field);
  } finally {
    $("synthesize").disabled = false;
    $("busy").hidden = true;
  }
});

init().catch((e) => showError(`cannot load the page's options: ${e.message}`));
