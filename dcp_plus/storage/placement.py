"""Objects of one checkpoint placed under key prefixes of its bucket.

A store opened on ``s3://bucket/run/step_100`` keeps a placed object ``name`` with prefix
``p`` at ``s3://bucket/p/run/step_100/name`` (:func:`~dcp_plus.format.key_prefix.insert_prefix`);
every other object stays under the checkpoint's own key.
"""

from __future__ import annotations

from collections.abc import Mapping

from dcp_plus.format.key_prefix import insert_prefix
from dcp_plus.storage.urls import prefixable


class Placed:
    """What a store with key prefixes adds: :meth:`place`, and locations that follow it."""

    url: str
    _placed: dict[str, str]
    _folders: dict[str, str]

    def place(self, files: Mapping[str, str]) -> None:
        """From now on, object ``name`` of ``files`` lies under key prefix ``files[name]``.

        Raises:
            ValueError: an unsafe prefix, a URL with no key below its bucket, or a store
                whose URL takes no key prefixes (a file system's: a record naming prefixes
                there would point outside the checkpoint's folder).
        """
        if files and not prefixable(self.url):
            raise ValueError(f"{self.url} is no object-store URL, so its objects have no key "
                             "prefixes")
        if not hasattr(self, "_placed"):
            self._placed, self._folders = {}, {}
        for prefix in set(files.values()) - set(self._folders):
            self._folders[prefix] = insert_prefix(self.url, prefix)
        self._placed.update(files)

    def prefix_of(self, name: str) -> str | None:
        """The key prefix of object ``name``; None: under the checkpoint's own key."""
        return getattr(self, "_placed", {}).get(name)

    def folder_url(self, name: str) -> str:
        """The URL of the folder that holds object ``name``."""
        prefix = self.prefix_of(name)
        return self.url if prefix is None else self._folders[prefix]

    def location(self, name: str) -> str:
        return f"{self.folder_url(name)}/{name}"
