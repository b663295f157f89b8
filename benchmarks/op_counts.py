"""Tensor operations and kernel launches per call of every method, counted by torch.profiler, beside the time.

    OMP_NUM_THREADS=1 python benchmarks/op_counts.py [--families vit bert clip lxmert detr llm] [--batches 1 8]
        [--methods ...] [--repeats 3] [--before DIR] [--out benchmarks/results/op_counts_cpu.md]

What is counted, per call of `relevancy.explain` (after a warm-up call), from the profiler's CPU events:
- **ops**: the aten operators called from Python or by autograd's engine (not the ones an operator calls inside
  itself): what the library and autograd ask for;
- **launches**: the operators that do work and call no other operator (views, reshapes, `empty`, `detach` and
  the like left out, and the host's handling of Python numbers: filling or converting a 0-dim tensor): on a GPU
  each is about one kernel launch, which is what costs time at small batches there;
- **copies**: `copy_`, `clone` and `_to_copy` among the launches (dtype round trips, `.contiguous()`, clones);
- **syncs**: operators that read a value back to the host (`.item()`, `bool(tensor)`, `nonzero`): on a GPU each
  waits until the queued kernels have run.
The counts follow the model's depth and the methods' code, not the machine: they hold on a GPU too (cuDNN / cuBLAS
may split an operator into more than one kernel). A plain forward of the same inputs (no gradients) is counted the
same way, and each count is also given as a multiple of it.

Time: the method's median over `--repeats` runs divided by the plain forward's, interleaved in one process.
`--before DIR`: a second copy of the library (the `src` folder of an earlier commit, e.g. made with
`git archive <commit> src | tar -x -C /tmp/before`) loaded in the same process beside this one (each version's
modules swapped into `sys.modules` while it runs), so that before and after are counted and timed on the same
models, interleaved: forward, before, after.

Models: ViT-B/16 (timm `vit_base_patch16_224`, random weights) at each of `--batches`; `small`: a ViT of ViT-B/16's
depth and heads with almost no arithmetic (width 48, 5 tokens), whose times are what a call costs besides its
arithmetic (Python, hooks, dispatch: what a GPU waits on at small batches); the other families at the
`--quick` shapes of `benchmarks/speed_memory.py` (`build`): BERT-base on 128 tokens, CLIP ViT-B/32 on 2 pairs,
LXMERT-base on 2 questions, DETR-R50 on one 480x640 image, a decoder of SmolLM2-135M's shape on 128 tokens.
token_ablation is left out (its N+1 forwards are plain forwards by design).
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_name, today  # noqa: E402
from speed_memory import build, describe  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ("vit", "small", "bert", "clip", "lxmert", "detr", "llm")
SMALL = "ViT of ViT-B/16's depth, width 48, 12 heads, 32 px (5 tokens), batch 1: the fixed cost"
#: operators that launch no kernel where they are leaves: views, metadata, allocation, no-op conversions
NO_KERNEL = frozenset(f"aten::{name}" for name in (
    "view", "_unsafe_view", "as_strided", "reshape", "_reshape_alias", "expand", "expand_as", "permute", "transpose",
    "t", "numpy_T", "unsqueeze", "squeeze", "select", "slice", "narrow", "split", "split_with_sizes", "chunk",
    "unbind", "unflatten", "flatten", "movedim", "detach", "detach_", "alias", "lift_fresh", "empty", "empty_like",
    "empty_strided", "resolve_conj", "resolve_neg", "contiguous", "to", "type_as", "view_as", "requires_grad_",
    "set_", "result_type", "is_nonzero", "size", "stride", "dim", "_has_compatible_shallow_copy_type", "diagonal",
    "index_select_backward", "real", "imag", "conj", "_conj", "broadcast_to", "align_as", "as_strided_", "squeeze_",
    "unsqueeze_", "transpose_", "t_", "_nested_tensor_size", "_shape_as_tensor", "dropout", "feature_dropout",
))
COPIES = frozenset(("aten::copy_", "aten::clone", "aten::_to_copy"))
#: operators that read a value back to the host: on a GPU each waits for the queued work (a synchronisation)
SCALAR_STEPS = frozenset(("aten::fill_", "aten::copy_", "aten::_to_copy", "aten::zero_", "aten::lift_fresh",
                          "aten::scalar_tensor"))
COUNTS = ("launches", "ops", "copies", "syncs")
SYNCS = frozenset(("aten::_local_scalar_dense", "aten::is_nonzero", "aten::nonzero", "aten::equal"))


def on_scalar(event: Any) -> bool:
    """A Python number turned into a 0-dim tensor or converted for an operator (`x + 1e-9` on a CPU): host work, no
    kernel on a GPU, where a number goes to the kernel as an argument."""
    shapes = [shape for shape in event.input_shapes if isinstance(shape, list)]
    return event.name in SCALAR_STEPS and all(len(shape) == 0 for shape in shapes)


def count_ops(run: Callable[[], Any]) -> dict[str, int]:
    """The ops, launches and copies of one `run()` (see the module docstring)."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        run()
    counts = {"ops": 0, "launches": 0, "copies": 0, "syncs": 0}

    def launches_below(event: Any) -> int:
        """Count the launches at and below `event`: an operator launches where no operator below it does."""
        below = sum(launches_below(child) for child in event.cpu_children)
        if below == 0 and event.name.startswith("aten::") and event.name not in NO_KERNEL and not on_scalar(event):
            counts["launches"] += 1
            counts["copies"] += event.name in COPIES
            counts["syncs"] += event.name in SYNCS
            return 1
        return below

    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith(("aten::", "autograd::")):
            parent = parent.cpu_parent  # record_function ranges of the library or of the model are not operators
        if parent is None or parent.name.startswith("autograd::"):
            counts["ops"] += 1
            launches_below(event)
    return counts


class Version:
    """One copy of the `relevancy` package, importable beside another in the same process."""

    def __init__(self, src: Path | None, label: str) -> None:
        self.label = label
        others = self._take()
        if src is not None:
            sys.path.insert(0, str(src))
        try:
            import relevancy

            self.relevancy = relevancy
        finally:
            if src is not None:
                sys.path.remove(str(src))
        self.modules = self._take()
        sys.modules.update(others)

    @staticmethod
    def _take() -> dict[str, Any]:
        """Remove the loaded `relevancy` modules from `sys.modules` and return them."""
        names = [n for n in sys.modules if n == "relevancy" or n.startswith("relevancy.")]
        return {name: sys.modules.pop(name) for name in names}

    @contextmanager
    def active(self) -> Iterator[Any]:
        """This version's modules in `sys.modules` (so that imports inside its functions find its own)."""
        others = self._take()
        sys.modules.update(self.modules)
        try:
            yield self.relevancy
        finally:
            self.modules.update(self._take())
            sys.modules.update(others)


def seconds(run: Callable[[], Any]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def workloads(families: list[str], batches: list[int]) -> Iterator[tuple[str, Any]]:
    """(label, Workload) for ViT-B/16 at each batch and the other families at their quick shapes."""
    import timm

    from speed_memory import Workload

    for family in families:
        if family == "vit":
            torch.manual_seed(0)
            model = timm.create_model("vit_base_patch16_224", pretrained=False).eval()
            for batch in batches:
                images = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(0))
                yield f"ViT-B/16 (timm), batch {batch}", Workload(model, images, None, lambda m=model, x=images: m(x))
        elif family == "small":
            from timm.models.vision_transformer import VisionTransformer

            torch.manual_seed(0)
            model = VisionTransformer(img_size=32, patch_size=16, embed_dim=48, depth=12, num_heads=12).eval()
            images = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
            yield SMALL, Workload(model, images, None, lambda m=model, x=images: m(x))
        else:
            yield describe(family, quick=True), build(family, quick=True, device="cpu")


def method_names(family: str, relevancy: Any, asked: list[str] | None) -> list[str]:
    names = relevancy.METHODS  # loads the version's registry (relevancy.methods) on first use
    methods = sys.modules["relevancy.methods"]
    # one registry now (the decoders' methods take token targets); an earlier version kept them apart
    decoders = [m for m, spec in methods.REGISTRY.items() if getattr(spec, "token_targets", False)]
    decoders += list(getattr(methods, "LANGUAGE_REGISTRY", ()))
    from_registry = [m for m in names if m != "token_ablation" and m not in decoders]
    if family == "llm":
        from_registry += decoders
    return [m for m in from_registry if asked is None or m in asked]


def measure(work: Any, method: str, versions: list[Version], repeats: int) -> dict[str, Any]:
    """Counts and time ratio of `method` under each version, interleaved with the plain forward."""
    def forward() -> None:
        with torch.no_grad():
            work.forward()

    def call(version: Version) -> Callable[[], Any]:
        def run() -> Any:
            with version.active() as relevancy:
                return relevancy.explain(work.model, work.inputs, method=method, target=work.target)
        return run

    result: dict[str, Any] = {}
    runs = {v.label: call(v) for v in versions}
    for label, run in runs.items():
        try:
            run()
        except (ValueError, TypeError) as error:  # a method the family does not offer (UnsupportedModelError)
            result[label] = {"unsupported": str(error).splitlines()[0]}
    live = {label: run for label, run in runs.items() if label not in result}
    for label, run in live.items():
        result[label] = count_ops(run)
    times: dict[str, list[float]] = {label: [] for label in live}
    base = []
    for _ in range(repeats):
        for label, run in live.items():
            base.append(seconds(forward))
            times[label].append(seconds(run))
    forward_seconds = statistics.median(base) if base else float("nan")
    for label in live:
        result[label]["ratio"] = statistics.median(times[label]) / forward_seconds
    result["forward_seconds"] = forward_seconds
    return result


def report(rows: list[tuple[str, str, dict]], forwards: dict[str, dict], labels: list[str], args: argparse.Namespace) -> str:
    import transformers

    command = " ".join(sys.argv[1:])
    lines = [f"# Operations per call (CPU {cpu_name()}, {torch.get_num_threads()} thread(s), {today()})", "",
             f"torch {torch.__version__}, transformers {transformers.__version__}, Python {platform.python_version()}; "
             f"`python benchmarks/op_counts.py {command}`. Counts from torch.profiler (CPU events) of one call after a "
             "warm-up; ops: aten operators asked for by Python or autograd; launches: operators that do work and call "
             f"no other (about one GPU kernel each); copies: copy_/clone/_to_copy among them. Time: median of {args.repeats} "
             "interleaved runs over the plain forward's (no gradients) in the same process. Random weights.", ""]
    heads = " | ".join(f"{what} {label}" for what in COUNTS + ("x forward time",) for label in labels)
    lines += [f"| model, inputs | method | {heads} | launches, x forward's |",
              "|---|---|" + "---:|" * ((len(COUNTS) + 1) * len(labels) + 1)]
    for work, method, result in rows:
        if method == "plain forward":
            cells = [str(result[k]) for k in COUNTS for _ in labels] + ["1"] * len(labels)
            lines.append(f"| {work} (forward {forwards[work]['forward_seconds']:.3f} s) | plain forward (no gradients) | "
                         + " | ".join(cells) + " | 1 |")
            continue
        if any("unsupported" in result[label] for label in labels):
            why = next(result[label]["unsupported"] for label in labels if "unsupported" in result[label])
            lines.append(f"| | {method} | not run: {why.replace('|', '/')} |")
            continue
        cells = [str(result[label][k]) for k in COUNTS for label in labels]
        cells += [f"{result[label]['ratio']:.2f}" for label in labels]
        last = result[labels[-1]]["launches"] / forwards[work]["launches"]
        lines.append(f"| | {method} | " + " | ".join(cells) + f" | {last:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8], help="ViT-B/16 batches")
    parser.add_argument("--methods", nargs="+", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--before", type=Path, default=None, help="the src folder of an earlier copy of the library")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "op_counts_cpu.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    versions = ([Version(args.before, "before")] if args.before else []) + [Version(None, "after" if args.before else "")]
    labels = [v.label for v in versions]
    rows: list[tuple[str, str, dict]] = []
    forwards: dict[str, dict] = {}
    for label, work in workloads(args.families, args.batches):
        def forward(work=work) -> None:
            with torch.no_grad():
                work.forward()
        forward()
        forwards[label] = {**count_ops(forward), "forward_seconds": 0.0}
        rows.append((label, "plain forward", forwards[label]))
        print(label, "plain forward", forwards[label], file=sys.stderr, flush=True)
        family = "llm" if label == describe("llm", quick=True) else "other"
        with versions[-1].active() as relevancy:
            names = method_names(family, relevancy, args.methods)
        for method in names:
            result = measure(work, method, versions, args.repeats)
            forwards[label]["forward_seconds"] = result.pop("forward_seconds")
            rows.append((label, method, result))
            print(label, method, result, file=sys.stderr, flush=True)
    text = report(rows, forwards, labels, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
