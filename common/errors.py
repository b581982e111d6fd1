"""The one base class for problems in what the user asked for, as opposed to bugs.

A config value, a model reference, a prompt file or a data folder that cannot work raises a
`UserError` subclass with a message that names the key or file and says what to do. The entry
points (common/cli.py `run_cli`) print such errors as one `error: ...` line and exit with 2;
anything else is a bug and keeps its traceback.
"""


class UserError(ValueError):
    """Bad input from the user: reported in one line, without a traceback."""
