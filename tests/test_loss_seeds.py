"""scripts/loss_seeds.py: the per-seed gaps to bf16 and their mean, from the bench's results.json."""

import csv
import importlib.util
import json
import math
import pathlib
import random

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "loss_seeds.py"
_spec = importlib.util.spec_from_file_location("loss_seeds", SCRIPT)
loss_seeds = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(loss_seeds)


def _write_run(folder, variant, seed, curve, val_curve, fmt="hybrid"):
    folder.mkdir(parents=True)
    record = dict(level="train", status="ok", impl=variant, loss_curve=curve, val_curve=val_curve)
    meta = dict(started="2026-11-27T00:00:00+00:00", args=dict(seed=seed, format="e4m3", train_format=fmt))
    path = folder / "results.json"
    path.write_text(json.dumps(dict(meta=meta, records=[record, dict(level="kernel", status="ok")])))
    return str(path)


def _run(rng, steps=200):
    curve = [rng.uniform(1.0, 2.0) for _ in range(steps)]
    val = [[s, rng.uniform(1.0, 2.0)] for s in range(50, steps + 1, 50)]
    return curve, val


def test_gaps_against_the_same_seeds_bf16(tmp_path):
    rng = random.Random(7)
    runs = {(v, s): _run(rng) for v in ("turbo-bf16", "fp8-blockwise") for s in (0, 1, 2)}
    paths = [_write_run(tmp_path / f"{v}_{s}", v, s, *runs[(v, s)]) for (v, s) in runs]
    rows, curves = loss_seeds._runs_from_json(paths)
    assert set(curves) == {(v, "hybrid", s) for v, s in runs}
    per = loss_seeds.gaps(rows)[("fp8-blockwise", "hybrid")]
    for seed, gap in per["train_last10pct"]:
        tail = lambda c: sum(c[-20:]) / 20  # the last 10% of 200 steps
        want = 100 * (tail(runs[("fp8-blockwise", seed)][0]) / tail(runs[("turbo-bf16", seed)][0]) - 1)
        assert gap == pytest.approx(want, rel=1e-12)
    for seed, gap in per["held_out_last"]:
        last = lambda v: v[-1][1]
        assert gap == pytest.approx(100 * (last(runs[("fp8-blockwise", seed)][1]) / last(runs[("turbo-bf16", seed)][1]) - 1))
    for seed, gap in per["held_out_last3"]:
        m3 = lambda v: sum(p for _, p in v[-3:]) / 3
        assert gap == pytest.approx(100 * (m3(runs[("fp8-blockwise", seed)][1]) / m3(runs[("turbo-bf16", seed)][1]) - 1))
    table = loss_seeds.report(rows)
    mean = sum(g for _, g in per["train_last10pct"]) / 3
    assert f"**{mean:+.2f}%**" in table


def test_summary_round_trip_and_json_wins(tmp_path):
    rng = random.Random(3)
    bf16 = _write_run(tmp_path / "b", "turbo-bf16", 5, *_run(rng))
    fp8 = _write_run(tmp_path / "f", "fp8-mxfp8", 5, *_run(rng))
    summary = tmp_path / "summary.csv"
    loss_seeds.main([bf16, fp8, "--write-summary", str(summary)])
    with open(summary) as f:
        rows = list(csv.DictReader(f))
    assert [(r["variant"], r["seed"]) for r in rows] == [("fp8-mxfp8", "5"), ("turbo-bf16", "5")]
    # an earlier row for the same run is replaced by the JSON's; a seed without bf16 gets no gap
    stale = tmp_path / "stale.csv"
    with open(stale, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["variant", "format", "seed", *loss_seeds.METRICS, "source"])
        w.writerow(["fp8-mxfp8", "hybrid", 5, 9.0, 9.0, 9.0, "old"])
        w.writerow(["fp8-mxfp8", "hybrid", 6, 1.0, 1.0, 1.0, "old"])
    rows = loss_seeds._runs_from_csv(str(stale))
    rows.update(loss_seeds._runs_from_json([fp8, bf16])[0])
    per = loss_seeds.gaps(rows)[("fp8-mxfp8", "hybrid")]
    assert [s for s, _ in per["train_last10pct"]] == [5]
    assert all(math.isfinite(g) and abs(g) < 100 for _, g in per["train_last10pct"])


def test_no_runs_is_an_error(tmp_path):
    with pytest.raises(SystemExit):
        loss_seeds.main([])
