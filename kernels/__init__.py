"""The library's kernels, written in the DSL, each beside its numpy reference."""

from __future__ import annotations

import importlib
import pkgutil


def all_kernels() -> dict:
    """The library's kernels by name: every module of zdsl.kernels imported so that its kernels
    register (kernels registered elsewhere, say by tests, are not the library's)."""
    from zdsl.lang.kernel import REGISTRY

    for mod in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{mod.name}")
    return {name: k for name, k in sorted(REGISTRY.items()) if k.fn.__module__.startswith(f"{__name__}.")}
