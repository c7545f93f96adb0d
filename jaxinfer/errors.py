"""The one exception type the CLI turns into a one-line error message."""


class JaxinferError(Exception):
    """A user-facing error: bad input, a missing file, an unsupported model.

    The message is one line that names what is wrong (file, field, value).
    The CLI prints it as `error: <message>` and exits non-zero; the server
    answers it with a 4xx.
    """
