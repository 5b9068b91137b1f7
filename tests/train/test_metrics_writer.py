"""MetricsWriter: the sample log (JSONL, TensorBoard text, wandb table) and wandb run ids kept
across a resume, with wandb in offline mode."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from tensorboardX.proto import event_pb2

from rljax.train.metrics_writer import SAMPLES_FILE, WANDB_ID_FILE, MetricsWriter, SampleRecord

SAMPLES = [
    SampleRecord(prompt="12+34=", completion="46", reward=1.5, reward_parts={"correct": 1.0, "format": 0.5},
                 example_id="train-7"),
    SampleRecord(prompt="1+1=", completion="```\nnot closed\n    3", reward=0.0),
]


def tensorboard_texts(logdir: Path) -> list[tuple[int, str, str]]:
    """(step, tag, text) of every text summary in the event files, read from the TFRecord framing
    (u64 length, u32 crc, payload, u32 crc) with the Event proto."""
    found = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4
            for value in event.summary.value:
                if value.tensor.string_val:
                    found.append((event.step, value.tag, value.tensor.string_val[0].decode()))
    return found


def test_samples_go_to_jsonl_and_tensorboard_text(tmp_path):
    """Each record becomes one samples.jsonl row with its step, reward and reward parts, and each
    step one TensorBoard text summary holding every prompt and completion verbatim (as indented
    code, so a stray ``` in a completion cannot end the block); mappings are accepted as records."""
    writer = MetricsWriter(tmp_path, tensorboard=True)
    writer.write_samples(3, SAMPLES)
    writer.write_samples(5, [{"prompt": "2+2=", "completion": "4", "reward": 1.0}])
    writer.close()

    rows = [json.loads(line) for line in (tmp_path / SAMPLES_FILE).read_text().splitlines()]
    assert rows == [
        {"step": 3, "example_id": "train-7", "prompt": "12+34=", "completion": "46", "reward": 1.5,
         "reward_parts": {"correct": 1.0, "format": 0.5}},
        {"step": 3, "example_id": None, "prompt": "1+1=", "completion": "```\nnot closed\n    3", "reward": 0.0,
         "reward_parts": {}},
        {"step": 5, "example_id": None, "prompt": "2+2=", "completion": "4", "reward": 1.0, "reward_parts": {}},
    ]
    texts = tensorboard_texts(tmp_path / "tensorboard")
    assert [(step, tag.split("/")[0]) for step, tag, _ in texts] == [(3, "samples"), (5, "samples")]
    first = texts[0][2]
    assert "reward 1.5 (correct 1, format 0.5), example train-7" in first
    assert "    12+34=\n" in first and "    46" in first
    assert "    ```\n    not closed\n        3" in first  # every completion line indented
    assert "    4" in texts[1][2]


def test_samples_log_restarts_or_truncates_with_the_run(tmp_path):
    """A fresh writer starts samples.jsonl anew; on resume, rows past the restored step go."""
    writer = MetricsWriter(tmp_path, tensorboard=False)
    for step in (1, 2, 3):
        writer.write_samples(step, SAMPLES[:1])
    resumed = MetricsWriter(tmp_path, tensorboard=False, resume=True)
    resumed.truncate_after(2)
    assert [r["step"] for r in resumed.read_samples()] == [1, 2]
    assert MetricsWriter(tmp_path, tensorboard=False).read_samples() == []


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb").mkdir()
    return tmp_path / "wandb"


def test_wandb_resume_continues_the_same_run(tmp_path, offline_wandb):
    """The first writer stores its wandb run id in the output dir; a resumed writer continues that
    run (same id), a fresh one starts another; the sample table is logged as a wandb table.

    Catches: `wandb.init(resume="allow")` without the stored id (the old code: a resume got a new
    run id) and an id file that is not written or not read."""
    out = tmp_path / "run"
    first = MetricsWriter(out, tensorboard=False, wandb_project="rljax-test", config={"seed": 0})
    first.write(1, {"loss": 0.5})
    first.write_samples(1, SAMPLES)
    first.close()
    run_id = first.wandb_run_id
    assert run_id and (out / WANDB_ID_FILE).read_text().strip() == run_id
    tables = list(offline_wandb.rglob("samples_1_*.table.json"))
    assert len(tables) == 1
    table = json.loads(tables[0].read_text())
    assert table["columns"] == ["step", "example_id", "prompt", "completion", "reward", "reward/correct",
                                "reward/format"]
    assert table["data"][0] == [1, "train-7", "12+34=", "46", 1.5, 1.0, 0.5]

    resumed = MetricsWriter(out, tensorboard=False, wandb_project="rljax-test", resume=True)
    resumed.write(2, {"loss": 0.4})
    resumed.close()
    assert resumed.wandb_run_id == run_id

    fresh = MetricsWriter(out, tensorboard=False, wandb_project="rljax-test")
    fresh.close()
    assert fresh.wandb_run_id != run_id
    assert (out / WANDB_ID_FILE).read_text().strip() == fresh.wandb_run_id
