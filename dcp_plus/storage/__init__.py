"""Byte stores under the writers and readers: local files, NFS, fsspec/S3, retries."""
