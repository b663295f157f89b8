"""What a request may carry, and reading uploaded images safely.

Every bad request becomes a `RequestError`: an HTTP status and a one-line message, answered as
`{"error": "..."}`. Images arrive as base64 in the JSON body (never as files): the body's size is capped before
it is read (`BodyLimit`), the format is sniffed from the bytes by Pillow among `FORMATS` only, and the pixel count
is read from the header and refused before any pixel is decoded (decompression bombs included).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import io
import json
import time
import warnings
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from PIL import Image, ImageOps, UnidentifiedImageError

#: the formats an upload may be in, as Pillow names them (sniffed from the content)
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class Limits:
    """The server's limits; each is a command-line option of `relevancy serve`."""

    max_body_bytes: int = 16 * 2**20  # a whole request body (images travel as base64: 4/3 of their size)
    max_image_bytes: int = 8 * 2**20  # one image file, decoded from base64
    max_pixels: int = 16_000_000  # one image, read from its header before decoding
    max_text_chars: int = 2_000  # one text, caption or prompt
    max_new_tokens: int = 32  # tokens one text-generation request may generate (each costs a backward pass)
    max_prompt_tokens: int = 512  # tokens of a text-generation prompt (a (T, T) matrix per layer: 2,000 characters can be 8,000)
    max_captions: int = 8  # captions per image-text request
    max_concept_images: int = 16  # example images of a concept
    max_running: int = 2  # explanations computed at once (K)
    max_waiting: int = 4  # further explanation requests allowed to wait for a slot; more get 503 at once
    time_limit_s: float = 30.0  # per request, waiting included
    max_per_client: int = 2  # explanation requests one client address may have admitted at once; more get 429
    body_timeout_s: float = 10.0  # for a request body to arrive whole; a slower one gets 408 and frees its place
    max_memory_mb: int = 4_096  # what the running explanations may take together; each request max_memory_mb / max_running

    @property
    def request_bytes(self) -> int:
        """One request's share of the memory budget: a request estimated over it is refused with 413."""
        return self.max_memory_mb * 2**20 // self.max_running

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_image_bytes", "max_pixels", "max_text_chars", "max_new_tokens", "max_prompt_tokens",
                     "max_captions", "max_concept_images", "max_running", "max_per_client", "max_memory_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be 0 or more, got {self.max_waiting}")
        for name in ("time_limit_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be more than 0, got {getattr(self, name)}")


class RequestError(Exception):
    """A request the server refuses: `status` (4xx, or 503/504 for load) and a one-line message."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = " ".join(message.split())
        self.headers = headers or {}


def error_body(message: str) -> bytes:
    """The one-line JSON every error is answered with."""
    return json.dumps({"error": " ".join(message.split())}).encode()


def megabytes(size: int) -> str:
    return f"{size / 2**20:.3g} MiB"


def image_bytes(data: str, limits: Limits, what: str) -> bytes:
    """The file bytes of a base64 string (a `data:...;base64,` prefix, as a browser's FileReader gives, is
    dropped; line breaks and spaces are ignored); the size is checked before decoding."""
    if data.startswith("data:"):
        _, comma, data = data.partition(",")
        if not comma:
            raise RequestError(400, f"{what} is a data URL without data")
    if len(data) * 3 // 4 > limits.max_image_bytes * 1.02 + 2:  # line breaks (as `base64` writes) add up to 2 %
        raise RequestError(413, f"{what} is larger than the limit of {megabytes(limits.max_image_bytes)}")
    data = "".join(data.split())  # base64 wrapped into lines
    if len(data) * 3 // 4 > limits.max_image_bytes + 2:
        raise RequestError(413, f"{what} is larger than the limit of {megabytes(limits.max_image_bytes)}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(400, f"{what} is not valid base64") from None
    if not raw:
        raise RequestError(400, f"{what} is empty")
    return raw


def open_image(raw: bytes, limits: Limits, what: str, draft: int | None = None) -> Image.Image:
    """An 8-bit RGB picture from an upload's bytes: its format sniffed among `FORMATS`, its size checked from the
    header before any pixel is decoded, EXIF orientation applied, the first frame of an animation. `draft`: a
    JPEG may be decoded at a reduced scale that keeps both sides at least this size (faster, less memory)."""
    from ...core.pictures import PictureError, to_rgb

    accepted = ", ".join(FORMATS)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own limit applies, below
            with Image.open(io.BytesIO(raw), formats=FORMATS) as image:
                pixels = image.width * image.height
                if pixels > limits.max_pixels:
                    raise RequestError(413, f"{what} has {image.width}x{image.height} = {pixels:,} pixels; the limit is {limits.max_pixels:,}")
                if draft is not None and image.format == "JPEG":
                    image.draft("RGB", (draft, draft))
                image.load()
                return to_rgb(ImageOps.exif_transpose(image), what)
    except Image.DecompressionBombError:
        raise RequestError(413, f"{what} is a decompression bomb: its header claims more pixels than the limit of {limits.max_pixels:,}") from None
    except UnidentifiedImageError:
        raise RequestError(415, f"{what} is not an image in an accepted format (the content is read, not a file name): {accepted}") from None
    except PictureError as error:
        raise RequestError(400, str(error)) from None
    except (OSError, SyntaxError, ValueError, EOFError) as error:
        raise RequestError(400, f"{what} could not be decoded ({error}); it may be truncated or damaged") from None


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is answered 413 without being read further: at once by
    its Content-Length, else (a chunked body) as soon as what arrived passes the limit. A body that has not
    arrived whole within `timeout_s` is answered 408 (a stalled or trickling client must not hold its place in
    the queue). A body within both limits is read here and handed on whole."""

    def __init__(self, app: ASGIApp, limit: int, timeout_s: float) -> None:
        self.app = app
        self.limit = limit
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        message = f"the request body is larger than the limit of {megabytes(self.limit)}"
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        encoding = headers.get(b"content-encoding", b"identity").decode("latin-1").strip().lower()
        if declared is not None and not declared.isdigit():
            await respond(send, 400, f"the Content-Length header must be a number of bytes, got '{declared.decode('latin-1')[:40]}'")
            return
        if declared is not None and int(declared) > self.limit:
            await respond(send, 413, message)
            return
        if encoding != "identity":
            await respond(send, 415, f"a request body compressed as '{encoding[:40]}' is not accepted; send the JSON uncompressed")
            return
        chunks: list[bytes] = []
        size, more = 0, True
        end = time.monotonic() + self.timeout_s
        while more:
            try:
                event = await asyncio.wait_for(receive(), max(end - time.monotonic(), 0))
            except asyncio.TimeoutError:
                await respond(send, 408, f"the request body did not arrive whole within the limit of {self.timeout_s:g} s",
                              {"Connection": "close"})
                return
            if event["type"] == "http.disconnect":
                return
            chunks.append(event.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await respond(send, 413, message)
                return
            more = event.get("more_body", False)
        body = b"".join(chunks)
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if delivered:
                return await receive()  # after the body: the client's disconnect
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


async def respond(send: Send, status: int, message: str, headers: dict[str, str] | None = None) -> None:
    """A one-line JSON error sent straight through ASGI (for middleware, before the app sees the request)."""
    body = error_body(message)
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})
