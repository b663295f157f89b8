"""How the per-object gradients of a shared DETR forward are best taken on this machine: one backward per round
with generic attention's reduction applied in place (what `Forward.gradients(combine=...)` does), or one batched
backward (`torch.autograd.grad(..., is_grads_batched=True)`) reduced after.

    python benchmarks/detr_gradient_rounds.py [--objects 5] [--size 800 1066] [--repeats 3] [--threads 1]

DETR-R50 sized, random weights (as `detr_speed.py`), one image, queries 0..K-1; each variant gives every
object's `mean_h (dS/dA * A)^+` for all 18 attention sites. Times: medians, the first run of each left out.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from clip_speed import cpu_model  # noqa: E402
from detr_speed import build  # noqa: E402

from relevancy.methods.capture import record_forward  # noqa: E402
from relevancy.families.detr.adapter import DetrAdapter  # noqa: E402
from relevancy.methods.coattention import weighted_in_place  # noqa: E402


def per_round(fwd) -> list[torch.Tensor]:
    return fwd.gradients(fwd.attentions, combine=weighted_in_place)


def batched(fwd) -> list[torch.Tensor]:
    originals = [fwd.recorded[id(a)] for a in fwd.attentions]
    outputs = torch.eye(len(fwd.score), dtype=fwd.score.dtype, device=fwd.score.device)
    grads = torch.autograd.grad(fwd.score, originals, grad_outputs=outputs, is_grads_batched=True)
    with torch.no_grad():  # (objects, 1, heads, T_q, T_k) against the one image's attention
        return [g.mul_(a.detach()).clamp_(min=0).mean(2)[:, 0] for g, a in zip(grads, originals)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=5)
    parser.add_argument("--size", type=int, nargs=2, default=[800, 1066], metavar=("H", "W"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    adapter = DetrAdapter(build("cpu"))
    image = torch.randn(1, 3, *args.size, generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {"per_round": [], "batched": []}
    with adapter.explaining(True):
        rows, label = adapter.bind_target(adapter.check_inputs({"pixel_values": image}),
                                          [[(q, 1) for q in range(args.objects)]])
        for repeat in range(args.repeats + 1):
            results = {}
            for name, variant in (("per_round", per_round), ("batched", batched)):
                fwd = record_forward(adapter, rows, label, attentions=True, gradients=True, share_rows=True)
                start = time.perf_counter()
                results[name] = variant(fwd)
                if repeat:
                    times[name].append(time.perf_counter() - start)
            assert all(torch.allclose(a, b) for a, b in zip(results["per_round"], results["batched"]))
    print(f"# DETR-R50 (random init) at {args.size[0]}x{args.size[1]}, {args.objects} objects of one image, "
          f"{cpu_model()}, {torch.get_num_threads()} thread(s), torch {torch.__version__}; median of {args.repeats}")
    for name, values in times.items():
        print(f"{name}: {statistics.median(values):.2f} s")


if __name__ == "__main__":
    main()
