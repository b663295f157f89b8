"""Prompts per second explaining a corpus on SmolLM2-135M-Instruct: relevancy's corpus run (`explain_corpus`: padded
batches of similar length, Parquet output) beside a loop of relevancy's `explain` per prompt and a loop of lxt 2.1's
AttnLRP per prompt (in its own venv); with `--inseq-python`, also input x gradient: relevancy's corpus run beside a loop
of inseq 0.7's `attribute` per prompt (in its own venv).

    OMP_NUM_THREADS=1 python benchmarks/corpus_speed.py --lxt-python /tmp/lxt/bin/python [--inseq-python /tmp/inseq/bin/python]
        [--prompts 64] [--longest 1] [--slices 1] [--threads 1]

The weights are SmolLM2's own (`relevancy.models.smollm2`, offline), saved once to a temporary folder with the
prompts: the retrieval world's first `--prompts` test prompts (`relevancy.worlds.language`), tokenised by SmolLM2's
tokenizer. Each tool runs in a process of its own that loads them from there, float32, `--threads` CPU threads:
relevancy's in this interpreter, lxt's in `--lxt-python` (lxt, torch and transformers; never a dependency of
relevancy). The loops explain each prompt's predicted next token as `benchmarks/llm_vs_lxt.py` does (lxt as its README
runs it, with relevancy's shortcut: the last position's logits only, one backward to the input); the corpus run does
the same for every prompt, its time including writing the Parquet files and the report. inseq's loop is its usual call
for a decoder, `attribute(text, generation_args={"max_new_tokens": 1})` with "input_x_gradient" (it generates the
predicted token, then attributes it; the prompt's text decoded from its ids and tokenised again by inseq); it is set
beside relevancy's corpus run with `method="input_x_gradient"`. Reported: seconds for the whole corpus (after one
warm-up prompt), prompts per second, and each tool's speed over lxt's loop (attnlrp) or inseq's loop (input x gradient).
`--slices S` cuts the corpus into S interleaved slices and runs the tools in turn on each, their order rotated, so that
a machine's changing load falls on every tool alike. Results: benchmarks/results/corpus_speed.txt (and .json).
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
from llm_vs_lxt import lxt_explainer, relevancy_explainer  # noqa: E402
from machine import cpu_name, today, write_results  # noqa: E402

TOOLS = ("relevancy corpus", "relevancy loop", "lxt loop")
#: the input x gradient tools, run with --inseq-python
GRADIENT_TOOLS = ("relevancy corpus ixg", "inseq loop")


def prepare(folder: Path, count: int, longest: int = 1) -> None:
    """SmolLM2's weights (safetensors), its tokenizer and `count` prompts' token ids into `folder`. `longest` 1: the
    retrieval world's prompts about 2 people (~57 tokens); above 1, lengths spread evenly from those up to `longest`
    ten-person prompts joined into one (~206 tokens each: 5 gives ~1,000), the last one's question explained."""
    from relevancy.models import smollm2
    from relevancy.worlds import language as llm_world

    model, tokenizer = smollm2()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    texts = []
    for k in range(count):
        joined = k * (longest + 1) // count if longest > 1 else 0  # 0: one two-person prompt
        texts.append(" ".join(llm_world.prompt("test", count * j + k, n_people=10).text for j in range(joined))
                     if joined else llm_world.prompt("test", k).text)
    ids = [tokenizer(text)["input_ids"] for text in texts]
    (folder / "prompts.json").write_text(json.dumps(ids))


def one(folder: Path, tool: str, threads: int, part: int = 0, parts: int = 1) -> dict:
    """One tool over slice `part` of `parts` of the corpus (every `parts`-th prompt from the `part`-th), in this
    process: its seconds (after a warm-up on the slice's first prompt)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.set_num_threads(threads)
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    prompts = [torch.tensor([ids]) for ids in json.loads((folder / "prompts.json").read_text())[part::parts]]
    if tool.startswith("relevancy corpus"):
        import relevancy

        tokenizer = AutoTokenizer.from_pretrained(folder)
        rows = [row[0].tolist() for row in prompts]
        method = "input_x_gradient" if tool.endswith("ixg") else "attnlrp"
        relevancy.explain_corpus(model, tokenizer, rows[:1], method=method, out=folder / f"warm-up {tool} {part}", progress=False)
        began = time.perf_counter()
        summary = relevancy.explain_corpus(model, tokenizer, rows, method=method, out=folder / f"{tool} {part}", progress=False)
        seconds = time.perf_counter() - began
        return {"tool": tool, "seconds": seconds, "prompts": len(rows), "batches": summary.batches,
                "tokens": sum(len(row) for row in rows)}
    if tool == "inseq loop":
        return inseq_loop(model, folder, prompts)
    explain = (lxt_explainer if tool == "lxt loop" else relevancy_explainer)(model)
    explain(prompts[0])
    began = time.perf_counter()
    for ids in prompts:
        explain(ids)
    return {"tool": tool, "seconds": time.perf_counter() - began, "prompts": len(prompts),
            "tokens": sum(ids.shape[1] for ids in prompts)}


def inseq_loop(model: torch.nn.Module, folder: Path, prompts: list[torch.Tensor]) -> dict:
    """inseq's input x gradient of each prompt's predicted token, one `attribute` call per prompt."""
    import inseq
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = [tokenizer.decode(ids[0]) for ids in prompts]
    attributer = inseq.load_model(model, "input_x_gradient", tokenizer=str(folder))

    def explain(text: str) -> None:
        attributer.attribute(text, generation_args={"max_new_tokens": 1}, show_progress=False)

    explain(texts[0])
    began = time.perf_counter()
    for text in texts:
        explain(text)
    return {"tool": "inseq loop", "seconds": time.perf_counter() - began, "prompts": len(texts),
            "tokens": sum(ids.shape[1] for ids in prompts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lxt-python", help="the interpreter of a venv with lxt 2.1, torch and transformers (required)")
    parser.add_argument("--inseq-python", help="the interpreter of a venv with inseq 0.7, torch and transformers: adds the "
                                                 "input x gradient rows")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--longest", type=int, default=1,
                        help="1: two-person prompts (~57 tokens); N > 1: lengths spread up to N ten-person prompts joined (5: ~1,000 tokens)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--slices", type=int, default=1,
                        help="the corpus cut into this many interleaved slices, the tools run in turn on each (their order "
                             "rotated slice by slice), each tool's seconds summed: a machine's load shared out over the tools")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "corpus_speed")
    parser.add_argument("--one", nargs=5, metavar=("FOLDER", "TOOL", "THREADS", "PART", "PARTS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        folder, tool, threads, part, parts = args.one
        print(json.dumps(one(Path(folder), tool, int(threads), int(part), int(parts))))
        return
    if not args.lxt_python:
        parser.error("--lxt-python is required: the interpreter of a venv with lxt 2.1, torch and transformers")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), str(HERE)])}
    with tempfile.TemporaryDirectory() as temporary:
        folder = Path(temporary)
        prepare(folder, args.prompts, args.longest)
        tools = TOOLS + (GRADIENT_TOOLS if args.inseq_python else ())
        totals: dict[str, dict] = {}
        for part in range(args.slices):
            for tool in tools[part % len(tools):] + tools[:part % len(tools)]:
                python = {"lxt loop": args.lxt_python, "inseq loop": args.inseq_python}.get(tool, sys.executable)
                out = subprocess.run([python, __file__, "--one", str(folder), tool, str(args.threads), str(part), str(args.slices)],
                                     capture_output=True, text=True, env=env)
                if out.returncode:
                    raise SystemExit(f"{tool} failed:\n{out.stderr[-3000:]}")
                run = json.loads(out.stdout.strip().splitlines()[-1])
                total = totals.setdefault(tool, {key: 0 for key in run if key != "tool"} | {"tool": tool})
                for key, value in run.items():
                    if key != "tool":
                        total[key] += value
                print(tool, f"slice {part}: {run['seconds']:.1f} s", file=sys.stderr, flush=True)
        runs = [totals[tool] for tool in tools]
    baselines = {r["tool"]: r for r in runs if r["tool"].endswith("loop") and not r["tool"].startswith("relevancy")}
    lines = [f"SmolLM2-135M-Instruct (its GGUF weights), float32, {args.prompts} retrieval-world prompts (longest: "
             f"{args.longest} joined; {args.slices} slice(s), the tools in turn on each; {runs[0]['tokens']:,} tokens, {runs[0]['tokens'] / args.prompts:.0f} per prompt), attnlrp / lxt 2.1 attnLRP"
             f"{' and input_x_gradient / inseq 0.7 input_x_gradient' if args.inseq_python else ''} of "
             f"each prompt's predicted token, {cpu_name()}, {args.threads} thread(s), {today()}; torch {torch.__version__}",
             f"{'tool':<21} {'seconds':>8} {'prompts/s':>9} {'speed-up':>9}  over"]
    for r in runs:
        baseline = baselines["inseq loop" if r["tool"] in GRADIENT_TOOLS else "lxt loop"]
        lines.append(f"{r['tool']:<21} {r['seconds']:>8.1f} {r['prompts'] / r['seconds']:>9.2f} {baseline['seconds'] / r['seconds']:>8.2f}x  "
                     f"{baseline['tool']}" + (f" ({r['batches']} batches)" if "batches" in r else ""))
    write_results(args.out, lines, {"runs": runs, "threads": args.threads})


if __name__ == "__main__":
    main()
