"""Memory and time of explaining a decoder as people load big ones: in float32, quantized to 4 bits (bitsandbytes NF4,
double quantization, float32 compute) and with every layer offloaded to disk (accelerate), each against its own
plain forward, measured in one process on the CPU.

    OMP_NUM_THREADS=2 python benchmarks/wrapped_models.py [--shape 1b|small] [--tokens 64] [--methods attnlrp transformer_attribution]
        [--out benchmarks/results/wrapped_models.json]

The model is a random `LlamaForCausalLM` of Llama-3.2-1B's shape (`--shape 1b`: 16 layers, width 2,048, MLP 8,192,
32 query and 8 key-value heads, vocabulary 128,256, tied embeddings: 1.24 B parameters, 4.9 GB in float32) or a small
one for a quick check (`--shape small`), saved once to a temporary folder and loaded from it three ways, each in a
process of its own (so that no form's peak holds another's heap). For each form: a plain forward (no gradients, the model's own, the next token's logits) and each method on one prompt of
`--tokens` tokens, each run after a warm-up, its time and its peak anonymous memory above the process's before the
model was loaded (Linux RssAnon, sampled every millisecond): the weights as the form holds them in memory (a
disk-offloaded model reads each layer as the forward reaches it) and what the run allocates; the pages of the files
the weights are mapped from are the kernel's page cache and are not counted. The ratios are to the same form's plain
forward.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

from machine import cpu_name, today

SHAPES = {
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=True),
    "small": dict(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, tie_word_embeddings=True),
}


def resident_kib(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field))


def measured(run: Callable[[], Any], zero_kib: int) -> tuple[float, float]:
    """(seconds, peak MiB of anonymous memory above `zero_kib`, the process's before the model was loaded) of one
    `run()`, after one warm-up run. Anonymous memory, sampled every millisecond: what the process allocates; the pages
    of the weights' files it maps (safetensors, accelerate's offload files), which the kernel drops under pressure,
    are not counted."""
    run()
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand the free heap back, so that a run's peak is its own
    peak, done = [resident_kib("RssAnon")], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], resident_kib("RssAnon"))
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    try:
        run()
    finally:
        seconds = time.perf_counter() - start
        done.set()
        sampler.join()
    return seconds, (max(peak[0], resident_kib("RssAnon")) - zero_kib) / 1024


def save(shape: str, folder: Path) -> None:
    """The random model of `shape`, saved."""
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPES[shape], max_position_embeddings=4096)).save_pretrained(folder)


def load_options(form: str, layers: int, offload: Path) -> dict:
    """`from_pretrained`'s options for each form of the model."""
    import torch
    import transformers

    return {
        "float32": dict(),
        "4-bit NF4": dict(quantization_config=transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32)),
        "offloaded to disk": dict(device_map={"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu",
                                              **{f"model.layers.{i}": "disk" for i in range(layers)}}, offload_folder=str(offload)),
    }[form]


FORMS = ("float32", "4-bit NF4", "offloaded to disk")


def measure_form(form: str, saved: Path, shape: str, tokens: int, methods: list[str]) -> list[dict]:
    """The rows of one form, measured in this process (a fresh one per form: no other form's heap in its peaks)."""
    import torch
    import transformers

    import relevancy

    torch.manual_seed(0)
    ids = torch.randint(0, SHAPES[shape]["vocab_size"], (1, tokens))
    gc.collect()
    zero = resident_kib("RssAnon")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        saved, **load_options(form, SHAPES[shape]["num_hidden_layers"], saved.parent / "offload")).eval()

    def forward() -> None:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)

    seconds, peak = measured(forward, zero)
    rows = [dict(form=form, method="forward", seconds=seconds, peak_mib=peak)]
    runs = [(form, method, lambda method=method: relevancy.explain(model, ids, method=method)) for method in methods]
    if form == "offloaded to disk":  # attnlrp as before: autograd keeping every offloaded weight it saves
        runs.append((form + ", weights kept by autograd", "attnlrp", lambda: _keeping_weights(relevancy, model, ids)))
    for name, method, run in runs:
        took, top = measured(run, zero)
        rows.append(dict(form=name, method=method, seconds=took, peak_mib=top, time_ratio=took / seconds,
                         memory_ratio=top / peak if peak > 0 else None))
    return rows


def _keeping_weights(relevancy: Any, model: Any, ids: Any) -> Any:
    import contextlib

    import relevancy.api

    kept = relevancy.api.offloaded_weights_reread
    relevancy.api.offloaded_weights_reread = lambda _model: contextlib.nullcontext()
    try:
        return relevancy.explain(model, ids, method="attnlrp")
    finally:
        relevancy.api.offloaded_weights_reread = kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--methods", nargs="+", default=["attnlrp", "transformer_attribution"])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--save", type=Path, help=argparse.SUPPRESS)  # a child process: write the model there
    parser.add_argument("--form", choices=FORMS, help=argparse.SUPPRESS)  # a child process: measure this form
    parser.add_argument("--saved", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    if args.save is not None:
        save(args.shape, args.save)
        return
    if args.form is not None:
        print(json.dumps(measure_form(args.form, args.saved, args.shape, args.tokens, args.methods)))
        return
    import torch
    import transformers

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        saved = Path(folder) / "model"
        subprocess.run([sys.executable, __file__, "--shape", args.shape, "--save", str(saved)], check=True)
        for form in FORMS:
            done = subprocess.run([sys.executable, __file__, "--shape", args.shape, "--tokens", str(args.tokens), "--methods",
                                   *args.methods, "--form", form, "--saved", str(saved)], check=True, capture_output=True, text=True)
            for row in json.loads(done.stdout.strip().splitlines()[-1]):
                rows.append(row)
                ratios = f" ({row['time_ratio']:.2f} forwards, {row['memory_ratio']:.2f} x the forward's peak)" if "time_ratio" in row else ""
                print(f"{row['form']}: {row['method']} {row['seconds']:.2f} s, {row['peak_mib']:.0f} MiB{ratios}", file=sys.stderr, flush=True)
    result = dict(date=today(), cpu=cpu_name(), shape=args.shape, tokens=args.tokens, torch=torch.__version__,
                  transformers=transformers.__version__, rows=rows)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    json.dump(result, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
