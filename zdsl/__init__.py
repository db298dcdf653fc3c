"""zdsl: GPU kernels for LLM inference written in a Python tile DSL, run through Vulkan."""

from zdsl.errors import ZdslError

__version__ = "0.1.0"

__all__ = ["ZdslError", "__version__"]
