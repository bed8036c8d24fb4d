"""Tensors whose values live in files, mapped into host memory only while touched.

[Note: the disk tier's files are a cache]
Each tensor the disk tier holds gets a file of its own under the user's
directory, created with a fresh random name and unlinked at once: the mapping
keeps the inode alive, the kernel writes the values to the file system and reads
them back when they are touched, and this process holds the only reference. So
no run ever reads another run's files, and a run that is killed leaves nothing
behind (the kernel frees an unlinked file with its last mapping; at most a file
caught in the instant between its creation and its unlink remains, named
``shardengine-disk-*``, which no run opens). The state in the files is always
made fresh in this process -- from the model, the optimizer's first step, or a
checkpoint -- and checkpoints read it through the mapping like any tensor: they
stay the source of truth.

Host memory: ``release`` writes a tensor's dirty pages to its file and drops them
from this process's resident set; ``prefetch`` maps them in again ahead of use.
Pages the kernel keeps in its page cache afterwards are clean and reclaimable
(the kernel drops them under memory pressure, as for any file it read). A tmpfs
directory (``/dev/shm``, often ``/tmp``) is memory, not disk: use a disk-backed one.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
import weakref

import torch

from ..errors import ConfigError

_MADV_WILLNEED = 3
_MADV_DONTNEED = 4
_MADV_POPULATE_READ = 22  # Linux >= 5.14; older kernels get the plain read-ahead hint
_MS_SYNC = 4
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def check_directory(path: str) -> str:
    """``path`` as an absolute directory this process can create files in, or a ConfigError."""
    directory = os.path.abspath(path)
    if not os.path.isdir(directory):
        raise ConfigError(f"offload_path {path!r} is not an existing directory: create it first "
                          "(on a disk-backed file system, e.g. a local NVMe drive)")
    try:
        handle, probe = tempfile.mkstemp(prefix="shardengine-disk-probe-", dir=directory)
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        raise ConfigError(f"offload_path {path!r} is not writable by this process ({error}); "
                          "pass a directory it may create files in") from error
    return directory


class FileTensors:
    """Makes file-backed copies of tensors in one directory and moves their pages in and out."""

    def __init__(self, directory: str):
        self.directory = check_directory(directory)
        self._held: dict[int, int] = {}  # data_ptr of each file-backed storage -> its bytes

    def copy_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous CPU copy of ``tensor`` whose storage is a file of its own (see the Note)."""
        handle, name = tempfile.mkstemp(prefix="shardengine-disk-", dir=self.directory)
        try:
            os.close(handle)
            numel = max(tensor.numel(), 1)  # an empty mapping cannot exist
            mapped = torch.from_file(name, shared=True, size=numel, dtype=tensor.dtype)
        finally:
            os.unlink(name)
        mapped = mapped[:tensor.numel()].view(tensor.shape)
        mapped.copy_(tensor.detach())
        address = mapped.untyped_storage().data_ptr()
        self._held[address] = mapped.untyped_storage().nbytes()
        # Forget it with the tensor, before the address can be reused by an ordinary allocation.
        weakref.finalize(mapped, self._held.pop, address, None)
        return mapped

    def holds(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._held

    def nbytes(self, tensor: torch.Tensor) -> int:
        """The values' bytes (an empty tensor's file holds one element: a mapping cannot be empty)."""
        return tensor.numel() * tensor.element_size() if self.holds(tensor) else 0

    @staticmethod
    def prefetch(tensor: torch.Tensor) -> None:
        """Map the values in now, ahead of their use (run on the disk tier's worker thread)."""
        address, length = _span(tensor)
        if _libc.madvise(address, length, _MADV_POPULATE_READ) != 0:
            _libc.madvise(address, length, _MADV_WILLNEED)

    @staticmethod
    def release(tensor: torch.Tensor) -> None:
        """Write the values to their file and drop them from this process's resident memory;
        the next touch reads them back (run on the worker thread)."""
        address, length = _span(tensor)
        if _libc.msync(address, length, _MS_SYNC) != 0 or _libc.madvise(address, length, _MADV_DONTNEED) != 0:
            raise OSError(ctypes.get_errno(), f"writing the disk tier's file back failed: "
                                              f"{os.strerror(ctypes.get_errno())}")


def return_freed_memory() -> None:
    """Hand memory freed by ``free()`` back to the system (glibc keeps freed heap blocks for reuse,
    so the in-memory state a first step made and the disk tier then moved into files would stay
    resident); a no-op where the C library has no ``malloc_trim``."""
    trim = getattr(_libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The page-aligned address range of a file-backed tensor's whole storage (a mapping starts
    on a page boundary)."""
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()
