"""Errors a user can cause. The command-line entry points print them as one line and exit;
everything else is a bug and keeps its traceback."""


class UserError(Exception):
    """A problem the user can fix (data, checkpoint, run folder). Exit status 1."""

    exit_code = 1

    def __init__(self, message: str = "", quiet: bool = False):
        super().__init__(message)
        self.quiet = quiet  # another process has printed the line already (data-parallel replicas)


class UsageError(UserError):
    """Invalid flags or flag combinations. Exit status 2, as argparse uses."""

    exit_code = 2


class DataError(UserError):
    """Missing, truncated, mislabelled or hostile data files."""


class CheckpointError(UserError):
    """A checkpoint that cannot be read or does not belong to this run."""


def exit_on_user_error(main):
    """Wrap a script's main(): a UserError becomes one line on stderr and its exit status."""
    import functools
    import sys

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as error:
            if not error.quiet:
                sys.stderr.write(f"error: {error}\n")
            sys.exit(error.exit_code)

    return wrapper
