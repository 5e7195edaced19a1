"""examples/fixed_point_gupta.py --quick: it runs, prints its table, writes its PNG and JSON, and every run
trains (the test error falls from chance); the update/grid ratios it prints follow from the FP32 updates."""

import json

import pytest

from example_helpers import load_example

pytest.importorskip("sklearn")

example = load_example("fixed_point_gupta")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fpg")
    return example.main(["--quick", "--out", str(out)]), out


def test_writes_the_table_the_png_and_the_json(run, capsys):
    res, out = run
    png = out / "fixed_point_gupta.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    on_disk = json.loads((out / "fixed_point_gupta.json").read_text())
    assert [r["name"] for r in on_disk["runs"]] == [r["name"] for r in res["runs"]]
    fls = example.CONFIGS["quick"]["fls"]
    assert [r["name"] for r in res["runs"]] == ["FP32"] + [f"<{16 - fl},{fl}> {r}" for fl in fls
                                                           for r in ("nearest", "stochastic")]
    example.print_table(res)
    printed = capsys.readouterr().out
    assert "Final test error" in printed and all(f"<{16 - fl},{fl}>" in printed for fl in fls)


def test_every_run_learns(run):
    res, _ = run
    epochs = example.CONFIGS["quick"]["epochs"]
    for r in res["runs"]:
        assert len(r["test_error"]) == epochs + 1 and len(r["train_loss"]) == epochs
        assert r["test_error"][0] > 0.6  # untrained: about chance (0.9)
        assert r["final_test_error"] < 0.5, r["name"]


def test_update_ratios(run):
    res, _ = run
    med = res["update_stats"]["median"]
    for row in res["update_ratios"]:
        assert row["median_update_over_step"] == pytest.approx(med * 2.0 ** row["fl"])
        assert 0 <= row["fraction_below_half_step"] <= 1
    fracs = [row["fraction_below_half_step"] for row in res["update_ratios"]]
    assert fracs == sorted(fracs, reverse=True)  # finer grids lose fewer updates


def test_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit):
        example.main(["--threads", "0", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        example.main(["--quick", "--seed", "-5", "--out", str(tmp_path)])
    assert e.value.code == 2 and "--seed must be in [0, 2**32)" in capsys.readouterr().err
    # an --out that cannot be a folder: refused before the training (it once failed after it, the run lost)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SystemExit) as e:
        example.main(["--out", str(blocker / "sub")])
    assert e.value.code == 2 and "--out" in capsys.readouterr().err
