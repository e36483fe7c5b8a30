"""Errors the library raises on purpose, so that callers can tell them from bugs."""


class ConfigError(ValueError):
    """A run-config key or value is unknown or out of range.

    The message names the key, the value received and what is allowed.
    """


class NumRoundsRequired(ConfigError):
    """A strategy's option needs the run's total number of rounds, and none was given.

    Flower's legacy strategies are never told the ``ServerConfig``'s rounds, so they must be
    given ``num_rounds``; the Message-API classes wait for ``start(num_rounds=...)`` instead.
    """


class ReplyError(ValueError):
    """A client's reply does not fit the wire layout the strategy expects.

    The message names the client and what was wrong; the strategy counts the reply as a failure
    and goes on with the others.
    """


class DivergedError(RuntimeError):
    """An aggregate holds NaN/Inf or exploded in one round; the run ends rather than send it.

    The message names the strategy, the round and what was wrong with the aggregate.
    """


class NoTrainingError(RuntimeError):
    """Every client asked to train failed or was rejected, and no round has trained yet.

    An error that every client raises at the first round (a batch without the expected keys, a
    model the algorithm cannot use, a bad setting) repeats in every round: going on would end a
    run that trained nothing as if it had completed. The message names the strategy, the round
    and quotes the clients' errors.
    """


class DataNotFoundError(FileNotFoundError):
    """A dataset is not on disk and could not be downloaded; the message says where it looked."""


class MissingExtraError(ModuleNotFoundError):
    """A feature needs a package that only an extra of ``flwr_pfl`` installs (the node install
    is lean: ``pip install flwr_pfl`` holds what a deployed ServerApp and ClientApp need)."""


def missing_extra(package: str, extra: str, what: str) -> MissingExtraError:
    """The error for ``what`` needing ``package``, naming the extra that installs it."""
    return MissingExtraError(f"{what} needs the package {package!r}, which is not installed: "
                             f"pip install \"flwr_pfl[{extra}]\" (or flwr_pfl[all])", name=package)
