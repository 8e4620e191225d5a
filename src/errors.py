"""The exceptions packlora raises for user-facing errors."""
from numbers import Integral


class PackloraError(Exception):
    """Base class of every packlora error."""


class DeviceError(PackloraError):
    """A device was asked for that this machine cannot provide, or devices were mixed."""


class AutodiffError(PackloraError):
    """Autodiff was used in a way its rules do not allow."""


class QuantError(PackloraError):
    """A weight could not be quantized, or a packed weight is malformed."""


class ModelError(PackloraError):
    """A model file or folder is missing, malformed or unsupported."""


class ConfigError(PackloraError):
    """A run configuration is invalid; the message names the key."""


class DataError(PackloraError):
    """A dataset file is malformed; the message names the file and line."""


class TrainingError(PackloraError):
    """Training could not go on (e.g. a NaN loss)."""


def check_count(where, name, value, minimum, note="", none_ok=False):
    """ConfigError `where: name must be a whole number >= minimum, got value` unless `value` is
    one (an int or numpy integer, not a bool; None too where none_ok)."""
    if none_ok and value is None:
        return
    if not (isinstance(value, Integral) and not isinstance(value, bool) and value >= minimum):
        raise ConfigError(f"{where}: {name} must be a whole number >= {minimum}{note}"
                          f"{', or None' if none_ok else ''}, got {value!r}")
