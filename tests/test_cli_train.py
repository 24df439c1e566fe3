"""`rdlm train`'s flags come from TrainConfig's field types (rdlm/cli/train.py)."""

import argparse
import dataclasses
from dataclasses import dataclass, field

import pytest

from rdlm.cli.train import NOT_FLAGS, add_config_flags, build_config
from rdlm.train import TrainConfig


def train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--config")
    p.add_argument("--set", action="append", default=[])
    add_config_flags(p, TrainConfig, skip=NOT_FLAGS)
    return p


def test_every_field_has_a_flag_of_its_type():
    p = train_parser()
    flags = {a.dest for a in p._actions}
    assert {f.name for f in dataclasses.fields(TrainConfig)} - flags == {"model_overrides"}
    args = p.parse_args(["--betas", "0.8,0.9", "--eval-num-steps", "1,2,3", "--update-clip", "none",
                         "--threads", "off", "--ema-decay", "0.5", "--no-progress", "--compile", "--lr", "0.1",
                         "--model", "small", "--steps", "7"])
    config = build_config(args)
    assert config.betas == (0.8, 0.9) and config.eval_num_steps == (1, 2, 3)
    assert config.update_clip is None and config.threads is None and config.ema_decay == 0.5
    assert config.progress is False and config.compile is True and config.lr == 0.1
    assert (config.model, config.steps) == ("small", 7)
    untouched = build_config(p.parse_args([]))
    assert untouched == TrainConfig(model_overrides={})  # no flag given: every field keeps its default


@pytest.mark.parametrize("argv, message", [(["--betas", "0.9"], "expected 2 comma-separated values"),
                                           (["--steps", "many"], "invalid int value"),
                                           (["--threads", "two"], "invalid int value")])
def test_bad_flag_values_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        train_parser().parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("annotation", [list[int], dict[str, int], int | str, bool | None, tuple, tuple[int, str]])
def test_a_field_type_without_a_flag_fails_when_the_parser_is_built(annotation):
    config = dataclasses.make_dataclass("Config", [("steps", int, 1), ("layers", annotation, None)])
    with pytest.raises(TypeError, match="field 'layers'"):
        add_config_flags(argparse.ArgumentParser(), config)


def test_skipped_fields_need_no_flag():
    @dataclass
    class Config:
        steps: int = 1
        extra: dict = field(default_factory=dict)

    p = argparse.ArgumentParser()
    add_config_flags(p, Config, skip=("extra",))
    assert p.parse_args(["--steps", "3"]).steps == 3
