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
// broadcast serves P panels. AVX-512 has 32 registers: 8 rows x 2 panels = 16 accumulators;
// AVX2's Vec16 is two of its 16 registers: 6 rows x 1 panel = 12 of them.
//
// Work is split over threads by panels, on torch's own thread pool (the one its other ops use),
// each thread taking the next group of panels when it is free (parallel.h). A thread streams
// the weights of its panels once and, for a long x (a prefill), runs every row tile over a
// panel while the panel is in its L2 cache. Where a
// matrix has too few panels to keep every thread busy (a many-core machine, a narrow layer)
// and x has rows to spare, the rows are split into blocks too, each block of a panel group one
// unit of work.
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

#include "parallel.h"
#include "vec.h"

namespace {

using vec::Vec16;

#if defined(LABKIT_VEC_AVX512)
constexpr int kRows = 8, kPanels = 2;  // 16 accumulators + 2 weight vectors + 1 broadcast of 32 registers
#elif defined(LABKIT_VEC_AVX2)
constexpr int kRows = 6, kPanels = 1;  // 12 + 2 + 1 of the 16 ymm registers (a Vec16 is two)
#else
constexpr int kRows = 4, kPanels = 1;  // plain arrays: the compiler keeps what it can
#endif
constexpr int kPanel = Vec16::size;  // output columns per panel
constexpr int kAhead = 64;           // prefetch this many weight rows (cache lines) ahead: 4 KB

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

}  // namespace

// x fp32 [M, K] contiguous; panels fp32 [ceil(N / 16), K, 16] contiguous (kernels/linear_cpu.py's
// pack_panels); bias fp32 [N] or None. Returns fp32 [M, N].
at::Tensor linear_panels(const at::Tensor& x, const at::Tensor& panels, int64_t out_features,
                         const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "x must be contiguous fp32 [M, K]");
  TORCH_CHECK(panels.scalar_type() == at::kFloat && panels.dim() == 3 && panels.is_contiguous() &&
                  panels.size(2) == kPanel,
              "panels must be contiguous fp32 [ceil(N / 16), K, 16]");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(panels.size(1) == K, "x has ", K, " columns but the weight's panels have ", panels.size(1), " rows");
  TORCH_CHECK(N > 0 && (N + kPanel - 1) / kPanel == panels.size(0), "out_features ", N, " does not fit ",
              panels.size(0), " panels of ", kPanel);
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be contiguous fp32 [", N, "]");
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t num_panels = panels.size(0);
  const int64_t groups = (num_panels + kPanels - 1) / kPanels;  // kPanels panels each
  // Rows in blocks only where the panel groups alone leave threads idle: at least 4 units per
  // thread, each block a whole number of tiles. (Every output is still summed in one order.)
  const int64_t want = 4 * int64_t(at::get_num_threads());
  const int64_t tiles = (M + kRows - 1) / kRows;
  const int64_t row_blocks = groups >= want ? 1 : std::min(tiles, (want + groups - 1) / groups);
  const int64_t block_rows = (tiles + row_blocks - 1) / row_blocks * kRows;
  // Units go to whichever thread asks next (parallel.h), one at a time, in order: one panel
  // group's row blocks, then the next group's.
  labkit::parallel_chunks(groups * row_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t first = (u / row_blocks) * kPanels, r0 = (u % row_blocks) * block_rows;
      const int64_t rows = std::min(block_rows, M - r0);
      if (rows <= 0) continue;
      const int cols = int(std::min<int64_t>(kPanels * kPanel, N - first * kPanel));
      const float* w = wp + first * K * kPanel;
      const float* bg = b != nullptr ? b + first * kPanel : nullptr;
      float* yu = yp + r0 * N + first * kPanel;
      if (num_panels - first >= kPanels)
        rows_over_panels<kPanels>(xp + r0 * K, rows, K, w, bg, yu, N, cols);
      else  // an odd last panel (kPanels = 2)
        rows_over_panels<1>(xp + r0 * K, rows, K, w, bg, yu, N, cols);
    }
  });
  return y;
}
