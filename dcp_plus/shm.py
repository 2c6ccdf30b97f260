"""Where dcp_plus keeps its shared memory (torch-free): the stagers' slabs, the memory tier's
snapshots and records, the rate cap's buckets.

``/dev/shm`` by default; the environment variable ``DCPP_SHM_DIR`` names another directory (a
tmpfs) for every process of the job: worker processes and restarted trainers inherit it, so
they find the same files. Read once, when dcp_plus is imported.

Why another directory: a tmpfs mounted with ``huge=within_size`` holds its files in 2 MiB
pages, where ``/dev/shm`` (``shmem_enabled`` ``never``, the kernel's default) has 4 KiB ones.
From 2 MiB pages, ``O_DIRECT`` writes reach the device's largest requests (virtio-blk and
NVMe cap a request's memory segments, and 4 KiB pages scatter them) and ``pread`` out of a
snapshot copies at memcpy speed (the kernel looks up one page per 2 MiB, not per 4 KiB):
``docs/howto-local.md`` has the mount line and the figures.
"""

from __future__ import annotations

import os

ENV = "DCPP_SHM_DIR"
DEFAULT = "/dev/shm"


def _shm_dir() -> str:
    d = os.environ.get(ENV) or DEFAULT
    if not os.path.isdir(d):
        raise NotADirectoryError(f"{ENV}={d!r}: not a directory; dcp_plus keeps its shared "
                                 f"memory there (unset it for {DEFAULT})")
    return d


SHM_DIR = _shm_dir()

