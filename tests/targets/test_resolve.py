"""`resolve_target_path`: built-in names, local paths and the errors that name the field."""

import pytest

from eagle31.errors import ConfigError
from eagle31.targets import TargetConfig, resolve_target_path
from eagle31.targets.kimi_mini import ensure_kimi_k26_mini


def test_local_path_is_returned(tmp_path):
    assert resolve_target_path(TargetConfig(path=str(tmp_path))) == tmp_path


def test_missing_path_names_target_path(tmp_path):
    with pytest.raises(ConfigError, match=r"target\.path='.*nowhere' is not a directory"):
        resolve_target_path(TargetConfig(path=str(tmp_path / "nowhere")))
    with pytest.raises(ConfigError, match=r"target\.path is not set"):
        resolve_target_path(TargetConfig())


def test_unknown_builtin_names_target_builtin():
    with pytest.raises(ConfigError, match=r"target\.builtin='llama' is not a built-in target"):
        resolve_target_path(TargetConfig(builtin="llama"))


def test_builtin_kimi_mini_resolves_to_the_cached_build():
    path = resolve_target_path(TargetConfig(builtin="kimi_k26_mini", path="/ignored"))
    assert path == ensure_kimi_k26_mini() and (path / "model.safetensors").is_file()
