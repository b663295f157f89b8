"""`relevancy serve [--host 127.0.0.1] [--port 8000] [--model ...]`: the web page and its API (needs the `serve` extra).

The listening socket is opened before the models load, so a port in use is a one-line error at once; the
startup line (on stdout, flushed) gives the URL, with the real port when `--port 0` asks for a free one, as soon as
the server answers: the models load in a thread of their own meanwhile (`catalog.CatalogLoading`), a second line says
when they are there, and a model asked for that cannot load stops the server with its one-line error.
"""
from __future__ import annotations

import argparse
import ipaddress
import socket
from pathlib import Path
from typing import Any

from ...core.extras import require
from ..common import MAX_NEW_TOKENS, MAX_TEXT_CHARS, UsageError, at_most, warn
from ...core.pictures import MAX_IMAGE_PIXELS

MIB = 2**20
#: each number option's range: option, argument name, lowest, highest
RANGES = (
    ("--max-running", "max_running", 1, 64), ("--max-waiting", "max_waiting", 0, 1_024),
    ("--time-limit", "time_limit", 0.1, 3_600), ("--max-image-mb", "max_image_mb", 0.01, 256),
    ("--max-body-mb", "max_body_mb", 0.01, 1_024), ("--max-pixels", "max_pixels", 1, MAX_IMAGE_PIXELS),
    ("--max-text-chars", "max_text_chars", 1, MAX_TEXT_CHARS), ("--max-new-tokens", "max_new_tokens", 1, MAX_NEW_TOKENS),
    ("--max-prompt-tokens", "max_prompt_tokens", 1, 100_000),
    ("--threads", "threads", 1, 1_024), ("--max-memory-mb", "max_memory_mb", 1, 2**24),
)


def open_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host:port` (IPv6 when the host is an IPv6 address); a UsageError otherwise."""
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be between 0 and 65535, got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=128)
    except OSError as error:
        raise UsageError(f"cannot listen on {host}:{port} ({error.strerror or error}); pick another --port or --host") from None


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_serve(args: argparse.Namespace) -> list[Path]:
    """Serve until interrupted (Ctrl+C); writes no files."""
    uvicorn = require("uvicorn", extra="serve")
    from . import Catalog, Limits, create_app, load_catalog, make_samples
    from .catalog import CatalogLoading

    for option, name, lowest, highest in RANGES:
        at_most(option, getattr(args, name), lowest, highest)
    try:
        limits = Limits(max_body_bytes=int(args.max_body_mb * MIB), max_image_bytes=int(args.max_image_mb * MIB),
                        max_pixels=args.max_pixels, max_text_chars=args.max_text_chars, max_new_tokens=args.max_new_tokens,
                        max_prompt_tokens=args.max_prompt_tokens, max_running=args.max_running,
                        max_waiting=args.max_waiting, time_limit_s=args.time_limit, max_per_client=args.max_per_client,
                        body_timeout_s=args.body_timeout, max_memory_mb=args.max_memory_mb)
    except ValueError as error:
        option = str(error).split()[0]
        flag = {"time_limit_s": "--time-limit", "body_timeout_s": "--body-timeout"}.get(option, "--" + option.replace("_", "-"))
        raise UsageError(str(error).replace(option, flag, 1)) from None
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    sock = open_socket(args.host, args.port)
    server: Any = None

    def ready(catalog: Catalog) -> None:
        for note in catalog.notes:
            warn("serve", note)
        tabs = [f"image: {', '.join(catalog.images)}"]
        tabs += [f"text: {catalog.text.name}"] if catalog.text else []
        tabs += [f"image-text: {catalog.pairs.name}"] if catalog.pairs else []
        tabs += [f"text generation: {catalog.language.name}"] if catalog.language else []
        print(f"relevancy serve: models loaded ({'; '.join(tabs)})", flush=True)

    def failed(_error: BaseException) -> None:  # a model asked for that cannot load: the server stops, the error is said
        if server is not None:
            server.should_exit = True

    # the models load in a thread of their own while the page already answers (/api/health says when they are there)
    loading = CatalogLoading(lambda: load_catalog(args.model, args.text_model, args.clip_model, args.language_model), ready, failed)
    try:
        app = create_app(loading, make_samples(), limits)
        if not is_loopback(args.host):
            warn("serve", f"listening on {args.host}: anyone who can reach this machine can use its models")
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=5))
        print(f"relevancy serve: {url_of(sock)} (the page answers now; the models are loading); Ctrl+C stops", flush=True)
        loading.start()
        server.run(sockets=[sock])
    finally:
        sock.close()
    app.state.gate.close()
    if loading.error is not None:
        raise loading.error
    return []
