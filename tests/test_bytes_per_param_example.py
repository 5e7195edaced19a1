"""examples/bytes_per_param.py --quick: it runs, writes its plot and JSON, and the bytes per param it counts
from the tensors are those of each precision mode."""

import json
import math

import pytest

from example_helpers import load_example

example = load_example("bytes_per_param")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bytes_out")
    return example.main(["--quick", "--out", str(out)]), out


def test_writes_plot_and_json(run):
    results, out = run
    assert (out / "bytes_per_param.png").stat().st_size > 1000
    saved = json.loads((out / "bytes_per_param.json").read_text())
    assert saved["steps"] == 20 and set(saved["results"]) == {"masters", "remainder", "stochastic", "nearest"}


def test_bytes_per_param_of_each_mode(run):
    results, _ = run
    # BF16 param 2 + BF16 grad 2 + FP32 moments 8, then the master: FP32 4, int16 remainder 2, none 0
    for name, master in (("masters", 4.0), ("remainder", 2.0), ("stochastic", 0.0), ("nearest", 0.0)):
        b = results[name]["bytes_per_param"]
        assert (b["param"], b["grad"], b["master"], b["moments"]) == (2.0, 2.0, master, 8.0), name
        assert 0 < b["step"] < 0.01 and b["total"] == pytest.approx(12.0 + master + b["step"])


def test_every_mode_trains(run):
    results, _ = run
    for name, r in results.items():
        assert len(r["losses"]) == 20 and all(math.isfinite(x) for x in r["losses"]), name
        assert r["losses"][-1] < r["losses"][0], name


def test_bad_arguments_are_refused_before_training(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for argv, match in ((["--out", str(blocker / "sub")], "--out"),
                        (["--quick", "--steps", "7", "--out", str(tmp_path)], "--quick runs 20 steps")):
        with pytest.raises(SystemExit) as e:
            example.main(argv)
        assert e.value.code == 2 and match in capsys.readouterr().err
