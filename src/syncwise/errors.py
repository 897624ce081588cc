"""User-facing errors: one clear paragraph, no traceback."""

# Every character str.splitlines() breaks a line at, escaped: a ConfigError is always one line, whatever
# path or text it quotes.
_ONE_LINE = {c: repr(chr(c))[1:-1] for c in (0x0A, 0x0B, 0x0C, 0x0D, 0x1C, 0x1D, 0x1E, 0x85, 0x2028, 0x2029)}


class SyncwiseError(Exception):
    """An error a user can meet and fix; the CLI prints its message and exits non-zero."""


class ConfigError(SyncwiseError):
    """A configuration value is invalid; raised before any worker starts. Its message is one line."""

    def __init__(self, field: str, value: object, accepted: str):
        self.field, self.value, self.accepted = field, value, accepted
        # None is a value nobody typed: the field is missing (not "'launch.shared_dir': None").
        text = (f"missing value for '{field}' — accepted: {accepted}" if value is None else
                f"invalid value for '{field}': {value!r} — accepted: {accepted}")
        super().__init__(text.translate(_ONE_LINE))
