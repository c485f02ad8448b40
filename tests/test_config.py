"""Stage configs (src/qerl_cli/config.py, stages/*.toml): every shipped file loads; --config overrides; bad files fail."""

from __future__ import annotations

import dataclasses
import importlib
import re
import tomllib
from pathlib import Path

import pytest

from qerl_cli import config
from qerl_cli.errors import QerlError

STAGES = sorted(p.stem for p in config.stages_dir().glob("*.toml"))


def _config_class(stage: str):
    """Stage ``foo`` has ``FooConfig`` in ``qerl_cli.foo``."""
    mod = importlib.import_module(f"qerl_cli.{stage}")
    cls = getattr(mod, f"{stage.capitalize()}Config", None)
    assert cls is not None and dataclasses.is_dataclass(cls), f"stages/{stage}.toml has no config class {stage}.{stage.capitalize()}Config"
    return cls


def _settable(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}


def test_shipped_stage_files_found():
    assert config.stages_dir() == Path(__file__).resolve().parents[1] / "stages" or "stages" in str(config.stages_dir())
    assert {"quantize", "pack", "verify"} <= set(STAGES)


@pytest.mark.parametrize("stage", STAGES)
def test_shipped_config_loads(stage):
    cls = _config_class(stage)
    cfg = config.load(stage, cls)
    assert isinstance(cfg, cls)
    shipped = tomllib.loads(config.shipped_config_path(stage).read_text())
    # the file sets exactly what a user may set: nothing missing, nothing silently ignored
    assert set(shipped) == _settable(cls)
    d = config.as_dict(cfg)
    for k, v in shipped.items():
        assert d[k] == v, k


@pytest.mark.parametrize("stage", STAGES)
def test_every_shipped_parameter_is_documented(stage):
    lines = config.shipped_config_path(stage).read_text().splitlines()
    keys = [(i, m.group(1)) for i, line in enumerate(lines) if (m := re.match(r"^([A-Za-z_][A-Za-z0-9_]*)\s*=", line))]
    for i, key in keys:
        j = i - 1
        while j >= 0 and lines[j].strip() and not lines[j].lstrip().startswith("#"):
            j -= 1  # another key (or an array's continuation) sharing the comment above it
        assert j >= 0 and lines[j].lstrip().startswith("#"), f"stages/{stage}.toml: '{key}' has no comment"


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "user.toml"
    p.write_text(text)
    return p


def test_config_file_overrides_defaults(tmp_path):
    from qerl_cli.verify import VerifyConfig

    cfg = config.load("verify", VerifyConfig, _write(tmp_path, "seed = 7\nbatch_sizes = [2, 3]\nrel_tol_fp32 = 1\n"))
    assert cfg.seed == 7 and cfg.batch_sizes == (2, 3)
    assert cfg.rel_tol_fp32 == 1.0 and isinstance(cfg.rel_tol_fp32, float)
    default = config.load("verify", VerifyConfig)
    assert cfg.prompts == default.prompts  # untouched keys keep the shipped default
    # flags beat the file; None flags are ignored
    cfg2 = config.load("verify", VerifyConfig, _write(tmp_path, "seed = 7\n"), {"seed": 9, "progress": None})
    assert cfg2.seed == 9 and cfg2.progress == default.progress


def test_config_file_overrides_quantize_targets(tmp_path):
    from qerl_cli.quantize import QuantizeConfig

    cfg = config.load("quantize", QuantizeConfig,
                      _write(tmp_path, 'targets = ["o_proj", "down_proj"]\nfused_groups = []\n'))
    assert tuple(cfg.targets) == ("o_proj", "down_proj") and tuple(cfg.fused_groups) == ()


def test_quantize_fused_groups_that_overlap_are_refused(tmp_path):
    """k_proj in two fused groups was quantized twice, the second global scale overwriting the first: q_proj and
    k_proj, asked to share one scale, did not (silently). One sentence instead."""
    from qerl_cli.quantize import QuantizeConfig

    with pytest.raises(QerlError, match="'k_proj' is in more than one fused group"):
        config.load("quantize", QuantizeConfig,
                    _write(tmp_path, 'fused_groups = ["q_proj,k_proj", "k_proj,v_proj"]\n'))


def test_unknown_key(tmp_path):
    from qerl_cli.verify import VerifyConfig

    with pytest.raises(QerlError, match=r"unknown verify parameter\(s\) \['sead'\]"):
        config.load("verify", VerifyConfig, _write(tmp_path, "sead = 1\n"))


def test_stage_set_field_cannot_come_from_a_file(tmp_path):
    from qerl_cli.quantize import QuantizeConfig

    with pytest.raises(QerlError, match="unknown quantize parameter"):
        config.load("quantize", QuantizeConfig, _write(tmp_path, 'method = "awq"\n'))


def test_missing_and_malformed_config_file(tmp_path):
    from qerl_cli.pack import PackConfig

    with pytest.raises(QerlError, match="does not exist"):
        config.load("pack", PackConfig, tmp_path / "nope.toml")
    with pytest.raises(QerlError, match="not valid TOML"):
        config.load("pack", PackConfig, _write(tmp_path, "progress = = true\n"))


WRONG_TYPES = [
    ("verify", "seed = \"x\""),
    ("verify", "seed = true"),
    ("verify", "seed = 1.5"),
    ("verify", "rel_tol_fp32 = \"1e-5\""),
    ("verify", "rel_tol_fp32 = true"),
    ("verify", "progress = 1"),
    ("verify", "batch_sizes = 4"),
    ("verify", "batch_sizes = [\"a\"]"),
    ("verify", "batch_sizes = [1.5]"),
    ("verify", "prompts = [1, 2]"),
    ("verify", "prompts = \"What is 7 + 5?\""),
    ("quantize", "targets = \"q_proj\"\nfused_groups = []"),
    ("quantize", "targets = [1]\nfused_groups = []"),
    ("quantize", "fused_groups = \"q_proj,k_proj\""),
    ("quantize", "progress = \"yes\""),
    ("pack", "progress = \"no\""),
]


@pytest.mark.parametrize("stage,line", WRONG_TYPES, ids=[f"{s}:{l.splitlines()[0]}" for s, l in WRONG_TYPES])
def test_wrong_type_is_a_clear_error(tmp_path, stage, line):
    cls = _config_class(stage)
    with pytest.raises(QerlError) as e:
        config.load(stage, cls, _write(tmp_path, line + "\n"))
    assert line.split("=")[0].strip() in str(e.value)


@pytest.mark.parametrize("line,match", [("batch_sizes = [0, 1]", "batch_sizes"), ("rel_tol_fp32 = -1.0", "rel_tol_fp32"),
                                         ("top1_min_bf16 = 2.0", "top1_min_bf16"), ("prompts = []", "prompts")])
def test_invalid_values(tmp_path, line, match):
    from qerl_cli.verify import VerifyConfig

    with pytest.raises(QerlError, match=match):
        config.load("verify", VerifyConfig, _write(tmp_path, line + "\n"))


def test_invalid_quantize_values(tmp_path):
    from qerl_cli.quantize import QuantizeConfig

    with pytest.raises(QerlError, match="targets"):
        config.load("quantize", QuantizeConfig, _write(tmp_path, "targets = []\nfused_groups = []\n"))
    with pytest.raises(QerlError, match="fused group"):
        config.load("quantize", QuantizeConfig, _write(tmp_path, 'targets = ["q_proj"]\n'))


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_float_is_a_clear_error(tmp_path, value):
    """A float parameter that is NaN or infinite is refused by name in every stage (rollout took
    `format_reward = nan` silently, and every reward of its artifact became NaN)."""
    from qerl_cli.rollout import RolloutConfig

    with pytest.raises(QerlError, match="format_reward.*finite"):
        config.load("rollout", RolloutConfig, _write(tmp_path, f"format_reward = {value}\n"))
    with pytest.raises(QerlError, match="format_reward.*finite"):
        config.load("rollout", RolloutConfig, None, {"format_reward": float(value)})  # (a flag's value)


@pytest.mark.parametrize("value", [2**40, 2**63])
def test_a_huge_integer_setting_is_a_clear_error(tmp_path, value):
    """An integer setting of 2**40 or more in size (a count, a size, a seed) is refused by name in every stage,
    not an overflow or out-of-memory traceback inside it (review, session 32)."""
    from qerl_cli.rollout import RolloutConfig
    from qerl_cli.train import TrainConfig

    with pytest.raises(QerlError, match=r"group must be below 2\*\*40"):
        config.load("rollout", RolloutConfig, _write(tmp_path, f"group = {value}\n"))
    with pytest.raises(QerlError, match=r"lora_rank must be below 2\*\*40"):
        config.load("train", TrainConfig, None, {"lora_rank": value})
    assert config.load("rollout", RolloutConfig, None, {"group": 2**40 - 1}).group == 2**40 - 1
