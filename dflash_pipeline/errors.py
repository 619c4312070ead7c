"""Errors a user can cause and fix. The CLI prints them as one line and exits non-zero.

Everything else is a bug and keeps its traceback.
"""


class DFlashError(Exception):
    """A problem with the user's input, store or configuration: printed as one line, exit code 2."""

    exit_code = 2


class StoreError(DFlashError):
    """The store is missing, of another format, or damaged; the message names store, segment and array."""


class CorruptSegmentError(StoreError):
    """A committed segment's data does not match its commit marker (checksum, shape, missing chunk)."""

    def __init__(self, store: str, segment: int, array: str, reason: str):
        self.store, self.segment, self.array, self.reason = store, segment, array, reason
        super().__init__(f"{store}: segment {segment:08d}, array '{array}': {reason}")


class ConfigMismatchError(DFlashError):
    """A store, checkpoint or run directory was made with settings that differ from the ones asked for."""


class InputDataError(DFlashError):
    """An input file is missing or not in a known format."""
