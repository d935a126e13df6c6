"""The drafter's attention kinds (`eagle31.drafter_attention`): each choice has its class, each class its own
fields, and no module outside the kinds tells them apart by name."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from eagle31.config import DrafterConfig
from eagle31.drafter_attention import KINDS, AttentionKind, DrafterAttention

LIBRARY = Path(__file__).resolve().parents[1] / "eagle31"


def test_every_choice_has_its_kind_and_each_kind_its_own_fields():
    assert set(KINDS) == set(DrafterAttention)
    config_fields = {f.name for f in dataclasses.fields(DrafterConfig)}
    owned = [name for kind in KINDS.values() for name in kind.fields]
    assert set(owned) <= config_fields and len(owned) == len(set(owned))
    for member, kind in KINDS.items():
        assert isinstance(kind, AttentionKind) and kind.name == member and member.kind is kind


def test_a_kind_that_leaves_out_a_method_cannot_be_made():
    class Half(AttentionKind):
        name = "half"

        def validate(self, cfg):
            pass

    with pytest.raises(TypeError, match="abstract"):
        Half()


@pytest.mark.parametrize("path", sorted(p for p in LIBRARY.rglob("*.py") if "drafter_attention" not in p.parts),
                         ids=lambda p: str(p.relative_to(LIBRARY)))  # fmt: skip
def test_no_module_outside_the_kinds_names_one(path):
    """A kind's name in code (a string to compare with) belongs to its class; docstrings and comments may say it."""
    names = {member.value for member in DrafterAttention} - {"llama"}  # "llama" is also HF's model_type of a layer
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(node) is not None}  # fmt: skip
    found = [node.lineno for node in ast.walk(tree)
             if isinstance(node, ast.Constant) and node.value in names and id(node) not in docstrings]  # fmt: skip
    assert not found, f"{path.relative_to(LIBRARY)}: lines {found}"
