"""The pool's spill files: private, exclusively created files that never follow a link, and faults
(unusable, unwritable, deleted or full spill directory, corrupted files) that raise ``PoolError``
naming the file, never return wrong bytes and leave the pool consistent."""

from __future__ import annotations

import errno
import gc
import os
import shutil
import stat
from pathlib import Path

import pytest
from pool_helpers import PS, assert_empty, assert_same, pool, raw

from daftrain.pool import PagePool, PoolError, RecordState
from daftrain.pool import spill as spill_module


def spill_one(p: PagePool) -> tuple:
    """Two records in a two-page pool: the first is spilled. Returns (spilled, resident)."""
    a = p.store(raw(2 * PS, 1), 1.0)
    b = p.store(raw(2 * PS, 2), 2.0)
    assert a.state is RecordState.SPILLED and b.state is RecordState.RESIDENT
    return a, b


def private_dir(spill_dir: Path) -> Path:
    (d,) = spill_dir.iterdir()
    return d


# -- file safety ---------------------------------------------------------------------------------------------


def test_spill_files_are_private_with_unpredictable_names(tmp_path: Path):
    names = []
    for _ in range(2):
        with pool(max_bytes=2 * PS, spill_dir=tmp_path) as p:
            a, _ = spill_one(p)
            d = private_dir(tmp_path)
            assert d.is_dir() and not d.is_symlink() and stat.S_IMODE(d.stat().st_mode) == 0o700
            path = a._entry.spill_path
            assert path.parent == d and stat.S_IMODE(path.lstat().st_mode) == 0o600
            names.append((d.name, path.name))
        assert list(tmp_path.iterdir()) == []  # the private directory went with the pool
    # the same record number in two pools: neither the directory nor the file name repeats
    assert names[0][0] != names[1][0] and names[0][1] != names[1][1]


def test_planted_symlinks_are_never_followed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    target = tmp_path / "victim.txt"
    target.write_bytes(b"precious")
    spill_dir = tmp_path / "spill"
    with pool(max_bytes=2 * PS, spill_dir=spill_dir) as p:
        a, b = spill_one(p)  # record 0 spilled: the private directory exists
        d = a._entry.spill_path.parent
        # Links at the names a sequential scheme would use next (guessed from the visible file's name),
        # in spill_dir and in the private directory.
        prefix = a._entry.spill_path.name.split("-")[0]
        for where in {spill_dir, d}:
            for seq in range(1, 10):
                (where / f"{prefix}-{seq:012d}.spill").symlink_to(target)
        # And a link at exactly the name the pool will draw next (its random part made predictable).
        drawn = iter(["0" * 16, "1" * 16])
        monkeypatch.setattr(spill_module.secrets, "token_hex", lambda n: next(drawn))
        trap = d / f"{1:012d}-{'0' * 16}.spill"
        trap.symlink_to(target)
        c = p.store(raw(2 * PS, 3), 3.0)  # evicts b (record 1): its create meets the link, draws again
        assert b.state is RecordState.SPILLED and c.state is RecordState.RESIDENT
        assert b._entry.spill_path == d / f"{1:012d}-{'1' * 16}.spill"
        assert trap.is_symlink() and target.read_bytes() == b"precious"
        assert_same(a.load(page_in=False), raw(2 * PS, 1))
        assert_same(b.load(page_in=False), raw(2 * PS, 2))
    assert target.read_bytes() == b"precious"


def test_spill_file_replaced_by_a_symlink_is_not_read(tmp_path: Path):
    with pool(max_bytes=2 * PS, spill_dir=tmp_path) as p:
        a, b = spill_one(p)
        path = a._entry.spill_path
        copy = tmp_path / "copy.spill"
        shutil.copyfile(path, copy)  # the very bytes, but behind a link
        path.unlink()
        path.symlink_to(copy)
        with pytest.raises(PoolError, match="cannot read spill file") as info:
            a.load()
        assert str(path) in str(info.value)
        a.release()
        b.release()
        assert_empty(p)


def test_dropped_pool_removes_its_spill_dir(tmp_path: Path):
    p = pool(max_bytes=2 * PS, spill_dir=tmp_path)
    a, b = spill_one(p)
    d = private_dir(tmp_path)
    del p, a, b
    gc.collect()
    assert not d.exists() and list(tmp_path.iterdir()) == []


# -- faults ------------------------------------------------------------------------------------------------------


def test_corrupted_spill_file_raises_pool_error(tmp_path: Path):
    with pool(max_bytes=2 * PS, spill_dir=tmp_path) as p:
        a = p.store(raw(2 * PS, 1), 1.0)
        b = p.store(raw(2 * PS, 2), 2.0)
        c = p.store(raw(2 * PS, 3), 0.5)
        d = p.store(raw(2 * PS, 4), 0.25)
        assert a.state is c.state is d.state is RecordState.SPILLED
        assert len(list(private_dir(tmp_path).iterdir())) == 3
        fa, fc, fd = (r._entry.spill_path for r in (a, c, d))
        data = bytearray(fa.read_bytes())
        data[100] ^= 0x01  # one flipped bit in the body
        fa.write_bytes(bytes(data))
        for _ in range(2):  # and it stays an error: never the wrong bytes
            with pytest.raises(PoolError, match="corrupted") as info:
                a.load()
            assert str(fa) in str(info.value)
        data = bytearray(fd.read_bytes())
        data[8] ^= 0x01  # a flipped bit in the header's record number
        fd.write_bytes(bytes(data))
        with pytest.raises(PoolError, match="corrupted: bad header") as info:
            d.load()
        assert str(fd) in str(info.value)
        fc.write_bytes(fc.read_bytes()[:-10])  # truncated
        with pytest.raises(PoolError, match="truncated") as info:
            c.load()
        assert str(fc) in str(info.value)
        fc.unlink()
        with pytest.raises(PoolError, match="missing") as info:
            p.prefetch(c)
        assert str(fc) in str(info.value)
        assert_same(b.load(), raw(2 * PS, 2))
        for r in (a, b, c, d):
            r.release()
        assert_empty(p)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("below", ["file", "file/sub"])
def test_spill_dir_below_a_regular_file_raises_pool_error(tmp_path: Path, below: str):
    (tmp_path / "file").write_bytes(b"not a directory")
    spill_dir = tmp_path / below
    with pool(max_bytes=2 * PS, spill_dir=spill_dir) as p:
        a = p.store(raw(2 * PS, 1), 1.0)
        with pytest.raises(PoolError, match="spill_dir") as info:
            p.store(raw(2 * PS, 2), 2.0)  # must spill a
        assert str(spill_dir) in str(info.value) and "writable directory" in str(info.value)
        assert a.state is RecordState.RESIDENT  # nothing was lost: a stays in its pages
        assert_same(a.load(), raw(2 * PS, 1))
        with pytest.raises(PoolError, match="spill_dir"):
            p.store(raw(2 * PS, 3), 0.5)  # a new record spilled as given
        p.check()
        assert p.stats().records == 1
        a.release()
        assert_empty(p)
    assert (tmp_path / "file").read_bytes() == b"not a directory"


def test_unwritable_spill_dir_raises_pool_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def refuse(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    with pool(max_bytes=2 * PS, spill_dir=tmp_path) as p:
        a = p.store(raw(2 * PS, 1), 1.0)
        with monkeypatch.context() as m:
            m.setattr(os, "mkdir", refuse)  # spill_dir does not let us make the private directory
            with pytest.raises(PoolError, match="spill_dir") as info:
                p.store(raw(2 * PS, 2), 2.0)
        assert str(tmp_path) in str(info.value) and "Permission denied" in str(info.value)
        assert a.state is RecordState.RESIDENT
        b = p.store(raw(2 * PS, 2), 2.0)  # writable again: a spills
        assert a.state is RecordState.SPILLED
        real_open = os.open
        with monkeypatch.context() as m:  # the private directory no longer lets us create files
            m.setattr(os, "open", lambda path, flags, *args, **kw: refuse(path) if flags & os.O_CREAT
                      else real_open(path, flags, *args, **kw))
            with pytest.raises(PoolError, match="cannot create spill file") as info:
                p.store(raw(2 * PS, 3), 3.0)  # must spill b
        assert str(a._entry.spill_path.parent) in str(info.value)
        assert b.state is RecordState.RESIDENT
        assert_same(a.load(page_in=False), raw(2 * PS, 1))
        assert_same(b.load(), raw(2 * PS, 2))
        p.check()
        a.release()
        b.release()
        assert_empty(p)


@pytest.mark.parametrize("then", ["deleted", "replaced by a file"])
def test_spill_dir_deleted_while_running_raises_pool_error(tmp_path: Path, then: str):
    with pool(max_bytes=2 * PS, spill_dir=tmp_path) as p:
        a, b = spill_one(p)
        path = a._entry.spill_path
        shutil.rmtree(path.parent)
        if then != "deleted":
            path.parent.write_bytes(b"")  # file operations below it now fail with ENOTDIR
        with pytest.raises(PoolError, match="missing" if then == "deleted" else "cannot read spill file") as info:
            a.load()
        assert str(path) in str(info.value)
        with pytest.raises(PoolError, match="cannot create spill file") as info:
            p.store(raw(2 * PS, 3), 3.0)  # must spill b into the deleted directory
        assert str(path.parent) in str(info.value)
        assert b.state is RecordState.RESIDENT
        assert_same(b.load(), raw(2 * PS, 2))
        p.check()
        a.release()  # its file cannot be removed: releasing it still works
        b.release()
        assert_empty(p)


def test_full_disk_while_spilling_raises_pool_error_and_leaves_no_file(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch):
    real_write = os.write
    calls = []

    def write(fd, data):
        calls.append(len(data))
        if len(calls) > 1:  # the header fits, then the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    with pool(max_bytes=2 * PS, spill_dir=tmp_path) as p:
        a = p.store(raw(2 * PS, 1), 1.0)
        with monkeypatch.context() as m:
            m.setattr(os, "write", write)
            with pytest.raises(PoolError, match="No space left") as info:
                p.store(raw(2 * PS, 2), 2.0)  # must spill a
            assert ".spill" in str(info.value) and str(tmp_path) in str(info.value)
            assert a.state is RecordState.RESIDENT
            calls.clear()
            with pytest.raises(PoolError, match="No space left"):
                p.store(raw(2 * PS, 3), 0.5)  # a new, least important record: spilled as given
        assert list(private_dir(tmp_path).iterdir()) == []  # the partial files are gone
        assert_same(a.load(), raw(2 * PS, 1))
        p.check()
        assert p.stats().records == 1 and p.stats().spills == 0
        b = p.store(raw(2 * PS, 2), 2.0)  # space again: a spills and reads back bit-exact
        assert a.state is RecordState.SPILLED
        assert_same(a.load(page_in=False), raw(2 * PS, 1))
        a.release()
        b.release()
        assert_empty(p)
