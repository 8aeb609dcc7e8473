"""Run Triton kernels on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1 must be set before
triton is imported). Triton 3.6's interpreter converts loop bounds with int(array), which numpy >= 2.4
refuses for 1-element arrays; wrap that one conversion so the kernels can be checked without a GPU."""
import os

os.environ["TRITON_INTERPRET"] = "1"

import triton.runtime.interpreter as interpreter  # noqa: E402

_original_patch = interpreter._patch_lang_tensor


def _patch_lang_tensor(tensor, scope):
    _original_patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


interpreter._patch_lang_tensor = _patch_lang_tensor
