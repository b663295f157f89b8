"""Hostile probes of `relevancy serve`'s API and page, each answered with a one-line 4xx error that names the
problem, or with the right result: bodies that are not one JSON object, unreadable bodies, odd HTTP methods and
headers, oversized names, odd but valid pictures and texts, and markup in every field the page shows."""
from __future__ import annotations

import io
import json
import re
import socket

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

import relevancy
from relevancy.apps.serve import Limits, create_app, load_catalog, make_samples
from test_serve import GOOD, PAIRS, TEXT, encoded, live_server, picture_bytes, refused, scene_png

LIMITS = Limits(max_body_bytes=2 * 2**20, max_image_bytes=2**20, max_pixels=1_000_000, max_text_chars=300,
                max_captions=3, max_concept_images=4, max_running=1, max_waiting=2, time_limit_s=60, max_per_client=3)


@pytest.fixture(scope="module")
def client():
    with TestClient(create_app(load_catalog(["shapes"], language="none"), make_samples(), LIMITS), raise_server_exceptions=False) as test_client:
        yield test_client


def post_raw(client: TestClient, body: bytes, content_type: str | None = "application/json", path: str = "/api/explain",
             **headers: str):
    if content_type is not None:
        headers["content-type"] = content_type
    return client.post(path, content=body, headers=headers)


def with_image(raw: bytes) -> dict:
    return {**GOOD, "image": {"data": encoded(raw)}}


def jpeg_cmyk() -> bytes:
    buffer = io.BytesIO()
    Image.new("CMYK", (64, 64), (0, 120, 200, 0)).save(buffer, "JPEG")
    return buffer.getvalue()


def gif_animation(frames: int) -> bytes:
    buffer = io.BytesIO()
    first, *rest = [Image.new("P", (64, 64), k % 200) for k in range(frames)]
    first.save(buffer, "GIF", save_all=True, append_images=rest)
    return buffer.getvalue()


GOOD_JSON = json.dumps(GOOD).encode()

REFUSED = [  # (name, request, status, words the one-line message must hold)
    ("truncated JSON", lambda c: post_raw(c, GOOD_JSON[:40]), 422, ("not valid JSON", "at character")),
    ("a JSON array", lambda c: post_raw(c, b"[1, 2]"), 422, ("one JSON object", "got an array")),
    ("a JSON string", lambda c: post_raw(c, b'"explain this"'), 422, ("one JSON object", "got a string")),
    ("JSON null", lambda c: post_raw(c, b"null"), 422, ("one JSON object", "got null")),
    ("an empty body", lambda c: post_raw(c, b""), 422, ("empty", "JSON object")),
    ("JSON sent as text/plain", lambda c: post_raw(c, GOOD_JSON, "text/plain"), 422, ("application/json", "got content-type text/plain")),
    ("no content type", lambda c: post_raw(c, GOOD_JSON, None), 422, ("application/json", "content-type none")),
    ("a form", lambda c: post_raw(c, b"image=scene-1&methods=cdam", "application/x-www-form-urlencoded"), 422,
     ("application/json", "x-www-form-urlencoded")),
    ("bytes that are not UTF-8", lambda c: post_raw(c, b'{"image": "\xff\xfe"}'), 400, ("not UTF-8", "0xff", "position 11")),
    ("JSON nested 100,000 deep", lambda c: post_raw(c, b"[" * 100_000 + b"]" * 100_000), 400, ("nested too deeply",)),
    ("a 5,000-digit number", lambda c: post_raw(c, GOOD_JSON[:-1] + b', "target": ' + b"9" * 5000 + b"}"), 400,
     ("more than 4,300 digits",)),
    ("NaN as the target", lambda c: post_raw(c, GOOD_JSON[:-1] + b', "target": NaN}'), 422, ("target", "integer")),
    ("a gzip body", lambda c: post_raw(c, b"\x1f\x8b\x08\x00junk", **{"content-encoding": "gzip"}), 415, ("gzip", "uncompressed")),
    ("Content-Length that is not a number", lambda c: post_raw(c, GOOD_JSON, **{"content-length": "-1"}), 400,
     ("Content-Length", "number of bytes", "'-1'")),
    ("a 100,000-character method name", lambda c: c.post("/api/explain", json={**GOOD, "methods": ["x" * 100_000]}), 422,
     ("methods.0", "at most 64 characters")),
    ("a 100,000-character model name", lambda c: c.post("/api/explain", json={**GOOD, "model": "m" * 100_000}), 422,
     ("model", "at most 64 characters")),
    ("a 100,000-character sample id", lambda c: c.post("/api/explain", json={**GOOD, "image": {"sample": "s" * 100_000}}), 422,
     ("image.sample", "at most 64 characters")),
    ("a long unknown sample to download", lambda c: c.get("/api/samples/" + "a" * 5000), 404, ("unknown sample", "5,000 characters")),
    ("a text with a lone surrogate", lambda c: post_raw(c, b'{"text": "good \\ud800 drug", "methods": ["cdam"]}', path="/api/explain-text"),
     400, ("not valid Unicode", "\\ud800", "character 6")),
    ("a caption with a lone surrogate", lambda c: post_raw(c, json.dumps({**PAIRS, "captions": ["a red star", "x"]}).encode().replace(b'"x"', b'"\\udfff"'),
                                                           path="/api/explain-pairs"), 400, ("caption 2", "\\udfff")),
    ("a caption longer than the context", lambda c: c.post("/api/explain-pairs", json={**PAIRS, "captions": ["red " * 20]}), 400,
     ("needs 22 tokens", "context_length is 16")),
    ("GET on an explain endpoint", lambda c: c.get("/api/explain"), 405, ("GET is not allowed on /api/explain", "use POST")),
    ("OPTIONS (a CORS preflight)", lambda c: c.options("/api/explain-text"), 405, ("OPTIONS", "use POST")),
    ("POST to the health check", lambda c: c.post("/api/health"), 405, ("POST", "use GET")),
    ("DELETE on the page", lambda c: c.delete("/"), 405, ("DELETE", "GET")),
    ("an image as a number", lambda c: c.post("/api/explain", json={**GOOD, "image": {"data": 5}}), 422, ("image.data", "string")),
    ("a data URL of HTML", lambda c: c.post("/api/explain", json={**GOOD, "image": {"data": "data:text/html;base64," + encoded(b"<script>alert(1)</script>")}}),
     415, ("not an image", "PNG, JPEG, WEBP, GIF")),
    ("a concept given as one object", lambda c: c.post("/api/explain", json={**GOOD, "methods": ["cdam"], "concept": {"sample": "scene-2"}}), 422,
     ("concept", "list")),
    ("ReDoc, which is not served", lambda c: c.get("/redoc"), 404, ("no such page: /redoc",)),
    ("a NUL in a page file's name", lambda c: c.get("/static/app.js%00.png"), 404, ("no such page",)),
]


@pytest.mark.parametrize("name, probe, status, words", REFUSED, ids=[case[0] for case in REFUSED])
def test_a_hostile_request_gets_a_one_line_error_naming_the_problem(client, name, probe, status, words):
    message = refused(probe(client), status, *words)
    assert len(message) < 400  # nothing the client sent is echoed at length
    assert client.get("/api/health").json()["admitted"] == 0  # and it holds no place in the queue


def test_the_same_json_in_utf16_is_read(client):
    assert post_raw(client, GOOD_JSON.decode().encode("utf-16")).status_code == 200


def test_a_repeated_method_is_explained_once(client):
    response = client.post("/api/explain", json={**GOOD, "methods": ["rollout", "rollout", "raw_attention"]})
    assert [result["explanation"]["method"] for result in response.json()["results"]] == ["rollout", "raw_attention"]


def test_line_wrapped_base64_as_the_base64_command_writes_it(client):
    data = encoded(scene_png())
    wrapped = "\n".join(data[k:k + 76] for k in range(0, len(data), 76)) + "\n"
    assert client.post("/api/explain", json=with_image(scene_png())).json()["results"][0]["explanation"] == \
        client.post("/api/explain", json={**GOOD, "image": {"data": wrapped}}).json()["results"][0]["explanation"]


@pytest.mark.parametrize("name, raw", [
    ("1x1 pixel", picture_bytes(np.zeros((1, 1, 3), np.uint8))),
    ("10000x1 pixels", picture_bytes(np.zeros((1, 10_000, 3), np.uint8))),
    ("RGBA", picture_bytes(np.full((64, 64, 4), 200, np.uint8))),
    ("16-bit grey", picture_bytes((np.arange(64 * 64).reshape(64, 64) * 16).astype(np.uint16))),
    ("CMYK JPEG", jpeg_cmyk()),
    ("a 50-frame GIF", gif_animation(50)),
], ids=lambda value: value if isinstance(value, str) else "")
def test_odd_but_valid_pictures_are_explained_at_the_models_size(client, name, raw):
    response = client.post("/api/explain", json=with_image(raw))
    assert response.status_code == 200, response.text
    scores = np.array(response.json()["results"][0]["explanation"]["scores"]["image"], dtype=float)
    assert np.isfinite(scores).all() and scores.shape == (1, 8, 8)


def test_the_page_answers_head(client):
    response = client.head("/")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")


def test_markup_in_a_text_comes_back_escaped(client):
    response = client.post("/api/explain-text", json={**TEXT, "text": "<script>alert(1)</script> <img src=x onerror=alert(2)> great"})
    assert response.status_code == 200, response.text
    html = response.json()["results"][0]["view"]["html"]
    assert "<script" not in html and "<img" not in html and "&lt;" in html


def test_markup_in_a_caption_is_named_as_an_unknown_word(client):
    refused(client.post("/api/explain-pairs", json={**PAIRS, "captions": ["a <b>red</b> star"]}), 400, "unknown words", "'<b>red</b>'",
            "vocabulary")  # the page shows error messages as text (textContent), never as markup


def test_control_and_invisible_characters_in_a_text_are_explained(client):
    response = client.post("/api/explain-text", json={**TEXT, "text": "\u202egood\u200b drug\ufeff\u0000 it worked"})
    assert response.status_code == 200, response.text
    answered = relevancy.load(response.json()["results"][0]["explanation"])  # the answer is to_json(): it loads back
    assert [word for word, _ in answered.words(0)] == ["good", "drug", "it", "worked"]


def raw_exchange(port: int, request: bytes) -> bytes:
    """Send `request` on a fresh loopback connection and read the answer until the server closes it (at most 10 s)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            sock.sendall(request)
        except (BrokenPipeError, ConnectionResetError):  # the server answered and closed before all was sent
            pass
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
    return received


@pytest.mark.parametrize("name, request_bytes", [
    ("a request line that is not HTTP", b"GARBAGE\r\n\r\n"),
    ("an HTTP/0.9 request", b"GET /\r\n\r\n"),
    ("a negative Content-Length", b"POST /api/explain HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n"),
    ("two Content-Lengths", b"POST /api/explain HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello"),
    ("a 200 kB header", b"GET / HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 200_000 + b"\r\n\r\n"),
    ("a chunked body with a bad chunk size", b"POST /api/explain HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                                             b"Content-Type: application/json\r\n\r\nZZ\r\nxx\r\n0\r\n\r\n"),
])
def test_broken_http_on_a_real_socket_gets_a_one_line_400_and_the_server_carries_on(server_port, name, request_bytes):
    head, _, body = raw_exchange(server_port, request_bytes).partition(b"\r\n\r\n")
    text_lines = [line for line in body.split(b"\r\n") if line and not re.fullmatch(rb"[0-9a-f]+", line)]  # chunk sizes aside
    assert head.startswith(b"HTTP/1.1 400 ")
    # a request larger than what the server reads before it answers may have its answer's body cut off: the server
    # closes with unread bytes, and TCP's reset can drop what the client had not yet read (the head arrived)
    assert text_lines == [b"Invalid HTTP request received."] or (len(request_bytes) > 65536 and text_lines == [])
    assert b'"status":"ok"' in raw_exchange(server_port, b"GET /api/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")


def test_a_100_kb_path_is_a_404_that_quotes_it_short(server_port):
    head, _, body = raw_exchange(server_port, b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 404 ") and json.loads(body)["error"].endswith("... (100,001 characters)") and len(body) < 200


@pytest.fixture(scope="module")
def server_port():
    app = create_app(load_catalog(["shapes"], text="none", pairs="none", language="none"), make_samples(scenes=2, pairs=1), LIMITS)
    with live_server(app) as url:
        yield int(url.rstrip("/").rsplit(":", 1)[1])
