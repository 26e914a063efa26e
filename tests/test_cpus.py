"""Threads sized to the cores this process may use: affinity, cgroup quota, --threads."""

from __future__ import annotations

import argparse
import logging
import os

import pytest

from sssd import cpus


def cgroup(tmp_path, files: dict[str, str], own: str = "0::/\n"):
    """A cgroup tree under tmp_path (real files, read as /sys/fs/cgroup would be) and the
    /proc/self/cgroup that places this process in it."""
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    root.mkdir(exist_ok=True)
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(own)
    return root, proc


def test_a_quota_of_half_a_core_is_one_thread(tmp_path):
    root, proc = cgroup(tmp_path, {"cpu.max": "50000 100000\n"})
    assert cpus.cgroup_quota(root, proc) == 0.5
    assert cpus.available_cpus(root, proc, affinity=8) == 1


def test_no_quota_leaves_the_affinity_mask(tmp_path):
    root, proc = cgroup(tmp_path, {"cpu.max": "max 100000\n"})
    assert cpus.cgroup_quota(root, proc) is None
    assert cpus.available_cpus(root, proc, affinity=6) == 6
    assert cpus.available_cpus(root, proc) == len(os.sched_getaffinity(0))  # this process's own mask


def test_a_quota_rounds_down_and_never_raises_the_affinity_count(tmp_path):
    root, proc = cgroup(tmp_path, {"cpu.max": "250000 100000\n"})
    assert cpus.available_cpus(root, proc, affinity=8) == 2  # 2.5 cores: two threads can run throughout
    assert cpus.available_cpus(root, proc, affinity=1) == 1


def test_the_tightest_limit_over_the_cgroup_and_its_ancestors(tmp_path):
    root, proc = cgroup(
        tmp_path,
        {"cpu.max": "max 100000\n", "a/cpu.max": "300000 100000\n", "a/b/cpu.max": "max 100000\n"},
        own="0::/a/b\n",
    )
    assert cpus.cgroup_quota(root, proc) == 3.0
    assert cpus.available_cpus(root, proc, affinity=16) == 3


def test_cgroup_v1_quota(tmp_path):
    root, proc = cgroup(
        tmp_path,
        {"cpu,cpuacct/cpu.cfs_quota_us": "150000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
        own="4:memory:/x\n3:cpu,cpuacct:/\n0::/\n",
    )
    assert cpus.cgroup_quota(root, proc) == 1.5
    assert cpus.available_cpus(root, proc, affinity=4) == 1
    (root / "cpu,cpuacct/cpu.cfs_quota_us").write_text("-1\n")  # v1's "no limit"
    assert cpus.cgroup_quota(root, proc) is None


def test_a_cgroup_path_the_container_cannot_see_reads_its_own_root(tmp_path):
    root, proc = cgroup(tmp_path, {"cpu.max": "100000 100000\n"}, own="0::/host/slice/elsewhere\n")
    assert cpus.available_cpus(root, proc, affinity=4) == 1


def test_unreadable_or_garbled_files_count_as_no_limit(tmp_path):
    root, proc = cgroup(tmp_path, {"cpu.max": "lots\n"})
    assert cpus.cgroup_quota(root, proc) is None
    assert cpus.cgroup_quota(tmp_path / "nowhere", tmp_path / "nothing") is None
    assert cpus.available_cpus(tmp_path / "nowhere", tmp_path / "nothing", affinity=3) == 3


def test_threads_zero_or_negative_is_a_clear_error():
    for bad in (0, -2):
        with pytest.raises(ValueError, match=rf"--threads must be >= 1, got {bad} \(leave it out to use the 2 cores"):
            cpus.threads_for(bad, available=2, what="--threads")
    with pytest.raises(ValueError, match="whole number"):
        cpus.threads_for(2.5, available=2)
    with pytest.raises(ValueError, match="whole number"):
        cpus.threads_for(True, available=2)


def test_too_many_threads_are_cut_to_the_cores_with_one_warning():
    said: list[str] = []
    assert cpus.threads_for(999, available=2, what="--threads", warn=said.append) == 2
    assert len(said) == 1 and "--threads 999" in said[0] and "may use 2 cores" in said[0]
    assert "using 2 threads" in said[0]
    said.clear()
    assert cpus.threads_for(2, available=2, warn=said.append) == 2 and not said  # what fits is kept, silently
    assert cpus.threads_for(1, available=2, warn=said.append) == 1 and not said


def test_pipeline_stages_share_the_cores():
    said: list[str] = []
    assert cpus.threads_for(4, available=8, share=2, warn=said.append) == 4 and not said
    assert cpus.threads_for(8, available=8, share=2, warn=said.append) == 4
    assert "per pipeline stage" in said[0] and "4 per stage over 2 stages" in said[0]
    assert cpus.threads_for(3, available=2, share=4, warn=said.append) == 1  # never below one


def test_no_request_takes_the_default_capped_at_the_cores():
    assert cpus.threads_for(None, available=3) == 3
    assert cpus.threads_for(None, default=16, available=3) == 3  # torch's count on a 3-core quota
    assert cpus.threads_for(None, default=2, available=8) == 2  # a smaller default (OMP_NUM_THREADS) is kept
    assert cpus.threads_for(None) == cpus.available_cpus()


def test_describe_names_where_the_count_comes_from(tmp_path):
    root, proc = cgroup(tmp_path, {"cpu.max": "150000 100000\n"})
    text = cpus.describe(root, proc)
    assert text.startswith("1 core (") and "cgroup CPU quota: 1.5 cores" in text


def _serve_args(*argv: str) -> argparse.Namespace:
    import socket

    from sssd import commands  # noqa: F401  (registers the subcommands)
    from sssd.cli import _parser

    with socket.socket() as s:  # a port that is free now: validate binds it once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return _parser().parse_args(["serve", "--datastore", "none", "--port", str(port), *argv])


def test_serve_refuses_threads_zero_and_cuts_too_many(capsys):
    from sssd.cli import main
    from sssd.commands.serve import validate

    assert main(["serve", "--datastore", "none", "--threads", "0"]) == 1
    assert "sssd serve: error: --threads must be >= 1, got 0 (leave it out" in capsys.readouterr().err
    args = _serve_args("--threads", "999")
    validate(args)
    available = cpus.available_cpus()
    assert args.threads == available
    err = capsys.readouterr().err
    assert err.count("WARNING: --threads 999: this process may use") == 1 and f"using {available} thread" in err
    args = _serve_args("--threads", "1")
    validate(args)
    assert args.threads == 1 and not capsys.readouterr().err


def test_serve_help_explains_the_default_and_the_environment(capsys):
    from sssd.cli import main

    assert main(["serve", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for words in (
        "CPU affinity and cgroup CPU quota",
        "OMP_NUM_THREADS",
        "OMP_WAIT_POLICY=passive",
        "SSSD_PROFILE_DIR",
    ):
        assert words in text
    assert f"{cpus.available_cpus()} here" in text


def test_llm_checks_and_fits_its_threads(tmp_path, caplog):
    import torch
    from tiny_models import tiny_model

    from sssd import LLM

    model = tiny_model(tmp_path / "m", "llama")
    before = torch.get_num_threads()
    try:
        with pytest.raises(ValueError, match="threads must be >= 1, got 0"):
            LLM(model, datastore=None, draft=[], threads=0)
        with caplog.at_level(logging.WARNING, logger="sssd.cpus"):
            LLM(model, datastore=None, draft=[], threads=999, max_model_len=64)
        said = [r.getMessage() for r in caplog.records if r.name == "sssd.cpus"]
        assert len(said) == 1 and said[0].startswith("threads 999: this process may use")
        assert torch.get_num_threads() == cpus.available_cpus()
    finally:
        torch.set_num_threads(before)
