// The chat page of `deepinfer serve`. It talks only to this server's own OpenAI-compatible API
// (relative URLs, so the page also works behind a path prefix): GET v1/models for the model name,
// POST v1/chat/completions with `stream: true` for the answers, read as server-sent events.
// Everything the model or the user writes is shown as text (textContent), never parsed as HTML.
// A picture pasted or dropped onto the page goes with the next message as an image_url part (a data
// URL; the server needs a vision model) and shows as a thumbnail in the history.
"use strict";


const $ = (id) => document.getElementById(id);

const chat = {
  history: [],      // the conversation sent with each request: {role, content}, oldest first
  controller: null, // the AbortController of the answer being streamed, if any
  model: null,      // the id picked among those GET v1/models reported (the first by default)
  pictures: [],     // data URLs of the pictures pasted or dropped for the next message
};

const MAX_PICTURE_BYTES = 8 << 20; // a larger file would not fit the server's body limit

/** An HTTP failure: the status and the server's own message. */
class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// -- errors ---------------------------------------------------------------------------------------

/** The HttpError for a non-2xx response, carrying the server's OpenAI-shaped error message. */
async function errorFromResponse(response) {
  let message = response.statusText || "request failed";
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch {
    // not JSON: keep the status text
  }
  return new HttpError(response.status, message);
}

function describeError(err) {
  if (err.status === 401) {
    return `The server refused the API key (401 Unauthorized): ${err.message}. ` +
      "Enter the key the server was started with (--api-key) under Settings.";
  }
  if (err.status) return `The server answered ${err.status}: ${err.message}`;
  return `The request failed: ${err.message}`;
}

/** Open the settings, where the API key field is (after a 401); `focus` only right after a user's action,
 * never while they may be typing elsewhere. */
function askForKey(focus) {
  $("settings").open = true;
  if (focus) $("api-key").focus();
}

function showError(text) {
  const box = $("error");
  box.textContent = text;
  box.hidden = !text;
}

// -- model name -----------------------------------------------------------------------------------

async function loadModel() {
  try {
    const response = await fetch("v1/models", { headers: authHeaders() });
    if (!response.ok) throw await errorFromResponse(response);
    const body = await response.json();
    const ids = body.data.map((card) => card.id);
    chat.model = ids.includes(chat.model) ? chat.model : ids[0];
    showModels(ids);
    showError("");
  } catch (err) {
    chat.model = null;
    showModels([]);
    showError(describeError(err));
    if (err.status === 401) askForKey(false);
  }
}

/** The model picker's options: one per id (its text set as text), the current model selected. */
function showModels(ids) {
  const picker = $("model");
  picker.replaceChildren(...(ids.length ? ids : ["model unknown"]).map((id) => {
    const option = document.createElement("option");
    option.value = option.textContent = id;
    return option;
  }));
  picker.disabled = !ids.length;
  if (chat.model) picker.value = chat.model;
}

// -- messages -------------------------------------------------------------------------------------

/** Append a message bubble; its text is set as text, never as HTML. */
function addMessage(role, text) {
  const bubble = document.createElement("div");
  bubble.className = `msg ${role}`;
  bubble.textContent = text;
  $("messages").appendChild(bubble);
  scrollToEnd();
  return bubble;
}

/** Thumbnails of `urls` (data URLs) appended to `parent`. */
function addThumbnails(parent, urls) {
  for (const url of urls) {
    const img = document.createElement("img");
    img.className = "thumb";
    img.alt = "picture";
    img.src = url;
    parent.appendChild(img);
  }
}

/** Read the picture files among `files` as data URLs for the next message. */
function takePictures(files) {
  for (const file of files) {
    if (!file.type.startsWith("image/")) continue;
    if (file.size > MAX_PICTURE_BYTES) {
      showError(`${file.name || "the picture"} is over ${MAX_PICTURE_BYTES >> 20} MB`);
      continue;
    }
    const reader = new FileReader();
    reader.onload = () => {
      chat.pictures.push(reader.result);
      showPending();
    };
    reader.readAsDataURL(file);
  }
}

function showPending() {
  const box = $("attachments");
  box.replaceChildren();
  addThumbnails(box, chat.pictures);
  box.hidden = chat.pictures.length === 0;
}

function scrollToEnd() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

/** The request body: optional system prompt, the history, the optional sampling fields. */
function buildRequest(history) {
  const messages = [];
  const system = $("system-prompt").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...history);
  const body = { messages, stream: true, stream_options: { include_usage: true } };
  if (chat.model) body.model = chat.model;
  const temperature = $("temperature").value.trim();
  if (temperature !== "") body.temperature = Number(temperature);
  const maxTokens = $("max-tokens").value.trim();
  if (maxTokens !== "") body.max_tokens = Number(maxTokens);
  return body;
}

// -- streaming ------------------------------------------------------------------------------------

/** The payloads of the `data:` lines of a server-sent-event response, as they arrive. */
async function* sseData(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    const lines = buffer.split("\n");
    buffer = lines.pop(); // an incomplete last line waits for the next read
    for (const line of lines) {
      if (line.startsWith("data:")) yield line.slice(5).trim();
    }
  }
}

/** Stream one answer into `bubble`; returns the turn's text, timings and usage. */
async function streamAnswer(history, bubble, signal) {
  const turn = { text: "", started: performance.now(), firstToken: null, ended: null, usage: null };
  const response = await fetch("v1/chat/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json", ...authHeaders() },
    body: JSON.stringify(buildRequest(history)),
    signal,
  });
  if (!response.ok) throw await errorFromResponse(response);
  for await (const data of sseData(response)) {
    if (data === "[DONE]") break;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new HttpError(0, chunk.error.message);
    const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
    if (delta && delta.content) {
      turn.firstToken = turn.firstToken ?? performance.now();
      turn.text += delta.content;
      bubble.textContent = turn.text;
      scrollToEnd();
    }
    if (chunk.usage) {
      turn.usage = chunk.usage;
      turn.ended = performance.now();
    }
  }
  return turn;
}

/** "N tokens/s" of the last answer: decode speed after the first token, and what the prompt reused. */
function showStats(turn) {
  const usage = turn.usage;
  if (!usage) {
    $("stats").textContent = "";
    return;
  }
  const tokens = usage.completion_tokens;
  const ended = turn.ended ?? performance.now();
  const first = turn.firstToken ?? ended;
  const decodeSeconds = (ended - first) / 1000;
  const rate = tokens > 1 && decodeSeconds > 0 ? (tokens - 1) / decodeSeconds : tokens / ((ended - turn.started) / 1000);
  const cached = (usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) || 0;
  $("stats").textContent =
    `${rate.toFixed(1)} tokens/s · ${tokens} tokens · first token after ${((first - turn.started) / 1000).toFixed(2)} s` +
    ` · prompt ${usage.prompt_tokens} tokens, ${cached} cached`;
}

function setBusy(controller) {
  chat.controller = controller;
  $("send").disabled = controller !== null;
  $("stop").disabled = controller === null;
}

/** Send `text` (and the pending pictures) as the next user turn and stream the answer. */
async function send(text) {
  showError("");
  $("stats").textContent = "";
  const history = chat.history; // a New chat during the stream replaces chat.history, not this array
  const pictures = chat.pictures;
  chat.pictures = [];
  showPending();
  const content = pictures.length === 0 ? text : [
    { type: "text", text },
    ...pictures.map((url) => ({ type: "image_url", image_url: { url } })),
  ];
  history.push({ role: "user", content });
  const userBubble = addMessage("user", text);
  if (pictures.length) {
    const row = document.createElement("div");
    row.className = "thumbs";
    addThumbnails(row, pictures);
    userBubble.appendChild(row);
  }
  const bubble = addMessage("assistant", "");
  const controller = new AbortController();
  setBusy(controller);
  try {
    const turn = await streamAnswer(history, bubble, controller.signal);
    history.push({ role: "assistant", content: turn.text });
    showStats(turn);
  } catch (err) {
    if (err.name === "AbortError") {
      // stopped: keep what was shown as the answer; with nothing shown, drop the question
      if (bubble.textContent) history.push({ role: "assistant", content: bubble.textContent });
      else {
        history.pop();
        userBubble.classList.add("failed");
      }
      if (chat.history === history) $("stats").textContent = "Stopped.";
    } else {
      history.pop(); // the question was not answered: it leaves the conversation
      userBubble.classList.add("failed");
      bubble.classList.add("failed");
      if (!$("prompt").value) $("prompt").value = text;
      if (pictures.length && chat.history === history) {
        chat.pictures = pictures.concat(chat.pictures); // sent again with the retried text
        showPending();
      }
      showError(describeError(err));
      if (err.status === 401) askForKey(true);
    }
    if (!bubble.textContent) bubble.remove();
  } finally {
    if (chat.controller === controller) setBusy(null);
  }
}

function newChat() {
  if (chat.controller) chat.controller.abort();
  chat.history = [];
  chat.pictures = [];
  showPending();
  $("messages").replaceChildren();
  $("stats").textContent = "";
  showError("");
  setBusy(null);
  $("prompt").focus();
}

// -- wiring ---------------------------------------------------------------------------------------

function onSubmit(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || chat.controller) return;
  $("prompt").value = "";
  send(text);
}

function onPromptKey(event) {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
}

function init() {
  loadStoredKey();
  $("composer").addEventListener("submit", onSubmit);
  $("prompt").addEventListener("keydown", onPromptKey);
  $("prompt").addEventListener("paste", (event) => takePictures(event.clipboardData.files));
  document.addEventListener("dragover", (event) => event.preventDefault());
  document.addEventListener("drop", (event) => {
    event.preventDefault();
    takePictures(event.dataTransfer.files);
  });
  $("stop").addEventListener("click", () => chat.controller && chat.controller.abort());
  $("new-chat").addEventListener("click", newChat);
  $("model").addEventListener("change", () => { chat.model = $("model").value; });
  $("api-key").addEventListener("change", () => {
    storeKey();
    loadModel();
  });
  loadModel();
}

init();
