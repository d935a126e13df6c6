"""The typed recipe schema: every recipe dry-runs, every bad choice is refused at composition,
and every CLI answers `--help` (in-process: no interpreter per case)."""

from __future__ import annotations

import dataclasses
import typing
from enum import StrEnum
from pathlib import Path

import pytest
import yaml

from eagle31.config import DrafterConfig
from eagle31.data.store import STORE_DTYPES, StoreDtype
from eagle31.errors import ConfigError
from eagle31.pipeline import run
from eagle31.recipe import (
    DrafterSection,
    RunConfig,
    describe_section,
    drafter_section,
    field_rows,
    load_recipe,
    section_class,
    section_doc,
    section_names,
    to_container,
)
from eagle31_cli import parse_key_values, recipe_main
from tests.helpers import run_script

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
NAMES = sorted(p.stem for p in (RECIPES / "recipe").glob("*.yaml"))

# One bad value per choice of the schema: (override, the field the error must name).
BAD_CHOICES = [
    ("target.builtin=llama", "target.builtin"),
    ("target.dtype=int8", "target.dtype"),
    ("data.overflow=cut", "data.overflow"),
    ("features.mode=disk", "features.mode"),
    ("features.store_dtype=int2", "features.store_dtype"),
    ("features.batching=bogus", "features.batching"),
    ("features.import_split=test", "features.import_split"),
    ("features.engine.worker=sglang", "features.engine.worker"),
    ("features.engine.transport=nccl", "features.engine.transport"),
    ("features.engine.mooncake_protocol=efa", "features.engine.mooncake_protocol"),
    ("drafter.init_from_format=eagle2", "drafter.init_from_format"),
    ("drafter.attention=gqa", "drafter.attention"),
    ("regenerate.backend=grpc", "regenerate.backend"),
    ("regenerate.device=tpu", "regenerate.device"),
    ("regenerate.on_length=truncate", "regenerate.on_length"),
    ("train.attention_kernel=bogus", "train.attention_kernel"),
    ("train.device=tpu", "train.device"),
    ("train.precision=fp8", "train.precision"),
    ("train.loss=mse", "train.loss"),
    ("train.optimizer=sgd", "train.optimizer"),
    ("train.schedule=step", "train.schedule"),
    ("train.muon_adjust_lr=none", "train.muon_adjust_lr"),
    ("export.formats=[bogus]", "export.formats"),
    ("export.dtype=int4", "export.dtype"),
    ("logging.wandb.mode=bogus", "logging.wandb.mode"),
    ("resume=sometimes", "resume"),
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.slow
def test_every_recipe_dry_runs(name, tmp_path, capsys):
    report = run(load_recipe(RECIPES, [f"recipe={name}", "dry_run=true", f"output_dir={tmp_path / 'run'}"]))
    assert report["recipe"] == name and report["parameters"]["trainable"] > 0
    assert f"dry run of recipe {name!r}: config valid" in capsys.readouterr().out
    assert not (tmp_path / "run").exists()  # a dry run writes nothing


@pytest.mark.slow
def test_a_dry_run_of_a_store_run_says_the_disk_the_store_takes(tmp_path, capsys):
    report = run(load_recipe(RECIPES, ["recipe=kimi_k26", "dry_run=true", f"output_dir={tmp_path / 'run'}"]))
    assert report["store_bytes_per_token"] == 4 * 7168 * 2 + 5  # 3 aux + final in bf16, input id and loss mask
    assert "feature store (bfloat16): 56.0 KiB per token, 5.22 TiB per 100M tokens of data" in capsys.readouterr().out


@pytest.mark.parametrize(
    "override, error",
    [
        ("target.path=/nonexistent/Kimi-K2.6", "error: target.path='/nonexistent/Kimi-K2.6' is not a directory"),
        (
            "data.source=[/nonexistent/chats.jsonl]",
            "error: data.source: no such file or directory: /nonexistent/chats.jsonl",
        ),
    ],
)
@pytest.mark.slow
def test_a_dry_run_refuses_a_target_or_data_that_does_not_exist(override, error, tmp_path, capsys):
    """The dry run reads neither, but a path it would train on that is not there is one line, not "config valid"."""
    argv = ["recipe=kimi_k26", "dry_run=true", override, f"output_dir={tmp_path / 'run'}"]
    assert recipe_main(run, RECIPES, argv) == 2
    out, err = capsys.readouterr()
    assert "config valid" not in out and err == error + "\n"
    argv[2] = f"{override.split('=')[0]}={'[' if '[' in override else ''}{tmp_path}{']' if '[' in override else ''}"
    assert recipe_main(run, RECIPES, argv) == 0, capsys.readouterr().err  # an existing folder passes


@pytest.mark.parametrize("override, field", BAD_CHOICES)
def test_each_bad_choice_is_refused_at_composition(override, field):
    with pytest.raises(ConfigError) as e:
        load_recipe(RECIPES, ["recipe=kimi_k26", "dry_run=true", override])
    message = str(e.value)
    assert "\n" not in message and field in message and "expected one of" in message


def test_the_bad_choices_together_are_refused_before_anything_runs(capsys):
    bad = [o for o, _ in BAD_CHOICES]
    ran = []
    assert recipe_main(ran.append, RECIPES, ["recipe=kimi_k26", "dry_run=true", *bad]) == 2
    assert not ran
    out, err = capsys.readouterr()
    assert "config valid" not in out and err.startswith("error: ") and err.count("\n") == 1


@pytest.mark.parametrize("where", ["command line", "recipe file"])
def test_the_earlier_train_attention_is_refused_naming_train_attention_kernel(where, tmp_path, capsys):
    """`train.attention` picked the kernel, `drafter.attention` the architecture: the kernel's is now
    `train.attention_kernel`, and the old key gets one line naming the new one, wherever it is spelled."""
    recipes, overrides = RECIPES, ["recipe=kimi_k26", "dry_run=true", "train.attention=flash"]
    if where == "recipe file":
        recipes, overrides = tmp_path / "recipes", ["recipe=demo"]
        (recipes / "recipe").mkdir(parents=True)
        (recipes / "config.yaml").write_text((RECIPES / "config.yaml").read_text())
        (recipes / "recipe" / "demo.yaml").write_text("# @package _global_\nname: old\ntrain:\n  attention: flash\n")
    ran = []
    assert recipe_main(ran.append, recipes, overrides) == 2 and not ran
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "train.attention is now train.attention_kernel" in err and "drafter.attention" in err
    )


def test_a_bad_choice_inside_a_recipe_file_names_its_field(tmp_path):
    recipes = tmp_path / "recipes"
    (recipes / "recipe").mkdir(parents=True)
    (recipes / "config.yaml").write_text((RECIPES / "config.yaml").read_text())
    (recipes / "recipe" / "demo.yaml").write_text("# @package _global_\nname: bad\ntrain:\n  precision: fp8\n")
    with pytest.raises(ConfigError, match=r"'fp8', expected one of \[auto, bf16, fp32\] \(field train\.precision\)"):
        load_recipe(recipes, [])


def _choice_fields(schema: type, prefix: str = "") -> dict[str, type]:
    """Dotted name -> enum of every choice field in the schema tree."""
    found = {}
    for f in dataclasses.fields(schema):
        hint = typing.get_type_hints(schema)[f.name]
        kinds = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
        kind = typing.get_args(kinds[0])[0] if typing.get_origin(kinds[0]) is list else kinds[0]
        if dataclasses.is_dataclass(kind):
            found |= _choice_fields(kind, f"{prefix}{f.name}.")
        elif isinstance(kind, type) and issubclass(kind, StrEnum):
            found[prefix + f.name] = kind
    return found


def test_every_choice_field_has_a_bad_value_case():
    missing = set(_choice_fields(RunConfig)) - {field for _, field in BAD_CHOICES}
    assert not missing, f"add a bad value of {sorted(missing)} to BAD_CHOICES"
    assert {field for _, field in BAD_CHOICES} <= set(_choice_fields(RunConfig))


def test_choices_compose_as_the_strings_recipes_spell():
    cfg = load_recipe(RECIPES, ["recipe=kimi_k26", "train.attention_kernel=blockwise", "export.formats=[speculators]"])
    assert cfg.train.attention_kernel == "blockwise" and f"{cfg.train.attention_kernel}" == "blockwise"
    plain = to_container(cfg)
    assert plain["export"]["formats"] == ["speculators"] and type(plain["train"]["device"]) is str
    assert yaml.safe_load(yaml.safe_dump(plain)) == plain  # the run directory's config.yaml


INITIALISATION = ("init_from", "init_from_format", "upgrade_to_eagle31")  # the section's own fields


def test_the_drafter_section_is_made_of_drafter_config_fields():
    """Every DrafterConfig field a recipe may set is a `drafter.*` field, an override (None: the target's) or a
    setting with DrafterConfig's default; a field only the target decides is not; then the initialisation's."""
    section = {f.name: f for f in dataclasses.fields(DrafterSection)}
    hints = typing.get_type_hints(DrafterSection)
    assert list(section)[-3:] == list(INITIALISATION)
    for f in dataclasses.fields(DrafterConfig):
        source = f.metadata.get("recipe")
        if source == "target":
            assert f.name not in section, f.name
        elif dataclasses.is_dataclass(hints[f.name]):  # an attention kind's fields: each None (the target's)
            nested = hints[f.name]()
            assert all(getattr(nested, g.name) is None for g in dataclasses.fields(hints[f.name])), f.name
        elif source == "override":
            assert section[f.name].default is None and type(None) in typing.get_args(hints[f.name]), f.name
        else:
            assert (
                section[f.name].default == f.default and hints[f.name] == typing.get_type_hints(DrafterConfig)[f.name]
            )
    assert len(section) == len(INITIALISATION) + sum(
        f.metadata.get("recipe") != "target" for f in dataclasses.fields(DrafterConfig)
    )


def test_a_new_drafter_field_is_a_recipe_field_with_no_line_in_recipe_py(tmp_path):
    """docs/architecture.md, "How to add a drafter switch": a field on DrafterConfig (here on a subclass, as the
    toy of a test) is in the section made of it, with its default, and composes from the command line."""

    @dataclasses.dataclass
    class WithToySwitch(DrafterConfig):
        toy_switch: bool = False

    section = drafter_section(WithToySwitch)
    toy = next(f for f in dataclasses.fields(section) if f.name == "toy_switch")
    assert toy.default is False and typing.get_type_hints(section)["toy_switch"] is bool
    from omegaconf import OmegaConf

    composed = OmegaConf.merge(OmegaConf.structured(section), OmegaConf.from_dotlist(["toy_switch=true"]))
    assert composed.toy_switch is True


def test_store_dtype_choices_are_the_dtypes_the_store_writes():
    assert set(StoreDtype) == set(STORE_DTYPES)


def test_key_value_choices_are_checked_when_parsed():
    @dataclasses.dataclass
    class Args:
        dtype: StoreDtype | None = None

    assert parse_key_values(["dtype=float8"], Args).dtype is StoreDtype.float8
    with pytest.raises(
        ConfigError, match=r"dtype must be one of \['bfloat16', 'float16', 'float32', 'float8'\], got 'int2'"
    ):
        parse_key_values(["dtype=int2"], Args)


# ---------------------------------------------------------------------------- --help and --cfg


CLIS = [
    "train/main.py",
    *(f"data_prep/{p.name}" for p in sorted((REPO / "data_prep").glob("*.py"))),
    *(f"scripts/{p.name}" for p in sorted((REPO / "scripts").glob("*.py"))),
]


@pytest.mark.parametrize("cli", CLIS)
def test_every_cli_answers_help(cli, monkeypatch, capsys):
    path = REPO / cli
    assert run_script(path, ["--help"], monkeypatch) == 0
    out = capsys.readouterr().out
    assert f"python {cli}" in out or f"{path.name}" in out  # opens with how to run it
    if cli.startswith(("train/", "data_prep/")):  # the recipe CLIs list the recipes and sections
        assert all(name in out for name in NAMES)
        assert all(f"  {section}" in out for section in ("target", "data", "features", "drafter", "train", "export"))
        assert "attention_kernel={auto|flash|blockwise|reference}" in out and "attention={llama|mla}" in out


@pytest.mark.parametrize("section", section_names())
def test_every_field_of_every_section_says_what_it_means(section):
    """`--help SECTION` reads each field's meaning from the comment on or above it: none may be missing."""
    owner = section_class(section)
    assert section == "top" or section_doc(owner), f"{section}: the section has no docstring"
    rows = field_rows(owner, "" if section == "top" else f"{section}.")
    undocumented = [
        name
        for name, _, _, meaning in rows
        if len(meaning.split()) < 3 and not (section == "top" and name in section_names())
    ]
    assert not undocumented, f"fields without a one-line meaning: {undocumented}"


def meaning(name: str) -> str:
    section = name.rsplit(".", 1)[0]
    return next(m for path, _, _, m in field_rows(section_class(section), f"{section}.") if path == name)


def test_help_section_prints_type_default_and_meaning(monkeypatch, capsys):
    assert run_script(REPO / "train" / "main.py", ["--help", "train", "features"], monkeypatch) == 0
    out = capsys.readouterr().out
    assert "  train.keep_last  (int, default 2)\n      checkpoints kept on disk" in out
    assert "  train.attention_kernel  ({auto|flash|blockwise|reference}, default auto)" in out
    assert "  features.engine.rates_from  (str or null, default null)" in out  # nested sections too
    assert "  export.formats  (list of {eagle3|speculators}" in describe_section("export")
    # the global batch, where a reader looks for it: under the micro-batch and the accumulation
    assert "train.grad_accum x (world size / train.sequence_parallel)" in meaning("features.tokens_per_batch")
    assert "grad_accum x (world size / sequence_parallel) micro-batches" in meaning("train.grad_accum")
    for name, words in [
        ("data.overflow", "truncate keeps"),
        ("data.eval_fraction", "held out"),
        ("train.weight_decay", "AdamW"),
        ("drafter.attention", "llama"),
    ]:
        assert words in meaning(name), name


def test_help_of_an_unknown_section_is_one_line_naming_the_sections(monkeypatch, capsys):
    assert run_script(REPO / "data_prep" / "capture.py", ["--help", "trian"], monkeypatch) == 2
    err = capsys.readouterr().err.strip()
    assert (
        "\n" not in err and err.startswith("error: --help trian: no such config section") and "features.engine" in err
    )


def test_cfg_prints_the_composed_config_and_runs_nothing(capsys):
    ran = []
    assert (
        recipe_main(ran.append, RECIPES, ["recipe=kimi_k26", "--cfg", "train.lr=5e-5", "features.batching=bucket"]) == 0
    )
    assert not ran
    printed = yaml.safe_load(capsys.readouterr().out)
    assert (
        printed["name"] == "kimi_k26" and printed["train"]["lr"] == 5e-5 and printed["features"]["batching"] == "bucket"
    )
    assert printed["target"]["config"].endswith("recipes/targets/kimi_k26.json")  # resolved, not ${recipes_dir:}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["recipe=demo", "drafter.sliding_window=4", "train.ttt_length=7"],
            "drafter.sliding_window=4 must be >= train.ttt_length=7",
        ),
        (
            ["recipe=kimi_k26", "drafter.sliding_window=2048"],
            "drafter.sliding_window=2048 cannot be served: vLLM builds an MLA drafter's attention without a window",
        ),
    ],
)
def test_a_window_the_run_could_not_train_or_serve_is_refused_at_the_plan(overrides, message, tmp_path):
    args = [*overrides, "dry_run=true", f"output_dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError, match=message) as e:
        run(load_recipe(RECIPES, args))
    assert "\n" not in str(e.value)
