"""Errors the library raises on purpose, so that callers can tell them from bugs."""


class ConfigError(ValueError):
    """A run-config key or value is unknown or out of range.

    The message names the key, the value received and what is allowed.
    """


class ReplyError(ValueError):
    """A client's reply does not fit the wire layout the strategy expects.

    The message names the client and what was wrong; the strategy counts the reply as a failure
    and goes on with the others.
    """


class DataNotFoundError(FileNotFoundError):
    """A dataset is not on disk and could not be downloaded; the message says where it looked."""
