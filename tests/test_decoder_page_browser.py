"""A decoder explanation's saved page in a real browser (headless Chromium, as tests/test_serve_browser.py): the
prompt, the answer span's own tokens and the latent heat maps (layers x tokens, layers x heads) are shown, each
cell coloured by its value with the value in its tooltip; with the first token excluded it is not shown."""
from __future__ import annotations

import torch
from language_models import build
from selenium.webdriver.common.by import By
from test_causal_lm import Characters, batch
from test_serve_browser import browser  # noqa: F401 (the fixture)

import relevancy


def test_the_span_and_latent_views_render(browser, tmp_path):  # noqa: F811
    model = build("llama")
    expl = relevancy.explain(model, batch("single0"), method="attnlrp", target="+6A", tokenizer=Characters(), latent=True,
                             exclude="first")
    page = expl.save(tmp_path / "decoder.html")
    browser.get(page.resolve().as_uri())
    tables = browser.find_elements(By.TAG_NAME, "table")
    assert len(tables) == 2 and all(table.is_displayed() for table in tables)
    cells = tables[0].find_elements(By.TAG_NAME, "td")
    assert len(cells) == 3 * 10  # layers 0..2 x (7 prompt tokens + 3 span tokens)
    values = torch.tensor([float(cell.get_attribute("title")) for cell in cells]).view(3, 10)
    assert torch.allclose(values, expl.latent.layers[:, 0].float(), rtol=1e-3, atol=1e-4)
    assert values[:, 0].abs().sum() == 0  # the excluded first token
    colours = {cell.value_of_css_property("background-color") for cell in cells}
    assert len(colours) > 5  # coloured by value, not one colour
    heads = tables[1].find_elements(By.TAG_NAME, "td")
    assert len(heads) == 2 * 4
    text = browser.find_element(By.TAG_NAME, "body").text
    assert "answer span" in text and "residual stream, layer x token" in text and "attention heads, layer x head" in text
    shown = [span.text for span in browser.find_elements(By.CSS_SELECTOR, "span[title]")]
    assert len(shown) == 6 + 3  # the prompt's tokens but the first, then the span's three tokens
