"""Time and peak memory of every method on every family, as ratios to a plain forward pass: one table.

    OMP_NUM_THREADS=1 python benchmarks/speed_memory.py [--quick] [--families vit bert clip lxmert detr]
        [--methods ...] [--repeats 1] [--rows-at-once K] [--device cpu|cuda] [--out FILE] [--page docs/speed.md]

Models (random weights, built offline: the cost follows the models' sizes, not their weights' values):
ViT-B/16 (timm `vit_base_patch16_224`) on 8 images; BERT-base (`BertForSequenceClassification(BertConfig())`) on
one text of 512 tokens; CLIP ViT-B/32 (`CLIPModel`: image tower width 768 / patch 32 / 224 px, text tower width 512,
77 tokens) on 8 image-text pairs; LXMERT-base (`LxmertForQuestionAnswering(LxmertConfig(num_qa_labels=3129))`) on
8 questions of 20 tokens with 36 regions each; DETR-R50 (`DetrForObjectDetection(DetrConfig(
use_pretrained_backbone=False))`) on one 800x1066 image, explaining one object; a decoder language model of
SmolLM2-135M's shape (`LlamaForCausalLM`: 30 layers, width 576, 9 query and 3 key-value heads, vocabulary 49,152,
tied embeddings) on one prompt of 1,000 tokens, its plain forward the model's own (sdpa attention) computing the
next token's logits only. `--quick`: 2 images / pairs / questions, 128 tokens, a 480x640 image, a 128-token prompt.
The decoder methods (attnlrp, cp_lrp, input_x_gradient) are measured on the decoder only.

Every (family, method) runs in a fresh process (so that no measurement inherits another's heap): the model is
built, the method and a plain forward (no gradients) run once to warm up, then each runs `--repeats` times,
interleaved so that the machine's load falls on both. Time: the method's median over the forward's median.
Peak memory: on a CPU the resident-set high-water mark (Linux VmHWM, reset before each run) above the process's
resident size before the model was built, so the weights, the inputs and what the run allocates; on a GPU
`torch.cuda.max_memory_allocated`, which counts the same things. The ratio is to the plain forward's peak measured
the same way; a second ratio leaves the weights out of both (what the run allocates beyond the model).
`--rows-at-once K` passes `rows_at_once=K` to `explain` (K rows at a time: the option that trades time for memory);
`--checkpoint` passes `checkpoint=True` (one-stream models: each block run again in the backward; methods without
the option are listed as not run). token_ablation is left out (N+1 forwards by design; its memory is a forward's).
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from machine import cpu_name, today

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ("vit", "bert", "clip", "lxmert", "detr", "llm")
#: the methods that propagate relevance through every layer (goal: at most 3x a forward's memory; the others 2x)
LRP_METHODS = ("transformer_attribution", "partial_lrp", "lrp", "attnlrp", "cp_lrp")
GOALS = {"attention": 2.0, "lrp": 3.0}
FORWARD = "forward"


@dataclass(frozen=True)
class Workload:
    """A model, its inputs, what `explain` is asked to explain, and the model's own plain forward of the inputs."""

    model: Any
    inputs: Any
    target: Any
    forward: Callable[[], Any]


def describe(family: str, quick: bool) -> str:
    """The family's model and inputs in words, for the table."""
    batch = 2 if quick else 8
    return {
        "vit": f"ViT-B/16 (timm), {batch} images 224 px",
        "bert": f"BERT-base, 1 text of {128 if quick else 512} tokens",
        "clip": f"CLIP ViT-B/32, {batch} image-text pairs (77 tokens)",
        "lxmert": f"LXMERT-base, {batch} questions of 20 tokens, 36 regions",
        "detr": f"DETR-R50, 1 image {'480x640' if quick else '800x1066'}, 1 object",
        "llm": f"decoder of SmolLM2-135M's shape, 1 prompt of {128 if quick else 1000} tokens",
    }[family]


def build(family: str, quick: bool, device: str) -> Workload:
    """The family's model (random weights, eval mode) and inputs on `device`."""
    import torch

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    batch = 2 if quick else 8
    if family == "vit":
        import timm

        model = timm.create_model("vit_base_patch16_224", pretrained=False).eval().to(device)
        images = torch.randn(batch, 3, 224, 224, generator=generator).to(device)
        return Workload(model, images, None, lambda: model(images))
    import transformers

    if family == "bert":
        model = transformers.BertForSequenceClassification(transformers.BertConfig()).eval().to(device)
        ids = torch.randint(1000, 20000, (1, 128 if quick else 512), generator=generator)
        ids[:, 0], ids[:, -1] = 101, 102
        text = {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}
        return Workload(model, text, None, lambda: model(**text))
    if family == "clip":
        config = transformers.CLIPConfig(
            text_config=dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8),
            vision_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                               image_size=224, patch_size=32),
            projection_dim=512,
        )
        model = transformers.CLIPModel(config).eval().to(device)
        images = torch.randn(batch, 3, 224, 224, generator=generator).to(device)
        ids = torch.randint(1, 49406, (batch, 77), generator=generator)
        ids[:, 0], ids[:, -1] = 49406, 49407  # start and end tokens (the end token has the largest id)
        ids = ids.to(device)
        return Workload(model, (images, ids), None, lambda: model(input_ids=ids, pixel_values=images))
    if family == "lxmert":
        model = transformers.LxmertForQuestionAnswering(transformers.LxmertConfig(num_qa_labels=3129)).eval().to(device)
        ids = torch.randint(1000, 20000, (batch, 20), generator=generator)
        ids[:, 0], ids[:, -1] = 101, 102
        corner = torch.rand(batch, 36, 2, generator=generator) * 0.6
        boxes = torch.cat([corner, corner + 0.1 + torch.rand(batch, 36, 2, generator=generator) * 0.3], -1)
        question = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids),
                    "visual_feats": torch.randn(batch, 36, 2048, generator=generator).relu(), "visual_pos": boxes}
        question = {name: value.to(device) for name, value in question.items()}
        return Workload(model, question, None, lambda: model(**question))
    if family == "detr":
        model = transformers.DetrForObjectDetection(transformers.DetrConfig(use_pretrained_backbone=False)).eval().to(device)
        size = (480, 640) if quick else (800, 1066)
        pixels = {"pixel_values": torch.randn(1, 3, *size, generator=generator).to(device)}
        return Workload(model, pixels, [[(0, 1)]], lambda: model(**pixels))
    if family == "llm":
        config = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                          num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                                          tie_word_embeddings=True, rope_theta=100000.0)
        model = transformers.LlamaForCausalLM(config).eval().to(device)
        ids = torch.randint(100, 49000, (1, 128 if quick else 1000), generator=generator).to(device)
        prompt = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        return Workload(model, prompt, None, lambda: model(**prompt, use_cache=False, logits_to_keep=1))
    raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")


# ------------------------------------------------------------------------------------------------ in the child process
def resident_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))


def high_water_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM"))


def reset_high_water() -> None:
    """Set the resident high-water mark back to the present resident size (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def peak_run(run: Callable[[], Any], device: str, zero_kib: int) -> tuple[float, int]:
    """Seconds of one `run()` and its peak memory in KiB (CPU: above `zero_kib`, the size before the model)."""
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand the free heap back, so that a run's peak is its own
        reset_high_water()
    start = time.perf_counter()
    run()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() // 1024 if device == "cuda" else high_water_kib() - zero_kib
    return seconds, peak


def measure_child(family: str, method: str, quick: bool, device: str, repeats: int, rows_at_once: int | None,
                  checkpoint: bool = False) -> dict:
    """The medians of the forward's and the method's seconds and the peak of each, in this (fresh) process."""
    import timm  # noqa: F401  (the model libraries loaded before the zero point: their code is not the run's memory)
    import torch
    import transformers  # noqa: F401

    import relevancy
    from relevancy.families.base import UnsupportedModelError

    if device == "cpu":
        torch.set_num_threads(1)
    zero_kib = resident_kib()
    work = build(family, quick, device)

    def forward() -> None:
        with torch.no_grad():
            work.forward()

    def explain() -> None:
        options = {"checkpoint": True} if checkpoint else {}
        relevancy.explain(work.model, work.inputs, method=method, target=work.target, rows_at_once=rows_at_once, **options)

    try:
        explain()  # warm-up: one-time allocations and first-call costs are not the method's
    except (UnsupportedModelError, ValueError) as error:
        return {"unsupported": str(error).splitlines()[0]}
    forward()
    runs: dict[str, list[tuple[float, int]]] = {FORWARD: [], method: []}
    for _ in range(repeats):
        runs[FORWARD].append(peak_run(forward, device, zero_kib))
        runs[method].append(peak_run(explain, device, zero_kib))
    weights = sum(t.numel() * t.element_size() for t in [*work.model.parameters(), *work.model.buffers()])
    measured = {name: {"seconds": statistics.median(s for s, _ in values), "peak_kib": max(p for _, p in values)}
                for name, values in runs.items()}
    return {**measured, "weights_kib": weights // 1024}


# ------------------------------------------------------------------------------------------------ in the parent
def measure(family: str, method: str, args: argparse.Namespace) -> dict:
    """`measure_child` in a fresh interpreter."""
    argv = [sys.executable, __file__, "--child", family, method, "--repeats", str(args.repeats), "--device", args.device]
    if args.rows_at_once:
        argv += ["--rows-at-once", str(args.rows_at_once)]
    if args.checkpoint:
        argv.append("--checkpoint")
    done = subprocess.run(argv + (["--quick"] if args.quick else []), capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return {"failed": last}
    return json.loads(done.stdout.strip().splitlines()[-1])


def goal(method: str) -> float:
    return GOALS["lrp" if method in LRP_METHODS else "attention"]


def table(results: dict[str, dict[str, dict]], args: argparse.Namespace) -> list[str]:
    """Markdown rows: per family a forward row (absolute figures) and per method its ratios."""
    lines = ["| family (random weights) | method | seconds | x forward time | peak MiB | x forward peak | "
             "x forward peak, weights left out | memory goal (x forward peak) |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for family, methods in results.items():
        forwards = [r[FORWARD] for r in methods.values() if FORWARD in r]
        if not forwards:
            lines.append(f"| {describe(family, args.quick)} | (every run failed) | | | | | | |")
            continue
        seconds = statistics.median(f["seconds"] for f in forwards)
        peak = statistics.median(f["peak_kib"] for f in forwards) / 1024
        weights = next(r["weights_kib"] for r in methods.values() if "weights_kib" in r) / 1024
        lines.append(f"| {describe(family, args.quick)}; weights {weights:.0f} MiB | plain forward (no gradients) | "
                     f"{seconds:.3f} | 1 | {peak:.0f} | 1 | 1 | |")
        for method, result in methods.items():
            if "unsupported" in result or "failed" in result:
                why = result.get("unsupported") or f"failed: {result['failed']}"
                lines.append(f"| | {method} | | | | | | not run: {why.replace('|', '/')} |")
                continue
            own, base = result[method], result[FORWARD]
            memory = own["peak_kib"] / base["peak_kib"]
            beyond = (own["peak_kib"] - result["weights_kib"]) / max(base["peak_kib"] - result["weights_kib"], 1)
            verdict = "met" if memory <= goal(method) else "**above**"
            lines.append(f"| | {method} | {own['seconds']:.3f} | {own['seconds'] / base['seconds']:.2f} | "
                         f"{own['peak_kib'] / 1024:.0f} | {memory:.2f} | {beyond:.2f} | <= {goal(method):g}x: {verdict} |")
    return lines


def write_into_page(page: Path, name: str, report: str) -> None:
    """Put `report` between the page's `<!-- name begin -->` and `<!-- name end -->` lines (added at its end if absent)."""
    begin, end = f"<!-- {name} begin -->", f"<!-- {name} end -->"
    text = page.read_text() if page.exists() else ""
    block = f"{begin}\n{report.replace('# ', '### ', 1)}{end}"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = f"{text.rstrip()}\n\n{block}\n" if text else f"{block}\n"
    page.write_text(text)


def variant(args: argparse.Namespace) -> str:
    """The options that change what is measured, for the title."""
    return (("--quick, " if args.quick else "") + (f"rows_at_once={args.rows_at_once}, " if args.rows_at_once else "")
            + ("checkpoint=True, " if args.checkpoint else ""))


def header(args: argparse.Namespace) -> list[str]:
    import torch
    import transformers

    if args.device == "cuda":
        where = f"GPU {torch.cuda.get_device_name()}"
    else:
        where = f"CPU {cpu_name()}, 1 thread"
    return [
        f"# Speed and memory per family and method ({variant(args)}{where}, {today()})",
        "",
        f"torch {torch.__version__}, transformers {transformers.__version__}, Python {platform.python_version()}; "
        f"`python benchmarks/speed_memory.py {' '.join(sys.argv[1:])}`. "
        f"Each row a fresh process; median of {args.repeats} run(s) after a warm-up. Random weights. Time and peak "
        "memory as ratios to a plain forward pass (no gradients) of the same inputs in the same process; peak memory "
        "counts the weights, the inputs and what the run allocates"
        + (" (`torch.cuda.max_memory_allocated`)." if args.device == "cuda" else
           " (resident high-water mark above the process before the model was built). The machine is shared with other "
           "jobs: times are noisy (under load one run can be off by 2x); the memory is not."),
        "",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--methods", nargs="+", default=None, help="default: every method but token_ablation (the decoder methods on the decoder only)")
    parser.add_argument("--quick", action="store_true", help="smaller batches, texts and images")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--rows-at-once", type=int, default=None, help="explain's rows_at_once (default: the whole batch)")
    parser.add_argument("--checkpoint", action="store_true", help="explain's checkpoint=True (methods without it: not run)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--out", type=Path, default=None, help="default benchmarks/results/speed_memory_<device>[_quick].md")
    parser.add_argument("--page", type=Path, default=ROOT / "docs" / "speed.md",
                        help="the page whose table for this device (and --quick) is replaced (default docs/speed.md)")
    parser.add_argument("--child", nargs=2, metavar=("FAMILY", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.rows_at_once is not None and args.rows_at_once < 1:
        parser.error(f"--rows-at-once must be at least 1, got {args.rows_at_once}")
    if args.child:
        print(json.dumps(measure_child(*args.child, args.quick, args.device, args.repeats, args.rows_at_once, args.checkpoint)))
        return
    from relevancy import METHODS as known
    from relevancy.families.base import SEED_METHODS

    methods = args.methods or [m for m in known if m != "token_ablation"]
    unknown = sorted(set(methods) - set(known))
    if unknown:
        parser.error(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    results: dict[str, dict[str, dict]] = {}
    for family in args.families:
        results[family] = {}
        for method in methods:
            if method not in SEED_METHODS and family != "llm":
                continue  # the decoder methods: decoders only
            results[family][method] = measure(family, method, args)
            print(f"{family} {method}: {json.dumps(results[family][method])}", file=sys.stderr, flush=True)
    report = "\n".join(header(args) + table(results, args)) + "\n"
    suffix = (("_quick" if args.quick else "") + (f"_rows{args.rows_at_once}" if args.rows_at_once else "")
              + ("_checkpoint" if args.checkpoint else ""))
    out = args.out or ROOT / "benchmarks" / "results" / f"speed_memory_{args.device}{suffix}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    write_into_page(args.page, f"speed_memory {args.device}{suffix.replace('_', ' ')}", report)
    print(report)


if __name__ == "__main__":
    main()
