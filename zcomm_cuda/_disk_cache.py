"""The on-disk cache of NVRTC's output: one file per compiled source, shared by every process.

[Note: kernel cache] A compile of the kernel sources takes up to half a minute per source
(NVRTC's optimizer and ptxas); every rank of every job would pay it on its first collective.
So the loader keeps what NVRTC produced (PTX, and the cubin for a real ``sm_`` arch) in a
directory (:func:`cache_dir`): ``$ZCOMM_CACHE_DIR``, else ``$XDG_CACHE_HOME/zcomm``, else
``~/.cache/zcomm``; entries live in its ``kernels/`` folder.

* Key. An entry's name holds the SHA-256 of everything that changes NVRTC's bytes: the
  cache format, the source's name and its text with its headers inlined (what NVRTC
  compiles), the options in order, the arch and NVRTC's version. An edited header, a new
  option (the device-checks define) or a new NVRTC is a new name; old entries are never
  read again (delete the folder to reclaim them).
* Write. A compile writes to a temporary file in the same folder and renames it onto the
  entry's name (``os.replace``, atomic on one filesystem): a reader sees no entry or a whole
  one. Ranks that start together take an exclusive lock (``flock``) on the entry's ``.lock``
  file around the check-compile-write, so that one of them compiles and the others wait and
  read its entry; where the filesystem refuses locks, each compiles and renames its own
  whole copy, still safe. Lock files stay (removing one would race a waiter).
* Read. An entry carries a magic word, its key and the SHA-256 of its payload; one that is
  truncated, corrupt or written for another key is reported (a warning) and recompiled,
  never loaded.
* A folder that cannot be written (a read-only image) still serves its entries; a source
  missing there is compiled in the process and a warning says it could not be stored.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import tempfile
import warnings
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Sequence

CACHE_DIR_ENV = "ZCOMM_CACHE_DIR"
FORMAT_VERSION = 1
ENTRY_SUFFIX = ".zck"

_MAGIC = b"ZCOMMKC1"
# magic, key digest, payload digest, PTX bytes, cubin bytes (or _NO_CUBIN)
_HEADER = struct.Struct("<8s32s32sQQ")
_NO_CUBIN = (1 << 64) - 1


class Entry(NamedTuple):
    """What one compile produced: PTX text and, for a real (``sm_``) arch, a cubin."""

    ptx: str
    cubin: bytes | None


class Fetched(NamedTuple):
    """An entry as :func:`load_or_compile` returned it: from the disk (``compiled`` False) or
    compiled by this call, and where it lives."""

    entry: Entry
    path: Path
    compiled: bool


def cache_dir() -> Path:
    """The cache folder ([Note: kernel cache]), read from the environment on every call."""
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "zcomm"


def entry_key(source: str, text: str, options: Sequence[str], arch: str, nvrtc_version: Sequence[int]) -> bytes:
    """The SHA-256 digest naming the entry of ``source`` compiled from ``text`` ([Note: kernel cache])."""
    fields = [FORMAT_VERSION, source, text, list(options), arch, list(nvrtc_version)]
    return hashlib.sha256(json.dumps(fields).encode()).digest()


def entry_path(directory: Path, source: str, arch: str, key: bytes) -> Path:
    return directory / "kernels" / f"{Path(source).stem}-{arch}-{key.hex()}{ENTRY_SUFFIX}"


def encode(key: bytes, entry: Entry) -> bytes:
    ptx = entry.ptx.encode()
    cubin = entry.cubin if entry.cubin is not None else b""
    digest = hashlib.sha256(ptx + cubin).digest()
    header = _HEADER.pack(_MAGIC, key, digest, len(ptx), len(cubin) if entry.cubin is not None else _NO_CUBIN)
    return header + ptx + cubin


def decode(data: bytes, key: bytes) -> Entry:
    """The entry in ``data``; ``ValueError`` saying what is wrong when it is not a whole entry for ``key``."""
    if len(data) < _HEADER.size:
        raise ValueError(f"{len(data)} bytes, shorter than the header")
    magic, stored_key, digest, ptx_len, cubin_len = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        raise ValueError("not a zcomm kernel cache entry")
    if stored_key != key:
        raise ValueError("written for another key")
    payload = data[_HEADER.size:]
    cubin_bytes = 0 if cubin_len == _NO_CUBIN else cubin_len
    if len(payload) != ptx_len + cubin_bytes:
        raise ValueError(f"payload of {len(payload)} bytes, the header says {ptx_len + cubin_bytes}")
    if hashlib.sha256(payload).digest() != digest:
        raise ValueError("payload digest mismatch")
    cubin = None if cubin_len == _NO_CUBIN else payload[ptx_len:]
    return Entry(payload[:ptx_len].decode(), cubin)


def read(path: Path, key: bytes) -> Entry | None:
    """The entry at ``path``, or None when there is none or it is not whole (with a warning)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return decode(data, key)
    except ValueError as exc:
        warnings.warn(f"zcomm kernel cache: {path} is unusable ({exc}); compiling it again", stacklevel=3)
        return None


def write(path: Path, key: bytes, entry: Entry) -> None:
    """Store ``entry`` at ``path`` atomically: a temporary file in the same folder, renamed onto it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(encode(key, entry))
        os.chmod(temp, 0o644)  # readable by other users of a shared (image) cache
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` + ``.lock`` (none where the folder or filesystem refuses it)."""
    import fcntl

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield  # no lock: concurrent compiles each rename a whole entry
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass  # as above
        yield
    finally:
        os.close(fd)  # releases the lock


def load_or_compile(directory: Path, source: str, text: str, options: Sequence[str], arch: str,
                    nvrtc_version: Sequence[int], compile: Callable[[], Entry]) -> Fetched:
    """The entry of ``source`` for these inputs: read from ``directory`` or made by ``compile()``
    and stored there ([Note: kernel cache])."""
    key = entry_key(source, text, options, arch, nvrtc_version)
    path = entry_path(directory, source, arch, key)
    entry = read(path, key)
    if entry is not None:
        return Fetched(entry, path, False)
    with locked(path):
        entry = read(path, key)  # another process may have written it while this one waited
        if entry is not None:
            return Fetched(entry, path, False)
        entry = compile()
        try:
            write(path, key, entry)
        except OSError as exc:
            warnings.warn(f"zcomm kernel cache: could not store {path} ({exc}); this process compiled it "
                          f"and will again next time", stacklevel=3)  # fmt: skip
    return Fetched(entry, path, True)
