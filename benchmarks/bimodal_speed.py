"""Cost of each method on base-sized LXMERT and VisualBERT question-answering models, in no-grad forward passes.

    python benchmarks/bimodal_speed.py [--batch 1 8] [--tokens 20] [--regions 36] [--repeats 3] [--threads 1] [--out FILE]

Models built offline from their configs with random weights (float32, eval): `LxmertForQuestionAnswering(
LxmertConfig(num_qa_labels=3129))` (hidden 768, 12 heads, 9 language, 5 relation and 5 cross layers, 2048-d
region features, as `unc-nlp/lxmert-base-uncased`) and `VisualBertForQuestionAnswering(VisualBertConfig(
visual_embedding_dim=2048, num_labels=3129))` (BERT-base, 12 layers). Inputs: `--tokens` random question tokens
([CLS] first, [SEP] last) and `--regions` random region features with random normalised boxes; the predicted
answer is explained. The authors' generators take one question at a time.
"""
from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from clip_speed import cpu_model  # noqa: E402
from detr_speed import finish, measure, ratio_rows  # noqa: E402

METHODS = ("generic_attention", "raw_attention", "rollout", "attention_gradcam")


def build(family: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if family == "lxmert":
        return transformers.LxmertForQuestionAnswering(transformers.LxmertConfig(num_qa_labels=3129)).eval()
    config = transformers.VisualBertConfig(visual_embedding_dim=2048, num_labels=3129)
    return transformers.VisualBertForQuestionAnswering(config).eval()


def make_inputs(family: str, batch: int, tokens: int, regions: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 20000, (batch, tokens), generator=generator)
    ids[:, 0], ids[:, -1] = 101, 102
    text = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
    features = torch.randn(batch, regions, 2048, generator=generator).relu()
    if family == "lxmert":
        corner = torch.rand(batch, regions, 2, generator=generator) * 0.6
        boxes = torch.cat([corner, corner + 0.1 + torch.rand(batch, regions, 2, generator=generator) * 0.3], -1)
        return {**text, "visual_feats": features, "visual_pos": boxes}
    ones = torch.ones(batch, regions, dtype=torch.long)
    return {**text, "visual_embeds": features, "visual_attention_mask": ones, "visual_token_type_ids": ones}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=20)
    parser.add_argument("--regions", type=int, default=36)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.cuda.get_device_name() if args.device == "cuda" else cpu_model()
    lines = [
        f"# base-sized LXMERT and VisualBERT (random init), {args.tokens} tokens, {args.regions} regions, {device}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, {platform.python_implementation()} "
        f"{platform.python_version()}; median of {args.repeats}; cost in no-grad forwards of the same inputs",
        "| model | batch | method | seconds | x forward |",
        "|---|---|---|---|---|",
    ]
    for family in ("lxmert", "visualbert"):
        model = build(family).to(args.device)
        for batch in args.batch:
            inputs = {k: v.to(args.device) for k, v in make_inputs(family, batch, args.tokens, args.regions).items()}
            medians = measure(model, inputs, None, METHODS, args.repeats)
            lines += ratio_rows(f"{family} | {batch}", f"{family} | {batch}", medians, METHODS)
    finish(lines, args.out)


if __name__ == "__main__":
    main()
