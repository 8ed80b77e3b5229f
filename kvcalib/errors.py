"""Errors a user can cause. The CLI prints each as one line on stderr and exits with code 2."""


class KvcalibError(Exception):
    """Base class: the message says what went wrong and what to do about it."""


class ModelLoadError(KvcalibError):
    """The model could not be found or loaded."""


class DatasetError(KvcalibError):
    """The text source is missing, unreadable, empty or too short."""


class ArtifactError(KvcalibError):
    """An artifact or activation directory is missing, corrupted or made for another model."""


class ActivationError(KvcalibError):
    """The model's activations cannot be recorded as a collection holds them (values float16 cannot hold)."""


class SettingsError(KvcalibError):
    """Options that contradict each other or the model."""


class OutputError(KvcalibError):
    """An output cannot be written: no room on the device, or another process writes it."""
