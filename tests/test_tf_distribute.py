"""Data-parallel TensorFlow: --distribute mirrored on two logical CPU devices, and
--distribute multi-worker with two processes on 127.0.0.1 (TF_CONFIG).

Two replicas at a global batch of 64 train as one process at batch 64 does (each takes its
half of every batch and of the noise drawn for it), resume from each other's checkpoints,
and, across workers, stop together on a SIGTERM to one of them and end with one line when
one dies.
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO, UNTIL_STOPPED, evaluated_in_one_process, resume_from_the_only_checkpoint, run_script

FAST = ["--data-limit", "512", "--log-every", "5", "--sample-every", "0", "--checkpoint-every", "0",
        "--no-tensorboard", "--batch-size", "64"]
SCRIPTS = {"vanilla_gan": "GAN/vanilla_gan/gan_tensorflow.py", "lsgan": "GAN/least_squares_gan/lsgan_tensorflow.py",
           "vae": "VAE/vanilla_vae/vae_tensorflow.py", "dcgan": "GAN/dcgan/dcgan_tensorflow.py",
           "wgan_gp": "GAN/wgan_gp/wgan_gp_tensorflow.py"}
MIRRORED = ["--distribute", "mirrored", "--replicas", "2"]
TIMEOUT_S = 240


def weights(run: Path, step: int, prefix: str | tuple = "module/") -> dict[str, np.ndarray]:
    with np.load(run / "checkpoints" / f"step_{step:06d}.npz", allow_pickle=False) as stored:
        return {key: stored[key] for key in stored.files if key.startswith(prefix)}


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    return max(float(np.max(np.abs(a[key].astype(np.float64) - b[key]))) for key in a if a[key].size)


def assert_equal_but_for_sign_flips(a: dict, b: dict, tolerance: float = 1e-5, share: float = 0.001):
    """Every entry within `tolerance` but a few (`share` of them at most, in all the arrays):
    Adam's step is about lr * sign(g), so a gradient within rounding of zero, which the
    replicas' all-reduce sums in another order than one process, can step the other way
    (PyTorch's epsilon, tests/test_twins_train_alike.py). Measured: VAE 2 of 652,824 entries
    (2.6e-5 apart), WGAN-GP 38 of 1,105,411 (3.2e-5), the vanilla GAN none; the print shows
    them when a test fails."""
    assert a.keys() == b.keys() and a
    apart = np.concatenate([np.abs(a[key].astype(np.float64) - b[key]).ravel() for key in a])
    print(f"apart: {int((apart > tolerance).sum())} of {apart.size}, max {apart.max():.2g}")
    assert (apart > tolerance).sum() <= share * apart.size, f"{(apart > tolerance).sum()} of {apart.size} apart"
# The GANs average G (--ema-decay) and run at width 32: at the default 256, Adam turns rounding
# in gradients near zero into lr-sized steps within 20 steps (measured: 1.7e-5 against 4.1e-8
# at width 32, TensorFlow LSGAN), as the DCGAN and WGAN-GP tests' lr 1e-5 avoids.
GAN_FLAGS = ["--ema-decay", "0.9", "--width", "32"]


def assert_same_optimizer_moments(alone: Path, together: Path, step: int, tolerance: float = 1e-4):
    """Adam's first and second moments of every weight at `step`, each within `tolerance` of
    its norm: the weights alone barely see the size of the gradient (Adam's step is about
    lr * sign(g)), so replicas whose losses were not scaled by their share of the batch
    (their summed gradient 2x one process's) ended with one process's weights, but with 2x its
    first moments and 4x its second. Measured: at most 3e-7 of the norm apart (vanilla GAN
    at step 10, LSGAN and VAE at 20); a moment that is 0 alone (no gradient) is 0 together."""
    moments = [{key: value.astype(np.float64) for key, value in weights(run, step, "optimizer/").items()
                if value.ndim >= 1} for run in (alone, together)]  # not the iterations, learning rate, scale
    assert moments[0].keys() == moments[1].keys() and moments[0]
    apart = {key: np.linalg.norm(moments[1][key] - value) / np.linalg.norm(value)
             for key, value in moments[0].items() if np.any(value)}
    worst = max(apart, key=apart.get)
    print(f"moments apart: at most {apart[worst]:.2g} of the norm ({worst})")
    assert apart[worst] <= tolerance, f"{worst}: {apart[worst]:.3g} of its norm apart"
    assert all(not np.any(moments[1][key]) for key in moments[0].keys() - apart.keys())


def train(script: str, out: Path, *flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
    result = run_script(script, "--out", str(out), *flags, timeout=TIMEOUT_S, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


# --- mirrored: two logical CPU devices in one process ----------------------------------------

@pytest.mark.parametrize("model,dataset,second_half", [
    ("vanilla_gan", "mnist", "one process"), ("lsgan", "ring8", None), ("vae", "mnist", "two replicas")])
def test_two_mirrored_replicas_end_with_the_weights_of_one_process(tmp_path, capfd, model, dataset, second_half):
    """float32, 20 steps: equal to float32 summation rounding, the GANs' averaged G
    (--ema-decay, moved once outside the replicas) too, and Adam's moments where the replicas
    took their last step, which see the size of the summed gradient as the weights do not.
    With `second_half`, the replicas stop at step 10 and the last 10 steps resume from their
    checkpoint. On ring8 D judges packs of 2 points (PacGAN): each replica packs its own half
    of the batch as one process packs the whole. Without, the run of two replicas is then
    evaluated by scripts/evaluate.py: the checkpoint of two mirrored replicas is an ordinary one."""
    script = SCRIPTS[model]
    flags = [*FAST, "--dataset", dataset, *(GAN_FLAGS if model != "vae" else [])]
    train(script, tmp_path / "alone", "--iters", "20", *flags, "--checkpoint-every", "10")
    together = tmp_path / "together"
    first = train(script, together, "--iters", "10" if second_half else "20", *flags, *MIRRORED)
    assert "2 replicas (MirroredStrategy)" in first.stdout
    if second_half:
        again = MIRRORED if second_half == "two replicas" else []
        second = train(script, together, "--iters", "20", "--resume", *flags, *again)
        assert "resumed from" in second.stdout
    compared = ("module/", "average/") if model != "vae" else ("module/",)
    alone = weights(tmp_path / "alone", 20, compared)
    assert_equal_but_for_sign_flips(alone, weights(together, 20, compared))
    assert model == "vae" or any(key.startswith("average/") for key in alone)
    assert_same_optimizer_moments(tmp_path / "alone", together, 10 if second_half == "one process" else 20)
    assert json.loads((together / "config.json").read_text())["replicas"] == (1 if second_half == "one process" else 2)
    # the logged losses are the replicas' average: the one-process run's
    alone = [json.loads(line) for line in (tmp_path / "alone" / "history.jsonl").read_text().splitlines()]
    mine = [json.loads(line) for line in (together / "history.jsonl").read_text().splitlines()]
    assert len(mine) == len(alone) == 4
    for ours, theirs in zip(mine, alone):
        for key in theirs:
            if key.endswith("loss") or key in ("recon", "kl"):
                assert ours[key] == pytest.approx(theirs[key], rel=1e-4), key
    if second_half is None:
        evaluated_in_one_process(together, 20, capfd)


def test_wgan_gp_shards_each_critic_batch(tmp_path):
    """WGAN-GP splits its batch in 5 critic batches: each is sharded on its own, with its
    noise, so 2 replicas still train as one process (sharding the whole batch instead ended
    4.9e-4 apart, measured at lambda 10). At lr 1e-5 and beta1 0 (the paper's; the ring's
    default is 0.5): with beta1 = 0, Adam turns gradients that are zero up to rounding (the
    Wasserstein loss is linear in the critic's output, and cancels for units active on every
    example) into steps of about lr, at 1e-4 one 1e-5 apart."""
    flags = ["--dataset", "ring8", "--iters", "10", *FAST[:-2], "--batch-size", "320", "--checkpoint-every", "10",
             "--lr", "1e-5", "--beta1", "0"]
    train(SCRIPTS["wgan_gp"], tmp_path / "alone", *flags)
    train(SCRIPTS["wgan_gp"], tmp_path / "together", *flags, *MIRRORED)
    assert_equal_but_for_sign_flips(weights(tmp_path / "alone", 10), weights(tmp_path / "together", 10))


def test_bfloat16_mirrored_replicas_average_the_gradient_of_one_process(tmp_path):
    """Under mixed_bfloat16 each replica's weight gradient is rounded to bfloat16 before the
    all-reduce, so the replicas agree with one process to bfloat16's precision. After one
    step Adam's first moment is (1 - beta1) x the gradient: compared tensor by tensor."""
    flags = ["--amp", "--amp-dtype", "bfloat16", "--iters", "1", *FAST, "--checkpoint-every", "1"]
    train(SCRIPTS["vae"], tmp_path / "alone", *flags)
    train(SCRIPTS["vae"], tmp_path / "together", *flags, *MIRRORED)
    alone, together = weights(tmp_path / "alone", 1, "optimizer/"), weights(tmp_path / "together", 1, "optimizer/")
    # Keras' Adam holds its iterations and learning rate, then a (first, second) moment per weight
    first_moments = [key for key in alone if alone[key].ndim >= 1 and int(key.rsplit("/", 1)[1]) % 2 == 0]
    compared = 0
    for key in first_moments:
        gradient, averaged = alone[key].astype(np.float64), together[key]
        assert np.linalg.norm(averaged - gradient) <= 2e-2 * np.linalg.norm(gradient), key
        compared += 1
    assert compared >= 4


def test_sync_bn_makes_dcgan_train_on_the_global_batch_statistics(tmp_path):
    """DCGAN has batch norm in G and D: with --sync-bn their statistics are the global
    batch's, so after 20 steps both networks hold one process's weights; without, each replica
    normalises its own half and they do not. At lr 1e-5, as in the WGAN-GP test: behind batch
    norm some of G's first-layer gradients cancel to rounding, which Adam's first steps turn into
    lr-sized moves (measured at the default 2e-4: 5.6e-6 after one step, 1.3e-3 after 20)."""
    flags = ["--width", "8", "--iters", "20", "--lr", "1e-5", *FAST, "--checkpoint-every", "20"]
    train(SCRIPTS["dcgan"], tmp_path / "alone", *flags)
    train(SCRIPTS["dcgan"], tmp_path / "synced", *flags, *MIRRORED, "--sync-bn")
    train(SCRIPTS["dcgan"], tmp_path / "per_replica", *flags, *MIRRORED)
    alone = weights(tmp_path / "alone", 20)
    assert {key.split("/")[1] for key in alone} == {"generator", "discriminator"}
    assert max_difference(alone, weights(tmp_path / "synced", 20)) <= 5e-5      # measured: 3.8e-6
    assert max_difference(alone, weights(tmp_path / "per_replica", 20)) > 5e-4  # measured: 1.8e-3


def test_sync_bn_moves_the_running_variance_by_the_global_batchs_unbiased_variance(tmp_path):
    """As one process does: counting the global batch, not one replica's share. After 5 steps,
    before the weights' float32 drift blurs it: measured 2.6e-7 on a Zen 4, 1.2e-7 with oneDNN
    off, 3.7e-7 with it held to AVX2; counting one replica's share, 6.3e-6 (after 20 steps
    1.7e-6, 1.1e-6, 3.6e-6 and 1.2e-5)."""
    flags = ["--width", "8", "--iters", "5", "--lr", "1e-5", *FAST, "--checkpoint-every", "5"]
    train(SCRIPTS["dcgan"], tmp_path / "alone", *flags)
    train(SCRIPTS["dcgan"], tmp_path / "synced", *flags, *MIRRORED, "--sync-bn")
    alone, synced = weights(tmp_path / "alone", 5), weights(tmp_path / "synced", 5)
    statistics = running_statistics(alone)
    assert len(statistics) == 14  # G's 4 batch norms and D's 3, a mean and a variance each
    assert max_difference({key: alone[key] for key in statistics}, {key: synced[key] for key in statistics}) <= 1.5e-6


def running_statistics(weights_of_run: dict) -> list[str]:
    """The keys of batch norm's moving means and variances: the last two of each run of four
    vectors (scale, shift, mean, variance) in a Keras network's weights."""
    keys, found = list(weights_of_run), []
    for index in range(len(keys) - 3):
        group = keys[index:index + 4]
        if (all(weights_of_run[key].ndim == 1 for key in group) and len({key.split("/")[1] for key in group}) == 1
                and (index == 0 or weights_of_run[keys[index - 1]].ndim != 1)):
            found += group[2:]
    return found


# --- flags ------------------------------------------------------------------------------------

@pytest.mark.parametrize("framework,flags,words", [
    ("pytorch", ["--distribute", "mirrored"], "torchrun --standalone"),
    # named as TensorFlow's, not sent to --distribute mirrored (mutation round 10: went unseen)
    ("pytorch", ["--replicas", "2"], "--replicas is TensorFlow's; PyTorch runs data parallel under torchrun"),
    ("tensorflow", ["--replicas", "2"], "--replicas N goes with --distribute mirrored"),
    # mutation round 10: --replicas with --distribute multi-worker went unseen (it was taken, and unused)
    ("tensorflow", ["--distribute", "multi-worker", "--replicas", "2"], "--replicas N goes with --distribute mirrored"),
    ("tensorflow", ["--sync-bn"], "add --distribute"),
    ("tensorflow", ["--distribute", "mirrored", "--replicas", "2", "--xla"], "keras#21366"),
    # when the flags are read: 100 replicas took 31 s to build before this was found
    ("tensorflow", ["--distribute", "mirrored", "--replicas", "48"], "--batch-size 64 does not divide among 48"),
])
def test_data_parallel_flags_that_do_not_go_together_are_refused(framework, flags, words):
    from common.config import parse_args
    from common.errors import UsageError

    with pytest.raises(UsageError, match=re.escape(words)):
        parse_args("dcgan", framework, flags)


@pytest.mark.parametrize("model,flags,words", [
    # the count the user must use, the first time: 320 was sent to "a multiple of 3" and then,
    # once the networks were built, to 15 (and a ring batch of 126 to 4)
    ("wgan_gp", ["--replicas", "3", "--batch-size", "320"],
     "3 replicas x 5 parts of each step's batch: use a multiple of 15"),
    ("wgan_gp", ["--replicas", "8", "--batch-size", "64"],  # once sent to 60, itself refused next
     "8 replicas x 5 parts of each step's batch: use a multiple of 40"),
    ("vanilla_gan", ["--replicas", "2", "--dataset", "ring8", "--batch-size", "126"],
     "2 replicas x packs of 2 samples: use a multiple of 4"),
    ("lsgan", ["--replicas", "2", "--dataset", "grid25", "--batch-size", "126"],
     "2 replicas x packs of 2 samples: use a multiple of 4"),
])
def test_a_batch_that_does_not_divide_into_replicas_parts_and_packs_is_refused_as_the_flags_are_read(
        model, flags, words):
    from common.config import parse_args
    from common.errors import UsageError

    with pytest.raises(UsageError, match=re.escape(words)):
        parse_args(model, "tensorflow", ["--distribute", "mirrored", *flags])


@pytest.mark.parametrize("flags,tf_config,words", [
    (["--distribute", "mirrored"], None, "needs --replicas N"),
    (["--distribute", "multi-worker"], "", "TF_CONFIG, which is empty"),
    (["--distribute", "multi-worker"], "  \n", "TF_CONFIG, which is empty"),
    (["--distribute", "multi-worker"], '{"cluster": ["a:1"], "task": {"type": "worker", "index": 0}}',
     'TF_CONFIG has no "cluster" object'),  # a list where the object goes: an AttributeError
    (["--distribute", "multi-worker"], "{not json", "TF_CONFIG is not JSON (Expecting property name enclosed in "
                                                    "double quotes: line 1 column 2 (char 1))"),
    (["--distribute", "multi-worker"], "{'cluster': {}}", "TF_CONFIG is not JSON"),  # Python's quotes
    (["--distribute", "multi-worker"], '["a:1"]', 'TF_CONFIG has no "cluster" object: expected'),
    (["--distribute", "multi-worker"], '{"cluster": {"worker": ["a:1"]}}', 'TF_CONFIG has no "task" object, this '
                                                                          "process's type and index"),
    (["--distribute", "multi-worker"], '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker"}}',
     "TF_CONFIG names no task index for this process"),
    (["--distribute", "multi-worker"], '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": true}}',
     "TF_CONFIG names this process's task index true, not an integer"),
    (["--distribute", "multi-worker"], '{"cluster": {"worker": ["a:1"]}, "task": {"type": "chief", "index": 0}}',
     "TF_CONFIG names this process's task type \"chief\", not \"worker\""),
    (["--distribute", "multi-worker"], '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0.0}}',
     "TF_CONFIG names this process's task index 0.0, not an integer"),
    (["--distribute", "multi-worker"], '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 1}}',
     "TF_CONFIG's task index 1 names no worker: the cluster lists 1 worker, whose indices are 0 to 0"),
    (["--distribute", "multi-worker"], '{"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", '
                                       '"index": -1}}', "task index -1 names no worker"),
    (["--distribute", "multi-worker"], '{"cluster": {"worker": []}, "task": {"type": "worker", "index": 0}}',
     'TF_CONFIG lists no workers in cluster.worker (a list of "host:port" strings)'),
    # two workers cannot listen on one port: each waited out the join's timeout
    (["--distribute", "multi-worker"], '{"cluster": {"worker": ["a:1", "b:2", "a:1"]}, "task": {"type": "worker", '
                                       '"index": 0}}', "TF_CONFIG lists a:1 more than once: each worker needs its own"),
    # a string index trained without ever writing (worker "0" is not worker 0), a string or
    # numbers for the workers ended in TensorFlow's traceback, and a parameter server hung
    (["--distribute", "multi-worker"], '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": "0"}}',
     "TF_CONFIG names this process's task index \"0\", not an integer"),
    (["--distribute", "multi-worker"], '{"cluster": {"worker": "a:1"}, "task": {"type": "worker", "index": 0}}',
     "TF_CONFIG lists no workers"),
    (["--distribute", "multi-worker"], '{"cluster": {"worker": ["a:1", 12]}, "task": {"type": "worker", "index": 0}}',
     'TF_CONFIG lists worker 12, not a "host:port" string'),
    (["--distribute", "multi-worker"], '{"cluster": {"worker": ["a:1"], "ps": ["a:2"]}, '
                                       '"task": {"type": "worker", "index": 0}}', "names ps besides the workers"),
    (["--distribute", "multi-worker"], "[" * 100000, "TF_CONFIG is not JSON (nested too deeply)"),
    # no port, or none a socket takes: TensorFlow's C++ error lines came before ours
    (["--distribute", "multi-worker"], '{"cluster": {"worker": ["localhost"]}, "task": {"type": "worker", "index": 0}}',
     "TF_CONFIG's worker 'localhost' is not host:port (a port from 1 to 65535)"),
    (["--distribute", "multi-worker"], '{"cluster": {"worker": ["a:1", "b:70000"]}, '
                                       '"task": {"type": "worker", "index": 0}}', "worker 'b:70000' is not host:port"),
    (["--distribute", "multi-worker"], '{"cluster": {"worker": [":2222"]}, "task": {"type": "worker", "index": 0}}',
     "worker ':2222' is not host:port"),
    (["--distribute", "multi-worker"], '{"cluster": {"worker": ["a:%s"]}, "task": {"type": "worker", "index": 0}}'
     % ("1" * 5000), "is not host:port"),  # past int()'s 4,300 digits: a ValueError of its own
])
def test_a_strategy_that_cannot_start_is_refused_before_tensorflow_sees_it(monkeypatch, flags, tf_config, words):
    from common.config import parse_args
    from common.errors import UsageError
    from common.tensorflow import runtime

    if tf_config is not None:
        monkeypatch.setenv("TF_CONFIG", tf_config)

    def joined(*args, **kwargs):  # a check gone fails here, not after the join's 10-minute wait
        raise AssertionError("reached TensorFlow's join")

    monkeypatch.setattr(runtime.tf.distribute, "MultiWorkerMirroredStrategy", joined)
    monkeypatch.setattr(runtime.tf.distribute, "MirroredStrategy", joined)
    with pytest.raises(UsageError, match=re.escape(words)):
        runtime.start_replicas(parse_args("vanilla_gan", "tensorflow", flags), "cpu")


@pytest.mark.parametrize("rank, torchrun", [("0", True), ("1", True), ("1", False)])
def test_a_tensorflow_script_under_torchrun_is_refused(rank, torchrun, tmp_path, monkeypatch, capsys):
    """torchrun --nproc-per-node 2 gan_tensorflow.py: each process trained the whole job alone,
    both into one run folder (history rows twice), with exit status 0. One line, from rank 0;
    a WORLD_SIZE and RANK 1 left in a shell, no torchrun's, exited 2 saying nothing."""
    from GAN.vanilla_gan import gan_tensorflow

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    if torchrun:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    else:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        gan_tensorflow.main(["--out", str(tmp_path / "run"), "--iters", "2", *FAST])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    if rank == "0" or not torchrun:
        assert err.startswith("error: torchrun launches PyTorch's replicas") and "\n" not in err, err
        assert err.endswith("(WORLD_SIZE is set in this shell: unset it)") != torchrun, err
    else:
        assert err == ""
    assert not (tmp_path / "run").exists()


def test_a_data_parallel_flag_error_is_one_line_from_the_script(tmp_path):
    """The whole path, in a process of its own: the batch refused as the flags are read."""
    result = run_script(SCRIPTS["vanilla_gan"], *MIRRORED[:-1], "3", "--iters", "1", "--out", str(tmp_path / "run"),
                        *FAST)
    assert result.returncode == 2, result.stderr[-2000:]
    ours = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(ours) == 1 and "does not divide among 3 replicas" in ours[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


# --- multi-worker: two processes on 127.0.0.1 -------------------------------------------------

def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for probe in sockets:
        probe.bind(("127.0.0.1", 0))
    ports = [probe.getsockname()[1] for probe in sockets]
    for probe in sockets:
        probe.close()
    return ports


def start_workers(script: str, *flags: str, indices=(0, 1), env=None, own_flags=None, ports=None,
                  stderr=subprocess.PIPE) -> list[subprocess.Popen]:
    """A two-worker cluster on 127.0.0.1 (on `ports`, if given); `indices`: the workers of it
    started; `own_flags`: more flags for some of them, by index; `stderr`: where theirs goes."""
    workers = [f"127.0.0.1:{port}" for port in ports or free_ports(2)]
    processes = []
    for index in indices:
        config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        processes.append(subprocess.Popen(
            [sys.executable, str(REPO / script), "--distribute", "multi-worker", *flags,
             *(own_flags or {}).get(index, [])], cwd=REPO,
            env={**os.environ, "TF_CONFIG": json.dumps(config), "PYTHONUNBUFFERED": "1", **(env or {})},
            stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True))
    return processes


def test_a_worker_whose_peers_never_join_gives_up_in_one_line(tmp_path):
    """TensorFlow waits for the cluster with no end, holding the GIL and taking SIGTERM as a
    pre-emption notice: a worker started alone outlived `timeout` (SIGTERM) for 11 minutes."""
    run = tmp_path / "run"
    (process,) = start_workers(SCRIPTS["vanilla_gan"], "--out", str(run), "--iters", "2", *FAST, indices=(0,),
                               env={"AMPGEN_JOIN_TIMEOUT_S": "3"})
    ((code, _, err, seconds),) = finish([process], timeout=120)
    assert code == -signal.SIGKILL, err[-2000:]
    ours = [line for line in err.splitlines() if line.startswith(("error:", "waiting for"))]
    assert ours == ["waiting for the other 1 worker(s) of TF_CONFIG (each started with --distribute multi-worker and "
                    "its own index?); up to 3 s (AMPGEN_JOIN_TIMEOUT_S), Ctrl-C stops it",
                    "error: the 2 workers of TF_CONFIG did not all join within 3 s (each one started, with its "
                    "own index and a free port?); AMPGEN_JOIN_TIMEOUT_S waits longer"], err[-2000:]
    assert seconds < 60 and not run.exists()


def test_the_join_watchdog_says_joined_only_after_its_notice_and_only_for_a_join(monkeypatch, capfd):
    """In this process, with the notice after 0.3 s: a join that ends sooner says nothing, one
    that fails after the notice does not say it joined, one that succeeds says after how long.
    (Mutation round 13; the watchdog kills this process only at its 60 s deadline.)"""
    from common.tensorflow import runtime

    def watchdog_lines():  # not TensorFlow's own start-up lines, if it is first imported here
        return [line for line in capfd.readouterr().err.splitlines() if line.startswith(("waiting for", "joined"))]

    monkeypatch.setattr(runtime, "JOIN_NOTICE_S", 0.3)
    capfd.readouterr()
    with runtime._given_up_after(60, 2):
        pass
    assert watchdog_lines() == []
    with pytest.raises(RuntimeError), runtime._given_up_after(60, 2):
        time.sleep(2.0)  # the watchdog's own start-up, on a loaded machine, comes before its 0.3 s
        raise RuntimeError("Could not start gRPC server")
    failed = watchdog_lines()
    assert len(failed) == 1 and failed[0].startswith("waiting for the other 1 worker(s) of TF_CONFIG"), failed
    with runtime._given_up_after(60, 2):
        time.sleep(2.0)
    said = watchdog_lines()
    assert len(said) == 2 and said[0].startswith("waiting for"), said
    assert re.fullmatch(r"joined the other workers after [12] s", said[1]), said


def test_a_worker_that_joins_after_saying_what_it_waits_for_says_so(tmp_path):
    """A worker alone printed nothing, not even its banner, until its join timed out (10
    minutes); PyTorch's replicas said what they waited for after 20 s."""
    ports, said_path = free_ports(2), tmp_path / "worker0.err"
    flags = ["--out", str(tmp_path / "run"), "--iters", "2", *FAST]
    with open(said_path, "w") as said_file:
        processes = start_workers(SCRIPTS["vanilla_gan"], *flags, indices=(0,), ports=ports, stderr=said_file,
                                  env={"AMPGEN_JOIN_TIMEOUT_S": "40"})  # says so after 10 s
    try:
        deadline = time.monotonic() + 90
        while "waiting for" not in said_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        processes += start_workers(SCRIPTS["vanilla_gan"], *flags, indices=(1,), ports=ports)
    finally:
        (code0, *_), (code1, _, err1, _) = finish(processes)
    err0 = said_path.read_text()
    assert (code0, code1) == (0, 0), (err0[-2000:], err1[-2000:])
    said = [line for line in err0.splitlines() if line.startswith(("waiting for", "joined"))]
    assert len(said) == 2 and said[0] == ("waiting for the other 1 worker(s) of TF_CONFIG (each started with "
                                          "--distribute multi-worker and its own index?); up to 40 s "
                                          "(AMPGEN_JOIN_TIMEOUT_S), Ctrl-C stops it"), err0[-2000:]
    assert re.fullmatch(r"joined the other workers after \d+ s", said[1]) and int(said[1].split()[-2]) >= 10, said


def join_watchdog(pid: int) -> int | None:
    """The join watchdog of worker `pid`, found by its parent and command line (Linux's /proc)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            command = (stat.parent / "cmdline").read_bytes()
        except OSError:  # ended meanwhile
            continue
        if parent == pid and b"select.select" in command:
            return int(stat.parent.name)
    return None


@pytest.mark.parametrize("signum, to_group", [(signal.SIGTERM, True), (signal.SIGINT, True), (signal.SIGINT, False)],
                         ids=["SIGTERM", "SIGINT", "SIGINT-to-the-worker-alone"])
def test_a_signal_to_a_joining_worker_ends_it_in_one_line(tmp_path, signum, to_group):
    """Ctrl-C, or `timeout`'s or a scheduler's SIGTERM to the process group, while a worker waits
    for the cluster: the join watchdog, in the group too, used to die of it, and the worker,
    which cannot take either signal then, waited on forever (SIGTERM) or for the whole join
    timeout (SIGINT). A SIGINT to the worker's pid alone waited for the join timeout too."""
    run = tmp_path / "run"
    (process,) = start_workers(SCRIPTS["vanilla_gan"], "--out", str(run), "--iters", "2", *FAST, indices=(0,),
                               env={"AMPGEN_JOIN_TIMEOUT_S": "300"})
    try:
        deadline = time.monotonic() + 120
        while not join_watchdog(process.pid) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)  # until the watchdog runs: the worker is joining
        assert join_watchdog(process.pid), "the worker never started to join"
        time.sleep(1.0)  # the watchdog's interpreter has started and set its handlers
        (os.killpg if to_group else os.kill)(process.pid, signum)
    finally:
        ((code, _, err, seconds),) = finish([process], timeout=60)
    assert seconds < 60
    assert code == -signal.SIGKILL, err[-2000:]
    ours = [line for line in err.splitlines() if line.startswith("error:")]
    assert ours == [f"error: interrupted ({signal.Signals(signum).name}) while joining the other workers; "
                    "nothing was trained"], err[-2000:]
    assert not run.exists()


@pytest.mark.parametrize("value", ["0", "soon", "nan"])
def test_a_join_timeout_that_is_not_a_number_of_seconds_is_refused(value, monkeypatch):
    from common.config import parse_args
    from common.errors import UsageError
    from common.tensorflow import runtime

    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}}')
    monkeypatch.setenv("AMPGEN_JOIN_TIMEOUT_S", value)
    with pytest.raises(UsageError, match="AMPGEN_JOIN_TIMEOUT_S must be a number of seconds above 0"):
        runtime.start_replicas(parse_args("vanilla_gan", "tensorflow", ["--distribute", "multi-worker"]), "cpu")


def finish(processes: list[subprocess.Popen], timeout: float = TIMEOUT_S) -> list[tuple[int, str, str, float]]:
    started, results = time.monotonic(), []
    for process in processes:
        try:
            out, err = process.communicate(timeout=max(1.0, timeout - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            out, err = "", "timed out"
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.communicate()
        results.append((process.returncode, out, err, time.monotonic() - started))
    return results


def wait_for_training(run: Path, processes: list[subprocess.Popen], timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and all(p.poll() is None for p in processes):
        history = run / "history.jsonl"
        if history.exists() and history.read_text().strip():
            return
        time.sleep(0.2)
    raise AssertionError("the workers did not start training")


def test_two_workers_train_as_one_process_and_write_one_run_folder(tmp_path):
    script = SCRIPTS["vanilla_gan"]
    flags = ["--iters", "20", "--checkpoint-every", "20", *FAST, *GAN_FLAGS]  # width 32, as the mirrored tests
    train(script, tmp_path / "alone", *flags)
    run = tmp_path / "workers"
    # --evaluate: worker 0 alone, after the summary is written and worker 1 let go
    results = finish(start_workers(script, "--out", str(run), *flags, "--evaluate", "20"))
    (code0, out0, err0, _), (code1, out1, err1, _) = results
    assert code0 == 0 and code1 == 0, (err0[-2000:], err1[-2000:])
    assert "evaluation (20 samples): fid " in out0
    assert {"fid", "precision", "recall"} <= set(json.loads((run / "summary.json").read_text())["metrics"])
    assert "2 replicas (CollectiveAllReduceStrategy, 2 workers)" in out0
    assert out1.strip() == ""  # worker 1 trains silently; worker 0 writes and prints
    assert "waiting for" not in err0 and "joined the other" not in err0  # joined within seconds: nothing said
    compared = ("module/", "average/")  # the average of G, moved once outside the workers, too
    alone = weights(tmp_path / "alone", 20, compared)
    assert any(key.startswith("average/") for key in alone)
    assert max_difference(alone, weights(run, 20, compared)) <= 1e-5
    assert len((run / "history.jsonl").read_text().splitlines()) == 4
    assert json.loads((run / "summary.json").read_text())["replicas"] == 2




def test_workers_started_with_different_flags_end_before_training_with_one_line(tmp_path):
    """Worker 1 asks for more iterations, and reads its data with a loader (--workers, which
    may differ): both used to train until worker 0 finished, then end in TensorFlow's traceback."""
    run = tmp_path / "run"
    results = finish(start_workers(SCRIPTS["vanilla_gan"], "--out", str(run), "--iters", "2", *FAST,
                                   own_flags={1: ["--iters", "3", "--workers", "1"]}))
    (code0, out0, err0, _), (code1, out1, err1, _) = results
    assert (code0, code1) == (2, 2), (err0[-2000:], err1[-2000:])
    ours = [line for line in err0.splitlines() if line.startswith("error:")]
    assert ours == ["error: the workers were started with different --iters (here: --iters 2): start every one "
                    "with the same flags (only --data-dir, --out, --init-from, --workers may differ)"], err0[-2000:]
    assert "Traceback" not in err0 + err1 and out0 + out1 == "" and not any(
        line.startswith("error:") for line in err1.splitlines())
    assert not run.exists()


def assert_one_line_from_worker_0(results, code: int, line: str):
    (code0, out0, err0, _), (code1, out1, err1, _) = results
    assert (code0, code1) == (code, code), (err0[-2000:], err1[-2000:])
    assert [text for text in err0.splitlines() if text.startswith("error:")] == [f"error: {line}"], err0[-2000:]
    assert "Traceback" not in err0 + err1 and not any(text.startswith("error:") for text in err1.splitlines())


def test_workers_resuming_from_folders_that_hold_different_checkpoints_end_with_one_line(tmp_path):
    """Each worker reads the latest checkpoint in its own --out. Worker 1's held none: a
    TypeError traceback; an older copy of the run: the workers trained on from other weights,
    worker 0 wrote a checkpoint and its summary, and both ended in TensorFlow's traceback."""
    flags = [*FAST[:-2], "--batch-size", "32", "--checkpoint-every", "2"]
    train(SCRIPTS["vanilla_gan"], tmp_path / "run", *flags, "--iters", "4")
    shutil.copytree(tmp_path / "run", tmp_path / "older")
    (tmp_path / "older" / "checkpoints" / "step_000004.npz").unlink()
    results = finish(start_workers(SCRIPTS["vanilla_gan"], *flags, "--resume", "--iters", "6",
                                   own_flags={0: ["--out", str(tmp_path / "run")],
                                              1: ["--out", str(tmp_path / "older")]}))
    assert_one_line_from_worker_0(results, 1, "--resume: the workers' run folders hold different latest "
                                  "checkpoints (worker 0: step 4, 1: step 2): each reads its own --out, which must "
                                  "hold the one run (a file system the machines share)")
    assert sorted(path.name for path in (tmp_path / "run" / "checkpoints").iterdir()) == [
        "step_000002.npz", "step_000004.npz"]


def test_workers_reading_other_files_end_before_training_with_one_line(tmp_path):
    """--data-dir may differ (a shared folder mounted elsewhere), the files it names may not:
    other images trained in silence, each worker on its own data, and images of another size
    (here) ended both in a traceback, as the networks were built from them."""
    from PIL import Image

    for index in range(32):
        for worker in (0, 1):
            side = 8 + 4 * worker
            pixels = np.random.default_rng([worker, index]).integers(0, 256, (side, side), dtype=np.uint8)
            (tmp_path / f"data{worker}" / "digits").mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels).save(tmp_path / f"data{worker}" / "digits" / f"{index}.png")
    flags = ["--dataset", "folder", "--iters", "2", "--out", str(tmp_path / "run"), *FAST[2:-2], "--batch-size", "32"]
    results = finish(start_workers(SCRIPTS["vanilla_gan"], *flags,
                                   own_flags={worker: ["--data-dir", str(tmp_path / f"data{worker}")]
                                              for worker in (0, 1)}))
    assert_one_line_from_worker_0(results, 1, "the workers hold different training data (here: 32 examples of "
                                  "(8, 8, 1), uint8): every one must read the same files (its own --data-dir may "
                                  "name them at another path)")
    assert not (tmp_path / "run").exists()


def test_tf_config_unset_is_said_so(monkeypatch):
    from common.config import parse_args
    from common.errors import UsageError
    from common.tensorflow import runtime

    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(UsageError, match="reads the cluster from TF_CONFIG, which is not set"):
        runtime.start_replicas(parse_args("vanilla_gan", "tensorflow", ["--distribute", "multi-worker"]), "cpu")


@pytest.mark.parametrize("raised, hint", [("Could not start gRPC server", True), ("Socket closed", False)])
def test_a_failed_join_names_this_workers_address_only_for_a_server_that_could_not_start(monkeypatch, raised, hint):
    """Worker 1's own host:port, not worker 0's, and no guess about ports for another failure.
    (Mutation round 13.)"""
    from common.config import parse_args
    from common.errors import UserError
    from common.tensorflow import runtime

    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["127.0.0.1:1111", "127.0.0.1:2222"]},
                                                "task": {"type": "worker", "index": 1}}))

    def fails(*args, **kwargs):
        raise RuntimeError(raised)

    monkeypatch.setattr(runtime.tf.distribute, "MultiWorkerMirroredStrategy", fails)
    with pytest.raises(UserError) as refused:
        runtime.start_replicas(parse_args("vanilla_gan", "tensorflow", ["--distribute", "multi-worker"]), "cpu")
    assert str(refused.value) == f"could not join the other workers ({raised})" + (
        "; is 127.0.0.1:2222 in use, by another worker given this task index, or another program?" if hint else "")


def test_a_second_worker_given_the_same_index_names_the_address_in_use(tmp_path):
    """It said only "Could not start gRPC server", after TensorFlow's C++ lines."""
    ports, flags = free_ports(2), ["--out", str(tmp_path / "run"), "--iters", "2", *FAST]
    (first,) = start_workers(SCRIPTS["vanilla_gan"], *flags, indices=(0,), ports=ports,
                             env={"AMPGEN_JOIN_TIMEOUT_S": "120"})
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # its server listens before it waits for the other worker
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", ports[0])) == 0:
                    break
            time.sleep(0.2)
        ((code, _, err, _),) = finish(start_workers(SCRIPTS["vanilla_gan"], *flags, indices=(0,), ports=ports))
    finally:
        finish([first], timeout=1)  # killed: it would wait out its join
    ours = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 1 and len(ours) == 1, err[-2000:]
    assert re.fullmatch(rf"error: could not join the other workers \(.*gRPC server.*\); is 127\.0\.0\.1:{ports[0]} in "
                        r"use, by another worker given this task index, or another program\?", ours[0]), ours


def test_a_sigterm_to_one_worker_stops_both_with_one_checkpoint(tmp_path):
    run = tmp_path / "run"
    processes = start_workers(SCRIPTS["vanilla_gan"], "--out", str(run), *UNTIL_STOPPED)
    try:
        wait_for_training(run, processes)
        processes[1].send_signal(signal.SIGTERM)
    finally:
        results = finish(processes, timeout=60)
    assert [code for code, *_ in results] == [128 + signal.SIGTERM] * 2, [err[-2000:] for _, _, err, _ in results]
    assert "stopped at step" in results[0][1]
    resume_from_the_only_checkpoint(SCRIPTS["vanilla_gan"], run)


def test_a_killed_worker_ends_the_other_with_one_line(tmp_path):
    run = tmp_path / "run"
    processes = start_workers(SCRIPTS["vanilla_gan"], "--out", str(run), *UNTIL_STOPPED)
    try:
        wait_for_training(run, processes)
        processes[1].kill()
        code, _, err, _ = finish(processes[:1], timeout=60)[0]  # a hang fails here ("timed out")
    finally:
        finish(processes)
    assert code == 1, err[-2000:]  # ReplicaFailed's status, a UserError's
    ours = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(ours) == 1 and "lost contact with another worker" in ours[0], err[-2000:]
    assert "Traceback" not in err, err[-2000:]


def threads_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("Threads:"))


def logged_step(run: Path) -> int:
    lines = (run / "history.jsonl").read_text().splitlines()
    return json.loads(lines[-1])["step"] if lines else 0


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads a process's thread count in /proc")
def test_a_workers_threads_do_not_grow_with_its_steps(tmp_path):
    """A timeout on the collectives (CommunicationOptions(timeout_seconds=600)) made TensorFlow
    start a thread per collective op that waited the timeout out: ~11 a step, and both workers
    aborted at ~14,000 threads after 1,500 steps of the vanilla GAN (a fresh-user review's run
    of 3,000). Here 300 steps after the first log line would have added ~3,300."""
    run = tmp_path / "run"
    processes = start_workers(SCRIPTS["vanilla_gan"], "--out", str(run), *UNTIL_STOPPED, "--width", "8",
                              "--batch-size", "8")
    try:
        wait_for_training(run, processes)
        first_step, first_count = logged_step(run), threads_of(processes[0].pid)
        deadline = time.monotonic() + 120
        while logged_step(run) < first_step + 300 and time.monotonic() < deadline and processes[0].poll() is None:
            time.sleep(0.2)
        steps, grown = logged_step(run) - first_step, threads_of(processes[0].pid) - first_count
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        finish(processes, timeout=30)
    assert steps >= 300, steps
    assert grown < 100, f"{grown} more threads after {steps} steps"


# --- float16 and clipping under mirrored replicas ----------------------------------------------

TINY = ["--dataset", "ring8", "--width", "8", "--data-limit", "64", "--sample-every", "0", "--no-tensorboard"]


@pytest.mark.parametrize("model,batch", [("vanilla_gan", "16"), ("wgan_gp", "20")])
def test_float16_mirrored_replicas_train_and_log_their_loss_scale(tmp_path, model, batch):
    """The loss scale is a MirroredVariable under --distribute: reading it for the log ended
    the first log point with a TypeError (float() of a MirroredVariable)."""
    from common.config import LOSS_SCALE_INIT

    run = tmp_path / "run"
    result = train(SCRIPTS[model], run, "--amp", "--amp-dtype", "float16", "--iters", "4", "--log-every", "1",
                   "--checkpoint-every", "0", "--batch-size", batch, *TINY, *MIRRORED)
    assert "2 replicas (MirroredStrategy)" in result.stdout
    history = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in history] == [1, 2, 3, 4]
    assert all(entry["loss_scale"] == LOSS_SCALE_INIT and entry["skipped"] == 0 for entry in history), history
    assert f"scale {LOSS_SCALE_INIT:.0f}" in result.stdout


def first_moments(run: Path, network: str) -> list[np.ndarray]:
    """Adam's first moment of each of the network's weights after one step: (1 - beta1) x the
    gradient it applied (a LossScaleOptimizer's scalars come first; ndim >= 1 skips them)."""
    slots = weights(run, 1, f"optimizer/{network}/")
    return [slots[key].astype(np.float64) for key in sorted(slots) if slots[key].ndim >= 1][0::2]


@pytest.mark.parametrize("precision", ["fp32", "float16"])
def test_clip_grad_norm_clips_the_global_gradient_of_mirrored_replicas(tmp_path, precision):
    """--clip-grad-norm clips the gradient of the global batch, as one process and PyTorch's
    DDP do (it sums, then clip_grad_norm_ clips): Keras clipped each replica's share before it
    summed them (measured: norm 0.0158 at 2 replicas against 0.0100 for one process). Under
    float16 the clip still sees unscaled gradients. The ring GAN's gradient norm is well above
    the clip after one step at lr 2e-4; beta1 is its 0.5."""
    clip, beta1 = 0.01, 0.5
    amp = ["--amp", "--amp-dtype", "float16"] if precision == "float16" else []
    flags = ["--iters", "1", "--log-every", "1", "--checkpoint-every", "1", "--batch-size", "16",
             "--clip-grad-norm", str(clip), *amp, *TINY]
    train(SCRIPTS["vanilla_gan"], tmp_path / "alone", *flags)
    train(SCRIPTS["vanilla_gan"], tmp_path / "together", *flags, *MIRRORED)
    for network in ("discriminator", "generator"):
        alone, together = first_moments(tmp_path / "alone", network), first_moments(tmp_path / "together", network)
        assert len(alone) == len(together) >= 4
        norms = [np.sqrt(sum(float(np.sum(m ** 2)) for m in moments)) / (1 - beta1) for moments in (alone, together)]
        # clip * norm / (norm + 1e-6), as clip_grad_norm_: under the clip by 1e-6 / norm
        assert all(clip * (1 - 1e-4) < n <= clip * (1 + 1e-6) for n in norms), (network, norms)
        apart = np.sqrt(sum(float(np.sum((a - b) ** 2)) for a, b in zip(alone, together)))
        # measured: 1.4e-7 of the norm in float32; 4.5e-4 in float16, whose rounding differs per replica
        assert apart <= (1e-5 if precision == "fp32" else 2e-3) * norms[0] * (1 - beta1), (network, apart)


def test_the_training_noise_draws_a_new_seed_each_call_from_the_run_seed():
    """Each draw takes the next counted seed: a counter that did not move gave every step the
    same noise, and resumed bit-exact all the same, so no run-level test saw it."""
    from common.tensorflow.runtime import Noise

    noise = Noise(3)
    first, second = noise.normal((4,)).numpy(), noise.uniform((4,)).numpy()
    assert int(noise.draws.numpy()) == 2
    assert not np.array_equal(first, noise.normal((4,)).numpy())
    np.testing.assert_array_equal(Noise(3).normal((4,)).numpy(), first)  # the seed alone decides
    assert not np.array_equal(Noise(4).normal((4,)).numpy(), first)
    assert second.min() >= 0 and second.max() < 1


def test_tf_config_without_multi_worker_is_said_in_a_note(tmp_path):
    """A worker of a cluster started without --distribute multi-worker trained alone, into its
    own run folder, without a word (a fresh-user review)."""
    config = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": 0}}
    flags = ["--iters", "2", "--width", "8", "--batch-size", "8", *FAST[:-2]]
    noted = "note: TF_CONFIG is set, but only --distribute multi-worker reads it: this process trains alone"
    result = train(SCRIPTS["vanilla_gan"], tmp_path / "alone", *flags, env={"TF_CONFIG": json.dumps(config)})
    assert result.returncode == 0 and noted in result.stdout, result.stderr[-2000:]
    result = train(SCRIPTS["vanilla_gan"], tmp_path / "plain", *flags)
    assert result.returncode == 0 and "TF_CONFIG" not in result.stdout
