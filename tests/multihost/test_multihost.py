"""Multi-controller jobs (``jax.distributed``, gloo collectives on 127.0.0.1): a trainer of 2
processes x 4 devices (and one of 4 x 2) sends parts; rollouts of 1 process (2x4 mesh) and of 2
processes (tensor 4 x data 2) apply them bit-exactly, refuse missing and corrupt parts, and
restart from Orbax state saved by another process count; a 4-process trainer sends packed
parts (coded on its devices) to a 2-process rollout. The jobs run once for the module
(``jsparse.examples.multihost``, each with a timeout); the tests read their reports. Each
rollout process checks every shard it holds against the trainer's bits, and fails its job
otherwise."""

import pytest

from jsparse.examples import multihost

TIMEOUT = 400  # seconds per job (several run at once)
FOUR_STEPS = 2  # training steps of the 4-process trainer (versions 2..3)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
  """Every job's reports; jobs that need nothing of each other run side by side."""
  fsdp = tmp_path_factory.mktemp("trainer_2x4")
  four = tmp_path_factory.mktemp("trainer_4x2")
  quantized = tmp_path_factory.mktemp("trainer_fp8")  # FP8 rollout weights, per channel
  fp8 = ["--quantize", "fp8_per_channel", "--steps", "3"]
  # The 4-process trainer runs its own FOUR_STEPS steps (the anchor and deltas of versions
  # 1-3, each checked by the rollout; the 2-process trainer's run covers the longer chain).
  steps4 = ["--steps", str(FOUR_STEPS)]
  phases = [
      # ranked: ranks resolved across the rollout processes that split a leaf
      {"trainer": ("trainer", 2, 4, fsdp, ["--save-state", "--chain", "--coding", "ranked"]),
       "trainer_fp8": ("trainer", 2, 4, quantized, [*fp8, "--coding", "auto"])},
      {"one": ("rollout", 1, 8, fsdp, ["--name", "one", "--faults"]),
       "two": ("rollout", 2, 4, fsdp, ["--name", "two", "--faults", "--save-at", "3"]),
       "rollout_fp8": ("rollout", 2, 4, quantized, ["--name", "rollout_fp8", *fp8])},
      {"follow": ("rollout", 2, 4, fsdp, ["--name", "follow", "--follow", "--steps", "0"]),
       "restored": ("rollout", 1, 8, fsdp, ["--name", "restored", "--tensor", "2",
                                            "--restore-from", "rollout_state_two", "--chain"]),
       "trainer4": ("trainer", 4, 2, four, ["--restore-sender", str(fsdp / "sender_state"),
                                            "--coding", "packed", *steps4])},  # packed parts
      {"after4": ("rollout", 2, 4, four, ["--name", "after4", *steps4])},
  ]
  reports, started = {}, []
  try:
    for phase in phases:
      running = {name: multihost.start(role, processes, devices, str(folder), extra,
                                       timeout=TIMEOUT)
                 for name, (role, processes, devices, folder, extra) in phase.items()}
      started += running.values()
      reports.update({name: job.wait() for name, job in running.items()})
  finally:
    for job in started:
      job.kill()
  return reports


def _totals(reports, version):
  return sum(next(v for v in r["versions"] if v["version"] == version)["part_bytes"]
             for r in reports)


def test_every_trainer_process_sends_its_own_part(jobs):
  trainer = jobs["trainer"]
  assert [r["process"] for r in trainer] == [0, 1]
  assert len({r["digest"] for r in trainer}) == 1  # one end-to-end digest, via collectives
  dense = trainer[0]["versions"][0]["dense_bytes"]
  anchor = [r["versions"][0]["anchor_bytes"] for r in trainer]
  assert all(0.4 * dense < a < 0.6 * dense for a in anchor), (anchor, dense)
  assert sum(anchor) < 1.01 * dense  # replicated leaves are sent once, not once per process


def test_parts_carry_a_realistic_update_compactly(jobs):
  trainer = jobs["trainer"]
  # only the anchor published beside version 1: no version itself is an anchor
  assert not any(v["anchor"] for r in trainer for v in r["versions"])
  for version in range(2, 7):
    stats = trainer[0]["versions"][version - 1]
    density = stats["changed"] / stats["elements"]
    assert 0.002 < density < 0.05, density  # AdamW at lr 1e-6 on fp32 masters
    per_change = _totals(trainer, version) / stats["changed"]
    assert per_change < 2.6, (version, per_change)  # small leaves: ~150 B index per unit
    assert stats["dense_bytes"] / _totals(trainer, version) > 50


@pytest.mark.parametrize("rollout", ["one", "two", "restored", "after4"])
def test_rollouts_end_bit_identical_to_their_trainer(jobs, rollout):
  """After the trainer's format-2 parts, and (``after4``) a 4-process trainer's packed ones."""
  trainer = jobs["trainer4" if rollout == "after4" else "trainer"]
  assert {r["coding"] for r in trainer} == {"packed" if rollout == "after4" else "ranked"}
  for r in jobs[rollout]:
    assert r["version"] == (FOUR_STEPS + 1 if rollout == "after4" else 6)
    assert r["digest"] == trainer[0]["digest"]


def test_rollout_processes_read_only_the_units_over_their_blocks(jobs):
  one, two = jobs["one"], jobs["two"]
  for v in one[0]["versions"]:
    assert v["bytes_read"] == v["bytes_total"]  # one process holds everything
  for r in two:
    for v in r["versions"]:
      assert v["units_read"] < v["units"]
      assert v["bytes_read"] < 0.85 * v["bytes_total"], v


@pytest.mark.parametrize("rollout", ["one", "two"])
def test_missing_and_corrupt_parts_are_refused_by_every_process(jobs, rollout):
  for r in jobs[rollout]:
    cases = {c["case"].split(" ")[0]: c for c in r["refused"]}
    assert set(cases) == {"missing", "corrupt"}
    assert all(c["refused"] and c["unchanged"] for c in cases.values()), cases
    parts = next(v for v in r["versions"] if v["version"] == 3)["parts"]
    assert parts > 2  # each trainer process streamed several parts
    assert f"missing [{parts - 1}]" in cases["missing"]["error"]
  if rollout == "two":  # the corrupt unit is read by process 1 only: process 0 refuses too
    assert "read by the last process only" in jobs["two"][0]["refused"][1]["case"]
    assert "rollout process(es) [1] refused" in jobs["two"][0]["refused"][1]["error"]
    assert "checksum" in jobs["two"][1]["refused"][1]["error"]


def test_a_rollout_restarts_from_state_saved_by_another_process_count(jobs):
  restored = jobs["restored"][0]
  assert [v["version"] for v in restored["versions"]] == [4, 5, 6]


def test_a_sender_restores_onto_another_process_count(jobs):
  saved = jobs["trainer"][0]
  for r in jobs["trainer4"]:
    assert r["restored_sender"] == {"version": 6, "digest": saved["digest"]}
  assert [r["process"] for r in jobs["trainer4"]] == [0, 1, 2, 3]


def test_a_delta_checkpoint_chain_saved_by_two_processes_restores_in_one(jobs):
  trainer = jobs["trainer"]
  for r in trainer:
    assert [(c["step"], c["kind"]) for c in r["chain"]] == \
        [(1, "base")] + [(v, "delta") for v in range(2, 7)]
  delta_bytes = trainer[0]["chain"][1]["bytes"]
  assert delta_bytes < 0.2 * trainer[0]["chain"][0]["bytes"], trainer[0]["chain"]
  restored = jobs["restored"][0]["chain_restored"]  # bits checked against the trainer's
  assert restored == {"step": 6, "kinds": ["base"] + ["delta"] * 5}


def test_a_two_process_rollout_catches_up_with_a_subscriber(jobs):
  for r in jobs["follow"]:  # from nothing: the anchor of version 1, then the deltas to 6
    assert r["followed"] == [1, 2, 3, 4, 5, 6]
    assert r["stats"]["anchors"] == 1 and r["stats"]["deltas"] == 5
    assert r["digest"] == jobs["trainer"][0]["digest"]


def test_a_quantized_rollout_holds_the_qwix_codes_of_the_trainer_masters(jobs):
  """Each trainer process quantizes its own blocks (per-channel scales finished across
  processes); the 2-process rollout applies every version (each process checks its shards), and
  the codes and scales equal qwix's on the whole masters."""
  trainer, rollout = jobs["trainer_fp8"], jobs["rollout_fp8"]
  assert all(all(r["qwix_equal"]) and len(r["qwix_equal"]) == 4 for r in trainer)
  assert [r["version"] for r in rollout] == [4, 4]
  assert len({r["digest"] for r in trainer + rollout}) == 1
  later = [v for v in trainer[0]["versions"] if v["version"] > 1]
  assert all(v["changed"] < 0.02 * v["elements"] for v in later)  # FP8 codes rarely flip


def test_auto_calibrates_across_the_trainer_processes_and_they_send_one_coding(jobs):
  """The 2-process FP8 trainer sends with ``coding="auto"``: its processes calibrate together
  (each receiving the other's parts), every version's parts are of one coding, chosen from
  rates equal on both processes; the rollout ends bit-identical (the test above)."""
  trainer = jobs["trainer_fp8"]
  first, second = (r["versions"] for r in trainer)
  assert [v["coding"] for v in first] == [v["coding"] for v in second]
  deltas = [v for v in first if not v["anchor"] and v["version"] > 1]
  chosen = [v for v in deltas if v["coding_rates"] is not None]
  assert chosen, deltas  # an RL step is representative: the codings were measured
  assert [v["coding_rates"] for v in first] == [v["coding_rates"] for v in second]
  for v in chosen:
    assert set(v["coding_rates"]) == {"ranked", "positioned", "packed"}
    assert v["coding"] in v["coding_rates"]
