"""The shared-memory arena and the read-only mappings of the sidecar's files."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import rlplane
from rlplane.shm import Arena, Mappings, shm_descriptor


def test_files_are_named_for_job_rank_and_pid(shm_dir: Path) -> None:
    with Arena("tiny-grpo", "trainer-0") as a:
        a.alloc(10)
        (path,) = a.paths
        assert os.path.dirname(path) == str(shm_dir)
        assert re.fullmatch(rf"rlplane-tiny-grpo-trainer-0-{os.getpid()}-\d+", os.path.basename(path))


def test_allocations_are_aligned_and_disjoint(shm_dir: Path) -> None:
    with Arena("j", "r", min_file_bytes=1 << 20) as a:
        segs = [a.alloc(n) for n in (1, 7, 300, 4096, 0, 5)]
        for s in segs:
            assert s.offset % 256 == 0
        ends = sorted((s.offset, s.offset + s.nbytes) for s in segs if s.path == segs[0].path)
        for (s0, e0), (s1, _) in zip(ends, ends[1:]):
            assert e0 <= s1
        segs[2].array[:] = 7
        assert segs[3].array.max() == 0


def test_grows_by_a_new_file_when_full(shm_dir: Path) -> None:
    with Arena("j", "r", min_file_bytes=1 << 16) as a:
        a.alloc(60_000)
        s = a.alloc(10_000)
        assert len(a.paths) == 2 and s.offset == 0
        big = a.alloc(1 << 20)  # larger than any file so far: a file of its own size at least
        assert len(a.paths) == 3 and os.path.getsize(big.path) >= 1 << 20
        assert os.path.getsize(a.paths[1]) >= 2 * os.path.getsize(a.paths[0])  # geometric growth


def test_bytes_written_are_visible_through_the_file(shm_dir: Path) -> None:
    with Arena("j", "r") as a:
        x = a.array("<f4", (4, 8))
        x[:] = np.arange(32, dtype=np.float32).reshape(4, 8)
        d = a.describe(x, "x")
        assert d["kind"] == "shm" and d["nbytes"] == 128
        with open(d["path"], "rb") as f:
            f.seek(d["offset"])
            assert np.array_equal(np.frombuffer(f.read(128), "<f4").reshape(4, 8), x)


def test_locate_finds_views_and_refuses_foreign_arrays(shm_dir: Path) -> None:
    with Arena("j", "r") as a:
        x = a.array("<i8", (10, 10))
        d = a.describe(x[3:5], "rows")
        assert d["offset"] == a.describe(x, "x")["offset"] + 3 * 80 and d["nbytes"] == 160
        with pytest.raises(rlplane.InvalidError, match="not contiguous"):
            a.describe(x[:, 1], "column")
        with pytest.raises(rlplane.InvalidError, match=r"\.alloc"):
            a.describe(np.zeros(4), "foreign")


def test_reset_keeps_the_largest_file_and_reuses_it(shm_dir: Path) -> None:
    with Arena("j", "r", min_file_bytes=1 << 16) as a:
        a.alloc(50_000)
        a.alloc(100_000)
        assert len(a.paths) == 2
        a.reset()
        assert len(a.paths) == 1 and len(os.listdir(shm_dir)) == 1
        s = a.alloc(100)
        assert s.offset == 0 and s.path == a.paths[0]


def test_close_removes_the_files_but_arrays_stay_valid(shm_dir: Path) -> None:
    a = Arena("j", "r")
    x = a.array("<f4", (100,))
    x[:] = 3
    assert os.listdir(shm_dir)
    a.close()
    assert os.listdir(shm_dir) == [] and a.closed
    assert float(x.sum()) == 300.0
    with pytest.raises(rlplane.InvalidError, match="closed"):
        a.alloc(1)


def test_files_go_away_when_the_arena_is_collected(shm_dir: Path) -> None:
    a = Arena("j", "r")
    a.alloc(1)
    del a
    gc.collect()
    assert os.listdir(shm_dir) == []


def test_files_go_away_at_interpreter_exit(shm_dir: Path) -> None:
    code = "from rlplane.shm import Arena; a = Arena('j', 'r'); a.alloc(1); print(a.paths[0])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ.copy())
    path = out.stdout.strip()
    assert path.startswith(str(shm_dir)) and not os.path.exists(path)


def test_a_missing_directory_is_named(tmp_path: Path) -> None:
    with pytest.raises(rlplane.ConfigError, match="RLPLANE_SHM_DIR"):
        Arena("j", "r", str(tmp_path / "nope"))


def sidecar_file(d: Path, name: str, data: bytes) -> str:
    """A file as the sidecar would leave one (here just bytes on disk)."""
    p = d / name
    p.write_bytes(data)
    return str(p)


def test_mappings_are_read_only_views(shm_dir: Path) -> None:
    path = sidecar_file(shm_dir, "batch", np.arange(16, dtype="<i8").tobytes())
    m = Mappings()
    x = m.array(shm_descriptor(path, 8, 32), "<i8", (4,))
    assert x.tolist() == [1, 2, 3, 4]
    assert not x.flags.writeable
    # cached: a second descriptor in the same file maps nothing new
    y = m.array(shm_descriptor(path, 0, 8), "<i8", (1,))
    assert y.base is not None and len(m._maps) == 1


def test_mappings_follow_a_replaced_or_grown_file(shm_dir: Path) -> None:
    path = sidecar_file(shm_dir, "batch", np.zeros(4, "<i4").tobytes())
    m = Mappings()
    assert m.array(shm_descriptor(path, 0, 16), "<i4", (4,)).tolist() == [0, 0, 0, 0]
    os.unlink(path)
    sidecar_file(shm_dir, "batch", np.arange(8, dtype="<i4").tobytes())
    assert m.array(shm_descriptor(path, 16, 16), "<i4", (4,)).tolist() == [4, 5, 6, 7]


def test_mapping_errors_name_the_problem(shm_dir: Path) -> None:
    path = sidecar_file(shm_dir, "batch", bytes(16))
    m = Mappings()
    with pytest.raises(rlplane.ProtocolError, match="RLPLANE_SHM_DIR"):
        m.bytes(shm_descriptor(str(shm_dir / "gone"), 0, 4))
    with pytest.raises(rlplane.ProtocolError, match="holds 16 bytes"):
        m.bytes(shm_descriptor(path, 8, 16))
    with pytest.raises(rlplane.ProtocolError, match="needs 24"):
        m.array(shm_descriptor(path, 0, 16), "<i8", (3,))
    with pytest.raises(rlplane.ProtocolError, match="cuda_ipc"):
        m.bytes({"kind": "cuda_ipc", "handle": "00", "offset": 0, "nbytes": 4})


def test_file_mode_follows_rlplane_shm_mode_whatever_the_umask(shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # In a pod the worker may run as another user: the operator sets RLPLANE_SHM_MODE=0666.
    old = os.umask(0o077)
    try:
        monkeypatch.setenv("RLPLANE_SHM_MODE", "0666")
        a = Arena("job", "trainer-0", str(shm_dir))
        a.array(np.float32, [4])
        assert [oct(os.stat(p).st_mode & 0o777) for p in a.paths] == ["0o666"]
        a.close()
        monkeypatch.delenv("RLPLANE_SHM_MODE")
        b = Arena("job", "trainer-0", str(shm_dir))
        b.array(np.float32, [4])
        assert [oct(os.stat(p).st_mode & 0o777) for p in b.paths] == ["0o600"]
        b.close()
        monkeypatch.setenv("RLPLANE_SHM_MODE", "rw")
        with pytest.raises(rlplane.ConfigError, match="RLPLANE_SHM_MODE"):
            Arena("job", "trainer-0", str(shm_dir))
    finally:
        os.umask(old)
