/* Draws a generation explained by relevancy: `data` is its GenerationExplanation.to_json() (the schema
   relevancy.explanation/1), `palette` the [background, text colour] steps of the text views. The prompt, then the
   generated tokens as buttons; choosing one colours every token before it by its relevance for that token (its
   row). A vision-language decoder's generation (scores.image, image_url) also shows its picture as it is and, beside
   it, the chosen token's map over a greyed copy, drawn on the patch grid in the same colours, and its image placeholder tokens as one
   [image] mark; where the result has a base tile's map too (base_scores: LLaVA-NeXT, LLaVA-OneVision), that map over
   another copy beside it, both maps coloured on one scale (their largest |score|). Plain script, no library, no
   network: used by saved pages and by the web page's generation tab. */
function relevancyGeneration(box, data, palette) {
  var steps = data.signed ? (palette.length - 1) / 2 : palette.length - 1;
  var shown = function (value) { return value === null ? 'n/a' : Number(value.toPrecision(4)); };
  var rows = data.scores.text.map(function (row, g) { return row.slice(0, data.prompt_length + g); });
  box.textContent = '';
  var caption = document.createElement('div');
  caption.className = 'generation-caption';
  var text = document.createElement('div');
  text.style.whiteSpace = 'pre-wrap';
  text.style.lineHeight = '1.9';
  var placeholders = data.image_tokens || [];
  function written(text) { return text.replace(/\n/g, '\u21b5\n'); }  // a line break shown, and kept
  var spans = data.tokens.map(function (token, k) {
    var span = document.createElement(k < data.prompt_length ? 'span' : 'button');
    span.textContent = written(token);
    if (placeholders[k]) {  // the image's tokens: their relevance is the picture's, drawn beside
      span.textContent = placeholders[k - 1] ? '' : '[image] ';
      span.style.display = placeholders[k - 1] ? 'none' : '';
    }
    span.dataset.position = k;
    if (k >= data.prompt_length) {
      span.type = 'button';
      span.className = 'generated-token';
      span.title = 'show what this token read';
      span.style.cssText = 'font:inherit;border:1px dashed #888;background:none;padding:0 1px;margin:0;cursor:pointer;white-space:pre-wrap';
      span.addEventListener('click', function () { choose(k - data.prompt_length); });
    }
    text.appendChild(span);
    return span;
  });
  // the colour scale under the map: the palette from its lowest to its highest colour, labelled per chosen row
  var scale = document.createElement('div');
  scale.className = 'relevancy-scale';
  scale.style.cssText = 'display:flex;align-items:center;gap:6px;font-size:small;color:#444;margin-top:4px';
  var low = document.createElement('span');
  var bar = document.createElement('span');
  bar.style.cssText = 'display:inline-block;width:160px;height:10px;border:1px solid #ccc';
  bar.style.background = 'linear-gradient(to right, ' + palette.map(function (pair) { return pair[0]; }).join(', ') + ')';
  var high = document.createElement('span');
  scale.appendChild(low);
  scale.appendChild(bar);
  scale.appendChild(high);
  var image = data.scores.image ? document.createElement('div') : null;
  var maps = [];  // [grids per generated token, canvas]: the image's map, and the base tile's where there is one
  function overlaid(grids, alt) {
    // the chosen token's map on its patch grid over a greyed copy of the picture
    var overlay = document.createElement('div');
    overlay.style.cssText = 'position:relative;display:inline-block';
    var picture = document.createElement('img');
    picture.src = data.image_url || '';
    picture.alt = alt;
    picture.style.cssText = 'width:224px;height:224px;image-rendering:auto;filter:grayscale(0.6)';
    var grid = grids[0] || [[0]];
    var canvas = document.createElement('canvas');
    canvas.width = grid[0].length;
    canvas.height = grid.length;
    canvas.style.cssText = 'position:absolute;left:0;top:0;width:224px;height:224px;opacity:0.6';
    overlay.appendChild(picture);
    overlay.appendChild(canvas);
    image.appendChild(overlay);
    maps.push([grids, canvas]);
    return overlay;
  }
  if (image) {
    image.className = 'generation-image';
    image.style.cssText = 'display:inline-flex;gap:8px;margin:6px 0;line-height:0';
    // the picture as the model saw it, in its own colours (the words name them), and beside it the chosen token's
    // map over a greyed copy (and the base tile's map over another)
    var plain = document.createElement('img');
    plain.className = 'generation-picture';
    plain.src = data.image_url || '';
    plain.alt = 'the image the model saw';
    plain.style.cssText = 'width:224px;height:224px;image-rendering:auto';
    image.appendChild(plain);
    overlaid(data.scores.image, 'the chosen token\'s map over the image');
    if (data.base_scores) {
      var base = overlaid(data.base_scores, 'the chosen token\'s map of the base tile (the whole image at one tile\'s size)');
      base.className = 'generation-base';
    }
  }
  function largest(map, most) {
    return map.reduce(function (m, line) {
      return line.reduce(function (n, v) { return Math.max(n, Math.abs(v)); }, m);
    }, most);
  }
  function drawImage(g) {
    var bound = maps.reduce(function (most, pair) { return largest(pair[0][g], most); }, 0);
    maps.forEach(function (pair) {
      var context = pair[1].getContext('2d');
      pair[0][g].forEach(function (line, y) {
        line.forEach(function (v, x) { context.fillStyle = colour(v, bound)[0]; context.fillRect(x, y, 1, 1); });
      });
    });
    image.dataset.bound = shown(bound);
    image.dataset.token = g;
    image.title = 'the image\'s relevance for ' + JSON.stringify(data.tokens[data.prompt_length + g]) + ' (patch grid' +
      (data.base_scores ? ', then the base tile\'s' : '') + ', largest |score| ' + shown(bound) + ')';
  }
  function colour(value, bound) {
    var share = bound > 0 ? value / bound : 0;
    var index = data.signed ? Math.round(steps + steps * share) : Math.round(steps * Math.max(share, 0));
    return palette[Math.min(Math.max(index, 0), palette.length - 1)];
  }
  // a character's first byte tokens (text '') are counted with it: their relevance added to the token that completes
  // it, or, where the row stops inside the character, to the last of them, shown as U+FFFD (TextPart.texts' rule)
  function folded(row) {
    var carried = 0;
    return row.map(function (v, k) {
      if (data.tokens[k] === '' && k < row.length - 1) { carried += v; return null; }
      var value = v + carried;
      carried = 0;
      return value;
    });
  }
  function choose(g) {
    var row = folded(rows[g]);
    var bound = row.reduce(function (most, v) { return v === null ? most : Math.max(most, Math.abs(v)); }, 0);
    spans.forEach(function (span, k) {
      var value = k < row.length ? row[k] : null;
      var pair = value === null ? null : colour(value, bound);
      span.style.background = pair ? pair[0] : 'none';
      span.style.color = pair ? pair[1] : '';
      span.style.outline = k === data.prompt_length + g ? '2px solid #000' : '';
      if (!placeholders[k]) { span.textContent = data.tokens[k] === '' && k === row.length - 1 ? '\ufffd' : written(data.tokens[k]); }
      if (value !== null) { span.title = 'relevance ' + shown(value); span.dataset.relevance = shown(value); }
      else {
        delete span.dataset.relevance;
        if (k >= data.prompt_length) { span.title = 'show what this token read'; } else { span.removeAttribute('title'); }
      }
    });
    low.textContent = data.signed ? (-bound).toPrecision(3) : '0';
    high.textContent = bound.toPrecision(3);
    var total = data.relevance_total ? '; relevance total ' + shown(data.relevance_total[g]) : '';
    caption.textContent = data.method + ': why ' + JSON.stringify(data.tokens[data.prompt_length + g]) +
      ' (logit ' + shown(data.logits[g][0]) + total + ')' + (data.signed ? ' - red: for, blue: against' : '') +
      '; choose another generated token (dashed) to see what it read';
    box.dataset.chosen = g;
    if (image) { drawImage(g); }
  }
  box.appendChild(caption);
  if (image) { box.appendChild(image); }
  box.appendChild(text);
  box.appendChild(scale);
  if (rows.length) { choose(0); }
}
