"""Errors the engine raises to its callers."""


class InvalidRequestError(ValueError):
    """A request the engine cannot serve; `field` names the offending input."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field} {message}")
        self.field = field
        self.message = message

    def __reduce__(self):  # picklable (it crosses from the engine process)
        return type(self), (self.field, self.message)

    def renamed(self, field: str) -> "InvalidRequestError":
        """The same error under a protocol's name for the field."""
        return type(self)(field, self.message)


class AdapterNotFoundError(InvalidRequestError):
    """A request for a LoRA adapter (a model name) that is not loaded (or is being unloaded)."""
    reason = "model_not_found"  # OpenAI's error code

    def __init__(self, name: str, message: str | None = None):
        super().__init__("model", message or f"{name!r} does not exist (no such model or LoRA adapter loaded)")
        self.name = name

    def __reduce__(self):
        return type(self), (self.name, self.message)


class AdapterLoadError(InvalidRequestError):
    """A LoRA adapter that cannot be loaded (its files, its config, a name in use), in one line."""

    def __init__(self, message: str):
        ValueError.__init__(self, message)
        self.field, self.message = "lora_path", message

    def __reduce__(self):
        return type(self), (self.message,)


class DuplicateRequestError(InvalidRequestError):
    """A request id that is already in flight."""


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; retry later (`retry_after`: seconds, when known)."""

    def __init__(self, message: str = "", retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after

    def __reduce__(self):
        return type(self), (str(self), self.retry_after)


class QueueWaitError(QueueFullError):
    """The request waited in the queue past max_queue_wait_s without being scheduled, or would (its
    time limit is shorter than the estimated wait); retry later."""


class EngineError(RuntimeError):
    """The engine step that ran this request failed; the engine keeps serving."""


class EngineClosedError(RuntimeError):
    """The engine was shut down."""


class EngineDeadError(EngineClosedError):
    """The engine core died (its process exited, or its loop crashed): nothing more is served."""
