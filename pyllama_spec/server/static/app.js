// The chat page of `pyllama-spec serve`: streams answers from /v1/chat/completions and shows
// speculation at work. Each streamed chunk carries a `pyllama_spec` object (the step's tokens,
// each with its text and whether it was an accepted draft token; how many tokens were drafted
// and accepted); the page shades accepted draft tokens, draws per-answer charts from those
// steps and shows the server's `timings` under each answer. Plain JavaScript, no build step.
"use strict";

const $ = (id) => document.getElementById(id);
const ui = {
  model: $("model"), log: $("log"), form: $("composer"), notice: $("notice"), attachments: $("attachments"),
  prompt: $("prompt"), attach: $("attach"), file: $("file"), send: $("send"), stop: $("stop"), clear: $("clear"),
  settings: $("settings"), temperature: $("temperature"), topP: $("top-p"), maxTokens: $("max-tokens"),
  speculative: $("speculative"), draftMax: $("draft-max"), apiKey: $("api-key"),
};

const state = {
  conversation: [],   // the messages sent with every request (OpenAI format, images as data: URIs)
  pending: [],        // images attached to the next message: {name, url}
  controller: null,   // the AbortController of the answer being streamed, null when idle
};

// ----------------------------------------------------------------------------- server facts

function requestHeaders() {
  const h = { "Content-Type": "application/json" };
  if (ui.apiKey.value) h.Authorization = "Bearer " + ui.apiKey.value;
  return h;
}

async function errorMessage(res) {
  try {
    const body = await res.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (e) { /* not JSON: fall through to the status line */ }
  return `HTTP ${res.status} ${res.statusText}`;
}

function notify(text) {
  ui.notice.textContent = text;
  ui.notice.hidden = !text;
}

function askForKey(message) {
  notify(message + " Enter the server's API key in Settings.");
  ui.settings.open = true;
  ui.apiKey.focus();
}

async function loadProps() {
  const res = await fetch("/props", { headers: requestHeaders() });
  if (res.status === 401) {
    ui.model.textContent = "(needs an API key)";
    askForKey(await errorMessage(res));
    return;
  }
  if (!res.ok) {
    notify("Could not read the server's settings: " + (await errorMessage(res)));
    return;
  }
  const props = await res.json();
  const spec = props.default_generation_settings.speculative;
  ui.model.textContent = `${props.model_alias} · ${spec.type}` +
    (spec.n_max_limit ? ` (draft max ${spec.n_max})` : "") + (props.modalities.vision ? " · images" : "");
  ui.maxTokens.value = props.default_generation_settings.max_tokens;
  if (spec.n_max_limit > 0) {
    ui.draftMax.max = spec.n_max_limit;
    ui.draftMax.value = spec.n_max || spec.n_max_limit;
  } else {  // a target-only server: nothing to switch on
    ui.speculative.checked = false;
    ui.speculative.disabled = ui.draftMax.disabled = true;
  }
  if (!props.modalities.vision) {
    ui.attach.disabled = true;
    ui.attach.title = "this model has no vision projector (--mmproj)";
  }
}

// ----------------------------------------------------------------------------- images

function addFiles(files) {
  for (const file of files) {
    if (!file.type.startsWith("image/")) {
      notify(`${file.name || "That file"} is not an image.`);
      continue;
    }
    const reader = new FileReader();
    reader.onload = () => {
      state.pending.push({ name: file.name || "pasted image", url: reader.result });
      renderAttachments();
    };
    reader.onerror = () => notify(`Could not read ${file.name}.`);
    reader.readAsDataURL(file);
  }
}

function renderAttachments() {
  ui.attachments.replaceChildren(...state.pending.map((img, i) => {
    const li = document.createElement("li");
    const pic = document.createElement("img");
    pic.src = img.url;
    pic.alt = img.name;
    const remove = document.createElement("button");
    remove.type = "button";
    remove.textContent = "×";
    remove.setAttribute("aria-label", `Remove ${img.name}`);
    remove.addEventListener("click", () => {
      state.pending.splice(i, 1);
      renderAttachments();
      ui.prompt.focus();
    });
    li.append(pic, remove);
    return li;
  }));
}

// ----------------------------------------------------------------------------- the conversation

const scroller = document.querySelector("main");

// Run `change` (which adds to the conversation) and keep the newest text in view, unless the
// reader has scrolled up to read something earlier.
function keepingBottom(change) {
  const atBottom = scroller.scrollHeight - scroller.scrollTop - scroller.clientHeight < 40;
  change();
  if (atBottom) scroller.scrollTop = scroller.scrollHeight;
}

function addItem(role) {
  const li = document.createElement("li");
  li.className = role;
  const label = document.createElement("p");
  label.className = "role";
  label.textContent = role === "user" ? "You" : "Answer";
  const text = document.createElement("p");
  text.className = "text";
  li.append(label, text);
  keepingBottom(() => ui.log.append(li));
  return li;
}

function showUserMessage(text, images) {
  const li = addItem("user");
  if (images.length) {
    const thumbs = document.createElement("div");
    thumbs.className = "thumbs";
    for (const img of images) {
      const pic = document.createElement("img");
      pic.src = img.url;
      pic.alt = img.name;
      thumbs.append(pic);
    }
    li.insertBefore(thumbs, li.querySelector(".text"));
  }
  li.querySelector(".text").textContent = text;
  return li;
}

function numberOrUndefined(input) {
  return input.value === "" ? undefined : Number(input.value);
}

function requestBody() {
  const body = {
    messages: state.conversation,
    stream: true,
    max_tokens: numberOrUndefined(ui.maxTokens),
    temperature: numberOrUndefined(ui.temperature),
    top_p: numberOrUndefined(ui.topP),
  };
  // llama-server's per-request key; 0 turns drafting off for this answer.
  if (!ui.speculative.disabled) body["speculative.n_max"] = ui.speculative.checked ? numberOrUndefined(ui.draftMax) : 0;
  return body;
}

function setBusy(busy) {
  document.body.dataset.state = busy ? "busy" : "ready";
  ui.send.disabled = busy;
  ui.stop.disabled = !busy;
}

async function send() {
  if (state.controller) return;  // one answer at a time; Escape or Stop ends it
  const text = ui.prompt.value.trim();
  const images = state.pending.splice(0);
  if (!text && !images.length) return;
  notify("");
  const content = images.length
    ? [...images.map((img) => ({ type: "image_url", image_url: { url: img.url } })),
       ...(text ? [{ type: "text", text }] : [])]
    : text;
  const userItem = showUserMessage(text, images);
  const message = { role: "user", content };
  state.conversation.push(message);
  ui.prompt.value = "";
  renderAttachments();

  const answer = new Answer(addItem("assistant"));
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  try {
    const res = await fetch("/v1/chat/completions", {
      method: "POST", headers: requestHeaders(), body: JSON.stringify(requestBody()), signal: controller.signal,
    });
    if (res.status === 401) askForKey(await errorMessage(res));
    if (!res.ok) throw new Error(await errorMessage(res));
    await readStream(res, answer);
    answer.end("done");
  } catch (e) {
    if (e.name === "AbortError") {
      answer.end("stopped");
    } else {
      answer.end("error", e.message);
    }
  } finally {
    if (answer.text) {
      state.conversation.push({ role: "assistant", content: answer.text });  // a stopped answer keeps what it said
    } else if (answer.state === "error") {
      // Refused or failed with nothing said: leave the message out, or every next request fails too.
      state.conversation.splice(state.conversation.indexOf(message), 1);
      userItem.classList.add("unsent");
      answer.note(" This message is not part of the conversation.");
    }
    state.controller = null;
    setBusy(false);
    if (document.activeElement === document.body || document.activeElement === ui.stop) ui.prompt.focus();
  }
}

function stop() {
  if (state.controller) state.controller.abort();
}

function clearConversation() {
  stop();
  state.conversation = [];
  ui.log.replaceChildren();
  notify("");
  ui.prompt.focus();
}

// ----------------------------------------------------------------------------- the stream

// Complete server-sent events in `buffer`: [the data of each, what is left for the next read].
function takeEvents(buffer) {
  const blocks = buffer.replace(/\r\n?/g, "\n").split("\n\n");
  const rest = blocks.pop();
  const events = [];
  for (const block of blocks) {
    const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, ""));
    if (data.length) events.push(data.join("\n"));  // ": ping" comments have no data
  }
  return [events, rest];
}

// Read the answer's events into `answer`. A stream that has more bytes waiting resolves each read
// at once (a microtask), so a loop of reads never lets the page draw or take a click while the
// server writes faster than the page reads: after SLICE_MS of work on events, give the page a
// turn (not in a hidden tab, where timers wait a second or more and nothing is drawn anyway).
const SLICE_MS = 12;

async function readStream(res, answer) {
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let working = 0;  // ms spent on events since the page last had a turn
  for (;;) {
    if (working > SLICE_MS && !document.hidden) {
      await new Promise((resolve) => setTimeout(resolve, 0));
      working = 0;
    }
    const { value, done } = await reader.read();
    const started = performance.now();
    if (done) throw new Error("the stream ended before [DONE]");
    const [events, rest] = takeEvents(buffer + value);
    buffer = rest;
    for (const data of events) {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const choice = chunk.choices && chunk.choices[0];
      if (choice && choice.delta && (choice.delta.content || chunk.pyllama_spec)) {
        answer.add(choice.delta.content || "", chunk.pyllama_spec);
      }
      if (choice && choice.finish_reason) answer.finishReason = choice.finish_reason;
      if (chunk.timings) answer.timings = chunk.timings;
    }
    working += performance.now() - started;
  }
}

// ----------------------------------------------------------------------------- one answer

// One streamed answer. Text and steps arrive as often as the server writes them (thousands a
// second on a fast pair); they are kept in `pending` and put on the page once a frame, so the
// page lays out and scrolls once a frame however fast the answer comes.
class Answer {
  constructor(li) {
    this.li = li;
    this.textEl = li.querySelector(".text");
    this.text = "";
    this.pending = [];  // [content, spec] not yet on the page
    // Per draft position i: steps that drafted past i, and steps that kept past i; per
    // k: steps that gave k + 1 tokens. Counted as steps arrive, so a frame's charts cost
    // the draft length, not the answer's length.
    this.drafted = [];
    this.accepted = [];
    this.tokensPerStep = [];
    this.verifySteps = -1;  // the first step is the prompt's own token
    this.timings = null;
    this.finishReason = null;
    this.state = "streaming";
    li.dataset.state = "streaming";
    li.setAttribute("aria-busy", "true");  // screen readers read the answer once, when it ends
    this.stateEl = document.createElement("p");
    this.stateEl.className = "state";
    this.stateEl.textContent = "…";
    this.charts = document.createElement("div");
    this.charts.className = "charts";
    this.footer = document.createElement("div");
    this.footer.className = "timings";
    li.append(this.stateEl, this.charts, this.footer);
    this.drawQueued = false;
  }

  add(content, spec) {
    this.text += content;
    if (spec) this.count(spec);
    this.pending.push([content, spec]);
    if (!this.drawQueued) {
      this.drawQueued = true;
      requestAnimationFrame(() => this.draw());
    }
  }

  // Put what arrived since the last frame on the page, in one change.
  draw() {
    this.drawQueued = false;
    if (!this.pending.length) return;
    const added = document.createDocumentFragment();
    for (const [content, spec] of this.pending.splice(0)) this.show(added, content, spec);
    keepingBottom(() => {
      this.textEl.append(added);
      this.drawCharts();
    });
  }

  show(into, content, spec) {
    if (!spec) {
      into.append(content);  // a server without the extension: plain text
      return;
    }
    let shown = "";
    for (const tok of spec.tokens) {
      shown += tok.text;
      if (!tok.text) continue;  // a token whose text shows at a later token
      const span = document.createElement("span");
      span.className = tok.draft ? "tok draft" : "tok";
      span.textContent = tok.text;
      into.append(span);
    }
    // Text no token carried (held back until the end of the answer) is shown unshaded.
    if (content.length > shown.length) into.append(content.slice(shown.length));
  }

  count(spec) {
    // The first step is the prompt's own token (nothing drafted); every later one is a verify step.
    this.verifySteps += 1;
    if (this.verifySteps === 0) return;  // the prompt's own token: nothing to count
    for (let i = 0; i < spec.drafted; i++) this.drafted[i] = (this.drafted[i] || 0) + 1;
    for (let i = 0; i < spec.accepted; i++) this.accepted[i] = (this.accepted[i] || 0) + 1;
    const k = spec.tokens.length - 1;
    if (k >= 0) {
      while (this.tokensPerStep.length <= k) this.tokensPerStep.push(0);
      this.tokensPerStep[k] += 1;
    }
  }

  end(how, message) {
    this.state = how;
    this.li.dataset.state = how;
    this.li.removeAttribute("aria-busy");
    const reasons = { stop: "finished", length: "reached the token limit" };
    this.stateEl.textContent = how === "done" ? (reasons[this.finishReason] || "finished")
      : how === "stopped" ? "stopped" : "Error: " + message;
    this.stateEl.classList.toggle("error", how === "error");
    if (how === "error") this.stateEl.setAttribute("role", "alert");
    this.draw();  // what arrived after the last frame (or all of it, in a tab not drawn meanwhile)
    keepingBottom(() => {
      this.drawCharts();
      if (this.timings) this.footer.replaceChildren(...timingsFooter(this.timings));
    });
  }

  note(text) {
    this.stateEl.textContent += text;
  }

  drawCharts() {
    if (this.verifySteps <= 0) return;  // no verify step yet (-1: not even the first token)
    const drafted = Array.from(this.drafted, (n) => n || 0);
    const accepted = drafted.map((_, i) => this.accepted[i] || 0);
    const rates = drafted.map((d, i) => (d ? accepted[i] / d : 0));
    const acceptance = barChart({
      title: "Acceptance by draft position",
      values: rates, max: 1, rate: true,
      label: (i) => `draft position ${i + 1}: ${accepted[i]} of ${drafted[i]} accepted (${Math.round(rates[i] * 100)}%)`,
      top: "100%", empty: "nothing drafted",
    });
    const counts = this.tokensPerStep.length ? this.tokensPerStep : [0];
    const perStep = barChart({
      title: "Tokens per target step (bars: steps)",
      values: counts, max: Math.max(...counts),
      label: (k) => `${counts[k]} step${counts[k] === 1 ? "" : "s"} gave ${k + 1} token${k ? "s" : ""}`,
      top: String(Math.max(...counts)),
    });
    this.charts.replaceChildren(acceptance, perStep);
  }
}

// ----------------------------------------------------------------------------- charts and footer

const SVG = "http://www.w3.org/2000/svg";

function svgEl(name, attrs, text) {
  const el = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

// A small bar chart: bar i is values[i] / max high, labelled i + 1 below; each bar's <title> says what it is.
function barChart({ title, values, max, label, top, rate = false, empty = "no steps yet" }) {
  const W = 240, H = 112, left = 30, right = 6, topPad = 8, bottom = 92;
  const figure = document.createElement("figure");
  const caption = document.createElement("figcaption");
  caption.textContent = title;
  const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": title + ": " +
    (values.length ? values.map((_, i) => label(i)).join("; ") : empty) });
  svg.append(svgEl("line", { class: "axis", x1: left, y1: bottom, x2: W - right, y2: bottom }),
             svgEl("line", { class: "axis", x1: left, y1: topPad, x2: left, y2: bottom }),
             svgEl("text", { x: left - 3, y: topPad + 3, "text-anchor": "end" }, top),
             svgEl("text", { x: left - 3, y: bottom, "text-anchor": "end" }, "0"));
  if (!values.length || !max) {
    svg.append(svgEl("text", { x: (left + W) / 2, y: (topPad + bottom) / 2, "text-anchor": "middle" }, empty));
  }
  const slot = (W - right - left) / Math.max(values.length, 1);
  const every = Math.ceil(values.length / 16);  // label at most 16 positions
  values.forEach((v, i) => {
    const h = max ? (v / max) * (bottom - topPad) : 0;
    const x = left + i * slot + slot * 0.15;
    const bar = svgEl("rect", { class: rate ? "bar rate" : "bar", x: x.toFixed(1), y: (bottom - h).toFixed(1),
                                width: (slot * 0.7).toFixed(1), height: h.toFixed(1) });
    bar.append(svgEl("title", {}, label(i)));
    svg.append(bar);
    if (i % every === 0) {
      svg.append(svgEl("text", { x: (x + slot * 0.35).toFixed(1), y: bottom + 10, "text-anchor": "middle" }, i + 1));
    }
  });
  figure.append(caption, svg);
  return figure;
}

function timingsFooter(t) {
  const ms = (v) => (v < 10 ? v.toFixed(1) : Math.round(v)) + " ms";
  const items = [
    `prompt ${t.prompt_n} tokens in ${ms(t.prompt_ms)}` + (t.cache_n ? ` (${t.cache_n} cached)` : ""),
    `${t.predicted_n} tokens in ${ms(t.predicted_ms)} · ${t.predicted_per_second.toFixed(1)} tokens/s`,
    `drafted ${t.draft_n} · accepted ${t.draft_n_accepted}` +
      (t.draft_n ? ` (${Math.round(t.acceptance_rate * 100)}%)` : ""),
    `${t.mean_accepted_length.toFixed(2)} tokens per target step (${t.target_steps} steps)`,
  ];
  return items.map((text) => {
    const span = document.createElement("span");
    span.textContent = text;
    return span;
  });
}

// ----------------------------------------------------------------------------- wiring

ui.form.addEventListener("submit", (e) => { e.preventDefault(); send(); });
ui.prompt.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.ctrlKey && !e.altKey && !e.isComposing) {
    e.preventDefault();
    ui.form.requestSubmit();  // the same checks of the settings' ranges as the Send button
  }
});
// A setting out of its range stops the submit: show it (the browser can only point at a visible field).
ui.form.addEventListener("invalid", () => { ui.settings.open = true; }, true);
document.addEventListener("keydown", (e) => {
  if (e.key === "Escape" && state.controller) {
    e.preventDefault();
    stop();
  }
});
ui.stop.addEventListener("click", stop);
ui.clear.addEventListener("click", clearConversation);
ui.attach.addEventListener("click", () => ui.file.click());
ui.file.addEventListener("change", () => { addFiles(ui.file.files); ui.file.value = ""; });
ui.prompt.addEventListener("paste", (e) => {
  const images = [...e.clipboardData.items].filter((it) => it.kind === "file" && it.type.startsWith("image/"));
  if (images.length) addFiles(images.map((it) => it.getAsFile()));
});
// Drop images anywhere on the page.
document.addEventListener("dragover", (e) => {
  if (![...e.dataTransfer.types].includes("Files")) return;
  e.preventDefault();
  document.body.classList.add("dropping");
});
document.addEventListener("dragleave", (e) => {
  if (e.target === document.documentElement || !e.relatedTarget) document.body.classList.remove("dropping");
});
document.addEventListener("drop", (e) => {
  if (!e.dataTransfer.files.length) return;
  e.preventDefault();
  document.body.classList.remove("dropping");
  addFiles(e.dataTransfer.files);
  ui.prompt.focus();
});
ui.apiKey.addEventListener("change", () => { notify(""); loadProps(); });

loadProps().catch((e) => notify("Could not reach the server: " + e.message)).finally(() => setBusy(false));
ui.prompt.focus();
