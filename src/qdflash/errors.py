"""One exception type for mistakes a user can fix (bad config, missing file, unknown preset).

Stage entry points catch it and print only its message (no traceback): the message must say
what was wrong, where we looked, and what to do instead.
"""


class QdflashError(Exception):
    """A user-facing error whose message is complete on its own."""
