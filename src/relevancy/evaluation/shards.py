"""Resumable, sharded evaluation: one mechanism under every benchmark.

A benchmark is a fixed list of chunks (a batch of items; the list does not depend on the number of processes).
Process ``rank`` of ``world`` computes chunks ``rank, rank + world, ...``: each chunk gives a *record* (plain data:
numbers, lists, dicts with text keys, tensors), and the process appends it to its own file
``OUT/partial/<benchmark>/rank-R-of-W.jsonl`` as one JSON line, flushed and fsynced before the next chunk starts, so
a kill loses at most the chunk in progress; a torn last line (a kill inside a write) is dropped when the file is
read and cut off before the next append.

The run's *identity* (what determines its numbers: the benchmark, the options, the content digest of every model's
weights, the versions of the libraries that compute them) goes to ``run.json`` beside the records with the first
of them. A run that finds records compares their ``run.json`` with its own identity and refuses (`RunRefused`,
naming every differing field and the folder) where they differ, so a changed command never mixes with an older
one's records; the processes of one run compare their identities with each other too. Rank 0 holds an exclusive
``flock`` on ``OUT/.relevancy-evaluate.lock`` while the run lives (the kernel drops it with the process, so a killed
run leaves no stale lock): a second run into the same ``OUT`` is refused.

The same command run again, with any number of processes, reads the records already there (every rank file of any
earlier process count; each line checked, a damaged one named by file and line), computes only its share's missing
chunks, then every process hands its share's records to the others (``torch.distributed`` gloo; without a process
group, the files alone) and the benchmark folds them in chunk order: exactly the records, and so the numbers, of one
uninterrupted process. `Shards.finish` removes the records once every process has read them (after a barrier).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import stat
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..core.files import TENSOR_DTYPES, read_regular, write_atomic

__all__ = ["LOCK", "PARTIAL", "RUN_FILE", "RunRefused", "Shards", "library_versions", "weights_digest"]

#: the folder under ``--out`` that holds the unfinished runs' records, one folder per benchmark
PARTIAL = "partial"
#: the file in ``--out`` whose lock the live run's rank 0 holds
LOCK = ".relevancy-evaluate.lock"
#: the run's identity, beside its records
RUN_FILE = "run.json"
#: the largest record file read (a whole ImageNet run's per-image lists of one process: hundreds of MB)
MAX_RECORD_BYTES = 2**32
#: the largest run.json read
MAX_RUN_BYTES = 2**20
#: the packages whose versions change the numbers (besides relevancy itself)
VERSIONED = ("torch", "torchvision", "timm", "transformers", "open_clip_torch", "numpy", "scikit-learn", "pycocotools")
#: a benchmark's name, which names its folder
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_RANK_FILE = re.compile(r"rank-(\d+)-of-(\d+)\.jsonl")
T = TypeVar("T")


class RunRefused(ValueError):
    """A run that must not start: another run's records in its folder, processes started differently, another
    live run writing into the same output folder."""


def weights_digest(model: nn.Module, tokenizer: Any = None) -> str:
    """The sha256 of `model`'s parameters and buffers (each one's name, dtype, shape and bytes, copied to the CPU one
    at a time: float64 and bfloat16 exactly) and of `tokenizer`'s vocabulary where given (``get_vocab()`` or
    ``vocab``): what a path does not say about the weights behind it."""
    digest = hashlib.sha256()
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in named:
            value = tensor.detach().to("cpu").contiguous().reshape(-1)
            digest.update(json.dumps([kind, name, str(tensor.dtype), list(tensor.shape)]).encode())
            digest.update(memoryview(value.view(torch.uint8).numpy()))
    if tokenizer is not None:
        vocabulary = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else getattr(tokenizer, "vocab", None)
        if vocabulary is None:
            raise TypeError(f"cannot weigh a {type(tokenizer).__name__}: it has neither get_vocab() nor vocab")
        items = sorted(vocabulary.items()) if isinstance(vocabulary, Mapping) else list(vocabulary)
        digest.update(json.dumps(["vocabulary", items]).encode())
    return digest.hexdigest()


def library_versions() -> dict[str, str | None]:
    """The versions of relevancy and of the installed `VERSIONED` packages (None: not installed)."""
    from .. import __version__

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {"relevancy": __version__, **{name: version(name) for name in VERSIONED}}


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


def _differences(there: Any, here: Any, names: tuple[str, str], field: str = "") -> list[str]:
    """One line per field (dotted into nested dicts) where `there` and `here` differ: ``field: A there, B here``
    (`names` say where each value is from)."""
    if isinstance(there, dict) and isinstance(here, dict):
        return [line for key in sorted(set(there) | set(here), key=str)
                for line in _differences(there.get(key, _ABSENT), here.get(key, _ABSENT), names, f"{field}.{key}" if field else str(key))]
    if there == here:
        return []

    def shown(value: Any) -> str:
        return "(not there)" if value is _ABSENT else json.dumps(value)[:90]

    return [f"{field or 'the identity'}: {shown(there)} {names[0]}, {shown(here)} {names[1]}"]


_ABSENT = object()


def _joined(world: int) -> bool:
    """Whether this process is one of a torch.distributed process group of `world` > 1 processes."""
    return world > 1 and dist.is_available() and dist.is_initialized()


def _unequal(identities: list[dict[str, Any]]) -> tuple[type[Exception], str] | None:
    """A problem where the processes' identities (by rank) differ: the fields of the first that differs from rank 0's."""
    for rank, identity in enumerate(identities):
        differences = _differences(identities[0], identity, ("on rank 0", f"on rank {rank}"))
        if differences:
            return RunRefused, (f"the processes of this run were started differently ({'; '.join(differences)}): start "
                                "every process with the same command, models and libraries")
    return None


class Shards:
    """The records of one run. ``folder`` None: kept in memory only (a library call without an output folder).

    Use it as a context manager (``with Shards.at(...) as shards:``), or call `release` when done: rank 0 holds the
    output folder's lock from the first `pending`, `save` or `collect` on."""

    def __init__(self, folder: Path | None = None, rank: int = 0, world: int = 1,
                 identity: Mapping[str, Any] | None = None) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in 0..{world - 1}")
        self.folder, self.rank, self.world = folder, rank, world
        self.identity: dict[str, Any] = json.loads(json.dumps(_encode(dict(identity or {}))))
        self._memory: dict[int, Any] = {}
        self._begun = False
        self._opened = False  # this process's file readied (a torn line cut) and run.json written
        self._lock: int | None = None  # rank 0's descriptor of the lock file
        self._made: Path | None = None  # the output folder, when this run made it

    @classmethod
    def at(cls, out: str | Path, benchmark: str, identity: Mapping[str, Any], rank: int = 0, world: int = 1) -> Shards:
        """The records of `benchmark` under the output folder `out` (in ``out/partial/<benchmark>/``); `identity`:
        what determines the results besides the weights (JSON-able: options, n, seed, ...), compared with the
        records' own before any is used. Touches no file: the lock is taken at the first `pending`/`save`/`collect`."""
        if not isinstance(benchmark, str) or not _NAME.fullmatch(benchmark):
            raise ValueError(f"a benchmark's name names its records' folder: letters, digits, '_', '.', '-', got {benchmark!r}")
        return cls(Path(out) / PARTIAL / benchmark, rank, world, {**identity, "benchmark": benchmark})

    def __enter__(self) -> Shards:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:  # a safety net: `release` is meant to be called (the context manager does)
        try:
            self.release()
        except Exception:  # noqa: BLE001 (at interpreter exit the modules it uses may be gone)
            pass

    @property
    def path(self) -> Path | None:
        """This process's record file."""
        return None if self.folder is None else self.folder / f"rank-{self.rank}-of-{self.world}.jsonl"

    @property
    def out(self) -> Path | None:
        """The output folder (None: in memory)."""
        return None if self.folder is None else self.folder.parent.parent

    def weigh(self, model: nn.Module, tokenizer: Any = None) -> None:
        """Add `model`'s weights (and `tokenizer`'s vocabulary) to the run's identity (`weights_digest`), with the
        versions of the libraries that compute the numbers: call it for every model of the run, before the first
        record is read or written. In memory, nothing to compare: a no-op."""
        if self.folder is None:
            return
        if self._begun:
            raise RuntimeError("Shards.weigh comes before the first pending/save/collect: the identity is compared then")
        self.identity.setdefault("weights", []).append(weights_digest(model, tokenizer))
        self.identity["versions"] = library_versions()

    # ------------------------------------------------------------------------------------------ the beginning
    def _begin(self, count: int | None) -> dict[int, Any]:
        """Start the run (once, every process together): rank 0 takes the lock, every process reads the records it
        sees and compares their run.json with its identity, the processes compare their identities; any problem
        raised on every process alike (`RunRefused`, or the damaged line's ValueError) after releasing. The records."""
        problem: tuple[type[Exception], str] | None = None
        stored: dict[int, Any] = {}
        if self.rank == 0:
            problem = self._take_lock()
        if problem is None:
            try:
                stored = self._read(count)
                problem = self._compare() if stored else None
            except ValueError as error:
                problem = (ValueError, str(error))
        if _joined(self.world):
            parts: list[Any] = [None] * self.world
            dist.all_gather_object(parts, (problem, self.identity))
            problem = next((p for p, _ in parts if p is not None), None) or _unequal([identity for _, identity in parts])
        if problem is not None:
            self.release()
            raise problem[0](problem[1])
        self._begun = True
        return stored

    def _take_lock(self) -> tuple[type[Exception], str] | None:
        """Hold the output folder's lock (made with the folder where missing); a problem where another live process
        holds it."""
        out = self.out
        assert out is not None
        if not out.exists():
            self._made = out
        out.mkdir(parents=True, exist_ok=True)
        path = out / LOCK
        while True:
            try:
                handle = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            except OSError as error:
                return RunRefused, f"cannot take the lock {path}: {error.strerror}; --out must be a folder this run can write"
            if not stat.S_ISREG(os.fstat(handle).st_mode):
                os.close(handle)
                return RunRefused, f"{path} is not a regular file: remove it (a run makes it as its lock)"
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(handle, 200).decode("utf-8", "replace").strip() or "another process"
                os.close(handle)
                return RunRefused, (f"another run is writing into {out} ({holder} holds {path}): wait until it ends, "
                                    "or give another --out")
            try:
                same = os.path.samestat(os.fstat(handle), os.stat(path))
            except FileNotFoundError:
                same = False
            if same:  # not a file its last holder removed after we opened it
                os.ftruncate(handle, 0)
                os.write(handle, f"process {os.getpid()} on {os.uname().nodename}\n".encode())
                self._lock = handle
                return None
            os.close(handle)

    def _compare(self) -> tuple[type[Exception], str] | None:
        """A problem unless the folder's run.json holds this run's identity (called where records exist)."""
        assert self.folder is not None
        where = self.folder / RUN_FILE
        remedy = f"remove {self.folder} to start this run afresh, or give another --out"
        try:
            there = json.loads(read_regular(where, MAX_RUN_BYTES))
        except FileNotFoundError:
            return RunRefused, f"{self.folder} holds records but no {RUN_FILE} saying what they are of: {remedy}"
        except (OSError, ValueError, RecursionError) as error:
            return RunRefused, f"{where} is not a run's identity ({' '.join(str(error).split())[:120]}): {remedy}"
        differences = _differences(there, self.identity, ("there", "here"))
        if differences:
            return RunRefused, f"{self.folder} holds the records of another run ({'; '.join(differences)}): {remedy}"
        return None

    # ------------------------------------------------------------------------------------------ the records
    def _files(self) -> list[Path]:
        """The record files in the run's folder, of every rank and process count."""
        assert self.folder is not None
        return sorted(path for path in self.folder.glob("rank-*-of-*.jsonl") if _RANK_FILE.fullmatch(path.name))

    def _read(self, count: int | None) -> dict[int, Any]:
        """Every record in the run's files, by chunk (the first of repeats), each line checked (a chunk below `count`
        where given); a file removed meanwhile counts as empty. A ValueError naming the file and the line."""
        assert self.folder is not None
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

    def _stored(self, count: int | None) -> dict[int, Any]:
        """Every record there is (the run begun at the first call)."""
        if self.folder is None:
            return dict(self._memory)
        return self._read(count) if self._begun else self._begin(count)

    def pending(self, count: int) -> list[int]:
        """The chunks of ``0 .. count - 1`` this process computes: its share, less those already recorded."""
        done = self._stored(count)
        return [k for k in range(self.rank, count, self.world) if k not in done]

    def save(self, chunk: int, record: Mapping[str, Any]) -> None:
        """Append `record` of `chunk` to this process's file: one complete line, on disk before this returns."""
        line = (json.dumps({"chunk": chunk, "record": _encode(record)}, allow_nan=True) + "\n").encode()
        if self.folder is None:
            self._memory[chunk] = _decode(json.loads(line)["record"], "record")
            return
        if not self._begun:
            self._begin(None)
        path = self.path
        assert path is not None
        if not self._opened:  # the folder is made by the first record (a refused command leaves nothing)
            self.folder.mkdir(parents=True, exist_ok=True)
            write_atomic(self.folder / RUN_FILE, json.dumps(self.identity, indent=1, sort_keys=True) + "\n")
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
        if _joined(self.world):
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
        if _joined(self.world):
            dist.barrier()
        if self.rank == 0:
            for path in self._files():
                path.unlink(missing_ok=True)
            (self.folder / RUN_FILE).unlink(missing_ok=True)
            shutil.rmtree(self.folder, ignore_errors=True)  # what else a kill left there (a temporary file)
        self.release()

    def release(self) -> None:
        """Let go of what this process holds (rank 0: the lock; an empty run folder and ``partial/``; the output folder
        when this run made it and left it empty). The records stay: the same command continues from them. Safe to
        call twice."""
        if self._lock is not None:  # rank 0 of the live run: the folders are its own to tidy
            assert self.folder is not None and self.out is not None
            for folder in (self.folder, self.folder.parent):
                try:
                    folder.rmdir()
                except OSError:  # not empty, or not there
                    pass
            (self.out / LOCK).unlink(missing_ok=True)  # while still held: no other run locks this file after its removal
            os.close(self._lock)
            self._lock = None
        if self._made is not None:
            try:
                self._made.rmdir()
            except OSError:
                pass
            self._made = None


def progress_bar(total: int, enabled: bool, desc: str, unit: str):
    """A tqdm bar on stderr with the time left (redrawn every 30 s when stderr is not a terminal)."""
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, desc=desc, unit=unit, dynamic_ncols=True,
                mininterval=0.5 if sys.stderr.isatty() else 30.0)


def fsum_dicts(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Key by key sums (``math.fsum``) of dicts of numbers with the same keys."""
    return {key: math.fsum(part[key] for part in parts) for key in parts[0]} if parts else {}
