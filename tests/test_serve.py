"""`relevancy serve`'s API through FastAPI's test client: every endpoint, every refusal, the bounded queue and
the time limit, and the server still answering after hostile requests. Also the `serve` command itself."""
from __future__ import annotations

import base64
import io
import json
import os
import struct
import subprocess
import sys
import threading
import time
import zlib
from contextlib import contextmanager
from typing import Iterator

import httpx
import numpy as np
import pytest
import torch
import uvicorn
from fastapi.testclient import TestClient
from PIL import Image

import relevancy
from relevancy.worlds import make_scenes
from relevancy.apps.serve import Limits, create_app, load_catalog, make_samples
from relevancy.apps.serve import jobs
from relevancy.families.base import IMAGE_ENCODER_METHODS, SEED_METHODS
from relevancy.core.files import strict_json

LIMITS = Limits(max_body_bytes=2 * 2**20, max_image_bytes=2**20, max_pixels=1_000_000, max_text_chars=300,
                max_captions=3, max_concept_images=4, max_running=1, max_waiting=2, time_limit_s=60)


@pytest.fixture(scope="module")
def catalog():
    return load_catalog(["shapes"], language="none")  # the text-generation tab: test_serve_generation.py


@pytest.fixture(scope="module")
def samples():
    return make_samples()


@pytest.fixture(scope="module")
def client(catalog, samples):
    with TestClient(create_app(catalog, samples, LIMITS)) as test_client:
        yield test_client


def encoded(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def picture_bytes(pixels: np.ndarray, kind: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=kind)
    return buffer.getvalue()


def scene_png(seed: int = 3) -> bytes:
    """A one-object shapes scene as a PNG file."""
    return picture_bytes(make_scenes(1, seed=seed).pixels[0])


def png_claiming(width: int, height: int) -> bytes:
    """A 1x1 PNG whose header claims `width` x `height` pixels (valid CRC): a decompression bomb's header."""
    raw = bytearray(picture_bytes(np.zeros((1, 1, 3), np.uint8)))
    header = struct.pack(">II", width, height) + bytes(raw[24:29])
    raw[16:29] = header
    raw[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + header))
    return bytes(raw)


def refused(response: httpx.Response, status: int, *words: str) -> str:
    """The response is a one-line JSON error with `status` whose message names every one of `words`."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert "\n" not in response.text
    body = response.json()
    assert list(body) == ["error"] and body["error"]
    for word in words:
        assert word in body["error"], (word, body["error"])
    return body["error"]


def prepared(catalog, raw: bytes) -> torch.Tensor:
    entry = catalog.images["shapes"]
    return entry.prepare([Image.open(io.BytesIO(raw)).convert("RGB")])


# -- the page and its files ----------------------------------------------------------------------------------
def test_page_files_and_docs_are_served_from_memory(client):
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert 'src="/static/app.js"' in page.text and "http" not in page.text.replace('href="/docs"', "")  # nothing from outside
    for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css"), ("swagger-ui-bundle.js", "text/javascript")):
        response = client.get(f"/static/{name}")
        assert response.status_code == 200 and response.headers["content-type"].startswith(kind) and response.content
    docs = client.get("/docs")
    assert docs.status_code == 200 and "/static/swagger-ui-bundle.js" in docs.text and "cdn" not in docs.text.lower()
    schema = client.get("/openapi.json").json()
    assert {"/api/explain", "/api/explain-text", "/api/explain-pairs", "/api/info", "/api/samples/{sample_id}"} <= set(schema["paths"])
    assert "503" in schema["paths"]["/api/explain"]["post"]["responses"]


@pytest.mark.parametrize("path", ["/static/../pyproject.toml", "/static/..%2F..%2Fpyproject.toml", "/static/%2e%2e/README.md",
                                  "/static/index.html/../../setup.py", "/nothing", "/api/samples/..%2F..%2Fetc%2Fpasswd"])
def test_no_request_path_reaches_the_file_system(client, path):
    refused(client.get(path), 404)


def test_info_lists_models_methods_samples_and_limits(client):
    info = client.get("/api/info").json()
    assert [m["name"] for m in info["image_models"]] == ["shapes"]
    assert info["image_models"][0]["classes"][5] == "star" and info["image_models"][0]["input_size"] == [64, 64]
    assert [m["name"] for m in info["methods"]] == list(IMAGE_ENCODER_METHODS)
    assert {m["name"] for m in info["methods"] if m["concept"]} == {"cdam", "token_ablation"}
    assert "lrp" not in {m["name"] for m in info["methods"] if m["pairs"]}
    assert info["text_model"]["classes"] == ["negative", "positive"] and info["pair_model"]["name"] == "shapes-clip"
    assert info["limits"]["max_running"] == 1 and info["limits"]["max_pixels"] == 1_000_000
    ids = [s["id"] for s in info["samples"]]
    assert ids[:6] == [f"scene-{k}" for k in range(1, 7)] and "photo-chelsea" in ids
    assert client.get("/api/health").json()["status"] == "ok"


def test_samples_are_pngs(client, samples):
    for key in ("scene-1", "photo-chelsea"):
        response = client.get(f"/api/samples/{key}")
        assert response.status_code == 200 and response.headers["content-type"] == "image/png"
        assert Image.open(io.BytesIO(response.content)).format == "PNG"
    refused(client.get("/api/samples/scene-99"), 404, "scene-99", "scene-1")


# -- explanations ----------------------------------------------------------------------------------------------
def as_answered(result) -> dict:
    """`result.to_json()` as the API answers it (strict JSON: NaN as null)."""
    return json.loads(json.dumps(strict_json(result.to_json())))


def test_every_method_on_an_uploaded_image_answers_its_to_json(client, catalog):
    raw = scene_png()
    response = client.post("/api/explain", json={"image": {"data": encoded(raw)}, "methods": list(SEED_METHODS)})
    assert response.status_code == 200, response.text
    body = response.json()
    batch = prepared(catalog, raw)
    model = catalog.images["shapes"].model
    assert [r["explanation"]["method"] for r in body["results"]] == list(SEED_METHODS)
    assert Image.open(io.BytesIO(base64.b64decode(body["input"].split(",")[1]))).size == (64, 64)
    for result in body["results"]:
        expected = relevancy.explain(model, batch, method=result["explanation"]["method"])
        assert result["explanation"] == as_answered(expected)  # the same call's to_json(), exactly
        assert result["summary"] == relevancy.methods.REGISTRY[expected.method].summary and result["seconds"] > 0
        view = result["view"]
        for key in ("overlay", "map_png"):
            assert view[key].startswith("data:image/png;base64,")
            assert Image.open(io.BytesIO(base64.b64decode(view[key].split(",")[1]))).size == (64, 64)
        bar = view["colour_bar"]
        if bar is None:  # a map without any relevance: a note instead of a colour scale
            assert view["note"].startswith("all zero") and not expected.scores.any()
            continue
        assert bar["colormap"] == ("RdBu_r" if expected.signed else "inferno") and len(bar["stops"]) == 11
        assert (bar["low"] == -bar["high"]) if expected.signed else bar["low"] < bar["high"]
    assert set(body) == {"model", "input", "results", "seconds"}
    assert body["seconds"] >= sum(r["seconds"] for r in body["results"])


def test_a_clicked_class_a_sample_a_jpeg_and_a_data_url(client, catalog, samples):
    jpeg = picture_bytes(make_scenes(1, seed=5).pixels[0], "JPEG")
    for image, raw in (({"sample": "scene-4"}, samples["scene-4"].png), ({"data": "data:image/jpeg;base64," + encoded(jpeg)}, jpeg)):
        response = client.post("/api/explain", json={"image": image, "methods": ["generic_attention"], "target": 7})
        assert response.status_code == 200, response.text
        answered = response.json()["results"][0]["explanation"]
        assert answered["target"] == [7] and answered["class_names"][7] == "T-shape"
        expected = relevancy.explain(catalog.images["shapes"].model, prepared(catalog, raw), method="generic_attention", target=7)
        assert answered == as_answered(expected)


def test_a_concept_from_uploaded_examples(client, catalog):
    circles = make_scenes(64, seed=1)
    examples = [picture_bytes(p) for p in circles.pixels[(circles.labels[:, 0] == 0).numpy()][:3]]
    response = client.post("/api/explain", json={"image": {"data": encoded(scene_png())}, "methods": ["cdam"],
                                                 "concept": [{"data": encoded(e)} for e in examples]})
    assert response.status_code == 200, response.text
    answered = response.json()["results"][0]["explanation"]
    assert answered["target"] == [-1]  # a concept, not a class
    model = catalog.images["shapes"].model
    concept = relevancy.Concept(model, torch.cat([prepared(catalog, e) for e in examples]))
    expected = relevancy.explain(model, prepared(catalog, scene_png()), method="cdam", target=concept)
    assert answered == as_answered(expected)


def test_text_answers_its_to_json_and_coloured_words(client, catalog):
    text = "The side effects were <b>awful</b> but it worked"
    response = client.post("/api/explain-text", json={"text": text, "methods": ["transformer_attribution", "cdam"], "target": 1})
    assert response.status_code == 200, response.text
    body = response.json()
    entry = catalog.text
    batch = relevancy.zoo.text.encode(entry.tokenizer, [text], model=entry.model)
    for result in body["results"]:
        expected = relevancy.explain(entry.model, batch, method=result["explanation"]["method"], target=1)
        assert result["explanation"] == as_answered(expected) and result["explanation"]["target"] == [1]
        html = result["view"]["html"]
        assert html == expected.to_html()
        assert "<b>" not in html and ">&lt;</span>" in html  # the text is escaped
        assert 'title="' in html  # scores on hover
    assert body["warnings"] == []


def test_image_and_captions_give_their_to_json_and_a_view_per_pair(client, catalog, samples):
    captions = ["a red star", "a small blue ring"]
    response = client.post("/api/explain-pairs", json={"image": {"sample": "scene-4"}, "captions": captions,
                                                       "methods": ["generic_attention", "cdam"]})
    assert response.status_code == 200, response.text
    body = response.json()
    bundle = catalog.pairs.bundle
    images = catalog.pairs.prepare([Image.open(io.BytesIO(samples["scene-4"].png)).convert("RGB")])
    encoded_captions = bundle.encode(captions)
    batch = relevancy.ImageTextBatch.grid(images, encoded_captions, tokens=bundle.token_strings(encoded_captions["input_ids"]))
    for result in body["results"]:
        expected = relevancy.explain(bundle.model, batch, method=result["explanation"]["method"])
        assert result["explanation"] == as_answered(expected)
        assert result["explanation"]["tokens"][0][0] == "<start>" and len(result["view"]["pairs"]) == 2
        for p, view in enumerate(result["view"]["pairs"]):
            assert view["html"].count("<span") == len(captions[p].split())
    assert body["results"][1]["view"]["pairs"][0]["colour_bar"]["colormap"] == "RdBu_r"


def test_a_model_without_classes_is_explained_through_concepts(catalog, samples):
    """The photo model's rules (no classes: concepts or a feature index; fewer methods), on the shapes ViT."""
    from dataclasses import replace

    shapes = catalog.images["shapes"]
    featureless = replace(shapes, name="nofeat", has_classes=False, methods=("raw_attention", "cdam"),
                          class_names=[f"feature {k}" for k in range(12)])
    app = create_app(replace(catalog, images={"nofeat": featureless}), samples, LIMITS)
    with TestClient(app) as test_client:
        entry = test_client.get("/api/info").json()["image_models"][0]
        assert entry["has_classes"] is False and entry["classes"] == [] and entry["methods"] == ["raw_attention", "cdam"]
        refused(test_client.post("/api/explain", json={**GOOD, "methods": ["cdam"]}), 400, "no classes", "concept")
        refused(test_client.post("/api/explain", json={**GOOD, "methods": ["rollout"]}), 400, "rollout", "nofeat")
        refused(test_client.post("/api/explain", json={**GOOD, "methods": ["cdam"], "target": 12}), 400, "12 features")
        body = test_client.post("/api/explain", json=GOOD).json()
        assert body["results"][0]["explanation"]["method"] == "raw_attention"
        body = test_client.post("/api/explain", json={**GOOD, "methods": ["cdam"], "concept": [{"sample": "scene-2"}]}).json()
        assert body["results"][0]["explanation"]["target"] == [-1]


def test_the_photo_model_explains_a_concept_of_photographs(samples):
    """The DINOv2 photo model of the `photos` extra (in the test extra): no classes, concepts, no token ablation."""
    app = create_app(load_catalog(["photo"], text="none", pairs="none", language="none"), samples, LIMITS)
    photo = {"image": {"sample": "photo-chelsea"}}
    with TestClient(app) as test_client:
        entry = test_client.get("/api/info").json()["image_models"][0]
        assert entry["name"] == "photo" and entry["has_classes"] is False and "token_ablation" not in entry["methods"]
        body = test_client.post("/api/explain", json={**photo, "methods": ["cdam"], "concept": [{"sample": "photo-chelsea"}]}).json()
        answered = body["results"][0]["explanation"]
        assert answered["tensors"]["scores/image"]["shape"] == [1, 16, 16] and answered["target"] == [-1]
        refused(test_client.post("/api/explain", json={**photo, "methods": ["token_ablation"], "concept": [photo["image"]]}),
                400, "token_ablation", "photo model")


# -- refusals ------------------------------------------------------------------------------------------------
GOOD = {"image": {"sample": "scene-1"}, "methods": ["raw_attention"]}
TEXT = {"text": "It worked.", "methods": ["raw_attention"]}
PAIRS = {"image": {"sample": "scene-1"}, "captions": ["a red star"], "methods": ["raw_attention"]}


def bad_requests() -> list[tuple[str, str, dict | bytes, int, tuple[str, ...]]]:
    """(name, path, body, status, words the message must hold) for every kind of bad request."""
    tiff = io.BytesIO()
    Image.new("RGB", (8, 8)).save(tiff, format="TIFF")
    svg = b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"></svg>'
    wide = picture_bytes(np.zeros((1001, 1000, 3), np.uint8))  # 1,001,000 pixels, a few kB compressed
    noise = np.random.default_rng(0).integers(0, 256, (700, 700, 3), dtype=np.uint8)
    example = {"data": encoded(scene_png())}
    image = lambda raw: {**GOOD, "image": {"data": encoded(raw)}}  # noqa: E731
    return [
        ("no methods", "/api/explain", {"image": {"sample": "scene-1"}}, 422, ("methods", "required")),
        ("no image", "/api/explain", {"methods": ["cdam"]}, 422, ("image", "required")),
        ("empty methods", "/api/explain", {**GOOD, "methods": []}, 422, ("methods",)),
        ("misspelt field", "/api/explain", {**GOOD, "taget": 3}, 422, ("taget",)),
        ("both image sources", "/api/explain", {**GOOD, "image": {"sample": "scene-1", "data": "AAAA"}}, 422, ("exactly one",)),
        ("target as text", "/api/explain", {**GOOD, "target": "3"}, 422, ("target",)),
        ("target as bool", "/api/explain", {**GOOD, "target": True}, 422, ("target",)),
        ("not JSON", "/api/explain", b"{image: 1", 422, ("JSON",)),
        ("unknown method", "/api/explain", {**GOOD, "methods": ["generic_atention"]}, 400, ("generic_atention", "Did you mean 'generic_attention'?")),
        ("unknown model", "/api/explain", {**GOOD, "model": "vit_base_patch16_224"}, 400, ("vit_base_patch16_224", "shapes")),
        ("model as a path", "/api/explain", {**GOOD, "model": "/etc/passwd"}, 400, ("unknown model",)),
        ("target too large", "/api/explain", {**GOOD, "target": 12}, 400, ("target 12", "12 classes", "0 to 11")),
        ("negative target", "/api/explain", {**GOOD, "target": -1}, 400, ("target -1",)),
        ("sample as a path", "/api/explain", {**GOOD, "image": {"sample": "../../../etc/passwd"}}, 400, ("unknown sample",)),
        ("bad base64", "/api/explain", {**GOOD, "image": {"data": "not base64!"}}, 400, ("base64",)),
        ("empty image", "/api/explain", {**GOOD, "image": {"data": ""}}, 400, ("empty",)),
        ("text as an image", "/api/explain", image(b"hello, I am not a picture"), 415, ("PNG, JPEG, WEBP, GIF",)),
        ("TIFF", "/api/explain", image(tiff.getvalue()), 415, ("accepted format",)),
        ("SVG", "/api/explain", image(svg), 415, ("accepted format",)),
        ("PNG named .jpg", "/api/explain", {**GOOD, "image": {"data": "data:image/jpeg;base64," + encoded(scene_png())}}, 200, ()),
        ("truncated PNG", "/api/explain", image(scene_png()[:200]), 400, ("could not be decoded",)),
        ("too many pixels", "/api/explain", image(wide), 413, ("1001", "1,000,000")),
        ("bomb header", "/api/explain", image(png_claiming(100_000, 100_000)), 413, ("decompression bomb", "1,000,000")),
        ("large header", "/api/explain", image(png_claiming(5_000, 5_000)), 413, ("5000x5000", "1,000,000")),
        ("image file too large", "/api/explain", image(picture_bytes(noise)), 413, ("1 MiB",)),
        ("concept and target", "/api/explain", {**GOOD, "methods": ["cdam"], "target": 1, "concept": [example]}, 400, ("not both",)),
        ("empty concept", "/api/explain", {**GOOD, "methods": ["cdam"], "concept": []}, 400, ("at least one",)),
        ("too many concept images", "/api/explain", {**GOOD, "methods": ["cdam"], "concept": [example] * 5}, 400, ("at most 4",)),
        ("concept with a class method", "/api/explain", {**GOOD, "methods": ["cdam", "rollout"], "concept": [example]}, 400,
         ("rollout", "cdam, token_ablation")),
        ("bad concept image", "/api/explain", {**GOOD, "methods": ["cdam"], "concept": [example, {"data": encoded(b"GIF89a...")}]}, 415,
         ("concept image 2",)),
        ("empty text", "/api/explain-text", {**TEXT, "text": ""}, 400, ("empty",)),
        ("blank text", "/api/explain-text", {**TEXT, "text": " \n\t "}, 400, ("empty",)),
        ("text over the limit", "/api/explain-text", {**TEXT, "text": "good " * 61}, 413, ("305", "300")),
        ("text target out of range", "/api/explain-text", {**TEXT, "target": 2}, 400, ("2 classes",)),
        ("text unknown method", "/api/explain-text", {**TEXT, "methods": ["magic"]}, 400, ("magic",)),
        ("text missing", "/api/explain-text", {"methods": ["cdam"]}, 422, ("text",)),
        ("empty caption", "/api/explain-pairs", {**PAIRS, "captions": ["a red star", ""]}, 400, ("caption 2", "empty")),
        ("no captions", "/api/explain-pairs", {**PAIRS, "captions": []}, 422, ("captions",)),
        ("too many captions", "/api/explain-pairs", {**PAIRS, "captions": ["a star"] * 4}, 400, ("at most 3",)),
        ("caption over the limit", "/api/explain-pairs", {**PAIRS, "captions": ["a " * 200]}, 413, ("caption 1",)),
        ("unknown word", "/api/explain-pairs", {**PAIRS, "captions": ["a purple zebra"]}, 400, ("zebra", "vocabulary")),
        ("lrp on pairs", "/api/explain-pairs", {**PAIRS, "methods": ["lrp"]}, 400, ("lrp", "image-text pairs")),
    ]


@pytest.mark.parametrize("name, path, body, status, words", bad_requests(), ids=[case[0] for case in bad_requests()])
def test_every_bad_request_is_a_one_line_json_error(client, forbid, name, path, body, status, words):
    forbid("relevancy.models.load_image_model", "relevancy.models.load_clip_model", "relevancy.models.load_text_classifier")
    started = time.perf_counter()
    if isinstance(body, bytes):
        response = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = client.post(path, json=body)
    if status == 200:
        assert response.status_code == 200, response.text
    else:
        refused(response, status, *words)
    assert time.perf_counter() - started < 10


def test_bodies_over_the_limit_are_refused_before_reading(client):
    refused(client.post("/api/explain", content=b"x" * (LIMITS.max_body_bytes + 1), headers={"content-type": "application/json"}),
            413, "2 MiB")

    def stream() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for _ in range(40):
            yield b" " * 2**16
    refused(client.post("/api/explain", content=stream(), headers={"content-type": "application/json"}), 413, "limit")
    refused(client.get("/api/explain"), 405)


def test_still_answering_after_hostile_requests(client):
    for body in (png_claiming(2**31 - 1, 2**31 - 1), b"\x89PNG\r\n\x1a\n" + os.urandom(300), b"GIF89a" + os.urandom(100)):
        assert client.post("/api/explain", json={**GOOD, "image": {"data": encoded(body)}}).status_code in (400, 413, 415)
    assert client.get("/api/health").json() == {"status": "ok", "models": "ready", "admitted": 0, "running": 0, "capacity": 3}
    assert client.post("/api/explain", json=GOOD).status_code == 200


def test_uploads_are_never_written_to_disk(client, monkeypatch):
    import builtins

    written: list[str] = []
    original_open, original_os_open = builtins.open, os.open

    def watched_open(file, mode="r", *args, **kwargs):
        if any(flag in mode for flag in "wax+"):
            written.append(str(file))
        return original_open(file, mode, *args, **kwargs)

    def watched_os_open(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            written.append(str(path))
        return original_os_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", watched_open)
    monkeypatch.setattr(os, "open", watched_os_open)
    big = picture_bytes(np.random.default_rng(1).integers(0, 256, (400, 400, 3), dtype=np.uint8))  # over a spooling size
    response = client.post("/api/explain", json={"image": {"data": encoded(big)}, "methods": ["cdam"],
                                                 "concept": [{"data": encoded(scene_png(s))} for s in range(3)]})
    assert response.status_code == 200 and written == []


# -- the queue and the time limit ------------------------------------------------------------------------------
def test_a_full_queue_answers_503_at_once_and_frees_up(catalog, samples):
    app = create_app(catalog, samples, Limits(max_running=1, max_waiting=1))
    gate = app.state.gate
    with TestClient(app) as test_client:
        assert gate.admit() and gate.admit()  # two requests in flight: one running, one waiting
        started = time.perf_counter()
        response = test_client.post("/api/explain", json=GOOD)
        refused(response, 503, "busy")
        assert response.headers["retry-after"] == "1" and time.perf_counter() - started < 1
        gate.leave()
        gate.leave()
        assert test_client.post("/api/explain", json=GOOD).status_code == 200


def test_the_time_limit_answers_504_and_the_slot_frees_when_the_work_stops(catalog, samples, monkeypatch):
    original = jobs.explained
    calls: list[str] = []

    def slow(model, inputs, method, **options):
        calls.append(method)
        time.sleep(1.0)
        return original(model, inputs, method, **options)

    app = create_app(catalog, samples, Limits(max_running=1, max_waiting=2, time_limit_s=0.5))
    with TestClient(app) as test_client:
        monkeypatch.setattr(jobs, "explained", slow)
        started = time.perf_counter()
        refused(test_client.post("/api/explain", json={**GOOD, "methods": ["raw_attention", "rollout", "cdam"]}), 504, "0.5 s")
        assert time.perf_counter() - started < 0.9  # answered at the limit, not when the work ended
        monkeypatch.setattr(jobs, "explained", original)
        time.sleep(1.2)  # the late job finishes its current method, sees its deadline and stops
        assert calls == ["raw_attention"]
        assert test_client.post("/api/explain", json=GOOD).status_code == 200


@contextmanager
def live_server(app) -> Iterator[str]:
    """`app` served by uvicorn on a free loopback port in a thread; yields its URL."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
    server = uvicorn.Server(config)
    import socket

    sock = socket.create_server(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def test_concurrent_clients_get_answers_or_quick_503s(catalog, samples, monkeypatch):
    original = jobs.explained

    def slow(model, inputs, method, **options):
        time.sleep(0.3)
        return original(model, inputs, method, **options)

    monkeypatch.setattr(jobs, "explained", slow)
    app = create_app(catalog, samples, Limits(max_running=1, max_waiting=1, max_per_client=6))  # one client: the gate's test
    statuses: list[tuple[int, float]] = []
    with live_server(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        http.get("api/health")  # the connection pool warmed up

        def one() -> None:
            started = time.perf_counter()
            status = http.post("api/explain", json=GOOD).status_code
            statuses.append((status, time.perf_counter() - started))

        threads = [threading.Thread(target=one) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert http.get("api/health").json()["admitted"] == 0
    codes = sorted(status for status, _ in statuses)
    assert set(codes) == {200, 503} and codes.count(200) >= 2, codes
    # turned away without waiting: before the first answer, which took at least one slow step
    assert max(seconds for status, seconds in statuses if status == 503) < min(seconds for status, seconds in statuses if status == 200)


@contextmanager
def stalled_requests(http: httpx.Client, count: int) -> Iterator[list]:
    """`count` loopback connections that each send an explanation POST's headers and 10 of its 1,000 body
    bytes, then stall; yielded once the server holds them all, closed on leaving."""
    import socket

    port = int(str(http.base_url).rstrip("/").rsplit(":", 1)[1])
    sockets = []
    try:
        for _ in range(count):
            sockets.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            sockets[-1].sendall(b"POST /api/explain HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                                b"Content-Length: 1000\r\n\r\n{\"image\": ")
        deadline = time.monotonic() + 10
        while http.get("api/health").json()["admitted"] != count:
            assert time.monotonic() < deadline, "the stalled requests were not admitted"
            time.sleep(0.05)
        yield sockets
    finally:
        for sock in sockets:
            sock.close()


def answer_on(sock) -> tuple[int, str]:
    """The status and body the server sent on a stalled connection (waits at most the socket's timeout)."""
    received = b""
    while b"\r\n\r\n" not in received or not received.endswith(b"}"):
        chunk = sock.recv(4096)
        if not chunk:
            break
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


def test_stalled_bodies_are_answered_408_and_free_their_places(catalog, samples):
    app = create_app(catalog, samples, Limits(max_running=1, max_waiting=5, max_per_client=7, body_timeout_s=1.5))
    with live_server(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        with stalled_requests(http, 6) as stalled:
            refused(http.post("api/explain", json=GOOD), 503, "busy")  # every place held by a stalled body
            started = time.perf_counter()
            for sock in stalled:
                status, body = answer_on(sock)
                assert status == 408 and "did not arrive whole within the limit of 1.5 s" in body, body
            assert time.perf_counter() - started < 5
        assert http.get("api/health").json()["admitted"] == 0
        assert http.post("api/explain", json=GOOD).status_code == 200


def test_one_client_holds_at_most_its_share_of_places(catalog, samples):
    app = create_app(catalog, samples, Limits(max_running=1, max_waiting=5, max_per_client=2, body_timeout_s=30))
    with live_server(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        with stalled_requests(http, 2):
            started = time.perf_counter()
            for path in ("api/explain", "api/explain-text", "api/explain-pairs"):
                refused(http.post(path, json=GOOD), 429, "too many requests from 127.0.0.1", "2 explanation requests")
            assert time.perf_counter() - started < 2 and http.get("api/health").json() == {"status": "ok", "models": "ready", "admitted": 2, "running": 0, "capacity": 6}
        deadline = time.monotonic() + 10
        while http.get("api/health").json()["admitted"]:  # a closed connection gives its places back
            assert time.monotonic() < deadline, "the closed connections kept their places"
            time.sleep(0.05)
        assert http.post("api/explain", json=GOOD).status_code == 200


def test_the_per_client_count_is_kept_per_address():
    import asyncio

    from relevancy.apps.serve.queue import Admission, Gate

    release = asyncio.Event()
    answered: list[int] = []

    async def held_app(scope, receive, send) -> None:
        await release.wait()

    async def capture(message) -> None:
        if message["type"] == "http.response.start":
            answered.append(message["status"])

    async def scenario() -> None:
        admission = Admission(held_app, Gate(1, 5, 30), frozenset({"/api/explain"}), per_client=1)
        scope = {"type": "http", "method": "POST", "path": "/api/explain", "headers": []}
        first = asyncio.create_task(admission({**scope, "client": ("10.0.0.1", 1)}, None, capture))
        other = asyncio.create_task(admission({**scope, "client": ("10.0.0.2", 1)}, None, capture))
        await asyncio.sleep(0)
        await admission({**scope, "client": ("10.0.0.1", 2)}, None, capture)  # the first address's second request
        assert answered == [429] and dict(admission.held) == {"10.0.0.1": 1, "10.0.0.2": 1}
        release.set()
        await asyncio.gather(first, other)
        assert not admission.held and admission.gate.admitted == 0

    asyncio.run(scenario())


# -- the command -----------------------------------------------------------------------------------------------
def test_serve_command_prints_its_url_and_serves(tmp_path):
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen([sys.executable, "-m", "relevancy.apps.cli", "serve", "--port", "0", "--text-model", "none",
                               "--clip-model", "none", "--language-model", "none", "--max-running", "3"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment, cwd=tmp_path)
    try:
        started = time.monotonic()
        line = server.stdout.readline()  # at once: the models load while the page answers
        assert line.startswith("relevancy serve: http://127.0.0.1:") and "the models are loading" in line
        url = line.split()[2]
        health = httpx.get(url + "api/health", timeout=10).json()
        assert time.monotonic() - started < 5 and health["models"] in ("loading", "ready")
        assert httpx.get(url, timeout=10).status_code == 200  # the page itself
        info = httpx.get(url + "api/info", timeout=60).json()  # waits for the models
        loaded = server.stdout.readline()
        assert loaded.startswith("relevancy serve: models loaded (image: shapes") and "text" not in loaded
        assert httpx.get(url + "api/health", timeout=10).json()["models"] == "ready"
        assert info["text_model"] is None and info["limits"]["max_running"] == 3
        assert httpx.post(url + "api/explain", json=GOOD, timeout=30).status_code == 200
    finally:
        server.terminate()
        server.wait(30)
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("arguments, words", [
    (["--port", "70000"], ("--port", "65535")),
    (["--max-running", "0"], ("--max-running", "between 1 and 64")),
    (["--time-limit", "0"], ("--time-limit",)),
    (["--body-timeout", "0"], ("--body-timeout", "more than 0")),
    (["--max-per-client", "0"], ("--max-per-client", "at least 1")),
    (["--model", "no_such_vit", "--port", "0"], ("no_such_vit",)),
])
def test_serve_command_refuses_bad_options_in_one_line(arguments, words, capsys):
    from relevancy.apps.cli import main

    assert main(["serve", "--text-model", "none", "--clip-model", "none", *arguments]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("relevancy serve: error:") and "\n" not in error
    for word in words:
        assert word in error


def test_a_port_in_use_is_a_one_line_error(capsys):
    import socket

    from relevancy.apps.cli import main

    with socket.create_server(("127.0.0.1", 0)) as taken:
        assert main(["serve", "--port", str(taken.getsockname()[1])]) == 2
    error = capsys.readouterr().err
    assert "cannot listen on 127.0.0.1" in error and "--port" in error
