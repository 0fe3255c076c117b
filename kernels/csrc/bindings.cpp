// The Python module of labkit's C++ CPU kernels (built by kernels/cpu_extension.py).
#include <torch/extension.h>

bool supports(int64_t head_dim, int64_t group, int64_t block_size);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  const c10::optional<at::Tensor>& k_scales,
                                  const c10::optional<at::Tensor>& v_scales);
bool vectorized(int64_t head_dim, int64_t group);
std::string isa();
at::Tensor paged_prefill_attention_rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                        const at::Tensor& block_tables, const at::Tensor& row_lens,
                                        const at::Tensor& row_seq, double scale,
                                        const c10::optional<at::Tensor>& k_scales,
                                        const c10::optional<at::Tensor>& v_scales);
at::Tensor paged_prefill_attention_tiles(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                         const at::Tensor& block_tables, const at::Tensor& context_lens,
                                         const at::Tensor& query_start_loc, double scale,
                                         const c10::optional<at::Tensor>& k_scales,
                                         const c10::optional<at::Tensor>& v_scales, bool amx);
bool amx_tiles();

at::Tensor rope_and_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
                          int64_t num_heads);
at::Tensor add_rms_norm(at::Tensor x, const c10::optional<at::Tensor>& delta, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor vec_exp(const at::Tensor& x);
at::Tensor linear_panels(const at::Tensor& x, const at::Tensor& panels, int64_t out_features,
                         const c10::optional<at::Tensor>& bias);
at::Tensor linear_panels_silu_mul(const at::Tensor& x, const at::Tensor& panels, int64_t out_features,
                                  const c10::optional<at::Tensor>& bias);

// The matmul and the attention loops run without the GIL, as torch's own ops (oneDNN's linear
// included) do: in `labkit serve` the engine steps on a thread of its own, and the event loop
// serves HTTP meanwhile. They touch no Python object; pybind11 converts the arguments before
// and the result after. The fused element-wise ops (microseconds each) keep it: releasing and
// taking it back costs about what they do, and every release is a chance for another thread
// to hold the engine's thread up.
using release_gil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "labkit's C++ CPU kernels";
  m.def("supports", &supports, "whether paged_decode_attention has a kernel for (head_dim, group, block_size)");
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over the paged KV cache, read in place (fp32, bf16, or int8 / fp8 with their scales; "
        "fp32 q and out)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("scale"), py::arg("k_scales") = py::none(), py::arg("v_scales") = py::none(), release_gil());
  m.def("vectorized", &vectorized,
        "whether (head_dim, group) runs vectorized on this build: SIMD registers and a compiled group");
  m.def("isa", &isa, "the instruction set this build's vectors use: avx512, avx2 or portable (vec.h)");
  m.def("paged_prefill_attention_rows", &paged_prefill_attention_rows,
        "prefill as query rows: row r attends to the first row_lens[r] tokens of sequence row_seq[r]",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("row_lens"),
        py::arg("row_seq"), py::arg("scale"), py::arg("k_scales") = py::none(), py::arg("v_scales") = py::none(),
        release_gil());
  m.def("paged_prefill_attention_tiles", &paged_prefill_attention_tiles,
        "prefill chunks in tiles of rows (prefill_attention.cpp): sequence i's rows "
        "query_start_loc[i]:query_start_loc[i + 1], causally over its cache; a bf16 cache on AMX where "
        "amx and amx_tiles()",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("query_start_loc"), py::arg("scale"), py::arg("k_scales") = py::none(),
        py::arg("v_scales") = py::none(), py::arg("amx") = true, release_gil());
  m.def("amx_tiles", &amx_tiles,
        "whether paged_prefill_attention_tiles runs a bf16 cache's tiles on AMX here (build and CPU)");
  m.def("rope_and_cache", &rope_and_cache,
        "rotary embedding of q and k, and k, v written into the cache at their slots; returns q");
  m.def("add_rms_norm", &add_rms_norm, "x += delta (in place, if given), then rms_norm(x) * weight");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up for x = [gate | up]");
  m.def("linear_panels", &linear_panels,
        "y = x W^T + b for fp32 x [M, K] and W packed in panels [ceil(N / 16), K, 16] (kernels/linear_cpu.py)",
        py::arg("x"), py::arg("panels"), py::arg("out_features"), py::arg("bias") = py::none(), release_gil());
  m.def("linear_panels_silu_mul", &linear_panels_silu_mul,
        "silu(x Wg^T + bg) * (x Wu^T + bu) for W = [gate | up] packed in panels (out_features = 2 * inter, "
        "inter a multiple of 16): SwiGLU's gate/up projection and activation in one pass",
        py::arg("x"), py::arg("panels"), py::arg("out_features"), py::arg("bias") = py::none(), release_gil());
  m.def("vec_exp", &vec_exp, "exp of an fp32 tensor by the kernels' vector exp (for testing its accuracy)");
}
