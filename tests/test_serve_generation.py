"""The web page's text-generation tab: its API (`/api/explain-generation`) through FastAPI's test client with a
tiny random Llama saved as a user would, its refusals, and the tab itself (and a saved generation page) in headless
Chromium: generate, choose a generated token, see what it read."""
from __future__ import annotations

import dataclasses
import json

import pytest
from fastapi.testclient import TestClient
from language_models import save_tiny_llama
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from test_serve import LIMITS, live_server, refused
from test_serve_browser import browser, opened  # noqa: F401  (the browser fixture)

import relevancy
from relevancy.core.files import strict_json
from relevancy.models import load_language_model
from relevancy.apps.serve import create_app, load_catalog, make_samples

PROMPT = "the cat sat on"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def catalog(folder):
    return load_catalog(["shapes"], text="none", pairs="none", language=str(folder))


@pytest.fixture(scope="module")
def client(catalog):
    with TestClient(create_app(catalog, make_samples(scenes=2, pairs=1), LIMITS)) as test_client:
        yield test_client


def test_info_names_the_model_its_methods_and_the_limit(client, folder):
    info = client.get("/api/info").json()
    assert info["language_model"]["name"] == str(folder)
    assert [m["name"] for m in info["language_model"]["methods"]] == ["attnlrp", "cp_lrp", "input_x_gradient", "raw_attention",
                                                                     "rollout", "attention_gradcam", "generic_attention", "cdam"]
    assert info["limits"]["max_new_tokens"] == LIMITS.max_new_tokens == 32
    assert client.get("/static/generation.js").text.startswith("/* Draws a generation")


@pytest.mark.parametrize("method", ["attnlrp", "input_x_gradient", "generic_attention"])
def test_the_rows_are_the_librarys(client, catalog, method):
    response = client.post("/api/explain-generation", json={"prompt": PROMPT, "max_new_tokens": 4, "method": method})
    assert response.status_code == 200, response.text
    (answer,) = response.json()["results"]
    entry = catalog.language
    expected = relevancy.explain_generation(entry.model, entry.tokenizer, PROMPT, max_new_tokens=4, method=method)
    assert answer["explanation"] == json.loads(json.dumps(strict_json(expected.to_json())))  # the same call's to_json()
    assert (answer["explanation"]["relevance_total"] is None) == (method != "attnlrp")
    signed = method != "generic_attention"
    assert len(answer["view"]["palette"]) == (101 if signed else 51)  # unsigned: one half


def test_a_continuation(client):
    answered = client.post("/api/explain-generation", json={"prompt": PROMPT, "continuation": " the mat"}).json()["results"][0]["explanation"]
    assert answered["text"] == " the mat" and len(answered["scores"]["text"]) == len(answered["generated_ids"])


@pytest.mark.parametrize("body, status, words", [
    ({"prompt": PROMPT, "method": "lrp"}, 400, ("unknown method 'lrp'", "attnlrp, cp_lrp, input_x_gradient, raw_attention")),
    ({"prompt": PROMPT, "method": "atnlrp"}, 400, ("Did you mean 'attnlrp'?",)),
    ({"prompt": PROMPT, "max_new_tokens": 0}, 400, ("max_new_tokens must be between 1 and 32",)),
    ({"prompt": PROMPT, "max_new_tokens": 33}, 400, ("max_new_tokens must be between 1 and 32",)),
    ({"prompt": PROMPT, "max_new_tokens": "8"}, 422, ("max_new_tokens",)),
    ({"prompt": " "}, 400, ("the prompt is empty",)),
    ({"prompt": "x" * 301}, 413, ("the prompt has 301 characters; the limit is 300",)),
    ({"prompt": PROMPT, "continuation": " cat" * 40}, 400, ("the continuation is 40 tokens; the limit is 32",)),
    ({"prompt": PROMPT, "temperature": 0.7}, 422, ("temperature",)),
    ({"prompt": PROMPT, "image": {"sample": "scene-1"}}, 400, ("model reads text only: leave the image out",)),
])
def test_bad_requests_are_one_line_errors(client, body, status, words):
    refused(client.post("/api/explain-generation", json=body), status, *words)


def test_a_server_without_a_language_model_says_so():
    catalog = load_catalog(["shapes"], text="none", pairs="none", language="none")
    with TestClient(create_app(catalog, make_samples(scenes=1, pairs=1), LIMITS)) as client:
        assert client.get("/api/info").json()["language_model"] is None
        refused(client.post("/api/explain-generation", json={"prompt": PROMPT}), 404, "no language model")


def test_a_named_model_that_cannot_load_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such folder"):
        load_catalog(["shapes"], text="none", pairs="none", language=str(tmp_path / "missing"))


def test_the_limit_is_a_serve_option(capsys):
    from relevancy.apps.cli import main

    assert main(["serve", "--text-model", "none", "--clip-model", "none", "--language-model", "none", "--max-new-tokens", "300"]) == 2
    assert "--max-new-tokens must be between 1 and 256, got 300" in capsys.readouterr().err


# -- in a browser ------------------------------------------------------------------------------------------------
def chosen_row(driver) -> list[tuple[str, str | None]]:
    """(token, relevance shown, None where none is) of every token of the drawn generation."""
    return driver.execute_script(
        "return [...document.querySelectorAll('.relevancy-generation [data-position]')]"
        ".map(s => [s.textContent, s.dataset.relevance === undefined ? null : s.dataset.relevance])")


def test_the_tab_generates_and_shows_what_a_chosen_token_read(browser, catalog):  # noqa: F811
    with live_server(create_app(catalog, make_samples(scenes=1, pairs=1), dataclasses.replace(LIMITS, max_new_tokens=5))) as url:
        wait = opened(browser, url)
        browser.find_element(By.ID, "tab-generation").click()
        prompt = browser.find_element(By.ID, "generation-prompt")
        prompt.clear()
        prompt.send_keys(PROMPT)
        assert browser.find_element(By.ID, "generation-tokens").get_attribute("max") == "5"
        tokens = browser.find_element(By.ID, "generation-tokens")
        tokens.clear()
        tokens.send_keys("3")
        browser.find_element(By.ID, "generation-run").click()
        wait.until(lambda d: "explained" in d.find_element(By.ID, "generation-status").text)
    generated = browser.find_elements(By.CSS_SELECTOR, "#generation-results button.generated-token")
    assert len(generated) == 3
    start = len(chosen_row(browser)) - 3
    drawn = chosen_row(browser)
    assert all(shown is not None for _, shown in drawn[:start]) and all(shown is None for _, shown in drawn[start:])
    generated[2].click()  # the third token read the prompt and the two tokens before it
    assert browser.find_element(By.ID, "generation-results").get_attribute("data-chosen") == "2"
    drawn = chosen_row(browser)  # a token of no text (a byte of a character the next completes) counts with that one
    assert all((shown is None) == (token == "") for token, shown in drawn[: start + 2]) and drawn[start + 2][1] is None
    assert "why" in browser.find_element(By.CSS_SELECTOR, "#generation-results .generation-caption").text


def test_a_saved_page_works_offline_in_a_browser(browser, folder, tmp_path):  # noqa: F811
    model, tokenizer = load_language_model(str(folder))
    page = relevancy.explain_generation(model, tokenizer, PROMPT, max_new_tokens=3).save(tmp_path / "generation.html")
    browser.get(page.as_uri())
    wait = WebDriverWait(browser, 30)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "button.generated-token"))
    buttons = browser.find_elements(By.CSS_SELECTOR, "button.generated-token")
    buttons[-1].click()
    assert browser.find_element(By.CSS_SELECTOR, ".relevancy-generation").get_attribute("data-chosen") == str(len(buttons) - 1)
    drawn = chosen_row(browser)
    assert [shown is not None for _, shown in drawn] == [token != "" for token, _ in drawn[:-1]] + [False]


def test_a_characters_byte_tokens_are_shown_with_it_in_a_browser(browser, folder, tmp_path):  # noqa: F811
    """The emoji's four byte tokens are generated one by one: a row that read all of them colours the emoji with their
    sum; a row that stops inside it shows the bytes read so far as U+FFFD, with theirs."""
    model, tokenizer = load_language_model(str(folder))
    result = relevancy.explain_generation(model, tokenizer, PROMPT, continuation=" 😀 ok", method="cp_lrp")
    start = result.prompt_length
    assert result.tokens[start:start + 5] == [" ", "", "", "", "😀"]  # the space, then the emoji's bytes
    browser.get(result.save(tmp_path / "generation.html").as_uri())
    WebDriverWait(browser, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, "button.generated-token"))
    buttons = browser.find_elements(By.CSS_SELECTOR, "button.generated-token")
    buttons[5].click()  # " ok"'s space read the whole emoji
    drawn = chosen_row(browser)
    assert [shown for _, shown in drawn[start + 1:start + 4]] == [None] * 3 and drawn[start + 4][0] == "😀"
    assert float(drawn[start + 4][1]) == pytest.approx(float(result.scores[5, start + 1:start + 5].sum()), rel=1e-3)
    buttons[4].click()  # the emoji's last byte read its first three
    drawn = chosen_row(browser)
    assert [token for token, _ in drawn[start + 1:start + 5]] == ["", "", "\ufffd", "😀"]
    assert drawn[start + 1][1] is None and drawn[start + 2][1] is None
    assert float(drawn[start + 3][1]) == pytest.approx(float(result.scores[4, start + 1:start + 4].sum()), rel=1e-3)
