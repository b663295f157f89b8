"""The page in a real browser: headless Chromium (Debian's `chromium` and `chromium-driver`, driven by selenium)
opens the page served on loopback, uploads a scene, picks a method, and sees the map appear; opens a saved generation
page and a decoder's explain page and sees their colour scales and line breaks.

CI installs the browser (`.ci/run`); where it is missing this test fails and says what to install.
"""
from __future__ import annotations

import base64
import io
import json
import shutil

import numpy as np
import pytest
from PIL import Image
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from relevancy.apps.serve import create_app, load_catalog, make_samples
from test_serve import live_server, scene_png

CHROMIUM = ("chromium", "chromium-browser")
#: Chromium as the machine's closed network wants it: no background connections, no first-run work
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--window-size=1400,1000")


@pytest.fixture(scope="module")
def browser():
    binary = next((path for path in map(shutil.which, CHROMIUM) if path), None)
    driver_path = shutil.which("chromedriver")
    if binary is None or driver_path is None:
        pytest.fail("the browser test needs Debian's Chromium and its driver: apt-get install -y chromium chromium-driver "
                    f"(found chromium: {binary}, chromedriver: {driver_path}); .ci/run installs them")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in FLAGS:
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(driver_path))
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def url():
    app = create_app(load_catalog(["shapes"], text="none", pairs="none", language="none"), make_samples(scenes=2, pairs=1))
    with live_server(app) as address:
        yield address


def opened(driver, url: str) -> WebDriverWait:
    """The page loaded and ready (its models and samples listed); a wait of up to 60 s for what comes next."""
    wait = WebDriverWait(driver, 60)
    driver.get(url)
    wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true")
    return wait


def shown_png(driver, element) -> Image.Image:
    source = element.get_attribute("src")
    assert source.startswith("data:image/png;base64,")
    return Image.open(io.BytesIO(base64.b64decode(source.split(",", 1)[1])))


def test_upload_a_scene_pick_a_method_and_see_its_map(browser, url, tmp_path):
    scene = tmp_path / "scene.png"
    scene.write_bytes(scene_png(seed=3))
    wait = opened(browser, url)
    assert browser.find_element(By.ID, "tab-text").get_attribute("disabled") is not None  # no text model on this server

    browser.find_element(By.ID, "image-file").send_keys(str(scene))
    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "#image-chosen figcaption").text == "scene.png")
    browser.find_element(By.CSS_SELECTOR, "input[name=image-method][value=generic_attention]").click()  # off (the default)
    browser.find_element(By.CSS_SELECTOR, "input[name=image-method][value=cdam]").click()  # on
    browser.execute_script("window.downloads = []; const make = URL.createObjectURL;"  # keep the download links' blobs
                           "URL.createObjectURL = (blob) => { window.downloads.push(blob); return make(blob); };")
    browser.find_element(By.ID, "image-run").click()
    wait.until(lambda d: "Explained" in d.find_element(By.ID, "image-status").text)

    cards = browser.find_elements(By.CSS_SELECTOR, "#image-results .card")
    assert [c.find_element(By.TAG_NAME, "h3").get_attribute("title") for c in cards][1].startswith("class-discriminative")
    assert [c.find_element(By.TAG_NAME, "h3").text for c in cards] == ["input", "cdamsigned"]  # the name and its tag
    overlay = cards[1].find_element(By.CSS_SELECTOR, "img.overlay")
    assert overlay.is_displayed() and overlay.size["width"] > 150
    assert shown_png(browser, overlay).size == (64, 64)
    assert browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth", overlay) == 64
    assert "blue: against" in cards[1].find_element(By.CLASS_NAME, "legend").text
    links = {a.text: a.get_attribute("download") for a in cards[1].find_elements(By.CSS_SELECTOR, ".downloads a")}
    assert set(links) == {"PNG", "JSON", ".npy"} and all(name.startswith("cdam_") for name in links.values())
    fetched = dict(zip(("JSON", ".npy"), map(bytes, browser.execute_async_script(  # the blobs behind the last card's links
        "const done = arguments[arguments.length - 1];"
        "Promise.all(window.downloads.slice(-2).map((b) => b.arrayBuffer()))"
        ".then((all) => done(all.map((b) => Array.from(new Uint8Array(b)))));"))))
    answered = json.loads(fetched["JSON"])  # the download is the API's to_json() of the result
    assert answered["schema"] == "relevancy.explanation/1" and answered["method"] == "cdam"
    assert np.load(io.BytesIO(fetched[".npy"])).tolist() == np.float32(answered["scores"]["image"][0]).tolist()

    chips = browser.find_elements(By.CSS_SELECTOR, "#image-classes .chip")
    assert len(chips) == 5 and "active" in chips[0].get_attribute("class")
    second = chips[1].text.rsplit(" ", 2)[0]
    chips[1].click()  # explain the second class instead
    wait.until(lambda d: f"Explained {second}" in d.find_element(By.ID, "image-status").text)
    assert "active" in browser.find_elements(By.CSS_SELECTOR, "#image-classes .chip")[1].get_attribute("class")


def test_a_file_that_is_not_an_image_shows_the_servers_error(browser, url, tmp_path):
    fake = tmp_path / "photo.png"
    fake.write_bytes(b"this is text, whatever its name says")
    wait = opened(browser, url)
    browser.find_element(By.ID, "image-file").send_keys(str(fake))
    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "#image-chosen figcaption").text == "photo.png")
    browser.find_element(By.ID, "image-run").click()
    wait.until(lambda d: "error" in d.find_element(By.ID, "image-status").get_attribute("class"))
    assert "not an image in an accepted format" in browser.find_element(By.ID, "image-status").text
    assert browser.find_elements(By.CSS_SELECTOR, "#image-results .card") == []


def test_nothing_hidden_shows_and_no_image_shows_before_one_is_chosen(browser, url):
    """`hidden` wins over every display rule (a flex figure once showed a broken-image icon in both image tabs)."""
    wait = opened(browser, url)
    shown_while_hidden = "return [...document.querySelectorAll('[hidden]')].filter(e => getComputedStyle(e).display !== 'none').map(e => e.id || e.tagName)"
    display = "return getComputedStyle(document.getElementById(arguments[0])).display"
    assert browser.execute_script(shown_while_hidden) == []
    assert browser.execute_script(display, "image-chosen") == browser.execute_script(display, "pairs-chosen") == "none"
    browser.find_element(By.CSS_SELECTOR, "#image-samples .sample").click()
    wait.until(lambda d: d.execute_script(display, "image-chosen") != "none")
    picture = browser.find_element(By.CSS_SELECTOR, "#image-chosen img")
    wait.until(lambda d: d.execute_script("return arguments[0].complete && arguments[0].naturalWidth", picture) > 0)
    assert browser.execute_script(shown_while_hidden) == []


def test_markup_in_a_file_name_and_in_an_error_is_shown_as_text(browser, url, tmp_path):
    hostile = tmp_path / "<img src=x onerror=window.pwned=1>.png"
    hostile.write_bytes(b"<script>window.pwned = 2</script>")
    wait = opened(browser, url)
    browser.find_element(By.ID, "image-file").send_keys(str(hostile))
    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "#image-chosen figcaption").text == hostile.name)
    browser.find_element(By.ID, "image-run").click()
    wait.until(lambda d: "error" in d.find_element(By.ID, "image-status").get_attribute("class"))
    assert browser.find_elements(By.CSS_SELECTOR, "#image-chosen figcaption *, #image-status *") == []  # text, no elements
    assert browser.execute_script("return typeof window.pwned") == "undefined"
    assert browser.execute_script("return document.querySelectorAll('img[src=x], script:not([src])').length") == 0


def test_a_saved_generation_page_colours_what_each_token_read_with_a_scale(browser, tmp_path):
    """The saved page of a generation (its inline script): line breaks shown as ↵, a colour scale under the map whose
    labels follow the chosen token's row; and the explain page of a decoder, titled by the explained token."""
    import torch
    import transformers
    from language_models import tiny_tokenizer

    import relevancy

    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      initializer_range=0.2, eos_token_id=tokenizer.eos_token_id)
    model = transformers.LlamaForCausalLM(config).eval()
    result = relevancy.explain_generation(model, tokenizer, "the cat sat.\nwhere does", method="attnlrp", continuation=" the cat")
    page = result.save(tmp_path / "generation.html")
    browser.get(page.as_uri())
    WebDriverWait(browser, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".relevancy-generation button.generated-token"))
    scale = browser.find_element(By.CSS_SELECTOR, ".relevancy-generation .relevancy-scale")
    assert scale.is_displayed() and scale.size["width"] > 100
    bar = scale.find_elements(By.TAG_NAME, "span")[1]
    assert "linear-gradient" in bar.value_of_css_property("background-image") and bar.size["width"] >= 150
    labels = lambda: [span.text for span in scale.find_elements(By.TAG_NAME, "span")]  # noqa: E731
    first = float(result.scores[0].abs().max())
    assert float(labels()[0]) == pytest.approx(-first, rel=1e-2) and float(labels()[2]) == pytest.approx(first, rel=1e-2)
    assert "\u21b5" in browser.find_element(By.CSS_SELECTOR, ".relevancy-generation").text  # the line break, visible
    buttons = browser.find_elements(By.CSS_SELECTOR, ".relevancy-generation button.generated-token")
    buttons[-1].click()
    last = float(result.scores[-1].abs().max())
    WebDriverWait(browser, 10).until(lambda d: float(labels()[2]) == pytest.approx(last, rel=1e-2))
    assert browser.find_element(By.CSS_SELECTOR, ".relevancy-generation").get_attribute("data-chosen") == str(len(buttons) - 1)

    expl = relevancy.explain(model, tokenizer(["the cat sat.\nwhere does the cat live?"], return_tensors="pt"),
                             method="attnlrp", tokenizer=tokenizer)
    browser.get(expl.save(tmp_path / "prompt.html").as_uri())
    token = tokenizer.decode([int(expl.target[0])])
    assert browser.title == f"relevancy: attnlrp: {token!r} ({float(expl.logits[0, expl.target[0]]):.2f})"
    text = browser.find_element(By.CSS_SELECTOR, ".relevancy-text")
    assert text.text.startswith(f"attnlrp: {token!r}") and "\u21b5" in text.text and "\u010a" not in text.text
    scale = text.find_element(By.CSS_SELECTOR, ".relevancy-scale")
    assert scale.is_displayed() and "linear-gradient" in scale.find_elements(By.TAG_NAME, "span")[1].value_of_css_property("background-image")


def test_a_saved_vision_language_generation_shows_the_clicked_words_image_map(browser, tmp_path):
    """The saved page of a tiny LLaVA's generation: the picture with the chosen word's map over it, each patch drawn
    in the palette colour of its share of that map's largest |score|; clicking another word draws its map; the
    image's placeholder tokens shown as one [image] mark."""
    from vlm_models import build
    from vlm_processor import picture, processor

    import relevancy
    from relevancy.results.generation_page import palette

    result = relevancy.explain_generation(build("llava"), processor(), "what is in the image ?", image=picture(2),
                                          max_new_tokens=3, method="attnlrp")
    browser.get(result.save(tmp_path / "generation.html").as_uri())
    wait = WebDriverWait(browser, 30)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".relevancy-generation .generation-image canvas"))
    box = browser.find_element(By.CSS_SELECTOR, ".relevancy-generation")
    image = box.find_element(By.CSS_SELECTOR, ".generation-image")
    assert image.is_displayed() and image.find_element(By.TAG_NAME, "img").get_attribute("src") == result.image_url
    plain = image.find_element(By.CSS_SELECTOR, "img.generation-picture")  # the picture in its own colours, beside the map
    assert plain.is_displayed() and plain.get_attribute("src") == result.image_url and "grayscale" not in plain.get_attribute("style")
    assert box.text.count("[image]") == 1 and "<image>" not in box.text
    colours = palette(result.signed)
    steps = (len(colours) - 1) // 2
    for g, button in reversed(list(enumerate(box.find_elements(By.CSS_SELECTOR, "button.generated-token")))):
        button.click()
        wait.until(lambda d: image.get_attribute("data-token") == str(g))
        scores = result.image_scores[g]
        bound = float(scores.abs().max())
        assert float(image.get_attribute("data-bound")) == pytest.approx(bound, rel=1e-3)
        drawn = browser.execute_script("const c = arguments[0]; return Array.from(c.getContext('2d').getImageData(0, 0, c.width, c.height).data);",
                                       image.find_element(By.TAG_NAME, "canvas"))
        expected = [colours[min(max(round(steps + steps * float(v) / bound), 0), len(colours) - 1)][0] for v in scores.flatten()]
        assert ["#%02x%02x%02x" % tuple(drawn[4 * k:4 * k + 3]) for k in range(len(expected))] == expected, g
