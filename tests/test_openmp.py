"""labkit/openmp.py: ``import labkit`` shortens OpenMP's spin-wait (a busy machine's
collapse, docs/benchmarks.md "--contend") only when it still can and the user has not chosen;
bench serve runs the peers with their own settings."""

import os
import subprocess
import sys

import pytest

from labkit.openmp import DEFAULT_SPIN_COUNT, configure_openmp_wait


def test_sets_the_spin_count_before_torch_loads_and_only_then():
    assert configure_openmp_wait({}, {}) == DEFAULT_SPIN_COUNT
    env = {}
    configure_openmp_wait(env, {})
    assert env == {"GOMP_SPINCOUNT": DEFAULT_SPIN_COUNT}
    assert configure_openmp_wait({}, {"torch": object()}) is None       # too late: the runtime has read it


@pytest.mark.parametrize("user", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "PASSIVE"},
                                  {"GOMP_SPINCOUNT": "50000"}, {"LABKIT_GOMP_SPINCOUNT": "default"},
                                  {"LABKIT_GOMP_SPINCOUNT": ""}])
def test_a_users_choice_is_left_alone(user):
    env = dict(user)
    assert configure_openmp_wait(env, {}) is None and env == user


def test_another_count_can_be_asked_for_and_nonsense_is_named():
    env = {"LABKIT_GOMP_SPINCOUNT": "200"}
    assert configure_openmp_wait(env, {}) == "200" and env["GOMP_SPINCOUNT"] == "200"
    with pytest.raises(ValueError, match="LABKIT_GOMP_SPINCOUNT.*'fast'"):
        configure_openmp_wait({"LABKIT_GOMP_SPINCOUNT": "fast"}, {})


def _spin_count_seen(code: str, **extra) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY",
                                                             "LABKIT_GOMP_SPINCOUNT")}
    env.update(extra)
    out = subprocess.run([sys.executable, "-c", code + "; import os; print(os.environ.get('GOMP_SPINCOUNT'))"],
                         env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()[-1]


def test_import_labkit_first_sets_it_in_a_fresh_process():
    assert _spin_count_seen("import labkit") == DEFAULT_SPIN_COUNT
    assert _spin_count_seen("import torch, labkit") == "None"          # torch first: nothing changes
    assert _spin_count_seen("import labkit", OMP_WAIT_POLICY="PASSIVE") == "None"


def test_bench_serve_runs_the_peers_with_their_own_openmp_settings(monkeypatch):
    from labkit import openmp
    from labkit.bench.serve import child_env
    monkeypatch.setattr(openmp, "set_by_labkit", DEFAULT_SPIN_COUNT)
    monkeypatch.setenv("GOMP_SPINCOUNT", DEFAULT_SPIN_COUNT)
    assert child_env("labkit")["GOMP_SPINCOUNT"] == DEFAULT_SPIN_COUNT
    for peer in ("hf-static", "hf-cb", "vllm"):
        env = child_env(peer)
        assert "GOMP_SPINCOUNT" not in env and env["LABKIT_GOMP_SPINCOUNT"] == "default"
    monkeypatch.setenv("GOMP_SPINCOUNT", "77")                  # the user's own value goes to everyone
    assert child_env("hf-static")["GOMP_SPINCOUNT"] == "77"
