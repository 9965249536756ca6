"""The CPU kernels' library, loaded through ctypes with its boundary read
from the C source: every `typedef struct {...} name;` of kernels.c becomes
a ctypes Structure, every exported (non-static) function gets its argument
and result types from its C signature, and the structs' sizes are checked
against the library's own (`struct_sizes`). So the struct and the
signatures are written once, in C, and a mismatch between the two sides
is an error at load, not a wrong pointer at run time.

`load()` returns the `Kernels` of this machine's build (build.py), or None
where none is built; it never compiles.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

from . import build

C_TYPES = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float, "void": None}


def _strip_comments(source: str) -> str:
    return re.sub(r"/\*.*?\*/", " ", source, flags=re.S)


def _declared(decl: str, structs: dict):
    """A C declaration's ctypes type: `const float *` -> c_void_p,
    `const decoder_layer *` -> POINTER(decoder_layer), `int64_t` -> c_int64."""
    decl = decl.replace("const ", "").strip()
    if decl.endswith("*"):
        base = decl[:-1].strip()
        return ctypes.POINTER(structs[base]) if base in structs else ctypes.c_void_p
    if decl not in C_TYPES:
        raise ValueError(f"kernels.c: no ctypes type for {decl!r}")
    return C_TYPES[decl]


def _split(declaration: str) -> tuple[str, str]:
    """'const float *x' -> ('const float *', 'x')."""
    m = re.fullmatch(r"\s*(.*?[\s*])(\w+)\s*", declaration)
    if m is None:
        raise ValueError(f"kernels.c: cannot read the declaration {declaration!r}")
    return m.group(1).strip(), m.group(2)


def read_structs(source: str) -> dict[str, type]:
    """Each `typedef struct { fields } name;` as a ctypes Structure, in
    declaration order."""
    structs: dict[str, type] = {}
    for body, name in re.findall(r"typedef struct\s*\{(.*?)\}\s*(\w+)\s*;", _strip_comments(source), re.S):
        fields = []
        for statement in body.split(";"):
            statement = " ".join(statement.split())
            if not statement:
                continue
            first, *rest = statement.split(",")
            kind, name0 = _split(first)
            names = [name0] + [n.strip() for n in rest]
            # `const float *a, *b`: a leading * on a later name belongs to that name
            base = kind.rstrip("*").strip()
            for i, n in enumerate(names):
                pointer = kind.endswith("*") if i == 0 else n.startswith("*")
                fields.append((n.lstrip("*").strip(), _declared(base + (" *" if pointer else ""), structs)))
        structs[name] = type(name, (ctypes.Structure,), {"_fields_": fields})
    return structs


def read_functions(source: str, structs: dict) -> dict[str, tuple]:
    """name -> (restype, argtypes) of each exported function definition."""
    out = {}
    pattern = r"^(int|void|int64_t|float)\s+(\w+)\s*\(([^)]*)\)\s*\{"
    for result, name, params in re.findall(pattern, _strip_comments(source), re.M):
        args = [] if params.strip() in ("", "void") else [_declared(_split(p)[0], structs) for p in params.split(",")]
        out[name] = (C_TYPES[result], args)
    return out


class Kernels:
    """The loaded library: its functions (typed) and its structs by C name."""

    def __init__(self, path: Path, source: Path | None = None):
        """`source`: the kernels.c `path` was built from (default: this
        tree's), whose structs and signatures it is read by (a benchmark's
        build of an earlier revision takes its own)."""
        source = (source or build.SOURCE).read_text()
        self.path = path
        self.structs = read_structs(source)
        self.lib = ctypes.CDLL(str(path))
        self.functions = read_functions(source, self.structs)
        for name, (restype, argtypes) in self.functions.items():
            fn = getattr(self.lib, name)
            fn.restype, fn.argtypes = restype, argtypes
            setattr(self, name, fn)
        # Whether bfloat16 products run on the CPU's dot product (kernels.c's constant of that name).
        self.native_bf16_products = bool(ctypes.c_int.in_dll(self.lib, "native_bf16_products").value)
        # Whether bfloat16 prefill attention runs on AMX tiles (kernels.c's `amx_prefill_attention`).
        self.amx_prefill_attention = bool(ctypes.c_int.in_dll(self.lib, "amx_prefill_attention").value)
        self.amx_refused = False  # set where Linux refused the tiles' state (attention.py)
        sizes = (ctypes.c_int64 * len(self.structs))()
        self.lib.struct_sizes(sizes)
        for (name, struct), size in zip(self.structs.items(), sizes):
            if ctypes.sizeof(struct) != size:
                raise ImportError(f"{path}: struct {name} is {size} bytes in C, {ctypes.sizeof(struct)} as read "
                                  f"from kernels.c")

    def __repr__(self) -> str:
        return f"Kernels({self.path.name})"


_loaded: dict[str, Kernels | None] = {}


def load() -> Kernels | None:
    """This machine's build of the current source, loaded (once per
    process), or None where none is built (`hybridkv build-kernels`)."""
    path = build.built_library()
    if path is None:
        return None
    key = str(path)
    if key not in _loaded:
        _loaded[key] = Kernels(path)
    return _loaded[key]
