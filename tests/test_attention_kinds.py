"""The drafter's attention kinds (`eagle31.attention`): each choice has its class, each class its own
fields, and no module outside the kinds tells them apart by name."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch.nn.functional as F

from eagle31.attention import KINDS, AttentionKind, DrafterAttention
from eagle31.attention.llama import LlamaAttention, LlamaAttentionKind, apply_rope
from eagle31.config import DrafterConfig
from eagle31.kernels.entries import KEYS_VALUES
from eagle31.ttt import ttt_unroll
from tests.helpers import random_batch, tiny_drafter

REPO = Path(__file__).resolve().parents[1]
LIBRARY = REPO / "eagle31"
# the library and the code over it: none of it tells the kinds apart by comparing a name
CODE = sorted(
    p
    for folder in ("eagle31", "experiments", "benchmarks", "scripts", "data_prep", "train")
    for p in (REPO / folder).rglob("*.py")
    if "attention" not in p.parts
)


def test_every_choice_has_its_kind_and_each_kind_its_own_fields():
    assert set(KINDS) == set(DrafterAttention)
    config_fields = {f.name for f in dataclasses.fields(DrafterConfig)}
    owned = [kind.config_field for kind in KINDS.values() if kind.config_field]
    assert set(owned) <= config_fields and len(owned) == len(set(owned))
    for kind in KINDS.values():  # a kind's fields are its config type's, held by its field of DrafterConfig
        assert (kind.config_field is None) == (kind.config_type is None) == (kind.fields() == ())
    for member, kind in KINDS.items():
        assert isinstance(kind, AttentionKind) and kind.name == member and member.kind is kind


def test_a_kind_that_leaves_out_a_method_cannot_be_made():
    class Half(AttentionKind):
        name = "half"

        def validate(self, cfg):
            pass

    with pytest.raises(TypeError, match="abstract"):
        Half()


@pytest.mark.parametrize(
    "path",
    sorted(p for p in LIBRARY.rglob("*.py") if "attention" not in p.parts),
    ids=lambda p: str(p.relative_to(LIBRARY)),
)
def test_no_module_outside_the_kinds_names_one(path):
    """A kind's name in code (a string to compare with) belongs to its class; docstrings and comments may say it."""
    names = {member.value for member in DrafterAttention} - {"llama"}  # "llama" is also HF's model_type of a layer
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(node) is not None
    }
    found = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in names and id(node) not in docstrings
    ]
    assert not found, f"{path.relative_to(LIBRARY)}: lines {found}"


def kind_name_comparisons(source: str) -> list[int]:
    """Lines of `source` that compare a value with a kind's name (`==`, `!=`, `in` a literal tuple, a `case`); a
    name as a config value or a dict key is no comparison."""
    names = {member.value for member in DrafterAttention}
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            spelled = [e for o in operands for e in (o.elts if isinstance(o, (ast.Tuple, ast.List, ast.Set)) else [o])]
        elif isinstance(node, ast.MatchValue):
            spelled = [node.value]
        else:
            continue
        if any(isinstance(e, ast.Constant) and e.value in names for e in spelled):
            found.append(node.lineno)
    return found


@pytest.mark.parametrize("path", CODE, ids=lambda p: str(p.relative_to(REPO)))
def test_no_code_compares_with_a_kind_name(path):
    """`recipe.drafter.attention != "llama"` asks the name, not the kind: compare with the member, or ask the kind."""
    found = kind_name_comparisons(path.read_text())
    assert not found, f"{path.relative_to(REPO)}: lines {found}"


def test_a_comparison_with_a_kind_name_is_found_and_a_value_is_not():
    compared = [
        'if recipe.drafter.attention != "llama":\n    pass',
        'x = a in ("mla", "b")',
        'match kind:\n    case "mla":\n        pass',
        'ok = "llama" == name',
    ]
    assert all(kind_name_comparisons(source) for source in compared)
    spelled = [
        'overrides = ["drafter.attention=mla"]',
        'cfg = {"attention": "llama"}',
        'x = {"mla": 1}["mla"]',
        "if kind == DrafterAttention.llama:\n    pass",
    ]
    assert not any(kind_name_comparisons(source) for source in spelled)


# ---------------------------------------------------------------------------- a kind defined here alone


class QKNormAttention(LlamaAttention):
    """Llama attention with an RMSNorm on each head's query and key (as Qwen3's layer has): a toy kind's module."""

    def __init__(self, config, rms_norm):
        super().__init__(config)
        self.q_norm = rms_norm(config.head_dim, config.rms_norm_eps)
        self.k_norm = rms_norm(config.head_dim, config.rms_norm_eps)

    def query(self, z, cos, sin):
        B, T, _ = z.shape
        return apply_rope(self.q_norm(self.q_proj(z).view(B, T, self.num_heads, self.head_dim)), cos, sin)

    def key_value(self, z, cos, sin, k_weight, v_weight):
        B, T, _ = z.shape
        k = self.k_norm(F.linear(z, k_weight).view(B, T, self.num_kv_heads, self.head_dim))
        return apply_rope(k, cos, sin), F.linear(z, v_weight).view(B, T, self.num_kv_heads, self.head_dim)

    def chain_keys_values(self):
        return KEYS_VALUES  # each chain step keeps its keys and values


class QKNormKind(LlamaAttentionKind):
    name, label = "qk_norm", "a QK-norm drafter"
    chain_keeps_input = False  # the chain keeps keys (remaking them from inputs would need k_norm's weight too)

    def attention(self, config, rms_norm):
        return QKNormAttention(config, rms_norm)


def test_a_new_kind_is_its_class_and_its_line_in_kinds(monkeypatch):
    """docs: CONTRIBUTING.md, "How to add": a kind defined and registered in this module alone (a recipe's choice
    would also need its `DrafterAttention` member) builds a drafter whose memory-lean unroll is the reference's, its
    own weights' gradients included."""
    from tests.test_reference import DOCS, K, assert_same, logits_and_gradients

    monkeypatch.setitem(KINDS, "qk_norm", QKNormKind())
    drafter = tiny_drafter(seed=11, attention="qk_norm")
    assert isinstance(drafter.midlayer.self_attn, QKNormAttention) and drafter.config.kind.name == "qk_norm"
    aux, _, ids, _ = random_batch(drafter.config, 2, 15, seed=12)
    expected = logits_and_gradients(drafter, lambda d: d.unroll(aux, ids, ttt_length=K, document_ids=DOCS).states)
    assert "midlayer.self_attn.k_norm.weight" in expected[1]
    for kernel in ("flash", "blockwise"):

        def run(d, kernel=kernel):
            return ttt_unroll(d, aux, ids, ttt_length=K, document_ids=DOCS, attention_kernel=kernel).states

        assert_same(logits_and_gradients(drafter, run), expected)
