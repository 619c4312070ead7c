"""Where a store lives: a local path or an object-store URL, behind zarr's store abstraction.

Zarr arrays go through the zarr `Store` directly. The few raw keys of the format (commit markers,
the manifest, run records, target files) go through `KV`, a small synchronous wrapper over the same
store with the one primitive the format depends on: create-once writes (`put_if_absent`).

- local path / file://      zarr LocalStore (atomic writes: temp file + rename; create-once via link)
- s3://bucket/prefix        obstore S3Store (credentials and endpoint from the usual AWS_* variables)
- gs://bucket/prefix        obstore GCSStore
- memory://name             obstore MemoryStore, one per name per process (tests, dry runs)

obstore is an optional extra; asking for an object-store URL without it fails with one clear line.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from dflash_pipeline.errors import StoreError

_MEMORY_STORES: dict[str, Any] = {}
_MEMORY_LOCK = threading.Lock()
OBJECT_SCHEMES = ("s3://", "gs://", "gcs://", "memory://")


def is_object_url(url: str) -> bool:
    return url.startswith(OBJECT_SCHEMES)


def _local_path(url: str) -> Path:
    return Path(url[len("file://"):] if url.startswith("file://") else url)


def _obstore_module():
    try:
        import obstore  # noqa: F401
        import obstore.store as obs_store
    except ImportError:
        raise StoreError("object-store URLs need obstore: pip install 'dflash-pipeline[object]'") from None
    return obs_store


def _object_store(url: str):
    obs_store = _obstore_module()
    scheme, rest = url.split("://", 1)
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise StoreError(f"{url}: no bucket/name in the URL")
    if scheme == "memory":
        with _MEMORY_LOCK:
            return _MEMORY_STORES.setdefault(rest, obs_store.MemoryStore())
    if scheme == "s3":
        kwargs: dict[str, Any] = {}
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            kwargs["endpoint"] = endpoint
            if endpoint.startswith("http://"):
                kwargs["client_options"] = {"allow_http": True}
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            kwargs["region"] = region
        # The constructor also reads the AWS_* variables itself (credentials, session token).
        return obs_store.S3Store(bucket, prefix=prefix or None, **kwargs)
    return obs_store.GCSStore(bucket, prefix=prefix or None)


def open_zarr_store(url: str, *, read_only: bool):
    """The zarr Store for `url`. A local store opened read-only must already exist."""
    import zarr.storage

    if is_object_url(url):
        return zarr.storage.ObjectStore(_object_store(url), read_only=read_only)
    path = _local_path(url)
    if read_only and not path.is_dir():
        raise StoreError(f"{url}: no such store (not a directory)")
    return zarr.storage.LocalStore(path, read_only=read_only)


class KV:
    """Synchronous raw-key access to a zarr Store (safe from several threads)."""

    def __init__(self, zstore):
        self.zstore = zstore

    @staticmethod
    def _sync(coro):
        from zarr.core.sync import sync

        return sync(coro)

    def get(self, key: str) -> bytes | None:
        from zarr.core.buffer import default_buffer_prototype

        buf = self._sync(self.zstore.get(key, prototype=default_buffer_prototype()))
        return None if buf is None else buf.to_bytes()

    def put(self, key: str, value) -> None:
        """`value`: bytes or any contiguous uint8 buffer (numpy array)."""
        from zarr.core.buffer import default_buffer_prototype

        self._sync(self.zstore.set(key, default_buffer_prototype().buffer.from_bytes(value)))

    def put_parts(self, key: str, parts: list) -> None:
        """Write the concatenation of `parts` (bytes-like buffers) under `key`. A local store writes
        them one after another into a temporary file that is then renamed (atomic, no joined copy);
        other stores get one joined buffer."""
        import zarr.storage

        if isinstance(self.zstore, zarr.storage.LocalStore):
            import uuid

            path = Path(self.zstore.root) / key
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.partial")
            try:
                with open(tmp, "wb") as f:
                    for p in parts:
                        f.write(p)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
            return
        import numpy as np

        total = sum(memoryview(p).nbytes for p in parts)
        out = np.empty(total, dtype=np.uint8)
        pos = 0
        for p in parts:
            b = np.frombuffer(p, dtype=np.uint8)
            out[pos:pos + len(b)] = b
            pos += len(b)
        self.put(key, out)

    def put_if_absent(self, key: str, value: bytes) -> bool:
        """Create-once write. True if this call created the key with this value."""
        from zarr.core.buffer import default_buffer_prototype

        self._sync(self.zstore.set_if_not_exists(key, default_buffer_prototype().buffer.from_bytes(value)))
        return self.get(key) == value

    def exists(self, key: str) -> bool:
        return self._sync(self.zstore.exists(key))

    def list_dir(self, prefix: str) -> list[str]:
        """Immediate children names of `prefix` (no trailing slash)."""
        async def collect():
            return [k.rstrip("/") async for k in self.zstore.list_dir(prefix.rstrip("/") + "/")]

        return sorted(set(self._sync(collect())))

    def list_prefix(self, prefix: str) -> list[str]:
        async def collect():
            return [k async for k in self.zstore.list_prefix(prefix)]

        return self._sync(collect())

    def delete_prefix(self, prefix: str) -> None:
        self._sync(self.zstore.delete_dir(prefix.rstrip("/")))

    def delete(self, key: str) -> None:
        self._sync(self.zstore.delete(key))

    def size_prefix(self, prefix: str) -> int:
        return int(self._sync(self.zstore.getsize_prefix(prefix.rstrip("/"))))
