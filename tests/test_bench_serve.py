"""``python -m labkit.bench serve`` and ``gpu-check``: argument handling, the ratios and the
scoring of a run, the bundled workload, the child process run by another interpreter, and
gpu-check's path on a machine without a GPU. No real model runs here (``tiny-llama`` at most)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from labkit.bench import gpu_check, serve

# ------------------------------------------------------------------ workloads


def test_the_bundled_workload_is_the_shared_one_with_its_references():
    path = serve.resolve_workload(None, "smollm2-135m")
    assert path.endswith("smollm2-64req.json") and os.path.isfile(path)
    w = serve.load_workload(path)
    reqs = w["requests"]
    assert len(reqs) == 64
    assert sum(len(r["prompt_token_ids"]) for r in reqs) == 18336
    assert sum(r["max_tokens"] for r in reqs) == 9588
    assert all(len(r["reference_output_token_ids"]) == r["max_tokens"] for r in reqs)


def test_workload_names_resolve_and_unknown_ones_list_the_choices(tmp_path):
    assert serve.resolve_workload(None, "tiny-llama") == "default"        # references are SmolLM2's
    assert serve.resolve_workload("default", "smollm2-135m") == "default"
    assert serve.resolve_workload("smollm2-64req", "tiny-llama").endswith("smollm2-64req.json")
    mine = tmp_path / "w.json"
    mine.write_text("{}")
    assert serve.resolve_workload(str(mine), "smollm2-135m") == str(mine)
    with pytest.raises(ValueError, match="no workload 'nope'.*smollm2-64req"):
        serve.resolve_workload("nope", "smollm2-135m")


def test_the_bundled_workload_is_packaged():
    import tomllib
    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as f:
        data = tomllib.load(f)["tool"]["setuptools"]["package-data"]
    assert "data/*.json" in data["labkit.bench"]


# ------------------------------------------------------------- interpreters


def _args(*argv: str):
    return serve.build_parser().parse_args(list(argv))


@pytest.mark.parametrize("argv, message", [
    (["--python", "vllm"], "expected ENGINE=PATH"),
    (["--python", "=/usr/bin/python3"], "expected ENGINE=PATH"),
    (["--python", "sglang=/usr/bin/python3"], "unknown engine 'sglang'"),
    (["--python", "vllm=/no/such/python"], "'/no/such/python', is not an executable file.*make vllm-venv"),
    (["--vllm-python", "/no/such/python"], "is not an executable file"),
])
def test_bad_interpreters_are_refused_with_the_reason(argv, message):
    with pytest.raises(ValueError, match=message):
        serve.interpreters(_args(*argv), ["labkit", "vllm"])


def test_vllm_without_an_interpreter_says_how_to_get_one(monkeypatch, tmp_path):
    monkeypatch.setattr(serve.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(serve, "VLLM_VENV_PYTHON", "no-such-venv/bin/python")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="vllm is not importable here and no --vllm-python.*make vllm-venv"):
        serve.interpreters(_args(), ["labkit", "vllm"])
    assert serve.interpreters(_args(), ["labkit"]) == {}           # not asked for: no error


def test_a_made_vllm_venv_is_found_without_the_option(monkeypatch, tmp_path):
    monkeypatch.setattr(serve.importlib.util, "find_spec", lambda name: None)
    python = tmp_path / ".venv-vllm" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.symlink_to(sys.executable)
    monkeypatch.chdir(tmp_path)
    assert serve.interpreters(_args(), ["vllm"]) == {"vllm": str(python)}
    assert serve.interpreters(_args("--vllm-python", sys.executable), ["vllm"]) == {"vllm": sys.executable}


def test_the_cli_refuses_a_missing_vllm_python_before_running_anything(capsys):
    assert serve.main(["--engines", "labkit,vllm", "--vllm-python", "/no/such/python"]) == 2
    err = capsys.readouterr().err
    assert "bench serve:" in err and "/no/such/python" in err
    assert serve.main(["--engines", "labkit,sglang"]) == 2
    assert "unknown engine" in capsys.readouterr().err


def test_another_interpreter_loads_this_file_by_path_and_gets_every_option():
    args = _args("--dtype", "bfloat16", "--contend", "--kv-gib", "3")
    args.model_dir = "/models/m"
    cmd = serve.child_command("vllm", "/venv/bin/python", args, "/w.json", "/out.json")
    assert cmd[:2] == ["/venv/bin/python", "-c"] and cmd[3] == serve.__file__
    rest = cmd[4:]
    for flag, value in [("--child", "vllm"), ("--dtype", "bfloat16"), ("--kv-gib", "3.0"),
                        ("--model-dir", "/models/m"), ("--workload", "/w.json")]:
        assert rest[rest.index(flag) + 1] == value
    assert "--contend" in rest
    here = serve.child_command("labkit", None, args, "/w.json", "/out.json")
    assert here[:4] == [sys.executable, "-m", "labkit.bench", "serve"]


# ------------------------------------------------------------- scoring and ratios


def _workload(outputs=(3, 2)):
    return {"requests": [{"prompt_token_ids": [1] * 10, "max_tokens": n,
                          "reference_output_token_ids": list(range(n))} for n in outputs]}


def test_score_counts_equal_requests_and_tokens_before_the_first_divergence():
    w = _workload()
    r = {"wall_s": 0.5, "outputs": [[0, 1, 2], [0, 9]], "contended_wall_s": 1.0,
         "contended_outputs": [[0, 1, 2], [0, 1]]}
    serve.score(r, w["requests"], [q["reference_output_token_ids"] for q in w["requests"]])
    assert r["output_tok_per_s"] == pytest.approx(5 / 0.5)
    assert r["total_tok_per_s"] == pytest.approx(25 / 0.5)
    assert r["requests_matching_reference"] == 1
    assert r["tokens_before_first_divergence"] == 3 + 1
    assert r["contended_requests_matching_reference"] == 2
    assert r["contended_over_quiet"] == pytest.approx(0.5)
    assert "outputs" not in r and "contended_outputs" not in r


def test_every_ratio_comes_from_the_same_run_and_skipped_engines_have_none():
    results = {"labkit": {"output_tok_per_s": 300.0, "contended_output_tok_per_s": 200.0},
               "hf-static": {"output_tok_per_s": 100.0, "contended_output_tok_per_s": 80.0},
               "hf-cb": {"skipped": "no generate_batch"},
               "vllm": {"output_tok_per_s": 400.0}}
    assert serve.ratios(results) == pytest.approx({"labkit/hf-static": 3.0, "labkit/vllm": 0.75,
                                                   "hf-static/vllm": 0.25})
    assert serve.ratios(results, "contended_output_tok_per_s") == pytest.approx({"labkit/hf-static": 2.5})


def test_the_report_scores_against_the_reference_and_shows_the_change_under_contention():
    w = _workload()
    results = {"labkit": {"wall_s": 1.0, "outputs": [[0, 1, 2], [0, 1]], "contended_wall_s": 2.0,
                          "contended_outputs": [[0, 1, 2], [0, 1]], "version": "0.1", "config": "fp32"},
               "hf-static": {"wall_s": 2.0, "outputs": [[0, 1, 2], [5, 5]], "contended_wall_s": 5.0,
                             "contended_outputs": [[0, 1, 2], [5, 5]], "version": "5", "config": "x"},
               "vllm": {"skipped": "RuntimeError: vllm is not importable"}}
    report = serve.build_report(w, "test", results, _args("--contend"), (1.0, 1.0, 1.0))
    assert report["workload"]["reference"] == "workload"
    assert report["engines"]["labkit"]["requests_matching_reference"] == 2
    assert report["engines"]["hf-static"]["requests_matching_reference"] == 1
    assert report["ratios"]["labkit/hf-static"] == pytest.approx(2.0)
    assert report["ratios_contended"]["labkit/hf-static"] == pytest.approx(2.5)
    assert report["ratio_change_under_contention"]["labkit/hf-static"] == pytest.approx(0.25)
    text = serve.format_report(report)
    assert "labkit/hf-static 2.00x" in text and "+25.0%" in text
    assert "vllm         skipped: RuntimeError: vllm is not importable" in text
    assert "2/2" in text and "1/2" in text


def test_without_references_labkit_is_the_reference():
    w = {"requests": [{"prompt_token_ids": [1], "max_tokens": 2}]}
    results = {"labkit": {"wall_s": 1.0, "outputs": [[4, 5]]}, "hf-static": {"wall_s": 1.0, "outputs": [[4, 6]]}}
    report = serve.build_report(w, "t", results, _args(), None)
    assert report["workload"]["reference"] == "labkit"
    assert report["engines"]["hf-static"]["requests_matching_reference"] == 0


def test_contention_runs_one_busy_process_only_inside_the_block():
    import psutil
    me = psutil.Process()
    with serve.contention():
        busy = me.children()
        assert len(busy) == 1 and busy[0].is_running()
    assert not busy[0].is_running() or busy[0].status() == psutil.STATUS_ZOMBIE
    with serve.contention(False):
        assert me.children() == []


# ------------------------------------------------------------- children, end to end


def test_an_engine_process_leaves_no_process_behind(tmp_path):
    """vLLM's workers outlive a killed engine process unless its whole group goes: run_child
    takes the group down when the child ends."""
    import psutil
    pidfile = tmp_path / "pid"
    code = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            f"open({str(pidfile)!r}, 'w').write(str(p.pid)); print('started')")
    returncode, printed = serve.run_child([sys.executable, "-c", code], capture=True, cwd=None)
    assert returncode == 0 and printed.strip() == "started"
    orphan = int(pidfile.read_text())
    try:
        psutil.Process(orphan).wait(timeout=10)
    except psutil.NoSuchProcess:
        pass
    assert not psutil.pid_exists(orphan) or psutil.Process(orphan).status() == psutil.STATUS_ZOMBIE


def test_memory_counts_every_process_of_an_engine():
    """vLLM's memory is in its worker processes: the tree's RSS counts children too."""
    import time
    alone = serve.tree_rss_mib()
    with serve.contention():                     # one child process, a Python interpreter
        time.sleep(0.5)
        with_child = serve.tree_rss_mib()
    assert with_child > alone + 2 > 2



@pytest.mark.slow
def test_a_child_run_by_another_interpreter_times_quiet_and_contended(tmp_path, capsys):
    """The whole path: labkit's child started the way vLLM's is (this file loaded by its path,
    from a scratch directory), with --contend; tiny-llama, two short requests."""
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps({"requests": [{"prompt_token_ids": [5, 6, 7], "max_tokens": 4},
                                                 {"prompt_token_ids": [8, 9], "max_tokens": 3}]}))
    assert serve.main(["--model", "tiny-llama", "--engines", "labkit", "--workload", str(workload),
                       "--kv-gib", "0.05", "--python", f"labkit={sys.executable}", "--contend", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    r = report["engines"]["labkit"]
    assert "skipped" not in r, r
    assert r["output_tok_per_s"] > 0 and r["contended_output_tok_per_s"] > 0
    assert r["requests_matching_reference"] == 2 and r["contended_requests_matching_reference"] == 2



@pytest.mark.slow
def test_labkit_and_labkit_numba_run_side_by_side_and_agree(tmp_path, capsys):
    """``labkit-numba`` is labkit with its C++ kernels off, in its own process: same tokens,
    its own throughput, the ratio between them from the same run."""
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps({"requests": [{"prompt_token_ids": [5, 6, 7, 8], "max_tokens": 6},
                                                 {"prompt_token_ids": list(range(1, 40)), "max_tokens": 5}]}))
    assert serve.main(["--model", "tiny-llama", "--engines", "labkit,labkit-numba", "--workload", str(workload),
                       "--kv-gib", "0.05", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    fast, numba = report["engines"]["labkit"], report["engines"]["labkit-numba"]
    assert "skipped" not in fast and "skipped" not in numba, (fast, numba)
    assert fast["requests_matching_reference"] == 2 and numba["requests_matching_reference"] == 2
    assert "labkit/labkit-numba" in report["ratios"] or "labkit-numba/labkit" in report["ratios"]

FAKE_VLLM = '''
"""A stand-in for vllm with its offline API's shape: answers each request with
the workload's reference tokens, and records how it was called."""
import json, os
__version__ = "0.0-fake"
_LOG = os.path.join(os.path.dirname(__file__), "calls.json")

class SamplingParams:
    def __init__(self, max_tokens, temperature, ignore_eos):
        self.max_tokens = max_tokens

class _Out:
    def __init__(self, ids):
        self.outputs = [type("C", (), {"token_ids": ids})()]

class _Core:
    def shutdown(self):
        with open(_LOG) as f:
            calls = json.load(f)
        calls["shutdown"] = True
        with open(_LOG, "w") as f:
            json.dump(calls, f)

class LLM:
    def __init__(self, model, **kw):
        self.llm_engine = type("E", (), {"engine_core": _Core()})()
        with open(_LOG, "w") as f:
            json.dump({"model": model, "kw": kw, "env": {k: v for k, v in os.environ.items()
                                                          if k.startswith("VLLM_CPU")}}, f)

    def generate(self, prompts, params, use_tqdm=False):
        return [_Out(list(range(p.max_tokens))) for p in params]
'''


def test_the_vllm_child_is_wired_as_the_recipe_says(tmp_path, monkeypatch, capsys):
    """vllm's child, with a stand-in for vllm: the model directory, the dtype, prefix caching
    off, both threads bound, its KV space, and the explicit shutdown."""
    fake = tmp_path / "fake"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    monkeypatch.setenv("PYTHONPATH", str(fake))
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps(_workload((4, 3))))
    assert serve.main(["--engines", "vllm", "--python", f"vllm={sys.executable}", "--model", str(model_dir),
                       "--workload", str(workload), "--dtype", "bfloat16", "--kv-gib", "1.5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    r = report["engines"]["vllm"]
    assert r["version"] == "0.0-fake" and r["requests_matching_reference"] == 2
    with open(fake / "vllm" / "calls.json") as f:
        calls = json.load(f)
    assert calls["model"] == str(model_dir) and calls["shutdown"] is True
    assert calls["kw"]["dtype"] == "bfloat16" and calls["kw"]["enable_prefix_caching"] is False
    cpus = sorted(os.sched_getaffinity(0))
    assert calls["env"] == {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)), "VLLM_CPU_KVCACHE_SPACE": "2"}


# ------------------------------------------------------------------ gpu-check


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: gpu-check runs for real")
def test_gpu_check_without_a_gpu_says_so_and_exits_cleanly():
    proc = subprocess.run([sys.executable, "-m", "labkit.bench", "gpu-check"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "gpu-check: no CUDA GPU on this machine" in proc.stdout and "docs/gpu.md" in proc.stdout


def test_gpu_check_refuses_unknown_steps(capsys):
    assert gpu_check.main(["--steps", "tests,benchmarks"]) == 2
    assert "unknown step(s) ['benchmarks']" in capsys.readouterr().err


def test_gpu_check_reads_pytest_counts():
    assert gpu_check.parse_pytest("..s\n3 failed, 40 passed, 2 skipped, 1 error in 9.1s\n") == \
        {"failed": 3, "passed": 40, "skipped": 2, "error": 1}
    assert gpu_check.parse_pytest("no tests ran in 0.1s") == {}


def test_gpu_check_summarises_the_kernel_benchmark():
    row = dict(head_dim=64, batch=1, context=8192, triton_ms=2.0, split_ms=0.5, triton_of_copy=0.1, split_of_copy=0.4)
    big = dict(head_dim=64, batch=64, context=512, triton_ms=1.0, split_ms=1.1, triton_of_copy=0.8, split_of_copy=0.7)
    bench = {"meta": {"device": "H100", "copy_gbps": 3000.0},
             "results": [row, big, dict(head_dim=64, batch=256, context=8192, skipped="too big")]}
    f = gpu_check.kernel_figures(bench)
    assert f["best_of_copy"] == 0.8 and f["best_split_of_copy"] == 0.7
    assert f["split_speedup_small_batch"] == {"batch": 1, "context": 8192, "head_dim": 64, "speedup": 4.0}
    assert "80% of it" in gpu_check.describe_kernels(f) and "4.0x" in gpu_check.describe_kernels(f)


def test_gpu_check_stops_at_its_budget(monkeypatch):
    ran = []
    monkeypatch.setattr(gpu_check, "pytest_step", lambda name, args, timeout: ran.append((name, timeout))
                        or gpu_check.StepResult(name, "passed", timeout))
    results = gpu_check.run_check(5.0, ("tests", "notebooks"))
    assert ran == [] and [r.status for r in results] == ["timeout", "timeout"]
    results = gpu_check.run_check(1000.0, ("tests", "notebooks"))
    assert [name for name, _ in ran] == ["tests", "notebooks"]
    assert ran[0][1] == gpu_check.STEP_CAPS["tests"] and all(r.status == "passed" for r in results)
    assert "gpu-check on X:" in gpu_check.format_summary("X", results)


def test_gpu_check_steps_never_run_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "TRITON_INTERPRET" not in gpu_check.child_env()


@pytest.mark.slow
def test_gpu_check_equality_step_runs_end_to_end_on_a_cpu(tmp_path):
    """The equality step's code, off a GPU: tiny-llama, the torch backend, two requests whose
    references are the engine's own tokens for one and wrong for the other."""
    from labkit import LLM, SamplingParams
    prompts = [[5, 6, 7, 8], [9, 10]]
    llm = LLM("tiny-llama", num_blocks=16, enable_prefix_caching=False)
    ours = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)]
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps({"requests": [
        {"prompt_token_ids": prompts[0], "max_tokens": 5, "reference_output_token_ids": ours[0]},
        {"prompt_token_ids": prompts[1], "max_tokens": 5, "reference_output_token_ids": [0] * 5}]}))
    out = tmp_path / "eq.json"
    assert gpu_check.run_equality(str(out), model="tiny-llama", device="cpu", backend="torch",
                                  workload=str(workload), num_requests=2) == 0
    figures = json.loads(out.read_text())
    assert figures["requests"] == 2 and figures["labkit_equal_hf"] == 2
    assert figures["labkit_equal_reference"] == 1 and figures["all_equal_reference"] == 1
    assert figures["output_tok_per_s"] > 0 and figures["backend"] == "torch"


def test_vllms_process_gets_every_core_and_the_kv_space_asked_for_unless_the_user_set_them(monkeypatch):
    from labkit.bench.serve import child_env
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    env = child_env("vllm", kv_gib=2.5)
    cpus = sorted(os.sched_getaffinity(0))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, cpus))
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"                  # whole GiB, rounded up
    assert "VLLM_CPU_KVCACHE_SPACE" not in child_env("labkit", kv_gib=2.5)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "7")
    env = child_env("vllm", kv_gib=2.5)
    assert (env["VLLM_CPU_OMP_THREADS_BIND"], env["VLLM_CPU_KVCACHE_SPACE"]) == ("0", "7")
