// The playground: a streamed chat over the public OpenAI API, with a structured answer's field
// confidences, tools and the prompt's cached tokens.
import { $, el, fetched, fmt, headers, notice, state } from "./util.js";

export async function loadModels() {
  const listed = await fetched("/v1/models");
  if (!listed) return;
  state.models = listed.data.map((m) => m.id);
  $("#model").replaceChildren(...state.models.map((id) => el("option", { value: id }, id)));
}

// events of a text/event-stream response, as they arrive
export async function* sse(resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) if (line.startsWith("data: ")) yield line.slice(6);
    }
  }
}

export function confidenceHue(p) {
  return Math.round(120 * Math.max(0, Math.min(1, 1 + Math.log10(Math.max(p, 1e-12)) / 4)));
}

// a JSON value with each leaf coloured by the probability of the tokens that wrote it
export function confidenceTree(value, confidence, pointer) {
  if (value !== null && typeof value === "object") {
    const list = Array.isArray(value);
    const items = Object.entries(value).map(([k, v]) => {
      const child = pointer + "/" + String(k).replace(/~/g, "~0").replace(/\//g, "~1");
      return el("li", {}, list ? "" : el("span", { class: "field" }, k + ": "), confidenceTree(v, confidence, child));
    });
    return el("ul", { class: "tree" }, ...items);
  }
  const p = confidence[pointer];
  const attrs = { class: "leaf", dataset: { pointer } };
  if (p !== undefined) {
    attrs.title = pointer + ": p = " + p.toPrecision(3);
    attrs.dataset.p = String(p);
  }
  const label = p === undefined ? "" : " " + (p >= 0.01 ? (100 * p).toFixed(0) + "%" : p.toExponential(1));
  const leaf = el("span", attrs, JSON.stringify(value), el("small", {}, label));
  // green (certain) to red (1e-4 or less), on a log scale: a value's tokens multiply their
  // probabilities, so a long value is rarely near 1. Set through the CSSOM, which the CSP allows.
  if (p !== undefined) leaf.style.background = "hsl(" + confidenceHue(p) + ", 70%, 85%)";
  return leaf;
}

export function parsed(text, id) {
  try {
    return text.trim() ? JSON.parse(text) : null;
  } catch (e) {
    throw new Error(id + " is not valid JSON: " + e.message);
  }
}

export async function send(event) {
  event.preventDefault();
  const prompt = $("#prompt").value.trim();
  if (!prompt) return;
  let schema;
  let tools;
  try {
    schema = parsed($("#schema").value, "the schema");
    tools = parsed($("#tools").value, "the tools");
  } catch (e) {
    notice(e.message);
    return;
  }
  state.chat.push({ role: "user", content: prompt });
  $("#prompt").value = "";
  const body = {
    model: $("#model").value,
    messages: state.chat,
    stream: true,
    stream_options: { include_usage: true },
    max_tokens: Number($("#max-tokens").value) || 128,
    temperature: Number($("#temperature").value),
  };
  if (schema) {
    body.response_format = { type: "json_schema", json_schema: { name: "answer", schema, strict: true } };
    body.ctxfuse = { field_confidence: true };
  }
  if (tools) {
    body.tools = tools;
    body.tool_choice = $("#tool-choice").value;
  }
  const turn = el("div", { class: "turn" }, el("p", { class: "user" }, prompt));
  const answer = el("pre", { class: "assistant" });
  const meta = el("p", { class: "meta muted" }, "waiting…");
  turn.append(answer, meta);
  $("#transcript").append(turn);
  $("#send").disabled = true;
  const started = performance.now();
  let first = null;
  let text = "";
  let usage = null;
  let result = null;
  const calls = [];
  try {
    const resp = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body) });
    if (!resp.ok) {
      const err = await resp.json().catch(() => null);
      throw new Error(err && err.error ? err.error.message : resp.status + " " + resp.statusText);
    }
    for await (const data of sse(resp)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const d = choice.delta || {};
        if (d.content) {
          if (first === null) first = performance.now();
          text += d.content;
          answer.textContent = text;
        }
        for (const tc of d.tool_calls || []) {
          if (first === null) first = performance.now();
          const c = (calls[tc.index] = calls[tc.index] || { name: "", arguments: "" });
          if (tc.function && tc.function.name) c.name += tc.function.name;
          if (tc.function && tc.function.arguments) c.arguments += tc.function.arguments;
          answer.textContent = calls.map((x) => x.name + "(" + x.arguments + ")").join("\n");
        }
        if (choice.ctxfuse) result = choice.ctxfuse;
      }
    }
  } catch (e) {
    meta.textContent = "error: " + e.message;
    meta.className = "meta bad";
    state.chat.pop();
    $("#send").disabled = false;
    return;
  }
  const done = performance.now();
  state.chat.push(calls.length ? { role: "assistant", content: null, tool_calls: calls.map((c, i) => ({ id: "call_" + i, type: "function", function: c })) } : { role: "assistant", content: text });
  if (calls.length) state.chat.pop(); // a tool call needs the tool's answer before the next turn: start over
  if (result && result.field_confidence && text) {
    try {
      answer.replaceChildren(confidenceTree(JSON.parse(text), result.field_confidence, ""));
      answer.classList.add("structured");
    } catch (_) {
      /* not JSON after all: the text stays */
    }
  }
  const generated = usage ? usage.completion_tokens : null;
  const cached = usage && usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : 0;
  const seconds = (done - (first || done)) / 1000;
  meta.replaceChildren(
    el("span", { class: "ttft" }, "first token " + fmt(first === null ? null : first - started, 0) + " ms"),
    " · ",
    el("span", {}, fmt(generated, 0) + " tokens" + (generated && seconds > 0 ? " at " + fmt(generated / seconds, 1) + "/s" : "")),
    " · ",
    el("span", { class: "cached" }, "prompt " + fmt(usage ? usage.prompt_tokens : null, 0) + " tokens, " + fmt(cached, 0) + " cached"),
    result && result.valid === false ? el("span", { class: "bad" }, " · invalid: " + (result.error || "")) : "",
  );
  $("#send").disabled = false;
}
