"""TensorBoard: both frameworks write the same tags at the same steps into their run folders, as
TensorBoard's own reader reads them back; a resumed run continues its curves without duplicate
steps; a real `tensorboard` server lists both runs and their scalars."""
import io
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image
from tensorboard.backend.event_processing import plugin_event_accumulator
from tensorboard.util import tensor_util

from common import tensorboard
from common.pytorch import tensorboard as pytorch_tensorboard
from common.tensorflow import tensorboard as tensorflow_tensorboard
from GAN.vanilla_gan import gan_pytorch, gan_tensorflow

SCRIPTS = {"pytorch": gan_pytorch, "tensorflow": gan_tensorflow}
TINY = ["--batch-size", "16", "--data-limit", "64", "--log-every", "2", "--sample-every", "2"]
INTERVAL_TAGS = {"loss/d_loss", "loss/g_loss", "amp/loss_scale", "amp/skipped_steps", "speed/ms_per_step",
                 "speed/samples_per_s", "optimizer/lr"}
SERVER_WAIT_S = 60


def train(framework, out, *extra):
    return SCRIPTS[framework].main(["--out", str(out), *TINY, *extra])


def read_events(folder) -> dict:
    """{tag: (plugin, [(step, value)])} of a run folder, read by TensorBoard's own reader (the
    one its Python data path uses); a value is a float for scalars, else the tensor."""
    accumulator = plugin_event_accumulator.EventAccumulator(str(folder), size_guidance={"tensors": 0})
    accumulator.Reload()
    events = {}
    for tag in accumulator.Tags()["tensors"]:
        plugin = accumulator.SummaryMetadata(tag).plugin_data.plugin_name
        values = [tensor_util.make_ndarray(event.tensor_proto) for event in accumulator.Tensors(tag)]
        events[tag] = (plugin, [(event.step, float(value) if plugin == "scalars" else value)
                                for event, value in zip(accumulator.Tensors(tag), values)])
    return events


def steps(events, tag) -> list[int]:
    return [step for step, _ in events[tag][1]]


def history(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "history.jsonl").read_text().splitlines()]


def logged(rows, key) -> list:
    """(step, value) of a history field, as TensorBoard holds it (in float32)."""
    return [(row["step"], pytest.approx(row[key], rel=1e-6)) for row in rows]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One tiny run per framework, side by side as in runs/<model>/, evaluated at the end."""
    root = tmp_path_factory.mktemp("runs") / "vanilla_gan"
    for framework in SCRIPTS:
        train(framework, root / f"{framework}-fp32", "--iters", "4", "--evaluate", "100")
    return root


def test_both_frameworks_write_the_same_tags_at_the_same_steps(runs):
    read = {framework: read_events(runs / f"{framework}-fp32") for framework in SCRIPTS}
    shapes = {framework: {tag: (plugin, steps(events, tag)) for tag, (plugin, _) in events.items()}
              for framework, events in read.items()}
    assert shapes["pytorch"] == shapes["tensorflow"]
    shape = shapes["pytorch"]
    quality = {tag for tag in shape if tag.startswith("quality/")}
    assert {"quality/fid", "quality/precision", "quality/recall"} <= quality
    assert {tag: shape[tag] for tag in INTERVAL_TAGS | quality} == {
        **{tag: ("scalars", [2, 4]) for tag in INTERVAL_TAGS}, **{tag: ("scalars", [4]) for tag in quality}}
    assert shape["samples"] == ("images", [0, 2, 4])
    assert shape["run/config"] == ("text", [0])
    assert shape["_hparams_/session_start_info"] == ("hparams", [0])

    for framework, events in read.items():
        folder = runs / f"{framework}-fp32"
        rows = history(folder)
        assert events["loss/d_loss"][1] == logged(rows, "d_loss")
        assert events["speed/ms_per_step"][1] == logged(rows, "step_ms")
        # the values the tags hold, not only their steps: examples per second, not per millisecond
        config = json.loads((folder / "config.json").read_text())
        assert events["speed/samples_per_s"][1] == [
            (row["step"], pytest.approx(config["batch_size"] * 1000.0 / row["step_ms"], rel=1e-6)) for row in rows]
        assert events["amp/loss_scale"][1] == logged(rows, "loss_scale")
        assert events["amp/skipped_steps"][1] == logged(rows, "skipped_total")
        assert events["optimizer/lr"][1] == [(row["step"], pytest.approx(config["lr"], rel=1e-6)) for row in rows]
        metrics = json.loads((folder / "summary.json").read_text())["metrics"]
        assert events["quality/fid"][1] == [(4, pytest.approx(metrics["fid"], rel=1e-6))]
        # the image is the grid PNG the run saved at that step, pixel for pixel
        width, height, png = events["samples"][1][-1][1]
        decoded = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
        assert decoded.shape == (int(height), int(width), 3)
        np.testing.assert_array_equal(decoded, tensorboard.grid_image(folder / "samples" / "step_000004.png"))
        text = events["run/config"][1][0][1].item().decode()
        assert f"vanilla_gan, {framework}, fp32 on cpu" in text and "| batch_size | 16 |" in text


def test_the_settings_table_keeps_a_path_with_a_bar_or_line_break_in_its_row():
    """--data-dir and --out are paths, which may hold "|" or a line break: they opened a column
    or ended the row of run/config's markdown table."""
    config = {"model": "vanilla_gan", "framework": "pytorch", "precision": "fp32", "device": "cpu",
              "data_dir": "/data/a|b\nc", "versions": {"torch": "2"}}
    rows = tensorboard.config_text(config).splitlines()[4:]
    assert rows == ["| data_dir | /data/a\\|b c |", "| device | cpu |", "| framework | pytorch |",
                    "| model | vanilla_gan |", "| precision | fp32 |", "| versions.torch | 2 |"]


def test_a_run_folder_named_with_an_undecodable_byte_keeps_its_tensorflow_events(tmp_path, capsys):
    """A folder name's byte that is not UTF-8 (a lone surrogate in Python) ended the events of
    the run in both frameworks. TensorFlow writes them now, the path escaped in run/config;
    torch's writer encodes its folder's path as UTF-8, so PyTorch still warns once and trains on."""
    out = tmp_path / "run_\udcff"
    assert gan_tensorflow.main(["--out", str(out), *TINY, "--iters", "2", "--dataset", "ring8"]) is not None
    assert "warning" not in capsys.readouterr().out
    readable = out.rename(tmp_path / "renamed")  # TensorBoard's reader takes UTF-8 paths only
    text = read_events(readable)["run/config"][1][0][1].item().decode()
    assert "run_\\udcff |" in text, text
    assert gan_pytorch.main(["--out", str(tmp_path / "torch_\udcff"), *TINY, "--iters", "2", "--dataset", "ring8"])
    assert "warning: TensorBoard events could not be written (UnicodeEncodeError" in capsys.readouterr().out


@pytest.mark.parametrize("framework", SCRIPTS)
def test_a_resumed_run_continues_its_curves_without_duplicate_steps(framework, tmp_path):
    out = tmp_path / "run"
    train(framework, out, "--iters", "6", "--checkpoint-every", "4")
    # As if the process had died after logging step 6 and before checkpointing it.
    for path in (out / "checkpoints").glob("step_000006.*"):
        path.unlink()
    # TensorBoard reads a folder's event files in name order, and a name starts with the second
    # its writer opened: the resumed run's file must come second, as it does for a real restart.
    time.sleep(1.0)
    train(framework, out, "--iters", "8", "--resume")

    assert len(list(out.glob("events.out.tfevents.*"))) == 2  # one writer per process, one after the other
    events = read_events(out)
    rows = history(out)
    assert [row["step"] for row in rows] == [2, 4, 6, 8]
    for tag in INTERVAL_TAGS:
        assert steps(events, tag) == [2, 4, 6, 8], tag  # step 6 once: the resumed run's
    assert events["loss/g_loss"][1] == logged(rows, "g_loss")
    assert steps(events, "samples") == [0, 2, 4, 6, 8]
    assert steps(events, "run/config") == [0, 4]  # the settings of each start, at the step it started from
    first, resumed = (str(text) for _, text in events["run/config"][1])
    assert "| iters | 6 |" in first and "| iters | 8 |" in resumed  # the resume's, not the run's before it

    # Reopened when finished: with nothing to do it leaves no empty events file behind; with
    # --evaluate its metrics go to a file of their own, at the run's last step.
    time.sleep(1.0)
    train(framework, out, "--iters", "8", "--resume")
    assert len(list(out.glob("events.out.tfevents.*"))) == 2
    train(framework, out, "--iters", "8", "--resume", "--evaluate", "100")
    assert len(list(out.glob("events.out.tfevents.*"))) == 3
    events = read_events(out)
    assert steps(events, "quality/fid") == [8] and steps(events, "loss/g_loss") == [2, 4, 6, 8]


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_a_writer_drops_the_earlier_processes_events_from_its_purge_step_on(framework, tmp_path):
    """A resumed run's writer purges from the first step it logs (the checkpoint's + 1), that
    step included. The resumed run above logs every second step, so a purge one step later
    went unseen there."""
    writer_class = {"pytorch": pytorch_tensorboard.Writer, "tensorflow": tensorflow_tensorboard.Writer}[framework]
    first = writer_class(tmp_path, 1)
    for step in (1, 2, 3):
        first.scalars({"loss/g_loss": float(step)}, step)
    first.close()
    time.sleep(1.0)  # the second writer's file comes second in name order, as a restart's does
    second = writer_class(tmp_path, 2)
    second.scalars({"loss/g_loss": 20.0}, 2)
    second.close()
    assert read_events(tmp_path)["loss/g_loss"][1] == [(1, 1.0), (2, 20.0)]


def test_no_tensorboard_writes_none_and_a_failed_write_does_not_stop_training(tmp_path, monkeypatch, capsys):
    train("pytorch", tmp_path / "off", "--iters", "2", "--no-tensorboard")
    assert not list((tmp_path / "off").glob("events.out.tfevents.*"))

    def disk_full(self, values, step):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pytorch_tensorboard.Writer, "scalars", disk_full)
    summary = train("pytorch", tmp_path / "full", "--iters", "4")
    assert summary["step"] == 4 and len(history(tmp_path / "full")) == 2
    warnings = [line for line in capsys.readouterr().out.splitlines() if "TensorBoard" in line]
    assert warnings == ["warning: TensorBoard events could not be written (OSError: [Errno 28] No space left "
                        "on device); the run goes on without them"]


def test_a_full_disk_under_the_event_writer_is_one_warning_in_both_frameworks(tmp_path, monkeypatch, capsys):
    """PyTorch's writes fail where the bytes are written, in the writer's thread, which keeps
    its error for the next write (no thread traceback); TensorFlow's writer raises the
    several-line error tf.summary raised on a full disk."""
    from tensorboard.summary.writer import record_writer

    def disk_full(self, data):
        raise OSError(28, "No space left on device")

    thread_errors = []
    monkeypatch.setattr(threading, "excepthook", thread_errors.append)  # what threading would print
    monkeypatch.setattr(record_writer.RecordWriter, "write", disk_full)
    summary = train("pytorch", tmp_path / "pytorch", "--iters", "4")
    assert summary["step"] == 4 and thread_errors == []

    def flush_failed(self, values, step):  # tf.summary's message, as a full disk raised it
        raise tf.errors.ResourceExhaustedError(None, None, (
            "{{function_node __wrapped__FlushSummaryWriter_device_/job:localhost/replica:0/task:0/device:CPU:0}} "
            "run/events.out.tfevents.v2; No space left on device\n\tFailed to flush 7 events to "
            "run/events.out.tfevents.v2\n\tCould not flush events file. [Op:FlushSummaryWriter] name: "))

    monkeypatch.setattr(tensorflow_tensorboard.Writer, "scalars", flush_failed)
    assert train("tensorflow", tmp_path / "tensorflow", "--iters", "4")["step"] == 4
    warnings = [line for line in capsys.readouterr().out.splitlines() if "TensorBoard" in line]
    assert warnings == [
        "warning: TensorBoard events could not be written (OSError: [Errno 28] No space left on device); "
        "the run goes on without them",
        "warning: TensorBoard events could not be written (ResourceExhaustedError: "
        "run/events.out.tfevents.v2; No space left on device); the run goes on without them"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


def test_a_tensorboard_server_lists_both_runs_and_their_scalars(runs, tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "tensorboard.log"
    expected = {"pytorch-fp32", "tensorflow-fp32"}
    with open(log, "wb") as output:
        server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(runs),
                                   "--host", "127.0.0.1", "--port", str(port)], stdout=output, stderr=output)
    try:
        deadline = time.monotonic() + SERVER_WAIT_S
        tags = {}
        while not (set(tags) == expected and all(INTERVAL_TAGS <= set(tags[run]) for run in expected)):
            assert server.poll() is None, f"tensorboard exited: {log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"no runs after {SERVER_WAIT_S} s: {log.read_text()[-2000:]}"
            time.sleep(0.5)
            try:
                if set(get_json(f"{base}/data/runs")) == expected:  # listed before their data is loaded
                    tags = get_json(f"{base}/data/plugin/scalars/tags")
            except OSError:
                pass  # not listening yet
        for run in expected:
            assert "quality/fid" in tags[run]
            points = get_json(f"{base}/data/plugin/scalars/scalars?run={run}&tag=loss/d_loss")
            assert [step for _, step, _ in points] == [2, 4]
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def test_quality_scalars_are_the_metrics_not_the_sample_count_or_the_draws():
    """--evaluate's figures become quality/<metric>; the sample count is no quality (a flat
    curve of 10,000 beside FID), and the lists of --eval-draws are no scalar."""
    metrics = {"samples": 10_000, "fid": 5.5, "classes_covered": 10, "draws": {"fid": [5.5, 6.0]}}
    assert tensorboard.metric_scalars(metrics) == {"quality/fid": 5.5, "quality/classes_covered": 10.0}


def test_the_skipped_steps_scalar_is_the_runs_total_not_the_intervals():
    """amp/skipped_steps counts the steps skipped so far, as its doc says; a float32 run (every
    run of the other tests) skips none, where both counts are 0 (mutation round 10: the
    interval's own count went unseen)."""
    row = {"step": 20, "loss_scale": 512.0, "skipped": 1, "skipped_total": 5, "step_ms": 4.0}
    scalars = tensorboard.interval_scalars(row, {"d_loss": 0.5}, batch_size=8, lr=2e-4)
    assert scalars["amp/skipped_steps"] == 5 and scalars["amp/loss_scale"] == 512.0
    assert scalars["speed/samples_per_s"] == 2000.0 and scalars["loss/d_loss"] == 0.5
