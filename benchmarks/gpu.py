"""The GPU table: every family and method, time and peak memory as ratios to a forward, and float64 exactness on CUDA.

    python benchmarks/gpu.py [--device cuda|cpu] [--quick] [--repeats 3] [--families ...] [--out benchmarks/results/gpu_<device>.md]

One prepared script for the short time a GPU is lent (meant to finish within 8 minutes on an H100 / H200 at full size;
not yet timed on one); try it first on a CPU with `--device cpu --quick` (the tests' tiny float64 models;
`tests/test_gpu_benchmark.py` runs it on three families).

1. **Time and memory** (float32, random weights): ViT-B/16 (timm) at batch 1, 8 and 32, and the standard shapes of
   `benchmarks/speed_memory.py` (BERT-base on 512 tokens, CLIP ViT-B/32 on 8 pairs, LXMERT-base on 8 questions,
   DETR-R50 on one 800x1066 image, a decoder of SmolLM2-135M's shape on 1,000 tokens). Per method: one warm-up,
   then `--repeats` runs interleaved with the model's plain forward (no gradients), each timed between
   `torch.cuda.synchronize()` calls; the median over the forward's median. Peak memory:
   `torch.cuda.max_memory_allocated` of the run (reset before it) over the forward's, so the weights count on both
   sides. At batch 32, transformer attribution also with its memory options: `rows_at_once=8` and `checkpoint=True`.
   Beside relevancy: lxt's AttnLRP on the decoder (`benchmarks/llm_lxt_reference.py`'s patching) where lxt is
   importable; the row says so where it is not. The authors' CVPR'21 / ICCV'21 code is not in this repository
   (their forked models; the figures of issue 36 measured it), so no row runs it.
   `--quick`: the tiny float64 models of `tests/family_cases.py` instead, batch 2 (the script's own check).
2. **Exactness in float64**: every family and method of `tests/family_cases.py` on the device against the CPU (the
   largest difference over the map's largest magnitude), and the authors' ViT maps of `tests/golden/vit_reference64.pt`
   computed on the device (the same measure; the tests require 1e-8).
The card, torch, CUDA and transformers versions head the table. With `--device cpu` the memory column is left out
(the CPU's peak is `benchmarks/speed_memory.py`'s resident high-water mark, another measure).
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests"))
from machine import cpu_name, today  # noqa: E402
from speed_memory import FAMILIES, Workload, build, describe  # noqa: E402

import relevancy  # noqa: E402
from relevancy.families.base import UnsupportedModelError  # noqa: E402

#: what transformer attribution's memory options are measured with at the largest ViT batch
MEMORY_OPTIONS = ({"rows_at_once": 8}, {"checkpoint": True})
VIT_BATCHES = (1, 8, 32)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(run: Callable[[], Any], device: str) -> tuple[float, int]:
    """Seconds of one `run()` (the device's queued work included) and its peak allocated bytes (0 on a CPU)."""
    synchronize(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    run()
    synchronize(device)
    seconds = time.perf_counter() - start
    return seconds, torch.cuda.max_memory_allocated() if device == "cuda" else 0


def workloads(device: str, quick: bool, families: list[str] | None) -> Iterator[tuple[str, str, Workload]]:
    """(label, family key, workload): the full-size models, or the tiny float64 models of the tests with `quick`;
    `families` (None: all) names the families kept (`FAMILIES`, or `tests/family_cases.py`'s names with `quick`)."""
    if quick:
        from family_cases import FAMILIES as CASES, to_device

        for name, case in CASES.items():
            if families is not None and name not in families:
                continue
            model = case.build().to(device)
            inputs, target = to_device(case.batch(), device)
            yield f"{name} (tiny, float64, batch of the tests)", name, Workload(model, inputs, target, plain(model, inputs))
        return
    import timm

    torch.manual_seed(0)
    vit = timm.create_model("vit_base_patch16_224", pretrained=False).eval().to(device)
    for batch in VIT_BATCHES if families is None or "vit" in families else ():
        images = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(0)).to(device)
        yield f"ViT-B/16 (timm), {batch} images 224 px", "vit", Workload(vit, images, None, lambda m=vit, x=images: m(x))
    del vit
    for family in FAMILIES:
        if family != "vit" and (families is None or family in families):
            yield describe(family, quick=False), family, build(family, quick=False, device=device)


def plain(model: torch.nn.Module, inputs: Any) -> Callable[[], Any]:
    """The model's own forward of a test case's inputs (tensor, dict or a relevancy batch: what `explain` takes)."""
    from relevancy.api import prepared

    if isinstance(inputs, torch.Tensor):
        return lambda: model(inputs)
    if isinstance(inputs, dict):
        return lambda: model(**inputs)

    def forward() -> Any:  # typed batches: the adapter's own forward of the checked inputs
        with prepared(model, inputs, attention_probabilities=False) as call:
            return call.adapter.forward(call.inputs)

    return forward


def methods_of(family: str) -> list[str]:
    """The registry's methods the family's workload runs: the decoders' too on decoders (token ablation left out:
    its N + 1 forwards are plain forwards)."""
    from relevancy.families.base import SEED_METHODS

    names = relevancy.METHODS if family in ("llm", "causal_lm_llama", "causal_lm_gpt2") else SEED_METHODS
    return [m for m in names if m != "token_ablation"]


def measure(work: Workload, runs: dict[str, Callable[[], Any]], device: str, repeats: int) -> dict[str, dict]:
    """Per run: seconds and peak as ratios to the plain forward's, interleaved; a failure's first line instead."""
    def forward() -> None:
        with torch.no_grad():
            work.forward()

    forward()
    live, result = {}, {}
    for name, run in runs.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # conservation warnings of random weights
                run()
            live[name] = run
        except (UnsupportedModelError, ValueError, ImportError, RuntimeError) as error:
            result[name] = {"not run": str(error).splitlines()[0][:160]}
    base: list[tuple[float, int]] = []
    taken: dict[str, list[tuple[float, int]]] = {name: [] for name in live}
    for _ in range(repeats):
        for name, run in live.items():
            base.append(timed(forward, device))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                taken[name].append(timed(run, device))
    if not base:
        base.append(timed(forward, device))
    seconds, peak = statistics.median(s for s, _ in base), max(p for _, p in base)
    for name, values in taken.items():
        own_seconds, own_peak = statistics.median(s for s, _ in values), max(p for _, p in values)
        result[name] = {"seconds": own_seconds, "x forward": own_seconds / seconds,
                        "peak MiB": own_peak / 2**20, "x forward peak": own_peak / peak if peak else None}
    return {"forward": {"seconds": seconds, "peak MiB": peak / 2**20}, **result}


def runs_for(label: str, family: str, work: Workload) -> dict[str, Callable[[], Any]]:
    """Every method of the family; at ViT's largest batch also transformer attribution's memory options; lxt beside
    the decoder."""
    def call(method: str, **options: Any) -> Callable[[], Any]:
        return lambda: relevancy.explain(work.model, work.inputs, method=method, target=work.target, **options)

    runs = {method: call(method) for method in methods_of(family)}
    if family == "vit" and label.startswith(f"ViT-B/16 (timm), {VIT_BATCHES[-1]} "):
        for options in MEMORY_OPTIONS:
            text = ", ".join(f"{k}={v}" for k, v in options.items())
            runs[f"transformer_attribution, {text}"] = call("transformer_attribution", **options)
    if family == "llm":
        runs["lxt AttnLRP (lxt's own code)"] = lxt_run(work)
    return runs


def lxt_run(work: Workload) -> Callable[[], Any]:
    """lxt's AttnLRP of the decoder's next token (a failure to import lxt is reported in the row)."""
    def run() -> Any:
        from llm_lxt_reference import lxt_map, lxt_patched, targets

        ids, mask = work.inputs["input_ids"], work.inputs["attention_mask"]
        target = targets(work.model, ids, mask)
        with lxt_patched("llama", "attnLRP"):
            return lxt_map(work.model, ids, mask, target)
    return run


def exactness(device: str, families: list[str] | None) -> list[str]:
    """Rows: every family and method in float64 on `device` against the CPU, and the authors' ViT maps on `device`."""
    from family_cases import FAMILIES as CASES, to_device
    from golden import build_vit, exact_options, vit_cases

    rows = ["| model | method | largest difference / map's largest |", "|---|---|---:|"]
    for name, case in CASES.items():
        if families is not None and name not in families:
            continue
        cpu_model, on_device = case.build(), case.build().to(device)
        inputs, target = case.batch()
        for method in relevancy.METHODS:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    expected = relevancy.explain(cpu_model, inputs, method=method, target=target)
                    actual = relevancy.explain(on_device, to_device(inputs, device), method=method, target=target)
            except (UnsupportedModelError, ValueError) as error:
                rows.append(f"| {name} | {method} | not offered: {str(error).splitlines()[0][:100]} |")
                continue
            error = max(relative(actual.parts[part].scores, expected.parts[part].scores) for part in expected.parts)
            rows.append(f"| {name} vs CPU | {method} | {error:.1e} |")
    case = vit_cases()[0]
    model = build_vit(case).to(device)
    references = {"raw_attention": "raw_attention", "rollout": "rollout", "attention_gradcam": "attn_gradcam",
                  "generic_attention": "generic_attention", "cdam": "cdam", "transformer_attribution": "transformer_attribution",
                  "partial_lrp": "partial_lrp", "lrp": "lrp"}
    records = [r for r in case["records"] if "target" in r]
    for method, key in references.items():
        options = exact_options(method, {"normalize": True} if method == "attention_gradcam" else {})
        worst = 0.0
        for record in records:
            image = case["inputs"][record["image"]][None].to(device)
            scores = relevancy.explain(model, image, method=method, target=record["target"], **options).scores[0]
            reference = record[key]
            if torch.isnan(reference).any():  # the authors' 0/0 of an all-zero map: relevancy gives zeros
                worst = max(worst, float(scores.abs().max()))
                continue
            worst = max(worst, relative(scores.reshape(reference.shape), reference))
        rows.append(f"| authors' ViT (tests/golden/vit_reference64.pt) on {device} | {method} | {worst:.1e} |")
    return rows


def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference over the expected map's largest magnitude."""
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    return float((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-30))


def header(args: argparse.Namespace) -> list[str]:
    import transformers

    if args.device == "cuda":
        where = f"GPU {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}"
    else:
        where = f"CPU {cpu_name()}, {torch.get_num_threads()} thread(s)"
    return [f"# GPU table ({'--quick, ' if args.quick else ''}{where}, {today()})", "",
            f"torch {torch.__version__}, transformers {transformers.__version__}, Python {platform.python_version()}; "
            f"`python benchmarks/gpu.py {' '.join(sys.argv[1:])}`. Random weights. Time: median of {args.repeats} runs "
            "interleaved with the plain forward (no gradients), synchronised; peak: `torch.cuda.max_memory_allocated` "
            "of the run over the forward's (weights on both sides).", ""]


def speed_rows(args: argparse.Namespace) -> list[str]:
    rows = ["| model, inputs | method | ms | x forward time | peak MiB | x forward peak |", "|---|---|---:|---:|---:|---:|"]
    for label, family, work in workloads(args.device, args.quick, args.families):
        result = measure(work, runs_for(label, family, work), args.device, args.repeats)
        forward = result.pop("forward")
        memory = f"{forward['peak MiB']:.0f}" if args.device == "cuda" else "-"
        rows.append(f"| {label} | plain forward (no gradients) | {forward['seconds'] * 1e3:.1f} | 1 | {memory} | 1 |")
        for name, value in result.items():
            if "not run" in value:
                rows.append(f"| | {name} | not run: {value['not run'].replace('|', '/')} | | | |")
                continue
            peak = "-" if value["x forward peak"] is None else f"{value['peak MiB']:.0f} | {value['x forward peak']:.2f}"
            rows.append(f"| | {name} | {value['seconds'] * 1e3:.1f} | {value['x forward']:.2f} | {peak}"
                        + (" | -" if value["x forward peak"] is None else "") + " |")
        print(f"{label}: done", file=sys.stderr, flush=True)
        del work
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="the tests' tiny float64 models (a check of the script)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--families", nargs="+", default=None,
                        help=f"only these (default: all): {', '.join(FAMILIES)}; with --quick the names of tests/family_cases.py")
    parser.add_argument("--out", type=Path, default=None, help="default benchmarks/results/gpu_<device>[_quick].md")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here; try --device cpu --quick")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    lines = header(args) + ["## Time and memory", ""] + speed_rows(args)
    lines += ["", "## Exactness in float64 on the device", ""] + exactness(args.device, args.families if args.quick else None)
    out = args.out or HERE / "results" / f"gpu_{args.device}{'_quick' if args.quick else ''}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = out.with_suffix(".tmp")
    temporary.write_text("\n".join(lines) + "\n")
    temporary.replace(out)  # written whole or not at all
    print("\n".join(lines))
    return out


if __name__ == "__main__":
    main()
