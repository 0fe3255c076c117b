"""labkit.vllm_port: finding vLLM, mapping SamplingParams, and running vLLM's offline API and
`vllm serve` in a process group that never outlives its use. Stand-ins for vllm (a package
on PYTHONPATH, run by this interpreter) test the wiring without vLLM; one test runs the real
thing where vLLM's interpreter is found (not in CI)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import textwrap
import time
import urllib.request

import psutil
import pytest

from labkit import SamplingParams
from labkit import vllm_port

HAS_VLLM, WHY_NOT = vllm_port.available()


def gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether process ``pid`` has ended (a zombie nobody reaps has ended too)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


# ------------------------------------------------------------------ finding vLLM
def test_an_empty_variable_turns_vllm_off(monkeypatch):
    monkeypatch.setenv(vllm_port.ENV_VAR, "")
    ok, why = vllm_port.available()
    assert not ok and "turned off" in why and vllm_port.ENV_VAR in why


def test_a_configured_interpreter_that_is_not_a_file_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv(vllm_port.ENV_VAR, str(tmp_path / "no-python"))
    ok, why = vllm_port.available()
    assert not ok and str(tmp_path / "no-python") in why and "not an executable file" in why
    assert "make vllm-venv" in why


@pytest.mark.skipif(HAS_VLLM and vllm_port.find_python()[0] == sys.executable, reason="vllm is importable here")
def test_an_interpreter_without_vllm_is_refused_with_the_reason(monkeypatch):
    monkeypatch.setenv(vllm_port.ENV_VAR, sys.executable)
    ok, why = vllm_port.available()
    assert not ok and f"{sys.executable} cannot import vllm" in why and "make vllm-venv" in why


def test_nothing_found_says_how_to_enable_it(monkeypatch, tmp_path):
    monkeypatch.delenv(vllm_port.ENV_VAR, raising=False)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    monkeypatch.setattr(vllm_port, "VLLM_VENV_PYTHON", "no-such-venv/bin/python")
    monkeypatch.chdir(tmp_path)
    ok, why = vllm_port.available()
    assert not ok and "vllm is not importable" in why and vllm_port.ENV_VAR in why and "make vllm-venv" in why
    with pytest.raises(vllm_port.VLLMUnavailable, match="make vllm-venv"):
        vllm_port.generate("Hello", SamplingParams(max_tokens=2), model=str(tmp_path))
    with pytest.raises(vllm_port.VLLMUnavailable, match="make vllm-venv"):
        with vllm_port.serve(str(tmp_path)):
            pass


def test_a_made_venv_is_found_from_the_current_directory(monkeypatch, tmp_path):
    python = tmp_path / ".venv-vllm" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.symlink_to(sys.executable)
    monkeypatch.chdir(tmp_path)
    assert vllm_port.find_venv_python() == str(python)
    assert vllm_port.find_venv_python("no-such-venv/bin/python") is None


# ------------------------------------------------------------------ SamplingParams, field by field
def test_every_sampling_field_maps_to_vllm():
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    assert names == set(vllm_port.SAMPLING_FIELDS), "a SamplingParams field was added or removed: map it"
    p = SamplingParams(max_tokens=7, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, seed=3, n=2,
                       stop=["\n"], stop_token_ids=[2], ignore_eos=True, min_tokens=1, logprobs=3,
                       prompt_logprobs=1, presence_penalty=0.5, frequency_penalty=-0.5,
                       repetition_penalty=1.1, logit_bias={"7": 2.0})
    kw = vllm_port.sampling_kwargs(p)
    assert kw == {vllm_port.SAMPLING_FIELDS[name]: getattr(p, name) for name in names}
    assert kw["logit_bias"] == {7: 2.0} and kw["top_k"] == 5 and kw["stop"] == ["\n"]


def test_structured_outputs_go_as_vllms_fields():
    """vLLM's StructuredOutputsParams has labkit's field names: they go as a plain dict (JSON to
    the child), which builds vLLM's own object from it."""
    from labkit import StructuredOutputsParams
    so = StructuredOutputsParams(choice=["yes", "no"])
    kw = vllm_port.sampling_kwargs(SamplingParams(max_tokens=2, structured_outputs=so))
    assert kw["structured_outputs"] == {f.name: getattr(so, f.name) for f in dataclasses.fields(so)}
    assert kw["structured_outputs"]["choice"] == ["yes", "no"] and kw["structured_outputs"]["json"] is None
    json.dumps(kw)


def test_a_field_vllm_lacks_is_refused():
    @dataclasses.dataclass
    class Extended(SamplingParams):
        beam_magic: int = 0
    with pytest.raises(ValueError, match=r"\['beam_magic'\] have no counterpart"):
        vllm_port.sampling_kwargs(Extended(max_tokens=2))


# ------------------------------------------------------------------ a stand-in for vllm
FAKE_VLLM = '''
"""A stand-in for vllm's offline API: answers each request with a made-up output and records
how it was called (the engine's arguments, each SamplingParams' fields, the environment)."""
import json, os
__version__ = "0.0-fake"
_LOG = os.path.join(os.path.dirname(__file__), "calls.json")

class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw

class _Logprob:
    def __init__(self, logprob, rank):
        self.logprob, self.rank, self.decoded_token = logprob, rank, f"<{rank}>"

class _Completion:
    def __init__(self, index, ids, want_logprobs):
        self.index, self.token_ids, self.text = index, ids, " ".join(map(str, ids))
        self.finish_reason, self.cumulative_logprob = "length", -1.5
        self.logprobs = [{t: _Logprob(-0.5, 1)} for t in ids] if want_logprobs is not None else None

class _Out:
    def __init__(self, i, prompt, params):
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else [ord(c) for c in prompt]
        self.request_id, self.prompt, self.prompt_token_ids = str(i), None if isinstance(prompt, dict) else prompt, ids
        self.finished, self.num_cached_tokens, self.prompt_logprobs = True, 0, None
        self.outputs = [_Completion(k, [i, k] * params.kw["max_tokens"], params.kw["logprobs"])
                        for k in range(params.kw["n"])]

class LLM:
    def __init__(self, model, **kw):
        core = type("Core", (), {"shutdown": lambda _: self._record(shutdown=True)})()
        self.llm_engine = type("Engine", (), {"engine_core": core})()
        self.calls = {"model": model, "kw": kw, "cwd": os.getcwd(),
                      "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU")}}

    def _record(self, **more):
        self.calls.update(more)
        with open(_LOG, "w") as f:
            json.dump(self.calls, f)

    def generate(self, prompts, params, use_tqdm=True):
        self._record(params=[p.kw for p in params])
        if os.environ.get("FAKE_VLLM_FAIL"):
            raise RuntimeError("the fake engine was told to fail")
        return [_Out(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
'''

FAKE_CLI = '''
"""A stand-in for vllm's CLI: `vllm serve MODEL --port N ...` answers /health until killed,
after starting a worker that ignores SIGTERM (vLLM's workers must not outlive the server)."""
import http.server, json, os, subprocess, sys

def main():
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    worker = subprocess.Popen([sys.executable, "-c",
                               "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    with open(os.path.join(os.path.dirname(__file__), "serve.json"), "w") as f:
        json.dump({"argv": sys.argv, "pid": os.getpid(), "worker": worker.pid,
                   "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU")}}, f)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"path": self.path}).encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """A fake vllm package importable by this interpreter, configured as vLLM's interpreter."""
    pkg = tmp_path / "fake" / "vllm"
    (pkg / "entrypoints" / "cli").mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    (pkg / "entrypoints" / "__init__.py").write_text("")
    (pkg / "entrypoints" / "cli" / "__init__.py").write_text("")
    (pkg / "entrypoints" / "cli" / "main.py").write_text(textwrap.dedent(FAKE_CLI))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    monkeypatch.setenv(vllm_port.ENV_VAR, sys.executable)
    for key in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "FAKE_VLLM_FAIL"):
        monkeypatch.delenv(key, raising=False)
    model = tmp_path / "model"
    model.mkdir()
    return pkg, str(model)


def test_generate_sends_each_field_and_returns_labkit_records(fake_vllm):
    pkg, model = fake_vllm
    assert vllm_port.available() == (True, f"vLLM (version unknown) with {sys.executable}")
    params = [SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logit_bias={5: -1.0}),
              SamplingParams(max_tokens=1, temperature=0.8, seed=4, n=2, logprobs=1)]
    outs = vllm_port.generate(["Hi", [11, 12, 13]], params, model=model, dtype="bfloat16")
    calls = json.loads((pkg / "calls.json").read_text())
    assert calls["model"] == model and calls["shutdown"] is True
    assert calls["kw"] == {**vllm_port.ENGINE_DEFAULTS, "dtype": "bfloat16"}
    assert calls["params"][0] == {**vllm_port.sampling_kwargs(params[0]), "logit_bias": {"5": -1.0}}  # JSON's keys
    assert calls["params"][1] == json.loads(json.dumps(vllm_port.sampling_kwargs(params[1])))
    cpus = sorted(os.sched_getaffinity(0))
    assert calls["env"] == {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)), "VLLM_CPU_KVCACHE_SPACE": "1"}
    assert calls["cwd"] != os.getcwd()             # not the repository root, whose kernels/ would shadow
    first, second = outs
    assert first.prompt == "Hi" and first.prompt_token_ids == [ord("H"), ord("i")] and first.finished
    assert first.outputs[0].token_ids == [0, 0, 0, 0] and first.outputs[0].text == "0 0 0 0"
    assert first.outputs[0].finish_reason == "length" and first.outputs[0].logprobs is None
    assert second.prompt is None and second.prompt_token_ids == [11, 12, 13]
    assert [c.token_ids for c in second.outputs] == [[1, 0], [1, 1]]
    assert second.outputs[1].logprobs[0][1].logprob == -0.5 and second.outputs[1].logprobs[0][1].rank == 1


def test_generate_takes_prompts_and_params_as_labkit_does(fake_vllm):
    pkg, model = fake_vllm
    assert vllm_port.generate([], model=model) == []                                # nothing to run: no vLLM
    outs = vllm_port.generate([1, 2], SamplingParams(max_tokens=1), model=model)   # one prompt of token ids
    assert len(outs) == 1 and outs[0].prompt_token_ids == [1, 2]
    with pytest.raises(ValueError, match="2 prompts but 1 SamplingParams"):
        vllm_port.generate(["a", "b"], [SamplingParams()], model=model)
    with pytest.raises(ValueError, match="expected SamplingParams, got dict"):
        vllm_port.generate("a", [{"max_tokens": 2}], model=model)
    with pytest.raises(ValueError, match="a prompt must be a string or a list of token ids"):
        vllm_port.generate([["a"]], model=model)
    with pytest.raises(ValueError, match="tiny-llama"):
        vllm_port.generate("a", model="tiny-llama")


def test_a_failed_generate_reports_vllms_log(fake_vllm, monkeypatch):
    pkg, model = fake_vllm
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")
    with pytest.raises(RuntimeError, match=r"(?s)LLM.generate failed \(exit 1\).*the fake engine was told to fail"):
        vllm_port.generate("Hi", SamplingParams(max_tokens=1), model=model)
    assert json.loads((pkg / "calls.json").read_text())["shutdown"] is True


def test_serve_runs_the_cli_waits_for_health_and_takes_its_workers_down(fake_vllm):
    pkg, model = fake_vllm
    with vllm_port.serve(model, served_model_name="smollm2-135m", dtype="bfloat16") as base_url:
        assert base_url.startswith("http://127.0.0.1:") and base_url.endswith("/v1")
        with urllib.request.urlopen(base_url + "/models", timeout=10) as r:
            assert json.load(r) == {"path": "/v1/models"}
        seen = json.loads((pkg / "entrypoints" / "cli" / "serve.json").read_text())
    argv = seen["argv"]
    assert argv[:3] == ["vllm", "serve", model]
    assert "--enforce-eager" in argv                 # True: a bare flag
    rest = [a for a in argv[3:] if a != "--enforce-eager"]
    flags = dict(zip(rest[::2], rest[1::2]))
    assert flags["--served-model-name"] == "smollm2-135m" and flags["--dtype"] == "bfloat16"
    assert flags["--port"] == base_url.split(":")[2].split("/")[0] and flags["--host"] == "127.0.0.1"
    assert seen["env"]["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert gone(seen["pid"]) and gone(seen["worker"]), "the server or its SIGTERM-deaf worker outlived the block"


# ------------------------------------------------------------------ the server's process group, bare
FAKE_SERVER = '''
import http.server, json, subprocess, sys, time
port, mode, pidfile = int(sys.argv[1]), sys.argv[2], sys.argv[3]
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(pidfile, "w").write(json.dumps([worker.pid]))
if mode == "crash":
    print("fake server: cannot load the model", flush=True)
    sys.exit(3)
time.sleep(0.5)                                   # not listening at once

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if mode == "ok" else 503)
        self.end_headers()

    def log_message(self, *a):
        pass

print("fake server: listening", flush=True)
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


@pytest.fixture
def fake_server(tmp_path):
    script = tmp_path / "server.py"
    script.write_text(textwrap.dedent(FAKE_SERVER))
    pidfile = tmp_path / "pids.json"

    def command(mode):
        port = vllm_port.free_port()
        return [sys.executable, str(script), str(port), mode, str(pidfile)], port
    return command, pidfile


def test_server_process_yields_once_healthy_and_cleans_up_on_error(fake_server):
    command, pidfile = fake_server
    cmd, port = command("ok")
    with pytest.raises(KeyError, match="the user's code failed"):
        with vllm_port.server_process(cmd, port, timeout_s=30) as base_url:
            assert base_url == f"http://127.0.0.1:{port}/v1"
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
                assert r.status == 200
            raise KeyError("the user's code failed")
    assert gone(json.loads(pidfile.read_text())[0]), "the server's child outlived the block"
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)


def test_a_server_that_exits_is_reported_with_its_log(fake_server):
    command, pidfile = fake_server
    cmd, port = command("crash")
    with pytest.raises(RuntimeError, match=r"(?s)exited with status 3 before it was ready.*cannot load the model"):
        with vllm_port.server_process(cmd, port, name="fake server", timeout_s=30):
            pytest.fail("the block ran although the server never came up")
    assert gone(json.loads(pidfile.read_text())[0])


def test_a_server_never_healthy_times_out_with_its_log(fake_server):
    command, pidfile = fake_server
    cmd, port = command("unhealthy")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)was not ready at .*/health within 3 s.*fake server: listening"):
        with vllm_port.server_process(cmd, port, name="fake server", timeout_s=3):
            pytest.fail("the block ran although the server never became healthy")
    assert time.monotonic() - t0 < 20
    assert gone(json.loads(pidfile.read_text())[0])


# ------------------------------------------------------------------ the real vLLM (not in CI)
@pytest.mark.skipif(not HAS_VLLM, reason=f"vLLM not available: {WHY_NOT}")
def test_real_vllm_gives_labkits_greedy_tokens_offline_and_served():
    """Greedy fp32: vLLM's LLM.generate and `vllm serve` (through the OpenAI client) give the
    tokens labkit gives, for the same prompts and SamplingParams."""
    import openai
    from labkit import LLM
    prompts = ["The three states of a KV block are", "Paging splits memory into"]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in LLM(num_blocks=64).generate(prompts, greedy, use_tqdm=False)]
    theirs = vllm_port.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in theirs] == ours
    with vllm_port.serve("smollm2-135m") as base_url:
        client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=300)
        served = [client.completions.create(model="smollm2-135m", prompt=p, max_tokens=12, temperature=0,
                                            extra_body={"ignore_eos": True, "return_token_ids": True}
                                            ).choices[0].token_ids for p in prompts]
    assert served == ours
