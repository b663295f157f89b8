"""Writing output files: checked before any work, never two outputs of one run on one name, each written whole.

`check_folder` and `check_file` refuse an output path that cannot be written before a command computes
anything; `distinct_stems` names the outputs of a run apart; `write_atomic` writes a temporary file in the
same folder and moves it into place with `os.replace`, so a failure leaves no partial file; `read_regular` reads
back what was written, refusing anything but a regular file of a bounded size (a pipe or a device may never end).
"""
from __future__ import annotations

import errno
import hashlib
import math
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, Iterable, Sequence


def strict_json(value: Any) -> Any:
    """`value` with NaN and infinities as None, so that it serialises as strict JSON (null)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


class OutputError(ValueError):
    """An output path that cannot be written; raised before any work is done."""


#: what a path that is neither a regular file nor a folder is, by its mode
SPECIAL_KINDS = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
                 (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def special_kind(path: str | Path) -> str | None:
    """What `path` is when it is a special file (a FIFO, a device, a socket; through links), else None (a regular
    file, a folder, nothing there): a special file is never read, since reading it may never end."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    return next((kind for test, kind in SPECIAL_KINDS if test(mode)), None)


#: the dtypes a tensor written into a JSON file may name (a saved result's, an evaluation record's)
TENSOR_DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool")


def read_regular(path: str | Path, limit: int, links: bool = False) -> bytes:
    """The bytes of `path`, refused (ValueError, naming what it is) unless it is a regular file of at most `limit`
    bytes: a pipe, a device or a folder is never read (the read may never end or never stop), a symbolic link only
    with `links`. The kind is checked before opening (no device is opened) and again on the open descriptor (no race
    between the check and the read); the open does not block, whatever is there. A missing file is the OSError."""
    path = Path(path)
    mode = (os.stat if links else os.lstat)(path).st_mode
    _check_regular(path, mode, links)
    try:
        handle = os.open(path, os.O_RDONLY | os.O_NONBLOCK | (0 if links else os.O_NOFOLLOW))
    except OSError as error:
        if error.errno == errno.ELOOP:  # made a link since the check
            _check_regular(path, stat.S_IFLNK, links)
        raise
    with os.fdopen(handle, "rb") as file:
        info = os.fstat(handle)
        _check_regular(path, info.st_mode, links)
        if info.st_size > limit:
            raise ValueError(f"{path} holds {info.st_size:,} bytes, more than the {limit:,} read here")
        data = file.read(limit + 1)
    if len(data) > limit:  # it grew while read
        raise ValueError(f"{path} holds more than the {limit:,} bytes read here")
    return data


def _check_regular(path: Path, mode: int, links: bool) -> None:
    """A ValueError naming what `path` is unless `mode` is a regular file's."""
    if stat.S_ISREG(mode):
        return
    if stat.S_ISLNK(mode):
        kind = "a symbolic link" + ("" if links else " (read only as the file itself, not through a link)")
    elif stat.S_ISDIR(mode):
        kind = "a folder"
    else:
        kind = next((kind for test, kind in SPECIAL_KINDS if test(mode)), "an unknown kind of file")
    raise ValueError(f"{path} is {kind}, not a regular file")


def check_model_path(value: str, option: str) -> None:
    """A ValueError naming what it is when `value` (a model name, file or folder) is a special file or a folder
    holding one (config.json, weights, tokenizer files: loaders read them whole); names that are no path pass."""
    path = Path(value).expanduser()
    kind = special_kind(path)
    if kind is not None:
        raise ValueError(f"{option} {value} is {kind}, not a model file or folder")
    if path.is_dir():
        try:
            entries = sorted(path.iterdir())
        except OSError as error:
            raise ValueError(f"{option} {value}: cannot list the folder ({error.strerror})") from None
        for entry in entries:
            kind = special_kind(entry)
            if kind is not None:
                raise ValueError(f"{option} {value}: its {entry.name} is {kind}, not a file; a model folder holds files")


def check_folder(path: str | Path, files: Iterable[str] = ()) -> Path:
    """`path` as an output folder: refused if it is a file, if it cannot be created or written, or if one of
    `files` (the names to be written in it) is a folder. Creates nothing."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputError(f"{path} exists and is not a folder")
    existing = path.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise OutputError(f"cannot create the folder {path}: {existing} is a file")
    try:
        with tempfile.TemporaryFile(dir=existing):  # the real test: permissions, read-only disks, root
            pass
    except OSError as error:
        raise OutputError(f"cannot write to {path}: {existing} is not writable ({error.strerror})") from None
    for name in files:
        if (path / name).is_dir():
            raise OutputError(f"cannot write {path / name}: it is a folder")
    return path


#: the longest file name (one path component, in bytes) the common file systems take
MAX_NAME_BYTES = 255


def checked_path(path: object, what: str, error: type[Exception]) -> Path:
    """`path` (a str or a path object) as a `Path`, refused with `error` in one line where no file could be there:
    bytes, a NUL character, a file or folder name longer than `MAX_NAME_BYTES` bytes (`what` names the path)."""
    if isinstance(path, (bytes, bytearray)) or not isinstance(path, (str, os.PathLike)):
        raise error(f"{what} must be a str or a pathlib.Path, got {type(path).__name__}")
    path = Path(path)
    if "\x00" in str(path):
        raise error(f"{what} cannot hold a NUL character: {str(path)!r:.80}")
    long = next((part for part in path.parts if len(part.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES), None)
    if long is not None:
        raise error(f"{what}: the name {long[:40]}... is {len(long.encode('utf-8', 'surrogateescape'))} bytes long; a file or folder "
                    f"name takes at most {MAX_NAME_BYTES}")
    return path


def output_path(path: object) -> Path:
    """`path` as an output file's path, refused in one line where no file could be written there (`checked_path`)."""
    return checked_path(path, "an output path", OutputError)


def check_file(path: str | Path) -> Path:
    """`path` as an output file: refused if it is no path a file could be written to (`output_path`), a folder, or if
    its folder cannot be created or written."""
    path = output_path(path)
    if path.is_dir():
        raise OutputError(f"{path} is a folder; give a file name")
    try:
        check_folder(path.parent)
    except OutputError as error:
        raise OutputError(f"cannot write {path}: {error}") from None
    return path


#: the suffixes of an HTML page
HTML_SUFFIXES = (".html", ".htm")


def check_html_path(path: str | Path, what: str) -> Path:
    """`path` for an HTML page of `what`: refused unless it ends in one of HTML_SUFFIXES (writing HTML into
    `x.png` makes a file nothing opens)."""
    path = Path(path)
    if path.suffix.lower() not in HTML_SUFFIXES:
        raise OutputError(f"{what} is saved as an HTML page: give a path ending in {' or '.join(HTML_SUFFIXES)}, got '{path.name}'")
    return path


def distinct_stems(paths: Sequence[str | Path]) -> list[str]:
    """One output name stem per input path, apart even where inputs share a name (or differ only in case):
    `a/cat.png`, `b/cat.png` -> `cat`, `cat-2`."""
    taken: set[str] = set()
    stems = []
    for path in paths:
        stem = Path(path).stem
        candidate, count = stem, 1
        while candidate.casefold() in taken:
            count += 1
            candidate = f"{stem}-{count}"
        taken.add(candidate.casefold())
        stems.append(candidate)
    return stems


def write_atomic(path: str | Path, content: bytes | str, durable: bool = False) -> Path:
    """Write `content` to `path` so that a failure leaves no partial file (and an older file untouched); a path
    that is a folder, or below a file, is refused in one line (`check_file`). `durable`: on disk (the file and its
    folder's entry fsynced) before this returns, so that a machine's crash keeps it too (a resumable run's records)."""
    path = check_file(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = content.encode("utf-8") if isinstance(content, str) else content
    # the temporary name stays within a file system's name length (mkstemp adds 8 characters and the suffix)
    stem = path.name.encode("utf-8", "surrogateescape")[:MAX_NAME_BYTES - 16].decode("utf-8", "ignore")
    handle, temporary = tempfile.mkstemp(prefix=f".{stem}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)  # mkstemp makes 0600 files; outputs are ordinary files
        os.replace(temporary, path)
        if durable:
            folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(folder)
            finally:
                os.close(folder)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    return path


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes, read in blocks (a model's weights file: hundreds of MB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()
