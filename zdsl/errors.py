"""One exception type for everything a user can get wrong or lack.

A ZdslError carries a single line: what is wrong and what to do about it. The CLI prints
it as ``error: <line>`` and exits non-zero; nothing beneath it (cffi, glslang, numpy) should
reach the user as a traceback.
"""


class ZdslError(Exception):
    """A failure with a one-line, actionable explanation."""

    exit_code = 2

    def __init__(self, message: str, *, hint: str | None = None):
        self.hint = hint
        super().__init__(message if hint is None else f"{message} ({hint})")


class NoDeviceError(ZdslError):
    """No Vulkan loader, no device, or no device matching the user's selector."""


class MissingFeatureError(ZdslError):
    """The device lacks a feature a kernel or variant needs."""


class OutOfMemoryError(ZdslError):
    """A device allocation failed."""


class KernelError(ZdslError):
    """A kernel is wrong: reported at the Python file and line it came from."""


class CompileError(ZdslError):
    """glslang or spirv-val rejected generated code."""


class ModelError(ZdslError):
    """A model file is missing, truncated, or not something zdsl can run."""
