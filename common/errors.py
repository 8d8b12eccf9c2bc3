"""Errors a user can cause. The command-line entry points print them as one line and exit;
everything else is a bug and keeps its traceback."""
from __future__ import annotations

import errno
import io
import os
import re
import signal
import subprocess
import sys
import threading

# OSErrors that are the file system's answer, not a bug: the user fixes them (another --out,
# free space, permissions), so they are one line like a UserError. A missing file is not among
# them: the paths a user names are checked where they are read, and any other is the code's.
FILE_SYSTEM_ERRNOS = {errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.EROFS, errno.ENOSPC,
                      errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM, errno.ENAMETOOLONG,
                      errno.EIO}
OUT_OF_MEMORY_HINT = "ask for less: a smaller batch, width, image size or sample count"


class UserError(Exception):
    """A problem the user can fix (data, checkpoint, run folder). Exit status 1."""

    exit_code = 1

    def __init__(self, message: str = "", quiet: bool = False):
        super().__init__(message)
        self.quiet = quiet  # another process has printed the line already (data-parallel replicas)


class UsageError(UserError):
    """Invalid flags or flag combinations. Exit status 2, as argparse uses."""

    exit_code = 2


class Interrupted(UserError):
    """Ctrl-C where the line can say more than "interrupted": while a script ran another (the
    child stopped on its own terms), or during the evaluation after a run's training. Exit
    status 130 (143 where run_child's script received a SIGTERM)."""

    exit_code = 130


class DataError(UserError):
    """Missing, truncated, mislabelled or hostile data files."""


class CheckpointError(UserError):
    """A checkpoint that cannot be read or does not belong to this run."""


def first_line(error: BaseException, announced: bool = False) -> str:
    """An exception's message as one line, for quoting in ours: its first line, less
    TensorFlow's `{{function_node ...}}` tag; the type's name when it has no message.
    `announced`: with the next line where the first ends in a colon (TensorFlow's lost worker,
    "... (stopped sending heartbeats):", is named on the next line)."""
    text = re.sub(r"\{\{[^}]*\}\}\s*", "", str(error)).strip()
    if not text:
        return type(error).__name__
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"{lines[0]} {lines[1]}" if announced and lines[0].endswith(":") and len(lines) > 1 else lines[0]


def clipped(text: str, limit: int) -> str:
    """`text` within `limit` characters, for quoting in one line: whole sentences where one ends
    in the second half of the limit, else whole words and "..." (a reason cut at 80 characters
    ended "This is typically caused")."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    sentence_end = head.rfind(". ")
    if sentence_end >= limit // 2:
        return head[:sentence_end]
    return head[:limit - 3].rsplit(" ", 1)[0] + "..."


def described(error: BaseException) -> str:
    """'Type: first line' of an exception, or 'Type' when it has no message."""
    line = first_line(error)
    return line if line == type(error).__name__ else f"{type(error).__name__}: {line}"


def file_system_problem(error: BaseException) -> str | None:
    """One line for an OSError the file system raised (not a folder, read-only, disk full, no
    permission), naming the path where the error has one; None for anything else."""
    # PyTorch raises its own error over the OS's (torch.save on a full disk: "[enforce fail at
    # inline_container.cc] unexpected pos"), which Python keeps as the context; not any error
    # raised while handling one, which may be a bug
    wrapped = (isinstance(error, RuntimeError) and "inline_container" in str(error)
               and not error.__suppress_context__)
    os_error = error if isinstance(error, OSError) else error.__context__ if wrapped else None
    if not isinstance(os_error, OSError) or os_error.errno not in FILE_SYSTEM_ERRNOS:
        return None
    reason = os_error.strerror or str(os_error)
    # a rename's target (filename2) is the path that was asked for; its source, the temporary file
    # beside it (atomic_write's), is the one the user never named
    path = os_error.filename2 or os_error.filename or _file_being_written(os_error) or _file_being_written(error)
    return f"{path}: {reason}" if path else f"cannot write the output: {reason}"


def _file_being_written(error: BaseException) -> str | None:
    """A failed write() names no path (disk full while a library saves a PNG): the open file in
    the innermost frame that holds one does."""
    import traceback

    for frame, _ in reversed(list(traceback.walk_tb(error.__traceback__))):
        for value in frame.f_locals.values():
            if isinstance(value, io.IOBase) and isinstance(getattr(value, "name", None), str):
                return value.name
    return None


def out_of_memory_problem(error: BaseException) -> str | None:
    """One line for a failed allocation (numpy, PyTorch on the CPU or a GPU, TensorFlow), None
    for anything else. The frameworks are only looked at when the script has imported them."""
    torch, tf = sys.modules.get("torch"), sys.modules.get("tensorflow")
    memory = (isinstance(error, MemoryError)  # numpy's _ArrayMemoryError too
              or isinstance(error, getattr(torch, "OutOfMemoryError", ()))
              # PyTorch's CPU allocator raises a plain RuntimeError
              or (isinstance(error, RuntimeError) and "DefaultCPUAllocator" in str(error))
              or isinstance(error, getattr(getattr(tf, "errors", None), "ResourceExhaustedError", ())))
    if not memory:
        return None
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    first = lines[0] if lines else ""
    if "DefaultCPUAllocator" in first:  # past PyTorch's "[enforce fail at alloc_cpu.cpp:127] ..."
        first = first[first.index("DefaultCPUAllocator"):]
    # TensorFlow's: "{{function_node ...}} OOM when allocating tensor with shape[...] ... on /job:..."
    first = re.sub(r"^\{\{[^}]*\}\}\s*", "", first).split(" on /job:")[0]
    detail = f" ({first[:200]})" if first else ""
    return f"out of memory{detail}; {OUT_OF_MEMORY_HINT}"


# What makes a model script join other replicas: torchrun's (the rest of its variables name
# where, and are harmless alone) and tf.distribute's.
REPLICA_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TF_CONFIG")


def run_child(command: list[str], on_interrupt, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run for a script that trains or evaluates. A terminal's Ctrl-C goes to the
    whole process group; the model scripts then finish their step, checkpoint and exit 130.
    subprocess.run would raise KeyboardInterrupt in this process and kill the child while it
    saves, so the signal is noted here instead and the child waited for; then this process
    stops too, with `on_interrupt` as its one line (exit 128 + the signal: 130, or 143): a
    string, or a function that says it once the child has ended (what the child saved).
    A SIGTERM is also passed on to the child: sent to this process alone (`kill PID`), it had
    killed it at once and left the child training on alone. The copy that follows one sent to
    the whole group is harmless (outside a training loop SIGTERM's default ends a script at the
    first; inside, StopRequest takes it as the same request). A Ctrl-C is not passed on: the
    terminal's reaches the child itself, and a copy of it, a second Ctrl-C moments later, ended
    a child outside its training loop in a traceback.
    The child runs alone: torchrun's variables and TF_CONFIG, left in a shell, are not passed
    on (a model script would join replicas that never come: `evaluate.py` waited 10 minutes)."""
    given = kwargs.get("env")
    kwargs["env"] = {name: value for name, value in (os.environ if given is None else given).items()
                     if name not in REPLICA_VARIABLES}
    if threading.current_thread() is not threading.main_thread():  # signal handlers are the main thread's
        return subprocess.run(command, **kwargs)
    received, here = [], sys._getframe()

    def note(signum, frame):
        received.append(signum)

    def pass_on(signum, frame):
        received.append(signum)
        child = _child_being_waited_for(frame, below=here)
        if child is not None:
            child.send_signal(signum)

    previous = {signal.SIGINT: signal.signal(signal.SIGINT, note),
                signal.SIGTERM: signal.signal(signal.SIGTERM, pass_on)}
    try:
        result = subprocess.run(command, **kwargs)  # the child starts with the signals' defaults
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if received or result.returncode in (130, 143):  # the child stopped on a signal of its own, and saved
        stopped = Interrupted(f"interrupted: {on_interrupt() if callable(on_interrupt) else on_interrupt}")
        stopped.exit_code = 128 + received[0] if received else result.returncode
        raise stopped
    return result


def _child_being_waited_for(frame, below) -> subprocess.Popen | None:
    """The started Popen that subprocess.run waits on, found from the frame a signal interrupted
    up to the frame `below` (run_child's, whose callers' Popens are not its child): subprocess.run
    hands its caller no pid while it runs. None before it starts or after."""
    while frame is not None and frame is not below:
        for value in frame.f_locals.values():
            if isinstance(value, subprocess.Popen) and getattr(value, "pid", None):
                return value
        frame = frame.f_back
    return None


def exit_on_user_error(main):
    """Wrap a script's main(): a UserError becomes one line on stderr and its exit status; so do
    the file system's refusals and running out of memory (exit status 1). Other errors keep
    their traceback."""
    import functools

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        _escape_what_stdout_cannot_encode()
        try:
            return main(*args, **kwargs)
        except UserError as error:
            if not error.quiet:
                _say(f"error: {error}")
            sys.exit(error.exit_code)
        except KeyboardInterrupt:  # a Ctrl-C outside a training loop, or a second one inside it
            _say("error: interrupted")
            sys.exit(130)
        except BrokenPipeError:
            if not _stdout_is_broken():  # a pipe to another process: a failure to report
                raise
            _silence_stdout()  # the output's reader has gone (`| head`): stop quietly, as Unix tools do
            sys.exit(128 + signal.SIGPIPE)
        except Exception as error:
            line = file_system_problem(error) or out_of_memory_problem(error)
            if line is None:
                raise
            _say(f"error: {line}")
            sys.exit(1)

    return wrapper


# What str.splitlines() splits at, each to its Python escape ("\\n", "\\x85", "\\u2028")
_LINE_BREAKS = {ord(c): c.encode("unicode_escape").decode() for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"}


def escaped_line_breaks(text: str) -> str:
    """`text` on one line, its line breaks written as escapes: a path or value holding one (a
    folder named in the shell with $'a\\nb') split the error line in two, the second looking
    like the start of another message."""
    return text.translate(_LINE_BREAKS)


def _escape_what_stdout_cannot_encode() -> None:
    """A folder name's undecodable byte (a lone surrogate in Python) printed in a path ("run
    folder: ...") raised UnicodeEncodeError under a strict stdout (en_US.UTF-8, not C.UTF-8),
    after the run folder was made. As stderr does by default: its \\x or \\u escape."""
    if isinstance(sys.stdout, io.TextIOWrapper) and sys.stdout.errors == "strict":
        sys.stdout.reconfigure(errors="backslashreplace")


def _say(line: str) -> None:
    """The one line, on stderr where there is one (`2>&-` leaves none)."""
    if sys.stderr is not None:
        try:
            sys.stderr.write(escaped_line_breaks(line) + "\n")
            sys.stderr.flush()
        except (OSError, ValueError):  # stderr closed or its reader gone: the exit status says it
            pass


def _stdout_is_broken() -> bool:
    """Whether stdout is a pipe whose reader has gone: poll() says POLLERR on its write end."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(mask & select.POLLERR for _, mask in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no stdout, or not a file
        return False


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that Python's flush at exit does not fail on the closed
    pipe once more (with its own "Exception ignored" lines)."""
    import os

    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass
