"""Train (or evaluate) the retrieval world's small decoders, one per token mixer (`relevancy.worlds.retrieval_models`).

    python -m training.retrieval_models --mixer attention|deltanet|mamba2 [--seed S] [--minutes M | --steps N] [--init DIR]
        [--people 2-4] [--single-kind F] [--restate K] [--reverse K]

The shipped Mamba-2 hybrid: `--mixer mamba2 --minutes 65 --threads 1 --lr 3e-3 --lm-weight 0 --single-kind 0.5
--warmup 0.01` (all of 1,000 test prompts; its card: worlds/weights/retrieval_mamba2/README.md).
    python -m training.retrieval_models --mixer MIXER --evaluate-only [--n 1000]

Data: fresh training prompts every step (`worlds.language.prompt("train", i, seed=S)`, prompt `i = step * batch + j`;
the test prompts come from another seed by construction). Loss: cross-entropy of the answer's token after the prompt
(`Answer: <name> lives in` -> `Paris`), read at the token before it (located by its characters' offset; rows
right-padded), plus `--lm-weight` times the next-token cross-entropy over every position: the answer gives one target
per prompt, while
copying the question's name after `Answer:` and the templates' words give many, and copying is the mechanism the
answer needs (a first run on the answer alone reached 37 % of the training answers in 9 minutes). Runs on the
benchmark's prompts alone (two people) stall at half the answers: a value of the asked kind, either person's, is right
half the time, and the binding of the person to the value comes late. `--single-kind F` made the Mamba-2 hybrid bind:
a fraction F of the training prompts hold the facts of the asked kind only, where the binding is all there is to
learn (the runs: docs/language_models.md). Three more options were tried without a run binding: `--people`
draws each training prompt's number of people from a range (with four, the unbound guess is right a quarter of the
time), and `--restate K` follows the answer with K more facts of the context written as answers
(`Answer: Ben's code word is Echo.`), each value one more target of the answer loss; `--reverse K` asks K facts
backwards (`Question: Echo ? Ben.`), whose targets, the names, train each value to carry its fact's person, the half
of the binding the answer reads. AdamW, the shared
warm-up and cosine schedule of the shipped models (`training.shapes_vit.fit`), following wall-clock progress with
`--minutes` or the step count with `--steps`. Validation (greedy answers on 300 test prompts of seed 1) at each
checkpoint; the model and the world's tokenizer are saved with `save_pretrained` to `--out` (default: the shipped
folder), the log `train.log` beside them.
"""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from relevancy.worlds import language, retrieval_models

from .shapes_vit import Run, _log, adamw, fit, machine, run_training_command, start_run, training_parser

#: validation prompts: test prompts of this world seed (the benchmark reads seed 0's)
VAL_SEED = 1


def people_range(text: str) -> tuple[int, int]:
    """`"2-4"` -> `(2, 4)`; `"2"` -> `(2, 2)`."""
    low, _, high = text.partition("-")
    bounds = int(low), int(high or low)
    if not 1 <= bounds[0] <= bounds[1] <= language.MAX_PEOPLE:
        raise argparse.ArgumentTypeError(f"--people takes N or LOW-HIGH within 1..{language.MAX_PEOPLE}, got {text!r}")
    return bounds


def training_item(index: int, seed: int, people: tuple[int, int], single_kind: float = 0.0) -> language.RetrievalPrompt:
    """Training prompt `index`, its number of people drawn from `people` by the index; a `single_kind` fraction of the
    prompts (drawn by the index) hold the facts of one kind only, the asked one's (its kind drawn by the index too)."""
    draw = random.Random(index)
    kinds = [draw.choice(list(language.KINDS))] if draw.random() < single_kind else None
    return language.prompt("train", index, seed=seed, n_people=people[0] + index % (people[1] - people[0] + 1), kinds=kinds)


def restated(item: language.RetrievalPrompt, k: int, reverse: int = 0) -> tuple[str, list[tuple[int, str]]]:
    """The prompt with its answer, followed by `k` other facts of its context written as answers, then `reverse`
    facts asked backwards (`Question: Paris ? Anna.`: whose value it is), and each target's `(character start,
    token)` in that text, the prompt's own answer first: the targets of the answer loss. The causal model reads the
    prompt as the benchmark does whatever follows it."""
    text = item.text + item.answer + "."
    targets = [(len(item.text) + 1, item.answer.strip())]
    draw = random.Random(item.text)
    others = [fact for i, fact in enumerate(item.facts) if i != item.evidence_fact]
    for fact in draw.sample(others, min(k, len(others))):
        prefix, value = fact[:-1].rsplit(" ", 1)
        text += f"\nAnswer: {prefix} "
        targets.append((len(text), value))
        text += f"{value}."
    for fact in draw.sample(item.facts, min(reverse, len(item.facts))):
        value, name = fact[:-1].rsplit(" ", 1)[1], fact.split(" ", 1)[0].split("'")[0]
        text += f"\nQuestion: {value} ? "
        targets.append((len(text), name))
        text += f"{name}."
    return text, targets


def encoded(tokenizer, items: list[language.RetrievalPrompt]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The prompts right-padded (`input_ids`, `attention_mask`) and each answer's token id `(B,)`."""
    inputs = tokenizer([item.text for item in items], padding=True, return_tensors="pt")
    answers = torch.tensor(tokenizer.convert_tokens_to_ids([item.answer.strip() for item in items]))
    return {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}, answers


def answer_logits(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """`(B, V)`: the next-token logits after each row's last real token."""
    logits = model(**inputs, use_cache=False).logits
    return logits[torch.arange(len(logits)), inputs["attention_mask"].sum(1) - 1]


@torch.no_grad()
def accuracy(model: torch.nn.Module, tokenizer, n: int, seed: int, batch: int = 100) -> dict[str, float]:
    """Greedy exact answers on the first `n` test prompts of world seed `seed`, overall and per kind of fact."""
    model.eval()
    items = language.prompts("test", n, seed=seed)
    right = []
    for start in range(0, n, batch):
        inputs, answers = encoded(tokenizer, items[start:start + batch])
        right += (answer_logits(model, inputs).argmax(-1) == answers).tolist()
    found = {"overall": sum(right) / n}
    for kind in language.KINDS:
        kept = [r for r, item in zip(right, items) if item.kind == kind]
        found[kind] = sum(kept) / max(len(kept), 1)
    return found


def _summary(found: dict[str, float], n: int) -> str:
    return " ".join(f"{key} {value:.4f}" for key, value in found.items()) + f" (n={n})"


def train(args: argparse.Namespace) -> None:
    out, log, _ = start_run(args, "train.log")
    tokenizer = retrieval_models.world_tokenizer()
    sizes = {} if args.hidden_size is None else {"hidden_size": args.hidden_size, "intermediate_size": 2 * args.hidden_size}
    model = (retrieval_models.build(args.mixer, args.seed, **sizes) if args.init is None
             else retrieval_models.load_folder(Path(args.init))[0]).train()
    parameters = sum(p.numel() for p in model.parameters())
    _log(log, f"start training mixer={args.mixer} seed={args.seed} init={args.init} people={args.people} single_kind={args.single_kind} restate={args.restate} reverse={args.reverse} params={parameters} batch={args.batch_size} lr={args.lr} lm_weight={args.lm_weight} "
              f"minutes={args.minutes} steps={args.steps} threads={args.threads} {machine()}")
    optimizer = adamw(model.named_parameters(), lambda name, p: p.ndim >= 2, args, betas=(0.9, 0.98))

    def loss(step: int, progress: float) -> tuple[torch.Tensor, dict[str, float]]:
        first = step * args.batch_size
        items = [training_item(first + j, args.seed, args.people, args.single_kind) for j in range(args.batch_size)]
        texts, targets = zip(*(restated(item, args.restate, args.reverse) for item in items))
        inputs = tokenizer(list(texts), padding=True, return_tensors="pt", return_offsets_mapping=True)
        starts = inputs.pop("offset_mapping")[..., 0]
        every = model(**inputs, use_cache=False).logits
        # each target read at the token before its value (the prompt's own answer first in each row)
        rows, positions, values = zip(*((row, int((starts[row] == start).nonzero()[0]) - 1, value)
                                        for row, found in enumerate(targets) for start, value in found))
        logits, wanted = every[rows, positions], torch.tensor(tokenizer.convert_tokens_to_ids(list(values)))
        own = torch.tensor([k == 0 for found in targets for k in range(len(found))])
        mask = inputs["attention_mask"]
        read = mask[:, 1:].bool()  # a real token follows
        answer = F.cross_entropy(logits[own], wanted[own])
        modelled = F.cross_entropy(every[:, :-1][read], inputs["input_ids"][:, 1:][read])
        total = answer + args.lm_weight * modelled
        logged = {"loss": answer.item(), "lm": modelled.item(), "acc": (logits[own].argmax(-1) == wanted[own]).float().mean().item()}
        if args.restate or args.reverse:
            total = total + F.cross_entropy(logits[~own], wanted[~own])
        return total, logged

    def checkpoint(step: int, seconds: float, final: bool) -> None:
        found = accuracy(model, tokenizer, args.val_n, VAL_SEED)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        _log(log, f"{'done' if final else 'checkpoint'} step {step} ({seconds / 60:.1f} min): val {_summary(found, args.val_n)}")

    fit(args, log, Run(model, optimizer, loss, checkpoint, args.batch_size, "prompts"))


def evaluate(args: argparse.Namespace) -> dict:
    started = time.time()
    model, tokenizer = retrieval_models.load(args.mixer) if args.weights is None else retrieval_models.load_folder(Path(args.weights))
    found = accuracy(model, tokenizer, args.n, seed=0)
    _log(Path(args.out) / "train.log" if Path(args.out).exists() else None,
         f"evaluate {args.mixer}: test {_summary(found, args.n)} ({time.time() - started:.0f} s)")
    return found


def main(argv=None) -> None:
    ap = training_parser(__doc__, minutes=15.0, pair_fraction=0.0, lr=3e-3, weight_decay=0.01)
    ap.add_argument("--mixer", required=True, choices=tuple(retrieval_models.ARCHITECTURES))
    ap.add_argument("--lm-weight", type=float, default=0.5, help="weight of the next-token loss over the prompt")
    ap.add_argument("--init", default=None, help="start from the model saved in this folder (a second stage)")
    ap.add_argument("--people", type=people_range, default=(2, 2), help="people per training prompt: N or LOW-HIGH")
    ap.add_argument("--restate", type=int, default=0, help="facts restated as answers after each training answer")
    ap.add_argument("--hidden-size", type=int, default=None, help="width (the MLP twice it); default the builder's, 64")
    ap.add_argument("--reverse", type=int, default=0, help="facts asked backwards (value -> person) after those")
    ap.add_argument("--single-kind", type=float, default=0.0, help="fraction of training prompts with the facts of one kind only")
    args_known, _ = ap.parse_known_args(argv)
    ap.set_defaults(out=str(retrieval_models.folder(args_known.mixer)))
    run_training_command(ap, argv, train, evaluate, threads_help="torch threads (the shipped runs: 1)", ckpt_minutes=5.0,
                         n_help="test prompts for --evaluate-only (world seed 0: the benchmark's)")


if __name__ == "__main__":
    main()
