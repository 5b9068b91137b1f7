"""Remote storage: gs:// run directories, checkpoints, metrics and data, against a local GCS.

`tests/gcs_emulator.py` serves GCS's JSON API on localhost; gcsfs (epath's client for gs://) and
tensorstore (orbax's array data) reach it through their emulator variables, so a `gs://` path
here takes the same code path as on a TPU VM. Objects land in the emulator's data directory,
where the tests look for them. Every test runs from an empty working directory, so a URI that
collapsed into a local path (`gs:/bucket/...`) would show up there.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from gcs_emulator import running
from test_metrics_writer import tensorboard_texts

from rljax import storage
from rljax.checkpoint import Checkpointer, export_hf, load_params
from rljax.data.sources import from_jsonl, from_parquet
from rljax.errors import CheckpointError, ConfigError, DataError
from rljax.models import init_params, load_hf, preset
from rljax.train.config import load_config
from rljax.train.loop import train
from rljax.train.metrics_writer import MetricsWriter, SampleRecord


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    with running(tmp_path_factory.mktemp("gcs")) as emulator:
        yield emulator


@pytest.fixture(autouse=True)
def empty_cwd(tmp_path, monkeypatch):
    """Runs each test in an empty directory; asserts afterwards that nothing named `gs:` appeared."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    yield
    assert not (cwd / "gs:").exists(), "a gs:// URI collapsed into a local path"


def _bits_equal(a, b) -> None:
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b):
        assert np.asarray(x).dtype == np.asarray(y).dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_checkpoint_round_trips_through_gs_and_exports_there(gcs):
    """A Checkpointer on a gs:// URI keeps the URI, saves into the bucket, and a second one restores
    it bitwise (params, typed key, data state, config); `load_params` reads the model back from
    the URI, and `export_hf` to a gs:// URI uploads an HF directory that `load_hf` reads bitwise.

    Catches: `os.path.abspath` (or `pathlib.Path`) on the URI, which turns it into a local
    directory `<cwd>/gs:/...` (the old Checkpointer), an export that writes locally only, and a
    restore that reads anything but what was saved."""
    cfg = preset("qwen2-test")
    params = jax.jit(lambda: init_params(cfg, jax.random.key(0)))()
    key = jax.random.key(7)
    uri = gcs.uri("ckpt-run", "checkpoints")
    with Checkpointer(uri) as ckpt:
        assert ckpt.directory == uri
        ckpt.save(3, params=params, rng=key, data_state={"next_index": 3}, config={"seed": 0}, model_config=cfg)
    assert (gcs.local(uri) / "3" / "params").is_dir()
    with Checkpointer(uri, read_only=True) as ckpt:
        restored = ckpt.restore(params=None)  # the arrays are read back by load_params below
    assert np.array_equal(jax.random.key_data(restored.rng), jax.random.key_data(key))
    assert (restored.step, restored.data_state, restored.config) == (3, {"next_index": 3}, {"seed": 0})

    cfg2, params2 = load_params(uri)  # a Checkpointer restore into the saved model's template
    assert cfg2 == cfg
    _bits_equal(params2, params)
    hf_uri = gcs.uri("exported")
    export_hf(uri, hf_uri)
    assert sorted(p.name for p in gcs.local(hf_uri).iterdir()) == ["config.json", "model.safetensors"]
    _, params3 = load_hf(gcs.local(hf_uri))
    _bits_equal(params3, params)


def _rows(path: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, path.read_text().splitlines())]


def test_metrics_reach_the_bucket_on_each_write_and_a_resume_appends(gcs):
    """With a gs:// out_dir, each write is in the bucket before close (JSONL rows and the
    TensorBoard events); a resumed writer pulls the JSONL back, drops rows past the restored
    step and appends, so the bucket holds rows from both writers; a fresh writer empties it.

    Catches: appending to the object directly (gcsfs turns mode "a" into an overwrite, so the
    first run's rows vanish), a resume that does not pull, uploading only at close (a killed
    run leaves no metrics), and TensorBoard events that never leave the staging directory."""
    uri = gcs.uri("metrics-run")
    remote = gcs.local(uri)
    first = MetricsWriter(uri, tensorboard=True)
    first.write(1, {"loss": 0.5})
    first.write_samples(1, [SampleRecord(prompt="1+1=", completion="2", reward=1.0)])
    assert _rows(remote / "metrics.jsonl") == [(1, 0.5)]
    assert len(list((remote / "tensorboard").glob("events.out.tfevents.*"))) == 1
    first.write(2, {"loss": 0.4})
    first.close()  # tensorboardX writes events from a thread: complete in the bucket once closed
    assert [(step, tag.split("/")[0]) for step, tag, _ in tensorboard_texts(remote / "tensorboard")] == \
        [(1, "samples")]

    resumed = MetricsWriter(uri, tensorboard=True, resume=True)
    resumed.truncate_after(1)  # resumed from the checkpoint of step 1
    resumed.write(2, {"loss": 0.3})
    assert _rows(remote / "metrics.jsonl") == [(1, 0.5), (2, 0.3)]
    assert [(r["step"], r["loss"]) for r in resumed.read()] == [(1, 0.5), (2, 0.3)]
    assert [r["step"] for r in map(json.loads, (remote / "samples.jsonl").read_text().splitlines())] == [1]
    resumed.close()
    assert len(list((remote / "tensorboard").glob("events.out.tfevents.*"))) == 2  # the first run's is kept

    MetricsWriter(uri, tensorboard=False).close()
    assert not (remote / "metrics.jsonl").exists()


def test_jsonl_and_parquet_sources_read_from_gs(gcs):
    """JSONL and Parquet task files are read from gs:// URIs, rows numbered by the file's stem;
    a missing object is the one-line DataError.

    Catches: `os.path.isfile` / `open` on the URI (the old sources: "does not exist" for a file
    that is in the bucket)."""
    rows = [{"question": "1+1", "answer": "2"}, {"question": "2+2", "answer": "4"}]
    jsonl = storage.as_path(gcs.uri("data", "train.jsonl"))
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")
    src = from_jsonl(str(jsonl))
    assert [(e.id, e.question, e.answer) for e in src.examples] == [("train:1", "1+1", "2"), ("train:2", "2+2", "4")]
    assert src.num_skipped == 1

    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buffer)
    parquet = storage.as_path(gcs.uri("data", "eval.parquet"))
    parquet.write_bytes(buffer.getvalue())
    assert [e.answer for e in from_parquet(str(parquet)).examples] == ["2", "4"]
    with pytest.raises(DataError, match="does not exist"):
        from_jsonl(gcs.uri("data", "missing.jsonl"))


# A tiny policy and task: one RL iteration, then a resume that runs the second.
TINY = [
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1", "model.num_heads=2",
    "model.num_kv_heads=1", "model.head_dim=16",
    "data.task_kwargs={min_terms=2, max_terms=2, min_digits=1, max_digits=1}", "data.size=40",
    "data.eval_size=4", "eval.size=4", "eval.every=100", "warm_start.steps=0",
    "rl.prompts_per_iteration=2", "sampling.num_samples=2", "checkpoint.every=1", "optim.total_steps=2",
    "mesh.devices=1", "metrics.progress_bar=false", "metrics.tensorboard=false", "metrics.samples_every=0",
]


def test_train_to_gs_then_resume_from_the_bucket(gcs):
    """`train` with output_dir=gs://... checkpoints, logs and plots into the bucket; a second run
    into the same URI without --resume is refused; with resume it restores step 1 from the
    bucket, continues the metrics file there and checkpoints step 2.

    Catches: `Path(cfg.output_dir)` in the loop (everything lands under ./gs:/ and the resume
    finds no checkpoint), a checkpoint guard that cannot list a bucket, and a resumed run that
    starts its metrics anew."""
    uri = gcs.uri("train-run")
    logs = []
    first = train(load_config(None, TINY + ["rl.iterations=1", f"output_dir='{uri}'"]), log=logs.append)
    assert str(first.output_dir) == uri and str(first.plot) == f"{uri}/curves.png"
    remote = gcs.local(uri)
    assert (remote / "checkpoints" / "1" / "params").is_dir() and (remote / "curves.png").is_file()
    with pytest.raises(CheckpointError, match="already holds checkpoints"):
        train(load_config(None, TINY + ["rl.iterations=2", f"output_dir='{uri}'"]), log=logs.append)

    second = train(load_config(None, TINY + ["rl.iterations=2", f"output_dir='{uri}'"]), resume=True,
                   log=logs.append)
    assert f"resumed from {uri}/checkpoints/1" in logs
    assert sorted(int(p.name) for p in (remote / "checkpoints").iterdir()) == [1, 2]
    steps = [json.loads(line)["step"] for line in (remote / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2] == [r["step"] for r in second.history]


def test_a_missing_bucket_is_one_line_with_the_fix(gcs):
    """The emulator answers 404 for a bucket that does not exist: the write check names the bucket
    and the command that creates it.

    Catches: a raw FileNotFoundError with a URL, or a failure deferred to the first checkpoint."""
    with pytest.raises(ConfigError) as err:
        storage.check_writable("gs://no-such-bucket/run")
    line = str(err.value)
    assert "\n" not in line
    assert "output_dir gs://no-such-bucket/run: bucket gs://no-such-bucket does not exist (404)" in line
    assert "gcloud storage buckets create gs://no-such-bucket --location=REGION" in line


def test_a_forbidden_write_is_one_line_with_the_fix(gcs, monkeypatch):
    """A 403 (what gcsfs raises for it: `OSError("Forbidden: <url>\\n<message>")`) names the
    bucket, the role and the gcloud command that grants it.

    Catches: reporting a forbidden write as a missing bucket or as a raw two-line OSError."""
    def forbidden(self, *args, **kwargs):
        raise OSError("Forbidden: https://storage.googleapis.com/upload/storage/v1/b/rljax-test-bucket/o\n"
                      "sa@p.iam.gserviceaccount.com does not have storage.objects.create access")

    monkeypatch.setattr(type(storage.as_path(gcs.uri())), "write_text", forbidden)
    with pytest.raises(ConfigError) as err:
        storage.check_writable(gcs.uri("run"))
    line = str(err.value)
    assert "\n" not in line and "writing is forbidden (403)" in line
    assert (f"gcloud storage buckets add-iam-policy-binding gs://{gcs.bucket} --member=serviceAccount:SA_EMAIL "
            "--role=roles/storage.objectAdmin") in line


def test_uri_errors_are_one_line(tmp_path, monkeypatch):
    """A gs:// path without gcsfs installed names the package and the pip command; an unsupported
    scheme names the ones that work; a local output_dir under a file says it is not writable.

    Catches: `epath.Path("ftp://x/y")` silently becoming the local path `ftp:/x/y`, and the
    ImportError deep inside fsspec on a machine without gcsfs."""
    storage._require_client.cache_clear()
    try:
        with monkeypatch.context() as patch, \
                pytest.raises(ConfigError, match=r"^gs:// paths need gcsfs: pip install 'gcsfs' \(the launch scripts"):
            patch.setattr(storage.importlib.util, "find_spec", lambda name: None)
            storage.as_path("gs://bucket/run")
    finally:
        storage._require_client.cache_clear()
    with pytest.raises(ConfigError, match=r"^ftp:// paths are not supported; use a local path or one of gs://"):
        storage.as_path("ftp://host/run")
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"^output_dir .*/file/run is not writable \((FileExistsError|NotADirectoryError)"):
        storage.check_writable(tmp_path / "file" / "run")
    assert storage.absolute("gs://b/run") == "gs://b/run" and storage.absolute("run") == str(Path.cwd() / "run")
