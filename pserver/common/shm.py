"""Shared-memory segments: the tensor bytes of a session whose worker is on the server's host.

A co-located worker still pays for TCP and gRPC framing on every byte it
pushes or pulls; through shared memory the bytes are copied once on each
end (with the Adler-32 in the same pass) while gRPC keeps carrying the
control messages (pserver.server.shm_session, on a Session; protos/dtlab_ps.proto's
ShmRequest ... ShmPulled). The agreement:

    worker  ShmRequest(boot id of its host)
    server  same boot id and shared memory allowed: creates a segment,
            /dev/shm/dtlab-ps-<server pid>-<random>, a page holding a random
            token and then one shard's bytes; ShmOffer(path), else the reason
    worker  maps the path, echoes the token: ShmAttach(token)
    server  the token matches (so the worker mapped this very segment, not a
            namesake in another mount namespace): unlinks the path, ShmReady

Both ends unlink the path once mapped, so the memory goes with the last
process that maps it, whichever dies first and however (kill -9 included).
A segment is left in /dev/shm only if the server dies between creating and
unlinking it; the owner pid in its name lets the next server that starts
sweep it (`sweep`).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import mmap
import os
import secrets
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "dtlab-ps-"
TOKEN_BYTES = 16
DATA_OFFSET = mmap.PAGESIZE  # the shard's bytes start page-aligned after the token


def boot_id() -> str:
    """This host's boot id ("" where the kernel does not publish one)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _owner(name: str) -> int | None:
    """The pid in a segment's name, None for a name not of our making."""
    if not name.startswith(PREFIX):
        return None
    pid = name[len(PREFIX):].split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def sweep(directory: Path = SHM_DIR) -> list[str]:
    """Unlink the segments whose owner process is gone; their names."""
    removed = []
    with contextlib.suppress(OSError):
        for path in directory.iterdir():
            pid = _owner(path.name)
            if pid is not None and not _alive(pid):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    removed.append(path.name)
    if removed:
        log.info("swept %d orphaned shared-memory segments: %s", len(removed), ", ".join(removed))
    return removed


class Segment:
    """A mapped segment: TOKEN_BYTES of token at 0, `nbytes` of data at DATA_OFFSET."""

    def __init__(self, path: Path, mapping: mmap.mmap, nbytes: int):
        self.path, self.nbytes, self._map = path, nbytes, mapping
        self.size = len(mapping)

    @classmethod
    def create(cls, nbytes: int, directory: Path = SHM_DIR) -> Segment:
        """A new segment owned by this process, its token set; OSError if impossible."""
        path = directory / f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, DATA_OFFSET + nbytes)
            mapping = mmap.mmap(fd, DATA_OFFSET + nbytes)
        except OSError:
            path.unlink()
            raise
        finally:
            os.close(fd)
        mapping[:TOKEN_BYTES] = secrets.token_bytes(TOKEN_BYTES)
        return cls(path, mapping, nbytes)

    @classmethod
    def attach(cls, path: str, size: int, data_offset: int, nbytes: int,
               directory: Path = SHM_DIR) -> Segment:
        """Map the segment a server offered; ValueError or OSError if it is not one."""
        p = Path(path)
        if p.parent != directory or _owner(p.name) is None:
            raise ValueError(f"{path} is not a parameter-server segment in {directory}")
        if data_offset != DATA_OFFSET or size != DATA_OFFSET + nbytes:
            raise ValueError(f"{path}: {size} bytes with data at {data_offset}, expected "
                             f"{DATA_OFFSET + nbytes} with data at {DATA_OFFSET}")
        fd = os.open(p, os.O_RDWR | os.O_NOFOLLOW)
        try:
            if os.fstat(fd).st_size != size:
                raise ValueError(f"{path} holds {os.fstat(fd).st_size} bytes, not {size}")
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(p, mapping, nbytes)

    @property
    def token(self) -> bytes:
        return bytes(self._map[:TOKEN_BYTES])

    def holds(self, token: bytes) -> bool:
        """Whether `token` is this segment's (constant time)."""
        return hmac.compare_digest(token, self.token)

    def array(self, dtype, n: int) -> np.ndarray:
        """The data area as n elements of `dtype`."""
        return np.frombuffer(self._map, np.dtype(dtype), n, DATA_OFFSET)

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def close(self) -> None:
        """Unlink and unmap (the memory stays while an array of it is alive)."""
        self.unlink()
        with contextlib.suppress(BufferError):
            self._map.close()
