"""The layouts an exported drafter is written in and read back from (`export.formats`, `Layout`).

    eagle3       the EAGLE-3 HF layout vLLM reads (`layouts/eagle3.py`)
    speculators  the `speculators` library's layout, which vLLM >= 0.25 also serves (`layouts/speculators.py`)

A new layout is a module here with its `Layout` (`config`, `key`, `read`), an `ExportFormat` member
(eagle31/recipe.py) and its line below; `export_drafter` and `load_drafter` also take a `Layout` object
itself (docs/architecture.md, "How to add").
"""

from __future__ import annotations

from eagle31.errors import ConfigError
from eagle31.layouts.eagle3 import Eagle3Layout
from eagle31.layouts.layout import Layout
from eagle31.layouts.speculators import SpeculatorsLayout
from eagle31.recipe import ExportFormat

LAYOUTS: dict[ExportFormat, Layout] = {
    ExportFormat.eagle3: Eagle3Layout(),
    ExportFormat.speculators: SpeculatorsLayout(),
}


def layout_of(format: str | Layout) -> Layout:
    """The layout of an export format's name (a `Layout` is itself); another name is a one-line ConfigError."""
    if isinstance(format, Layout):
        return format
    try:
        return LAYOUTS[ExportFormat(format)]
    except ValueError:
        raise ConfigError(f"export format must be one of {[m.value for m in ExportFormat]}, got {format!r}") from None
