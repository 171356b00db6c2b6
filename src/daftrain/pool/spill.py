"""A pool's spill files: its private spill directory, and writing, reading and verifying the file of
one spilled record.

File format (little-endian): header ``magic "DAFTPOOL", record number (u64), stream bytes (u64)``,
the record's byte stream, trailer ``CRC32 of the stream (u32)``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import struct
import tempfile
import threading
import weakref
import zlib
from collections.abc import Iterable
from pathlib import Path

import torch

from .errors import PoolError

_SPILL_MAGIC = b"DAFTPOOL"
_SPILL_HEADER = struct.Struct("<8sQQ")  # magic, record sequence number, stream bytes
_SPILL_TRAILER = struct.Struct("<I")  # CRC32 of the stream

_O_BINARY = getattr(os, "O_BINARY", 0)  # Windows: no newline translation
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_BINARY
_READ_FLAGS = os.O_RDONLY | _O_NOFOLLOW | _O_BINARY
_CREATE_ATTEMPTS = 100

_LOST = "the record cannot be recovered (its file was the only copy): release it"

# NOTE [ Spill file safety ]
# ``spill_dir`` may be shared (a scratch disk, /tmp) with other users, so the pool never writes to a
# name someone else could have prepared:
#   1. It makes its own directory inside ``spill_dir`` with ``tempfile.mkdtemp`` (a fresh random
#      name, mode 0700): nobody else can list it or create, rename or remove entries in it.
#   2. Each file is created with O_CREAT | O_EXCL | O_NOFOLLOW and mode 0600 under a random name: an
#      existing file or a planted symbolic link makes the create fail (and the pool try another
#      name), it is never opened, so it cannot redirect a write onto another file. Files are read
#      with O_NOFOLLOW too.
#   3. The directory and whatever is left in it are removed when the pool is closed or collected.
# Every file carries its record number, length and CRC32, checked on every read: a truncated,
# altered, replaced or deleted file raises ``PoolError`` naming it, never returns wrong bytes.


def _remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]


class _SpillFiles:
    """The spill directory of one pool and the files in it (thread-safe)."""

    def __init__(self, spill_dir: str | os.PathLike[str] | None) -> None:
        self._parent = None if spill_dir is None else Path(spill_dir)
        self._dir: Path | None = None  # made on the first spill
        self._lock = threading.Lock()
        self._finalizer: weakref.finalize | None = None

    @property
    def directory(self) -> Path | None:
        """The pool's private spill directory (``None`` before the first spill)."""
        return self._dir

    def _directory(self) -> Path:
        with self._lock:
            if self._dir is not None:
                return self._dir
            where = "the system temporary directory" if self._parent is None else f"spill_dir {self._parent}"
            try:
                if self._parent is not None:
                    os.makedirs(self._parent, mode=0o700, exist_ok=True)
                path = tempfile.mkdtemp(prefix="daftrain-pool-", dir=self._parent)
            except OSError as exc:
                raise PoolError(
                    f"cannot make the pool's spill directory in {where}: {exc}; set PoolConfig.spill_dir to "
                    "an existing, writable directory (or PoolConfig.spill=False to never spill)"
                ) from exc
            self._dir = Path(path)
            self._finalizer = weakref.finalize(self, _remove_tree, path)
            return self._dir

    def _create(self, seq: int) -> tuple[int, Path]:
        directory = self._directory()
        for _ in range(_CREATE_ATTEMPTS):
            path = directory / f"{seq:012d}-{secrets.token_hex(8)}.spill"
            try:
                return os.open(path, _CREATE_FLAGS, 0o600), path
            except FileExistsError:  # a name taken (or a link planted): never opened, try another
                continue
            except OSError as exc:
                raise PoolError(
                    f"cannot create spill file {path} for record {seq}: {exc}; the pool's spill directory "
                    f"{directory} must stay in place and writable while the pool is open "
                    "(or set PoolConfig.spill=False)"
                ) from exc
        raise PoolError(
            f"cannot create a spill file for record {seq} in {directory}: {_CREATE_ATTEMPTS} random names "
            "were all taken; something else is writing into the pool's private spill directory"
        )

    def write(self, seq: int, nbytes: int, pieces: Iterable[torch.Tensor | bytes]) -> tuple[Path, int]:
        """Write the ``nbytes`` stream of record ``seq`` (given in ``pieces``) to a new file; returns
        the file and the stream's CRC32. On failure nothing is left behind and ``PoolError`` names it."""
        fd, path = self._create(seq)
        crc = 0
        try:
            try:
                _write_all(fd, _SPILL_HEADER.pack(_SPILL_MAGIC, seq, nbytes))
                for piece in pieces:
                    mv = memoryview(piece.numpy()) if isinstance(piece, torch.Tensor) else memoryview(piece)
                    crc = zlib.crc32(mv, crc)
                    _write_all(fd, mv)
                _write_all(fd, _SPILL_TRAILER.pack(crc))
            finally:
                os.close(fd)
        except OSError as exc:
            self.remove(path)
            raise PoolError(
                f"cannot spill record {seq} to {path}: {exc}; free space in (or choose another) "
                "PoolConfig.spill_dir, raise PoolConfig.max_bytes, or set PoolConfig.spill=False"
            ) from exc
        return path, crc

    @staticmethod
    def read(path: Path, seq: int, nbytes: int, crc: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read and verify the stream of record ``seq`` into a fresh buffer or ``out``."""
        buf = torch.empty(nbytes, dtype=torch.uint8, device="cpu") if out is None else out[:nbytes]
        try:
            with os.fdopen(os.open(path, _READ_FLAGS), "rb") as f:
                header = f.read(_SPILL_HEADER.size)
                if len(header) != _SPILL_HEADER.size:
                    raise PoolError(f"spill file {path} of record {seq} is truncated (no header); {_LOST}")
                magic, got_seq, got_nbytes = _SPILL_HEADER.unpack(header)
                if magic != _SPILL_MAGIC or got_seq != seq or got_nbytes != nbytes:
                    raise PoolError(
                        f"spill file {path} of record {seq} is corrupted: bad header (magic {magic!r}, "
                        f"record {got_seq}, {got_nbytes} bytes; expected record {seq}, {nbytes} bytes); {_LOST}"
                    )
                got = f.readinto(memoryview(buf.numpy())) if nbytes else 0
                trailer = f.read(_SPILL_TRAILER.size)
                extra = f.read(1)
        except FileNotFoundError as exc:
            raise PoolError(
                f"spill file {path} of record {seq} is missing: something deleted it while the pool was open "
                f"(keep PoolConfig.spill_dir intact during training); {_LOST}"
            ) from exc
        except OSError as exc:
            raise PoolError(f"cannot read spill file {path} of record {seq}: {exc}; {_LOST}") from exc
        if got != nbytes or len(trailer) != _SPILL_TRAILER.size or extra:
            raise PoolError(f"spill file {path} of record {seq} is truncated or has trailing bytes; {_LOST}")
        actual = zlib.crc32(memoryview(buf.numpy()))
        (stored,) = _SPILL_TRAILER.unpack(trailer)
        if actual != crc or stored != crc:
            raise PoolError(
                f"spill file {path} of record {seq} is corrupted: CRC32 {actual:#010x}, "
                f"file says {stored:#010x}, written {crc:#010x}; {_LOST}"
            )
        return buf

    @staticmethod
    def remove(path: Path) -> None:
        """Delete a spill file; a file already gone (or a directory that cannot be listed) is fine."""
        with contextlib.suppress(OSError):
            path.unlink()

    def close(self) -> None:
        """Remove the private spill directory and whatever is left in it."""
        if self._finalizer is not None:
            self._finalizer()
