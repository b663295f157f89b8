"""Cost of each method on a ViT-B/16-sized CLIP in forward passes of the image-text pairs (both towers), and peak memory.

    python benchmarks/clip_speed.py [--library transformers|open_clip|both] [--batch 1 8] [--repeats 5]
                                    [--threads 1] [--ablation] [--memory] [--out FILE]

The model is built offline from its config with random weights (float32, eval): image tower 224 px, patch 16,
width 768, 12 layers, 12 heads; text tower width 512, 12 layers, 8 heads, context 77, vocabulary 49408; projection
512; QuickGELU. transformers: `CLIPModel(CLIPConfig(...))` in its default attention (sdpa); open_clip:
`open_clip.model.CLIP(embed_dim=512, vision_cfg, text_cfg, quick_gelu=True)`.

Inputs: `batch` pairs, image i with text i: random normal (already normalised) images and random token ids of length
77, a start token first and the end token (the largest id, 49407) at a random position, zeros after it, as OpenAI's
tokenizer pads.

Baselines (both towers, then each pair's scaled logit): a plain forward under `torch.no_grad()`, the same forward
with gradients enabled (the graph kept), and forward + backward of the summed pair logits (input and parameter
gradients). Times are medians over `--repeats`, in one process; each measurement is interleaved with a no-grad
forward so that load from other work on the machine affects both sides of a ratio.
`token_ablation` (N forwards) runs at batch 1 only and only with `--ablation`.

Peak memory (`--memory`): each measurement in a fresh subprocess, after one warm-up run and with the free heap handed
back to the system (malloc_trim); the peak growth of resident memory (/proc/self/statm, polled every 0.5 ms) during
one run. tracemalloc does not see torch's CPU tensors, so it is not used.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

import torch

import relevancy

LIBRARIES = ("transformers", "open_clip")
CONTEXT, VOCAB, IMAGE_SIZE = 77, 49408, 224
START, END = VOCAB - 2, VOCAB - 1  # OpenAI's <|startoftext|> and <|endoftext|>: the end token is the largest id
BASELINES = ("forward_no_grad", "forward_grad", "forward_backward")
# (row name, method, options)
METHODS: list[tuple[str, str, dict]] = [
    ("generic_attention start_layer=-1", "generic_attention", {"start_layer": -1}),
    ("generic_attention start_layer=0", "generic_attention", {"start_layer": 0}),
    ("raw_attention", "raw_attention", {}),
    ("rollout", "rollout", {}),
    ("attention_gradcam", "attention_gradcam", {}),
    ("cdam", "cdam", {}),
    ("transformer_attribution", "transformer_attribution", {}),
]
ABLATION = ("token_ablation", "token_ablation", {})
TARGET = 3.0  # the target: generic_attention costs at most 3 no-grad forwards of the pairs


# ------------------------------------------------------------------------------------------------ model and inputs
def build(library: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if library == "transformers":
        import transformers

        config = transformers.CLIPConfig(
            text_config=dict(
                hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8,
                max_position_embeddings=CONTEXT, vocab_size=VOCAB, hidden_act="quick_gelu",
                bos_token_id=START, eos_token_id=END, pad_token_id=0,
            ),
            vision_config=dict(
                hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                image_size=IMAGE_SIZE, patch_size=16, hidden_act="quick_gelu",
            ),
            projection_dim=512,
        )
        model = transformers.CLIPModel(config)
    elif library == "open_clip":
        import open_clip

        model = open_clip.model.CLIP(
            embed_dim=512,
            vision_cfg=dict(image_size=IMAGE_SIZE, patch_size=16, width=768, layers=12, head_width=64),
            text_cfg=dict(context_length=CONTEXT, vocab_size=VOCAB, width=512, heads=8, layers=12),
            quick_gelu=True,
        )
    else:
        raise ValueError(f"library must be one of {LIBRARIES}, got {library!r}")
    return model.float().eval()


def attention_implementation(model: torch.nn.Module, library: str) -> str:
    if library == "transformers":
        return f"attn_implementation={model.config._attn_implementation}"
    return "nn.MultiheadAttention (fused, need_weights=False)"


def make_inputs(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` random normalised images and `batch` random texts: start token, words, the end token at a random
    position (the largest id, as OpenAI's tokenizer), zeros after it."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
    ids = torch.randint(1, START, (batch, CONTEXT), generator=generator)
    ends = torch.randint(2, CONTEXT, (batch,), generator=generator)
    ids[:, 0] = START
    ids[torch.arange(batch), ends] = END
    ids[torch.arange(CONTEXT)[None] > ends[:, None]] = 0
    return images, ids


def pair_logits(model: torch.nn.Module, library: str, images: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(B,) the scaled logit of image i with text i: the model's own forward of both towers."""
    if library == "transformers":
        return model(input_ids=ids, pixel_values=images).logits_per_image.diagonal()
    out = model(images, ids)
    if isinstance(out, dict):
        image, text, scale = out["image_features"], out["text_features"], out["logit_scale"]
    else:
        image, text, scale = out[:3]
    return scale * (image * text).sum(-1)


# ------------------------------------------------------------------------------------------------ what is timed
def runner(model: torch.nn.Module, library: str, images: torch.Tensor, ids: torch.Tensor, what: str) -> Callable[[], object]:
    """A no-argument call for a baseline name or a `METHODS` row name."""
    if what == "forward_no_grad":
        def run():
            with torch.no_grad():
                return pair_logits(model, library, images, ids)
        return run
    if what == "forward_grad":
        def run():
            with torch.enable_grad():
                return pair_logits(model, library, images, ids)
        return run
    if what == "forward_backward":
        def run():
            with torch.enable_grad():
                pixels = images.clone().requires_grad_(True)
                pair_logits(model, library, pixels, ids).sum().backward()
            model.zero_grad(set_to_none=True)
        return run
    for name, method, options in METHODS + [ABLATION]:
        if name == what:
            return lambda: relevancy.explain(model, (images, ids), method=method, **options)
    raise ValueError(f"unknown measurement {what!r}")


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_all(model, library: str, batch: int, repeats: int, rows: list[str]) -> tuple[dict, dict]:
    """Median seconds of each row, interleaved with no-grad forwards; rows that raise are reported, not timed."""
    images, ids = make_inputs(batch)
    runs, failed = {}, {}
    forward = runner(model, library, images, ids, "forward_no_grad")
    forward()  # warm-up
    for row in rows:
        fn = runner(model, library, images, ids, row)
        try:
            fn()  # warm-up, and whether the method supports CLIP
        except Exception as error:  # noqa: BLE001 - any refusal is reported as "not supported"
            message = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            failed[row] = message if len(message) <= 100 else message[:97] + "..."
            continue
        runs[row] = fn
    plain: list[float] = []
    timings: dict[str, list[float]] = {row: [] for row in runs}
    for _ in range(repeats):
        for row, fn in runs.items():
            plain.append(seconds(forward))
            timings[row].append(seconds(fn))
    medians = {"forward_no_grad": statistics.median(plain)}
    medians.update({row: statistics.median(values) for row, values in timings.items()})
    return medians, failed


# ------------------------------------------------------------------------------------------------ peak memory
def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_memory_child(library: str, batch: int, what: str, threads: int | None) -> None:
    """Peak resident memory during one run above the memory before it (after a warm-up, free heap handed back)."""
    if threads:
        torch.set_num_threads(threads)
    model = build(library)
    images, ids = make_inputs(batch)
    run = runner(model, library, images, ids, what)
    run()
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    baseline, peak, done = resident_bytes(), [0], threading.Event()

    def poll() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], resident_bytes())
            time.sleep(0.0005)

    watcher = threading.Thread(target=poll)
    watcher.start()
    result = run()
    done.set()
    watcher.join()
    del result
    print(json.dumps({"peak_kib": (max(peak[0], resident_bytes()) - baseline) // 1024}))


def peak_memory(library: str, batch: int, what: str, threads: int | None) -> int | None:
    command = [sys.executable, os.path.abspath(__file__), "--child", library, str(batch), what]
    if threads:
        command += ["--threads", str(threads)]
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode != 0:
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_kib"]


# ------------------------------------------------------------------------------------------------ report
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def header(threads: int, repeats: int) -> list[str]:
    import open_clip
    import transformers

    return [
        "# relevancy.explain on a ViT-B/16-sized CLIP (random init, float32, eval; image 224 px / patch 16 / width 768 /"
        " 12 layers / 12 heads, text width 512 / 12 layers / 8 heads / context 77), image i with text i",
        f"# CPU: {cpu_model()} ({os.cpu_count()} logical CPUs, shared with other work while measuring), "
        f"{threads} torch thread(s); torch {torch.__version__}, transformers {transformers.__version__}, "
        f"open_clip {open_clip.__version__}, Python {platform.python_version()}",
        f"# seconds: median of {repeats} runs; x no-grad / x grad: that time over the median plain forward of the pairs"
        " (both towers, pair logits) under torch.no_grad() / with gradients enabled, measured in the same process,"
        " interleaved",
    ]


def table(library: str, implementation: str, batch: int, medians: dict, failed: dict, rows: list[str],
          memory: dict | None) -> list[str]:
    base, grad = medians["forward_no_grad"], medians.get("forward_grad")
    lines = [f"{library} ({implementation}), batch {batch}: plain forward {base:.3f} s"]
    head = f"  {'method':34s} {'seconds':>9s} {'x no-grad':>10s} {'x grad':>8s}"
    if memory is not None:
        head += f" {'peak RSS MiB':>13s}"
    lines.append(head)
    for row in ["forward_no_grad"] + rows:
        if row in failed:
            reason = "not supported" if row == "transformer_attribution" else "failed"
            lines.append(f"  {row:34s} {reason} ({failed[row]})")
            continue
        value = medians[row]
        line = f"  {row:34s} {value:9.3f} {value / base:10.2f} {value / grad if grad else float('nan'):8.2f}"
        if memory is not None:
            kib = memory.get(row)
            line += f" {kib / 1024:13.0f}" if kib is not None else f" {'-':>13s}"
        lines.append(line)
    for row in rows:
        if row.startswith("generic_attention") and row in medians:
            ratio = medians[row] / base
            verdict = "meets" if ratio <= TARGET else "ABOVE"
            lines.append(f"  target: {row} {ratio:.2f} x no-grad forward, {verdict} the target of {TARGET:.0f} x")
    return lines


def write_atomically(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=".clip_speed.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)  # mkstemp makes it private; a results file is an ordinary file
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--library", choices=(*LIBRARIES, "both"), default="both")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steadier on a shared machine)")
    parser.add_argument("--methods", default=",".join(name for name, _, _ in METHODS),
                        help="comma-separated rows of the table (default: all)")
    parser.add_argument("--ablation", action="store_true", help="also token_ablation (batch 1 only; N forwards)")
    parser.add_argument("--memory", action="store_true", help="peak resident memory, one subprocess per measurement")
    parser.add_argument("--out", help="also write the tables as text to this file (atomically)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        library, batch, what = args.child
        peak_memory_child(library, int(batch), what, args.threads)
        return
    torch.set_num_threads(args.threads)
    libraries = LIBRARIES if args.library == "both" else (args.library,)
    chosen = [m for m in args.methods.split(",") if m]
    known = [name for name, _, _ in METHODS]
    unknown = [m for m in chosen if m not in known]
    if unknown:
        parser.error(f"unknown methods {unknown}; rows: {', '.join(known)}")
    lines = header(torch.get_num_threads(), args.repeats)
    print("\n".join(lines), flush=True)
    for library in libraries:
        model = build(library)
        implementation = attention_implementation(model, library)
        for batch in args.batch:
            rows = ["forward_grad", "forward_backward"] + chosen
            if args.ablation and batch == 1:
                rows.append(ABLATION[0])
            medians, failed = time_all(model, library, batch, args.repeats, rows)
            memory = None
            if args.memory:
                memory = {row: peak_memory(library, batch, row, args.threads)
                          for row in ["forward_no_grad"] + rows if row not in failed}
            block = table(library, implementation, batch, medians, failed, rows, memory)
            if memory is not None:
                block.append("  peak RSS: peak growth of resident memory (/proc/self/statm) during one run, fresh process, after a warm-up")
            block.append("  forward_backward: backward of the summed pair logits to the pixels and every parameter")
            print("\n".join(block), flush=True)
            lines += block
            if args.out:  # after every table, so a long run leaves what it has measured
                write_atomically(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
