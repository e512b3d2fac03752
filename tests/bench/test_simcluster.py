"""bench.simcluster: argument checking, prerequisites, rank environment, and (as root) a real
2x1 cluster: wire bytes counted, exit status propagated, nothing left behind, also on Ctrl-C."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from bench.harness.wire import parse_net_dev, read_wire_bytes
from bench.simcluster import launcher
from bench.simcluster.config import ClusterConfig, parse_config, parse_rate
from bench.simcluster.launcher import exit_status, rank_env, thread_share


@pytest.mark.parametrize(("text", "bps"), [("200mbit", 200_000_000), ("1gbit", 10**9), ("64kbit", 64_000), ("1.5Mbit", 1_500_000)])
def test_parse_rate(text, bps):
    assert parse_rate(text) == bps


def test_unlimited_rate_means_no_shaping():
    assert parse_rate("unlimited") is None
    config = parse_config(["--num-nodes", "2", "--local-size", "1", "--rate", "unlimited", "--", "true"])
    assert config.rate_bps is None


@pytest.mark.parametrize("text", ["200", "200mb", "fast", "1bit"])
def test_parse_rate_rejects(text):
    with pytest.raises(ValueError, match="rate"):
        parse_rate(text)


def test_parse_config_takes_the_command_after_the_dashes():
    config = parse_config(["--num-nodes", "2", "--local-size", "3", "--rate", "200mbit", "--", "python", "-V"])
    assert config == ClusterConfig(num_nodes=2, local_size=3, rate_bps=200_000_000, command=("python", "-V"))
    assert config.world_size == 6


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num-nodes", "0", "--local-size", "1", "--rate", "1mbit", "--", "true"], "--num-nodes"),
        (["--num-nodes", "2", "--local-size", "0", "--rate", "1mbit", "--", "true"], "--local-size"),
        (["--num-nodes", "2", "--local-size", "1", "--rate", "quick", "--", "true"], "rate"),
        (["--num-nodes", "2", "--local-size", "1", "--rate", "1mbit"], "no command"),
        (["--local-size", "1", "--rate", "1mbit", "--", "true"], "--num-nodes"),
        (["--nodes", "2", "--local-size", "1", "--rate", "1mbit", "--", "true"], "--num-nodes"),
        (["--num-nodes", "2", "--local", "1", "--rate", "1mbit", "--", "true"], "--local-size"),
        (["--num-nodes", "2", "--rate", "1mbit", "--local", "--", "true"], "--local-size"),
    ],
)
def test_parse_config_rejects(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        parse_config(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_not_root_is_refused_plainly(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    config = ClusterConfig(num_nodes=2, local_size=1, rate_bps=10**6, command=("true",))
    assert launcher.launch(config) == 2
    assert "needs root" in capsys.readouterr().err


def test_missing_iproute2_is_refused_plainly(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/ip")
    assert "iproute2 (tc not found)" in launcher.missing_prerequisite()


def test_rank_env_is_node_major_and_torchrun_style():
    config = ClusterConfig(num_nodes=2, local_size=2, rate_bps=10**6, command=("true",))
    env = rank_env(config, 3, "10.213.0.1", 23456, {"PMI_RANK": "0", "KEEP": "1"})
    assert env["RANK"] == "3" and env["WORLD_SIZE"] == "4"
    assert env["LOCAL_RANK"] == "1" and env["LOCAL_WORLD_SIZE"] == "2" and env["ZCOMM_LOCAL_SIZE"] == "2"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.213.0.1", "23456")
    assert env["GLOO_SOCKET_IFNAME"] == env["ZCOMM_WIRE_IFACE"] == "zc-up"
    assert "PMI_RANK" not in env and env["KEEP"] == "1"
    assert env["OMP_NUM_THREADS"] == str(thread_share(4))
    # The caller's own thread count wins.
    assert rank_env(config, 0, "10.213.0.1", 23456, {"OMP_NUM_THREADS": "3"})["OMP_NUM_THREADS"] == "3"


@pytest.mark.parametrize(("world_size", "cores", "share"), [(4, 2, 1), (2, 16, 8), (3, 16, 5), (1, 1, 1)])
def test_thread_share_splits_the_cores(world_size, cores, share):
    assert thread_share(world_size, cores) == share


def test_exit_status_of_signalled_rank():
    assert exit_status(3) == 3
    assert exit_status(-signal.SIGKILL) == 128 + signal.SIGKILL


def test_wire_counters(monkeypatch):
    text = (
        "Inter-|   Receive |  Transmit\n face |bytes packets errs drop fifo frame compressed multicast|bytes ...\n"
        "    lo:  100 1 0 0 0 0 0 0  100 1 0 0 0 0 0 0\n"
        " zc-up: 5000 9 0 0 0 0 0 0 7000 8 0 0 0 0 0 0\n"
    )
    assert parse_net_dev(text, "zc-up") == (7000, 5000)
    with pytest.raises(ValueError, match="eth9"):
        parse_net_dev(text, "eth9")
    monkeypatch.delenv("ZCOMM_WIRE_IFACE", raising=False)
    assert read_wire_bytes() is None


# --- as root: a real simulated cluster -------------------------------------------------------

def _ours(pid: int) -> list[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in listing.splitlines() if line.startswith(f"zcsim-{pid}-")]


def _launch(tmp_path, env, *command, rate="100mbit", **kwargs):
    argv = [sys.executable, "-m", "bench.simcluster", "--num-nodes", "2", "--local-size", "1", "--rate", rate, "--",
            *command]  # fmt: skip
    return subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


@pytest.mark.root
@pytest.mark.slow
def test_two_nodes_count_wire_bytes_and_leave_nothing(tmp_path, checkout_env, simcluster_host):
    out = tmp_path / "rows.json"
    proc = _launch(tmp_path, checkout_env, sys.executable, "-m", "bench.collectives", "--ops", "all_gather",
                   "-b", "256K", "-e", "256K", "-n", "2", "-w", "1", "--json", str(out))  # fmt: skip
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stdout + stderr
    (row,) = json.loads(out.read_text())
    assert row["wrong"] == 0
    # A 2-rank all-gather sends each rank's half across: 256 KiB per call plus headers.
    assert 256 * 1024 <= row["wire_bytes"] < 1.1 * 256 * 1024
    totals = [int(line.split(": ")[1].split()[0]) for line in stdout.splitlines() if line.startswith("# simcluster node")]
    assert len(totals) == 2 and all(sent >= 3 * 128 * 1024 for sent in totals)
    assert _ours(proc.pid) == []


@pytest.mark.root
@pytest.mark.parametrize(("rate", "shaped"), [("100mbit", True), ("unlimited", False)])
def test_unlimited_rate_adds_no_token_bucket(tmp_path, checkout_env, simcluster_host, rate, shaped):
    env = {key: value for key, value in checkout_env.items() if key != "OMP_NUM_THREADS"}
    proc = _launch(tmp_path, env, "sh", "-c", 'tc qdisc show dev "$ZCOMM_WIRE_IFACE"; echo "threads=$OMP_NUM_THREADS"',
                   rate=rate)  # fmt: skip
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stdout + stderr
    assert ("qdisc tbf" in stdout) is shaped
    assert stdout.count(f"threads={thread_share(2)}") == 2
    assert _ours(proc.pid) == []


@pytest.mark.root
def test_failing_rank_sets_the_status_and_stops_the_others(tmp_path, checkout_env, simcluster_host):
    proc = _launch(tmp_path, checkout_env, "sh", "-c", 'if [ "$RANK" = 1 ]; then exit 7; fi; exec sleep 60')
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 7, stdout + stderr
    assert "rank 1 exited with status 7" in stderr
    assert _ours(proc.pid) == []


@pytest.mark.root
def test_ctrl_c_cleans_up(tmp_path, checkout_env, simcluster_host):
    proc = _launch(tmp_path, checkout_env, "sleep", "60")
    deadline = time.monotonic() + 30
    while len(_ours(proc.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stdout + stderr
    assert _ours(proc.pid) == []
