"""Flags of bench.collectives (bench.collectives.cli): nccl-tests size syntax and the config's validation."""

import pytest
import torch

from bench.collectives.catalog import ALL_OPS
from bench.collectives.cli import parse_config, parse_stages
from bench.harness.flags import parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [("8", 8), ("1K", 1024), ("64M", 64 << 20), ("2G", 2 << 30), ("4k", 4096), ("16MB", 16 << 20)],
)
def test_parse_size_suffixes_are_powers_of_1024(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "1.5M", "M", "-1K", "1T"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_parse_stages():
    assert parse_stages("auto") == (None,)
    assert parse_stages("1,2,4") == (1, 2, 4)
    with pytest.raises(ValueError):
        parse_stages("0")


def test_sweep_is_geometric_and_inclusive():
    config = parse_config(["-b", "1M", "-e", "64M", "-f", "2", "-d", "bfloat16"])
    assert config.sizes == [1 << k for k in range(20, 27)]
    assert config.torch_dtype == torch.bfloat16
    assert config.ops == ALL_OPS


def test_ops_and_outputs():
    config = parse_config(["--ops", "all_gather,reduce_scatter_q4", "--stages", "1,2", "--json", "x.json"])
    assert config.ops == ("all_gather", "reduce_scatter_q4")
    assert config.stages == (1, 2)
    assert config.json_path == "x.json"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-b", "2", "-e", "1"], "minbytes <= maxbytes"),
        (["-f", "1"], "stepfactor"),
        (["-n", "0"], "iters >= 1"),
        (["-w", "-1"], "warmup >= 0"),
        (["-d", "double"], "--datatype"),
        (["--ops", ","], "ops must be"),
        (["--group-size", "7"], "group size"),
        (["--stages", "0"], "--stages"),
    ],
)
def test_config_rejects(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        parse_config(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_flag_exits_with_usage(capsys):
    with pytest.raises(SystemExit) as info:
        parse_config(["--ops", "broadcast"])
    assert info.value.code == 2
    assert "ops must be" in capsys.readouterr().err


def test_device_and_backend_flags():
    assert (parse_config([]).device, parse_config([]).backend) == ("auto", "auto")
    config = parse_config(["--device", "cpu", "--backend", "gloo"])
    assert (config.device, config.backend) == ("cpu", "gloo")


def test_unknown_device_exits_with_usage(capsys):
    with pytest.raises(SystemExit) as info:
        parse_config(["--device", "tpu"])
    assert info.value.code == 2
    assert "--device" in capsys.readouterr().err
