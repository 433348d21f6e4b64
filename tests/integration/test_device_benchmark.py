"""The prepared accelerator check runs end to end (here on CPU, at a toy size)."""

import json

from jsparse.benchmarks import device, sync


def test_the_device_benchmark_reports_programs_against_floors_and_writes_a_trace(tmp_path):
  rows = device.run(str(tmp_path), dim=32, depth=1, vocab=64, pretrain_steps=2,
                    large_params=200_000, repeats=1, echo=False, methods=(sync.METHODS[0],))
  assert set(rows["programs"]) == {"diff", "device_pack", "device_unpack", "device_apply",
                                   "host"}
  assert all(r["ms"] > 0 and r["floor_ms"] > 0 for r in rows["programs"].values())
  for table in (rows["step"]["methods"], rows["large"]["methods"]):
    assert set(table) == {sync.METHODS[0], sync.METHODS[6]}
    packed, dense = table[sync.METHODS[6]], table[sync.METHODS[0]]
    assert packed["bytes"] < dense["bytes"] and set(packed["e2e"]) == set(sync.LINKS_GBIT)
  assert rows["large"]["params"] >= 200_000 * 0.5
  assert json.loads((tmp_path / "results.json").read_text())["copy_gbps"] > 0
  assert any((tmp_path / "trace").rglob("*.xplane.pb"))
