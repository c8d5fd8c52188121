"""The benchmark scripts run end to end on tiny sizes (their numbers are not checked here:
speed is measured by running them, see docs/benchmarks.md), and the W1 correctness check
they make (every contestant's tables equal after one step) passes, dynamic tables included."""

import json
import re
import subprocess
import sys

from conftest import ROOT


def run(args, tmp_path):
    res = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=None)
    assert res.returncode == 0, f"{args}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res.stdout


def test_w1_with_dynamic_tables_and_the_per_table_call_agrees_with_the_peers(tmp_path):
    out = tmp_path / "w1.json"
    bench = str(ROOT / "benchmarks" / "bench_w1.py")
    run(
        [
            bench,
            "--rows",
            "3000",
            "--steps",
            "4",
            "--nbatches",
            "2",
            "--batch",
            "256",
            "--stream-mb",
            "8",
            "--dynamic",
            "--per-table",
            "--skip-fbgemm",
            "--out",
            str(out),
        ],
        tmp_path,
    )
    report = json.loads(out.read_text())
    assert report["correctness"]["passed"]
    assert report["correctness"]["sokpy_vs_sokpy_dynamic_max_abs_diff"] < 1e-6
    assert report["correctness"]["sokpy_vs_sokpy_per_table_max_abs_diff"] < 1e-6
    assert {"sokpy", "sokpy_dynamic", "sokpy_per_table", "torch"} <= set(report["results"])
    for r in report["results"].values():  # the four phases of a step, each timed
        assert min(r["forward_ms"], r["loss_forward_ms"], r["backward_ms"], r["optimizer_ms"]) > 0
    sp = report["results"]["sokpy"]["split_ms"]  # the loss inside steps and alone
    assert sp["loss"] > 0 and sp["loss_alone"] > 0 and sp["own_overhead"] == sp["overhead"] - sp["loss"]


def test_storage_benchmark_runs(tmp_path):
    out = tmp_path / "storage.json"
    bench = str(ROOT / "benchmarks" / "bench_storage.py")
    run([bench, "--rows", "2000", "--tables", "2", "--dim", "8", "--growth-rows", "5000", "--out", str(out)], tmp_path)
    report = json.loads(out.read_text())
    (g,) = report["growth"]
    assert g["rows"] == 5000 and g["growths_during_fill"] >= 1
    assert report["checkpoint"]["bytes"] == 2 * 2000 * 8 * 2 * 4  # values + Adagrad sums


def test_per_table_cost_is_measured(tmp_path):
    """bench_tables.py --per-table runs the tiny step at 4 and 500 tables and reports the
    growth per table (and every run's correctness check passes)."""
    out = tmp_path / "tables.json"
    bench = str(ROOT / "benchmarks" / "bench_tables.py")
    run([bench, "--only", "--per-table", "--steps", "2", "--skip-fbgemm", "--out", str(out)], tmp_path)
    report = json.loads(out.read_text())
    pt = report["per_table"]
    assert [r["tables"] for r in pt["rows"]] == [4, 500]
    assert (
        pt["overhead_us_per_table"]
        == 1e3 * (pt["rows"][1]["sokpy_overhead_ms"] - pt["rows"][0]["sokpy_overhead_ms"]) / 496
    )
    for name in ("tiny4", "tiny500"):
        assert json.loads((tmp_path / f"tables_{name}.json").read_text())["correctness"]["passed"]


def test_gpu_benchmark_script_runs_on_the_host_backend(tmp_path):
    """bench_gpu.py is for GPU nodes; run on the host backend at 2 ranks it exercises the
    same script (data, steps, the slowest-rank reduction, the report)."""
    out = tmp_path / "gpu.json"
    bench = str(ROOT / "benchmarks" / "bench_gpu.py")
    args = ["--backend", "host", "--workload", "t100", "--rows", "2000", "--batch", "64"]
    args += ["--steps", "3", "--warmup", "1", "--nbatches", "2", "--out", str(out)]
    run([str(ROOT / "launch" / "sokrun"), "-np", "2", "--timeout", "240", "python", bench, *args], tmp_path)
    report = json.loads(out.read_text())
    assert report["ranks"] == 2 and report["shape"]["tables"] == 100
    res = report["sokpy"]
    assert res["step"]["n"] == 3 and res["samples_per_s"] > 0 and "forward_hbm_share" not in res


def test_soak_script_runs(tmp_path):
    """benchmarks/soak.py end to end, briefly (its numbers come from long runs, see
    docs/benchmarks.md): the dynamic table grows by the fresh keys of every rank."""
    out = tmp_path / "soak.json"
    args = [str(ROOT / "benchmarks" / "soak.py"), "--steps", "6", "--window", "3", "--new-keys", "8"]
    run([str(ROOT / "launch" / "sokrun"), "-np", "2", "--timeout", "240", "python", *args, "--out", str(out)], tmp_path)
    report = json.loads(out.read_text())
    assert [w["step"] for w in report["windows"]] == [3, 6]
    assert report["windows"][-1]["dynamic_rows"] >= 6 * 2 * 8  # every fresh key of both ranks is a row


def test_streaming_soak_script_runs(tmp_path):
    """benchmarks/soak_stream.py end to end, briefly, at one rank: the capped tables fill,
    evict and stay at their cap, the uncapped one holds every key, and the report has the
    capped tables' targets (its numbers come from the long run, docs/benchmarks.md)."""
    out = tmp_path / "soak_stream.json"
    args = [str(ROOT / "benchmarks" / "soak_stream.py"), "--steps", "6", "--window", "3", "--batch-size", "64"]
    run(
        [*args, "--max-rows", "300", "--variants", "uncapped,lru,lfu0,lru+admit2", "--auc-windows", "1"]
        + ["--out", str(out)],
        tmp_path,
    )
    report = json.loads(out.read_text())
    first, last = report["windows"]
    assert [first["step"], last["step"]] == [3, 6]
    assert last["uncapped"]["rows"] == last["uncapped"]["inserted"] > 300 and last["uncapped"]["evicted"] == 0
    for kind, low in (("lru", 300 - 300 // 64), ("lfu0", 300)):  # lru frees a margin of 300 // 64 rows more
        w = last[kind]
        assert low <= w["rows"] <= 300 and w["inserted"] - w["evicted"] == w["rows"] and w["inserted"] > 300
        assert 0.0 <= w["hit_rate"] < last["uncapped"]["hit_rate"] <= 1.0
        assert {"step_time_ratio", "auc_diff", "memory_met"} <= set(report["summary"]["goals"][kind])
    assert last["lru+admit2"]["inserted"] < last["lru"]["inserted"]  # keys seen once get no row


def test_eviction_replay_bounds_every_policy_by_the_offline_optimum(tmp_path):
    """benchmarks/eviction_replay.py on a short stream with a cap far below its keys: Belady's
    offline optimum holds at least as many of each step's keys as every policy, and no
    capped policy more than the uncapped key set."""
    out = tmp_path / "replay.json"
    args = [str(ROOT / "benchmarks" / "eviction_replay.py"), "--steps", "40", "--batch-size", "64"]
    run(
        [*args, "--max-rows", "200", "--policies", "lru,lfu,decay:20,bonus:20,overdue:100,belady", "--out", str(out)],
        tmp_path,
    )
    results = json.loads(out.read_text())["results"]
    best, top = results["belady"]["hit_rate"], results["uncapped"]["hit_rate"]
    assert 0.0 < best < top < 1.0  # (at this cap even the optimum misses some returning keys)
    for policy in ("lru", "lfu", "decay:20", "bonus:20", "overdue:100"):
        assert 0.0 < results[policy]["hit_rate"] <= best, (policy, results)


def test_python_call_count_script_runs(tmp_path):
    """benchmarks/count_python_calls.py end to end on tiny tables: one count per phase."""
    args = [str(ROOT / "benchmarks" / "count_python_calls.py"), "--tables", "3", "--rows", "100", "--batch", "16"]
    out = run([*args, "--calls", "3"], tmp_path)
    counts = {line.split(":")[0]: int(line.split()[1]) for line in out.splitlines() if "Python calls" in line}
    assert set(counts) == {"forward", "step"} and 0 < counts["forward"] < counts["step"], out


def test_per_table_against_keyed_script_runs(tmp_path):
    """benchmarks/per_table_vs_keyed.py end to end on tiny tables: a line per variant, the
    keyed one at 1.000x itself."""
    script = str(ROOT / "benchmarks" / "per_table_vs_keyed.py")
    out = run([script, "--tables", "3", "--rows", "200", "--batch", "32", "--steps", "2", "--rounds", "2"], tmp_path)
    lines = {line.split(":")[0]: line for line in out.splitlines() if "x keyed" in line}
    assert set(lines) == {"keyed", "per-table", "per-table, no cat"}, out
    assert lines["keyed"].endswith("1.000x keyed"), out


def test_each_contestant_in_its_own_process(tmp_path):
    """benchmarks/own_process.py on tiny tables: one process per contestant and round, the
    contestants' rows agree after the correctness step, and every pair has its ratio; a
    contestant of another checkout (``--tree``, here this one again) runs with that checkout's
    sokpy, the report names each checkout's commit, and every pair has its CPU-time ratio too."""
    out = tmp_path / "own.json"
    script = str(ROOT / "benchmarks" / "own_process.py")
    args = [
        "--tables",
        "3",
        "--rows",
        "300",
        "--batch",
        "16",
        "--steps",
        "3",
        "--rounds",
        "1",
        "--tree",
        f"again={ROOT}",
    ]
    run([script, *args, "--contestants", "sokpy,sokpy_per_table,torch,sokpy@again", "--out", str(out)], tmp_path)
    r = json.loads(out.read_text())
    (got,) = r["rounds"]
    assert set(got) == {"sokpy", "sokpy_per_table", "torch", "sokpy@again"}
    assert all(got[n]["max_abs_diff_to_sokpy"] <= 1e-5 for n in ("sokpy_per_table", "torch")), got
    assert got["sokpy@again"]["max_abs_diff_to_sokpy"] == 0.0, got  # the same build: the same bits
    assert all(g["changed_by_step"] > 1e-4 and g["n"] == 3 for g in got.values()), got
    assert all(g["page_faults_per_step"] >= 0 for g in got.values()), got
    assert {"torch / sokpy", "sokpy@again / sokpy", "sokpy@again / torch"} <= set(r["summary"]["ratios"])
    assert set(r["summary"]["cpu_ratios"]) == set(r["summary"]["ratios"])
    assert all(g["cpu_ms"] > 0 for g in got.values()), got
    assert set(r["commits"]) == {"(this checkout)", "again"} and len(set(r["commits"].values())) == 1, r["commits"]


def test_scaling_benchmark_times_each_kernel(tmp_path):
    """benchmarks/bench_scaling.py --per-kernel at one rank: the launches it times are the
    step's kernels (the timer wraps the running backend's kernel set)."""
    out = tmp_path / "scaling.json"
    script = str(ROOT / "benchmarks" / "bench_scaling.py")
    args = ["--tables", "3", "--rows", "300", "--dim", "8", "--batch", "16", "--hotness", "2", "--steps", "3"]
    run([script, *args, "--per-kernel", "--out", str(out)], tmp_path)
    per_kernel = json.loads(out.read_text())["result"]["per_kernel_ms_rank0"]
    assert {"combine_forward", "segment_sum", "adagrad_update"} <= set(per_kernel), per_kernel
    assert all(ms > 0 for ms in per_kernel.values()), per_kernel


def shown_figures(*pages):
    """The images ``pages`` of docs/ show (``img/<name>.png``)."""
    return {n for page in pages for n in re.findall(r"\]\(img/([\w.-]+\.png)\)", page.read_text())}


def test_every_committed_figure_is_shown():
    shown = shown_figures(*(ROOT / "docs").glob("*.md"))
    assert {p.name for p in (ROOT / "docs" / "img").glob("*.png")} == shown


def test_plots_draw_every_figure_of_the_benchmarks_page_from_docs_data(tmp_path):
    """benchmarks/plots.py draws each figure the page shows from the JSON in docs/data/ (with
    each benchmark's own plot function, so a change to a report's shape shows here)."""
    run([str(ROOT / "benchmarks" / "plots.py"), "--out-dir", str(tmp_path)], tmp_path)
    drawn = {p.name for p in tmp_path.glob("*.png")}
    assert drawn == shown_figures(ROOT / "docs" / "benchmarks.md") and all(
        (tmp_path / n).stat().st_size > 10_000 for n in drawn
    )


def test_pipeline_benchmark_job_times_the_phases_of_both_loops():
    """benchmarks/bench_pipeline.py's job (what each run of it starts on the emulated nodes), at
    2 ranks, plain and pipelined: every step's phases on every rank, the same losses, and the
    summary takes the key exchange's wait of the rank that waited least in it."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_pipeline
    from conftest import run_mpi

    args = ["--job", "--steps", "3", "--warmup", "2", "--batch-size", "256", "--dim", "4", "--wire-dtype", "bfloat16"]
    script = ROOT / "benchmarks" / "bench_pipeline.py"
    runs = {}
    for mode in ("plain", "pipeline"):
        out = run_mpi(2, script, *args, *(["--pipeline"] if mode == "pipeline" else []), timeout=300)
        runs[mode] = json.loads(next(ln for ln in out.splitlines() if ln.startswith("PHASES "))[len("PHASES ") :])
    assert runs["plain"]["losses"] == runs["pipeline"]["losses"]
    for mode, data in runs.items():
        assert len(data["ranks"]) == 2 and all(len(r) == 3 for r in data["ranks"]), data
        s = bench_pipeline.summarise(data["ranks"])
        assert s["keys_last_ms"] <= s["keys_ms"] + s["wait_ms"] + 1e-9 and s["step_ms"] > 0, s
        assert (s["ahead_ms"] > 0) == (mode == "pipeline"), (mode, s)


def test_host_step_benchmark_pairs_both_steps(tmp_path):
    """benchmarks/bench_host_step.py on a few rounds: both steps start from the same rows
    (their forward outputs agree), both change them, and every clock has both sides' times
    and the ratio of their pairs."""
    out = tmp_path / "host_step.json"
    script = str(ROOT / "benchmarks" / "bench_host_step.py")
    run([script, "--steps", "2", "--rounds", "3", "--warmup-rounds", "1", "--out", str(out)], tmp_path)
    r = json.loads(out.read_text())
    assert r["check"]["forward_max_abs_diff"] <= 1e-6
    assert all(v > 0 for v in r["check"]["step_changed_rows_by"].values()), r["check"]
    for clock in ("cpu", "wall"):
        got = r["result"][clock]
        assert got["sokpy_ms_per_step"] > 0 and got["torch_ms_per_step"] > 0 and got["ratio_median"] > 0, got
