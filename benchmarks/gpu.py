"""The GPU table: every family and method, time and peak memory as ratios to a forward, and float64 exactness on CUDA.

    python benchmarks/gpu.py [--device cuda|cpu] [--quick] [--repeats 3] [--families ...] [--out benchmarks/results/gpu_<device>.md]

One prepared script for the short time a GPU is lent (about 3 minutes on an H200 with `--repeats 5`); try it first on a CPU with `--device cpu --quick` (the tests' tiny float64 models;
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
2. **Decoders in their own dtype** (issue 32, items 4 to 6): a decoder of SmolLM2-135M's shape (random weights, sdpa
   attention) in float32 at 100 and 1,000 tokens and in bf16 at 100, 1,000 and 4,000 tokens, and one of Llama-3.2-1B's
   shape (where the GPU's time is arithmetic more than kernel launches) at 1,000 tokens in float32 and bf16 and 4,000
   in bf16: relevancy's `attnlrp`, with `checkpoint=True`, and lxt's AttnLRP (its README's call with the last
   position's logits only and the weights frozen; lxt's patches applied around each of its runs, so both tools are
   timed against the same unpatched forward) side by side, the peaks also as a ratio to lxt's; at 1,000 tokens in
   float32 (SmolLM2's shape) `transformer_attribution` and `lrp`, each with `checkpoint=True`. Then the maps' distances: bf16 against
   float32 (the same weights), relevancy against lxt. `--quick`: a two-layer decoder at 32 tokens.
3. **A vision-language decoder** (issue 34, item 6): LLaVA-1.5-7B's shape at full depth (24 tower layers, 32
   decoder layers, 576 image tokens and 24 text tokens), random weights made on the device, float32 and bf16:
   `attnlrp`, with `checkpoint=True`, `generic_attention`. `--quick`: the tests' tiny LLaVA.
4. **Exactness in float64**: every family and method of `tests/family_cases.py` on the device against the CPU (the
   largest difference over the map's largest magnitude), and the authors' ViT maps of `tests/golden/vit_reference64.pt`
   computed on the device (the same measure; the tests require 1e-8).
`--sections` picks and orders the parts (default: decoder, vlm, speed, exactness); the file is rewritten whole after
each part, so a run cut short keeps the parts it finished. The card, torch, CUDA and transformers versions head the table. With `--device cpu` the memory column is left out
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

#: the row of lxt's own AttnLRP beside the decoders
LXT = "lxt AttnLRP (lxt's own code)"
#: what transformer attribution's memory options are measured with at the largest ViT batch
MEMORY_OPTIONS = ({"rows_at_once": 8}, {"checkpoint": True})
VIT_BATCHES = (1, 8, 32)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(run: Callable[[], Any], device: str) -> tuple[float, int]:
    """Seconds of one `run()` (the device's queued work included) and the bytes it allocated at its peak above what
    was allocated before it (0 on a CPU): what the call itself needs, whatever an earlier model left behind."""
    synchronize(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    run()
    synchronize(device)
    seconds = time.perf_counter() - start
    return seconds, torch.cuda.max_memory_allocated() - before if device == "cuda" else 0


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes of the model's parameters and buffers: counted on both sides of a peak ratio."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


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
    weights = weight_bytes(work.model) if device == "cuda" else 0
    seconds, peak = statistics.median(s for s, _ in base), weights + max(p for _, p in base)
    for name, values in taken.items():
        own_seconds, own_peak = statistics.median(s for s, _ in values), weights + max(p for _, p in values)
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
        runs[LXT] = lxt_run(work)
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


#: (shape, dtype, prompt tokens) of the decoder part: the issue's settings, a 1B model where the GPU's time is
#: arithmetic rather than kernel launches, and the quick check's
DECODER_SETTINGS = (("SmolLM2-135M", "float32", 100), ("SmolLM2-135M", "float32", 1000), ("SmolLM2-135M", "bfloat16", 100),
                    ("SmolLM2-135M", "bfloat16", 1000), ("SmolLM2-135M", "bfloat16", 4000), ("Llama-3.2-1B", "float32", 1000),
                    ("Llama-3.2-1B", "bfloat16", 1000), ("Llama-3.2-1B", "bfloat16", 4000))
QUICK_DECODER_SETTINGS = (("tiny", "float32", 32), ("tiny", "bfloat16", 32))
#: the decoders' widths (random weights)
DECODER_SHAPES = {
    "tiny": dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, rope_theta=100000.0),
    "SmolLM2-135M": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0),
    "Llama-3.2-1B": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def decoder_model(shape: str, dtype: str, device: str) -> torch.nn.Module:
    """A Llama decoder of `DECODER_SHAPES[shape]`, random weights made on `device`, in `dtype`."""
    import transformers

    config = transformers.LlamaConfig(**DECODER_SHAPES[shape], max_position_embeddings=8192, tie_word_embeddings=True,
                                      attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.LlamaForCausalLM(config).eval().to(DTYPES[dtype])


def lxt_attnlrp(model: torch.nn.Module) -> Callable[[dict], torch.Tensor]:
    """lxt's AttnLRP as its README runs it, with relevancy's shortcut (the last position's logits only) and the weights
    frozen for the call (their flags restored), so its one backward reaches the input only, as relevancy's does."""
    def run(prompt: dict) -> torch.Tensor:
        flags = [p.requires_grad for p in model.parameters()]
        model.requires_grad_(False)
        try:
            embeds = model.get_input_embeddings()(prompt["input_ids"]).detach().requires_grad_(True)
            logits = model(inputs_embeds=embeds, use_cache=False, logits_to_keep=1).logits[0, -1]
            logits[logits.detach().argmax()].backward()
            return (embeds * embeds.grad).float().sum(-1)[0].detach()
        finally:
            for parameter, flag in zip(model.parameters(), flags):
                parameter.requires_grad_(flag)
    return run


def distance(a: torch.Tensor, b: torch.Tensor) -> str:
    """'correlation / largest difference over b's largest magnitude' of two maps."""
    a, b = a.detach().double().flatten().cpu(), b.detach().double().flatten().cpu()
    correlation = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
    return f"{correlation:.6f} / {float((a - b).abs().max() / b.abs().max()):.1e}"


def timed_rows(label: str, result: dict[str, dict], device: str, beside_lxt: bool = False) -> list[str]:
    """Table rows of `measure`'s result, the forward first (its peak "-" off a GPU); `beside_lxt`: a last column of
    each peak over lxt's run's (`LXT`) in the same result."""
    forward = result.pop("forward")
    memory = f"{forward['peak MiB']:.0f}" if device == "cuda" else "-"
    lxt_peak = result.get(LXT, {}).get("peak MiB") if beside_lxt else None
    end = " |" if beside_lxt else ""
    rows = [f"| {label} | plain forward (no gradients) | {forward['seconds'] * 1e3:.1f} | 1 | {memory} | 1 |{end}"]
    for name, value in result.items():
        if "not run" in value:
            rows.append(f"| | {name} | not run: {value['not run'].replace('|', '/')} | | | |{end}")
            continue
        measured = value["x forward peak"] is not None
        peak = f"{value['peak MiB']:.0f} | {value['x forward peak']:.2f}" if measured else "- | -"
        over = f" {value['peak MiB'] / lxt_peak:.2f} |" if beside_lxt and measured and lxt_peak else end
        rows.append(f"| | {name} | {value['seconds'] * 1e3:.1f} | {value['x forward']:.2f} | {peak} |{over}")
    return rows


def decoder_rows(args: argparse.Namespace) -> list[str]:
    """The decoder part: time and peak of relevancy's and lxt's AttnLRP per shape, dtype and length (over the same
    plain forward: lxt's patches are applied around each of its own runs only), then the maps' distances."""
    rows = ["| decoder, dtype, prompt | method | ms | x forward time | peak MiB | x forward peak | peak / lxt's |",
            "|---|---|---:|---:|---:|---:|---:|"]
    maps: dict[tuple[str, str, str, int], torch.Tensor] = {}
    settings = QUICK_DECODER_SETTINGS if args.quick else DECODER_SETTINGS
    # the seeds' transformer attribution and LRP at the first shape's longest float32 prompt
    seeds_at = max((setting for setting in settings if setting[:2] == (settings[0][0], "float32")), key=lambda setting: setting[2])
    for shape, dtype, tokens in settings:
        model = decoder_model(shape, dtype, args.device)
        ids = torch.randint(100, model.config.vocab_size - 100, (1, tokens), generator=torch.Generator().manual_seed(tokens))
        prompt = {"input_ids": ids.to(args.device), "attention_mask": torch.ones_like(ids).to(args.device)}
        work = Workload(model, prompt, None, lambda m=model, p=prompt: m(**p, use_cache=False, logits_to_keep=1))

        def ours(method: str, **options: Any) -> Callable[[], Any]:
            return lambda: relevancy.explain(model, prompt, method=method, **options)

        runs = {"relevancy attnlrp": ours("attnlrp"), "relevancy attnlrp, checkpoint=True": ours("attnlrp", checkpoint=True)}
        if (shape, dtype, tokens) == seeds_at:
            for method in ("transformer_attribution", "lrp"):
                runs[f"relevancy {method}"] = ours(method)
                runs[f"relevancy {method}, checkpoint=True"] = ours(method, checkpoint=True)
        try:
            from llm_lxt_reference import lxt_patched

            explain_lxt = lxt_attnlrp(model)

            def lxt_run() -> torch.Tensor:
                with lxt_patched("llama", "attnLRP"):
                    return explain_lxt(prompt)

            runs[LXT] = lxt_run
        except ImportError as error:
            explain_lxt = lxt_run = None
            missing = f"lxt not importable here: {error}"
        result = measure(work, runs, args.device, args.repeats)
        if lxt_run is None:
            result[LXT] = {"not run": missing}
        elif "not run" not in result[LXT]:
            maps[("lxt", shape, dtype, tokens)] = lxt_run()
        maps[("relevancy", shape, dtype, tokens)] = relevancy.explain(model, prompt, method="attnlrp").scores[0].float()
        label = f"{shape}'s shape, {dtype}, {tokens} tokens"
        rows += timed_rows(label, result, args.device, beside_lxt=True)
        print(f"decoder {shape} {dtype} {tokens}: done", file=sys.stderr, flush=True)
        del model, work, runs, explain_lxt, lxt_run
        if args.device == "cuda":
            torch.cuda.empty_cache()
    rows += ["", "Map distances (Pearson correlation / largest difference over the second map's largest magnitude):", "",
             "| decoder, prompt | maps compared | distance |", "|---|---|---|"]
    for shape, dtype, tokens in settings:
        if ("lxt", shape, dtype, tokens) in maps:
            rows.append(f"| {shape}, {tokens} tokens, {dtype} | relevancy against lxt | "
                        f"{distance(maps[('relevancy', shape, dtype, tokens)], maps[('lxt', shape, dtype, tokens)])} |")
        for tool in ("relevancy", "lxt"):
            if dtype != "float32" and (tool, shape, dtype, tokens) in maps and (tool, shape, "float32", tokens) in maps:
                rows.append(f"| {shape}, {tokens} tokens | {tool}: {dtype} against float32 (same weights) | "
                            f"{distance(maps[(tool, shape, dtype, tokens)], maps[(tool, shape, 'float32', tokens)])} |")
    return rows


def vlm_workload(dtype: str, device: str, quick: bool) -> tuple[str, Workload]:
    """LLaVA-1.5-7B's shape at full depth (random weights made on `device`) with 576 image and 24 text tokens, or
    the tests' tiny LLaVA with `quick`."""
    if quick:
        from vlm_models import build, inputs as tiny_inputs

        model = build("llava", dtype=DTYPES[dtype]).to(device)
        inputs = {k: v[:1].to(device, DTYPES[dtype] if v.is_floating_point() else v.dtype) for k, v in tiny_inputs("llava").items()}
        label = "tiny LLaVA of the tests"
    else:
        from vlm_speed import build, prompt

        with torch.device(device):
            model = build(tower_layers=24, decoder_layers=32).to(DTYPES[dtype])
        inputs = {k: v.to(device) for k, v in prompt().items()}
        inputs["pixel_values"] = inputs["pixel_values"].to(DTYPES[dtype])
        label = "LLaVA-1.5-7B's shape (24 + 32 layers), 576 image + 24 text tokens"
    return f"{label}, {dtype}", Workload(model, inputs, None, lambda: model(**inputs, use_cache=False, logits_to_keep=1))


def vlm_rows(args: argparse.Namespace) -> list[str]:
    """The vision-language part: attnlrp (also with checkpoint=True) and generic_attention over the plain forward."""
    rows = ["| model, dtype | method | ms | x forward time | peak MiB | x forward peak |", "|---|---|---:|---:|---:|---:|"]
    for dtype in ("float32", "bfloat16"):
        label, work = vlm_workload(dtype, args.device, args.quick)

        def ours(method: str, **options: Any) -> Callable[[], Any]:
            return lambda: relevancy.explain(work.model, work.inputs, method=method, **options)

        runs = {"attnlrp": ours("attnlrp"), "attnlrp, checkpoint=True": ours("attnlrp", checkpoint=True),
                "generic_attention": ours("generic_attention")}
        rows += timed_rows(label, measure(work, runs, args.device, args.repeats), args.device)
        print(f"vlm {dtype}: done", file=sys.stderr, flush=True)
        del work, runs
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return rows


def header(args: argparse.Namespace) -> list[str]:
    import transformers

    if args.device == "cuda":
        where = f"GPU {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}"
    else:
        where = f"CPU {cpu_name()}, {torch.get_num_threads()} thread(s)"
    return [f"# GPU table ({'--quick, ' if args.quick else ''}{where}, {today()})", "",
            f"torch {torch.__version__}, transformers {transformers.__version__}, Python {platform.python_version()}; "
            f"`python benchmarks/gpu.py {' '.join(sys.argv[1:])}`. Random weights. Time: median of {args.repeats} runs "
            "interleaved with the plain forward (no gradients), synchronised; peak: the model's weights plus what the run "
            "allocated at its peak above what was allocated before it (`torch.cuda.max_memory_allocated`), over the "
            "same of the forward (weights on both sides).", ""]


def speed_rows(args: argparse.Namespace) -> list[str]:
    rows = ["| model, inputs | method | ms | x forward time | peak MiB | x forward peak |", "|---|---|---:|---:|---:|---:|"]
    for label, family, work in workloads(args.device, args.quick, args.families):
        rows += timed_rows(label, measure(work, runs_for(label, family, work), args.device, args.repeats), args.device)
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
    parser.add_argument("--sections", nargs="+", default=["decoder", "vlm", "speed", "exactness"],
                        help="the parts run, in this order: decoder, vlm, speed, exactness")
    parser.add_argument("--out", type=Path, default=None, help="default benchmarks/results/gpu_<device>[_quick].md")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here; try --device cpu --quick")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    parts = {"decoder": ("Decoders: relevancy and lxt, float32 and bf16", decoder_rows),
             "vlm": ("A vision-language decoder", vlm_rows),
             "speed": ("Time and memory", speed_rows),
             "exactness": ("Exactness in float64 on the device",
                           lambda a: exactness(a.device, a.families if a.quick else None))}
    unknown = [name for name in args.sections if name not in parts]
    if unknown:
        parser.error(f"unknown --sections {', '.join(unknown)}; choose from {', '.join(parts)}")
    out = args.out or HERE / "results" / f"gpu_{args.device}{'_quick' if args.quick else ''}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = header(args)
    for name in args.sections:
        title, rows = parts[name]
        lines += ["", f"## {title}", ""] + rows(args)
        temporary = out.with_suffix(".tmp")
        temporary.write_text("\n".join(lines) + "\n")
        temporary.replace(out)  # each version written whole or not at all
    print("\n".join(lines))
    return out


if __name__ == "__main__":
    main()
