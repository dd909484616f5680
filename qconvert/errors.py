"""User-facing errors: one line naming the file or tensor and the fix."""


class QConvertError(Exception):
    """An error caused by input or usage. The CLI prints ``str(err)`` and exits 1."""


class CheckpointError(QConvertError):
    """The source checkpoint is missing, corrupt or inconsistent."""


class PlanError(QConvertError):
    """The requested conversion cannot be planned for this model."""


class OutputError(QConvertError):
    """The destination cannot be written."""
