"""The errors every module may raise, at the bottom of the import graph (this module imports nothing).

The scripts' entry point (`runtime.run`) maps them to exit codes: ConfigError and DataError exit 2 before any model
loads, NonFiniteError exits 3 (resuming would only hit it again)."""


class ConfigError(ValueError):
    """An invalid configuration. The message names the parameters involved and shows the arithmetic."""


class DataError(ValueError):
    """A bad dataset or row. The message names the file (or hub dataset) and the row."""


class NonFiniteError(RuntimeError):
    """A NaN/inf loss, gradient or weight with `on_nonfinite: stop`."""


EXIT_CONFIG = 2
EXIT_NONFINITE = 3
