"""The one exception type for mistakes a user can make (bad config, missing file, bad data).

The CLI turns it into one readable line and exit code 2, never a stack trace.
"""


class UserError(Exception):
    """A problem with the user's input, with a message that says what to do about it."""
