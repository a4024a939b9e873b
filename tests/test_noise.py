"""The noise check: shards whose target passes disagree by more than 3x blame the machine, with its load."""
from __future__ import annotations

from jobs.describe import describe
from pipeline.noise import MIN_PASSES, CpuTimes, MachineLoad, cpu_times, ms_per_pass, noise_summary, spread, verdict
from pipeline.summary import RunInfo, summarize
from tests.pipeline_helpers import shard

STAT = "cpu  {user} 0 100 {idle} 0 0 0 {steal} 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n"


def stat_file(tmp_path, name: str, user: int, idle: int, steal: int) -> str:
    path = tmp_path / name
    path.write_text(STAT.format(user=user, idle=idle, steal=steal))
    return str(path)


def test_cpu_steal_is_the_share_of_cpu_time_stolen_between_two_readings(tmp_path):
    start = cpu_times(stat_file(tmp_path, "a", user=1000, idle=8900, steal=0))
    assert start == CpuTimes(steal=0, total=10_000)
    load = MachineLoad.since(start, stat_file(tmp_path, "b", user=1500, idle=9300, steal=100))
    assert load.cpu_steal == 100 / 1000 and len(load.load_average) == 3 and load.cpus >= 1
    assert cpu_times(str(tmp_path / "missing")) is None
    (tmp_path / "old").write_text("cpu  1 2 3 4\n")  # a kernel without the steal column
    assert cpu_times(str(tmp_path / "old")) is None
    assert MachineLoad.since(None, str(tmp_path / "b")).cpu_steal is None


def test_shards_more_than_3x_apart_in_ms_per_pass_are_called_noise_and_say_what_the_machine_did():
    stats = [shard(i, "w0", "r") for i in range(5)]  # 2.0 s over 20 passes: 100 ms per pass
    stats[0].verify_s = 9.0  # the worker's first shard pays its warm-up: left out
    stats[3].verify_s = 7.0
    stats[4].target_passes = MIN_PASSES - 1  # too few passes to judge: left out
    stats[4].verify_s = 60.0
    assert ms_per_pass(stats) == {"shard-00001": 100.0, "shard-00002": 100.0, "shard-00003": 350.0}
    assert ms_per_pass([stats[0], shard(1, "w1", "r")]) == {"shard-00000": 450.0, "shard-00001": 100.0}  # one each
    load = MachineLoad((11.8, 10.2, 6.1), 0.021, 2)
    noise = noise_summary(stats, load)
    assert noise["noisy"] and noise["spread"] == 3.5 and noise["slowest"] == {"shard_id": "shard-00003", "ms_per_pass": 350.0}
    assert noise["message"] == ("shards differ 3.5x in ms per target pass (shard-00003 350.0 ms, shard-00001 100.0 ms; "
                                "more than 3x): a loaded or throttled machine, not the job (load average 11.8 10.2 6.1 "
                                "on 2 CPUs; CPU steal 2.1 %)")
    stats[3].verify_s = 5.0
    steady = noise_summary(stats, None)
    assert not steady["noisy"] and steady["spread"] == 2.5 and steady["message"] is None and steady["load_average"] is None
    assert spread({"only": 1.0}) is None and noise_summary(stats[:1], load)["spread"] is None


def test_the_benchmark_can_judge_its_own_cells():
    found = spread({"b=16 k=0": 40.0, "b=16 k=4": 200.0, "b=1 k=0": 50.0})
    assert found.noisy and verdict(found, MachineLoad(None, None, None), unit="cell").startswith(
        "cells differ 5.0x in ms per target pass (b=16 k=4 200.0 ms, b=16 k=0 40.0 ms")
    assert verdict(found, MachineLoad(None, None, None)).endswith("(load average and CPU steal not readable here)")


def test_the_printed_summary_names_the_noise_only_when_there_is_some():
    stats = [shard(i, "w0", "r") for i in range(3)]
    load = MachineLoad((1.0, 1.0, 1.0), None, 4)
    quiet = describe(summarize(stats, RunInfo("r", 0.0, 10.0, 3, load), "/out"))
    assert "noise" not in quiet
    stats[2].verify_s = 20.0
    noisy = describe(summarize(stats, RunInfo("r", 0.0, 10.0, 3, load), "/out")).splitlines()
    assert noisy[2].startswith("noise: shards differ 10.0x") and noisy[2].endswith("(load average 1.0 1.0 1.0 on 4 CPUs)")
