"""The one exception type for problems the user can fix.

Anything raised as ``UserError`` is printed by the CLI as a single line
(``error: ...``) with exit status 2 and no traceback. Messages name the
file/key/argument at fault and what was expected.
"""


class UserError(Exception):
    """Bad input: config, data, paths, checkpoints or CLI arguments."""

    exit_code = 2
