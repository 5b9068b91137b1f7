"""Where a run reads and writes: local paths and object-store URIs (gs://, s3://, az://, hf://) alike.

`pathlib.Path("gs://bucket/run")` collapses to `gs:/bucket/run`, a directory on the local disk:
a pod's workers would then each checkpoint to their own disk and could never resume. So every
path that may name a bucket goes through `as_path`, which returns an `etils.epath.Path`, the type
orbax itself takes (its array data goes through tensorstore's own GCS driver, the rest through
epath), and which keeps the URI whole. A URI whose scheme epath cannot serve, or whose client
package is missing, stops at `as_path` with one line instead of collapsing into a local path.

Object stores cannot append to an object, and tensorboardX writes local files only, so writers
that append stage their files in a local directory and copy them up (`Mirror`). Failures to
write a run directory show up at the start of a run (`check_writable`), with the fix, rather
than at the first checkpoint an hour in.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import tempfile
import uuid
from pathlib import Path

from etils import epath

from rljax.errors import ConfigError

# The schemes etils epath serves (through fsspec), the package each needs, and how to get it.
CLIENTS = {
    "gs": ("gcsfs", "pip install 'gcsfs' (the launch scripts install rljax[gcs])"),
    "s3": ("s3fs", "pip install s3fs"),
    "az": ("adlfs", "pip install adlfs"),
    "hf": ("huggingface_hub", "pip install huggingface_hub"),
}


def scheme(path: str | os.PathLike) -> str | None:
    """The URI scheme of `path` ("gs" for gs://bucket/run), None for a local path."""
    text = os.fspath(path)
    head, sep, _ = text.partition("://")
    return head if sep and head.isidentifier() else None


def is_remote(path: str | os.PathLike) -> bool:
    """True for an object-store URI, False for a path on this machine."""
    return scheme(path) is not None


@functools.cache
def _require_client(name: str) -> None:
    if name not in CLIENTS:
        raise ConfigError(f"{name}:// paths are not supported; use a local path or one of "
                          f"{', '.join(s + '://' for s in CLIENTS)}")
    package, install = CLIENTS[name]
    if importlib.util.find_spec(package) is None:
        raise ConfigError(f"{name}:// paths need {package}: {install}")


def as_path(path: str | os.PathLike) -> epath.Path:
    """`path` as an epath.Path: a URI stays a URI, a local path stays local (not made absolute)."""
    name = scheme(path)
    if name is not None:
        _require_client(name)
    return path if isinstance(path, epath.Path) else epath.Path(os.fspath(path))


def absolute(path: str | os.PathLike) -> str:
    """A URI unchanged; a local path made absolute (what orbax is given as a directory)."""
    text = os.fspath(as_path(path))
    return text if is_remote(text) else os.path.abspath(text)


def bucket_of(path: str | os.PathLike) -> str:
    """`gs://bucket` of `gs://bucket/run/x` (the scheme and the first path part)."""
    name, _, rest = os.fspath(path).partition("://")
    return f"{name}://{rest.split('/', 1)[0]}"


def copy_locally_hint(uri: str | os.PathLike) -> str:
    """How to copy a remote directory to this machine, for inputs that must be local."""
    uri = os.fspath(uri).rstrip("/")
    if scheme(uri) == "gs":
        return f"gcloud storage cp -r {uri} ."
    return f"copy {uri} to a local directory"


def check_writable(directory: str | os.PathLike, what: str = "output_dir") -> epath.Path:
    """Creates `directory`, writes and deletes a marker object in it, and returns it as a path.

    Any failure is a `ConfigError` naming the directory, what went wrong (a missing bucket is a
    404, a missing permission a 403) and the fix. Each process writes its own marker (a random
    name), since every process of a multi-host run writes its checkpoint shards here.
    """
    path = as_path(directory)
    marker = path / f".rljax-write-check-{uuid.uuid4().hex}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        marker.write_text("rljax checks that this directory is writable\n")
        marker.unlink()
    except Exception as err:  # noqa: BLE001 - only storage calls above: what the client raised is the cause
        raise ConfigError(write_failure(path, err, what)) from None
    return path


def write_failure(path: epath.Path | str, err: BaseException, what: str = "output_dir") -> str:
    """One line for a failed write to `path`: the cause, and the fix for the usual two."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    where = f"{what} {os.fspath(path)}"
    if not is_remote(path):
        return f"{where} is not writable ({type(err).__name__}: {text}); choose a directory you can write to"
    bucket = bucket_of(path)
    if isinstance(err, FileNotFoundError):
        fix = (f"create it (gcloud storage buckets create {bucket} --location=REGION)" if scheme(path) == "gs"
               else "create it")
        return f"{where}: bucket {bucket} does not exist (404); {fix} or point {what} at a bucket you own"
    if isinstance(err, PermissionError) or "Forbidden" in str(err) or "403" in text:
        fix = (f"gcloud storage buckets add-iam-policy-binding {bucket} --member=serviceAccount:SA_EMAIL "
               "--role=roles/storage.objectAdmin" if scheme(path) == "gs" else "grant write access to it")
        return (f"{where}: writing is forbidden (403); grant this machine's service account "
                f"roles/storage.objectAdmin on {bucket}: {fix}")
    return f"{where} cannot be written ({type(err).__name__}: {text}); check the URI and the credentials"


def _signature(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


class Mirror:
    """A local staging directory whose files are copied to a remote directory by `push`.

    For writers that need a local file (appending, tensorboardX): they write into `local`, and
    `push` uploads each file that changed since the last push, whole (object stores replace an
    object, never append to it). Remote files are never deleted, so a resumed run's older
    TensorBoard event files stay beside its new ones. `pull` first fetches files a previous run
    left, so a resumed run appends to them.
    """

    def __init__(self, remote: str | os.PathLike):
        self.remote = as_path(remote)
        self._staging = tempfile.TemporaryDirectory(prefix="rljax-staging-")  # removed when collected
        self.local = Path(self._staging.name)
        self._pushed: dict[str, tuple[int, int]] = {}

    def pull(self, *names: str) -> None:
        """Copies `remote/name` to `local/name` for each name that exists remotely."""
        for name in names:
            source = self.remote / name
            if source.exists():
                target = self.local / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(source.read_bytes())
                self._pushed[name] = _signature(target)

    def push(self) -> list[str]:
        """Uploads the files that changed since the last push; returns their relative names."""
        sent = []
        for file in sorted(p for p in self.local.rglob("*") if p.is_file()):
            name = file.relative_to(self.local).as_posix()
            signature = _signature(file)
            if self._pushed.get(name) != signature:
                (self.remote / name).write_bytes(file.read_bytes())
                self._pushed[name] = signature
                sent.append(name)
        return sent


def upload_tree(local: str | os.PathLike, remote: str | os.PathLike) -> None:
    """Copies every file under the local directory `local` to the same place under `remote`."""
    local, remote = Path(local), as_path(remote)
    for file in sorted(p for p in local.rglob("*") if p.is_file()):
        (remote / file.relative_to(local).as_posix()).write_bytes(file.read_bytes())

