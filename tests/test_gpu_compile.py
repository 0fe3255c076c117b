"""The GPU path, proven without a GPU: ``python -m labkit.bench gpu-compile`` compiles every
Triton kernel the engine launches for the GPUs students get (sm_75: Colab's T4, sm_80: A100,
sm_89: L4, sm_90: H100) and checks each build against the GPU's limits.

CI compiles the ``--quick`` subset: every kernel, every target and every dtype it runs
(fp16 and fp32 everywhere, bf16 from sm_80) on the default model's shape (SmolLM2: 3 KV
heads, group 3, head dim 64, blocks of 16; the grid's head dim 64 stands in when the model is
not cached), with the quantized KV caches (kv_cache_dtype int8 everywhere, fp8 from sm_89);
and on the T4 (sm_75: the least shared memory, where the largest tiles bind first) and the
H100 (sm_90: the newest code generation), two grid shapes that with the first cover head dims
64/96/128, GQA groups 1/3/8 and block sizes 8/16/32: head dim 128 x group 8 x blocks of 32
(the largest tiles), head dim 96 (padded to 128) x group 1 x blocks of 8 (two blocks per key
tile). About 190 builds, ~1 s of CPU each. The full matrix (all 96 grid shapes, block size 64
too) is the CLI's default and docs/gpu.md's figures.

The compile runs in worker processes with TRITON_INTERPRET=0: this process defined its
kernels under the interpreter (conftest), and those cannot be compiled.
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest

from labkit.bench import gpu_compile as G
from run_once import computed_once

KERNELS = {"reshape_and_cache", "paged_decode", "paged_decode_split", "paged_decode_reduce", "paged_prefill"}


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """The CI subset, compiled once for the run (however many xdist workers ask): (exit status, report)."""
    def compile_quick():
        out = tmp_path_factory.mktemp("gpu-compile") / "report.json"
        status = G.main(["--quick", "--jobs", str(min(4, os.cpu_count() or 1)), "--out", str(out)])
        return [status, json.loads(out.read_text())]
    return tuple(computed_once(tmp_path_factory, "gpu-compile-quick", compile_quick))


@pytest.mark.slow
def test_every_kernel_compiles_and_fits_every_gpu(quick):
    status, report = quick
    assert status == 0, "\n".join(report["failures"])
    rows = report["builds"]
    shapes = report["meta"]["shapes"]
    assert len(shapes) == 3
    for target in G.TARGETS.values():
        for dtype in target.dtypes:
            for shape in shapes:
                where = (target.name, dtype, shape)
                built = {r["kernel"] for r in rows if (r["target"], r["dtype"], r["shape"]) == where}
                everywhere = shape == shapes[0] or target.name in G.QUICK_GRID_TARGETS
                assert built == (KERNELS if everywhere else set()), (target.name, dtype, shape)
    assert not any(r["target"] == "sm_75" and r["dtype"] == "bf16" for r in rows)   # the T4 has no bf16
    # The quantized caches: every kernel that reads or writes the cache, on the first shape, where
    # the GPU runs them (int8 everywhere; fp8 e4m3 needs sm_89's conversions: the L4, the H100).
    assert {t.name for t in G.TARGETS.values() if "fp8" in t.kv_dtypes} == {"sm_89", "sm_90"}
    for target in G.TARGETS.values():
        for dtype in target.dtypes:
            for kv in ("int8", "fp8"):
                built = {r["kernel"] for r in rows if (r["target"], r["dtype"], r["kv_dtype"], r["shape"])
                         == (target.name, dtype, kv, shapes[0])}
                assert built == (KERNELS if kv in target.kv_dtypes else set()), (target.name, dtype, kv)
    assert {r["kv_dtype"] for r in rows if r["shape"] != shapes[0]} == {"auto"}
    for r in rows:
        limit = G.TARGETS[r["target"]].max_shared
        assert r["status"] in ("ok", "spills") and r["problems"] == []
        assert 0 <= r["shared"] + r["static_shared"] <= limit == r["shared_limit"]
        assert 0 < r["registers"] <= 255 and 0 < r["occupancy"] <= 1
    # The decode kernels hold a [16, d] query tile and read K/V tiles through shared memory:
    # a build that reports none was not what the engine launches.
    assert all(r["shared"] > 0 for r in rows if r["kernel"] in ("paged_decode", "paged_prefill"))


@pytest.mark.slow
def test_the_compile_cache_stays_out_of_the_repository(quick):
    _, report = quick
    cache = report["meta"]["cache_dir"]
    assert os.path.commonpath([cache, tempfile.gettempdir()]) == tempfile.gettempdir()
    assert not os.path.exists(cache)


@pytest.mark.slow
def test_every_triton_kernel_of_the_package_is_in_the_check(quick):
    """A new @triton.jit kernel that the compile check does not launch fails here."""
    import sys

    import labkit.kernels  # noqa: F401  (defines the kernel modules)
    defined = set()
    for name in ("paged_decode_attention", "paged_prefill_attention", "reshape_and_cache"):
        module = sys.modules[f"labkit.kernels.{name}"]
        defined |= {k.strip("_").removesuffix("_kernel") for k, v in vars(module).items()
                    if k.endswith("_kernel") and hasattr(v, "fn")}
    assert defined == KERNELS == {r["kernel"] for r in quick[1]["builds"]}


def _row(**overrides) -> dict:
    row = dict(kernel="paged_decode", target="sm_75", gpu="T4", dtype="fp16", shape="grid d64 g3 kv3 bs16",
               num_warps=4, shared=24576, static_shared=0, registers=128, spill_stores=0, spill_loads=0, stack=0,
               build="abc")
    return {**row, **overrides}


def test_a_build_past_a_gpus_limits_fails_the_check():
    assert G.judge(_row())["status"] == "ok"
    t4_too_big = G.judge(_row(shared=65 << 10))
    assert t4_too_big["status"] == "no launch"
    assert t4_too_big["problems"] == ["shared memory 66560 B per block > 65536 B on T4"]
    assert G.judge(_row(shared=65 << 10, target="sm_80"))["status"] == "ok"       # an A100 block has 163 KiB
    assert "registers per thread" in G.judge(_row(registers=256))["problems"][0]
    assert "1056 threads per block > 1024" in G.judge(_row(num_warps=33))["problems"][0]
    assert G.judge(_row(spill_stores=64))["status"] == "spills"                   # slower, still launches
    broken = G.judge(_row(error="CompilationError: at 12:4: ..."))
    assert broken["status"] == "compile error"
    assert G.failures([G.judge(_row()), t4_too_big, broken]) == [
        "paged_decode sm_75 fp16 grid d64 g3 kv3 bs16: shared memory 66560 B per block > 65536 B on T4",
        "paged_decode sm_75 fp16 grid d64 g3 kv3 bs16: CompilationError: at 12:4: ..."]


def test_occupancy_follows_the_cuda_rules():
    # 128 registers x 128 threads = 16K of the T4's 64K registers: 4 blocks, 16 of 32 warps;
    # 24 KiB of shared memory per block allows only 2 (64 KiB per multiprocessor): 8 warps.
    assert G.occupancy(_row(shared=0), G.TARGETS["sm_75"]) == 0.5
    assert G.occupancy(_row(), G.TARGETS["sm_75"]) == 0.25
    # an A100 block also reserves 1 KiB: 164 KiB / 25 KiB = 6 blocks by memory, 4 by registers
    assert G.occupancy(_row(target="sm_80"), G.TARGETS["sm_80"]) == 16 / 64


def test_ptxas_report_is_read():
    log = ("ptxas info    : Compiling entry function '_paged_decode_kernel' for 'sm_75'\n"
           "ptxas info    : Function properties for _paged_decode_kernel\n"
           "    8 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n"
           "ptxas info    : Used 212 registers, used 1 barriers, 456 bytes cmem[0]\n")
    assert G.parse_ptxas(log) == dict(registers=212, stack=8, spill_stores=8, spill_loads=12, static_shared=0)
    with pytest.raises(RuntimeError, match="no register count"):
        G.parse_ptxas("")


def test_a_shape_the_launchers_refuse_is_a_failed_build_not_a_crash(tmp_path, capsys):
    out = tmp_path / "r.json"
    status = G.main(["--no-model", "--head-dims", "512", "--groups", "1", "--block-sizes", "16",
                     "--targets", "sm_80", "--dtypes", "fp16", "--kv-dtypes", "auto", "--jobs", "1", "--out", str(out)])
    assert status == 1
    report = json.loads(out.read_text())
    assert [r["kernel"] for r in report["builds"]] == ["(plan)"]
    assert "head_dim 512 > 256 is not supported" in report["failures"][0]
    assert "FAILED (plan) sm_80 fp16 grid d512 g1 kv8 bs16" in capsys.readouterr().out


def test_bad_options_are_refused(capsys):
    assert G.main(["--targets", "sm_70"]) == 2
    assert "unknown target or dtype ['sm_70']" in capsys.readouterr().err
    assert G.main(["--kv-dtypes", "fp4"]) == 2
    assert "unknown target or dtype ['fp4']" in capsys.readouterr().err
    assert G.main(["--targets", "sm_75", "--dtypes", "bf16"]) == 2          # the T4 runs no bf16
    assert "nothing to compile" in capsys.readouterr().err


def test_model_shapes_come_from_their_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_attention_heads": 14, "num_key_value_heads": 2, "hidden_size": 896}))
    assert G.model_shape(str(tmp_path)) == (2, 7, 64)          # Qwen2.5-0.5B: group 7, head dim 64
    assert "no config" in G.model_shape(str(tmp_path / "missing"))
    shapes, notes = G.matrix_shapes([str(tmp_path)], [64], [1], [8, 16], quick=False)
    assert [s.label for s in shapes[:2]] == [f"{tmp_path.name} d64 g7 kv2 bs8", f"{tmp_path.name} d64 g7 kv2 bs16"]
    assert notes == []


def test_the_quantized_caches_compile_with_the_model_dtypes_they_run_beside():
    """Units keep every KV cache dtype of one (target, dtype, head dim) together: the split
    decode's reduce reads no cache, so its build is the same for all of them, and one worker
    compiles it once (ptxas reports only a build it compiled)."""
    shapes = [G.Shape("m", 3, 3, 64, 16), G.Shape("grid", 8, 8, 128, 32)]
    units = G.plan_units(shapes, ["sm_75", "sm_90"], ["fp16"], G.KV_DTYPES, shapes[:1])
    assert [(u["target"], u["kv_dtypes"]) for u in units] == [
        ("sm_75", {"m d64 g3 kv3 bs16": ["auto", "int8"]}), ("sm_75", {"grid d128 g8 kv8 bs32": ["auto"]}),
        ("sm_90", {"m d64 g3 kv3 bs16": ["auto", "int8", "fp8"]}), ("sm_90", {"grid d128 g8 kv8 bs32": ["auto"]})]
