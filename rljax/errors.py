"""User-facing errors.

`RljaxError` carries one line that names the problem and the fix. The CLI prints it
without a traceback; internal bugs stay ordinary exceptions and stay loud.
"""


class RljaxError(Exception):
    """A problem with the user's input (config, data, checkpoint), stated in one line."""


class ConfigError(RljaxError):
    """A bad config key or value."""


class CheckpointError(RljaxError):
    """A checkpoint that is missing, unsupported or does not fit the model."""


class DataError(RljaxError):
    """A data source that is missing or malformed."""


class LaunchError(RljaxError):
    """A multi-host run that cannot start, e.g. a worker that cannot reach the coordinator."""
