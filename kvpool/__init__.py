"""KV pools in CPU memory: the one place that makes them, and names, maps and cleans up after the
shared ones.

A pool that another process must reach (a tensor-parallel rank's pool read by rank 0, a decode
worker's pool written in place by an shm sender) lives in a file, usually under /dev/shm, mapped
with torch.from_file. The engine's model runner creates its pool here, and kvtransfer's shm
backend creates and maps pools through the same functions, so the file's mode (0600: its owner's
processes only), its zero fill and its size check are the same everywhere. A new pool's memory is
reserved when its file is made, so a full filesystem fails there with one line naming the bytes
needed and free (PoolSpaceError), not later as a SIGBUS in whichever process touches a page
first. An engine's files are named after its process (new_pool_paths), so the files of a process
killed before it could unlink them are found and removed later (remove_stale_pool_files).

A pool no other process maps can be put on transparent huge pages (`new_private_pool`: advised
before its zero fill first touches it; Linux backs it with 2 MiB pages where THP is "madvise",
most distributions' default, or "always"). A decode worker on the nixl backend does
(EngineConfig.kv_cache_huge_pages): a NIXL (UCX) sender on the same host writes into its pool
by the kernel's cross-memory copy, which pins the pool's pages call by call, and into 2 MiB pages
that ran 1.2-1.4x faster (BENCHMARKS.md, the nixl backend). Elsewhere it bought nothing measured
(decode steps at 2k-token contexts), and a fresh process's first fill of a 1 GiB pool took
190-650 ms on huge pages against about 300 on small ones, so other pools keep small pages. Pool
files do too: tmpfs uses huge pages only where its mount or shmem_enabled says so.

A package of its own, importing only torch and the standard library, so that the engine and
kvtransfer can both use it and still never import each other (tests/unit/test_boundaries.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import math
import os
import sys
import uuid

import torch

KV_FILE_PREFIX = "pdserve-kv-"  # every pool file's name starts with it
HUGE_PAGE = 2 << 20  # a transparent huge page on x86-64 and most arm64 kernels
_MADV_HUGEPAGE = 14  # asm-generic/mman-common.h
_MADV_DONTNEED, _MADV_REMOVE, _MADV_POPULATE_WRITE = 4, 9, 23  # (the same header)
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _shape_and_bytes(shape, dtype: torch.dtype) -> tuple[tuple[int, ...], int, int]:
    shape = tuple(int(n) for n in shape)
    numel = math.prod(shape)
    return shape, numel, numel * torch.empty((), dtype=dtype).element_size()


class PoolSpaceError(OSError):
    """The filesystem of a new pool file cannot hold the pool; the message is one line for the
    operator: the path, the bytes needed, the bytes free, and what to change."""


def _free_bytes(fd: int) -> int | None:
    try:
        st = os.fstatvfs(fd)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _no_space(path: str, needed: int, free: int | None) -> PoolSpaceError:
    directory = os.path.dirname(path) or "."
    has = "too little" if free is None else f"{free} bytes ({free / 2**20:.1f} MiB)"
    return PoolSpaceError(
        f"the shared KV pool {path} needs {needed} bytes ({needed / 2**20:.1f} MiB) but "
        f"{directory} has {has} free: lower kv_cache_memory, make {directory} larger (docker "
        f"run --shm-size, or mount -o remount,size=...), or use the grpc or torch KV backend "
        f"instead of shm"
    )


def _reserve(fd: int, path: str, nbytes: int) -> None:
    """Give the file its nbytes for real (posix_fallocate), or raise PoolSpaceError. A sparse file
    would take its pages on first touch, and a full tmpfs answers that touch with SIGBUS."""
    free = _free_bytes(fd)
    if free is not None and free < nbytes:
        raise _no_space(path, nbytes, free)
    fallocate = getattr(os, "posix_fallocate", None)
    try:
        if fallocate is None:
            raise OSError(errno.EOPNOTSUPP, "no posix_fallocate")
        fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise _no_space(path, nbytes, _free_bytes(fd)) from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, nbytes)  # a filesystem that cannot allocate ahead: sparse, as before


def new_private_pool(shape, dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor for a KV pool that only this process reads and writes, its
    memory advised for transparent huge pages (`advise_huge_pages`) before the fill touches it."""
    shape, numel, _ = _shape_and_bytes(shape, dtype)
    if numel <= 0:
        raise ValueError(f"a KV pool needs a non-empty shape, got {shape}")
    pool = torch.empty(shape, dtype=dtype)
    advise_huge_pages(pool)
    return pool.zero_()


def _madvise():
    """libc's madvise, or None where there is none to call."""
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """madvise(MADV_HUGEPAGE) over the whole 2 MiB pages inside a contiguous CPU tensor's bytes:
    pages first touched after it are huge where the kernel's THP setting allows (the edges, less
    than 2 MiB each, keep small pages). False where nothing was advised: not Linux, a tensor
    smaller than a huge page, or the call refused (a kernel without THP)."""
    if not sys.platform.startswith("linux") or tensor.device.type != "cpu":
        return False
    if not tensor.is_contiguous():
        return False
    begin = tensor.data_ptr()
    start = -(-begin // HUGE_PAGE) * HUGE_PAGE
    end = (begin + tensor.numel() * tensor.element_size()) // HUGE_PAGE * HUGE_PAGE
    if end <= start:
        return False
    madvise = _madvise()
    return madvise is not None and madvise(start, end - start, _MADV_HUGEPAGE) == 0


def _pages(tensor: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """A contiguous CPU tensor's bytes as uint8, and the whole pages inside them: (bytes, offset
    of the first whole page, offset past the last)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("a pool's pages: a contiguous CPU tensor only")
    raw = tensor.view(-1).view(torch.uint8)
    begin = tensor.data_ptr()
    start = -(-begin // PAGE) * PAGE - begin
    end = (begin + raw.numel()) // PAGE * PAGE - begin
    return raw, start, max(start, end)


def release_pool(pool: torch.Tensor, shared: bool) -> int:
    """Gives a pool's memory back to the system and keeps the tensor, and every mapping of it in
    this process or another, valid: afterwards its bytes read as zeros, as a new pool's. The whole
    pages are dropped (`shared`: a pool file's, MADV_REMOVE, which frees the file's blocks, so
    a tmpfs gets its space back; else MADV_DONTNEED), the partial pages at its edges zeroed.
    Returns the bytes dropped (0 where the kernel refused: then every byte is zeroed instead).
    `refill_pool` takes the memory again."""
    raw, start, end = _pages(pool)
    madvise = _madvise() if sys.platform.startswith("linux") else None
    advice = _MADV_REMOVE if shared else _MADV_DONTNEED
    if madvise is None or end == start or madvise(pool.data_ptr() + start, end - start, advice):
        raw.zero_()
        return 0
    raw[:start].zero_()
    raw[end:].zero_()
    return end - start


def refill_pool(pool: torch.Tensor, shared: bool) -> None:
    """Takes a released pool's memory again, as `create_pool_file` or a new private pool took it
    at the start: every page faulted in, zeroed, now rather than on a request's first write. For a
    pool file, MADV_POPULATE_WRITE, which fails with an error where a full tmpfs cannot give the
    pages back (PoolSpaceError; a plain write would be killed by SIGBUS); without that advice
    (kernels before 5.14), /dev/shm's free space (where pool files live by default) is checked
    first."""
    raw, start, end = _pages(pool)
    madvise = _madvise() if sys.platform.startswith("linux") else None
    if madvise is not None and end > start:
        if madvise(pool.data_ptr() + start, end - start, _MADV_POPULATE_WRITE) == 0:
            return
        err = ctypes.get_errno()
        if err in (errno.ENOMEM, errno.EFAULT, errno.ENOSPC):
            raise PoolSpaceError(
                f"a KV pool of {raw.numel()} bytes could not take its memory back "
                f"({os.strerror(err)}): free memory (or /dev/shm space) and wake it again"
            )
    if shared:
        st = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
        if st is not None and st.f_bavail * st.f_frsize < raw.numel():
            raise PoolSpaceError(
                f"a KV pool of {raw.numel()} bytes could not take its memory back: /dev/shm "
                f"has {st.f_bavail * st.f_frsize} bytes free; free some and wake it again"
            )
    raw.zero_()


def create_pool_file(path: str, shape, dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor backed by a new file at `path` (an existing file is truncated),
    which other processes can map with `map_pool_file`. The file outlives the tensor: unlink it
    when the pool is retired (the mapping stays valid after the unlink for as long as it lives).

    The file's bytes are allocated here (posix_fallocate): on tmpfs (/dev/shm) that commits the
    pool's memory up front, zeroed pages and all, which is the point: a filesystem that cannot
    hold the pool raises PoolSpaceError now, and the file is removed."""
    shape, numel, nbytes = _shape_and_bytes(shape, dtype)
    if numel <= 0:
        raise ValueError(f"a shared KV pool needs a non-empty shape, got {shape}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        _reserve(fd, path, nbytes)  # a fresh (truncated) file reads as zeros
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    finally:
        os.close(fd)
    return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)


def map_pool_file(path: str, shape, dtype: torch.dtype) -> torch.Tensor:
    """A pool made by `create_pool_file` (in this process or another), mapped shared. Raises
    OSError when the file cannot be opened, ValueError when its size does not fit shape and dtype."""
    shape, numel, nbytes = _shape_and_bytes(shape, dtype)
    size = os.path.getsize(path)
    if size != nbytes:
        raise ValueError(
            f"the shared KV pool {path} holds {size} bytes, but shape {shape} in "
            f"{str(dtype).removeprefix('torch.')} needs {nbytes}"
        )
    return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host runs (another user's counts as running): how the
    sweeps of files and folders named after the process that made them (pool files here, the
    disk tier's folders) tell an orphan from a live one. The launcher's sweep of its secret
    folders has a copy of its own (deploy/secret_files.py: it never imports torch)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, and not ours to judge
        return True
    return True


def remove_stale_pool_files(directory: str) -> None:
    """Unlink pool files left by processes that are gone (killed before they could unlink them):
    under /dev/shm they would hold memory until reboot."""
    for path in glob.glob(os.path.join(directory, f"{KV_FILE_PREFIX}*")):
        pid = os.path.basename(path)[len(KV_FILE_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit():
            continue
        if not pid_alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def new_pool_paths(directory: str, num_ranks: int) -> list[str]:
    """Fresh names for one engine's pool files, one per tensor-parallel rank, under `directory`
    (named after this process, so remove_stale_pool_files can tell when they are orphaned);
    orphaned files found there are removed first."""
    remove_stale_pool_files(directory)
    prefix = os.path.join(directory, f"{KV_FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    return [f"{prefix}-rank{r}" for r in range(num_ranks)]
