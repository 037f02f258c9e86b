"""Names a package exports but loads on first use (PEP 562): `lazy_getattr` builds the package's
module-level `__getattr__` from a map of name -> submodule. A package whose submodules import
torch or transformers uses it so that importing one light submodule (a path helper, a dataclass)
does not import them all; each name is imported from its submodule the first time it is read and
then kept in the package's namespace."""

from __future__ import annotations

import importlib


def lazy_getattr(package: str, names: dict[str, str], namespace: dict):
    """The `__getattr__` of `package` (its `__name__`), whose `namespace` (its `globals()`) gets
    each name of `names` (name -> submodule, relative to the package) when first read."""

    def __getattr__(name: str):
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value  # later reads find it without this function
        return value

    return __getattr__
