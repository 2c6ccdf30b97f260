"""Byte stores under the writers and readers: local files, NFS, fsspec/S3, retries.

- ``objectio``: the :class:`~dcp_plus.storage.objectio.ObjectStore` interface and
  ``open_store`` (an fsspec URL to its store); ``fsspec_store`` and ``s3io``: those stores.
- ``ranged``: transfer settings, multipart arithmetic, coalesced ranged-read plans.
- ``dirstore`` and ``nfsio``: a directory as an object store (mounted, or ``nfs://``).
- ``fileio``: durable local-file primitives.
- ``retry``: the one retry loop; ``http_errors`` and ``nfs_errors``: which errors it retries.
- ``fanout``: parallel calls that raise the first error; ``urls``: ``is_url``.

This ``__init__`` imports nothing: writer worker processes use these modules without torch.
"""
