"""Resumable runs: what a sharded, killable run of many chunks needs, whatever its records hold.

A run is a fixed list of chunks (the list does not depend on the number of processes); process ``rank`` of ``world``
computes chunks ``rank, rank + world, ...`` that are not yet recorded. How a chunk's record is stored is the
subclass's (`relevancy.evaluation.shards.Shards`: JSON lines per process; `relevancy.corpus`: one Parquet file per
chunk); what is here is shared by both:

- the run's *identity* (what determines its results: the options, the content digest of every model's weights and
  tokenizer, `weights_digest`, the versions of the libraries that compute them, `library_versions`) goes to
  ``run.json`` with the first record; a run that finds records compares their ``run.json`` with its own identity and
  refuses (`RunRefused`, naming every differing field and the folder) where they differ, and the processes of one run
  compare their identities with each other (``torch.distributed``);
- rank 0 holds an exclusive ``flock`` on a lock file in the output folder while the run lives (the kernel drops it
  with the process, so a killed run leaves no stale lock): a second run into the same folder is refused;
- `distributed` joins torchrun's process group (gloo), `progress_bar` draws rank 0's bar.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import stat
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from . import __version__
from .files import read_regular, write_atomic

__all__ = ["RUN_FILE", "Run", "RunRefused", "distributed", "library_versions", "progress_bar", "weights_digest"]

#: the run's identity, beside its records
RUN_FILE = "run.json"
#: the largest run.json read
MAX_RUN_BYTES = 2**20
#: the packages whose versions change the numbers (besides relevancy itself)
VERSIONED = ("torch", "torchvision", "timm", "transformers", "open_clip_torch", "numpy", "scikit-learn", "pycocotools")


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
    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {"relevancy": __version__, **{name: version(name) for name in VERSIONED}}


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


def joined(world: int) -> bool:
    """Whether this process is one of a torch.distributed process group of `world` > 1 processes."""
    return world > 1 and dist.is_available() and dist.is_initialized()


def distributed() -> tuple[int, int, bool]:
    """``(rank, world, created)``: the process group this process is in, joined (gloo) when launched by torchrun
    (``WORLD_SIZE`` set) and none exists yet (``created``: the caller destroys it when done)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
        return dist.get_rank(), dist.get_world_size(), True
    return 0, 1, False


def _unequal(identities: list[dict[str, Any]]) -> tuple[type[Exception], str] | None:
    """A problem where the processes' identities (by rank) differ: the fields of the first that differs from rank 0's."""
    for rank, identity in enumerate(identities):
        differences = _differences(identities[0], identity, ("on rank 0", f"on rank {rank}"))
        if differences:
            return RunRefused, (f"the processes of this run were started differently ({'; '.join(differences)}): start "
                                "every process with the same command, models and libraries")
    return None


class Run:
    """The chunks of one run recorded under `folder` (None: kept in memory only, a library call without an output
    folder), its identity in ``folder/run.json``, rank 0's lock on ``out/<lock>``. A subclass says how records are
    stored: `_read` (the records there, by chunk) and `_empty_folders` (what `release` may remove when empty).

    Use it as a context manager, or call `release` when done: rank 0 holds the lock from the first `pending` on."""

    def __init__(self, folder: Path | None, out: Path | None, lock: str, rank: int = 0, world: int = 1,
                 identity: Mapping[str, Any] | None = None) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in 0..{world - 1}")
        self.folder, self.out, self.lock, self.rank, self.world = folder, out, lock, rank, world
        self.identity: dict[str, Any] = json.loads(json.dumps(dict(identity or {})))
        self._begun = False
        self._identified = False  # run.json written by this process
        self._lock: int | None = None  # rank 0's descriptor of the lock file
        self._made: Path | None = None  # the output folder, when this run made it

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:  # a safety net: `release` is meant to be called (the context manager does)
        try:
            self.release()
        except Exception:  # noqa: BLE001 (at interpreter exit the modules it uses may be gone)
            pass

    def weigh(self, model: nn.Module, tokenizer: Any = None) -> None:
        """Add `model`'s weights (and `tokenizer`'s vocabulary) to the run's identity (`weights_digest`), with the
        versions of the libraries that compute the numbers: call it for every model of the run, before the first
        record is read or written. In memory, nothing to compare: a no-op."""
        if self.folder is None:
            return
        if self._begun:
            raise RuntimeError(f"{type(self).__name__}.weigh comes before the first pending/save/collect: the identity is compared then")
        self.identity.setdefault("weights", []).append(weights_digest(model, tokenizer))
        self.identity["versions"] = library_versions()

    # ------------------------------------------------------------------------------------------ the records
    def _read(self, count: int | None) -> dict[int, Any]:
        """Every record in the run's folder, by chunk (below `count` where given); a ValueError naming a damaged one."""
        raise NotImplementedError

    def _empty_folders(self) -> tuple[Path, ...]:
        """The folders `release` removes where they are empty, innermost first."""
        raise NotImplementedError

    def _stored(self, count: int | None) -> dict[int, Any]:
        """Every record there is (the run begun at the first call; in memory, no run to begin)."""
        return self._read(count) if self._begun or self.folder is None else self._begin(count)

    def pending(self, count: int) -> list[int]:
        """The chunks of ``0 .. count - 1`` this process computes: its share, less those already recorded."""
        done = self._stored(count)
        return [k for k in range(self.rank, count, self.world) if k not in done]

    def _identify(self) -> None:
        """Before this process's first record: the run begun, the folder made (a refused command leaves nothing) and
        run.json written."""
        if not self._begun:
            self._begin(None)
        if not self._identified:
            assert self.folder is not None
            self.folder.mkdir(parents=True, exist_ok=True)
            write_atomic(self.folder / RUN_FILE, json.dumps(self.identity, indent=1, sort_keys=True) + "\n")
            self._identified = True

    # ------------------------------------------------------------------------------------------ the beginning
    def _begin(self, count: int | None) -> dict[int, Any]:
        """Start the run (once, every process together): rank 0 takes the lock, every process reads the records it
        sees and compares their run.json with its identity, the processes compare their identities; any problem
        raised on every process alike (`RunRefused`, or the damaged record's ValueError) after releasing. The records."""
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
        if joined(self.world):
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
        path = out / self.lock
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

    # ------------------------------------------------------------------------------------------ the end
    def release(self) -> None:
        """Let go of what this process holds (rank 0: the lock; the record folders left empty; the output folder
        when this run made it and left it empty). The records stay: the same command continues from them. Safe to
        call twice."""
        if self._lock is not None:  # rank 0 of the live run: the folders are its own to tidy
            assert self.out is not None
            for folder in self._empty_folders():
                try:
                    folder.rmdir()
                except OSError:  # not empty, or not there
                    pass
            (self.out / self.lock).unlink(missing_ok=True)  # while still held: no other run locks this file after its removal
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
