"""Data-parallel training: torchrun/DDP with gloo on CPU, two replicas on 127.0.0.1.

Two replicas at a global batch of 64 train as one process at batch 64 does (each takes its
half of every batch and of the noise drawn for it), resume from each other's checkpoints,
stop together on a Ctrl-C or a SIGTERM to one of them, and end with one line when one dies.
"""
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from common import distributed
from common.errors import CheckpointError, DataError, UsageError, UserError
from common.loop import StopRequest
from tests.conftest import REPO, UNTIL_STOPPED, evaluated_in_one_process, resume_from_the_only_checkpoint, run_script

FAST = ["--data-limit", "512", "--log-every", "5", "--sample-every", "0", "--checkpoint-every", "0",
        "--no-tensorboard", "--batch-size", "64"]
SCRIPTS = {"vanilla_gan": "GAN/vanilla_gan/gan_pytorch.py", "lsgan": "GAN/least_squares_gan/lsgan_pytorch.py",
           "vae": "VAE/vanilla_vae/vae_pytorch.py", "dcgan": "GAN/dcgan/dcgan_pytorch.py",
           "wgan_gp": "GAN/wgan_gp/wgan_gp_pytorch.py"}
TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
# The GANs average G (--ema-decay) and run at width 32: at the default 256, Adam turns rounding
# in gradients near zero into lr-sized steps within 20 steps (measured: 1.7e-5 against 4.1e-8
# at width 32, TensorFlow LSGAN), as the DCGAN and WGAN-GP tests' lr 1e-5 avoids.
GAN_FLAGS = ["--ema-decay", "0.9", "--width", "32"]


def replica_environment() -> dict:
    """Every process of a comparison, the one-process run too, on one thread: a float32 sum
    (a bias gradient, say) can be split otherwise on two, and a rounding difference in a
    near-zero gradient is an Adam step of +-lr that GAN training then amplifies."""
    return {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "MKL_CBWR": "AUTO,STRICT",
            "PYTHONUNBUFFERED": "1"}


def torchrun_command(script: str, *flags: str, replicas: int = 2, launcher: tuple = ()) -> list[str]:
    """`launcher`: more of torchrun's own options."""
    return [sys.executable, "-m", "torch.distributed.run", *launcher, "--nnodes", "1", "--nproc-per-node",
            str(replicas), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", script, *flags]


def torchrun(script: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(torchrun_command(script, *flags), cwd=REPO, env=replica_environment(),
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def checkpoint(run: Path, step: int) -> dict:
    return torch.load(run / "checkpoints" / f"step_{step:06d}.pt", weights_only=True)


def max_weight_difference(a: dict, b: dict) -> float:
    return max((a[name][key].float() - b[name][key].float()).abs().max().item()
               for name in a for key in a[name] if a[name][key].is_floating_point())


# --- the sharding, without processes ----------------------------------------------------------

def test_each_replica_gets_its_slice_of_every_part_of_the_batch():
    rows = np.arange(20)
    assert distributed.shard(rows, 0, 1).tolist() == list(range(20))
    assert distributed.shard(rows, 1, 2).tolist() == list(range(10, 20))
    # WGAN-GP: 2 parts (critic batches) of 10; each replica takes its half of each part
    assert distributed.shard(rows, 0, 2, parts=2).tolist() == [0, 1, 2, 3, 4, 10, 11, 12, 13, 14]
    assert distributed.shard(torch.arange(20).view(10, 2), 1, 2).tolist() == torch.arange(10, 20).view(5, 2).tolist()
    together = np.concatenate([distributed.shard(rows, rank, 4) for rank in range(4)])
    assert together.tolist() == rows.tolist()


def test_a_batch_that_does_not_divide_is_refused():
    distributed.check_batch(64, 2)
    distributed.check_batch(320, 2, parts=5)
    with pytest.raises(UsageError, match="multiple of 10"):
        distributed.check_batch(325, 2, parts=5)
    with pytest.raises(UsageError, match="multiple of 4"):
        distributed.check_batch(66, 4)
    distributed.check_batch(68, 2, pack=2)  # PacGAN's D: each replica's share divides into packs
    with pytest.raises(UsageError, match="packs of 2 samples: use a multiple of 4"):
        distributed.check_batch(66, 2, pack=2)


def test_a_batch_that_does_not_divide_into_one_process_packs_names_one_replica():
    """One process (PacGAN's packs alone): "1 replica", not "1 replicas"."""
    with pytest.raises(UsageError) as refused:
        distributed.check_batch(33, 1, pack=2)
    assert str(refused.value).startswith("--batch-size 33 does not divide among 1 replica x packs of 2 samples: "
                                         "use a multiple of 2"), refused.value


def test_pytorch_fit_refuses_a_replicas_share_that_does_not_divide_into_ds_packs():
    """Under torchrun the parser knows no replica count: fit checks the batch, with the
    model's packs (PacGAN's D on the mixtures), before anything is built. 6 points divide
    into packs of 2, each of 2 replicas' 3 do not. (Mutation round 8: fit's check without
    pack= went unseen.)"""
    from types import SimpleNamespace

    from common.config import parse_args
    from common.pytorch import session

    cfg = parse_args("vanilla_gan", "pytorch", ["--dataset", "ring8", "--batch-size", "6"])
    runtime = SimpleNamespace(replicas=SimpleNamespace(count=2, writer=True))
    data = SimpleNamespace(dataset=SimpleNamespace(sample_shape=(2,)))
    with pytest.raises(UsageError, match="2 replicas x packs of 2 samples: use a multiple of 4"):
        session.fit(cfg, runtime, SimpleNamespace(), data)


def test_a_relayed_signal_is_the_same_stop_request_and_a_later_one_quits(monkeypatch):
    monkeypatch.setattr(StopRequest, "RELAY_WINDOW_S", 0.3)
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # torchrun passing on the terminal's Ctrl-C
        assert stop.requested == signal.SIGINT
        time.sleep(0.4)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)


@pytest.mark.parametrize("name, again", [("SIGINT", "Ctrl-C again"), ("SIGTERM", "another signal")])
def test_a_stop_request_says_what_quits_at_once(name, again, capsys):
    """A SIGTERM (a scheduler's, `kill`) had been told "Ctrl-C again to quit at once"."""
    with StopRequest() as stop:
        os.kill(os.getpid(), getattr(signal, name))
        assert stop.requested == getattr(signal, name)
    said = capsys.readouterr().err
    assert said == f"\n{name}: finishing this step and saving a checkpoint ({again} to quit at once)\n"


# --- the replicas' flags, compared as they start --------------------------------------------

class Gathered:
    """The replicas of a gather, seen from rank `rank`: what each of them sent (a list of rows
    per gather, for a check that gathers more than once)."""

    def __init__(self, rows: list[list[int]], rank: int = 0, noun: str = "replicas"):
        self.rows, self.rank, self.count, self.noun = rows, rank, len(rows), noun
        self.writer = rank == 0

    def gather(self, values: list[int]) -> list[list[int]]:
        assert list(values) == self.rows[self.rank]  # this replica's own row, as sent
        return self.rows


class GatheredFlags(Gathered):
    """check_same_flags' two gathers: the flags' names (alike, unless `names` differ), then
    their values."""

    def __init__(self, rows: list[list[int]], rank: int = 0, noun: str = "replicas", names=None):
        super().__init__(rows, rank, noun)
        self.names = names

    def gather(self, values: list[int]) -> list[list[int]]:
        if len(values) == 1:  # the names' CRC
            return [list(values)] * (self.count - 1) + [[self.names if self.names is not None else values[0]]]
        return super().gather(values)


def fingerprints_of(*argvs: list[str]) -> tuple[list, list[list[int]]]:
    from common.config import parse_args

    configs = [parse_args("vanilla_gan", "pytorch", argv) for argv in argvs]
    return configs, [distributed.flags_fingerprint(cfg) for cfg in configs]


def test_replicas_started_with_different_flags_are_one_line_naming_them_and_this_ones_values():
    (here, _), fingerprints = fingerprints_of(["--lr", "1e-3", "--no-tensorboard"],
                                              ["--amp", "--out", "/elsewhere", "--workers", "2"])
    with pytest.raises(UsageError) as refused:
        distributed.check_same_flags(here, GatheredFlags(fingerprints[::-1], rank=1, noun="workers"))
    assert str(refused.value) == ("the workers were started with different --amp, --lr, --no-tensorboard (here: "
                                  "no --amp, --lr 0.001, --no-tensorboard): start every one with the same flags "
                                  "(only --data-dir, --out, --init-from, --workers may differ)")
    assert refused.value.quiet and refused.value.exit_code == 2


def test_replicas_may_differ_only_in_their_machines_paths_and_loader_threads():
    from common.config import parse_args

    (here, _), fingerprints = fingerprints_of([], ["--out", "/elsewhere", "--workers", "2", "--init-from", "/run"])
    distributed.check_same_flags(here, GatheredFlags(fingerprints))
    (here, *_), fingerprints = fingerprints_of([], [], ["--seed", "1"])  # the third of three
    with pytest.raises(UsageError, match="different --seed \\(here: --seed 0\\)"):
        distributed.check_same_flags(here, GatheredFlags(fingerprints))
    lsgan = parse_args("lsgan", "pytorch", [])  # another script: no --model flag to name
    with pytest.raises(UsageError, match="different scripts \\(here: vanilla_gan's script\\)"):
        distributed.check_same_flags(here, GatheredFlags([fingerprints[0], distributed.flags_fingerprint(lsgan)]))
    with pytest.raises(UsageError, match="^the replicas run different versions of this code \\(their flags differ\\): "
                                         "check out the same commit on every machine$"):
        distributed.check_same_flags(here, GatheredFlags([fingerprints[0]] * 2, names=12345))


def test_a_flags_value_is_shown_as_the_command_line_gives_it():
    """(Mutation round 13: "--amp True", "--data-limit None".)"""
    assert [distributed._as_flag(name, value) for name, value in (
        ("amp", True), ("amp", False), ("data_limit", None), ("data_limit", 512), ("tensorboard", False),
        ("tensorboard", True), ("model", "lsgan"))] == [
        "--amp", "no --amp", "no --data-limit", "--data-limit 512", "--no-tensorboard", "TensorBoard on",
        "lsgan's script"]


class OtherReplica:
    """runtime.dist's all_gather and barrier as replica `rank` of two sees them, the other one
    sending `theirs` (one list per gather; a gather is two all_gathers: the lengths, then the
    values padded to the longest). What was called, on which group, and whether every tensor it
    was handed had been lent (runtime._LENT, which the exit waits for)."""

    def __init__(self, monkeypatch, *theirs: list[int], rank: int = 0):
        from common.pytorch import runtime

        self.rank, self.lent, self.theirs, self.calls, self.lengths_next = rank, runtime._LENT, list(theirs), [], True
        self.sent = []  # what this replica sent, each all_gather's row
        monkeypatch.setattr(runtime.dist, "all_gather", self.all_gather)
        monkeypatch.setattr(runtime.dist, "barrier", lambda group=None: self.calls.append(("barrier", group)))

    def all_gather(self, rows, row, group=None):
        self.calls.append(("all_gather", group, all(id(tensor) in self.lent for tensor in (*rows, row))))
        self.sent.append(row.tolist())
        values = self.theirs[0]
        sent = [len(values)] if self.lengths_next else values + [0] * (len(row) - len(values))
        if not self.lengths_next:
            self.theirs.pop(0)
        self.lengths_next = not self.lengths_next
        rows[self.rank].copy_(row)
        rows[1 - self.rank].copy_(torch.tensor(sent, dtype=row.dtype))


def test_pytorch_gather_holds_every_replica_until_all_have_it_and_lends_its_tensors(monkeypatch):
    """The lengths, then the values, then a barrier, all on the control group, with tensors the
    exit waits for: a replica that exited on what it gathered aborted in 7 of 36 runs
    ("terminate called without an active exception") as gloo's thread freed them. (Mutation
    round 13: the barrier.)"""
    from common.pytorch import runtime

    other = OtherReplica(monkeypatch, [9, 8, 2**40])
    replicas = runtime.Replicas(rank=0, count=2, control_group="control")
    assert replicas.gather([4]) == [[4], [9, 8, 2**40]]
    assert other.calls == [("all_gather", "control", True), ("all_gather", "control", True), ("barrier", "control")]


def test_a_writers_failure_ends_the_others_with_its_line_and_its_success_lets_them_on(monkeypatch):
    from common.pytorch import runtime

    # a path's undecodable byte, as Python holds it (a lone surrogate), crossed too: it raised
    # UnicodeEncodeError on the writer, in a traceback, the others waiting on
    refusal = "cannot write /runs/\udcff: disk full: ü"
    OtherReplica(monkeypatch, [1, *refusal.encode(errors="surrogateescape")], [], rank=1)
    waiting = runtime.Replicas(rank=1, count=2)
    with pytest.raises(distributed.ReplicaFailed) as stopped:
        waiting.writer_first(lambda: pytest.fail("only the writer acts"))
    assert str(stopped.value) == f"rank 0 stopped: {refusal}" and stopped.value.quiet
    assert waiting.writer_first(lambda: pytest.fail("only the writer acts")) is None

    # what the writer sends, read back by the others: the same line (an empty one too, not success)
    for refusal in ("cannot write /runs/\udcff: disk full", ""):
        def refuse(refusal=refusal):
            raise CheckpointError(refusal)

        writers_side = OtherReplica(monkeypatch, [], [])
        with pytest.raises(CheckpointError):
            runtime.Replicas(rank=0, count=2).writer_first(refuse)
        (length,), row = writers_side.sent[:2]
        OtherReplica(monkeypatch, row[:length], [], rank=1)
        with pytest.raises(distributed.ReplicaFailed) as stopped:
            runtime.Replicas(rank=1, count=2).writer_first(lambda: pytest.fail("only the writer acts"))
        assert str(stopped.value) == f"rank 0 stopped: {refusal}"

    other = OtherReplica(monkeypatch, [], [])
    writer = runtime.Replicas(rank=0, count=2)
    assert writer.writer_first(lambda: "run folder") == "run folder"

    def refuse():
        raise CheckpointError("no room in /runs/\udcff")

    with pytest.raises(CheckpointError, match="^no room in /runs/\udcff$"):
        writer.writer_first(refuse)
    assert [call[0] for call in other.calls] == ["all_gather", "all_gather", "barrier"] * 2


def test_the_stop_flag_and_the_logged_losses_are_lent_to_their_all_reduces(monkeypatch):
    from common.pytorch import runtime

    reduced = []

    class Work:
        def wait(self):
            pass

    def all_reduce(tensor, op=None, group=None, async_op=False):
        reduced.append(id(tensor) in runtime._LENT)
        return Work()

    monkeypatch.setattr(runtime.dist, "all_reduce", all_reduce)
    replicas = runtime.Replicas(rank=1, count=2)
    assert replicas.stop_signal(2) == 0 and replicas.stop_signal(0) == 2  # agreed one step late
    assert replicas.mean(torch.tensor([4.0, 6.0])).tolist() == [2.0, 3.0]  # (no other replica adds here)
    assert reduced == [True, True, True]


def test_a_replicas_exit_waits_until_the_collectives_let_go_of_its_tensors(monkeypatch):
    """_leave, at exit: a stop flag never waited for is let go, the lent tensors are waited for
    (here a thread holds one for 0.3 s, as gloo's does for a moment), then the group destroyed.
    A tensor held past the timeout (a stuck collective) is given up on."""
    from common.pytorch import runtime

    monkeypatch.setattr(runtime, "_LENT", {})  # this test's tensors alone
    events = []
    monkeypatch.setattr(runtime.dist, "destroy_process_group", lambda: events.append(("destroyed", len(runtime._LENT))))
    held = [runtime._lend(torch.zeros(1))]
    replicas = runtime.Replicas(rank=1, count=2, _pending_stop=("work", runtime._lend(torch.zeros(1))))
    started = time.monotonic()
    threading.Timer(0.3, held.clear).start()
    runtime._leave(replicas)
    assert time.monotonic() - started >= 0.3
    assert replicas._pending_stop is None and events == [("destroyed", 0)]

    def collective_with_a_bug():
        lent = runtime._lend(torch.zeros(1))  # noqa: F841 (held by the traceback's frame)
        raise ValueError("a bug")

    try:
        collective_with_a_bug()
    except ValueError as error:  # uncaught, Python would keep it, and its traceback, for the exit
        monkeypatch.setattr(sys, "last_value", error, raising=False)
        monkeypatch.setattr(sys, "last_traceback", error.__traceback__, raising=False)
    started = time.monotonic()
    runtime._leave(replicas)
    assert time.monotonic() - started < runtime.RETURN_TIMEOUT_S / 2 and events[-1] == ("destroyed", 0)

    stuck = runtime._lend(torch.zeros(1))
    started = time.monotonic()
    assert not runtime.wait_for_lent_tensors(timeout_s=0.2)
    assert 0.2 <= time.monotonic() - started < 10
    del stuck
    assert runtime.wait_for_lent_tensors(timeout_s=0)


def test_every_other_setting_enters_the_fingerprint():
    """A value changed in any one field of RunConfig but the per-machine ones changes its
    number, and only its number."""
    import dataclasses

    (base,), (plain,) = fingerprints_of([])
    names = list(distributed.shared_flags(base))
    assert set(names) == {field.name for field in dataclasses.fields(base)} - set(distributed.PER_MACHINE_FLAGS)
    for index, name in enumerate(names):
        value = getattr(base, name)
        other = (not value if isinstance(value, bool) else value + 1 if isinstance(value, (int, float))
                 else "x" if value is None else f"{value}x")
        changed = distributed.flags_fingerprint(dataclasses.replace(base, **{name: other}))
        assert [i for i, (a, b) in enumerate(zip(plain, changed)) if a != b] == [index], name
        assert all(0 <= number < 2**31 for number in changed)  # an int32 for TensorFlow's gather


def sent_for(x: np.ndarray) -> list[int]:
    """What check_same_data sends to the gather for training set `x`."""
    sent = []

    class Sending(Gathered):
        def gather(self, values):
            sent.append(values)
            return [values, values]

    distributed.check_same_data(x, Sending([[], []]))
    return sent[0]


def test_replicas_holding_other_data_are_one_line():
    images = np.arange(2 * 28 * 28, dtype=np.uint8).reshape(2, 28, 28, 1)
    other = images.copy()
    other[1, 5, 5, 0] += 1  # one pixel of one image
    ours, theirs = sent_for(images), sent_for(other)
    assert ours != theirs and ours[0] == theirs[0] == 2
    assert sent_for(images[:1]) != ours and sent_for(images.reshape(2, 28, 14, 2)) != ours  # count, shape
    assert sent_for(images.view(np.int8)) != ours  # the same bytes read as another type
    distributed.check_same_data(images, Gathered([ours, ours]))
    distributed.check_same_data(images, Gathered([[]]))  # one process: nothing gathered, nothing compared
    with pytest.raises(DataError) as refused:
        distributed.check_same_data(images, Gathered([theirs, ours], rank=1))
    assert str(refused.value) == ("the replicas hold different training data (here: 2 examples of (28, 28, 1), "
                                  "uint8): every one must read the same files (its own --data-dir may name them at "
                                  "another path)")
    assert refused.value.quiet


def test_replicas_that_loaded_other_init_from_weights_are_one_line(tmp_path):
    ours, theirs = tmp_path / "ours.npz", tmp_path / "theirs.npz"
    ours.write_bytes(b"weights")
    theirs.write_bytes(b"weightz")
    crc = lambda path: zlib.crc32(path.read_bytes()) >> 1  # noqa: E731
    distributed.check_same_start(ours, Gathered([[crc(ours)], [crc(ours)]]))
    distributed.check_same_start(ours, Gathered([[]]))  # one process: nothing read, nothing gathered
    with pytest.raises(CheckpointError) as refused:
        distributed.check_same_start(ours, Gathered([[crc(ours)], [crc(theirs)]], noun="workers"))
    assert str(refused.value) == (f"the workers loaded different --init-from weights (here: {ours}): every one must "
                                  "load the same file (its own --init-from may name it at another path)")
    assert not refused.value.quiet
    (tmp_path / "moved.npz").symlink_to(tmp_path / "gone")  # removed since it was loaded, say
    with pytest.raises(CheckpointError) as refused:
        distributed.check_same_start(tmp_path / "moved.npz", Gathered([[0], [0]]))
    assert str(refused.value) == (f"--init-from weights {tmp_path / 'moved.npz'} is unreadable (No such file or "
                                  "directory); name another")


def test_a_fifo_named_as_a_replicas_latest_checkpoint_is_refused_before_its_bytes_are_read(tmp_path):
    """Under replicas the checkpoint's CRC is read before the restore checks the file: a FIFO
    named like a checkpoint would block that read forever."""
    from types import SimpleNamespace

    from common import loop

    fifo = tmp_path / "step_000004.pt"
    os.mkfifo(fifo)
    run = SimpleNamespace(latest_checkpoint=lambda: (4, fifo))
    session = SimpleNamespace(replicas=Gathered([[4, 0], [4, 0]]))
    ended = []

    def resume():
        try:
            loop.resume(SimpleNamespace(resume=True), run, session, None, print)
        except CheckpointError as error:
            ended.append(str(error))

    thread = threading.Thread(target=resume, daemon=True)
    thread.start()
    thread.join(timeout=30)
    if thread.is_alive():  # blocked in the read: a writer's open lets it go, at EOF
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(timeout=30)
    assert ended == [f"checkpoint {fifo} is not a regular file; delete it to resume from the one before"]


def test_replicas_resuming_from_different_checkpoints_are_one_line(tmp_path):
    """Of other steps, or none; or of the same step but another file (another run's)."""
    ours, theirs = tmp_path / "step_000020.pt", tmp_path / "theirs" / "step_000020.pt"
    theirs.parent.mkdir()
    ours.write_bytes(b"weights" * 400_000)  # read a MiB at a time: 2.8 MB
    theirs.write_bytes(b"weightz" * 400_000)
    crc = lambda path: zlib.crc32(path.read_bytes()) >> 1  # noqa: E731
    distributed.check_same_checkpoint((20, ours), Gathered([[20, crc(ours)], [20, crc(ours)]]))
    distributed.check_same_checkpoint((20, tmp_path / "gone"), Gathered([[]]))  # one process: nothing read
    with pytest.raises(CheckpointError) as refused:
        distributed.check_same_checkpoint(None, Gathered([[20, crc(ours)], [-1, 0], [10, crc(theirs)]], rank=1))
    assert str(refused.value) == ("--resume: the replicas' run folders hold different latest checkpoints (replica "
                                  "0: step 20, 1: none, 2: step 10): each reads its own --out, which must hold the "
                                  "one run (a file system the machines share)")
    assert refused.value.quiet and refused.value.exit_code == 1
    with pytest.raises(CheckpointError) as refused:
        distributed.check_same_checkpoint((20, ours), Gathered([[20, crc(ours)], [20, crc(theirs)]], noun="workers"))
    assert str(refused.value) == (f"--resume: the workers' latest checkpoints are of the same step (20) but not the "
                                  f"same file (here: {ours}): each reads its own --out, which must hold the one run "
                                  "(a file system the machines share)")
    assert not refused.value.quiet and refused.value.exit_code == 1
    # a dangling link (a file removed after the listing, or unreadable, alike): a traceback
    (tmp_path / "step_000030.pt").symlink_to(tmp_path / "gone")
    with pytest.raises(CheckpointError) as refused:
        distributed.check_same_checkpoint((30, tmp_path / "step_000030.pt"), Gathered([[0, 0], [0, 0]]))
    assert str(refused.value) == (f"checkpoint {tmp_path / 'step_000030.pt'} is unreadable (No such file or "
                                  "directory); delete it to resume from the one before")


def two_replicas(tmp_path, *flags: str, own_flags: dict) -> list[tuple[str, str, str]]:
    """torchrun's two replicas of the vanilla GAN, each with its own command line as on two
    machines: the shared `flags` and its `own_flags`. How each ended (`ended`), its stdout and
    its stderr. (Joined by hand instead, rank 0 held the rendezvous store, and its exit could
    abort rank 1's teardown: once in three suites.)"""
    folder = tmp_path / "replicas"
    folder.mkdir()
    finish(start_replicas(folder, SCRIPTS["vanilla_gan"], *flags, own_flags=own_flags), timeout=TIMEOUT_S)
    return [(ended(folder, rank), replica_output(folder, rank, "stdout"), replica_output(folder, rank, "stderr"))
            for rank in (0, 1)]


def assert_one_line_from_rank_0(results, code: int, line: str):
    (code0, _, err0), (code1, _, err1) = results
    assert (code0, code1) == (str(code), str(code)), (err0[-2000:], err1[-2000:])
    assert [text for text in err0.splitlines() if text.startswith("error:")] == [f"error: {line}"], err0[-2000:]
    # No Python traceback, and no C++ abort as a replica exits on what it gathered ("terminate
    # called without an active exception": 7 of 36 runs of the --resume test, before the exit
    # waited for gloo's thread to let go of the gathered tensors), rank 1 quiet.
    for text in (err0, err1):
        assert "Traceback" not in text and "terminate called" not in text, text[-2000:]
    assert not any(text.startswith("error:") for text in err1.splitlines()), err1[-2000:]


def test_replicas_started_with_different_flags_end_before_training_with_one_line(tmp_path):
    """Rank 1 asks for more iterations. They used to train until rank 0 finished, which then
    aborted, and rank 1 lost contact."""
    results = two_replicas(tmp_path, *FAST, own_flags={rank: ["--out", str(tmp_path / f"run{rank}"), "--iters",
                                                              str(2 + rank)] for rank in (0, 1)})
    assert_one_line_from_rank_0(results, 2, "the replicas were started with different --iters (here: --iters 2): "
                                "start every one with the same flags (only --data-dir, --out, --init-from, "
                                "--workers may differ)")
    assert not (tmp_path / "run0").exists() and not (tmp_path / "run1").exists()


def test_replicas_resuming_from_folders_that_hold_different_checkpoints_end_with_one_line(tmp_path):
    """Each replica reads the latest checkpoint in its own --out. Rank 1's held none: a
    TypeError traceback; an older copy of the run: the replicas trained on from other weights
    until their collectives came apart (gloo's abort)."""
    flags = [*FAST[:-2], "--batch-size", "32", "--checkpoint-every", "2"]
    train_alone = run_script(SCRIPTS["vanilla_gan"], "--out", str(tmp_path / "run"), *flags, "--iters", "4")
    assert train_alone.returncode == 0, train_alone.stderr[-2000:]
    (tmp_path / "empty").mkdir()
    results = two_replicas(tmp_path, *flags, "--resume", "--iters", "6",
                           own_flags={0: ["--out", str(tmp_path / "run")], 1: ["--out", str(tmp_path / "empty")]})
    assert_one_line_from_rank_0(results, 1, "--resume: the replicas' run folders hold different latest checkpoints "
                                "(replica 0: step 4, 1: none): each reads its own --out, which must hold the one "
                                "run (a file system the machines share)")
    assert sorted(path.name for path in (tmp_path / "run" / "checkpoints").iterdir()) == [
        "step_000002.pt", "step_000004.pt"]


def test_replicas_resuming_from_another_runs_checkpoint_of_the_same_step_end_with_one_line(tmp_path):
    """Rank 1's copy of the run holds a checkpoint of step 4 from another seed: the replicas
    trained on from other weights in silence, DDP averaging their gradients."""
    flags = [*FAST[:-2], "--batch-size", "32", "--checkpoint-every", "2", "--iters", "4"]
    for seed in (0, 1):
        made = run_script(SCRIPTS["vanilla_gan"], "--out", str(tmp_path / f"seed{seed}"), *flags, "--seed", str(seed))
        assert made.returncode == 0, made.stderr[-2000:]
    shutil.copytree(tmp_path / "seed0", tmp_path / "copy")
    shutil.copy(tmp_path / "seed1" / "checkpoints" / "step_000004.pt", tmp_path / "copy" / "checkpoints")
    results = two_replicas(tmp_path, *flags[:-1], "6", "--resume",
                           own_flags={0: ["--out", str(tmp_path / "seed0")], 1: ["--out", str(tmp_path / "copy")]})
    assert_one_line_from_rank_0(results, 1, "--resume: the replicas' latest checkpoints are of the same step (4) but "
                                f"not the same file (here: {tmp_path / 'seed0' / 'checkpoints' / 'step_000004.pt'}): "
                                "each reads its own --out, which must hold the one run (a file system the machines "
                                "share)")
    assert sorted(path.name for path in (tmp_path / "seed0" / "checkpoints").iterdir()) == [
        "step_000002.pt", "step_000004.pt"]


def test_replicas_starting_from_other_init_from_weights_end_with_one_line(tmp_path):
    """--init-from may name its file at another path on each machine; another file trained the
    replicas apart in silence (loaded after DDP's broadcast of the initial weights)."""
    for seed in (0, 1):
        made = run_script(SCRIPTS["vanilla_gan"], "--out", str(tmp_path / f"seed{seed}"), *FAST, "--iters", "1",
                          "--seed", str(seed))
        assert made.returncode == 0, made.stderr[-2000:]
    results = two_replicas(tmp_path, *FAST, "--iters", "2", "--out", str(tmp_path / "run"),
                           own_flags={rank: ["--init-from", str(tmp_path / f"seed{rank}")] for rank in (0, 1)})
    assert_one_line_from_rank_0(results, 1, "the replicas loaded different --init-from weights (here: "
                                f"{tmp_path / 'seed0' / 'initial_weights.npz'}): every one must load the same file "
                                "(its own --init-from may name it at another path)")
    assert not (tmp_path / "run").exists()


def test_replicas_reading_other_files_end_before_training_with_one_line(tmp_path):
    """--data-dir may differ (a shared folder mounted elsewhere), the files it names may not:
    other images trained in silence, each replica on its own data, and images of another size
    (here) ended in DDP's traceback, as the networks were built from them."""
    from PIL import Image

    for rank in (0, 1):
        for index in range(32):
            side = 8 + 4 * rank
            pixels = np.random.default_rng([rank, index]).integers(0, 256, (side, side), dtype=np.uint8)
            (tmp_path / f"data{rank}" / "digits").mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels).save(tmp_path / f"data{rank}" / "digits" / f"{index}.png")
    flags = ["--dataset", "folder", "--iters", "2", "--out", str(tmp_path / "run"), *FAST[2:-2], "--batch-size", "32"]
    results = two_replicas(tmp_path, *flags, own_flags={rank: ["--data-dir", str(tmp_path / f"data{rank}")]
                                                        for rank in (0, 1)})
    assert_one_line_from_rank_0(results, 1, "the replicas hold different training data (here: 32 examples of "
                                "(8, 8, 1), uint8): every one must read the same files (its own --data-dir may name "
                                "them at another path)")
    assert not (tmp_path / "run").exists()


# --- flags --------------------------------------------------------------------------------

def test_sync_bn_outside_torchrun_or_on_cpu_is_one_line(tmp_path):
    outside = run_script(SCRIPTS["dcgan"], "--sync-bn", "--iters", "1", "--out", str(tmp_path / "a"))
    on_cpu = run_script(SCRIPTS["dcgan"], "--sync-bn", "--iters", "1", "--out", str(tmp_path / "b"),
                        env={**os.environ, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"})
    for result, words in ((outside, "launch with torchrun"), (on_cpu, "needs CUDA")):
        assert result.returncode == 2, result.stderr
        assert words in result.stderr and "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_sync_bn_on_a_cpu_is_refused_only_for_a_model_with_batch_norm(monkeypatch):
    """Under torchrun on a CPU, --sync-bn on the vanilla GAN (no batch norm) was refused as
    needing CUDA, where TensorFlow notes the flag ignored; DCGAN's is refused as before."""
    from common.errors import UsageError
    from common.pytorch import runtime

    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)

    def joined(*args, **kwargs):  # past the flag's check: the join itself
        raise RuntimeError("no other replica here")

    monkeypatch.setattr(runtime.dist, "init_process_group", joined)
    with pytest.raises(UsageError, match="--sync-bn needs CUDA GPUs"):
        runtime.start_replicas("cpu", sync_bn=True, batch_norm=True)
    with pytest.raises(UserError, match="could not join the other replicas"):
        runtime.start_replicas("cpu", sync_bn=True, batch_norm=False)


@pytest.mark.parametrize("model, refused", [("vanilla_gan", False), ("dcgan", True)])
def test_a_script_under_torchrun_on_a_cpu_refuses_sync_bn_only_for_a_model_with_batch_norm(model, refused,
                                                                                            monkeypatch):
    """The scripts' setup hands the model's batch norm to start_replicas: the vanilla GAN's
    --sync-bn is let through to the join; DCGAN's is refused before it."""
    from common.config import parse_args
    from common.pytorch import runtime

    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)

    def joined(*args, **kwargs):  # past the flag's check: the join itself
        raise RuntimeError("no other replica here")

    monkeypatch.setattr(runtime.dist, "init_process_group", joined)
    cfg = parse_args(model, "pytorch", ["--sync-bn", "--device", "cpu"])
    with pytest.raises(UserError) as error:
        runtime.setup(cfg, log=lambda *args: None)
    said = "--sync-bn needs CUDA GPUs" if refused else "could not join the other replicas"
    assert said in str(error.value), error.value


@pytest.mark.parametrize("environment, words", [
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not an integer"),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "x"}, "LOCAL_RANK='x' is not an integer"),
    ({"WORLD_SIZE": "2", "RANK": "5", "LOCAL_RANK": "0"},
     "RANK 5 and LOCAL_RANK 0 must be from 0 to WORLD_SIZE - 1 (1)"),  # it waited
    # a WORLD_SIZE left in a shell: the join said "environment variable RANK expected, but not set"
    ({"WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "WORLD_SIZE is 2, but RANK is not set: launch with torchrun, which "
                                             "sets both (a WORLD_SIZE left in this shell: unset it)"),
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "-1"}, "must be from 0 to WORLD_SIZE - 1"),
])
def test_a_hand_set_torchrun_environment_is_checked(monkeypatch, environment, words):
    from common.errors import UsageError
    from common.pytorch import runtime

    for name in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UsageError, match=re.escape(words)):
        runtime.launched_by_torchrun()


def test_torchrun_is_recognised_by_its_world_size(monkeypatch):
    from common.pytorch import runtime

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not runtime.launched_by_torchrun()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not runtime.launched_by_torchrun()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert runtime.launched_by_torchrun()
    monkeypatch.delenv("LOCAL_RANK")  # one process per machine, joined by hand or an srun wrapper
    assert runtime.launched_by_torchrun()


@pytest.mark.parametrize("joins_in_s", [0.5, 0.0])
def test_a_replica_slow_to_join_says_what_it_waits_for(joins_in_s, monkeypatch, capsys):
    """WORLD_SIZE left in the environment: the process waited 10 minutes for replicas that never
    came, saying nothing, and Ctrl-C did not stop it. A join slower than JOIN_NOTICE_S says so,
    one that ends sooner does not."""
    from common.errors import UserError
    from common.pytorch import runtime

    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(runtime, "JOIN_NOTICE_S", 0.1)

    def no_other_replica(*args, **kwargs):  # as gloo ends the wait, at its timeout
        time.sleep(joins_in_s)
        raise RuntimeError("Timed out waiting for clients")

    monkeypatch.setattr(runtime.dist, "init_process_group", no_other_replica)
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(UserError, match="could not join the other replicas"):
        runtime.start_replicas("cpu", sync_bn=False)
    assert {signum: signal.getsignal(signum) for signum in before} == before  # the join's handlers undone
    time.sleep(0.2)  # past the notice's time: cancelled, it stays unsaid
    notice = ("waiting for the other 1 replica(s) at 127.0.0.1:29999 (WORLD_SIZE 2 in the environment: "
              "torchrun's, or left over?); up to 10 minutes, Ctrl-C stops it\n")
    assert capsys.readouterr().err == (notice if joins_in_s else "")


@pytest.mark.parametrize("signum, reader_gone", [(signal.SIGINT, False), (signal.SIGTERM, False),
                                                 (signal.SIGINT, True)])
def test_a_signal_while_joining_ends_the_process_with_one_line(signum, reader_gone, tmp_path):
    """WORLD_SIZE left in the environment and no other replica: the join waits in C++, where
    Python's handlers do not run. Ctrl-C ended the process silently (the kernel's default),
    and SIGTERM waited on: now each says one line and exits at once, even when the reader of
    its stderr is gone (`| tee`, ended by the same Ctrl-C), where the line cannot be written."""
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    command = [sys.executable, str(REPO / SCRIPTS["vanilla_gan"]), "--out", str(tmp_path / "run"), "--iters", "2",
               *FAST]
    stderr_read, stderr_written = os.pipe()
    process = subprocess.Popen(command, cwd=REPO, env=env, stderr=stderr_written)
    os.close(stderr_written)
    err = b""
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # joining once the process group's store listens on MASTER_PORT
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", int(env["MASTER_PORT"]))) == 0:
                    break
            assert process.poll() is None, "the script ended before it joined"
            time.sleep(0.2)
        time.sleep(1.0)  # inside init_process_group, past the store's start
        if reader_gone:
            os.close(stderr_read)
        process.send_signal(signum)
        process.wait(timeout=30)
        if not reader_gone:
            with os.fdopen(stderr_read, "rb") as reader:
                err = reader.read()
    finally:
        process.kill()
        process.wait()
    assert process.returncode == 128 + signum, err
    if not reader_gone:
        assert err.decode().strip() == (f"error: interrupted ({signal.Signals(signum).name}) while joining the other "
                                        "replicas; nothing was trained"), err
    assert not (tmp_path / "run").exists()


def test_a_signal_while_joining_ends_a_replica_other_than_rank_0_silently(tmp_path):
    """torchrun's terminal is every replica's: rank 0 alone says the interrupted join's line
    (each replica saying it printed it once per replica); the others exit with the signal's status."""
    with socket.socket() as server:  # the store rank 0 would serve: rank 1 connects, then waits in C++
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(1)
        env = {**os.environ, "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(server.getsockname()[1])}
        command = [sys.executable, str(REPO / SCRIPTS["vanilla_gan"]), "--out", str(tmp_path / "run"),
                   "--iters", "2", *FAST]
        process = subprocess.Popen(command, cwd=REPO, env=env, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 120
            while True:  # a script that dies before it connects fails the test now, not in 120 s
                assert process.poll() is None, process.communicate()[1]
                assert time.monotonic() < deadline, "the replica never connected"
                try:
                    connection, _ = server.accept()
                    break
                except TimeoutError:
                    continue
            with connection:
                time.sleep(1.0)  # inside init_process_group
                process.send_signal(signal.SIGINT)
                _, err = process.communicate(timeout=30)
        finally:
            process.kill()
            process.wait()
    assert process.returncode == 128 + signal.SIGINT, err
    assert err == b"", err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("slow", [True, False])
def test_a_slow_join_that_succeeds_says_it_joined(slow, monkeypatch, capsys):
    """After the notice, the wait's end is said too: the notice alone read as a wait still going."""
    from common.pytorch import runtime

    for name, value in {"WORLD_SIZE": "3", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(runtime, "JOIN_NOTICE_S", 0.1 if slow else 60)

    def join(*args, **kwargs):  # slow: the other replicas come once the notice has been said
        if slow:
            for timer in [t for t in threading.enumerate() if isinstance(t, threading.Timer)]:
                timer.join(timeout=10)

    monkeypatch.setattr(runtime.dist, "init_process_group", join)
    monkeypatch.setattr(runtime.dist, "get_rank", lambda *args: 0)
    monkeypatch.setattr(runtime.dist, "get_world_size", lambda *args: 3)
    registered = []  # not run: no process group to leave
    monkeypatch.setattr(runtime.atexit, "register", lambda *args: registered.append(args))
    replicas = runtime.start_replicas("cpu", sync_bn=False)
    assert (replicas.rank, replicas.count) == (0, 3)
    assert registered == [(runtime._leave, replicas)]  # the exit waits for the collectives' tensors
    err = capsys.readouterr().err
    if slow:
        assert err.startswith("waiting for the other 2 replica(s) at 127.0.0.1:29999 ")
        assert re.search(r"\njoined the other 2 replica\(s\) after [01] s\n$", err), err
    else:
        assert err == ""


# --- two replicas against one process -------------------------------------------------------

def test_wgan_gp_replicas_shard_each_critic_batch_as_one_process_trains(tmp_path):
    """WGAN-GP splits its batch in 5 critic batches, each sharded on its own (with its noise),
    so that 2 replicas train as one process does; sharding the whole batch gives replica 0 the
    first critic batches whole. At lr 1e-5, beta1 0 (TensorFlow's twin test says why), 10 steps."""
    flags = ["--dataset", "ring8", "--iters", "10", "--data-limit", "512", "--log-every", "5", "--sample-every",
             "0", "--checkpoint-every", "10", "--no-tensorboard", "--batch-size", "320", "--lr", "1e-5",
             "--beta1", "0", "--width", "4"]
    alone = run_script(SCRIPTS["wgan_gp"], "--out", str(tmp_path / "alone"), *flags, env=replica_environment())
    assert alone.returncode == 0, alone.stderr
    together = torchrun(SCRIPTS["wgan_gp"], "--out", str(tmp_path / "together"), *flags)
    assert together.returncode == 0, together.stderr[-3000:]
    alone_state, together_state = checkpoint(tmp_path / "alone", 10), checkpoint(tmp_path / "together", 10)
    apart = torch.cat([(alone_state["modules"][name][key].float() - together_state["modules"][name][key].float())
                       .abs().flatten() for name in alone_state["modules"] for key in alone_state["modules"][name]
                       if alone_state["modules"][name][key].is_floating_point()])
    # Adam's step is about lr * sign(g): a gradient within rounding of zero (a unit active on
    # every example, the critic's output bias), summed in another order, may step the other way
    # (the TensorFlow twin's assert_equal_but_for_sign_flips); a few such entries, not more
    print(f"apart: {int((apart > 1e-5).sum())} of {apart.numel()}, max {apart.max():.2g}")
    assert (apart > 1e-5).sum() <= 0.001 * apart.numel(), f"{int((apart > 1e-5).sum())} of {apart.numel()} apart"


@pytest.mark.parametrize("model,dataset,second_half", [
    ("vanilla_gan", "mnist", "two replicas"), ("lsgan", "ring8", None), ("vae", "mnist", "one process")])
def test_two_replicas_end_with_the_weights_of_one_process(tmp_path, capfd, model, dataset, second_half):
    """float32, 20 steps: equal to float32 summation rounding. With `second_half`, the two
    replicas stop at step 10 and the last 10 steps resume from their checkpoint, under two
    replicas again or in one process. On ring8 D judges packs of 2 points (PacGAN): each
    replica packs its own half of the batch as one process packs the whole. Without, the run
    of two replicas is then evaluated by scripts/evaluate.py in one process."""
    script = SCRIPTS[model]
    flags = [*FAST, "--dataset", dataset, *(GAN_FLAGS if model != "vae" else [])]  # each rank moves its own average
    alone = run_script(script, "--iters", "20", "--out", str(tmp_path / "alone"), *flags, env=replica_environment())
    assert alone.returncode == 0, alone.stderr
    together = tmp_path / "together"
    first = torchrun(script, "--iters", "10" if second_half else "20", "--out", str(together), *flags)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "2 replicas (DDP, gloo)" in first.stdout
    if second_half == "two replicas":  # rank 0 evaluates alone, the summary written, rank 1 let go
        second = torchrun(script, "--iters", "20", "--resume", "--out", str(together), *flags, "--evaluate", "20")
    elif second_half == "one process":
        second = run_script(script, "--iters", "20", "--resume", "--out", str(together), *flags,
                            env=replica_environment())
    if second_half:
        assert second.returncode == 0, second.stderr[-3000:]
        assert "resumed from" in second.stdout
    if second_half == "two replicas":
        assert "evaluation (20 samples): fid " in second.stdout
        assert {"fid", "precision", "recall"} <= set(json.loads((together / "summary.json").read_text())["metrics"])
    alone_state, together_state = checkpoint(tmp_path / "alone", 20), checkpoint(together, 20)
    assert max_weight_difference(alone_state["modules"], together_state["modules"]) <= 1e-5
    if model != "vae":
        averaged = {name: average["module"] for name, average in alone_state["averages"].items()}
        assert averaged and max_weight_difference(
            averaged, {name: average["module"] for name, average in together_state["averages"].items()}) <= 1e-5
    # rank 0 alone wrote the folder: one history row per log point, the losses averaged
    history = [line for line in (together / "history.jsonl").read_text().splitlines() if line]
    assert len(history) == 4
    alone_losses = (tmp_path / "alone" / "history.jsonl").read_text().splitlines()
    for mine, theirs in zip(history, alone_losses):
        mine, theirs = json.loads(mine), json.loads(theirs)
        for key in theirs:
            if key.endswith("loss") or key in ("recon", "kl"):
                assert math.isclose(mine[key], theirs[key], rel_tol=1e-4), key
    if second_half is None:
        evaluated_in_one_process(together, 20, capfd)


@pytest.mark.parametrize("model", ["vanilla_gan", "vae"])
def test_bfloat16_replicas_average_the_gradient_of_one_process(tmp_path, model):
    """Under bfloat16 autocast each replica's weight gradient is rounded to bfloat16 before
    the all-reduce (a sum over 32 examples rounds otherwise than one over 64), so the two
    agree to bfloat16's precision, not float32's. After one step Adam's first moment is
    (1 - beta1) x the gradient: the averaged gradient, compared tensor by tensor. Replicas
    that do not average (no DDP) miss by 99% (GAN) and 30% (VAE) of its norm, far past 2%."""
    script = SCRIPTS[model]
    flags = ["--amp", "--amp-dtype", "bfloat16", "--iters", "1", *FAST]
    alone = run_script(script, "--out", str(tmp_path / "alone"), *flags, env=replica_environment())
    assert alone.returncode == 0, alone.stderr
    together = torchrun(script, "--out", str(tmp_path / "together"), *flags)
    # its log too: once (1 run in many) a replica ended in a C++ abort, "terminate called without
    # an active exception", and stderr's tail alone did not say whether it had trained
    assert together.returncode == 0, together.stdout[-2000:] + together.stderr[-6000:]
    mine, theirs = checkpoint(tmp_path / "together", 1), checkpoint(tmp_path / "alone", 1)
    compared = 0
    for name, optimizer in theirs["optimizers"].items():
        for index, state in optimizer["state"].items():
            gradient, averaged = state["exp_avg"], mine["optimizers"][name]["state"][index]["exp_avg"]
            assert (averaged - gradient).norm() <= 2e-2 * gradient.norm(), (name, index)
            compared += 1
    assert compared >= 4


def test_dcgan_replicas_hold_identical_weights(tmp_path):
    """DCGAN's batch norm keeps per-replica statistics on CPU, so it does not train as one
    process would; but the gradients are averaged, so every replica holds the same weights."""
    out = tmp_path / "dcgan"
    result = torchrun("tests/replica_probe.py", SCRIPTS["dcgan"], "--iters", "5", "--width", "8",
                      "--out", str(out), *FAST)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    parameters = {name: dict(network.named_parameters()) for name, network in
                  _dcgan_networks().items()}
    for name, weights in parameters.items():
        for key in weights:
            assert torch.equal(ranks[0][name][key], ranks[1][name][key]), (name, key)
    saved = checkpoint(out, 5)["modules"]  # what rank 0 wrote is what the ranks hold
    for name, weights in parameters.items():
        for key in weights:
            assert torch.equal(saved[name][key], ranks[0][name][key]), (name, key)


def _dcgan_networks():
    from GAN.dcgan.dcgan_pytorch import build_networks
    return build_networks((1, 28, 28), 8)


def test_a_batch_that_does_not_divide_among_the_replicas_is_one_line(tmp_path):
    result = torchrun("GAN/wgan_gp/wgan_gp_pytorch.py", "--dataset", "ring8", "--iters", "1",
                      "--out", str(tmp_path / "w"), *FAST[:-2], "--batch-size", "325")
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert ours == ["error: --batch-size 325 does not divide among 2 replicas x 5 parts of each "
                    "step's batch: use a multiple of 10 (the global batch; each replica trains on batch / 2)"]


# --- stopping -------------------------------------------------------------------------------

# What each replica of the stop tests runs: the model script, in the process torchrun started
# (the pid the signals reach), and then how it ended, written to <folder>/rank<RANK>: its exit
# status, or the exception it raised. torchrun's own report cannot say: it names no replica's
# status when it is stopped itself (a Ctrl-C), and a replica that its closing SIGTERM reaches
# after the replica's own sys.exit it reports as killed by that SIGTERM.
# That closing SIGTERM (torchrun sends it to the others when one replica ends) is ignored here:
# it could otherwise land after the run has left its stop handler (common/loop.py's StopRequest,
# which restores the handler it found) and before the record is written, and kill the replica
# with its status unsaid (seen once with two pytest workers on 2 cores). While the run trains,
# its own handler replaces this one, so the stop tests' signals reach it as before; a replica
# that hangs instead of ending is still killed by torchrun, and then reads "killed".
EXIT_RECORDER = """\
import json
import os
import runpy
import signal
import sys
from pathlib import Path

folder, sys.argv = Path(sys.argv[1]), sys.argv[2:]
sys.argv += json.loads(os.environ.get(f"OWN_FLAGS_{os.environ['RANK']}", "[]"))  # this replica's own
signal.signal(signal.SIGTERM, signal.SIG_IGN)


def record(how):
    (folder / f"rank{os.environ['RANK']}").write_text(str(how))


try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as stop:
    record(0 if stop.code is None else stop.code)
    raise
except BaseException as error:
    record(f"raised {type(error).__name__}")
    raise
record(0)
"""


def start_replicas(folder: Path, script: str, *flags: str, own_flags: dict | None = None) -> subprocess.Popen:
    """torchrun's replicas of `script`, each one's stdout and stderr in files of its own under
    `folder` (replica_output: torchrun mixes them on its own), and how it ended too (ended);
    `own_flags`: more flags for some of them, by rank."""
    recorder, statuses = folder / "exit_recorder.py", folder / "ended"
    recorder.write_text(EXIT_RECORDER)
    statuses.mkdir()
    launcher = ("--log-dir", str(folder / "logs"), "--redirects", "3")
    environment = {**replica_environment(), **{f"OWN_FLAGS_{rank}": json.dumps(flags_of_rank)
                                               for rank, flags_of_rank in (own_flags or {}).items()}}
    return subprocess.Popen(torchrun_command(str(recorder), str(statuses), script, *flags, launcher=launcher),
                            cwd=REPO, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def replica_output(folder: Path, rank: int, stream: str) -> str:
    """What replica `rank` wrote to `stream` ("stdout" or "stderr"): torchrun's --redirects
    keeps it in <--log-dir>/<run id>_<random>/attempt_0/<local rank>/<stream>.log."""
    found = list((folder / "logs").glob(f"*/attempt_0/{rank}/{stream}.log"))
    assert len(found) == 1, found
    return found[0].read_text()


def ended(folder: Path, rank: int) -> str:
    """How replica `rank` ended: its exit status ("130"), "raised <Exception>", or "killed" by a
    signal before it could say."""
    status = folder / "ended" / f"rank{rank}"
    return status.read_text() if status.exists() else "killed"


def wait_for_training(run: Path, process: subprocess.Popen, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        if (run / "history.jsonl").exists() and (run / "history.jsonl").read_text().strip():
            return
        time.sleep(0.2)
    raise AssertionError("the replicas did not start training")


def worker_pids(process: subprocess.Popen) -> dict[int, int]:
    """{rank: pid} of torchrun's workers."""
    found = {}
    for task in Path(f"/proc/{process.pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = [entry for entry in environment if entry.startswith(b"RANK=")]
            if rank:
                found[int(rank[0][5:])] = int(pid)
    return found


def finish(process: subprocess.Popen, timeout: float = 60) -> tuple[int, str, str]:
    """torchrun's exit status, stdout and stderr; a hang fails the test (TimeoutExpired)."""
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    return process.returncode, out, err


def test_a_float16_checkpoint_between_log_steps_counts_skips_on_every_replica(tmp_path):
    """A checkpoint between two log steps reads the open interval's skipped steps, an
    all-reduce under torchrun: every replica takes part, or rank 0 would wait in it alone
    (or pair it with another replica's gradient all-reduce)."""
    run = tmp_path / "run"
    flags = [*FAST, "--log-every", "4", "--checkpoint-every", "3", "--sample-every", "5"]
    result = torchrun(SCRIPTS["vanilla_gan"], "--out", str(run), "--iters", "6", "--amp", "--amp-dtype",
                      "float16", "--init-scale", "1.8e19", *GAN_FLAGS, *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    # at a scale of 1.8e19 every step's float16 gradients overflow: all six are skipped
    skipped = [row["skipped_total"] for row in map(json.loads, (run / "history.jsonl").read_text().splitlines())]
    assert skipped == [4, 6] and checkpoint(run, 3)["meta"]["skipped_total"] == 3


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm to rank 1"])
def test_a_stop_request_stops_every_replica_with_one_checkpoint(tmp_path, how):
    run = tmp_path / "run"
    process = start_replicas(tmp_path, SCRIPTS["vanilla_gan"], "--out", str(run), *UNTIL_STOPPED)
    stop_signal = signal.SIGINT if how == "ctrl-c" else signal.SIGTERM
    try:
        wait_for_training(run, process)
        if how == "ctrl-c":
            os.killpg(process.pid, signal.SIGINT)  # the terminal's Ctrl-C reaches every process
        else:
            os.kill(worker_pids(process)[1], signal.SIGTERM)
    finally:
        code, _, launcher_err = finish(process)
    assert code != 0, launcher_err[-3000:]
    errors = [replica_output(tmp_path, rank, "stderr") for rank in (0, 1)]
    # every replica saw the request through: the stop path's exit, 128 + the signal, not an exception
    assert [ended(tmp_path, rank) for rank in (0, 1)] == [str(128 + stop_signal)] * 2, errors
    for err in errors:
        assert "Traceback" not in err and not re.search(r"^error:", err, re.MULTILINE), err
    assert f"{stop_signal.name}: finishing this step and saving a checkpoint" in errors[1]
    assert "stopped at step" in replica_output(tmp_path, 0, "stdout")
    resume_from_the_only_checkpoint(SCRIPTS["vanilla_gan"], run, errors[0][-3000:])


def test_a_killed_replica_ends_the_others_with_one_line(tmp_path):
    run = tmp_path / "run"
    process = start_replicas(tmp_path, SCRIPTS["vanilla_gan"], "--out", str(run), *UNTIL_STOPPED)
    try:
        wait_for_training(run, process)
        os.kill(worker_pids(process)[1], signal.SIGKILL)
    finally:
        code, _, launcher_err = finish(process)
    assert code != 0, launcher_err[-3000:]
    assert ended(tmp_path, 1) == "killed"
    # rank 0 learns of it at its next collective (torchrun's SIGTERM to it, should that come
    # first, is a stop request, which ends at a collective too) and ends with one line
    err = replica_output(tmp_path, 0, "stderr")
    ours = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(ours) == 1 and "lost contact with another replica" in ours[0], err
    assert "Traceback" not in err, err
    assert ended(tmp_path, 0) == "1", err  # ReplicaFailed's status, a UserError's
