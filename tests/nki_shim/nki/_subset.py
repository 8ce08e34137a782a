"""The Python subset check: what ``nki.jit`` refuses before a kernel is traced.

The simulator guide warns that the simulator runs any Python while the NKI compiler accepts only
its meta-programming subset; the stand-in refuses what the compiler refuses. Before a launch the
kernel's source is parsed and checked, and so is every helper it reaches: functions named in its
module scope, ``module.function`` attributes of imported modules, recursively (the stand-in's own
``nki`` modules excepted). Each check cites a rule of :mod:`.rules`.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import textwrap
import types

import numpy as np

from ._core import NkiShimError
from .rules import tag

_RANGES = {"range", "affine_range", "static_range", "sequential_range", "dynamic_range"}
_IMMUTABLE = (int, float, bool, str, bytes, type(None), complex)
_BANNED = {
    ast.Try: "try/except",
    ast.With: "with",
    ast.AsyncWith: "async with",
    ast.Yield: "yield",
    ast.YieldFrom: "yield from",
    ast.Global: "global",
    ast.Nonlocal: "nonlocal",
    ast.ClassDef: "a class definition",
    ast.FunctionDef: "a nested function definition",
    ast.AsyncFunctionDef: "async def",
    ast.Await: "await",
    ast.Set: "a set literal",
    ast.JoinedStr: "an f-string",
    ast.Raise: "raise",
}
if hasattr(ast, "TryStar"):
    _BANNED[ast.TryStar] = "try/except*"
_COMPREHENSIONS = {
    ast.ListComp: "a list comprehension",
    ast.SetComp: "a set comprehension",
    ast.DictComp: "a dict comprehension",
    ast.GeneratorExp: "a generator expression",
    ast.Lambda: "a lambda",
}

_checked: set = set()  # code objects already found clean


def _is_shim(module: types.ModuleType) -> bool:
    return module.__name__ == "nki" or module.__name__.startswith("nki.")


def _immutable(value) -> bool:
    if isinstance(value, tuple):
        return all(_immutable(v) for v in value)
    return isinstance(value, _IMMUTABLE)


def _fail(rule: str, fn, node, what: str):
    where = f"{fn.__code__.co_filename}:{fn.__code__.co_firstlineno + getattr(node, 'lineno', 1) - 1}"
    raise NkiShimError(f"{tag(rule)} {fn.__qualname__} ({where}): {what}")


def _is_kernel(value) -> bool:
    from . import Kernel

    return isinstance(value, Kernel)


def check_signature(fn) -> None:
    """Kernel signatures: positional parameters with optional defaults only (``py-kwonly``)."""
    code = fn.__code__
    if code.co_kwonlyargcount or code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS):
        raise NkiShimError(
            f"{tag('py-kwonly')} kernel {fn.__qualname__}: keyword-only parameters, *args or **kwargs in its signature"
        )


def check_function(fn, is_kernel: bool = False) -> None:
    """Refuse ``fn`` (and, recursively, its helpers) if it leaves the NKI meta-programming subset."""
    code = fn.__code__
    if code in _checked:
        return
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as error:
        raise NkiShimError(f"{fn.__qualname__}: the stand-in needs the kernel's source to check it ({error})")
    tree = ast.parse(source)
    fdef = tree.body[0]
    if not isinstance(fdef, ast.FunctionDef):
        raise NkiShimError(f"{fn.__qualname__}: expected a def statement, found {type(fdef).__name__}")
    if not is_kernel and fdef.decorator_list:
        _fail("py-decorated-helper", fn, fdef, "a helper called from a kernel must not be decorated")
    _checked.add(code)  # before recursing: mutual recursion terminates
    try:
        for helper in _check_body(fn, fdef):
            check_function(helper)
    except BaseException:  # not clean after all: check again (and fail again) next time
        _checked.discard(code)
        raise


def _walk(fdef: ast.FunctionDef):
    """The body's nodes (not the decorators, which run in Python before NKI sees the function)."""
    for stmt in fdef.body:
        yield from ast.walk(stmt)


def _check_body(fn, fdef: ast.FunctionDef) -> list:
    loop_iters = set()
    local = {a.arg for a in (*fdef.args.posonlyargs, *fdef.args.args, *fdef.args.kwonlyargs)}
    for node in _walk(fdef):
        if isinstance(node, ast.For):
            loop_iters.add(id(node.iter))
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            local.add(node.id)
    helpers = []
    for node in _walk(fdef):
        kind = type(node)
        if kind in _BANNED:
            _fail("py-construct", fn, node, f"uses {_BANNED[kind]}")
        if kind in _COMPREHENSIONS:
            _fail("py-comprehension", fn, node, f"uses {_COMPREHENSIONS[kind]}")
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            _fail("py-is", fn, node, "uses `is` / `is not`")
        if isinstance(node, ast.Dict):
            for key in node.keys:
                if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                    _fail("py-dict-key", fn, node, "a dict key that is not a string literal")
        if isinstance(node, ast.Call):
            callee = node.func
            name = callee.id if isinstance(callee, ast.Name) else (
                callee.attr if isinstance(callee, ast.Attribute) else None)
            if name in _RANGES and id(node) not in loop_iters:
                _fail("py-range-value", fn, node, f"{name}(...) used as a value, not as a for loop's iterable")
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in local:
            helpers += _resolve_global(fn, node, node.id)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id not in local:
            base = _free(fn).get(node.value.id, fn.__globals__.get(node.value.id))
            if isinstance(base, types.ModuleType) and not _is_shim(base):
                helpers += _resolve_value(fn, node, f"{node.value.id}.{node.attr}", getattr(base, node.attr, None))
    return helpers


def _free(fn) -> dict:
    """The closure's free variables, name -> value (a closure reads them like module-level names)."""
    cells = fn.__closure__ or ()
    return {n: c.cell_contents for n, c in zip(fn.__code__.co_freevars, cells)}


def _resolve_global(fn, node, name: str) -> list:
    free = _free(fn)
    if name in free:
        return _resolve_value(fn, node, name, free[name])
    if name in fn.__globals__:
        return _resolve_value(fn, node, name, fn.__globals__[name])
    if hasattr(builtins, name):
        return []
    _fail("py-global-state", fn, node, f"name {name!r} is not defined")


def _resolve_value(fn, node, name: str, value) -> list:
    if isinstance(value, types.ModuleType):
        return []
    if _is_kernel(value):
        _fail("py-decorated-helper", fn, node, f"calls the @nki.jit kernel {name} from inside a kernel")
    if isinstance(value, types.FunctionType):
        return [value]
    if _immutable(value) or isinstance(value, (types.BuiltinFunctionType, np.dtype)):  # dtypes are constants
        return []
    _fail("py-global-state", fn, node, f"reads module-level {type(value).__name__} {name}")
