"""Build the API reference from the docstrings: ``python -m tools.api_docs [OUT_DIR]``.

pdoc documents what a module's namespace holds; dcp_plus's packages export their public names
lazily (writer worker processes must start without importing torch), so they are resolved here
first. Fails (exit 1) when a public name does not resolve or a module does not import.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import sys
import warnings
from pathlib import Path

FATAL = ("does not resolve", "Error importing")

PACKAGES = ["dcp_plus", "dcp_plus.format", "dcp_plus.tiers", "dcp_plus.writers"]
"""The packages whose ``__all__`` is lazy (``dcp_plus._lazy``)."""


def resolve_lazy_exports() -> None:
    for name in PACKAGES:
        pkg = importlib.import_module(name)
        for export in getattr(pkg, "__all__", []):
            setattr(pkg, export, getattr(pkg, export))


def public_modules() -> list[str]:
    """Every module of dcp_plus without a private part in its name; not ``dcp_plus.cli``
    (the command line is documented in docs/cli.md), nor the TorchTitan integration where
    TorchTitan is not installed."""
    import dcp_plus

    titan = importlib.util.find_spec("torchtitan") is not None
    names = ["dcp_plus"]
    for info in pkgutil.walk_packages(dcp_plus.__path__, "dcp_plus."):
        parts = info.name.split(".")
        if any(p.startswith("_") for p in parts) or parts[1] == "cli":
            continue
        if info.name.startswith("dcp_plus.integrations") and not titan:
            continue  # its classes resolve only where TorchTitan is installed
        if info.name not in names:
            names.append(info.name)
    if not titan:  # pdoc walks a package's submodules: keep it out of these
        names += ["!dcp_plus.integrations*"]
    return names


def main() -> int:
    import pdoc

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "build/api")
    resolve_lazy_exports()
    modules = public_modules()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pdoc.pdoc(*modules, output_directory=out)
    # a public name that does not resolve fails the build; pdoc's other remarks (a method
    # named `list` shadowing the builtin in an annotation, a module reached twice) do not
    problems = [w for w in caught if any(m in str(w.message) for m in FATAL)]
    for w in problems:
        print(f"api_docs: {w.message}", file=sys.stderr)
    print(f"API reference: {out / 'index.html'} ({len(list(out.rglob('*.html')))} pages)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
