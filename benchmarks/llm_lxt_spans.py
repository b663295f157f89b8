"""Make tests/golden/llm_lxt_spans.pt: lxt's rules on answer spans and inside the decoder, in float64.

    /work/venvs/lxt-spans/bin/python benchmarks/llm_lxt_spans.py [--out tests/golden/llm_lxt_spans.pt]

Needs lxt 2.1 (the `llm-bench` extra; never a dependency of relevancy itself). The models are the tiny float64
Llama and GPT-2 of tests/golden/llm_lxt_reference.pt (`tests/language_models.build`, their weights' SHA-256 recorded
so that the tests know they rebuilt the same ones); lxt's patch maps are applied as benchmarks/llm_lxt_reference.py
applies them (`attnLRP`, `cp_LRP`; none for input x gradient). For the prompt `single0` (7 tokens):
- `span`: the span `SPAN` read teacher-forced: the prompt and the span but its last token run from `inputs_embeds`,
  the span's token `j` scored at the position before it; the score is the sum of the span's logits (`logit`) or of
  their log-probabilities (`log_prob`, the log-softmax taken on lxt's logits by plain autograd); the map is
  `(inputs_embeds * grad).sum(-1)` over the prompt and the span's read tokens, `(1, 7 + 2)`;
- `foil`: the same for the span `FOIL` (`logit`), the other side of a Contrast;
- `latent` (for the span's `logit` and for the next token's logit, the golden file's target): forward hooks keep each
  decoder layer's output and each attention's output-projection input (the heads' outputs side by side); their
  input x gradient from the same backward: `layers` `(L + 1, 1, W)` (0: the token embeddings), `neurons`
  `(L + 1, 1, W, D)`, `heads` `(L, 1, H)` summed over tokens and head width.
"""
from __future__ import annotations

import argparse
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from language_models import GOLDEN, build, weights_checksum  # noqa: E402
from llm_lxt_reference import lxt_patched  # noqa: E402

SPAN = (11, 22, 33)
FOIL = (44, 55)
VARIANTS = {"attnlrp": "attnLRP", "cp_lrp": "cp_LRP", "input_x_gradient": None}


def layer_parts(model: torch.nn.Module) -> tuple[list, list]:
    """The decoder layers and the attentions' output projections (Llama: `model.layers`, `self_attn.o_proj`; GPT-2:
    `transformer.h`, `attn.c_proj`)."""
    if hasattr(model, "model"):
        layers = list(model.model.layers)
        return layers, [layer.self_attn.o_proj for layer in layers]
    layers = list(model.transformer.h)
    return layers, [layer.attn.c_proj for layer in layers]


def relevance(model: torch.nn.Module, prompt: torch.Tensor, span: tuple[int, ...], score: str) -> dict[str, torch.Tensor]:
    """Input x gradient of the span's summed score (see the module's docstring), with the latent maps."""
    ids = torch.cat([prompt, torch.tensor([span[:-1]], dtype=torch.long)], 1)
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    layers, projections = layer_parts(model)
    hidden, heads = [], []
    handles = [layer.register_forward_hook(lambda _m, _i, out: hidden.append(out[0] if isinstance(out, tuple) else out)) for layer in layers]
    handles += [p.register_forward_pre_hook(lambda _m, args: heads.append(args[0])) for p in projections]
    try:
        logits = model(inputs_embeds=embeds, position_ids=torch.arange(ids.shape[1])[None], use_cache=False).logits[0]
    finally:
        for handle in handles:
            handle.remove()
    positions = torch.arange(prompt.shape[1] - 1, prompt.shape[1] - 1 + len(span))
    read = logits[positions] if score == "logit" else logits[positions].log_softmax(-1)
    explained = read.gather(1, torch.tensor(span)[:, None]).sum()
    grads = torch.autograd.grad(explained, [embeds, *hidden, *heads])
    states = torch.stack([(x * g).detach() for x, g in zip([embeds, *hidden], grads[:1 + len(hidden)])])
    count = model.config.num_attention_heads
    per_head = torch.stack([(x * g).detach().view(*x.shape[:2], count, -1).sum((1, 3)) for x, g in zip(heads, grads[1 + len(hidden):])])
    return {"map": states[0].sum(-1), "layers": states.sum(-1), "neurons": states, "heads": per_head, "explained": explained.detach()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests/golden/llm_lxt_spans.pt")
    args = parser.parse_args()
    prompt = GOLDEN["inputs"]["single0"][0]
    out: dict = {"span": SPAN, "foil": FOIL, "prompt": "single0", "models": {}}
    for arch in ("llama", "gpt2"):
        model = build(arch)
        entry = {"checksum": weights_checksum(model)}
        next_token = (int(GOLDEN["models"][arch]["targets"]["single0"]),)
        for method, variant in VARIANTS.items():
            with lxt_patched(arch, variant) if variant else nullcontext():
                found = {"span_logit": relevance(model, prompt, SPAN, "logit"),
                         "span_log_prob": relevance(model, prompt, SPAN, "log_prob"),
                         "foil_logit": relevance(model, prompt, FOIL, "logit"),
                         "next_logit": relevance(model, prompt, next_token, "logit")}
            entry[method] = {name: {k: v for k, v in values.items() if name.endswith("logit") or k in ("map", "explained")}
                             for name, values in found.items()}
            layers = found["span_logit"]["layers"].sum(-1)[:, 0]
            print(f"{arch} {method}: span logit {float(found['span_logit']['explained']):.4f}, relevance per layer {[round(float(v), 4) for v in layers]}")
        out["models"][arch] = entry
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(out, args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} kB)")


if __name__ == "__main__":
    main()
