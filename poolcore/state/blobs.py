"""Bytes that travel between the facade and a worker host through Redis: an archive uploaded
into a run, one downloaded from it, a task folder sent by a client.

  blob:<id>     string (raw bytes), with a TTL: the caller names the id (a job id, a digest)

The hosts share no file system with the facade or the client, and Redis is the one store both
sides reach, so bytes go through it. They are bounded by the callers' size limits and always
expire. The state store's client decodes replies as text, so blobs have a client of their own
on the same Redis that does not.
"""

from __future__ import annotations

import redis

from poolcore.state import keys
from poolcore.state.connection import binary_client


class BlobsState:
    _r: redis.Redis
    _binary: redis.Redis | None = None

    @property
    def _bytes(self) -> redis.Redis:
        if self._binary is None:
            self._binary = binary_client(self._r)
        return self._binary

    def blob_held_by(self, blob_id: str, holder: str, ttl: float) -> bool:
        """Whether the tenant uploaded the blob; its holders live on with the blob (touch_blob)."""
        pipe = self._r.pipeline()
        pipe.sismember(keys.blob_holders_key(blob_id), holder)
        pipe.pexpire(keys.blob_holders_key(blob_id), int(ttl * 1000))
        return bool(pipe.execute()[0])

    def put_blob(self, blob_id: str, data: bytes, ttl: float) -> None:
        self._bytes.set(keys.blob_key(blob_id), data, px=int(ttl * 1000))

    def put_blob_once(self, blob_id: str, data: bytes, ttl: float) -> bool:
        """Store unless the id is there already (content-addressed ids); True when stored. An
        existing blob's lifetime starts again either way."""
        key = keys.blob_key(blob_id)
        if self._bytes.set(key, data, px=int(ttl * 1000), nx=True):
            return True
        self._bytes.pexpire(key, int(ttl * 1000))
        return False

    def get_blob(self, blob_id: str) -> bytes | None:
        return self._bytes.get(keys.blob_key(blob_id))

    def blob_size(self, blob_id: str) -> int | None:
        """The blob's length in bytes; None when there is none."""
        key = keys.blob_key(blob_id)
        pipe = self._bytes.pipeline()
        pipe.exists(key).strlen(key)
        exists, size = pipe.execute()
        return size if exists else None

    def touch_blob(self, blob_id: str, ttl: float) -> bool:
        """Start the blob's lifetime again; False when it is gone."""
        return bool(self._bytes.pexpire(keys.blob_key(blob_id), int(ttl * 1000)))

    def drop_blob(self, blob_id: str) -> None:
        self._bytes.delete(keys.blob_key(blob_id))
