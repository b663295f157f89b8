"""Memory and time of explaining a decoder as people load big ones: in float32, quantized to 4 bits (bitsandbytes NF4,
double quantization, float32 compute) and with every layer offloaded to disk (accelerate), each against its own
plain forward, measured in one process on the CPU.

    OMP_NUM_THREADS=2 python benchmarks/wrapped_models.py [--shape 1b|small] [--tokens 64] [--methods attnlrp transformer_attribution]
        [--out benchmarks/results/wrapped_models.json]

The model is a random `LlamaForCausalLM` of Llama-3.2-1B's shape (`--shape 1b`: 16 layers, width 2,048, MLP 8,192,
32 query and 8 key-value heads, vocabulary 128,256, tied embeddings: 1.24 B parameters, 4.9 GB in float32) or a small
one for a quick check (`--shape small`), saved once to a temporary folder and loaded from it three ways. For each
form: a plain forward (no gradients, the model's own, the next token's logits) and each method on one prompt of
`--tokens` tokens, each run after a warm-up, its time and its peak resident memory above the resident size before
the run (Linux VmHWM reset before each run): what the run allocates beyond the model as it is held in memory (a
disk-offloaded model holds next to none: its layers are read as the forward reaches them). The ratios are to the
same form's plain forward.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
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


def measured(run: Callable[[], Any]) -> tuple[float, float]:
    """(seconds, peak MiB above the resident size before) of one `run()`, after one warm-up run."""
    run()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # the high-water mark back to the present resident size
    before = resident_kib()
    start = time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    return seconds, (resident_kib("VmHWM") - before) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--methods", nargs="+", default=["attnlrp", "transformer_attribution"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    import torch
    import transformers

    import relevancy

    torch.manual_seed(0)
    ids = torch.randint(0, SHAPES[args.shape]["vocab_size"], (1, args.tokens))
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        saved, offload = Path(folder) / "model", Path(folder) / "offload"
        config = transformers.LlamaConfig(**SHAPES[args.shape], max_position_embeddings=4096)
        transformers.LlamaForCausalLM(config).save_pretrained(saved)
        gc.collect()
        forms = {
            "float32": dict(),
            "4-bit NF4": dict(quantization_config=transformers.BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32)),
            "offloaded to disk": dict(device_map={"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu",
                                                  "lm_head": "cpu", **{f"model.layers.{i}": "disk" for i in range(config.num_hidden_layers)}},
                                      offload_folder=str(offload)),
        }
        for form, options in forms.items():
            before = resident_kib()
            model = transformers.AutoModelForCausalLM.from_pretrained(saved, **options).eval()
            held = (resident_kib() - before) / 1024

            def forward() -> None:
                with torch.no_grad():
                    model(input_ids=ids, use_cache=False, logits_to_keep=1)

            seconds, peak = measured(forward)
            rows.append(dict(form=form, method="forward", seconds=seconds, peak_mib=peak, held_mib=held))
            print(f"{form}: model held {held:.0f} MiB; forward {seconds:.2f} s, {peak:.0f} MiB", flush=True)
            for method in args.methods:
                took, top = measured(lambda: relevancy.explain(model, ids, method=method))
                ratio = top / peak if peak > 0 else None  # a small model's forward may allocate nothing new
                rows.append(dict(form=form, method=method, seconds=took, peak_mib=top, held_mib=held,
                                 time_ratio=took / seconds, memory_ratio=ratio))
                print(f"{form}: {method} {took:.2f} s ({took / seconds:.2f} forwards), {top:.0f} MiB"
                      f" ({'-' if ratio is None else f'{ratio:.2f}'} x the forward's)", flush=True)
            del model
            gc.collect()
    result = dict(date=today(), cpu=cpu_name(), shape=args.shape, tokens=args.tokens, torch=torch.__version__,
                  transformers=transformers.__version__, rows=rows)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    json.dump(result, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
