// relevancy serve: the page's behaviour. It talks to the JSON API under it (/api/...) and nothing else. Each
// method's answer holds the result's to_json() (`explanation`, docs/api.md) and how to draw it (`view`).
"use strict";

const $ = (id) => document.getElementById(id);
const DEFAULT_METHOD = "generic_attention";
const TOP_CLASSES = 5;
let info = null;
let objectUrls = [];  // download links made for the current results, freed when new results replace them

function element(tag, attributes = {}, children = []) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attributes)) {
    if (key === "text") node.textContent = value;
    else if (key === "className") node.className = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child);
  return node;
}

function number(value) {
  if (value === null || value === undefined) return "n/a";
  const size = Math.abs(value);
  return size !== 0 && (size < 1e-3 || size >= 1e4) ? value.toExponential(2) : Number(value.toPrecision(3)).toString();
}

function methodName(name) {
  // a method name that may wrap after its underscores in a narrow card
  const node = document.createElement("span");
  name.split("_").forEach((part, k, parts) => {
    node.append(part + (k < parts.length - 1 ? "_" : ""));
    if (k < parts.length - 1) node.append(document.createElement("wbr"));
  });
  return node;
}

function seconds(value) {
  return value < 1 ? `${Math.round(value * 1000)} ms` : `${value.toFixed(2)} s`;
}

async function post(path, body) {
  const response = await fetch(path, {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)});
  let data = null;
  try { data = await response.json(); } catch (error) { /* not JSON: reported below by status */ }
  if (!response.ok) throw new Error((data && data.error) || `the server answered ${response.status}`);
  return data;
}

function status(tab, message, kind = "") {
  const line = $(`${tab}-status`);
  line.textContent = message;
  line.className = `status ${kind}`;
}

function readFile(file) {
  return new Promise((resolve, reject) => {
    if (file.size > info.limits.max_image_bytes) {
      reject(new Error(`${file.name} is ${(file.size / 2 ** 20).toFixed(1)} MiB; the limit is ${(info.limits.max_image_bytes / 2 ** 20).toFixed(0)} MiB`));
      return;
    }
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(new Error(`could not read ${file.name}`));
    reader.readAsDataURL(file);
  });
}

// -- tabs ---------------------------------------------------------------------------------------------------
function showTab(name) {
  for (const tab of document.querySelectorAll("[role=tab]")) {
    const selected = tab.getAttribute("aria-controls") === name;
    tab.setAttribute("aria-selected", String(selected));
    $(tab.getAttribute("aria-controls")).hidden = !selected;
  }
}

// -- shared controls ----------------------------------------------------------------------------------------
function methodBoxes(container, methods, tab) {
  container.replaceChildren();
  for (const method of methods) {
    const box = element("input", {type: "checkbox", value: method.name, name: `${tab}-method`});
    box.checked = method.name === DEFAULT_METHOD;
    const label = element("label", {className: "method", title: method.summary}, [box, element("span", {text: method.name})]);
    if (method.signed) label.append(element("span", {className: "tag", text: "signed", title: "negative values mean evidence against"}));
    container.append(label);
  }
}

function chosenMethods(tab) {
  return [...document.querySelectorAll(`input[name=${tab}-method]:checked`)].filter((box) => !box.disabled).map((box) => box.value);
}

function imagePicker(tab, state) {
  const chosen = $(`${tab}-chosen`);
  const show = (src, caption) => {
    chosen.hidden = false;
    chosen.querySelector("img").src = src;
    chosen.querySelector("figcaption").textContent = caption;
  };
  const gallery = $(`${tab}-samples`);
  for (const sample of info.samples) {
    const button = element("button", {type: "button", className: "sample", title: sample.title, "data-sample": sample.id},
                           [element("img", {src: `/api/samples/${encodeURIComponent(sample.id)}`, alt: sample.title})]);
    button.addEventListener("click", () => {
      state.image = {sample: sample.id};
      for (const other of gallery.children) other.classList.toggle("picked", other === button);
      show(button.querySelector("img").src, sample.title);
      $(`${tab}-file`).value = "";
    });
    gallery.append(button);
  }
  $(`${tab}-file`).addEventListener("change", async (event) => {
    const file = event.target.files[0];
    if (!file) return;
    try {
      state.image = {data: await readFile(file)};
      for (const other of gallery.children) other.classList.remove("picked");
      show(state.image.data, file.name);
    } catch (error) {
      status(tab, error.message, "error");
    }
  });
}

function colourBar(bar) {
  const gradient = element("div", {className: "gradient"});
  gradient.style.background = `linear-gradient(to right, ${bar.stops.join(", ")})`;
  const ticks = element("div", {className: "ticks"}, [element("span", {text: number(bar.low)})]);
  if (bar.low < 0 && bar.high > 0) ticks.append(element("span", {text: "0"}));
  ticks.append(element("span", {text: number(bar.high)}));
  return element("div", {className: "bar"}, [gradient, ticks, element("p", {className: "legend", text: bar.legend})]);
}

function download(label, href, filename) {
  return element("a", {href, download: filename, text: label});
}

function blobUrl(parts, type) {
  const url = URL.createObjectURL(new Blob(parts, {type}));
  objectUrls.push(url);
  return url;
}

function npyParts(scores) {
  // one map's raw scores (nested arrays, null for NaN) as the parts of a float32 .npy file
  const shape = [];
  for (let level = scores; Array.isArray(level); level = level[0]) shape.push(level.length);
  const values = Float32Array.from(scores.flat(Infinity), (value) => (value === null ? NaN : value));
  let header = `{'descr': '<f4', 'fortran_order': False, 'shape': (${shape.join(", ")}${shape.length === 1 ? "," : ""}), }`;
  header += " ".repeat((64 - ((10 + header.length + 1) % 64)) % 64) + "\n";  // the data starts 64-byte aligned
  const start = new Uint8Array([0x93, 78, 85, 77, 80, 89, 1, 0, header.length & 255, header.length >> 8]);
  return [start, new TextEncoder().encode(header), new Uint8Array(values.buffer)];
}

function mapCard(title, view, stem, scores, explanation, extra = []) {
  // one map: `view` how the server drew it, `scores` its raw scores, `explanation` the whole to_json() it is from
  const card = element("article", {className: "card"});
  card.append(element("h3", {text: title}));
  card.append(element("img", {className: "overlay", src: view.overlay, alt: `${title}: map over the image`}));
  card.append(view.colour_bar ? colourBar(view.colour_bar) : element("p", {className: "note", text: view.note}));
  for (const node of extra) card.append(node);
  card.append(element("p", {className: "downloads"}, [
    "Raw map: ",
    download("PNG", view.map_png, `${stem}.png`), " · ",
    download("JSON", blobUrl([JSON.stringify(explanation)], "application/json"), `${stem}.json`), " · ",
    download(".npy", blobUrl(npyParts(scores), "application/octet-stream"), `${stem}.npy`),
  ]));
  return card;
}

function topClasses(logits, names) {
  // the classes of one row's logits with the highest probabilities (softmax), best first
  const most = Math.max(...logits);
  const weights = logits.map((value) => Math.exp(value - most));
  const total = weights.reduce((sum, value) => sum + value, 0);
  return weights.map((weight, index) => ({index, name: names[index], probability: weight / total}))
    .sort((a, b) => b.probability - a.probability).slice(0, TOP_CLASSES);
}

function heading(answer) {
  // a result's heading: its method (wrapping at underscores), "signed" where it is, the summary on hover
  const node = element("h3", {title: answer.summary}, [methodName(answer.explanation.method)]);
  if (answer.explanation.signed) node.append(element("span", {className: "tag", text: "signed"}));
  return node;
}

function freeDownloads() {
  for (const url of objectUrls) URL.revokeObjectURL(url);
  objectUrls = [];
}

async function run(tab, path, body, render) {
  const button = $(`${tab}-run`);
  button.disabled = true;
  status(tab, "Explaining…", "busy");
  try {
    const data = await post(path, body);
    freeDownloads();
    render(data, body);
  } catch (error) {
    status(tab, error.message, "error");
  } finally {
    button.disabled = false;
  }
}

// -- image tab ----------------------------------------------------------------------------------------------
const imageState = {image: null, target: null, concept: []};

function imageModel() {
  return info.image_models.find((model) => model.name === $("image-model").value);
}

function conceptMode() {
  return document.querySelector("input[name=image-target]:checked").value === "concept";
}

// the methods some image model offers (info.methods also lists the text and pair models' methods)
function imageMethods() {
  return info.methods.filter((method) => info.image_models.some((model) => model.methods.includes(method.name)));
}

function updateImageControls() {
  const model = imageModel();
  const classRadio = document.querySelector("input[name=image-target][value=class]");
  classRadio.disabled = !model.has_classes;  // a model without classes is explained through concepts
  if (!model.has_classes) document.querySelector("input[name=image-target][value=concept]").checked = true;
  const concept = conceptMode();
  $("concept-box").hidden = !concept;
  for (const method of imageMethods()) {
    const box = document.querySelector(`input[name=image-method][value=${method.name}]`);
    box.disabled = !model.methods.includes(method.name) || (concept && !method.concept);
    box.parentElement.classList.toggle("off", box.disabled);
  }
  const usable = info.methods.filter((method) => method.concept && model.methods.includes(method.name)).map((method) => method.name);
  $("concept-methods").textContent = `Concepts work with ${usable.join(" and ")}.`;
  $("image-class-label").textContent = !model.has_classes ? "this model has none"
    : imageState.target === null ? "the predicted one" : `${model.classes[imageState.target]} (click another below)`;
}

function explainImage() {
  if (!imageState.image) { status("image", "Choose an image first: upload one or pick a sample.", "error"); return; }
  const methods = chosenMethods("image");
  if (!methods.length) { status("image", "Tick at least one method.", "error"); return; }
  const body = {model: $("image-model").value, image: imageState.image, methods};
  if (conceptMode()) {
    if (!imageState.concept.length) { status("image", "Choose a few example images of the concept first.", "error"); return; }
    body.concept = imageState.concept.map((data) => ({data}));
  } else if (imageState.target !== null) {
    body.target = imageState.target;
  }
  run("image", "/api/explain", body, renderImage);
}

function explainedTarget(model, body, explanation) {
  // what the image tab explained: a class, a feature, a concept, or nothing in particular (target-free methods)
  const index = explanation.target[0];
  if (body.concept) return `concept (${body.concept.length} example${body.concept.length === 1 ? "" : "s"})`;
  if (!model.has_classes && body.target === undefined) return "nothing in particular (these methods use no target)";
  return model.has_classes ? model.classes[index] : `feature ${index}`;
}

function renderImage(data, body) {
  const model = info.image_models.find((entry) => entry.name === data.model);
  const first = data.results[0].explanation;
  const top = model.has_classes ? topClasses(first.logits[0], model.classes) : [];
  const target = explainedTarget(model, body, first);
  $("image-top").hidden = !top.length;
  const chips = $("image-classes");
  chips.replaceChildren();
  for (const entry of top) {
    const chip = element("button", {type: "button", className: "chip", text: `${entry.name} ${(entry.probability * 100).toFixed(1)} %`});
    chip.classList.toggle("active", !body.concept && entry.index === first.target[0]);
    chip.addEventListener("click", () => {
      imageState.target = entry.index;
      document.querySelector("input[name=image-target][value=class]").checked = true;
      updateImageControls();
      explainImage();
    });
    chips.append(chip);
  }
  const cards = $("image-results");
  cards.replaceChildren(element("article", {className: "card input"}, [
    element("h3", {text: "input"}),
    element("img", {className: "overlay", src: data.input, alt: "the image as the model sees it"}),
    element("p", {className: "hint", text: `as ${model.name} sees it: ${model.input_size.join(" x ")} px`}),
  ]));
  for (const answer of data.results) {
    const explanation = answer.explanation;
    const stem = `${explanation.method}_${target.replace(/[^A-Za-z0-9-]+/g, "_")}`;
    const card = mapCard(explanation.method, answer.view, stem, explanation.scores.image[0], explanation,
                         [element("p", {className: "time", text: seconds(answer.seconds)})]);
    card.querySelector("h3").replaceWith(heading(answer));
    cards.append(card);
  }
  status("image", `Explained ${target} with ${data.results.length} method${data.results.length > 1 ? "s" : ""} in ${seconds(data.seconds)}.`, "done");
}

function setUpImage() {
  const select = $("image-model");
  for (const model of info.image_models) select.append(element("option", {value: model.name, text: model.title}));
  select.addEventListener("change", () => { imageState.target = null; updateImageControls(); });
  methodBoxes($("image-methods"), imageMethods(), "image");
  imagePicker("image", imageState);
  for (const radio of document.querySelectorAll("input[name=image-target]")) radio.addEventListener("change", updateImageControls);
  $("concept-files").addEventListener("change", async (event) => {
    const files = [...event.target.files];
    if (files.length > info.limits.max_concept_images) {
      status("image", `At most ${info.limits.max_concept_images} example images.`, "error");
      return;
    }
    try {
      imageState.concept = await Promise.all(files.map(readFile));
      $("concept-count").textContent = `${files.length} example image${files.length > 1 ? "s" : ""}`;
    } catch (error) {
      status("image", error.message, "error");
    }
  });
  $("image-form").addEventListener("submit", (event) => { event.preventDefault(); explainImage(); });
  updateImageControls();
}

// -- text tab -----------------------------------------------------------------------------------------------
const textState = {target: null};

function textChips() {
  const chips = $("text-classes");
  chips.replaceChildren();
  const choices = [{index: null, name: "predicted"}, ...info.text_model.classes.map((name, index) => ({index, name}))];
  for (const choice of choices) {
    const chip = element("button", {type: "button", className: "chip", text: choice.name});
    chip.classList.toggle("active", choice.index === textState.target);
    chip.addEventListener("click", () => { textState.target = choice.index; textChips(); });
    chips.append(chip);
  }
}

function renderText(data) {
  const results = $("text-results");
  const first = data.results[0].explanation;
  const classes = info.text_model.classes;
  const probabilities = topClasses(first.logits[0], classes).map((entry) => `${entry.name} ${(entry.probability * 100).toFixed(1)} %`).join(", ");
  const target = classes[first.target[0]];
  results.replaceChildren(element("p", {className: "summary", text: `The model says: ${probabilities}. Explained: ${target}.`}));
  for (const warning of data.warnings) results.append(element("p", {className: "note", text: warning}));
  for (const answer of data.results) {
    const block = element("article", {className: "text-result"});
    const words = element("div", {className: "words"});
    words.innerHTML = answer.view.html;  // the HTML export's rendering (its caption names the method); escaped by the server
    const about = element("p", {className: "time", text: `${answer.explanation.method}: ${answer.summary} · ${seconds(answer.seconds)}`});
    block.append(words, about);
    results.append(block);
  }
  status("text", `Explained ${target} with ${data.results.length} method${data.results.length > 1 ? "s" : ""} in ${seconds(data.seconds)}. Hover a word for its score.`, "done");
}

function setUpText() {
  if (!info.text_model) {
    $("tab-text").disabled = true;
    $("tab-text").title = "this server has no text model";
    return;
  }
  $("text-model").textContent = `Model: ${info.text_model.title}. At most ${info.limits.max_text_chars.toLocaleString()} characters.`;
  $("text-input").maxLength = info.limits.max_text_chars;
  methodBoxes($("text-methods"), info.methods.filter((method) => info.text_model.methods.includes(method.name)), "text");
  textChips();
  $("text-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const methods = chosenMethods("text");
    const text = $("text-input").value;
    if (!text.trim()) { status("text", "Write a text first.", "error"); return; }
    if (!methods.length) { status("text", "Tick at least one method.", "error"); return; }
    const body = {text, methods};
    if (textState.target !== null) body.target = textState.target;
    run("text", "/api/explain-text", body, renderText);
  });
}

// -- image-text tab -----------------------------------------------------------------------------------------
const pairState = {image: null};

function renderPairs(data, body) {
  const results = $("pairs-results");
  results.replaceChildren();
  for (const answer of data.results) {
    const explanation = answer.explanation;
    const title = element("h2", {title: answer.summary}, [methodName(explanation.method)]);
    if (explanation.signed) title.append(element("span", {className: "tag", text: "signed"}));
    title.append(element("span", {className: "time", text: seconds(answer.seconds)}));
    const cards = element("div", {className: "cards"});
    answer.view.pairs.forEach((view, k) => {
      const words = element("p", {className: "words"});
      words.innerHTML = view.html;  // escaped by the server
      const logit = explanation.logits[k][0];
      const caption = element("div", {className: "caption"}, [words, element("p", {className: "hint", text: `logit ${logit === null ? "n/a" : logit.toFixed(2)} · words: ${answer.view.legend}`})]);
      cards.append(mapCard(`“${body.captions[k]}”`, view, `${explanation.method}_caption${k + 1}`, explanation.scores.image[k], explanation, [caption]));
    });
    results.append(title, cards);
  }
  const pairs = data.results[0].view.pairs.length;
  status("pairs", `Explained ${pairs} pair${pairs > 1 ? "s" : ""} with ${data.results.length} method${data.results.length > 1 ? "s" : ""} in ${seconds(data.seconds)}.`, "done");
}

function setUpPairs() {
  if (!info.pair_model) {
    $("tab-pairs").disabled = true;
    $("tab-pairs").title = "this server has no image-text model";
    return;
  }
  $("pairs-model").textContent = `Model: ${info.pair_model.title}. At most ${info.limits.max_captions} captions.`;
  methodBoxes($("pairs-methods"), info.methods.filter((method) => method.pairs), "pairs");
  imagePicker("pairs", pairState);
  $("pairs-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const captions = $("pairs-captions").value.split("\n").map((line) => line.trim()).filter(Boolean);
    const methods = chosenMethods("pairs");
    if (!pairState.image) { status("pairs", "Choose an image first: upload one or pick a sample.", "error"); return; }
    if (!captions.length) { status("pairs", "Write at least one caption.", "error"); return; }
    if (!methods.length) { status("pairs", "Tick at least one method.", "error"); return; }
    run("pairs", "/api/explain-pairs", {image: pairState.image, captions, methods}, renderPairs);
  });
}

// -- generation tab -----------------------------------------------------------------------------------------
const generationState = {image: null};

function renderGeneration(data) {
  const answer = data.results[0];
  const explanation = answer.explanation;
  relevancyGeneration($("generation-results"), explanation, answer.view.palette);  // generation.js: the saved pages' drawing, shared
  const count = explanation.generated_ids.length;
  status("generation", `${explanation.method}: ${count} token${count > 1 ? "s" : ""} explained in ${seconds(data.seconds)}. ` +
         "Choose a generated token (dashed) to see what it read; hover a token for its relevance.", "done");
}

function setUpGeneration() {
  const model = info.language_model;
  if (!model) {
    $("tab-generation").disabled = true;
    $("tab-generation").title = "this server has no language model";
    return;
  }
  $("generation-model").textContent = `Model: ${model.title}. At most ${info.limits.max_text_chars.toLocaleString()} characters.`;
  $("generation-prompt").maxLength = info.limits.max_text_chars;
  $("generation-tokens").max = info.limits.max_new_tokens;
  if (model.reads_images) {  // a vision-language decoder: each generation is about an image
    $("generation-image").hidden = false;
    $("generation-prompt").value = "What is in the image?";
    imagePicker("generation", generationState);
  }
  const methods = $("generation-methods");
  for (const method of model.methods) {
    const radio = element("input", {type: "radio", value: method.name, name: "generation-method"});
    radio.checked = method.name === model.methods[0].name;
    methods.append(element("label", {className: "method", title: method.summary}, [radio, element("span", {text: method.name})]));
  }
  $("generation-forced").addEventListener("change", (event) => {
    $("generation-continuation").disabled = !event.target.checked;
    $("generation-tokens").disabled = event.target.checked;
  });
  $("generation-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const prompt = $("generation-prompt").value;
    const tokens = Number($("generation-tokens").value);
    if (!prompt.trim()) { status("generation", "Write a prompt first.", "error"); return; }
    const body = {prompt, method: document.querySelector("input[name=generation-method]:checked").value};
    if (model.reads_images) {
      if (!generationState.image) { status("generation", "Choose an image first: upload one or pick a sample.", "error"); return; }
      body.image = generationState.image;
    }
    if ($("generation-forced").checked) {
      body.continuation = $("generation-continuation").value;
      if (!body.continuation) { status("generation", "Write the continuation to explain, or untick it to generate.", "error"); return; }
    } else if (!Number.isInteger(tokens) || tokens < 1 || tokens > info.limits.max_new_tokens) {
      status("generation", `Tokens to generate: 1 to ${info.limits.max_new_tokens}.`, "error"); return;
    } else {
      body.max_new_tokens = tokens;
    }
    run("generation", "/api/explain-generation", body, renderGeneration);
  });
}

async function start() {
  for (const tab of document.querySelectorAll("[role=tab]")) tab.addEventListener("click", () => showTab(tab.getAttribute("aria-controls")));
  try {
    const response = await fetch("/api/info");
    info = await response.json();
  } catch (error) {
    status("image", `The server did not answer: ${error.message}`, "error");
    return;
  }
  setUpImage();
  setUpText();
  setUpPairs();
  setUpGeneration();
  document.body.dataset.ready = "true";
}

start();
