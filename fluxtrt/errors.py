"""User-facing errors: one clear line that names the fix. The CLI prints them without a traceback."""


class FluxtrtError(Exception):
    """An error caused by the user's input or environment, with a message that says what to do."""


class ModelSourceError(FluxtrtError):
    """The --model argument does not name a usable local FLUX.1 folder."""


class ValidationError(FluxtrtError):
    """An exported graph disagrees with PyTorch."""


class BackendUnavailableError(FluxtrtError):
    """A build backend or executor cannot be used on this machine."""


class ConfigError(FluxtrtError):
    """A GPU config file is malformed or unknown."""
