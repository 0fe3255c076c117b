"""Linear layers on panels (kernels/linear_cpu.py, csrc/linear.cpp): packing, the checks the
C++ entry point makes, which layout the CPU backend chooses, and a model on panels against
the same model on oneDNN's packed weights. The loop's arithmetic on every ISA build is in
test_cpu_vec.py."""

import pytest
import torch
import torch.nn.functional as F

from labkit.kernels import cpu_extension
from labkit.kernels.linear_cpu import linear_panels, linear_panels_ref, pack_panels, unpack_panels
from labkit.model.llama import linear_layout

EXT = cpu_extension.load()
needs_ext = pytest.mark.skipif(EXT is None, reason=cpu_extension.status()[1])
CPU = torch.device("cpu")


def test_panels_hold_sixteen_output_columns_side_by_side():
    w = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    p = pack_panels(w)
    assert p.shape == (2, 3, 16) and p.is_contiguous()
    assert torch.equal(p[0, 1], w[:16, 1]) and torch.equal(p[1, 2, :4], w[16:, 2])
    assert not p[1, :, 4:].any()                          # the last panel's padding is zero
    assert torch.equal(unpack_panels(p, 20), w)


def test_packing_refuses_what_the_loop_cannot_multiply():
    with pytest.raises(ValueError, match="fp32"):
        pack_panels(torch.ones(16, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out_features, in_features"):
        pack_panels(torch.ones(16))


@needs_ext
def test_the_reference_and_the_loop_agree():
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(40, 24, generator=g), torch.randn(40, generator=g), torch.randn(3, 5, 24, generator=g)
    p = pack_panels(w)
    out = linear_panels(EXT, x, p, 40, b)                 # leading dimensions kept
    assert out.shape == (3, 5, 40)
    torch.testing.assert_close(out, linear_panels_ref(x, p, 40, b))
    torch.testing.assert_close(out, F.linear(x, w, b))


@needs_ext
@pytest.mark.parametrize("bad,match", [
    (lambda x, p, b: (x.double(), p, 40, b), "x must be contiguous fp32"),
    (lambda x, p, b: (x.t(), p, 40, b), "x must be contiguous fp32"),
    (lambda x, p, b: (x[:, :20].contiguous(), p, 40, b), "x has 20 columns but the weight.s panels have 24 rows"),
    (lambda x, p, b: (x, p, 50, b), "out_features 50"),
    (lambda x, p, b: (x, p, 0, b), "out_features 0"),
    (lambda x, p, b: (x, p.transpose(1, 2), 40, b), "panels must be"),
    (lambda x, p, b: (x, p, 40, b[:39]), "bias must be"),
])
def test_the_loop_refuses_inputs_it_would_misread(bad, match):
    x, p, b = torch.randn(24, 24), pack_panels(torch.randn(40, 24)), torch.randn(40)
    with pytest.raises(RuntimeError, match=match):
        EXT.linear_panels(*bad(x, p, b))


def test_the_layout_follows_dtype_and_the_setting(monkeypatch):
    monkeypatch.delenv("LABKIT_CPU_LINEAR", raising=False)
    layout, ext = linear_layout(CPU, torch.float32)
    simd = EXT is not None and EXT.isa() != "portable"
    assert layout == ("panels" if simd else "onednn" if torch.backends.mkldnn.is_available() else None)
    assert (ext is not None) == (layout == "panels")
    assert linear_layout(CPU, torch.bfloat16)[0] != "panels"      # bf16 stays on oneDNN (or plain)
    assert linear_layout(CPU, torch.float16)[0] is None
    monkeypatch.setenv("LABKIT_CPU_LINEAR", "onednn")
    assert linear_layout(CPU, torch.float32) == ("onednn", None)
    monkeypatch.setenv("LABKIT_CPU_LINEAR", "fast")
    with pytest.raises(ValueError, match="LABKIT_CPU_LINEAR='fast' is not one of auto, onednn, panels"):
        linear_layout(CPU, torch.float32)
    monkeypatch.setenv("LABKIT_CPU_LINEAR", "panels")
    with pytest.raises(ValueError, match="bfloat16"):
        linear_layout(CPU, torch.bfloat16)


@needs_ext
@pytest.mark.slow
def test_smollm2_on_panels_gives_the_tokens_of_onednn(monkeypatch):
    """The default model's greedy tokens on panels and on oneDNN's packed weights: the two
    multiplies round differently, the tokens are the same (and every block comes back)."""
    from labkit import LLM, SamplingParams
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    outs = {}
    for layout in ("panels", "onednn"):
        monkeypatch.setenv("LABKIT_CPU_LINEAR", layout)
        llm = LLM("smollm2-135m", num_blocks=64)
        assert llm.runner.linear_layout == layout
        outs[layout] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert llm.allocator.num_free_blocks == llm.allocator.num_blocks == 64
    assert outs["panels"] == outs["onednn"]


@needs_ext
def test_the_matmul_benchmark_times_every_method_on_the_models_shapes(capsys):
    from labkit.bench.matmul import main, model_shapes, run, table
    from labkit.model.loader import tiny_config
    shapes = model_shapes("tiny-llama")
    c = tiny_config()
    assert len(shapes) == 4 * c.num_hidden_layers + 1 and shapes[-1] == (c.vocab_size, c.hidden_size)
    result = run("tiny-llama", [1, 9], ["panels", "onednn", "mkl"], None, 1)
    assert set(result["rows"]) == {1, 9}
    for row in result["rows"].values():
        assert set(row) == {f"panels-{EXT.isa()}", "onednn", "mkl"}
        assert all(r["ms"] > 0 and r["gb_per_s"] > 0 and r["gflop_per_s"] > 0 for r in row.values())
    text = table(result)
    assert text.count("\n| ") == 3 and "panels-" in text and "GB/s" in text
    assert main(["--model", "tiny-llama", "--rows", "2", "--repeats", "1", "--methods", "panels"]) == 0
    assert f"panels-{EXT.isa()} ms" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="rows must be >= 1"):
        run("tiny-llama", [0], ["mkl"], None, 1)


@needs_ext
def test_a_layer_on_panels_takes_leading_dimensions(monkeypatch):
    """The model passes [tokens, features]; a notebook may pass a batch dimension too."""
    from labkit.model.llama import Linear
    g = torch.Generator().manual_seed(1)
    w, b, x = torch.randn(40, 24, generator=g), torch.randn(40, generator=g), torch.randn(2, 3, 24, generator=g)
    layer = Linear(w, b)
    layer.pack_panels(EXT)
    torch.testing.assert_close(layer(x), F.linear(x, w, b))
    torch.testing.assert_close(layer(x[0]), F.linear(x[0], w, b))


@needs_ext
@pytest.mark.slow
def test_a_sequences_logits_do_not_depend_on_its_batch(monkeypatch):
    """On panels the whole forward pass is batch-invariant on the CPU backend: the matmul sums
    in one order whatever the rows, and attention and the element-wise ops work row by row. A
    sequence's logits are the same bits decoded alone and beside seven others, and its
    prompt's alone and packed with other prompts. (SmolLM2, not tiny-llama: at tiny-llama's
    sizes oneDNN is batch-invariant too, at SmolLM2's its decode logits differ by ~4e-5.)"""
    from labkit.model import load_model
    from labkit.model.runner import ModelRunner, SeqChunk
    monkeypatch.setenv("LABKIT_CPU_LINEAR", "panels")
    runner = ModelRunner(load_model("smollm2-135m"), block_size=16, num_blocks=96, attention_backend="cpu")
    assert runner.linear_layout == "panels"
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, runner.vocab_size, (n,), generator=g).tolist() for n in (13, 7, 21, 5, 9, 16, 40, 3)]
    blocks = [list(range(10 * i, 10 * i + 10)) for i in range(len(prompts))]
    alone = runner.execute([SeqChunk(prompts[0], 0, blocks[0])])
    packed = runner.execute([SeqChunk(p, 0, b) for p, b in zip(prompts, blocks)])
    assert torch.equal(alone[0], packed[0])
    step = [SeqChunk([7 + i], len(p), b) for i, (p, b) in enumerate(zip(prompts, blocks))]
    together = runner.execute(step)
    assert torch.equal(runner.execute(step[:1])[0], together[0])      # the same token, the same slot
