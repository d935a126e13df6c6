"""`LAYOUTS`, the one list of export formats that recipes, detection, reading and model cards ask (CONTRIBUTING.md)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from eagle31.errors import ConfigError
from eagle31.layouts.eagle3 import Eagle3Layout
from eagle31.layouts.layout import Layout
from eagle31.layouts.speculators import SpeculatorsLayout

LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in (Eagle3Layout(), SpeculatorsLayout())}
UNMARKED = Eagle3Layout.name  # the layout of a config no layout recognises: vLLM's own


def layout_of(format: str | Layout) -> Layout:
    """The layout of an export format's name (a `Layout` is itself); another name is a one-line ConfigError."""
    if isinstance(format, Layout):
        return format
    if format not in LAYOUTS:
        raise ConfigError(f"export format must be one of {list(LAYOUTS)}, got {format!r}")
    return LAYOUTS[format]


def layout_of_config(meta: dict[str, Any]) -> Layout:
    """The layout a checkpoint's `config.json` is in: the one that recognises it (`Layout.recognises`), else vLLM's."""
    return next((layout for layout in LAYOUTS.values() if layout.recognises(meta)), LAYOUTS[UNMARKED])


# the source formats besides `source_formats()`: detect it, or eagle31's own checkpoint
AUTO, NATIVE = "auto", "eagle31"


def source_formats() -> list[str]:
    """The formats a checkpoint can be read as, besides eagle31's own: every layout, then every layout's dialects."""
    return [*LAYOUTS, *(dialect for layout in LAYOUTS.values() for dialect in layout.dialects)]


def source_layout(format: str | Layout) -> Layout:
    """The layout a source format's files are in: its own, or the one it is a dialect of (a `Layout` is itself)."""
    if isinstance(format, Layout):
        return format
    return next(layout for name, layout in LAYOUTS.items() if format == name or format in layout.dialects)


# a drafter to read (`eagle31.convert.load_drafter`): detected from its config.json (auto), eagle31's own, or a
# layout or a layout's dialect (`eagle31.layouts.source_formats`)
DrafterFormat = StrEnum(  # type: ignore[misc]  # its members come from LAYOUTS, known at run time
    "DrafterFormat", [(name, name) for name in (AUTO, NATIVE, *source_formats())], module=__name__
)


ExportFormat = StrEnum("ExportFormat", [(name, name) for name in LAYOUTS], module=__name__)  # type: ignore[misc]  # as above
