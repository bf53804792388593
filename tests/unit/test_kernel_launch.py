"""kernels/triton/launch.py: what its cache keys on, and that the plain launch is kept where there
is no compiled kernel (Triton's interpreter). The cached launch itself is checked on a GPU
(tests/integration/test_gpu.py: bit for bit against plain launches, over shapes and alignments that change
Triton's specialisation)."""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from perflab_kernels.triton.launch import Launcher, arg_key  # noqa: E402


@triton.jit
def _scale(X, Y, n, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < n) * factor, mask=offs < n)


def _triton_specialisation(arg):
    """Triton's own specialisation of a runtime argument (what JITFunction.run keys compiled kernels
    on), where this Triton exposes it."""
    native = pytest.importorskip("triton._C.libtriton").__dict__.get("native_specialize_impl")
    if native is None:
        pytest.skip("this Triton has no native_specialize_impl")
    from triton.backends.compiler import BaseBackend

    return native(BaseBackend, arg, False, True, True)


def test_the_key_tells_apart_what_triton_specialises_on():
    """Two arguments that share a key must share Triton's specialisation (else a hit would hand one
    of them a kernel compiled for the other); integers and tensors that share a specialisation
    share a key (else a changing token count or stride would miss on every new value)."""
    base = torch.zeros(64, dtype=torch.bfloat16)
    values = [True, False, 0, 1, 16, 17, 8191, 8192, -96, -100, (1 << 31) - 16, 1 << 31, 1.0, 2.5, None,
              base, base[1:], base[8:], base.float(), base.float()[4:]]
    for i, a in enumerate(values):
        for b in values[i + 1:]:
            same_key = type(a) is type(b) and arg_key(a) == arg_key(b)
            same_spec = _triton_specialisation(a) == _triton_specialisation(b)
            assert not same_key or same_spec, (a, b)
            if type(a) is type(b) and isinstance(a, (int, torch.Tensor)) and not isinstance(a, bool):
                assert same_key == same_spec, (a, b)
    assert arg_key(True) != arg_key(1) and arg_key(False) != arg_key(0)  # equal in Python, u1 against i32 in Triton
    assert arg_key(8192) == arg_key(4096) != arg_key(8191)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's path: kernels run compiled on a GPU")
def test_the_interpreter_launches_the_plain_way_and_keeps_nothing():
    launch = Launcher(_scale)
    x = torch.arange(37, dtype=torch.float32)
    for n in (37, 37, 20):  # the same arguments twice: a kept kernel would make the second a hit
        y = torch.zeros_like(x)
        launch((triton.cdiv(n, 16),), x, y, n, 2.5, BLOCK=16)
        assert torch.equal(y[:n], x[:n] * 2.5) and not y[n:].any()
    assert launch.misses == 3 and launch.hits == 0 and not launch.compiled


def test_kernels_call_jit_functions_by_their_own_names():
    """Under torch.compile Inductor copies a user kernel's source into a module of its own and
    imports the JIT functions it calls by name: a call through another module (`pdl.gdc_prologue`)
    is a NameError there (a compiled block with the fused norms failed so on an H200). Every
    @triton.jit body in kernels/triton calls other modules' functions only through `tl`."""
    import ast
    import importlib
    import types
    from pathlib import Path

    offenders = []
    for path in sorted(Path(__file__).parents[2].joinpath("kernels", "triton").glob("*.py")):
        module = importlib.import_module(f"perflab_kernels.triton.{path.stem}")
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef) or not any("jit" in ast.unparse(d) for d in fn.decorator_list):
                continue
            body = [n for stmt in fn.body for n in ast.walk(stmt)]  # the body only: `@triton.jit(...)` itself is a call
            for call in (n for n in body if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)):
                root = call.func
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id != "tl" and isinstance(getattr(module, root.id, None), types.ModuleType):
                    offenders.append(f"{path.name}:{call.lineno} {fn.name}: {ast.unparse(call.func)}")
    assert not offenders, offenders
