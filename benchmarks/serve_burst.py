"""A burst of generation requests on `relevancy serve`, half of whose clients give up: the server's memory against
its budget, and how soon every place is free again.

    OMP_NUM_THREADS=1 python benchmarks/serve_burst.py [--requests 30] [--leave-after 2] [--max-new-tokens 32]
                                                       [--max-memory-mb 4096] [--time-limit 30] [--out FILE]

Starts `relevancy serve` on loopback with SmolLM2 (`--language-model smollm2`, no text or image-text model, `--threads
1`, `--max-running 2`, `--max-waiting REQUESTS - 2`, `--max-per-client REQUESTS`: the clients share one address),
warms it with one generation, then sends `--requests` generation requests at once (`attnlrp`, the prompt below,
`--max-new-tokens`); every other client gives up after `--leave-after` seconds (httpx closes the connection). The
first two clients to send are leavers, so two running jobs lose their client. Reports the status of every answer, the
server's resident memory (sampled every 0.1 s: before, peak, after) against `--max-memory-mb`, and the seconds from
the last client's end until `/api/health` shows no admitted request and no running job. Writes the report to `--out`
(default benchmarks/results/serve_burst.md).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
from machine import cpu_name, today
from serve_load import Memory

from relevancy.core.files import write_atomic

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT = "Tom lives in Rome. Mia lives in Oslo. Where does Tom live? Tom lives in"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--leave-after", type=float, default=2.0)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-memory-mb", type=int, default=4096)
    parser.add_argument("--time-limit", type=float, default=30.0)
    parser.add_argument("--out", type=Path, default=RESULTS / "serve_burst.md")
    args = parser.parse_args()
    server = subprocess.Popen(
        [sys.executable, "-m", "relevancy.apps.cli", "serve", "--host", "127.0.0.1", "--port", "0", "--threads", "1",
         "--text-model", "none", "--clip-model", "none", "--language-model", "smollm2", "--max-running", "2",
         "--max-waiting", str(args.requests - 2), "--max-per-client", str(args.requests), "--time-limit", str(args.time_limit),
         "--max-memory-mb", str(args.max_memory_mb)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        line = server.stdout.readline()
        if not line.startswith("relevancy serve: http://127.0.0.1:"):
            raise RuntimeError(f"the server did not start: {line!r}")
        url = line.split()[2]
        body = {"prompt": PROMPT, "max_new_tokens": args.max_new_tokens, "method": "attnlrp"}
        memory = Memory(server.pid)
        with httpx.Client(base_url=url, timeout=120) as http:
            warm = time.perf_counter()
            assert http.post("api/explain-generation", json=body).status_code == 200
            one = time.perf_counter() - warm
        time.sleep(0.5)
        before = memory.rss()
        answers: list[tuple[bool, str]] = []

        def client(leaves: bool) -> None:
            with httpx.Client(base_url=url, timeout=args.leave_after if leaves else 10 * args.time_limit) as http:
                try:
                    answers.append((leaves, str(http.post("api/explain-generation", json=body).status_code)))
                except httpx.TimeoutException:
                    answers.append((leaves, "gave up"))

        leaving = [True, True] + [k % 2 == 1 for k in range(args.requests - 4)] + [False, False]  # half leave
        threads = [threading.Thread(target=client, args=(leaves,)) for leaves in leaving]
        started = time.monotonic()
        for k, thread in enumerate(threads):
            thread.start()
            if k == 1:
                time.sleep(0.2)
        for thread in threads:
            thread.join()
        ended = time.monotonic()
        with httpx.Client(base_url=url, timeout=10) as http:
            while True:
                health = http.get("api/health").json()
                if not health["admitted"] and not health["running"]:
                    break
                time.sleep(0.05)
        freed = time.monotonic() - ended
        peak = max(memory.between(started, time.monotonic()))
        after = memory.rss()
        memory.stop()
    finally:
        server.terminate()
        server.wait(30)
    stayed = Counter(status for leaves, status in answers if not leaves)
    left = Counter(status for leaves, status in answers if leaves)
    mib = 2**20
    report = "\n".join([
        f"# A burst of generation requests, half the clients gone ({today()}, {cpu_name()}, OMP_NUM_THREADS=1)", "",
        f"`relevancy serve --language-model smollm2 --max-running 2 --max-waiting {args.requests - 2} --time-limit "
        f"{args.time_limit:g} --max-memory-mb {args.max_memory_mb}`; {args.requests} requests at once (`attnlrp`, "
        f"{args.max_new_tokens} new tokens; one alone took {one:.1f} s), every other client giving up after "
        f"{args.leave_after:g} s (the first two among them).", "",
        f"- clients that stayed: {dict(stayed)}; clients that left: {dict(left)}",
        f"- the server's resident memory: {before / mib:,.0f} MiB before, peak {peak / mib:,.0f} MiB "
        f"(+{(peak - before) / mib:,.0f} MiB, budget {args.max_memory_mb:,} MiB), {after / mib:,.0f} MiB after",
        f"- every place and slot free {freed:.2f} s after the last client's end (time limit {args.time_limit:g} s); "
        f"the burst took {ended - started:.1f} s", "",
    ])
    write_atomic(args.out, report)
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
