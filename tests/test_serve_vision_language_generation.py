"""The web page's generation tab with a vision-language decoder (the tiny random LLaVA of `vlm_models.py` saved
with its offline processor): the API takes an uploaded image or a sample and answers the library call's
`to_json()`, refuses a request without an image and an image over the limits; in headless Chromium the tab takes
an uploaded picture, generates, and clicking a generated word shows its image map."""
from __future__ import annotations

import base64
import dataclasses
import json

import pytest
from fastapi.testclient import TestClient
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from test_serve import LIMITS, live_server, refused, scene_png
from test_serve_browser import browser, opened  # noqa: F401  (the browser fixture)
from vlm_processor import saved_llava

import relevancy
from relevancy.core.files import strict_json
from relevancy.apps.serve import create_app, load_catalog, make_samples
from relevancy.apps.serve.limits import Limits, open_image

PROMPT = "what is in the image ?"


@pytest.fixture(scope="module")
def catalog(tmp_path_factory):
    return load_catalog(["shapes"], text="none", pairs="none", language=str(saved_llava(tmp_path_factory.mktemp("llava"))))


@pytest.fixture(scope="module")
def client(catalog):
    with TestClient(create_app(catalog, make_samples(scenes=2, pairs=1), LIMITS)) as test_client:
        yield test_client


def test_info_says_the_model_reads_images_and_offers_its_methods(client):
    model = client.get("/api/info").json()["language_model"]
    assert model["reads_images"] is True and [m["name"] for m in model["methods"]] == ["attnlrp", "cp_lrp", "input_x_gradient", "token_activation_map"]


def test_an_upload_answers_the_librarys_to_json(client, catalog):
    upload = scene_png(seed=5)
    body = {"prompt": PROMPT, "max_new_tokens": 3, "image": {"data": base64.b64encode(upload).decode()}}
    response = client.post("/api/explain-generation", json=body)
    assert response.status_code == 200, response.text
    (answer,) = response.json()["results"]
    entry = catalog.language
    expected = relevancy.explain_generation(entry.model, entry.tokenizer, PROMPT, max_new_tokens=3,
                                            image=open_image(upload, LIMITS, "the image"))
    assert answer["explanation"] == json.loads(json.dumps(strict_json(expected.to_json())))
    assert answer["explanation"]["kind"] == "VisionLanguageGenerationExplanation" and len(answer["explanation"]["scores"]["image"]) == 3
    sampled = client.post("/api/explain-generation", json={"prompt": PROMPT, "max_new_tokens": 1, "image": {"sample": "scene-1"}})
    assert sampled.status_code == 200 and sampled.json()["results"][0]["explanation"]["image_url"].startswith("data:image/png")


def test_requests_without_an_image_or_over_the_limits_are_refused(client, catalog):
    refused(client.post("/api/explain-generation", json={"prompt": PROMPT}), 400, "generates about an image: give one")
    refused(client.post("/api/explain-generation", json={"prompt": PROMPT, "method": "rollout", "image": {"sample": "scene-1"}}),
            400, "unknown method 'rollout'", "attnlrp, cp_lrp, input_x_gradient")
    refused(client.post("/api/explain-generation", json={"prompt": PROMPT, "image": {"data": "bm90IGFuIGltYWdl"}}), 415,
            "the image is not an image in an accepted format")
    small = dataclasses.replace(LIMITS, max_pixels=100)
    with TestClient(create_app(catalog, make_samples(scenes=1, pairs=1), small)) as limited:
        body = {"prompt": PROMPT, "image": {"data": base64.b64encode(scene_png(seed=5)).decode()}}
        refused(limited.post("/api/explain-generation", json=body), 413, "pixels; the limit is 100")


def test_the_tab_uploads_an_image_and_clicking_a_word_shows_its_map(browser, catalog, tmp_path):  # noqa: F811
    scene = tmp_path / "scene.png"
    scene.write_bytes(scene_png(seed=6))
    with live_server(create_app(catalog, make_samples(scenes=2, pairs=1), Limits())) as url:
        wait = opened(browser, url)
        browser.find_element(By.ID, "tab-generation").click()
        assert browser.find_element(By.ID, "generation-image").is_displayed()
        browser.find_element(By.ID, "generation-file").send_keys(str(scene))
        wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "#generation-chosen figcaption").text == "scene.png")
        browser.find_element(By.ID, "generation-tokens").clear()
        browser.find_element(By.ID, "generation-tokens").send_keys("3")
        browser.find_element(By.ID, "generation-run").click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#generation-results .generation-image canvas"))
        image = browser.find_element(By.CSS_SELECTOR, "#generation-results .generation-image")
        assert image.find_element(By.TAG_NAME, "img").get_attribute("src").startswith("data:image/png;base64,")
        buttons = browser.find_elements(By.CSS_SELECTOR, "#generation-results button.generated-token")
        assert len(buttons) == 3 and image.get_attribute("data-token") == "0"
        buttons[2].click()
        WebDriverWait(browser, 10).until(lambda d: image.get_attribute("data-token") == "2")
        drawn = browser.execute_script("const c = arguments[0]; return Array.from(c.getContext('2d').getImageData(0, 0, c.width, c.height).data);",
                                       image.find_element(By.TAG_NAME, "canvas"))
        assert len(drawn) == 4 * 16 and any(value not in (0, 255) for value in drawn[::4])  # a 4 x 4 grid, coloured
