"""One exception type for mistakes a user can fix (bad config, missing file, unknown preset).

Stage entry points catch it and print only its message (no traceback): the message must say
what was wrong, where we looked, and what to do instead.
"""

import os
import traceback


class QdflashError(Exception):
    """A user-facing error whose message is complete on its own."""


class SourceNotFound(QdflashError):
    """A data source found nowhere it was looked for (no path given). A source or gate task the
    profile marks optional is skipped on this error, and only on this one: a path the user gave
    that does not exist, or a file that is malformed, stays an error."""


def raised_at(err: BaseException, frames: int = 1) -> str:
    """Where `err` was raised: its innermost `frames` frames as "file:line function", innermost first, joined by " <- ".
    Why: a failure on a GPU lent for minutes must be found from its result file, without running it there again."""
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                       for f in reversed(traceback.extract_tb(err.__traceback__)[-frames:]))
