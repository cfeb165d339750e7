"""The one error type of checkpoint reading and writing."""


class CheckpointingError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, unsafe or does not fit the model; names the path."""
