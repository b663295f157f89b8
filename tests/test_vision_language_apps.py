"""The command line's `explain-generation --image` and the web page's generation tab on the vision-language families
with an adapter of their own: a tiny random Qwen2-VL (`qwen_vl_models.py`, with `vlm_processor.qwen_processor`) and
a tiny LLaVA-NeXT (`vlm_models.py`, `vlm_processor.tiled_processor`), each saved with `save_pretrained` (model and
processor) to a folder and loaded back by the apps' loader (`relevancy.models.load_vision_language_model`, whose
classes come from the adapters' `layouts`). A given continuation (`--target`) is explained as `relevancy.explain`
explains each of its tokens on the processor's output; a generation's JSON is the library call's; the page holds the
LLaVA-NeXT base tile's map, drawn in headless Chromium beside the tiles' map; the web API answers the library's result;
Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision, Mistral 3 and Pixtral-12B's LLaVA (`vlm_processor.pixtral_processor`) load and
generate too."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch
import transformers
from fastapi.testclient import TestClient
from qwen_vl_models import build as build_qwen
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from test_causal_lm import assert_close_to
from test_serve import LIMITS, refused, scene_png
from test_serve_browser import browser  # noqa: F401  (the browser fixture)
from test_vision_language_generation_cli import image, run  # noqa: F401  (the picture fixture, the command's runner)
from vlm_models import MERGES, build as build_vlm
from vlm_processor import pixtral_processor, qwen_processor, tiled_processor

import relevancy
from relevancy.apps.serve import create_app, load_catalog, make_samples
from relevancy.apps.serve.jobs import image_token_count
from relevancy.apps.serve.limits import open_image
from relevancy.core.files import strict_json
from relevancy.core.pictures import read_image

PROMPT = "what is in the image ?"
#: family -> (model, processor), each built from its seed in float32
MADE = {"qwen2_vl": lambda: (build_qwen("qwen2_vl", torch.float32), qwen_processor()),
        "llava_next": lambda: (build_vlm("llava_next", torch.float32), tiled_processor("llava_next"))}


@pytest.fixture(scope="module", params=list(MADE))
def saved(request, tmp_path_factory) -> tuple[str, Path]:
    """`(family, folder)`: the family's model and processor saved with `save_pretrained`."""
    folder = tmp_path_factory.mktemp(request.param)
    model, processor = MADE[request.param]()
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return request.param, folder




def loaded(folder: Path) -> tuple[torch.nn.Module, object]:
    """The folder's model and processor as transformers reads them."""
    return transformers.AutoModelForImageTextToText.from_pretrained(folder).eval(), transformers.AutoProcessor.from_pretrained(folder)


def test_a_continuation_is_explained_as_explain_explains_each_token(saved, image, capsys, tmp_path):
    """`--target "red star"`: each token's text and image rows (LLaVA-NeXT: and the base tile's) equal `explain` on the
    processor's output for the image and prompt with the tokens before it, that token the target (to 1e-4 of each
    map's maximum, float32); the page is written with the base tile's map where there is one."""
    family, folder = saved
    out = tmp_path / "seen.html"
    code, text, err = run(capsys, PROMPT, "--model", str(folder), "--image", str(image), "--target", "red star", "--json", "--out", str(out))
    assert code == 0, err
    (numbers,) = json.loads(text)
    model, processor = loaded(folder)
    made = dict(processor(images=read_image(str(image)), text=f"{processor.image_token}\n{PROMPT}", return_tensors="pt"))
    start = made["input_ids"].shape[1]
    ids = torch.cat([made["input_ids"], torch.tensor([numbers["generated_ids"]])], 1)
    assert numbers["prompt_length"] == start and len(numbers["generated_ids"]) == 2
    for g, token in enumerate(numbers["generated_ids"]):
        prefix = {**made, "input_ids": ids[:, :start + g], "attention_mask": torch.ones(1, start + g, dtype=torch.long)}
        if "mm_token_type_ids" in made:
            prefix["mm_token_type_ids"] = (prefix["input_ids"] == model.config.image_token_id).int()
        alone = relevancy.explain(model, prefix, method="attnlrp", target=token)
        assert_close_to(torch.tensor(numbers["scores"]["text"][g][:start + g]), alone.scores[0].float(), f"{family} text {g}", 1e-4)
        assert_close_to(torch.tensor(numbers["scores"]["image"][g]), alone.image_scores[0].float(), f"{family} image {g}", 1e-4)
        if family == "llava_next":
            assert_close_to(torch.tensor(numbers["base_scores"][g]), alone.base_scores[0].float(), f"{family} base {g}", 1e-4)
    assert (numbers["base_scores"] is None) == (family != "llava_next")
    page = out.read_text()
    assert "function relevancyGeneration" in page and "generation-base" in page and numbers["image_url"] in page


def test_a_generation_equals_the_library_call(saved, image, capsys):
    family, folder = saved
    code, text, err = run(capsys, PROMPT, "--model", str(folder), "--image", str(image), "--max-new-tokens", "2", "--json",
                          "--method", "cp_lrp")
    assert code == 0, err
    (numbers,) = json.loads(text)
    model, processor = loaded(folder)
    expected = relevancy.explain_generation(model, processor, PROMPT, image=read_image(str(image)), max_new_tokens=2, method="cp_lrp")
    assert numbers == json.loads(json.dumps(strict_json(expected.to_json())))
    assert numbers["kind"] == "VisionLanguageGenerationExplanation" and len(numbers["scores"]["image"]) == len(expected.generated_ids)


def test_the_page_draws_the_base_tiles_map_beside_the_tiles(browser, image, tmp_path):  # noqa: F811
    """A LLaVA-NeXT generation's page (the script the web page's tab shares): two maps over the picture, the tiles' on
    their grid and the base tile's on its 4 x 4, both coloured; choosing another token redraws both."""
    model, processor = MADE["llava_next"]()
    result = relevancy.explain_generation(model, processor, PROMPT, image=read_image(str(image)), continuation="red star")
    page = result.save(tmp_path / "seen.html")
    browser.get(page.resolve().as_uri())
    WebDriverWait(browser, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".generation-image canvas"))
    image_box = browser.find_element(By.CSS_SELECTOR, ".generation-image")
    tiles, base = image_box.find_elements(By.TAG_NAME, "canvas")
    rows, cols = result.image_scores.shape[1:]
    assert (tiles.get_attribute("width"), tiles.get_attribute("height")) == (str(cols), str(rows))
    assert (base.get_attribute("width"), base.get_attribute("height")) == ("4", "4")
    assert base.find_element(By.XPATH, "..").get_attribute("class") == "generation-base"
    read = "const c = arguments[0]; return Array.from(c.getContext('2d').getImageData(0, 0, c.width, c.height).data);"
    first = browser.execute_script(read, base)
    assert len(first) == 4 * 16 and any(value not in (0, 255) for value in first[::4])
    browser.find_elements(By.CSS_SELECTOR, "button.generated-token")[1].click()
    WebDriverWait(browser, 10).until(lambda d: image_box.get_attribute("data-token") == "1")
    assert browser.execute_script(read, base) != first


def test_the_web_page_answers_the_librarys_result_with_the_base_tiles_map(tmp_path):
    """The LLaVA-NeXT folder as the generation tab's model: an upload is answered with the library call's `to_json()`,
    `base_scores` in it; the memory estimate counts the image's placeholders as the processor writes them; a request
    without an image is refused."""
    folder = tmp_path / "llava_next"
    model, processor = MADE["llava_next"]()
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    catalog = load_catalog(["shapes"], text="none", pairs="none", language=str(folder))
    with TestClient(create_app(catalog, make_samples(scenes=1, pairs=1), LIMITS)) as client:
        assert client.get("/api/info").json()["language_model"]["reads_images"] is True
        upload = scene_png(seed=5)
        response = client.post("/api/explain-generation", json={"prompt": PROMPT, "max_new_tokens": 2,
                                                                "image": {"data": base64.b64encode(upload).decode()}})
        assert response.status_code == 200, response.text
        (answer,) = response.json()["results"]
        entry = catalog.language
        expected = relevancy.explain_generation(entry.model, entry.tokenizer, PROMPT, max_new_tokens=2, image=open_image(upload, LIMITS, "the image"))
        assert answer["explanation"] == json.loads(json.dumps(strict_json(expected.to_json())))
        assert len(answer["explanation"]["base_scores"]) == len(expected.generated_ids)
        # the memory estimate's count of the image's tokens: the processor's for this picture's tiles
        assert image_token_count(entry, open_image(upload, LIMITS, "the image")) == int(expected.image_tokens.sum())
        refused(client.post("/api/explain-generation", json={"prompt": PROMPT}), 400, "generates about an image: give one")


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "llava_onevision", "mistral3", "pixtral"])
def test_the_other_families_load_from_their_folders_and_generate(family, image, capsys, tmp_path):
    """Qwen2.5-VL, Qwen3-VL (their processors), LLaVA-OneVision (`tiled_processor`), Mistral 3 and Pixtral
    (`pixtral_processor`), saved and read back: one
    generated token, the JSON the library call's."""
    if family.startswith("qwen"):
        model, processor = build_qwen(family, torch.float32), qwen_processor(family)
    else:
        model = build_vlm(family, torch.float32)
        processor = pixtral_processor(MERGES[family]) if family in MERGES else tiled_processor(family)
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    code, text, err = run(capsys, PROMPT, "--model", str(tmp_path), "--image", str(image), "--max-new-tokens", "1", "--json")
    assert code == 0, err
    model, processor = loaded(tmp_path)
    expected = relevancy.explain_generation(model, processor, PROMPT, image=read_image(str(image)), max_new_tokens=1)
    assert json.loads(text) == [json.loads(json.dumps(strict_json(expected.to_json())))]
