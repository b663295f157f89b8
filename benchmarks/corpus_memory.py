"""Peak memory of `explain_corpus` against the memory budget it was given, on SmolLM2-135M-Instruct (float32, CPU):
does a corpus run stay within `memory_budget`, and how close is the planner's estimate of its largest batch?

    OMP_NUM_THREADS=1 python benchmarks/corpus_memory.py [--prompts 32] [--longest 5] [--budgets 256MiB,1GiB]

For each budget, a process of its own loads the model, reads its resident memory, resets the kernel's peak counter
(`/proc/self/clear_refs`, Linux), runs `explain_corpus` with `attnlrp` over the same prompts (lengths spread from ~57
to ~1,000 tokens, as `corpus_speed.py --longest` makes them) and reads the peak resident memory (`VmHWM`). Reported:
the peak above the loaded model (the run's working memory, Parquet writing included) beside the budget and the
planner's estimate for its largest batch (`row_memory` of the batch's longest prompt times its rows), the batches and
the seconds. Results: benchmarks/results/corpus_memory.txt (and .json).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from corpus_speed import prepare  # noqa: E402
from machine import cpu_name, today, write_results  # noqa: E402

MIB = 2**20


def resident(field: str) -> int:
    """A `/proc/self/status` memory field (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))


def one(folder: Path, budget: int, threads: int) -> dict:
    """One corpus run within `budget` bytes, in this process: its working memory, batches, plan and seconds."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    import relevancy
    from relevancy.corpus import plan_batches, row_memory

    torch.set_num_threads(threads)
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    rows = json.loads((folder / "prompts.json").read_text())
    lengths = [len(row) for row in rows]
    cost = {length: row_memory(model, "attnlrp", length) for length in set(lengths)}
    plan = plan_batches(lengths, cost.__getitem__, budget)
    planned = max(len(batch) * cost[lengths[batch[0]]] for batch in plan)
    loaded = resident("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from the resident memory now
    began = time.perf_counter()
    summary = relevancy.explain_corpus(model, tokenizer, rows, method="attnlrp", out=folder / f"run-{budget}",
                                       memory_budget=budget, progress=False)
    return {"budget": budget, "working": resident("VmHWM") - loaded, "planned": planned, "batches": summary.batches,
            "largest_batch": max(len(batch) for batch in plan), "seconds": time.perf_counter() - began,
            "loaded": loaded, "tokens": sum(lengths)}


def bytes_of(text: str) -> int:
    """`256MiB`, `1GiB` or a number of bytes."""
    for unit, size in (("GiB", 2**30), ("MiB", MIB)):
        if text.endswith(unit):
            return int(float(text[:-len(unit)]) * size)
    return int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--longest", type=int, default=5, help="lengths spread up to N ten-person prompts joined (5: ~1,000 tokens)")
    parser.add_argument("--budgets", default="256MiB,1GiB")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "corpus_memory")
    parser.add_argument("--one", nargs=3, metavar=("FOLDER", "BUDGET", "THREADS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        folder, budget, threads = args.one
        print(json.dumps(one(Path(folder), int(budget), int(threads))))
        return
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), str(HERE)])}
    runs = []
    with tempfile.TemporaryDirectory() as temporary:
        folder = Path(temporary)
        prepare(folder, args.prompts, args.longest)
        for budget in map(bytes_of, args.budgets.split(",")):
            out = subprocess.run([sys.executable, __file__, "--one", str(folder), str(budget), str(args.threads)],
                                 capture_output=True, text=True, env=env)
            if out.returncode:
                raise SystemExit(f"budget {budget} failed:\n{out.stderr[-3000:]}")
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"budget {budget / MIB:.0f} MiB: {runs[-1]['working'] / MIB:.0f} MiB", file=sys.stderr, flush=True)
    lines = [f"SmolLM2-135M-Instruct, float32, attnlrp, {args.prompts} retrieval-world prompts ({runs[0]['tokens']:,} tokens, "
             f"up to {args.longest} joined), {cpu_name()}, {args.threads} thread(s), {today()}; torch {torch.__version__}; "
             f"the model loaded: {runs[0]['loaded'] / MIB:.0f} MiB resident",
             f"{'budget MiB':>10} {'peak above model MiB':>21} {'planned largest batch MiB':>26} {'batches':>8} {'largest':>8} {'seconds':>8}"]
    for r in runs:
        lines.append(f"{r['budget'] / MIB:>10.0f} {r['working'] / MIB:>21.0f} {r['planned'] / MIB:>26.0f} {r['batches']:>8} "
                     f"{r['largest_batch']:>8} {r['seconds']:>8.1f}")
    write_results(args.out, lines, {"runs": runs, "threads": args.threads})


if __name__ == "__main__":
    main()
