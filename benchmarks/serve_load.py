"""Load on `relevancy serve`: concurrent clients for a fixed time, mixed methods, some malformed requests.

    OMP_NUM_THREADS=1 python benchmarks/serve_load.py [--clients 8] [--seconds 60] [--warmup 10]
                                                      [--max-running 2] [--max-waiting 4] [--out FILE]

Starts the server on loopback (`relevancy serve --port 0 --threads 1 --max-per-client CLIENTS`, the shipped
models: the clients stand for as many machines but share one address), warms it up with
`--warmup` seconds of the same traffic, then runs `--clients` clients for `--seconds` seconds; each sends its next
request as soon as the last is answered (after a 503 it waits 0.1 s). Traffic per client, drawn at random (seeded):
45 % generic_attention on an uploaded scene (base64 PNG), 20 % another image method (rollout, cdam,
transformer_attribution, lrp) on a sample scene, 10 % the text tab, 10 % the image-text tab (two captions), 15 %
malformed (unknown method, bad base64, a text file as an image, a missing field, a target out of range, an empty
text, a decompression-bomb header). Reports throughput, p50/p95 latency per kind (answered requests), every status
code, and the server's resident memory (sampled every 0.1 s): after warm-up, at the end, the peak, and its growth
over the run. Stops the server and itself when done; writes the report to `--out` (default
benchmarks/results/serve_load.md).
"""
from __future__ import annotations

import argparse
import base64
import io
import os
import platform
import random
import statistics
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from relevancy.worlds import make_scenes
from relevancy.core.files import write_atomic

RESULTS = Path(__file__).resolve().parent / "results"
OTHER_METHODS = ("rollout", "cdam", "transformer_attribution", "lrp")


def png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def bomb_header() -> bytes:
    """A 1x1 PNG whose header claims 60000 x 60000 pixels."""
    raw = bytearray(png(np.zeros((1, 1, 3), np.uint8)))
    header = struct.pack(">II", 60_000, 60_000) + bytes(raw[24:29])
    raw[16:29] = header
    raw[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + header))
    return bytes(raw)


def traffic(seed: int) -> list[tuple[str, str, dict]]:
    """(kind, path, body) of every request a client may send; `draw` picks among them with the mix's weights."""
    scenes = [base64.b64encode(png(p)).decode() for p in make_scenes(16, seed=seed).pixels]
    malformed = [
        {"image": {"sample": "scene-1"}, "methods": ["magic"]},
        {"image": {"data": "%%% not base64 %%%"}, "methods": ["generic_attention"]},
        {"image": {"data": base64.b64encode(b"just some text").decode()}, "methods": ["generic_attention"]},
        {"methods": ["generic_attention"]},
        {"image": {"sample": "scene-2"}, "methods": ["generic_attention"], "target": 99},
        {"image": {"data": base64.b64encode(bomb_header()).decode()}, "methods": ["generic_attention"]},
    ]
    return [("generic_attention", "/api/explain", {"image": {"data": s}, "methods": ["generic_attention"]}) for s in scenes] \
        + [("other image methods", "/api/explain", {"image": {"sample": f"scene-{k % 6 + 1}"}, "methods": [m]})
           for k, m in enumerate(OTHER_METHODS)] \
        + [("text", "/api/explain-text", {"text": t, "methods": ["generic_attention", "cdam"]})
           for t in ("The side effects were awful but it worked", "Great drug, no problems at all.")] \
        + [("image-text", "/api/explain-pairs", {"image": {"sample": "scene-4"}, "captions": ["a green square", "a T-shape"],
                                                 "methods": ["generic_attention"]})] \
        + [("malformed", "/api/explain", body) for body in malformed] \
        + [("malformed", "/api/explain-text", {"text": "   ", "methods": ["cdam"]})]


WEIGHTS = {"generic_attention": 0.45, "other image methods": 0.20, "text": 0.10, "image-text": 0.10, "malformed": 0.15}


def draw(requests: list[tuple[str, str, dict]], rng: random.Random) -> tuple[str, str, dict]:
    kind = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
    return rng.choice([r for r in requests if r[0] == kind])


class Memory:
    """The server's resident memory (VmRSS), sampled every 0.1 s in a thread until stopped."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[tuple[float, int]] = []
        self.running = True
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def rss(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def sample(self) -> None:
        while self.running:
            self.samples.append((time.monotonic(), self.rss()))
            time.sleep(0.1)

    def between(self, start: float, end: float) -> list[int]:
        return [value for moment, value in self.samples if start <= moment <= end]

    def stop(self) -> None:
        self.running = False
        self.thread.join()


def run_clients(url: str, clients: int, seconds: float, seed: int) -> tuple[list[tuple[str, int, float]], float]:
    """`clients` threads sending requests for `seconds`; (kind, status, latency) per request, and the wall time."""
    records: list[tuple[str, int, float]] = []
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def client(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        requests = traffic(seed * 1000 + index)
        with httpx.Client(base_url=url, timeout=60) as http:
            while time.monotonic() < end:
                kind, path, body = draw(requests, rng)
                started = time.perf_counter()
                try:
                    status = http.post(path, json=body).status_code
                except httpx.HTTPError as error:
                    status = -1
                    print(f"client {index}: {type(error).__name__}: {error}", file=sys.stderr)
                latency = time.perf_counter() - started
                with lock:
                    records.append((kind, status, latency))
                if status == 503:
                    time.sleep(0.1)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return records, time.monotonic() - started


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def report(args: argparse.Namespace, records: list, wall: float, memory: dict) -> str:
    codes = Counter(status for _, status, _ in records)
    by_kind: dict[str, list[float]] = defaultdict(list)
    for kind, status, latency in records:
        if status == 200 or (kind == "malformed" and 400 <= status < 500):
            by_kind[kind].append(latency)
    answered = sum(1 for _, status, _ in records if status == 200)
    lines = [
        "# relevancy serve under load",
        "",
        f"{args.clients} clients for {args.seconds:g} s after {args.warmup:g} s of warm-up; server `--max-running "
        f"{args.max_running} --max-waiting {args.max_waiting} --max-per-client {args.clients} --threads 1`, OMP_NUM_THREADS=1; CPU: {cpu_model()} "
        f"({os.cpu_count()} cores, shared with other work); Python {platform.python_version()}.",
        "",
        f"- requests: {len(records)} in {wall:.1f} s = **{len(records) / wall:.1f} requests/s**; "
        f"explanations answered (200): {answered} = **{answered / wall:.1f}/s**",
        "- status codes: " + ", ".join(f"{code}: {count}" for code, count in sorted(codes.items())),
        f"- 5xx other than 503: **{sum(c for code, c in codes.items() if code >= 500 and code != 503)}**; "
        f"connection errors: {codes.get(-1, 0)}",
        f"- server memory (resident): {memory['start'] / 2**20:.0f} MiB after warm-up, {memory['end'] / 2**20:.0f} MiB at the end, "
        f"peak {memory['peak'] / 2**20:.0f} MiB; growth over the run **{memory['growth'] * 100:+.1f} %** (end vs start), "
        f"peak vs start {memory['peak_growth'] * 100:+.1f} %",
        "",
        "| kind (answered requests) | count | p50 s | p95 s | max s |",
        "| --- | --- | --- | --- | --- |",
    ]
    for kind in WEIGHTS:
        values = by_kind.get(kind, [])
        lines.append(f"| {kind}{' (4xx)' if kind == 'malformed' else ''} | {len(values)} | {percentile(values, 50):.3f} | "
                     f"{percentile(values, 95):.3f} | {max(values, default=float('nan')):.3f} |")
    turned = [latency for _, status, latency in records if status == 503]
    lines.append(f"| 503 (turned away) | {len(turned)} | {percentile(turned, 50):.3f} | {percentile(turned, 95):.3f} | "
                 f"{max(turned, default=float('nan')):.3f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--max-running", type=int, default=2)
    parser.add_argument("--max-waiting", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "serve_load.md")
    args = parser.parse_args()
    if args.clients < 1 or not 0 < args.seconds <= 600 or not 0 <= args.warmup <= 120:
        parser.error("--clients must be at least 1, --seconds within (0, 600], --warmup within [0, 120]")
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen(
        [sys.executable, "-m", "relevancy.apps.cli", "serve", "--host", "127.0.0.1", "--port", "0", "--threads", "1",
         "--max-running", str(args.max_running), "--max-waiting", str(args.max_waiting), "--max-per-client", str(args.clients)],
        stdout=subprocess.PIPE, text=True, env=environment)
    try:
        line = server.stdout.readline()
        if not line.startswith("relevancy serve: http://127.0.0.1:"):
            raise RuntimeError(f"the server did not start: {line!r}")
        url = line.split()[2]
        print(line.strip(), file=sys.stderr)
        memory = Memory(server.pid)
        if args.warmup:
            run_clients(url, args.clients, args.warmup, seed=args.seed + 1)
        start = time.monotonic()
        records, wall = run_clients(url, args.clients, args.seconds, seed=args.seed)
        end = time.monotonic()
        assert httpx.get(url + "api/health", timeout=10).json()["admitted"] == 0
        memory.stop()
        during = memory.between(start, end)
        first = statistics.median(during[:10])  # the first second of the run
        last = statistics.median(during[-10:])  # its last second
        numbers = {"start": first, "end": last, "peak": max(during), "growth": last / first - 1, "peak_growth": max(during) / first - 1}
    finally:
        server.terminate()
        server.wait(30)
    text = report(args, records, wall, numbers)
    print(text)
    write_atomic(args.out, text)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
