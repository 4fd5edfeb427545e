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


# Raised by the layers above; defined here so that every error class lives in one place.


class ManifestError(FluxtrtError):
    """A manifest is missing, unreadable or does not match its engines."""


class ShapeError(FluxtrtError):
    """A request does not fit an engine's optimization profile."""


class RequestError(FluxtrtError):
    """A generation request the engines cannot serve (size, steps, batch)."""


class NonFiniteError(FluxtrtError):
    """A component produced NaN or Inf."""


class QueueFull(RequestError):
    """More samples are waiting than the batcher accepts (`max_queue`): try again later."""


class ShuttingDown(RequestError):
    """The batcher stopped before the request finished."""


class DropInError(FluxtrtError):
    """A diffusers feature the engine-backed modules cannot provide; the message names the fluxtrt way."""


class ArtifactError(FluxtrtError):
    """An archive is corrupt, tampered with, or unsafe to extract."""


class BuildError(FluxtrtError):
    """TensorRT could not parse or build a graph."""


class ReplicationError(FluxtrtError):
    """Zero-copy export could not replicate a traced block to the model's depth."""


class WorkflowError(FluxtrtError):
    """A request whose image inputs the engines' model cannot serve, or that are unreadable."""


class BadRequest(FluxtrtError):
    """A request the server refuses with 400: one line for the client."""

    status = 400


class TooLarge(BadRequest):
    """A body over the server's size limit: 413."""

    status = 413
