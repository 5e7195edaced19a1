"""The demo (`python examples/demo.py --quick`): it runs, writes its PNG and JSON, every run trains, the table's
fields are all there and consistent with the levels, and the measured effects point the way the paper
says: loss scaling reduces gradient underflow, FP32 masters keep updates that FP16 weights lose."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

# The demo is a script outside the package (examples/ is no package): loaded from its file.
_spec = importlib.util.spec_from_file_location("demo", Path(__file__).resolve().parents[1] / "examples" / "demo.py")
demo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(demo)

RUN_NAMES = [name for name, _, _ in demo.RUNS]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo_out")
    res = demo.main(["--quick", "--out", str(out), "--no-progress"])
    return res, out


def runs_by_name(res):
    return {r["name"]: r for r in res["runs"]}


def test_writes_a_png_and_a_standard_json_with_the_returned_numbers(run):
    res, out = run
    png = out / "demo.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    on_disk = json.loads((out / "demo.json").read_text(),
                         parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert [r["name"] for r in on_disk["runs"]] == RUN_NAMES
    assert on_disk["summary"] == res["summary"]
    for ours, theirs in zip(res["runs"], on_disk["runs"]):
        assert {k: ours[k] for k in demo.TABLE_FIELDS} == {k: theirs[k] for k in demo.TABLE_FIELDS}
        assert theirs["train_losses"] == ours["train_losses"]
    assert res["device"] in ("cpu", "cuda")


def test_every_run_has_every_table_field(run):
    res, _ = run
    assert set(demo.TABLE_FIELDS) >= {"final_train_loss", "heldout_loss", "heldout_accuracy", "ms_per_step",
                                      "weight_bytes", "optimizer_state_bytes", "skipped_steps", "final_loss_scale"}
    for r in res["runs"]:
        for field in demo.TABLE_FIELDS:
            value = r[field]
            assert isinstance(value, (int, float)) and math.isfinite(value), (r["name"], field, value)
        assert r["ms_per_step"] > 0 and r["weight_bytes"] > 0 and r["optimizer_state_bytes"] > 0
        assert 0 <= r["heldout_accuracy"] <= 1 and 0 <= r["skipped_steps"] <= res["config"]["steps"]


def test_every_run_trains(run):
    res, _ = run
    for r in res["runs"]:
        losses = r["train_losses"]
        assert len(losses) == res["config"]["steps"]
        assert losses[0] == pytest.approx(math.log(256), abs=0.3)  # an untrained model: about uniform
        assert r["final_train_loss"] < losses[0] - 0.5, r["name"]
        assert r["evals"][-1]["loss"] < r["evals"][0]["loss"], r["name"]
        assert r["heldout_loss"] < math.log(256) - 0.5 and r["heldout_accuracy"] > 1 / 256


def test_the_table_reflects_the_levels(run):
    res, _ = run
    r = runs_by_name(res)
    assert r["O0"]["param_dtypes"] == ["float32"] and r["O1"]["param_dtypes"] == ["float32"]
    assert r["O2"]["param_dtypes"] == ["float16", "float32"]  # LayerNorm kept in FP32
    assert r["O3"]["param_dtypes"] == ["float16"]
    # FP16 weights take about half the bytes; O2's optimizer state adds the FP32 masters.
    assert r["O3"]["weight_bytes"] == r["O0"]["weight_bytes"] // 2
    assert r["O3"]["weight_bytes"] < r["O2"]["weight_bytes"] < r["O0"]["weight_bytes"]
    assert r["O2"]["optimizer_state_bytes"] > r["O0"]["optimizer_state_bytes"] == r["O3"]["optimizer_state_bytes"]
    assert r["O2"]["scaler_enabled"] and r["O1"]["scaler_enabled"]
    assert not r["O0"]["scaler_enabled"] and not r["O3"]["scaler_enabled"] and not r["O2 no scaling"]["scaler_enabled"]
    assert r["O2 no scaling"]["final_loss_scale"] == 1.0 and r["O2"]["final_loss_scale"] > 1.0


def test_loss_scaling_reduces_gradient_underflow(run):
    res, _ = run
    probes = runs_by_name(res)["O2"]["probes"]
    assert len(probes) == res["config"]["probes"]
    for p in probes:
        act = p["activation_grads"]
        assert act["unscaled"]["nonzero_fp32"] == act["scaled"]["nonzero_fp32"] > 0
        assert act["unscaled"]["flushed"] > 0
        assert act["unscaled"]["flushed_frac"] > act["scaled"]["flushed_frac"]
        assert p["weight_grads"]["unscaled"]["flushed"] >= p["weight_grads"]["scaled"]["flushed"]
        hist = act["histogram_fp32"]
        assert sum(hist["counts"]) + hist["below"] + hist["above"] == act["unscaled"]["nonzero_fp32"]
    u = res["summary"]["underflow"]["activation_grads"]
    assert u["unscaled"]["flushed_frac_mean"] > u["scaled"]["flushed_frac_mean"]


def test_fp32_masters_keep_updates_that_fp16_weights_lose(run):
    res, _ = run
    lost = [p["lost_updates"] for p in runs_by_name(res)["O2"]["probes"] if "lost_updates" in p]
    assert lost
    for d in lost:
        assert d["updated_elements"] > 0
        assert d["lost_low_precision"] > d["lost_fp32_master"]
    assert res["verdicts"]["loss_curves"]


def test_fixed_point_panel(run):
    res, _ = run
    fp = res["fixed_point"]
    if fp is None:
        pytest.skip("scikit-learn is not installed: the demo skips its fixed-point panel")
    fls = fp["config"]["fls"]
    assert len(fp["runs"]) == 1 + 2 * len(fls) and fp["runs"][0]["name"] == "FP32"
    for r in fp["runs"]:
        assert 0 <= r["final_test_error"] < 0.5, r["name"]  # every setting learns (chance is 0.9)
    assert [row["fl"] for row in fp["update_ratios"]] == list(fls)


def test_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit):
        demo.main(["--steps", "1", "--out", str(tmp_path)])
    # a negative seed: refused at once (it was taken, and the fixed-point panel failed after the other runs)
    with pytest.raises(SystemExit) as e:
        demo.main(["--quick", "--seed", "-1", "--out", str(tmp_path)])
    assert e.value.code == 2 and "--seed must be in [0, 2**32)" in capsys.readouterr().err


def test_an_out_that_cannot_be_a_folder_is_refused_before_training(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SystemExit) as e:
        demo.main(["--quick", "--no-progress", "--out", str(blocker / "sub")])
    assert e.value.code == 2 and "--out" in capsys.readouterr().err
