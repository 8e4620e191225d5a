"""The exceptions packlora raises for user-facing errors."""


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
