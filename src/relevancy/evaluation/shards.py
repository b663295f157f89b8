"""Resumable, sharded evaluation: one mechanism under every benchmark.

A benchmark is a fixed list of chunks (a batch of items; the list does not depend on the number of processes).
Process ``rank`` of ``world`` computes chunks ``rank, rank + world, ...``: each chunk gives a *record* (plain data:
numbers, lists, dicts with text keys, tensors), and the process appends it to its own file
``OUT/partial/<benchmark>/rank-R-of-W.jsonl`` as one JSON line, flushed and fsynced before the next chunk starts, so
a kill loses at most the chunk in progress; a torn last line (a kill inside a write) is dropped when the file is
read and cut off before the next append.

The run's identity (`run.json`), its comparison on resume, the lock on the output folder and the weights' digest are
`relevancy.core.runs.Run`'s, shared with `relevancy.corpus`; this module adds the records of a benchmark.

The same command run again, with any number of processes, reads the records already there (every rank file of any
earlier process count; each line checked, a damaged one named by file and line), computes only its share's missing
chunks, then every process hands its share's records to the others (``torch.distributed`` gloo; without a process
group, the files alone) and the benchmark folds them in chunk order: exactly the records, and so the numbers, of one
uninterrupted process. `Shards.finish` removes the records once every process has read them (after a barrier).
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from ..core.files import TENSOR_DTYPES, read_regular
from ..core.runs import RUN_FILE, Run, RunRefused, joined, library_versions, progress_bar, weights_digest

__all__ = ["LOCK", "PARTIAL", "RUN_FILE", "RunRefused", "Shards", "library_versions", "progress_bar", "weights_digest"]

#: the folder under ``--out`` that holds the unfinished runs' records, one folder per benchmark
PARTIAL = "partial"
#: the file in ``--out`` whose lock the live run's rank 0 holds
LOCK = ".relevancy-evaluate.lock"
#: the largest record file read (a whole ImageNet run's per-image lists of one process: hundreds of MB)
MAX_RECORD_BYTES = 2**32
#: a benchmark's name, which names its folder
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_RANK_FILE = re.compile(r"rank-(\d+)-of-(\d+)\.jsonl")
T = TypeVar("T")


def _encode(value: Any) -> Any:
    """`value` as JSON: tensors (and numpy arrays) as ``{"tensor": nested list, "dtype", "shape"}``, exact for
    every float (Python's float repr round-trips); a dtype outside `TENSOR_DTYPES` is refused before anything is
    written."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        dtype = str(value.dtype).removeprefix("torch.")
        if dtype not in TENSOR_DTYPES:
            raise TypeError(f"a record's tensor has dtype {dtype}; records hold {', '.join(TENSOR_DTYPES)}")
        return {"tensor": value.tolist(), "dtype": dtype, "shape": list(value.shape)}
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


def _decode(value: Any, where: str) -> Any:
    """`_encode`'s output back, tensors rebuilt; a ValueError naming `where` (the key path) for a tensor entry that is
    not one (a dtype outside `TENSOR_DTYPES`, a shape that is not its data's)."""
    if isinstance(value, dict):
        if set(value) == {"tensor", "dtype", "shape"}:
            return _tensor(value, where)
        return {key: _decode(item, f"{where}/{key}") for key, item in value.items()}
    if isinstance(value, list):
        return [_decode(item, f"{where}/{k}") for k, item in enumerate(value)]
    return value


def _tensor(entry: dict, where: str) -> torch.Tensor:
    """The tensor of an encoded entry, its dtype and shape checked against its data."""
    dtype, shape = entry["dtype"], entry["shape"]
    if dtype not in TENSOR_DTYPES:
        raise ValueError(f"the tensor at {where} has dtype {json.dumps(dtype)[:40]}; records hold {', '.join(TENSOR_DTYPES)}")
    if not isinstance(shape, list) or not all(type(size) is int and size >= 0 for size in shape):
        raise ValueError(f"the tensor at {where} has shape {json.dumps(shape)[:40]}, not a list of whole numbers >= 0")
    try:
        tensor = torch.tensor(entry["tensor"], dtype=getattr(torch, dtype))
    except (TypeError, ValueError, RuntimeError, OverflowError) as error:
        raise ValueError(f"the tensor at {where} holds no {dtype} array ({' '.join(str(error).split())[:80]})") from None
    # an empty tensor's list keeps no trace of its leading sizes: only its count of elements is checked
    if list(tensor.shape) != shape and not (tensor.numel() == 0 == math.prod(shape)):
        raise ValueError(f"the tensor at {where} has shape {shape} but its data {list(tensor.shape)}")
    return tensor.reshape(shape)


def _entry(line: bytes, count: int | None) -> tuple[int, Any]:
    """The chunk and the decoded record of one record line; a ValueError saying what is wrong with it."""
    try:
        entry = json.loads(line)
    except (ValueError, RecursionError) as error:
        raise ValueError(f"not JSON ({' '.join(str(error).split())[:80]})") from None
    if not isinstance(entry, dict) or set(entry) != {"chunk", "record"}:
        raise ValueError('not a record: a record line is {"chunk": N, "record": {...}}')
    chunk, record = entry["chunk"], entry["record"]
    if type(chunk) is not int or chunk < 0 or (count is not None and chunk >= count):
        bound = "" if count is None else f" below {count}"
        raise ValueError(f"its chunk {json.dumps(chunk)[:40]} is not a whole number >= 0{bound}")
    if not isinstance(record, dict):
        raise ValueError(f"its record is {type(record).__name__}, not a JSON object")
    return chunk, _decode(record, "record")


class Shards(Run):
    """The records of one run. ``folder`` None: kept in memory only (a library call without an output folder).

    Use it as a context manager (``with Shards.at(...) as shards:``), or call `release` when done: rank 0 holds the
    output folder's lock from the first `pending`, `save` or `collect` on."""

    def __init__(self, folder: Path | None = None, rank: int = 0, world: int = 1,
                 identity: Mapping[str, Any] | None = None) -> None:
        super().__init__(folder, None if folder is None else folder.parent.parent, LOCK, rank, world,
                         _encode(dict(identity or {})))
        self._memory: dict[int, Any] = {}
        self._opened = False  # this process's file readied (a torn line cut)

    @classmethod
    def at(cls, out: str | Path, benchmark: str, identity: Mapping[str, Any], rank: int = 0, world: int = 1) -> Shards:
        """The records of `benchmark` under the output folder `out` (in ``out/partial/<benchmark>/``); `identity`:
        what determines the results besides the weights (JSON-able: options, n, seed, ...), compared with the
        records' own before any is used. Touches no file: the lock is taken at the first `pending`/`save`/`collect`."""
        if not isinstance(benchmark, str) or not _NAME.fullmatch(benchmark):
            raise ValueError(f"a benchmark's name names its records' folder: letters, digits, '_', '.', '-', got {benchmark!r}")
        return cls(Path(out) / PARTIAL / benchmark, rank, world, {**identity, "benchmark": benchmark})

    @property
    def path(self) -> Path | None:
        """This process's record file."""
        return None if self.folder is None else self.folder / f"rank-{self.rank}-of-{self.world}.jsonl"

    def _empty_folders(self) -> tuple[Path, ...]:
        assert self.folder is not None
        return self.folder, self.folder.parent

    # ------------------------------------------------------------------------------------------ the records
    def _files(self) -> list[Path]:
        """The record files in the run's folder, of every rank and process count."""
        assert self.folder is not None
        return sorted(path for path in self.folder.glob("rank-*-of-*.jsonl") if _RANK_FILE.fullmatch(path.name))

    def _read(self, count: int | None) -> dict[int, Any]:
        """Every record in the run's files (in memory: those saved), by chunk (the first of repeats), each line checked
        (a chunk below `count` where given); a file removed meanwhile counts as empty. A ValueError naming the file and
        the line."""
        if self.folder is None:
            return dict(self._memory)
        found: dict[int, Any] = {}
        remedy = f"remove {self.folder} to start this run afresh"
        for path in self._files():
            try:
                data = read_regular(path, MAX_RECORD_BYTES)
            except FileNotFoundError:
                continue
            except ValueError as error:
                raise ValueError(f"{error}; record files are regular files: {remedy}") from None
            for number, line in enumerate(data[: data.rfind(b"\n") + 1].splitlines(), 1):
                try:
                    chunk, record = _entry(line, count)
                except ValueError as error:
                    raise ValueError(f"{path} line {number} is not a record of this run: {error}; {remedy}") from None
                found.setdefault(chunk, record)
        return found

    def save(self, chunk: int, record: Mapping[str, Any]) -> None:
        """Append `record` of `chunk` to this process's file: one complete line, on disk before this returns."""
        line = (json.dumps({"chunk": chunk, "record": _encode(record)}, allow_nan=True) + "\n").encode()
        if self.folder is None:
            self._memory[chunk] = _decode(json.loads(line)["record"], "record")
            return
        self._identify()
        path = self.path
        assert path is not None
        if not self._opened:
            try:  # cut a torn last line left by a kill
                data = read_regular(path, MAX_RECORD_BYTES)
                os.truncate(path, data.rfind(b"\n") + 1)
            except FileNotFoundError:
                pass
            self._opened = True
        with open(path, "ab") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def collect(self, count: int) -> list[Any]:
        """Every chunk's record in chunk order, on every process (a collective call under torch.distributed). Each
        process hands on its share's records (those it computed or read: `pending` saw to it that it has them all)."""
        stored = self._stored(count)
        if joined(self.world):
            mine = {k: v for k, v in stored.items() if k % self.world == self.rank}
            parts: list[Any] = [None] * self.world
            dist.all_gather_object(parts, mine)
            for part in parts:
                for k, v in part.items():
                    stored.setdefault(k, v)
        missing = [k for k in range(count) if k not in stored]
        if missing:
            raise RuntimeError(f"{len(missing)} of {count} chunks have no record (first: {missing[0]}) in {self.folder}")
        return [stored[k] for k in range(count)]

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

    # ------------------------------------------------------------------------------------------ the end
    def finish(self) -> None:
        """Remove the run's records once the results are written (a collective call under torch.distributed: after
        a barrier, so that no process still reads them), then `release`. The record files go before run.json, so a
        kill midway leaves records that still say what they are of."""
        if self.folder is None:
            return
        if joined(self.world):
            dist.barrier()
        if self.rank == 0:
            for path in self._files():
                path.unlink(missing_ok=True)
            (self.folder / RUN_FILE).unlink(missing_ok=True)
            shutil.rmtree(self.folder, ignore_errors=True)  # what else a kill left there (a temporary file)
        self.release()


def fsum_dicts(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Key by key sums (``math.fsum``) of dicts of numbers with the same keys."""
    return {key: math.fsum(part[key] for part in parts) for key in parts[0]} if parts else {}
