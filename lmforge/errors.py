"""The one exception type for problems the user can fix.

Anything raised as ``UserError`` is printed (`lmforge.say.say`, at the edges that print) as a
single line (``error: ...``) with exit status 2 and no traceback. Messages name the
file/key/argument at fault and what was expected.
"""

class UserError(Exception):
    """Bad input: config, data, paths, checkpoints or CLI arguments."""

    exit_code = 2
    said = False  # its line is on stderr already (`say`)


def json_kind(value) -> str:
    """A JSON value as a message names it, in JSON's words (a row that is an array: "an array")."""
    return ("null" if value is None else "true/false" if isinstance(value, bool) else
            "a number" if isinstance(value, (int, float)) else "a string" if isinstance(value, str) else
            "an array" if isinstance(value, list) else "an object")


def json_error(e) -> str:
    """Why a JSONL line is not JSON (``e``: its JSONDecodeError), in one phrase: two values on one line
    is JSONL's own mistake, not "Extra data"."""
    if e.msg == "Extra data":
        return f"more than one JSON value on the line (at column {e.colno}); JSONL holds one per line"
    return f"not valid JSON ({e.msg} at column {e.colno})"


class PeerUserError(UserError):
    """Rank 0's bad-input error, raised on the other ranks too so that none waits for it: rank 0
    prints the one line, the others exit with its code without repeating it."""


# Errors of the machine around a run, not of lmforge: a full disk, a read-only or forbidden
# folder. Retrying cannot help, so they end a run as bad input does (one line, exit 2).
_ENVIRONMENT_ERRNOS = {"ENOSPC": "free some space or choose another folder",
                       "EDQUOT": "the disk quota is used up; free some space or choose another folder",
                       "EROFS": "the file system is read-only; choose another folder",
                       "EACCES": "check the folder's permissions or choose another folder",
                       "EPERM": "check the folder's permissions or choose another folder",
                       "EFBIG": "the file system's file size limit is reached"}


def environment_error(e: BaseException, where: str | None = None) -> UserError | None:
    """A UserError naming the path and the errno for a full disk / read-only / forbidden path,
    else None. ``where`` names the path when the OSError carries none (a failed write())."""
    import errno as errno_names

    if not isinstance(e, OSError) or e.errno is None:
        return None
    name = errno_names.errorcode.get(e.errno, "")
    if name not in _ENVIRONMENT_ERRNOS:
        return None
    path = e.filename or where or "?"
    return UserError(f"{path}: {e.strerror or name} ({name}); {_ENVIRONMENT_ERRNOS[name]}")
