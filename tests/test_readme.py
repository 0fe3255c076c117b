"""The README's commands, run as written.

Every fenced ``bash`` and ``python`` block of README.md is taken apart into its commands
(a bash block: one command a line, comments dropped; a python block: the whole block) and
each is run from the repository root, in the environment the tests run in, as the README
tells a reader to (``source .venv/bin/activate`` first: ``python`` is this interpreter).
``RULES`` says how each bash command is run; one that no rule knows fails, so that a new
snippet cannot go untested by accident:

* ``run``: run it; it must exit 0 within its budget (benchmarks are marked ``slow``);
* ``lab``: ``make lab`` serving forever: started (its setup and model steps taken as done:
  ``make test`` just did them), asked for its first page, which must be chapter 00, stopped;
* ``server``: ``python -m labkit serve ...``: started, sent the README's completion request,
  stopped;
* ``activate``: sourced in bash, then ``python`` must be the venv's;
* ``parse``: too long to run here (minutes of the real model): its options are checked
  against the benchmark's own parser, then it is skipped, with the reason;
* ``skip``: cannot run here, with the reason (the test suite itself, a CUDA install, ...).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from labkit.notebooks import LABKIT_SOURCE, needs_model

sys.path.insert(0, str(Path(__file__).parent / "browser"))
from lab_server import stop_group, wait_until_answers  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BIN = Path(sys.executable).parent
FENCE = re.compile(r"^```(\w+)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


@dataclass(slots=True, frozen=True)
class Rule:
    pattern: str
    kind: str                 # run | lab | server | activate | parse | skip
    reason: str = ""
    timeout_s: int = 120
    slow: bool = False


RULES = [
    Rule(r"make test\b|python -m pytest\b", "skip", "the test suite itself: this test runs inside it"),
    Rule(r"make lab\b", "lab", slow=True),
    Rule(r"make lint$", "run", timeout_s=300),
    Rule(r"make setup\b.*TORCH_INDEX=\S*/cu\d+", "skip", "installs a CUDA build of torch (several GB)"),
    Rule(r"make dist\b", "skip", "built and checked by tests/test_install.py (test_make_dist_builds_a_wheel...)"),
    Rule(r"make grade\b|python -m labkit\.notebooks verify\b", "skip",
         "needs a folder of students' notebooks (tests/test_grade.py grades sample ones)"),
    Rule(r"make notebooks\b|python -m labkit\.notebooks (generate|strip|colab)\b", "skip",
         "rewrites solutions/ or notebooks/ in place; tests/test_notebooks.py checks the generator on copies"),
    Rule(r"conda ", "skip", "creates a conda environment (minutes, network); tests/test_install.py checks "
                            "environment.yml and make's use of an active one"),
    Rule(r"source \.venv/bin/activate$", "activate"),
    Rule(r"python -m labkit serve\b.*(--api-keys?-file|--api-key\b|--host)", "skip",
         "a class server (keys, the room's network): tests/test_server.py and tests/test_classroom.py run one"),
    Rule(r"python -m labkit serve\b", "server", timeout_s=240, slow=True),
    Rule(r"python -c \"import secrets\b.*> keys\.txt$", "skip",
         "writes a class's keys file into the clone; tests/test_classroom.py makes and reads one"),
    Rule(r"curl ", "skip", "talks to the server a snippet above starts: the 'server' rule runs it against that server"),
    Rule(r"python -m labkit\.bench serve\b", "parse", "minutes of the real model with each engine: run it by hand"),
    Rule(r"python -m labkit\.bench kv-dtype\b", "parse",
         "minutes of the real model; tests/test_kv_cache_dtype.py runs this benchmark on tiny-llama (auto, int8)"),
    Rule(r"python -m labkit\.bench tiers\b", "parse",
         "minutes of the real model; tests/test_host_tier.py runs this benchmark on tiny-llama (all three configs)"),
    Rule(r"python -m labkit\.bench gpu-compile\b", "parse",
         "tests/test_gpu_compile.py compiles this subset and more (--quick: every target and dtype)"),
    # Benchmarks the suite runs elsewhere (each a minute of the real model or the simulator here):
    # their README lines are checked against their parsers, not run a second time.
    Rule(r"python -m labkit\.bench structured\b", "parse",
         "chapter 12 runs this benchmark on the real model (section 6), in tests/test_notebooks.py"),
    Rule(r"python -m labkit\.bench prefix\b", "parse",
         "chapter 10 runs this benchmark (tests/test_notebooks.py); tests/test_radix_cache.py checks its report"),
    Rule(r"python -m labkit\.bench sharing\b", "parse",
         "tests/test_exercises_beams.py runs this benchmark (test_bench_sharing_prints_the_table_beside_the_paper)"),
    Rule(r"python -m labkit\.bench step\b", "parse",
         "tests/test_kernels.py runs this benchmark on tiny-llama (test_bench_step_smoke, ..._ops_breakdown)"),
    Rule(r"python -m labkit\.bench swap\b", "parse",
         "tests/test_swap.py runs its parts: micro and sim (test_swap_benchmark_reproduces_figure_19s_shape), "
         "real on tiny-llama at the same block sizes (test_swap_benchmark_measures_the_real_engine_...)"),
    Rule(r"python -m labkit\.bench costs\b", "parse",
         "tests/test_server_sampling.py runs this benchmark for one short round (test_costs_benchmark_...)"),
    Rule(r"python -m labkit\.bench startup\b", "parse",
         "tests/test_readme.py runs this benchmark with one repeat (test_startup_benchmark_...)"),
    Rule(r"python -m labkit\.bench spec\b", "parse",
         "tests/test_spec_decode.py runs this benchmark on tiny-llama, every method and both workloads "
         "(test_spec_benchmark_...); chapter 11 serves its grounded workload on SmolLM2"),
    Rule(r"python -m labkit\.bench\b", "run", timeout_s=600, slow=True),
    Rule(r"python -m labkit\.notebooks check\b", "run", timeout_s=120),
]


def _strip_comment(line: str) -> str:
    """``line`` without its trailing ``# comment`` (a ``#`` outside quotes, after a space)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def readme_snippets() -> list[tuple[str, str, int]]:
    """``(language, text, line number)`` of each command: bash blocks line by line (with
    continuation lines joined), python blocks whole; other languages are not commands."""
    text = README.read_text(encoding="utf-8")
    out, seen = [], set()
    for block in FENCE.finditer(text):
        lang, body = block.group(1), block.group(2)
        first_line = text.count("\n", 0, block.start()) + 2
        if lang == "python":
            out.append(("python", body, first_line))
        elif lang in ("bash", "sh", "shell", "console"):
            for offset, line in enumerate(body.replace("\\\n", " ").splitlines()):
                command = _strip_comment(line).strip()
                if command and command not in seen:
                    seen.add(command)
                    out.append(("bash", command, first_line + offset))
    return out


def rule_for(command: str) -> Rule | None:
    return next((r for r in RULES if re.match(r.pattern, command)), None)


def _params():
    params = []
    for lang, text, line in readme_snippets():
        rule = rule_for(text) if lang == "bash" else Rule("", "python", slow=needs_model(text))
        marks = [pytest.mark.slow] if rule is not None and rule.slow else []
        label = text.strip().splitlines()[0][:60]
        params.append(pytest.param(lang, text, rule, id=f"L{line}:{label}", marks=marks))
    return params


def _env() -> dict[str, str]:
    """The README's "activate first": this interpreter's bin/ first on PATH."""
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", VIRTUAL_ENV=sys.prefix)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")     # a shared machine: see the README's GPUs section
    env.pop("PYTHONHOME", None)
    return env


def _model_cached() -> bool:
    from labkit.model.loader import _cache_complete, default_model_dir
    return _cache_complete(default_model_dir())


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_readme_has_commands():
    langs = {lang for lang, _, _ in readme_snippets()}
    assert {"bash", "python"} <= langs, "the README's snippets went missing (fenced ```bash / ```python blocks)"


@pytest.mark.parametrize("lang, text, rule", _params())
def test_readme_snippet_runs_as_written(lang, text, rule, tmp_path):
    if lang == "python":
        if needs_model(text) and not _model_cached():
            pytest.skip("needs the default model, which is not cached here (make model)")
        script = tmp_path / "snippet.py"
        script.write_text(text)
        run = subprocess.run(["python", str(script)], cwd=ROOT, env=_env(), capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, f"README python snippet failed:\n{text}\n{run.stdout[-2000:]}{run.stderr[-4000:]}"
        return
    if rule is None:
        pytest.fail(f"no rule in tests/test_readme.py says how to run the README command {text!r}: add one")
    if rule.kind == "skip":
        pytest.skip(rule.reason)
    if rule.kind == "parse":
        _check_options(text)
        pytest.skip(f"options checked; not run: {rule.reason}")
    if rule.kind == "activate":
        if not (ROOT / ".venv" / "bin" / "activate").exists():
            pytest.skip("no .venv here (the tests run in another environment, e.g. conda)")
        run = subprocess.run(["bash", "-c", f"{text} && python -c 'import labkit, sys; print(sys.prefix)'"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        assert Path(run.stdout.strip()).resolve() == (ROOT / ".venv").resolve(), run.stdout
        return
    if rule.kind == "lab":
        _check_make_lab(text, tmp_path)
        return
    if rule.kind == "server":
        _check_server(text, rule.timeout_s)
        return
    run = subprocess.run(["bash", "-c", text], cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=rule.timeout_s)
    assert run.returncode == 0, f"{text!r} exited {run.returncode}:\n{run.stdout[-2000:]}{run.stderr[-4000:]}"
    assert run.stdout.strip(), f"{text!r} printed nothing"


def _check_options(command: str) -> None:
    """The benchmark's own parser accepts the README's options."""
    import importlib
    import shlex
    argv = shlex.split(command)
    from labkit.bench.__main__ import COMMANDS, module_name
    what = argv[3]
    if what not in COMMANDS:
        pytest.fail(f"{command!r}: python -m labkit.bench has no benchmark {what!r}")
    module = importlib.import_module(module_name(what))
    try:
        module.build_parser().parse_args(argv[4:])
    except SystemExit as e:
        pytest.fail(f"{command!r}: labkit.bench.{what} rejects these options (exit {e.code})")


def _check_make_lab(command: str, tmp_path: Path) -> None:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    pytest.importorskip("jupyterlab", reason="jupyterlab is not installed")
    from lab_server import running_make_lab       # a free port instead of PORT=..., which may be taken
    with running_make_lab(ROOT / "notebooks", tmp_path / "home") as (url, token):
        with urllib.request.urlopen(f"{url}/?token={token}", timeout=30) as r:    # follows the redirect
            assert r.status == 200
            assert r.url.split("?")[0].endswith("/lab/tree/00_setup_and_tour.ipynb"), r.url


def _check_server(command: str, timeout_s: int) -> None:
    port = int(m.group(1)) if (m := re.search(r"--port[ =](\d+)", command)) else 8000
    if port == 0 or _port_in_use(port):
        pytest.skip(f"port {port} is in use here")
    if "tiny-llama" not in command and not _model_cached():
        pytest.skip("needs the default model, which is not cached here (make model)")
    proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_until_answers(proc, f"{base}/v1/models", timeout_s, repr(command))
        except RuntimeError as e:
            pytest.fail(f"{e}:\n{proc.stdout.read()[-3000:] if proc.poll() is not None else ''}")
        clients = [c for lang, c, _ in readme_snippets() if lang == "bash" and c.startswith("curl ")
                   and f"127.0.0.1:{port}/" in c]
        assert clients, f"the README shows no curl request for the server it starts with {command!r}"
        for client in clients:
            body = _send_as_written(client)
            text = body["choices"][0]["text"]
            assert body["usage"]["completion_tokens"] >= 1 and text.strip(), \
                f"the README's request to {command!r} answered no text: {body}"
    finally:
        stop_group(proc)


def _send_as_written(curl: str) -> dict:
    """The README's curl command, run as written (or, without curl, the same request sent
    by urllib); returns the JSON answer."""
    import shlex
    if shutil.which("curl"):
        run = subprocess.run(["bash", "-c", f"{curl} --silent --show-error --fail --max-time 120"], cwd=ROOT,
                             capture_output=True, text=True, timeout=180)
        assert run.returncode == 0, f"{curl!r} failed: {run.stderr}"
        return json.loads(run.stdout)
    argv = shlex.split(curl)
    url = next(a for a in argv[1:] if a.startswith("http"))
    headers = dict(h.split(": ", 1) for h in (argv[i + 1] for i, a in enumerate(argv) if a == "-H"))
    data = next(argv[i + 1] for i, a in enumerate(argv) if a in ("-d", "--data"))
    request = urllib.request.Request(url, data=data.encode(), headers=headers)
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.load(r)


# ---- what the README says agrees with the files it describes ------------------------------------
@pytest.mark.parametrize("command, ok", [
    ("python -m labkit.bench kv-dtype --kv-dtypes auto,int8 --requests 4", True),   # kv-dtype lives in kv_dtype.py
    ("python -m labkit.bench kv-dtype --kv-dtypez auto", False),   # a misspelt option
    ("python -m labkit.bench kv-dtype --requests four", False),    # a value of the wrong type
    ("python -m labkit.bench kvdtype --requests 4", False),        # no such benchmark
])
def test_the_parse_rule_fails_a_line_its_benchmark_would_refuse(command, ok):
    """A README line that is only parsed must still fail when the benchmark would not run it."""
    if ok:
        _check_options(command)
    else:
        with pytest.raises(pytest.fail.Exception):
            _check_options(command)


def test_readme_names_the_cpu_torch_sources():
    text = README.read_text(encoding="utf-8")
    index = re.search(r"^TORCH_INDEX\s*\?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert index in text, "the README must name the Makefile's torch index"
    assert "pytorch-cpu" in text and "conda-forge" in text, "the README must say conda takes conda-forge's CPU torch"


def test_readme_lists_every_benchmark():
    from labkit.bench.__main__ import COMMANDS
    listed = {c.split()[3] for lang, c, _ in readme_snippets()
              if lang == "bash" and c.startswith("python -m labkit.bench ")}
    assert set(COMMANDS) <= listed, f"benchmarks missing from the README: {sorted(set(COMMANDS) - listed)}"


def test_colab_links_and_install_cell_name_one_home():
    """The Colab badges open notebooks from the repository the install cell installs from."""
    home = re.fullmatch(r"git\+https://github\.com/([^/@]+/[^/@]+?)(?:\.git)?(?:@.*)?", LABKIT_SOURCE)
    if home is None:
        pytest.skip(f"LABKIT_SOURCE is not a GitHub repository ({LABKIT_SOURCE}): no Colab link to compare")
    links = re.findall(r"colab\.research\.google\.com/github/([^/]+/[^/]+)/", README.read_text(encoding="utf-8"))
    assert links and set(links) == {home.group(1)}, (set(links), LABKIT_SOURCE)
    assert LABKIT_SOURCE in README.read_text(encoding="utf-8")


def test_bench_help_is_plain_text_and_a_bare_command_prints_it(capsys):
    """``python -m labkit.bench`` alone lists the benchmarks (what the README says it does:
    a success); ``--help``, everywhere, is terminal text without reStructuredText's backticks."""
    from labkit.bench.__main__ import COMMANDS, main
    assert main([]) == 0
    bare = capsys.readouterr().out
    assert all(name in bare for name in COMMANDS) and "``" not in bare
    assert main(["--help"]) == 0 and capsys.readouterr().out == bare
    for name in COMMANDS:
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        out = capsys.readouterr().out
        assert e.value.code == 0 and f"python -m labkit.bench {name}" in out, name
        assert "``" not in out, f"python -m labkit.bench {name} --help shows RST markup"
    assert main(["nope"]) == 2 and "choose from: memory" in capsys.readouterr().err


# ---- the command line: answers at once, exit codes that mean something --------------------------
def _cli(*args: str) -> subprocess.CompletedProcess:
    """``python -X importtime ARGS`` in a fresh process: its output, and in stderr the modules it imported."""
    return subprocess.run([sys.executable, "-X", "importtime", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def _imported(run: subprocess.CompletedProcess) -> set[str]:
    return {line.rsplit("|", 1)[-1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("args, code, says", [
    (["-m", "labkit", "--help"], 0, "serve"),
    (["-m", "labkit", "serve", "--help"], 0, "--attention-backend"),
    (["-m", "labkit.bench"], 0, "startup"),                    # the list of benchmarks: what was asked for
    (["-m", "labkit.bench", "--help"], 0, "sharing"),
    (["-m", "labkit"], 2, "COMMAND"),                          # no command: the help, and a failing status
    (["-m", "labkit.bench", "nope"], 2, "unknown benchmark 'nope'"),
    (["-m", "labkit", "serve", "--port", "eighty"], 2, "invalid int value"),
    (["-m", "labkit", "serve", "--attention-backend", "fast"], 2, "invalid choice"),
])
def test_cli_answers_without_importing_torch(args, code, says):
    """Help, the benchmark list and argument errors come from the parsers alone: no torch, no
    server, so they answer in a fraction of a second (``python -m labkit.bench startup``)."""
    run = _cli(*args)
    assert run.returncode == code, run.stdout + run.stderr[-2000:]
    assert says in run.stdout + run.stderr
    imported = _imported(run)
    assert "labkit" in imported and not imported & {"torch", "transformers", "fastapi"}, \
        sorted(m for m in imported if m.split(".")[0] in ("torch", "transformers", "fastapi"))


def test_cli_written_out_defaults_match_their_sources():
    """The parser writes two values out (importing them would load torch): they must agree."""
    from labkit.__main__ import BACKENDS, DEFAULT_MAX_BODY_MIB
    from labkit.kernels.backend import BACKENDS as KERNEL_BACKENDS
    from labkit.server.limits import DEFAULT_MAX_BODY_BYTES
    assert BACKENDS == KERNEL_BACKENDS and DEFAULT_MAX_BODY_MIB << 20 == DEFAULT_MAX_BODY_BYTES


@pytest.mark.slow
def test_startup_benchmark_times_each_command_and_sees_which_import_torch():
    """``python -m labkit.bench startup`` (the README's line runs five repeats), one repeat:
    every command timed, and only the engine's import loads torch."""
    from labkit.bench.startup import COMMANDS, table
    run = subprocess.run([sys.executable, "-m", "labkit.bench", "startup", "--repeat", "1", "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert out["repeat"] == 1 and [r["command"] for r in out["rows"]] == list(COMMANDS)
    for r in out["rows"]:
        assert 0 < r["min_s"] <= r["median_s"], r
        assert r["imports_torch"] == ("LLM" in r["command"]), r
    printed = table(out["rows"], out["repeat"]).splitlines()       # what it prints without --json
    assert len(printed) == 1 + len(COMMANDS) and "1 fresh processes each" in printed[0]
    assert [line.split()[-1] for line in printed[1:]] == ["yes" if "LLM" in c else "no" for c in COMMANDS]
    bad = subprocess.run([sys.executable, "-m", "labkit.bench", "startup", "--repeat", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--repeat" in bad.stderr
