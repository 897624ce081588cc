"""User-facing errors: one clear paragraph, no traceback."""


class SyncwiseError(Exception):
    """An error a user can meet and fix; the CLI prints its message and exits non-zero."""


class ConfigError(SyncwiseError):
    """A configuration value is invalid; raised before any worker starts."""

    def __init__(self, field: str, value: object, accepted: str):
        self.field, self.value, self.accepted = field, value, accepted
        super().__init__(f"invalid value for '{field}': {value!r} — accepted: {accepted}")
