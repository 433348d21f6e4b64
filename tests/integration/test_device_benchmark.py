"""The prepared accelerator check runs end to end (here on CPU, at a toy size)."""

import json

from jsparse.benchmarks import device, sync


def test_the_device_benchmark_reports_programs_against_floors_and_writes_a_trace(tmp_path):
  rows = device.run(str(tmp_path), dim=32, depth=1, vocab=64, pretrain_steps=2,
                    large_params=200_000, repeats=1, echo=False, methods=(sync.DENSE,))
  assert set(rows["programs"]) == {"diff", "device_pack", "device_unpack", "device_apply",
                                   "host"}
  assert all(r["ms"] > 0 and r["floor_ms"] > 0 for r in rows["programs"].values())
  for table in (rows["step"]["methods"], rows["large"]["methods"]):
    assert set(table) == {sync.DENSE, sync.PACKED}
    packed, dense = table[sync.PACKED], table[sync.DENSE]
    assert packed["bytes"] < dense["bytes"] and set(packed["e2e"]) == set(sync.LINKS_GBIT)
  assert rows["large"]["params"] >= 200_000 * 0.5
  assert json.loads((tmp_path / "results.json").read_text())["copy_gbps"] > 0
  assert any((tmp_path / "trace").rglob("*.xplane.pb"))
  estimate = rows["estimate"]
  assert {(r["params"], r["link_gbit"]) for r in estimate} == {
      (p, g) for p in (7e9, 70e9) for g in (10.0, 100.0)}
  for r in estimate:  # hosts move bytes: the host part follows the payload, not the params
    assert r["sparse"] == r["device"] + r["host"] + r["wire"]
    assert r["accelerators"] == 64 and r["hosts"] == 8
  seven, seventy = (next(r for r in estimate if r["params"] == p and r["link_gbit"] == 100.0)
                    for p in (7e9, 70e9))
  assert abs(seventy["host"] / seven["host"] - 10) < 1e-6
