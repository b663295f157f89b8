"""Resumable, sharded evaluation: one mechanism under every benchmark.

A benchmark is a fixed list of chunks (a batch of items; the list does not depend on the number of processes).
Process ``rank`` of ``world`` computes chunks ``rank, rank + world, ...``: each chunk gives a *record* (plain data:
numbers, lists, dicts with text keys, tensors), and the process appends it to its own file
``OUT/partial/<run>/rank-R-of-W.jsonl`` as one JSON line, flushed and fsynced before the next chunk starts, so
a kill loses at most the chunk in progress; a torn last line (a kill inside a write) is dropped when the file is
read and cut off before the next append. ``<run>`` is a hash of what determines the results (benchmark, model,
methods, n, seed, batch size, ...), so a changed command never mixes with an older one's records.

The same command run again reads the records already there (of every rank file it can see), computes only the
missing chunks, then every process hands its chunks' records to the others (``torch.distributed`` gloo; without a
process group, the files alone) and the benchmark folds them in chunk order: exactly the records, and so the
numbers, of one uninterrupted process. Rank 0 removes the run's folder once the results are written.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["PARTIAL", "Shards"]

#: the folder under ``--out`` that holds the unfinished runs' records
PARTIAL = "partial"
T = TypeVar("T")


def _encode(value: Any) -> Any:
    """`value` as JSON: tensors (and numpy arrays) as ``{"tensor": nested list, "dtype", "shape"}``, exact for
    every float (Python's float repr round-trips)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        return {"tensor": value.tolist(), "dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape)}
    if isinstance(value, np.ndarray):
        return _encode(torch.from_numpy(value))
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        if not all(isinstance(key, str) for key in value):
            raise TypeError(f"a record's dict keys must be text, got {sorted(map(repr, value))[:3]}")
        return {key: _encode(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(item) for item in value]
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"tensor", "dtype", "shape"}:
            return torch.tensor(value["tensor"], dtype=getattr(torch, value["dtype"])).reshape(value["shape"])
        return {key: _decode(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_decode(item) for item in value]
    return value


def _complete_lines(path: Path) -> tuple[list[bytes], int]:
    """The complete (newline-ended) lines of `path` and their length in bytes; a torn last line is not one."""
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    return data[:end].splitlines(), end


class Shards:
    """The records of one run. ``folder`` None: kept in memory only (a library call without an output folder)."""

    def __init__(self, folder: Path | None = None, rank: int = 0, world: int = 1) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in 0..{world - 1}")
        self.folder, self.rank, self.world = folder, rank, world
        self._memory: dict[int, Any] = {}
        self._opened = False
        self._key = "{}"

    @classmethod
    def at(cls, out: str | Path, key: Mapping[str, Any], rank: int = 0, world: int = 1) -> Shards:
        """The records of the run `key` (JSON-able: what determines the results) under the output folder `out`."""
        text = json.dumps(_encode(key), sort_keys=True)
        shards = cls(Path(out) / PARTIAL / hashlib.sha256(text.encode()).hexdigest()[:16], rank, world)
        shards._key = text
        return shards

    @property
    def path(self) -> Path | None:
        return None if self.folder is None else self.folder / f"rank-{self.rank}-of-{self.world}.jsonl"

    def _stored(self) -> dict[int, Any]:
        """Every record in the run's files (any rank, any world size), by chunk; the first of repeats."""
        found: dict[int, Any] = {}
        if self.folder is None:
            return dict(self._memory)
        for path in sorted(self.folder.glob("rank-*.jsonl")):
            for number, line in enumerate(_complete_lines(path)[0], 1):
                try:
                    entry = json.loads(line)
                except ValueError as error:
                    raise ValueError(f"{path} line {number} is not a record ({error}); remove {self.folder} to start the run afresh") from None
                found.setdefault(int(entry["chunk"]), entry["record"])
        return found

    def pending(self, count: int) -> list[int]:
        """The chunks of ``0 .. count - 1`` this process computes: its share, less those already recorded."""
        done = self._stored()
        return [k for k in range(self.rank, count, self.world) if k not in done]

    def save(self, chunk: int, record: Mapping[str, Any]) -> None:
        """Append `record` of `chunk` to this process's file: one complete line, on disk before this returns."""
        if self.folder is None:
            self._memory[chunk] = _decode(json.loads(json.dumps(_encode(record))))
            return
        path = self.path
        assert path is not None
        if not self._opened:  # the folder is made by the first record (a refused command leaves nothing)
            self.folder.mkdir(parents=True, exist_ok=True)
            if not (self.folder / "run.json").exists():
                from ..core.files import write_atomic

                write_atomic(self.folder / "run.json", self._key + "\n")  # what the records are of, for a reader
            if path.exists():  # cut a torn last line left by a kill
                os.truncate(path, _complete_lines(path)[1])
            self._opened = True
        line = json.dumps({"chunk": chunk, "record": _encode(record)}, allow_nan=True) + "\n"
        with open(path, "ab") as f:
            f.write(line.encode())
            f.flush()
            os.fsync(f.fileno())

    def collect(self, count: int) -> list[Any]:
        """Every chunk's record in chunk order, on every process (a collective call under torch.distributed)."""
        stored = self._stored()
        mine = {k: v for k, v in stored.items() if k % self.world == self.rank}
        if self.world > 1 and dist.is_available() and dist.is_initialized():
            parts: list[Any] = [None] * self.world
            dist.all_gather_object(parts, mine)
            for part in parts:
                for k, v in part.items():
                    stored.setdefault(k, v)
        missing = [k for k in range(count) if k not in stored]
        if missing:
            raise RuntimeError(f"{len(missing)} of {count} chunks have no record (first: {missing[0]}) in {self.folder}")
        return [_decode(stored[k]) if self.folder is not None else stored[k] for k in range(count)]

    def map(self, chunks: Sequence[T], compute: Callable[[T], Mapping[str, Any]], progress: bool = False,
            desc: str = "", unit: str = "item", size: Callable[[T], int] = lambda chunk: 1) -> list[Any]:
        """`compute` on this process's missing chunks (recorded as each finishes), then every chunk's record in
        order. `progress`: a bar on rank 0 over its chunks' items (``size`` each), with the time left."""
        todo = self.pending(len(chunks))
        with progress_bar(sum(size(chunks[k]) for k in todo), progress and self.rank == 0, desc, unit) as bar:
            for k in todo:
                self.save(k, compute(chunks[k]))
                bar.update(size(chunks[k]))
        return self.collect(len(chunks))

    def finish(self) -> None:
        """Remove the run's records (rank 0, once the results are written); ``partial/`` too when it is empty."""
        if self.folder is None or self.rank != 0:
            return
        shutil.rmtree(self.folder, ignore_errors=True)
        try:
            self.folder.parent.rmdir()
        except OSError:
            pass


def progress_bar(total: int, enabled: bool, desc: str, unit: str):
    """A tqdm bar on stderr with the time left (redrawn every 30 s when stderr is not a terminal)."""
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, desc=desc, unit=unit, dynamic_ncols=True,
                mininterval=0.5 if sys.stderr.isatty() else 30.0)


def fsum_dicts(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Key by key sums (``math.fsum``) of dicts of numbers with the same keys."""
    return {key: math.fsum(part[key] for part in parts) for key in parts[0]} if parts else {}
