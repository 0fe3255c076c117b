// Linear layers on a CPU, in C++: y = x W^T + b, W packed in panels of 16 output columns.
//
// Why a matrix multiply of our own, when oneDNN and MKL exist: decoding multiplies a few rows
// (one per sequence: 1 to 16 at a class's batch sizes) by every weight matrix of the model, so
// a decode step reads all the weights (540 MB for SmolLM2-135M in fp32) to do 2 multiply-adds
// per weight and row. That is bound by memory bandwidth, and the libraries, tuned for large
// matrices, stream the weights well below it: oneDNN's packed fp32 linear reached 15-19 GB/s
// here at 1-8 rows, against 25 GB/s for a plain sum over the same bytes (2-core Zen 4).
//
// The layout (kernels/linear_cpu.py packs it once, at load): W [N, K] becomes
// panels [ceil(N / 16), K, 16]: panel p holds output columns 16p .. 16p + 15, and for each k
// their 16 weights side by side, one Vec16, one 64-byte cache line. Reading a panel is one
// contiguous stream, which the hardware prefetcher follows; the last panel is padded with
// zero columns.
//
// The loop: a tile of R rows of x by P panels keeps R x P accumulators in vector registers.
// For each k it loads the P weight vectors once and, for each row, broadcasts x[r, k] and
// multiply-adds it into that row's P accumulators. One weight load serves R rows, one
// broadcast serves P panels. AVX-512 has 32 registers: 8 rows x 3 panels = 24 accumulators,
// 3 weight vectors and a broadcast: 24 multiply-adds for 11 loads, which an Intel Xeon's two
// FMA units want (8 x 2, 16 for 10, took 4-23% longer at 64-1,024 rows there in four of five
// comparisons alternated in one process, 4% less in the fifth); AVX2's Vec16 is two of its 16
// registers: 6 rows x 1 panel = 12 of them.
//
// Work is split over threads by panels, on torch's own thread pool (the one its other ops use),
// each thread taking the next group of panels when it is free (parallel.h). For a decode step's
// few rows a thread so streams the weights of its panels once. A long x (a prefill's hundreds
// of rows) is cut into row blocks of at most kBlockBytes, and every panel group passes over one
// block before the next block starts: the block stays in the thread's L2 cache while the
// panels stream through. (Without blocks, a 1024-row x of 2.4 MB does not fit in a 2 MB L2 and
// is read again from L3 by every panel group: the model's 1,024-row matmuls took 0-15% longer,
// alternated runs on an Intel Xeon.) Where a
// matrix has too few panels to keep every thread busy (a many-core machine, a narrow layer)
// and x has rows to spare, the rows are split into more blocks, so that there are enough
// units of work (a block of a panel group each).
//
// Batch invariance: every output y[r, n] is sum_k x[r, k] W[n, k] added in the order
// k = 0, 1, ..., K - 1 in one accumulator, then the bias: the same bits whatever the number
// of rows, whichever tile a row falls in. So a sequence's logits do not depend on how many
// other sequences share its step (oneDNN's and MKL's do: they choose their blocking, and so
// their order of summation, by the matrix sizes).

// ATen's own headers, not <torch/extension.h> (see paged_decode_attention.cpp).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "parallel.h"
#include "vec.h"

namespace {

using vec::Vec16;

#if defined(LABKIT_VEC_AVX512)
constexpr int kRows = 8, kPanels = 3;  // 24 accumulators + 3 weight vectors + 1 broadcast of 32 registers
#elif defined(LABKIT_VEC_AVX2)
constexpr int kRows = 6, kPanels = 1;  // 12 + 2 + 1 of the 16 ymm registers (a Vec16 is two)
#else
constexpr int kRows = 4, kPanels = 1;  // plain arrays: the compiler keeps what it can
#endif
constexpr int kPanel = Vec16::size;  // output columns per panel
constexpr int kAhead = 64;           // prefetch this many weight rows (cache lines) ahead: 4 KB
// The most bytes of x one row block holds: a quarter of a 1 MB L2 (Zen 4; 512 KB on Zen 3,
// 2 MB on Intel Sapphire Rapids), leaving the rest to the panels streaming through. Measured on
// a 2-core Xeon: 256 KB and 512 KB within 2%, 64 KB 11% slower (more passes over the weights).
constexpr int64_t kBlockBytes = 256 << 10;

// R rows of x (row stride ldx) times P panels (panel stride K * 16) into y (row stride ldy).
// cols: how many of the tile's P * 16 columns are real (the last panel may be padding).
template <int R, int P>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t K, const float* bias, float* y,
                 int64_t ldy, int cols) {
  Vec16 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = Vec16::zero();
  const int64_t panel_stride = K * kPanel;
  for (int64_t k = 0; k < K; ++k) {
    Vec16 wk[P];
    for (int p = 0; p < P; ++p) {
      const float* row = w + p * panel_stride + k * kPanel;
      if (k + kAhead < K) __builtin_prefetch(row + kAhead * kPanel, 0, 3);  // within the panel only
      wk[p] = Vec16::load(row);
    }
    for (int r = 0; r < R; ++r) {
      const Vec16 xr = Vec16::all(x[r * ldx + k]);
      for (int p = 0; p < P; ++p) acc[r][p] = vec::fma(xr, wk[p], acc[r][p]);
    }
  }
  for (int p = 0; p < P; ++p) {
    const int n = std::min(kPanel, cols - p * kPanel);
    if (n <= 0) break;
    const Vec16 b = bias != nullptr ? vec::load(bias + p * kPanel, n) : Vec16::zero();
    for (int r = 0; r < R; ++r) vec::store(acc[r][p] + b, y + r * ldy + p * kPanel, n);
  }
}

// All rows of x over P panels starting at w: full tiles of kRows, then one tile of the rest.
template <int P>
void rows_over_panels(const float* x, int64_t M, int64_t K, const float* w, const float* bias, float* y,
                      int64_t N, int cols) {
  int64_t r = 0;
  for (; r + kRows <= M; r += kRows) tile<kRows, P>(x + r * K, K, w, K, bias, y + r * N, N, cols);
  const float* xr = x + r * K;
  float* yr = y + r * N;
  switch (M - r) {  // the remainder: each count its own unrolled tile
    case 0: break;
    case 1: tile<1, P>(xr, K, w, K, bias, yr, N, cols); break;
    case 2: tile<2, P>(xr, K, w, K, bias, yr, N, cols); break;
    case 3: tile<3, P>(xr, K, w, K, bias, yr, N, cols); break;
    case 4: tile<4, P>(xr, K, w, K, bias, yr, N, cols); break;
    case 5: tile<5, P>(xr, K, w, K, bias, yr, N, cols); break;
    case 6: tile<6, P>(xr, K, w, K, bias, yr, N, cols); break;
    default: tile<7, P>(xr, K, w, K, bias, yr, N, cols); break;  // (kRows = 8 only)
  }
}

// Panels [first, first + count) of one unit (count <= kPanels: the last group may be short).
inline void rows_over_group(const float* x, int64_t M, int64_t K, const float* w, int64_t count, const float* bias,
                            float* y, int64_t ldy, int cols) {
  switch (count) {
    case 1: rows_over_panels<1>(x, M, K, w, bias, y, ldy, cols); break;
    case 2: rows_over_panels<std::min(2, kPanels)>(x, M, K, w, bias, y, ldy, cols); break;
    default: rows_over_panels<kPanels>(x, M, K, w, bias, y, ldy, cols); break;
  }
}

// How x [M, K] times `panels` panels is cut into units of work: groups of kPanels panels, and
// rows in blocks (whole tiles each), as many as the larger of two needs ask: a block of x within
// kBlockBytes, and, where the panel groups alone leave threads idle, at least 4 units per
// thread. Every output is still summed in one order, in one accumulator.
struct Plan {
  int64_t groups, row_blocks, block_rows;
};

Plan plan(int64_t M, int64_t K, int64_t panels) {
  const int64_t groups = (panels + kPanels - 1) / kPanels;
  const int64_t tiles = (M + kRows - 1) / kRows;
  const int64_t want = 4 * int64_t(at::get_num_threads());
  const int64_t tiles_in_l2 = std::max<int64_t>(1, kBlockBytes / (K * int64_t(sizeof(float)) * kRows));
  const int64_t row_blocks = std::max((tiles + tiles_in_l2 - 1) / tiles_in_l2,
                                      groups >= want ? int64_t(1) : std::min(tiles, (want + groups - 1) / groups));
  return {groups, row_blocks, (tiles + row_blocks - 1) / row_blocks * kRows};
}

// body(first panel, first row, rows) for every unit, each on whichever thread asks next
// (parallel.h), in order: a row block's panel groups one after the other, then the next
// block's. A decode step's few rows are one block: its panel groups are split over the
// threads, each streaming its weights once.
template <typename Body>
void for_each_unit(const Plan& p, int64_t M, const Body& body) {
  labkit::parallel_chunks(p.groups * p.row_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t r0 = (u / p.groups) * p.block_rows, rows = std::min(p.block_rows, M - r0);
      if (rows > 0) body((u % p.groups) * kPanels, r0, rows);
    }
  });
}

// The checks both entries make: x fp32 [M, K] contiguous, panels fp32 [ceil(N / 16), K, 16]
// contiguous, bias fp32 [N] or None (its data, or nullptr).
const float* check_operands(const at::Tensor& x, const at::Tensor& panels, int64_t N,
                            const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "x must be contiguous fp32 [M, K]");
  TORCH_CHECK(panels.scalar_type() == at::kFloat && panels.dim() == 3 && panels.is_contiguous() &&
                  panels.size(2) == kPanel,
              "panels must be contiguous fp32 [ceil(N / 16), K, 16]");
  TORCH_CHECK(panels.size(1) == x.size(1), "x has ", x.size(1), " columns but the weight's panels have ",
              panels.size(1), " rows");
  TORCH_CHECK(x.size(1) > 0, "x has no columns: a linear layer of in_features 0");
  TORCH_CHECK(N > 0 && (N + kPanel - 1) / kPanel == panels.size(0), "out_features ", N, " does not fit ",
              panels.size(0), " panels of ", kPanel);
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
              "bias must be contiguous fp32 [", N, "]");
  return bias->data_ptr<float>();
}

}  // namespace

// x fp32 [M, K] contiguous; panels fp32 [ceil(N / 16), K, 16] contiguous (kernels/linear_cpu.py's
// pack_panels); bias fp32 [N] or None. Returns fp32 [M, N].
at::Tensor linear_panels(const at::Tensor& x, const at::Tensor& panels, int64_t out_features,
                         const c10::optional<at::Tensor>& bias) {
  const int64_t N = out_features;
  const float* b = check_operands(x, panels, N, bias);
  const int64_t M = x.size(0), K = x.size(1), num_panels = panels.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for_each_unit(plan(M, K, num_panels), M, [&](int64_t first, int64_t r0, int64_t rows) {
    const int cols = int(std::min<int64_t>(kPanels * kPanel, N - first * kPanel));
    rows_over_group(xp + r0 * K, rows, K, wp + first * K * kPanel, std::min<int64_t>(kPanels, num_panels - first),
                    b != nullptr ? b + first * kPanel : nullptr, yp + r0 * N + first * kPanel, N, cols);
  });
  return y;
}

// SwiGLU's first half in one pass: silu(x Wg^T + bg) * (x Wu^T + bu), for the MLP's gate and up
// weights stacked [gate | up] (out_features = 2 * inter, inter a multiple of 16, so that no
// panel holds columns of both) and packed as one matrix. A unit multiplies a block of rows by a
// group of gate panels and by the matching up panels into two buffers of its own (a row block
// by 48 columns each, 21 KB for SmolLM2's prefill: in L2 with the block), and writes only
// silu(gate) * up: the [M, 2 inter] product of the unfused path (12.6 MB for a 1024-token
// prefill of SmolLM2, per layer) is never written to memory and read back. The same bits as
// linear_panels followed by silu_and_mul (fused_ops.cpp): the same sums, the same vec::silu.
at::Tensor linear_panels_silu_mul(const at::Tensor& x, const at::Tensor& panels, int64_t out_features,
                                  const c10::optional<at::Tensor>& bias) {
  const float* b = check_operands(x, panels, out_features, bias);
  TORCH_CHECK(out_features % (2 * kPanel) == 0, "gate and up of ", out_features / 2, " columns each: the fused "
              "SwiGLU needs a multiple of ", kPanel);
  const int64_t M = x.size(0), K = x.size(1), inter = out_features / 2, half = inter / kPanel;
  at::Tensor y = at::empty({M, inter}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const Plan p = plan(M, K, half);  // units over the gate panels; each takes its up panels too
  for_each_unit(p, M, [&](int64_t first, int64_t r0, int64_t rows) {
    thread_local std::vector<float> gate, up;  // rows x (kPanels * 16) each: this unit's two products
    const int64_t width = kPanels * kPanel, count = std::min<int64_t>(kPanels, half - first);
    const int cols = int(count * kPanel);
    gate.resize(rows * width);
    up.resize(rows * width);
    const float* x0 = xp + r0 * K;
    rows_over_group(x0, rows, K, wp + first * K * kPanel, count, b != nullptr ? b + first * kPanel : nullptr,
                    gate.data(), width, cols);
    rows_over_group(x0, rows, K, wp + (half + first) * K * kPanel, count,
                    b != nullptr ? b + inter + first * kPanel : nullptr, up.data(), width, cols);
    for (int64_t r = 0; r < rows; ++r)
      for (int c = 0; c < cols; c += kPanel) {
        const Vec16 g = Vec16::load(gate.data() + r * width + c), u = Vec16::load(up.data() + r * width + c);
        (vec::silu(g) * u).store(yp + (r0 + r) * inter + first * kPanel + c);
      }
  });
  return y;
}
