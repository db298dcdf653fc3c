"""zdsl: GPU kernels for LLM inference written in a Python tile DSL, run through Vulkan.

    import zdsl
    from zdsl import Buffer, f32, u32

    @zdsl.kernel(workgroup=64)
    def scale(x: Buffer[f32], y: Buffer[f32], n: u32, s: f32):
        i = zdsl.global_id()
        with zdsl.if_(i < n):
            y[i] = x[i] * s

The language is `zdsl.lang.language` (re-exported here); `zdsl.lang.kernel` turns functions into
variants; `zdsl.lang.glsl` and `zdsl.lang.interp` are the two backends of one IR.
"""

from zdsl.errors import ZdslError
from zdsl.lang.kernel import Example, Launch, kernel
from zdsl.lang.language import *  # noqa: F401,F403  (the language's builtins)
from zdsl.lang.language import __all__ as _language
from zdsl.lang.types import bf16, boolean, f16, f32, i8, i16, i32, u8, u16, u32

__version__ = "0.1.0"

__all__ = ["ZdslError", "kernel", "Example", "Launch", "bf16", "boolean", "f16", "f32", "i8", "i16", "i32", "u8",
           "u16", "u32", "__version__", *_language]
