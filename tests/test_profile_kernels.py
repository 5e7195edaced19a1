"""benchmarks/profile_kernels.py (the GPU check's profile stage) as far as it runs without a GPU: its
workloads name existing kernels, and its summary reads what ncu writes (a details page as CSV, after
ncu's own messages and the program's output) into one row per workload."""

import json
import re
from pathlib import Path

import pytest

from benchmarks import profile_kernels as pk

ROOT = Path(__file__).resolve().parents[1]

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def row(kid, kernel, section, metric, unit, value):
    return (f'"{kid}","7","python","h","{kernel}","1","7","(256, 1, 1)","(600, 1, 1)","0","9.0","{section}",'
            f'"{metric}","{unit}","{value}"')


def test_every_workload_names_a_kernel_of_ours():
    sources = "".join(p.read_text() for p in (ROOT / "csrc" / "cuda").glob("*.cu"))
    for name, w in pk.WORKLOADS.items():
        assert re.search(r"__global__ void\b[\s\S]{0,80}?\b" + w.kernel + r"\(", sources), (name, w.kernel)
        assert w.goal


def test_the_summary_reads_ncu_csv(tmp_path):
    k = "void mpf::(anonymous namespace)::optim_kernel<mpf::AdamPolicy, (Pass)0>(OptimLaunch, OptimConsts)"
    text = "\n".join([
        "==PROF== Connected to process 7 (python)",
        "output of the program, with, commas",
        HEADER,
        row(0, k, "GPU Speed Of Light Throughput", "Duration", "usecond", "1,234.56"),
        row(0, k, "GPU Speed Of Light Throughput", "DRAM Throughput", "%", "84.20"),
        row(0, k, "GPU Speed Of Light Throughput", "Memory Throughput", "%", "91.30"),
        row(0, k, "Memory Workload Analysis", "Memory Throughput", "Tbyte/second", "3.05"),
        row(0, k, "Launch Statistics", "Registers Per Thread", "register/thread", "96"),
        row(0, k, "Occupancy", "Achieved Occupancy", "%", "23.9"),
        row(0, k, "Occupancy", "Some Future Metric", "", "n/a"),
        row(1, "another launch", "GPU Speed Of Light Throughput", "Duration", "usecond", "5"),
        "==PROF== Disconnected from process 7",
    ])
    kernels = pk.parse_ncu_csv(text)
    assert [x["kernel"] for x in kernels] == [k, "another launch"]
    assert kernels[0]["metrics"]["Duration"] == [("1,234.56", "usecond")]
    (tmp_path / "profile-adamw-fp16-stochastic.csv").write_text(text)
    (tmp_path / "profile-check-fp16.csv").write_text("==ERROR== ERR_NVGPUCTRPERM - no access to the counters\n")
    rows = pk.summarize([tmp_path / "profile-adamw-fp16-stochastic.csv", tmp_path / "profile-check-fp16.csv"])
    first, failed = rows
    assert first["workload"] == "adamw-fp16-stochastic" and first["kernel"] == k  # the first launch profiled
    assert first["duration"] == pytest.approx(1234.56) and first["duration unit"] == "usecond"
    assert first["DRAM %"] == pytest.approx(84.2) and first["registers"] == 96
    assert first["memory %"] == pytest.approx(91.3)  # SpeedOfLight's %, not MemoryWorkloadAnalysis's bytes/s
    assert first["achieved occupancy %"] == pytest.approx(23.9)
    assert "SM %" not in first  # a metric ncu did not write is left out, not invented
    assert failed["workload"] == "check-fp16" and "no kernel profiled" in failed["error"]


def test_the_command_line_summarizes_and_fails_on_a_missing_profile(tmp_path, capsys):
    good = tmp_path / "profile-gemm-fp16-4096.csv"
    good.write_text("\n".join([HEADER, row(0, "gemm_kernel", "Launch Statistics", "Registers Per Thread", "", "168")]))
    out = tmp_path / "p.json"
    assert pk.main(["summarize", str(good), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["rows"][0]["registers"] == 168
    assert "gemm-fp16-4096" in capsys.readouterr().out
    empty = tmp_path / "profile-convert-stochastic.csv"
    empty.write_text("")
    assert pk.main(["summarize", str(good), str(empty)]) == 1
    rows = pk.summarize([good, tmp_path / "profile-never-written.csv"])
    assert rows[1] == {"workload": "never-written", "error": "ncu wrote no file"}
    with pytest.raises(SystemExit):
        pk.main(["run", "no-such-workload"])


def test_the_list_says_why_each_workload_cannot_run_here(capsys, monkeypatch):
    # every workload runs on CUDA: without a device each row says so (the rows once read "can run" there)
    monkeypatch.setattr(pk.torch.cuda, "is_available", lambda: False)
    assert pk.main(["list"]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert [r[0] for r in rows] == list(pk.WORKLOADS) and all(r[3] == "no CUDA device" for r in rows)
