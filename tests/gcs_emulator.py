"""A local Google Cloud Storage for tests: `gcp-storage-emulator` serves GCS's JSON API on
localhost, and both clients rljax uses for `gs://` talk to it through their documented
emulator variables:

- etils `epath` (metrics, data, orbax's metadata files) goes through gcsfs, which reads
  `STORAGE_EMULATOR_HOST`;
- tensorstore (orbax's array data) reads `TENSORSTORE_GCS_HTTP_URL`, and
  `GOOGLE_AUTH_TOKEN_FOR_TESTING` stands in for credentials.

So a `gs://bucket/...` path in a test takes the same code path as on a TPU VM, down to the HTTP
requests; only the server differs. Objects land under `<root>/.cloudstorage/<bucket>/...`, so a
test can also look at what was written. The server handles one request at a time (HTTP/1.0, no
keep-alive), so concurrent writers (two worker processes) are serialised rather than racing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

BUCKET = "rljax-test-bucket"


@dataclasses.dataclass(frozen=True)
class Emulator:
    url: str          # http://127.0.0.1:PORT
    root: Path        # the emulator's data directory
    bucket: str       # a bucket that exists

    @property
    def env(self) -> dict[str, str]:
        """The variables a process (this one or a child) needs to reach this emulator for gs://."""
        # gcsfs's default class first asks the Storage Control API (gRPC, which the emulator lacks)
        # for each bucket's layout; the answer for an ordinary bucket is the plain client, so the
        # plain client is used here (read when gcsfs is imported).
        return {"STORAGE_EMULATOR_HOST": self.url, "TENSORSTORE_GCS_HTTP_URL": self.url,
                "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator", "GOOGLE_CLOUD_PROJECT": "rljax-test",
                "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}

    def uri(self, *parts: str) -> str:
        return "/".join((f"gs://{self.bucket}", *parts))

    def local(self, uri: str) -> Path:
        """Where the emulator keeps the object (or prefix) `gs://bucket/key`."""
        assert uri.startswith("gs://"), uri
        return self.root / ".cloudstorage" / uri[len("gs://"):]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(root: Path) -> Iterator[Emulator]:
    """Serves an emulator from a thread of this process, with `BUCKET` created, and points this
    process's gs:// clients at it for the duration."""
    from gcp_storage_emulator.server import create_server

    logging.getLogger("gcp_storage_emulator").setLevel(logging.ERROR)
    port = _free_port()
    server = create_server("127.0.0.1", port, in_memory=False, default_bucket=BUCKET, data_dir=str(root))
    server.start()
    _quiet_disconnects(server._api._httpd)
    emulator = Emulator(url=f"http://127.0.0.1:{port}", root=Path(root), bucket=BUCKET)
    saved = {k: os.environ.get(k) for k in emulator.env}
    os.environ.update(emulator.env)
    _forget_clients()
    try:
        yield emulator
    finally:
        _forget_clients()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()


def _forget_clients() -> None:
    """fsspec caches filesystem instances, and a cached gcsfs keeps the endpoint it was made with;
    etils epath keeps its own cache of the instance it got from fsspec."""
    with contextlib.suppress(ImportError):
        import gcsfs

        gcsfs.GCSFileSystem.clear_instance_cache()
    with contextlib.suppress(ImportError):
        from etils.epath import backend

        backend.fsspec_backend._get_filesystem.cache_clear()


def _quiet_disconnects(httpd) -> None:
    """gcsfs may close a connection before reading a whole reply; the server would print each
    such BrokenPipeError as a traceback. Other errors are still printed."""
    default = httpd.handle_error

    def handle_error(request, client_address):
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            default(request, client_address)

    httpd.handle_error = handle_error
