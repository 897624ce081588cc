"""User-facing errors: one clear paragraph, no traceback."""

# Every character str.splitlines() breaks a line at, escaped: a ConfigError is always one line, whatever
# path or text it quotes.
_ONE_LINE = {c: repr(chr(c))[1:-1] for c in (0x0A, 0x0B, 0x0C, 0x0D, 0x1C, 0x1D, 0x1E, 0x85, 0x2028, 0x2029)}


ECHO_CHARS = 120
"""A refused value is echoed up to this many characters of its repr (then '…' and its full length): a 1 MB value
gives a one-line error of about 200 characters plus what is accepted, not a 1 MB line."""


def echo(value: object) -> str:
    """``repr(value)``, cut to ECHO_CHARS (repr escapes control characters and bidi overrides such as U+202E)."""
    try:
        text = repr(value)
    except Exception:  # a user object whose __repr__ fails still gets its error
        text = f"<{type(value).__name__}>"
    return text if len(text) <= ECHO_CHARS else f"{text[:ECHO_CHARS - 20]}… ({len(text):,} characters)"


class SyncwiseError(Exception):
    """An error a user can meet and fix; the CLI prints its message and exits non-zero."""


class ConfigError(SyncwiseError):
    """A configuration value is invalid; raised before any worker starts. Its message is one line."""

    def __init__(self, field: str, value: object, accepted: str):
        self.field, self.value, self.accepted = field, value, accepted
        # a key as typed, cut in the middle: its end names the key (a file's path, then ': hidden_size')
        field = field if len(field) <= 80 else f"{field[:30]}…{field[-40:]} ({len(field):,} characters)"
        # None is a value nobody typed: the field is missing (not "'launch.shared_dir': None").
        text = (f"missing value for '{field}' — accepted: {accepted}" if value is None else
                f"invalid value for '{field}': {echo(value)} — accepted: {accepted}")
        super().__init__(text.translate(_ONE_LINE))
