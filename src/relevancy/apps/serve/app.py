"""The FastAPI application: the page (one HTML file, its CSS and JavaScript, served from memory), the API it
uses (`/api/...`, JSON in and out) and the OpenAPI documentation (`/docs`, its assets served from memory too).

Requests never name a file: the page's files, the samples and the documentation's assets are read into memory
when the app is made and looked up by fixed names. Uploads travel inside the JSON body and are decoded in
memory. Errors of every kind are answered as one line of JSON, `{"error": "..."}`, with their status.
"""
from __future__ import annotations

import logging
import sys
from dataclasses import asdict
from importlib import resources
from typing import Any, Callable

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.requests import Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from ... import __version__
from ...core.files import strict_json
from .catalog import Catalog, CatalogLoading
from .jobs import Job, check_generation, check_image, check_pairs, check_text, generation_methods, pair_methods, registry
from .limits import BodyLimit, Limits, RequestError
from .queue import Admission, Gate, until_disconnect
from .samples import Sample
from .schemas import (GenerationRequest, GenerationResponse, ImageRequest, ImageResponse, PairRequest, PairResponse, TextRequest,
                      TextResponse)

log = logging.getLogger("relevancy.apps.serve")

EXPLAIN_PATHS = frozenset({"/api/explain", "/api/explain-text", "/api/explain-pairs", "/api/explain-generation"})
PAGE_FILES = {"app.js": "text/javascript", "generation.js": "text/javascript", "style.css": "text/css"}
#: the page may load its own files only; inline styles are allowed for the coloured words of the text maps
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data: blob:; style-src 'self' 'unsafe-inline'; "
                               "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"description": text, "content": {"application/json": {"example": {"error": "one line saying what is wrong"}}}}
    for code, text in {400: "a bad request (unknown method or model, target out of range, empty text, ...)",
                       413: "too large (body, image bytes or pixels, text, estimated memory over the server's budget)", 415: "not an accepted image format",
                       422: "the JSON does not match the schema",
                       408: "the request body did not arrive in time", 429: "too many requests from this client at once", 503: "busy: try again (Retry-After)",
                       504: "the explanation took longer than the time limit"}.items()
}


JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "true or false", type(None): "null"}


def not_one_object(content_type: str, problem: dict[str, Any]) -> str:
    """The message for a body that is not one JSON object: empty, sent as another content type, or another JSON value."""
    wanted = "the request body must be one JSON object sent as content-type application/json"
    if problem.get("type") == "missing":
        return f"the request body is empty; {wanted.removeprefix('the request body ')}"
    if "json" not in content_type.lower():
        return f"{wanted} (got content-type {content_type or 'none'})"
    return f"{wanted} (got {JSON_KINDS.get(type(problem.get('input')), 'another JSON value')})"


def unreadable_body(cause: BaseException) -> str:
    """The message for a body FastAPI could not parse, from the exception that stopped it."""
    if isinstance(cause, UnicodeDecodeError):
        return f"the request body is not UTF-8 text (byte 0x{cause.object[cause.start]:02x} at position {cause.start}); send JSON as UTF-8"
    if isinstance(cause, RecursionError):
        return "the request body's JSON is nested too deeply to read"
    if isinstance(cause, ValueError) and "digits" in str(cause):  # Python's limit on integer strings
        return f"a number in the request body's JSON has more than {sys.get_int_max_str_digits():,} digits"
    return f"the request body could not be read as JSON ({cause})"


def shown(name: str, limit: int = 64) -> str:
    """A name from a request as an error message quotes it: cut to `limit` characters."""
    return name if len(name) <= limit else f"{name[:limit]}... ({len(name):,} characters)"


def _documentation_assets() -> dict[str, tuple[bytes, str]]:
    """Swagger UI's script and style from the fastapi-offline package (so /docs works without internet)."""
    folder = resources.files("fastapi_offline") / "static"
    return {name: ((folder / name).read_bytes(), kind) for name, kind in
            (("swagger-ui-bundle.js", "text/javascript"), ("swagger-ui.css", "text/css"))}


def create_app(catalog: Catalog | CatalogLoading, samples: dict[str, Sample], limits: Limits = Limits()) -> FastAPI:
    """The application for these models (loaded, or loading: the page and the health endpoint answer at once, the
    model endpoints once the models are there), samples and limits."""
    gate = Gate(limits.max_running, limits.max_waiting, limits.time_limit_s)

    async def models() -> Catalog:
        if isinstance(catalog, Catalog):
            return catalog
        if catalog.state == "ready":
            return catalog.catalog
        try:
            return await run_in_threadpool(catalog.wait)  # a request that comes while they load waits for them
        except RuntimeError as error:
            raise RequestError(503, str(error)) from None

    app = FastAPI(title="relevancy", version=__version__, docs_url=None, redoc_url=None,
                  description="Relevance maps of transformers: explain an image, a text, an image-text pair or a generation. "
                              "Images travel as base64 inside the JSON. Every error is one line of JSON: `{\"error\": \"...\"}`.")
    app.state.gate = gate
    static = resources.files("relevancy.apps.serve") / "static"
    page = (static / "index.html").read_bytes()
    files = {name: ((static / name).read_bytes(), kind) for name, kind in PAGE_FILES.items()}
    files.update(_documentation_assets())

    async def answer(check: Callable[[], Job], http: Request, *advice: str) -> dict[str, Any]:
        return strict_json(await gate.run(check(), lambda: until_disconnect(http.receive), *advice))

    @app.exception_handler(RequestError)
    async def refused(request: Request, error: RequestError) -> JSONResponse:
        return JSONResponse({"error": error.message}, error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = []
        for item in error.errors():
            location = item.get("loc", ())[1:]
            if item.get("type") == "json_invalid":
                at = f" at character {location[0]}" if location else ""
                problems.append(f"the request body is not valid JSON ({item.get('ctx', {}).get('error', 'unreadable')}{at})")
            elif not location:  # the body as a whole: empty, not JSON, or JSON but not an object
                problems.append(not_one_object(request.headers.get("content-type", ""), item))
            else:
                problems.append(f"{'.'.join(str(part) for part in location)}: {item.get('msg', 'invalid')}")
        return JSONResponse({"error": " ".join("; ".join(problems).split())}, 422)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        headers = getattr(error, "headers", None)
        if error.status_code == 404:
            message = f"no such page: {shown(request.url.path)}"
        elif error.status_code == 405:
            allowed = (headers or {}).get("Allow", "")
            message = f"{request.method} is not allowed on {shown(request.url.path)}" + (f"; use {allowed}" if allowed else "")
        elif error.status_code == 400 and error.__cause__ is not None:  # FastAPI could not parse the body
            message = unreadable_body(error.__cause__)
        else:
            message = str(error.detail)
        return JSONResponse({"error": message}, error.status_code, headers=headers)

    @app.exception_handler(Exception)
    async def failed(request: Request, error: Exception) -> JSONResponse:
        log.exception("error while answering %s", request.url.path)
        return JSONResponse({"error": f"internal error ({type(error).__name__}); the server's log has the details"}, 500)

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def index() -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    @app.get("/static/{name}", include_in_schema=False)
    async def page_file(name: str) -> Response:
        if name not in files:
            raise HTTPException(404)
        content, kind = files[name]
        return Response(content, media_type=kind, headers=PAGE_HEADERS)

    @app.get("/docs", include_in_schema=False)
    async def documentation() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="relevancy API",
                                   swagger_js_url="/static/swagger-ui-bundle.js", swagger_css_url="/static/swagger-ui.css",
                                   swagger_favicon_url="data:,")

    @app.get("/api/info", summary="The models, methods, samples and limits of this server (once its models are loaded)")
    async def info() -> dict[str, Any]:
        from ...families import adapter_for

        catalog = await models()
        methods = registry()
        text_methods = [] if catalog.text is None else list(adapter_for(catalog.text.model).methods)
        offered = {n for m in catalog.images.values() for n in m.methods} | set(text_methods) | set(pair_methods())
        return {
            "version": __version__,
            "image_models": [{"name": m.name, "title": m.title, "has_classes": m.has_classes,
                              "classes": m.class_names if m.has_classes else [], "methods": list(m.methods),
                              "input_size": list(m.input_size)} for m in catalog.images.values()],
            "text_model": None if catalog.text is None else
            {"name": catalog.text.name, "title": catalog.text.title, "classes": catalog.text.class_names,
             "methods": text_methods},
            "pair_model": None if catalog.pairs is None else {"name": catalog.pairs.name, "title": catalog.pairs.title},
            "language_model": None if catalog.language is None else
            {"name": catalog.language.name, "title": catalog.language.title, "reads_images": catalog.language.reads_images,
             "methods": [{"name": n, "summary": summary} for n, summary in generation_methods(catalog.language).items()]},
            "methods": [{"name": n, "signed": m.signed, "summary": m.summary, "concept": m.accepts_concept,
                         "pairs": n in pair_methods()} for n, m in methods.items() if n in offered],
            "samples": [{"id": key, "title": sample.title} for key, sample in samples.items()],
            "limits": asdict(limits),
        }

    @app.get("/api/health", summary="Whether the server answers, whether its models are loaded (`models`: loading, ready, "
                                    "failed), how many explanation requests it holds and how many jobs run")
    async def health() -> dict[str, Any]:
        state = "ready" if isinstance(catalog, Catalog) else catalog.state
        return {"status": "ok", "models": state, "admitted": gate.admitted, "running": gate.running, "capacity": gate.capacity}

    @app.get("/api/samples/{sample_id}", summary="A sample picture (PNG)", response_class=Response,
             responses={200: {"content": {"image/png": {}}}, 404: ERROR_RESPONSES[400] | {"description": "no such sample"}})
    async def sample(sample_id: str) -> Response:
        if sample_id not in samples:
            raise RequestError(404, f"unknown sample '{shown(sample_id)}'; the samples are {', '.join(samples)}")
        return Response(samples[sample_id].png, media_type="image/png")

    @app.post("/api/explain", response_model=ImageResponse, responses=ERROR_RESPONSES,
              summary="Explain an image: per method its result (to_json()) and its map drawn over the image")
    async def explain_image(request: ImageRequest, http: Request) -> dict[str, Any]:
        loaded = await models()
        return await answer(lambda: check_image(request, loaded, samples, limits), http)

    @app.post("/api/explain-text", response_model=TextResponse, responses=ERROR_RESPONSES,
              summary="Explain a text: per method its result (to_json()) and its coloured words")
    async def explain_text(request: TextRequest, http: Request) -> dict[str, Any]:
        loaded = await models()
        return await answer(lambda: check_text(request, loaded, limits), http)

    @app.post("/api/explain-pairs", response_model=PairResponse, responses=ERROR_RESPONSES,
              summary="Explain an image against captions (CLIP): per method its result (to_json()), per caption the map and the coloured caption")
    async def explain_pairs(request: PairRequest, http: Request) -> dict[str, Any]:
        loaded = await models()
        return await answer(lambda: check_pairs(request, loaded, samples, limits), http)

    @app.post("/api/explain-generation", response_model=GenerationResponse, responses=ERROR_RESPONSES,
              summary="Generate from a prompt (or read a continuation) and explain every generated token over the tokens before it (to_json())")
    async def explain_generation(request: GenerationRequest, http: Request) -> dict[str, Any]:
        loaded = await models()
        return await answer(lambda: check_generation(request, loaded, samples, limits), http,
                            "ask for fewer new tokens, a shorter prompt or a faster method")

    app.add_middleware(BodyLimit, limit=limits.max_body_bytes, timeout_s=limits.body_timeout_s)
    app.add_middleware(Admission, gate=gate, paths=EXPLAIN_PATHS, per_client=limits.max_per_client)  # outermost: a turned-away body is never read
    return app


__all__ = ["create_app"]
