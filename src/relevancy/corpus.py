"""`explain_corpus()`: thousands of prompts explained by a decoder language model, batched by length, resumable,
sharded over torchrun's processes, written as a Parquet dataset; `load_corpus()` reads it back.

The prompts are tokenised, sorted by length (longest first) and cut into padded batches that fit a memory budget
(`plan_batches`, from `row_memory`: the model's size, the method's cost and the batch's longest prompt). The plan
depends on the prompts, the tokenizer and the budget only, never on the number of processes, so a run killed under
three processes continues under one. Each batch is a chunk of a `relevancy.core.runs.Run`: process ``r`` of ``W``
explains batches ``r, r + W, ...`` not yet written, each written at once as ``OUT/shards/part-<chunk>.parquet``
(a temporary file fsynced, then renamed: a part file is whole or absent). The part files are the records *and* the
output: nothing is gathered into one process's memory, and a finished run is its set of part files, ``run.json``
(the run's identity, compared on resume) and ``report.md``. Explaining a padded batch gives each row what the row
alone gives (the decoders' padding contract), so the dataset does not depend on the batching either.
"""
from __future__ import annotations

import hashlib
import json
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from .api import explain
from .core.extras import require
from .core.files import check_folder, read_regular, write_atomic
from .core.messages import quoted
from .core.runs import RUN_FILE, MAX_RUN_BYTES, Run, distributed, joined, progress_bar
from .families import adapter_for
from .families.base import UnsupportedModelError
from .families.causal_lm import Span
from .families.causal_lm.adapter import context_window
from .generation import (MEMORY_BUDGET, MATRICES, PREFIX_ROW_MATRICES, check_generation_method, explain_generation,
                         prompt_ids, shared_forward_memory)
from .methods import lookup
from .methods.language import latent_parts
from .results.parts import sink_shares
from .results.token_text import decoded_texts

__all__ = ["CorpusSummary", "explain_corpus", "load_corpus", "plan_batches", "read_prompts", "row_memory"]

#: the folder of the part files, under the output folder
SHARDS = "shards"
#: the file in the output folder whose lock the live run's rank 0 holds
LOCK = ".relevancy-corpus.lock"
#: the most rows in one batch, whatever the budget (beyond it a batch gains little speed on any device)
MAX_BATCH = 64
#: the `(T, T)` matrices per head that the methods of one forward (attnlrp, cp_lrp, input_x_gradient) hold at once
#: per row, where generation's tables (`MATRICES`, `PREFIX_ROW_MATRICES`) do not say: their attention runs fused and
#: keeps no probabilities for the backward, so only the site whose backward is running holds its scores and
#: probabilities (measured on SmolLM2, `benchmarks/corpus_memory.py`: a 1,000-token prompt peaks at 0.9 GiB above the
#: model, where one probability matrix per site and head kept would be 2 GiB more)
ONE_FORWARD_MATRICES = 2
#: per token and attention site, the activations a forward keeps for the backward, in hidden-size vectors and
#: intermediate-size vectors (norms, q/k/v, attention output, residuals; the MLP's gate, up and product)
ACTIVATIONS = (12, 4)
#: the latent maps a corpus row holds (neurons: a (L + 1, T, D) array per prompt, too large for a dataset)
LATENT_PARTS = ("layers", "heads")
_PART = re.compile(r"part-(\d{5,})\.parquet")


@dataclass(frozen=True)
class Prompt:
    """One prompt of the corpus: its `id` (the index in the source, or a given id column's value), the prompt as given
    (a text or chat messages), its explained target (None: the predicted next token; a token id, a text: a token or
    an answer span; a list of ids: a span) and its token ids."""

    index: int
    id: Any
    prompt: Any
    target: Any
    ids: list[int]


@dataclass(frozen=True)
class CorpusSummary:
    """What a corpus run did: the output folder, the prompts and tokens explained, the batches (those computed by this
    run's processes and those found written by an earlier run), the seconds it took and the files it wrote."""

    out: Path
    prompts: int
    tokens: int
    batches: int
    computed: int
    seconds: float
    files: tuple[Path, ...]

    def __str__(self) -> str:
        found = self.batches - self.computed
        again = f" ({found} of them found written by an earlier run)" if found else ""
        rate = self.prompts / self.seconds if self.seconds > 0 else float("inf")
        return (f"explained {self.prompts:,} prompts ({self.tokens:,} tokens) in {self.batches} batches{again}: "
                f"{self.seconds:,.1f} s, {rate:,.1f} prompts/s over the whole run; dataset in {self.out / SHARDS}, "
                f"report {self.out / 'report.md'} (relevancy.load_corpus({str(self.out)!r}))")


# ---------------------------------------------------------------------------------------------- the prompts
def read_prompts(source: Any, prompt_column: str = "prompt", target_column: str | None = None,
                 id_column: str | None = None) -> list[tuple[Any, Any, Any]]:
    """`(id, prompt, target)` per prompt of `source`: a list (texts, chat messages, or dicts with the columns), a
    JSON-lines file (``.jsonl``: per line a text, chat messages or an object with the columns), a text file (one
    prompt per line, blank lines skipped), or a Hugging Face `datasets.Dataset`. The id is the prompt's index unless
    `id_column` names one; the target the `target_column`'s value (None without it)."""
    if isinstance(source, (str, Path)):
        rows = _file_rows(Path(source))
    elif hasattr(source, "column_names") and hasattr(source, "features"):  # a datasets.Dataset
        missing = [c for c in (prompt_column, target_column, id_column) if c is not None and c not in source.column_names]
        if missing:
            raise ValueError(f"the dataset has no column {quoted(missing[0])}; its columns: {', '.join(source.column_names)}")
        rows = list(source)
    elif isinstance(source, (list, tuple)):
        rows = list(source)
    else:
        raise TypeError(f"prompts must be a list, a .jsonl or text file's path, or a datasets.Dataset, got {type(source).__name__}")
    if not rows:
        raise ValueError("prompts is empty: a corpus has at least one prompt")
    found = []
    for index, row in enumerate(rows):
        if isinstance(row, Mapping) and not _is_message(row):
            if prompt_column not in row:
                raise ValueError(f"prompt {index} has no column {quoted(prompt_column)} (prompt_column=); its columns: "
                                 f"{', '.join(map(str, row))}")
            given = [row.get(column) if column is not None else None for column in (id_column, target_column)]
            if id_column is not None and id_column not in row:
                raise ValueError(f"prompt {index} has no id column {quoted(id_column)} (id_column=)")
            found.append((index if id_column is None else given[0], row[prompt_column], given[1]))
        elif target_column is not None or id_column is not None:
            raise ValueError(f"prompt {index} is a {type(row).__name__}, not a row with columns: target_column= and id_column= "
                             "name columns of rows given as dicts (a .jsonl file's objects, a dataset)")
        else:
            found.append((index, row, None))
    ids = [row[0] for row in found]
    if any(not isinstance(i, (int, str)) or isinstance(i, bool) for i in ids) or len(set(map(type, ids))) > 1:
        raise ValueError(f"the ids (id_column={quoted(id_column)}) must be all whole numbers or all texts")
    if len(set(ids)) != len(ids):
        raise ValueError(f"the ids (id_column={quoted(id_column)}) repeat: each prompt needs its own")
    return found


def _is_message(row: Mapping) -> bool:
    """A chat message ({"role", "content"}) rather than a row of columns."""
    return set(row) <= {"role", "content"} and "role" in row


def _file_rows(path: Path) -> list[Any]:
    """The rows of a prompts file: a JSON-lines file's values, a text file's non-blank lines."""
    text = read_regular(path, 2**34, links=True).decode("utf-8")
    if path.suffix.lower() in (".jsonl", ".ndjson"):
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError as error:
                    raise ValueError(f"{path} line {number} is not JSON ({' '.join(str(error).split())[:80]})") from None
        return rows
    return [line for line in text.splitlines() if line.strip()]


def _shown(prompt: Any) -> str:
    """The prompt column's text: a text as given, chat messages as JSON."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)


def _target(target: Any) -> Any:
    """A row's target as `explain` takes it: a list of ids is a `Span`."""
    return Span(list(target)) if isinstance(target, (list, tuple)) else target


# ---------------------------------------------------------------------------------------------- the plan
def row_memory(model: nn.Module, method: str, length: int) -> int:
    """Bytes one row of `length` tokens holds while `method` explains it (an estimate): the forward's activations kept
    for the backward (`ACTIVATIONS` per token and layer), the logits and their gradient, and the method's `(T, T)`
    matrices (generation's tables: `shared_forward_memory`; the relevance methods of one forward:
    `ONE_FORWARD_MATRICES` per head, one site's at a time)."""
    config = model.config.get_text_config()
    sites = len(adapter_for(model).attention_sites())
    itemsize = torch.promote_types(next(model.parameters()).dtype, torch.float32).itemsize
    hidden, inner = config.hidden_size, getattr(config, "intermediate_size", None) or 4 * config.hidden_size
    activations = length * sites * (ACTIVATIONS[0] * hidden + ACTIVATIONS[1] * inner) * itemsize
    logits = 2 * length * config.vocab_size * itemsize
    if method in MATRICES or method in PREFIX_ROW_MATRICES:
        matrices = sum(shared_forward_memory(model, sites, length, method))
    else:
        matrices = ONE_FORWARD_MATRICES * config.num_attention_heads * length * length * itemsize
    return activations + logits + matrices


def plan_batches(lengths: Sequence[int], cost: Callable[[int], int], budget: int, max_batch: int = MAX_BATCH) -> list[list[int]]:
    """Batches of prompt indices: longest first, each batch as many prompts of similar length as fit `budget` bytes
    (`cost(length)` per row of the batch's longest prompt) and `max_batch`; a prompt alone over the budget is a batch
    of its own (it is explained as `explain` would, one prompt, and `explain_corpus` warns). A pure function of the
    lengths: every process, and every later run, plans the same batches."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and len(batches[-1]) < max_batch and (len(batches[-1]) + 1) * cost(lengths[batches[-1][0]]) <= budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


# ---------------------------------------------------------------------------------------------- the records
class _Parts(Run):
    """A corpus run's records: one Parquet file per batch in ``OUT/shards/``, run.json and the lock in ``OUT``."""

    def __init__(self, out: Path, rank: int, world: int, identity: Mapping[str, Any]) -> None:
        super().__init__(out, out, LOCK, rank, world, identity)

    def _read(self, count: int | None) -> dict[int, Path]:
        """The part files there, by batch; one of a batch beyond `count` is refused (another run's)."""
        assert self.folder is not None
        found = {}
        for path in sorted((self.folder / SHARDS).glob("part-*.parquet")):
            match = _PART.fullmatch(path.name)
            if match is None:
                continue
            chunk = int(match.group(1))
            if count is not None and chunk >= count:
                raise ValueError(f"{path} is a batch beyond this run's {count}: remove {self.folder} to start this run afresh")
            found[chunk] = path
        return found

    def _empty_folders(self) -> tuple[Path, ...]:
        assert self.folder is not None
        return (self.folder / SHARDS,)

    def save(self, chunk: int, columns: Mapping[str, list]) -> None:
        """Write batch `chunk`'s rows as its part file: whole, on disk, before this returns."""
        pa = require("pyarrow", "corpus")
        import pyarrow.parquet as pq

        self._identify()
        assert self.folder is not None
        sink = pa.BufferOutputStream()
        pq.write_table(pa.table(dict(columns)), sink)
        write_atomic(self.folder / SHARDS / f"part-{chunk:05d}.parquet", sink.getvalue().to_pybytes(), durable=True)

    def tidy(self) -> None:
        """Remove what a killed run's writes left (temporary files): after every process has written its share."""
        assert self.folder is not None
        for path in (self.folder / SHARDS).glob(".part-*.tmp"):
            path.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------- the run
def explain_corpus(model: nn.Module, tokenizer: Any, prompts: Any, method: str = "attnlrp", targets: Any = None, *,
                   out: str | Path, prompt_column: str = "prompt", target_column: str | None = None,
                   id_column: str | None = None, max_new_tokens: int = 32, latent: bool | Sequence[str] = False,
                   memory_budget: int = MEMORY_BUDGET, max_batch: int = MAX_BATCH, progress: bool = True,
                   **options: Any) -> CorpusSummary:
    """Explain every prompt of a corpus with a decoder language model and write one row per prompt to `out` as a
    Parquet dataset (``out/shards/part-*.parquet``, `load_corpus(out)` or ``datasets.load_dataset("parquet",
    data_files=f"{out}/shards/*.parquet")``) with a ``report.md`` of corpus-level figures.

    `prompts`: a list (texts, chat messages, or dicts with `prompt_column`), a ``.jsonl`` or text file, or a
    `datasets.Dataset` (`read_prompts`); chat messages go through the tokenizer's chat template. `targets`: None (each
    prompt's predicted next token, or `target_column`'s values: a token id, a text, one token or an answer span read
    teacher-forced, a list of ids), a list of such targets (one per prompt), or ``"generate"`` (the model's own
    continuation of up to `max_new_tokens`, each generated token explained: `explain_generation`). `method` and
    `options` as `relevancy.explain` takes them (`score="log_prob"`, ...); `latent`: True or some of "layers", "heads".
    Prompts are explained in padded batches of similar length within `memory_budget` bytes (`plan_batches`), each
    row what that prompt alone gives. Under torchrun every process takes its share of the batches; each batch is
    written as it finishes, and the same call after a kill continues where the run stopped, with any number of
    processes (the run's identity, in ``out/run.json``, is compared first: `RunRefused` names what differs). A
    finished run called again rewrites only its report. Returns a `CorpusSummary` (on every process)."""
    started = time.perf_counter()
    family = adapter_for(model)
    if not family.generates or family.reads_images:
        raise UnsupportedModelError(f"explain_corpus explains text decoder language models, not the {family.family} family "
                                    f"({family.examples}): a vision-language decoder's prompt comes with its image, "
                                    "explain_generation(..., image=)")
    generate = isinstance(targets, str) and targets == "generate"
    if generate:
        method = check_generation_method(method)
    else:
        method = lookup(method, family.methods, f"methods of the {family.family} family").name
    parts = _latent_parts(latent)
    if generate and parts:
        raise ValueError("latent= is read for a prompt's next token or answer: leave it out with targets='generate'")
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget < 1:
        raise ValueError(f"memory_budget must be a whole number of bytes >= 1, got {memory_budget!r}")
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be a whole number >= 1, got {max_batch!r}")
    try:
        json.dumps(options)
    except TypeError:
        raise ValueError(f"explain_corpus's options are recorded in the run's identity: give plain values (texts, numbers), got "
                         f"{sorted(options)}") from None
    out = check_folder(out)
    rows = read_prompts(prompts, prompt_column, target_column, id_column)
    given = _targets(targets, rows, generate)
    corpus = [Prompt(k, i, p, t, prompt_ids(tokenizer, p)) for k, ((i, p, _), t) in enumerate(zip(rows, given))]
    extra = max_new_tokens if generate else max((_target_length(tokenizer, p.target) for p in corpus), default=0)
    window = context_window(model)
    for p in corpus:
        if window is not None and len(p.ids) + extra > window:
            raise ValueError(f"prompt {p.id!r} has {len(p.ids)} tokens, and with {extra} more exceeds the model's context window of {window}")
    cost = (lambda length: row_memory(model, method, length + extra))
    batches = plan_batches([len(p.ids) for p in corpus], cost, memory_budget, max_batch)
    over = [p for p in corpus if cost(len(p.ids)) > memory_budget]
    if over:
        longest = max(over, key=lambda p: len(p.ids))
        warnings.warn(f"{len(over)} prompt{'s' if len(over) > 1 else ''} need more than the memory budget of "
                      f"{memory_budget / 2**20:,.0f} MiB alone (the longest, {longest.id!r}: {len(longest.ids)} tokens, about "
                      f"{cost(len(longest.ids)) / 2**20:,.0f} MiB): each runs in a batch of its own (memory_budget=, --memory-budget)",
                      stacklevel=2)
    identity = {"corpus": _digest(corpus), "prompts": len(corpus), "batches": len(batches), "method": method,
                "targets": "generate" if generate else ("given" if any(p.target is not None for p in corpus) else "predicted"),
                "max_new_tokens": max_new_tokens if generate else None, "latent": list(parts), "options": options,
                "memory_budget": memory_budget, "max_batch": max_batch,
                "dtype": str(next(model.parameters()).dtype), "device": next(model.parameters()).device.type}
    rank, world, created = distributed()
    computed = 0
    try:
        with _Parts(out, rank, world, identity) as run:
            run.weigh(model, tokenizer)
            todo = run.pending(len(batches))
            share = [corpus[i] for k in todo for i in batches[k]]
            with progress_bar(len(share), progress and rank == 0, "explain-corpus", "prompt") as bar:
                tokens, clock = 0, time.perf_counter()
                for k in todo:
                    batch = [corpus[i] for i in batches[k]]
                    explained = (_generated(model, tokenizer, batch, method, max_new_tokens) if generate
                                 else _explained(model, tokenizer, batch, method, parts, options))
                    run.save(k, explained)
                    computed += 1
                    tokens += sum(len(p.ids) for p in batch)
                    bar.set_postfix_str(f"{tokens / max(time.perf_counter() - clock, 1e-9):,.0f} tokens/s", refresh=False)
                    bar.update(len(batch))
            if joined(world):
                import torch.distributed as dist

                dist.barrier()  # every share written
                computed = _summed(computed)
            files: tuple[Path, ...] = ()
            if rank == 0:
                run.tidy()
                missing = sorted(set(range(len(batches))) - set(run._read(len(batches))))
                if missing:
                    raise RuntimeError(f"{len(missing)} of {len(batches)} batches have no part file (first: {missing[0]}) in {out / SHARDS}")
                from .results.corpus_report import write_report

                files = write_report(out, _part_files(out, len(batches)), method, generate)
            if joined(world):
                dist.barrier()  # the report written before any process leaves
        return CorpusSummary(out, len(corpus), sum(len(p.ids) for p in corpus), len(batches), computed,
                             time.perf_counter() - started, files)
    finally:
        if created:
            import torch.distributed as dist

            dist.destroy_process_group()


def _summed(value: int) -> int:
    """`value` summed over the processes."""
    import torch.distributed as dist

    total = torch.tensor([value])
    dist.all_reduce(total)
    return int(total.item())


def _latent_parts(latent: object) -> tuple[str, ...]:
    """`latent=` as the parts a corpus row keeps (`methods.language.latent_parts`'s check): True is `LATENT_PARTS`;
    neurons are refused by name (a `(L + 1, T, D)` array per prompt: explain that prompt alone)."""
    chosen = latent_parts(latent)
    if "neurons" in chosen and latent is not True:
        raise ValueError(f"latent neurons are a (layers, tokens, hidden size) array per prompt, too large for a corpus: ask for some "
                         f"of {', '.join(map(quoted, LATENT_PARTS))} here, and explain a prompt alone for its neurons")
    return tuple(part for part in LATENT_PARTS if part in chosen)


def _targets(targets: Any, rows: list[tuple[Any, Any, Any]], generate: bool) -> list[Any]:
    """The target of each prompt: given per prompt, the target column's, or None everywhere; all or none given."""
    if generate or targets is None:
        found = [None] * len(rows) if generate else [row[2] for row in rows]
    elif isinstance(targets, (list, tuple)) and len(targets) == len(rows):
        found = list(targets)
    else:
        raise ValueError(f"targets must be None, 'generate', or a list of one target per prompt ({len(rows)}), got {quoted(targets)}")
    if any(t is None for t in found) and any(t is not None for t in found):
        raise ValueError("targets are given for some prompts and not others: give one for every prompt, or none (each prompt's "
                         "predicted next token)")
    for t in found:
        if not (t is None or isinstance(t, str) and t or isinstance(t, int) and not isinstance(t, bool) and t >= 0
                or isinstance(t, (list, tuple)) and t and all(isinstance(v, int) and not isinstance(v, bool) for v in t)):
            raise ValueError(f"a target is a token id, a non-empty text (a token or an answer span) or a list of token ids, got {quoted(t)}")
    return found


def _target_length(tokenizer: Any, target: Any) -> int:
    """How many tokens a target adds to its prompt's forward (an answer span is read teacher-forced)."""
    if isinstance(target, str):
        return len(tokenizer(target, add_special_tokens=False)["input_ids"])
    return len(target) if isinstance(target, (list, tuple)) else 1


def _digest(corpus: Sequence[Prompt]) -> str:
    """The sha256 of the prompts as explained: ids, token ids and targets (the tokenizer's work included)."""
    digest = hashlib.sha256()
    for p in corpus:
        digest.update(json.dumps([p.id, p.ids, p.target], ensure_ascii=False).encode())
    return digest.hexdigest()


def _padded(batch: Sequence[Prompt], device: torch.device) -> dict[str, torch.Tensor]:
    """The batch's token ids, right-padded (padding id 0, masked), on `device`: each row's tokens at the positions
    they have alone (a model whose rotary frequencies are float32 gives a shifted row other rounding)."""
    width = max(len(p.ids) for p in batch)
    ids = torch.tensor([p.ids + [0] * (width - len(p.ids)) for p in batch], device=device)
    mask = torch.tensor([[1] * len(p.ids) + [0] * (width - len(p.ids)) for p in batch], device=device)
    return {"input_ids": ids, "attention_mask": mask}


def _floats(values: torch.Tensor) -> Any:
    """A tensor as nested lists of Python floats in its own precision (float64 stays float64)."""
    return values.detach().cpu().numpy().astype(np.float64 if values.dtype == torch.float64 else np.float32).tolist()


def _common(batch: Sequence[Prompt]) -> dict[str, list]:
    """The columns every row has: its index in the source, its id and its prompt."""
    return {"index": [p.index for p in batch], "id": [p.id for p in batch], "prompt": [_shown(p.prompt) for p in batch]}


def _explained(model: nn.Module, tokenizer: Any, batch: Sequence[Prompt], method: str, parts: tuple[str, ...],
               options: Mapping[str, Any]) -> dict[str, list]:
    """One batch's rows: `explain` on the padded batch, each row cut to its own tokens."""
    inputs = _padded(batch, next(model.parameters()).device)
    targets = None if batch[0].target is None else [_target(p.target) for p in batch]
    more = {"latent": parts} if parts else {}
    expl = explain(model, inputs, method=method, target=targets, tokenizer=tokenizer, **more, **options)
    mask = inputs["attention_mask"].bool().cpu()
    width = mask.shape[1]
    columns = {**_common(batch), "tokens": [], "scores": [], "target": [], "target_ids": [], "relevance_total": [],
               "sink_share": _floats(expl.sink_share)}
    span = expl.span
    if span is not None:
        columns["span_scores"] = []
    for name in parts:
        columns[f"latent_{name}"] = []
    for b, p in enumerate(batch):
        columns["tokens"].append(decoded_texts(tokenizer, p.ids))
        columns["scores"].append(_floats(expl.scores[b][mask[b]]))
        ids = [int(expl.target[b])] if span is None else [int(t) for t in span.ids[b].tolist() if t >= 0]
        columns["target_ids"].append(ids)
        columns["target"].append(tokenizer.decode(ids))
        columns["relevance_total"].append(None if expl.relevance_total is None else float(expl.relevance_total[b]))
        # a span's own tokens where the target has several (a one-token target has none, as when explained alone)
        read = len(ids) if len(ids) > 1 else 0
        if span is not None:
            columns["span_scores"].append(_floats(span.scores[b][:read]))
        if "layers" in parts:  # the prompt's columns, then the span's
            keep = torch.cat([mask[b], torch.ones(expl.latent.layers.shape[2] - width, dtype=torch.bool)])
            columns["latent_layers"].append(_floats(expl.latent.layers[:, b][:, keep][:, : len(p.ids) + read]))
        if "heads" in parts:
            columns["latent_heads"].append(_floats(expl.latent.heads[:, b]))
    return columns


def _generated(model: nn.Module, tokenizer: Any, batch: Sequence[Prompt], method: str, max_new_tokens: int) -> dict[str, list]:
    """One batch's rows of generations: `explain_generation` on the batch (decoded together), each generated token's
    row over the tokens before it."""
    results = explain_generation(model, tokenizer, [p.ids for p in batch], max_new_tokens=max_new_tokens, method=method)
    columns = {**_common(batch), "tokens": [], "scores": [], "target": [], "target_ids": [], "relevance_total": [],
               "sink_share": [], "prompt_length": []}
    for p, result in zip(batch, results):
        generated = result.generated_ids.tolist()
        columns["tokens"].append(list(result.tokens))
        columns["scores"].append(_floats(result.scores))
        columns["target"].append(result.text)
        columns["target_ids"].append(generated)
        columns["relevance_total"].append(None if result.relevance_total is None else _floats(result.relevance_total))
        read = torch.arange(result.scores.shape[1])[None] < (len(p.ids) + torch.arange(len(generated)))[:, None]
        columns["sink_share"].append(_floats(sink_shares(result.scores, read)))
        columns["prompt_length"].append(len(p.ids))
    return columns


# ---------------------------------------------------------------------------------------------- reading back
def _part_files(out: Path, count: int) -> list[Path]:
    """The part files of a finished run of `count` batches, in batch order."""
    return [out / SHARDS / f"part-{k:05d}.parquet" for k in range(count)]


def load_corpus(out: str | Path):
    """The dataset `explain_corpus` wrote to `out`: a `datasets.Dataset`, one row per prompt in the source's order
    (`index`), its columns as written (`id`, `prompt`, `tokens`, `scores`, `target`, `target_ids`, `relevance_total`,
    `sink_share`, and `span_scores`, `latent_layers`, `latent_heads`, `prompt_length` where they apply). An unfinished
    run is refused, naming the batches still missing."""
    pa = require("pyarrow", "corpus")
    datasets = require("datasets", "corpus")
    import pyarrow.parquet as pq

    out = Path(out)
    try:
        identity = json.loads(read_regular(out / RUN_FILE, MAX_RUN_BYTES))
    except FileNotFoundError:
        raise FileNotFoundError(f"{out} holds no corpus run ({RUN_FILE} is missing): explain_corpus(..., out=) writes one") from None
    count = identity.get("batches") if isinstance(identity, dict) else None
    if type(count) is not int or "corpus" not in identity:
        raise ValueError(f"{out / RUN_FILE} is not a corpus run's identity")
    paths = _part_files(out, count)
    missing = [path.name for path in paths if not path.is_file()]
    if missing:
        raise ValueError(f"the run in {out} is unfinished: {len(missing)} of {count} batches are not written (first: {missing[0]}); "
                         "run the same command again to finish it")
    table = pa.concat_tables([pq.read_table(path) for path in paths], promote_options="default")
    return datasets.Dataset(table.sort_by("index"))
