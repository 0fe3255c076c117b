"""``python -m labkit.bench http --vs-vllm`` and ``--breakdown``: the labkit half runs end to end
on tiny-llama and its report parses; the vLLM half is skipped, with the reason, where vLLM
cannot run (CI machines have no ``.venv-vllm``), and its client's command line and result
file are checked without it. Issue 35."""

import json
import os
import subprocess
import sys

import pytest

from labkit import vllm_port
from labkit.bench import http_breakdown, http_vllm

HAS_VLLM, WHY_NOT = vllm_port.available()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _level(c, tok_s, ttft, tpot, failed=0):
    return {"concurrency": c, "completed": 4, "failed": failed, "duration_s": 1.0, "output_tokens": 16,
            "output_tok_per_s": tok_s, "ttft_mean_ms": ttft, "ttft_p99_ms": 2 * ttft,
            "tpot_mean_ms": tpot, "tpot_p99_ms": 2 * tpot}


@pytest.mark.slow
def test_the_labkit_half_runs_and_the_vllm_half_says_why_it_is_skipped():
    env = {**os.environ, vllm_port.ENV_VAR: ""}          # vLLM turned off, as on a machine without it
    proc = subprocess.run([sys.executable, "-m", "labkit.bench", "http", "--vs-vllm", "--quick", "--model",
                           "tiny-llama", "--json"], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "vLLM half skipped:" in proc.stderr and "turned off" in proc.stderr
    report = json.loads(proc.stdout)
    (one,) = report["rounds"]
    labkit, vllm = one["servers"]
    assert labkit["name"] == "labkit" and not labkit["skipped"] and "labkit.bench http" in labkit["client"]
    assert [lv["concurrency"] for lv in labkit["levels"]] == list(http_vllm.QUICK.levels)
    for lv in labkit["levels"]:
        assert lv["completed"] == http_vllm.QUICK.num_prompts and lv["failed"] == 0
        assert lv["output_tokens"] == http_vllm.QUICK.num_prompts * http_vllm.QUICK.output_len
        assert lv["output_tok_per_s"] > 0 and lv["ttft_mean_ms"] > 0 and lv["tpot_mean_ms"] > 0
    assert vllm["name"] == "vllm" and not vllm["attempted"] and "turned off" in vllm["skipped"]
    assert one["ratios_labkit_over_vllm"] == {} and report["issue35_bar_at_8"] == [None]
    table = http_vllm.format_report(report)
    assert "labkit" in table and "vllm            skipped" in table


def test_the_report_gives_labkit_over_vllm_per_round_their_median_and_the_issues_bar():
    w = http_vllm.Workload(levels=(1, 8))

    def runs(vllm_at_8):
        lab = http_vllm.ServerRun("labkit", levels=[_level(1, 20.0, 100.0, 40.0), _level(8, 80.0, 900.0, 70.0)])
        return [lab, http_vllm.ServerRun("vllm", levels=[_level(1, 25.0, 80.0, 36.0), vllm_at_8])]

    r = http_vllm.report("smollm2-135m", w, [runs(_level(8, 72.6, 1218.0, 74.4))], eager=False)
    (one,) = r["rounds"]
    assert one["ratios_labkit_over_vllm"]["1"]["output_tok_per_s"] == pytest.approx(0.8)
    assert one["ratios_labkit_over_vllm"]["8"]["ttft_mean_ms"] == pytest.approx(900 / 1218, abs=1e-3)
    assert r["issue35_bar_at_8"] == [True] and http_vllm.succeeded(r)
    # vLLM faster in a second round: the bar is met in one round of two; the median between them
    r = http_vllm.report("m", w, [runs(_level(8, 72.6, 1218.0, 74.4)), runs(_level(8, 100.0, 800.0, 60.0))],
                         eager=False)
    assert r["issue35_bar_at_8"] == [True, False]
    assert r["median_ratios_labkit_over_vllm"]["8"]["output_tok_per_s"] == pytest.approx((80 / 72.6 + 0.8) / 2,
                                                                                           abs=1e-3)
    text = http_vllm.format_report(r)
    assert "round 2:" in text and "median over 2 rounds" in text and "(1 of 2 rounds)" in text
    assert not http_vllm.succeeded(http_vllm.report("m", w, [runs(_level(8, 72.6, 1218.0, 74.4, failed=1))],
                                                    eager=False))         # a failed request fails the run


def test_vllm_bench_serve_gets_the_workload_and_its_result_file_is_read():
    w = http_vllm.Workload(num_prompts=32, input_len=128, output_len=32)
    cmd = http_vllm.vllm_client_command("/venv/bin/python", "http://127.0.0.1:9", "smollm2-135m", "/models/m",
                                        w, 8, "/tmp/out", "r.json")
    assert cmd[0] == "/venv/bin/python" and cmd[cmd.index("cli") + 1:][:2] == ["bench", "serve"]
    for flag, value in [("--base-url", "http://127.0.0.1:9"), ("--max-concurrency", "8"), ("--num-prompts", "32"),
                        ("--random-input-len", "128"), ("--random-output-len", "32"), ("--temperature", "0"),
                        ("--tokenizer", "/models/m"), ("--result-filename", "r.json")]:
        assert cmd[cmd.index(flag) + 1] == value
    assert "--ignore-eos" in cmd and "--save-result" in cmd
    saved = {"completed": 32, "failed": 0, "duration": 14.1, "total_output_tokens": 1024, "output_throughput": 72.6,
             "mean_ttft_ms": 1218.0, "p99_ttft_ms": 2000.0, "mean_tpot_ms": 74.4, "p99_tpot_ms": 90.0}
    lv = http_vllm.parse_vllm_result(saved, 8)
    assert lv == {"concurrency": 8, "completed": 32, "failed": 0, "duration_s": 14.1, "output_tokens": 1024,
                  "output_tok_per_s": 72.6, "ttft_mean_ms": 1218.0, "ttft_p99_ms": 2000.0,
                  "tpot_mean_ms": 74.4, "tpot_p99_ms": 90.0}


def test_timers_time_a_method_and_undo_restores_it():
    class Thing:
        def work(self, x):
            return x + 1

    thing, t, original = Thing(), http_breakdown.Timers(), Thing.work
    t.wrap(thing, "work", "work")
    t.wrap(Thing, "work", "class")             # a class's method too (the other instances)
    assert thing.work(1) == 2 and Thing().work(2) == 3
    assert t.calls["work"] == 1 and t.calls["class"] == 1 and t.wall["work"] >= 0
    t.undo()
    assert "work" not in vars(thing) and Thing.work is original


@pytest.mark.slow
def test_the_breakdown_runs_offline_and_online_on_a_tiny_model():
    w = http_vllm.Workload(levels=(2,), num_prompts=4, input_len=16, output_len=4)
    r = http_breakdown.run_breakdown("tiny-llama", w, use_vllm_client=False)
    (level,) = r["levels"]
    off, on = level["offline"], level["online"]
    assert off["steps"] > 0 and on["steps"] > 0 and on["client"]["completed"] == 4
    assert off["phases"]["forward"] > 0 and on["phases"]["event loop CPU, total"] > 0
    assert "HTTP writes (h11 + socket, CPU)" in on["phases"] and "sampling" in off["phases"]
    text = http_breakdown.format_breakdown(r)
    assert "| ms per engine step | offline | online |" in text


@pytest.mark.skipif(not HAS_VLLM, reason=f"vLLM cannot run here: {WHY_NOT}")
def test_vllms_client_is_found_where_vllm_is():
    python, version = vllm_port.find_python()
    assert os.access(python, os.X_OK) and version


def test_another_checkout_runs_with_its_own_kernels(tmp_path):
    """``--labkit-src DIR`` (and ``python -m labkit.bench.checkout DIR MODULE``) runs DIR's
    labkit: its Python package and its ``kernels/`` as ``labkit.kernels`` (which only an install
    maps), not this checkout's editable kernels."""
    (tmp_path / "labkit").mkdir()
    (tmp_path / "labkit" / "__init__.py").write_text("")
    (tmp_path / "labkit" / "__main__.py").write_text(
        "import sys, labkit, labkit.kernels, labkit.kernels.part\n"
        "print(labkit.__file__, labkit.kernels.__file__, labkit.kernels.part.WHO, sys.argv[1:], sep='|')\n")
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    (tmp_path / "kernels" / "part.py").write_text("WHO = 'the other checkout'\n")
    for cmd in ([*http_vllm.labkit_command(str(tmp_path)), "serve", "--port", "1"],
                [sys.executable, "-m", "labkit.bench.checkout", str(tmp_path), "labkit", "serve", "--port", "1"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        package, kernels, who, argv = proc.stdout.strip().split("|")
        assert package == str(tmp_path / "labkit" / "__init__.py")
        assert kernels == str(tmp_path / "kernels" / "__init__.py") and who == "the other checkout"
        assert argv == "['serve', '--port', '1']"
    assert http_vllm.labkit_command() == [sys.executable, "-m", "labkit"]
    proc = subprocess.run([sys.executable, "-m", "labkit.bench.checkout", str(tmp_path / "labkit"), "labkit"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "not a labkit checkout" in proc.stderr
