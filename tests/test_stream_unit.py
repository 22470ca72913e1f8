"""Streamed data without Ray: the window order at any world size, the shard index made once, and
the resume fingerprint of streamed jobs."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from tests.conftest import tiny_spec
from tidal.errors import CheckpointError, TidalError
from tidal.launch import stream_prep
from tidal.spec.job import JobSpec
from tidal.storage import RunDir, check_compatible
from tidal.worker.stream import StreamBatches, read_index
from tidal.worker.window_order import epoch_order

SEQ = 16  # tiny_spec's model.seq_len: windows of 17 tokens


def numbered_chunks(windows: int, pieces: int = 7):
    """A token stream whose window w is filled with the value w: a window's tokens name it. Cut in
    uneven pieces, as batches of documents would be."""
    flat = np.repeat(np.arange(windows, dtype=np.int32), SEQ + 1)
    calls = []

    def chunks(spec: JobSpec):
        calls.append(spec.name)
        yield from np.array_split(flat, pieces)

    return chunks, calls


def streamed(tmp_path, windows: int = 200, **overrides) -> tuple[JobSpec, str, list[str]]:
    source = tmp_path / "src.txt"
    if not source.exists():
        source.write_text("x")  # its size and mtime key the index; the tokens come from `chunks`
    spec = tiny_spec(tmp_path, name="s", **{"data.source": str(source), "data.streaming": True,
                                            "data.shard_windows": 12, "model.vocab_size": 256, **overrides})
    chunks, calls = numbered_chunks(windows)
    return spec, stream_prep.prepare(spec, chunks), calls


def step_windows(spec: JobSpec, uri: str, world: int, step: int) -> list[list[int]]:
    """Each rank's windows at `step`, as the numbers their tokens hold."""
    out = []
    for rank in range(world):
        batches = StreamBatches(spec, uri, rank, world, torch.device("cpu"))
        out.append([int(x[0, 0]) for inputs, _ in batches.for_step(step) for x in inputs.split(1)])
    return out


def test_a_step_trains_the_same_global_batch_at_world_sizes_1_2_and_4(tmp_path):
    spec, uri, _ = streamed(tmp_path)
    for step in (1, 5, 13, 14):  # 200 windows / 16 a step: step 13 crosses into the second epoch
        by_world = {w: step_windows(spec, uri, w, step) for w in (1, 2, 4)}
        assert sum(by_world[2], []) == sum(by_world[4], []) == by_world[1][0], step
        assert len(set(by_world[1][0])) == 16


def test_every_window_once_per_epoch_then_the_job_ends_at_the_last_whole_step(tmp_path):
    spec, uri, _ = streamed(tmp_path, windows=200, **{"data.epochs": 2})
    batches = StreamBatches(spec, uri, 0, 1, torch.device("cpu"))
    seen = []
    for step in range(1, 26):  # 2 epochs of 200 windows = 25 whole steps of 16
        seen += [int(x[0, 0]) for inputs, _ in batches.for_step(step) for x in inputs.split(1)]
        assert batches.ended == (step == 25)
    assert Counter(seen[:200]) == Counter(range(200)) == Counter(seen[200:])
    assert seen[:200] != seen[200:], "each epoch has its own order"


def test_the_order_keeps_a_stretch_of_windows_within_a_few_shards():
    counts = [10] * 40
    order = epoch_order(counts, seed=3, epoch=0)
    assert sorted(order.tolist()) == list(range(400))
    shards = [len({w // 10 for w in order[i:i + 40]}) for i in range(0, 400, 40)]
    assert max(shards) <= 4, shards  # a run of 4 shards' windows is read from those 4 only


def test_the_shard_index_is_made_once_and_reused(tmp_path):
    spec, uri, calls = streamed(tmp_path)
    chunks, again = numbered_chunks(200)
    assert stream_prep.prepare(spec, chunks) == uri and again == [], "a published index is reused"
    assert read_index(uri)["counts"] == [12] * 16 + [8]
    # A build cut short (no marker) is never read: the next start makes it again.
    sfs, path = RunDir(spec.checkpoint.storage, spec.name).fs, uri
    sfs.delete_file(f"{path}/{stream_prep.MARKER}")
    stream_prep.prepare(spec, chunks)
    assert again == ["s"]
    # What changes the tokens makes another index.
    longer = spec.with_overrides({"model.seq_len": 8})
    assert stream_prep.prepare(longer, chunks) != uri and again == ["s", "s"]


def test_a_changed_source_under_checkpoints_is_refused(tmp_path):
    spec, _, _ = streamed(tmp_path)
    RunDir(spec.checkpoint.storage, spec.name).fs.create_dir(f"{tmp_path}/runs/s/checkpoint_000000008")
    (tmp_path / "src.txt").write_text("longer now")
    chunks, _ = numbered_chunks(200)
    with pytest.raises(TidalError, match=r"streamed source changed .*size: 1 -> 10.*--restart"):
        stream_prep.prepare(spec, chunks)


def test_too_few_windows_for_one_step_is_a_clear_error(tmp_path):
    spec, uri, _ = streamed(tmp_path, windows=10, **{"data.epochs": 1})
    with pytest.raises(TidalError, match="make no whole step of train.global_batch 16; raise data.epochs"):
        StreamBatches(spec, uri, 0, 1, torch.device("cpu"))


@pytest.mark.parametrize("change", [{"data.text_field": "body"}, {"data.shard_windows": 8}])
def test_a_changed_stream_field_is_refused_by_name(tmp_path, change):
    (tmp_path / "x.jsonl").write_text("")
    spec = tiny_spec(tmp_path, **{"data.source": str(tmp_path / "x.jsonl"), "data.streaming": True, "data.epochs": 1,
                                  "model.vocab_size": 256})
    state = {"fingerprint": spec.resume_fingerprint(), "step": 8}
    field = next(iter(change))
    with pytest.raises(CheckpointError, match=rf"these fields changed.*\n  {field}: "):
        check_compatible(spec.with_overrides(change), state)


def test_turning_streaming_on_is_refused_and_other_jobs_keep_their_fingerprint(tmp_path):
    (tmp_path / "x.jsonl").write_text("")
    plain = tiny_spec(tmp_path, **{"data.source": str(tmp_path / "x.jsonl"), "model.vocab_size": 256})
    assert not any(k in plain.resume_fingerprint() for k in ("data.streaming", "data.epochs", "data.text_field"))
    with pytest.raises(CheckpointError, match="data.streaming: None -> True"):
        check_compatible(plain.with_overrides({"data.streaming": True}),
                         {"fingerprint": plain.resume_fingerprint(), "step": 8})


@pytest.mark.slow
def test_shards_on_object_storage_give_the_same_steps(tmp_path, bucket):
    """The index on S3 (moto's server): built there, found again, and read by the workers from it."""
    local, local_uri, _ = streamed(tmp_path)
    on_s3 = local.with_overrides({"checkpoint.storage": f"{bucket}/runs"})
    chunks, calls = numbered_chunks(200)
    uri = stream_prep.prepare(on_s3, chunks)
    assert uri.startswith(f"{bucket}/runs/s/tidal-stream/") and calls == ["s"]
    assert stream_prep.prepare(on_s3, chunks) == uri and calls == ["s"]
    for step in (1, 13):
        assert step_windows(on_s3, uri, 2, step) == step_windows(local, local_uri, 2, step)


def test_a_reader_holds_a_few_shards_and_fetches_the_next_steps_ahead(tmp_path):
    spec, uri, _ = streamed(tmp_path, windows=600)  # 50 shards of 12 windows
    batches = StreamBatches(spec, uri, 0, 2, torch.device("cpu"))
    reader = batches.reader
    for step in range(1, 30):
        list(batches.for_step(step))
        assert len(reader.cache) <= reader.limit < 50
        upcoming = batches.order.windows_of(step * 16, 16)[batches.part]
        assert set(reader._shards_of(upcoming).tolist()) <= set(reader.cache) | set(reader.loading), step


def test_more_epochs_continue_a_finished_stream_on_the_same_steps(tmp_path):
    """data.epochs says where the job ends, not what a step trains: raising it resumes (the CLI's
    advice for a job whose stream ended), and the steps already trained keep their windows."""
    spec, uri, _ = streamed(tmp_path, **{"data.epochs": 1})
    more = spec.with_overrides({"data.epochs": 3})
    check_compatible(more, {"fingerprint": spec.resume_fingerprint(), "step": 12})
    assert step_windows(spec, uri, 2, 12) == step_windows(more, uri, 2, 12)
    one, three = (StreamBatches(s, uri, 0, 1, torch.device("cpu")) for s in (spec, more))
    assert (one.last, three.last) == (12, 37)
    with pytest.raises(TidalError, match="data.epochs 1 ends the stream at step 12, before step 13"):
        next(one.for_step(13))
