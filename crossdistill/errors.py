"""The exception types the CLI reports without a stack trace of the process that reports them.

`UserError` is a mistake a user can make (bad config, missing file, bad data): the CLI turns it
into one readable line and exit code 2. `RunFailed` is a run in a process of its own that failed:
its message already holds what that process said (its traceback), which the reporting process's
own traceback would only bury; the CLI prints the message and exits with 1.
"""


class UserError(Exception):
    """A problem with the user's input, with a message that says what to do about it."""


class RunFailed(RuntimeError):
    """A run in a child process failed, or ended without a result; the message says which run
    and carries the child's traceback when it sent one."""
