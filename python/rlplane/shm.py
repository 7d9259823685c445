"""Shared-memory files: the client's arena (weights, rollout columns) and read-only mappings of the
sidecar's files (batches, staging buffers).

The sidecar never receives bytes over the socket: it maps the files named by ``shm`` memory
descriptors (``{"kind": "shm", "path", "offset", "nbytes"}``). The client's files live under
``$RLPLANE_SHM_DIR`` (default ``/dev/shm``) and are named ``rlplane-<job>-<rank>-<pid>-<n>``; they
are removed when the arena is closed, when it is garbage-collected, or at interpreter exit.
"""

from __future__ import annotations

import bisect
import errno
import itertools
import mmap
import os
import re
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .errors import ConfigError, InvalidError, ProtocolError

__all__ = ["Arena", "Segment", "Mappings", "shm_dir", "shm_descriptor", "DEFAULT_ALIGN"]

#: Alignment of every allocation (bytes): enough for any dtype and for vectorised copies.
DEFAULT_ALIGN = 256
_PAGE = mmap.PAGESIZE
_COUNTER = itertools.count()
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def shm_dir(reported: str | None = None) -> str:
    """The directory for the client's shared-memory files.

    ``$RLPLANE_SHM_DIR`` when set (the path as this process sees it), else the directory the
    sidecar reported in its hello (``shm_dir``), else ``/dev/shm``.
    """
    return os.environ.get("RLPLANE_SHM_DIR") or reported or "/dev/shm"


def shm_descriptor(path: str, offset: int, nbytes: int) -> dict[str, Any]:
    """A ``shm`` memory descriptor."""
    return {"kind": "shm", "path": path, "offset": int(offset), "nbytes": int(nbytes)}


@dataclass(frozen=True)
class Segment:
    """One allocation in an arena file: ``nbytes`` bytes at ``offset`` of ``path``.

    ``array`` is a writable ``uint8`` view of the bytes, valid as long as it is referenced.
    """

    path: str
    offset: int
    nbytes: int
    array: npt.NDArray[np.uint8]

    @property
    def descriptor(self) -> dict[str, Any]:
        """The segment as a ``shm`` memory descriptor."""
        return shm_descriptor(self.path, self.offset, self.nbytes)

    def view(self, dtype: npt.DTypeLike, shape: Sequence[int]) -> np.ndarray:
        """The segment's first bytes viewed as an array of ``dtype`` and ``shape``."""
        dt = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if n > self.nbytes:
            raise InvalidError(f"a view of {n} bytes does not fit a segment of {self.nbytes}")
        return self.array[:n].view(dt).reshape(tuple(shape))


class _File:
    __slots__ = ("path", "size", "mm", "base", "used")

    def __init__(self, path: str, size: int, mm: mmap.mmap) -> None:
        self.path = path
        self.size = size
        self.mm = mm
        self.base = np.frombuffer(mm, dtype=np.uint8)
        self.used = 0

    @property
    def address(self) -> int:
        return int(self.base.__array_interface__["data"][0])


def _unlink_all(paths: list[str]) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
        except OSError:
            pass
    paths.clear()


def _default_mode() -> int:
    """``$RLPLANE_SHM_MODE`` (octal, e.g. ``0666``), else ``0o600``."""
    raw = os.environ.get("RLPLANE_SHM_MODE")
    if not raw:
        return 0o600
    try:
        return int(raw, 8)
    except ValueError:
        raise ConfigError(f"RLPLANE_SHM_MODE={raw!r} is not an octal file mode (e.g. 0666)") from None


class Arena:
    """Shared-memory files this process writes and the sidecar maps.

    Allocations are bump-allocated in the current file; one that does not fit opens a new file of
    at least ``min_file_bytes`` (and at least twice the last one, up to 1 GiB, so growth is
    geometric). Nothing is freed one by one: :meth:`reset` reuses the space of a scratch arena,
    :meth:`close` removes every file.

    Files are created with mode ``$RLPLANE_SHM_MODE`` (octal), else ``0o600``: the sidecar must
    then run as the same user (it does under ``rlplane local``). The operator sets
    ``RLPLANE_SHM_MODE=0666`` in users' containers, whose ``/dev/shm`` is the pod's own
    memory-backed volume and whose user may differ from the worker's; pass ``mode`` to override.

    Mappings stay valid while numpy arrays reference them, even after :meth:`close` removed the
    files.
    """

    def __init__(
        self,
        job: str,
        rank: str,
        directory: str | None = None,
        *,
        min_file_bytes: int = 16 * 1024 * 1024,
        mode: int | None = None,
    ) -> None:
        self.directory = directory or shm_dir()
        self.prefix = f"rlplane-{_SAFE.sub('_', job)}-{_SAFE.sub('_', rank)}-{os.getpid()}"
        self.min_file_bytes = max(int(min_file_bytes), _PAGE)
        self.mode = mode if mode is not None else _default_mode()
        self._files: list[_File] = []
        self._paths: list[str] = []
        self._lock = threading.Lock()
        # Sorted (address, file) for locating arrays that live in the arena.
        self._by_addr: list[tuple[int, _File]] = []
        self._finalizer = weakref.finalize(self, _unlink_all, self._paths)
        if not os.path.isdir(self.directory):
            raise ConfigError(
                f"the shared-memory directory {self.directory} does not exist; set RLPLANE_SHM_DIR to a "
                "memory-backed directory the sidecar also sees (default /dev/shm)"
            )

    @property
    def paths(self) -> list[str]:
        """The arena's files, oldest first."""
        return list(self._paths)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return not self._finalizer.alive

    def _open(self, size: int) -> _File:
        size = -(-size // _PAGE) * _PAGE
        path = os.path.join(self.directory, f"{self.prefix}-{next(_COUNTER)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), self.mode)
        try:
            # os.open's mode passes through the umask; the mode asked for is the mode wanted.
            os.fchmod(fd, self.mode)
            self._paths.append(path)
            try:
                # Reserve the pages now: a full tmpfs answers ENOSPC here instead of SIGBUS on write.
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                    _unlink_all([path])
                    self._paths.remove(path)
                    raise ConfigError(
                        f"no room for {size} bytes of shared memory in {self.directory} ({e.strerror}): enlarge it "
                        "(docker --shm-size, the pod's memory-backed emptyDir sizeLimit) or set RLPLANE_SHM_DIR"
                    ) from None
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        f = _File(path, size, mm)
        self._files.append(f)
        bisect.insort(self._by_addr, (f.address, f), key=lambda t: t[0])
        return f

    def alloc(self, nbytes: int, align: int = DEFAULT_ALIGN) -> Segment:
        """Allocates ``nbytes`` bytes (aligned to ``align``) and returns them as a :class:`Segment`."""
        if self.closed:
            raise InvalidError("the shared-memory arena is closed")
        nbytes = int(nbytes)
        if nbytes < 0:
            raise InvalidError(f"cannot allocate {nbytes} bytes")
        with self._lock:
            f = self._files[-1] if self._files else None
            start = 0
            if f is not None:
                start = -(-f.used // align) * align
                if start + nbytes > f.size:
                    f = None
            if f is None:
                last = self._files[-1].size if self._files else 0
                grow = min(2 * last, 1 << 30)
                f = self._open(max(nbytes, self.min_file_bytes, grow))
                start = 0
            f.used = start + nbytes
            return Segment(f.path, start, nbytes, f.base[start : start + nbytes])

    def array(self, dtype: npt.DTypeLike, shape: Sequence[int]) -> np.ndarray:
        """A new zero-filled array in shared memory (files are created zeroed; reused space is zeroed)."""
        dt = np.dtype(dtype)
        shape = tuple(int(s) for s in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        seg = self.alloc(nbytes, align=max(DEFAULT_ALIGN, dt.alignment))
        seg.array[:] = 0
        return seg.array.view(dt).reshape(shape)

    def reset(self) -> None:
        """Reuses the arena's space from the start (for scratch use, e.g. one ``put`` at a time).

        Keeps the largest file and removes the others; arrays allocated before must no longer be
        written. Their mappings stay valid.
        """
        with self._lock:
            if not self._files:
                return
            keep = max(self._files, key=lambda f: f.size)
            drop = [f for f in self._files if f is not keep]
            _unlink_all([f.path for f in drop])
            for f in drop:
                self._paths.remove(f.path)
            self._files = [keep]
            self._by_addr = [(keep.address, keep)]
            keep.used = 0

    def locate(self, array: np.ndarray) -> tuple[str, int] | None:
        """Where ``array``'s bytes live in the arena: ``(path, offset)``, or None if elsewhere.

        The array must be C-contiguous to be described by one (path, offset, nbytes).
        """
        addr = int(array.__array_interface__["data"][0])
        return self.locate_address(addr, array.nbytes)

    def locate_address(self, addr: int, nbytes: int) -> tuple[str, int] | None:
        """Like :meth:`locate` for a raw address range (e.g. a torch tensor's ``data_ptr()``)."""
        with self._lock:
            i = bisect.bisect_right(self._by_addr, addr, key=lambda t: t[0]) - 1
            if i < 0:
                return None
            base, f = self._by_addr[i]
            if addr + nbytes <= base + f.size:
                return f.path, addr - base
            return None

    def describe(self, array: np.ndarray, what: str = "the array") -> dict[str, Any]:
        """The ``shm`` descriptor of an array allocated in this arena.

        Raises:
            InvalidError: the array is not C-contiguous or does not live in this arena.
        """
        if not array.flags.c_contiguous:
            raise InvalidError(f"{what} is not contiguous: describe a contiguous array (np.ascontiguousarray copies)")
        where = self.locate(array)
        if where is None:
            raise InvalidError(
                f"{what} is not in shared memory this client allocated: allocate it with .alloc(name, dtype, shape) "
                "and fill it, or pass torch tensors through rlplane.torch.register_model"
            )
        return shm_descriptor(where[0], where[1], array.nbytes)

    def close(self) -> None:
        """Removes the arena's files. Existing arrays keep their mappings until they are dropped."""
        with self._lock:
            self._finalizer()
            for f in self._files:
                try:
                    f.mm.close()
                except BufferError:
                    pass  # arrays still reference the mapping; it goes away with them
            self._files = []
            self._by_addr = []

    def __enter__(self) -> Arena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Mappings:
    """Read-only mappings of the sidecar's files, cached by path.

    A file replaced (another inode) or grown since it was mapped is mapped again.
    """

    def __init__(self, *, writable: bool = False) -> None:
        self._maps: dict[str, tuple[tuple[int, int], int, np.ndarray]] = {}
        self._lock = threading.Lock()
        self.writable = writable

    def bytes(self, descriptor: dict[str, Any], what: str = "a descriptor") -> npt.NDArray[np.uint8]:
        """The descriptor's bytes as a ``uint8`` array (read-only unless ``writable``)."""
        if not isinstance(descriptor, dict) or descriptor.get("kind") != "shm":
            kind = descriptor.get("kind") if isinstance(descriptor, dict) else type(descriptor).__name__
            raise ProtocolError(f"{what}: expected a shm memory descriptor, got kind {kind!r}")
        try:
            path = descriptor["path"]
            offset = int(descriptor["offset"])
            nbytes = int(descriptor["nbytes"])
        except (KeyError, TypeError, ValueError):
            raise ProtocolError(f"{what}: a shm descriptor needs path, offset and nbytes: {descriptor}") from None
        if offset < 0 or nbytes < 0:
            raise ProtocolError(f"{what}: negative offset or nbytes in {descriptor}")
        if nbytes == 0:
            return np.zeros(0, dtype=np.uint8)
        base = self._map(path, offset + nbytes, what)
        return base[offset : offset + nbytes]

    def _map(self, path: str, need: int, what: str) -> np.ndarray:
        try:
            st = os.stat(path)
        except OSError as e:
            raise ProtocolError(
                f"{what}: cannot open the sidecar's shared-memory file {path} ({e.strerror}); does this process "
                "see the same RLPLANE_SHM_DIR as the sidecar?"
            ) from None
        key = (st.st_dev, st.st_ino)
        with self._lock:
            cached = self._maps.get(path)
            if cached is not None and cached[0] == key and cached[1] >= need:
                return cached[2]
            if st.st_size < need:
                raise ProtocolError(f"{what}: {path} holds {st.st_size} bytes, the descriptor needs {need}")
            flags = os.O_RDWR if self.writable else os.O_RDONLY
            fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
            try:
                access = mmap.ACCESS_WRITE if self.writable else mmap.ACCESS_READ
                mm = mmap.mmap(fd, st.st_size, access=access)
            finally:
                os.close(fd)
            arr = np.frombuffer(mm, dtype=np.uint8)
            self._maps[path] = (key, st.st_size, arr)
            return arr

    def array(self, descriptor: dict[str, Any], dtype: npt.DTypeLike, shape: Sequence[int], what: str = "a descriptor") -> np.ndarray:
        """The descriptor's bytes viewed as ``dtype`` and ``shape`` (zero-copy).

        Raises:
            ProtocolError: the descriptor's size does not match ``shape`` × itemsize.
        """
        dt = np.dtype(dtype)
        shape = tuple(int(s) for s in shape)
        need = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        raw = self.bytes(descriptor, what)
        if raw.nbytes != need:
            raise ProtocolError(f"{what}: the descriptor holds {raw.nbytes} bytes, {dt} {list(shape)} needs {need}")
        if need == 0:
            return np.zeros(shape, dtype=dt)
        return raw.view(dt).reshape(shape)

    def clear(self) -> None:
        """Forgets every cached mapping (they stay valid while arrays reference them)."""
        with self._lock:
            self._maps.clear()
