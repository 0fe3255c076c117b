// Prefill attention on a CPU, in C++: a chunk's query rows in tiles, as two small matrix
// multiplies with an exact softmax between them.
//
// A decode query is one row: it reads each cached K and V once and does little arithmetic on
// it, so the decode loop (paged_decode_attention.cpp) is built to stream memory. A prefill
// chunk of L tokens is L query rows over the same context, and row j's context is row j - 1's
// plus one token: L rows read the same keys and values L times. Done a row at a time (what
// paged_prefill_attention_rows does), every key is loaded again for every row, and its dot
// product is summed across vector lanes for each row alone. Done a tile of rows at a time, a
// key loaded once serves the whole tile: that is matrix multiplication, and it runs at the
// speed of the machine's multiply-adds, not of its loads.
//
// For each sequence and query head, in tiles of kTile consecutive rows of its chunk:
//
//   1. scores   S = (q * scale) K^T over the context the tile's last row sees. K is packed
//      first, once per sequence and KV head, as panels of 16 tokens, kt[p][d][16] (the same
//      layout as a linear layer's weight panels, linear.cpp): for each d the tile's rows
//      broadcast q[r][d] and multiply-add it with one vector of 16 tokens' K[., d]. On
//      AVX-512 two panels at a time: 2 loads and 8 broadcasts for 16 multiply-adds (AVX2,
//      with half the registers: four rows by one panel).
//   2. softmax  for each row r over its own causal length n_r = context - L + j + 1: the
//      maximum, exp, the sum. Exact, not online: the whole row of scores is there (a short
//      context, at most a few thousand floats a row). Past n_r the row's probabilities are 0.
//   3. values   out = P V: for each token, its V row (read in place from the paged cache) is
//      multiply-added into the tile's outputs with each row's probability broadcast.
//
// The causal mask costs nothing extra: a row stops at its own length (scores past it are never
// used, probabilities past it are 0); within a tile, its last row's length bounds the work.
//
// Every number a prefill row gets depends only on its own query, its sequence's cache and its
// length: which tile, batch, or chunk of kTile rows or more it falls in changes no bit (the dot
// products run over d in order, in one accumulator per row; zeros past a row's length add
// exactly nothing), so the CPU backend's logits stay batch-invariant (linear.cpp). (A prefill
// row and the decode loop's row for the same token are computed in other orders: equal within
// rounding, not to the bit. So is a row of a chunk shorter than kTile, which takes the decode
// loop, below: within fp32's rounding of the tiles', or, for a bf16 cache on AMX, within the
// bf16 rounding of its query and weights, about 1e-3 relative.)
//
// A chunk of fewer than kTile rows takes the decode loop instead, a row at a time
// (short_chunks_as_rows): for a few rows, packing the whole context's keys costs more than it
// saves.
//
// Cache dtypes: as the decode loop's. K is widened (bf16) or dequantized (int8, fp8: times its
// token's scale) into fp32 panels as it is packed; V is widened as it is read, and a quantized
// V's scales join the probabilities (the sum of values takes p * s; the softmax's sum, p).
// A bf16 cache on a CPU with AMX (and a head size that is a multiple of 32) takes namespace amx
// below instead: the same three steps on 16-row tiles, both multiplies on the matrix unit.
//
// Measured on a 2-core Intel Xeon (AVX-512), SmolLM2's 9 query and 3 KV heads of 64, fp32, one
// layer (python -m labkit.bench prefill): eight fresh 128-token prompts 3.26 ms row by row, 2.38
// in tiles; one 512-token prompt 5.32 and 2.89; 1,024 tokens 20.9 and 10.9 (SDPA 16.5). See
// docs/performance.md.

// ATen's own headers, not <torch/extension.h> (see paged_decode_attention.cpp).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "parallel.h"
#include "vec.h"

#if defined(LABKIT_VEC_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define LABKIT_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using vec::Vec16;

constexpr int kTile = 8;                 // query rows per tile
constexpr int kLanes = Vec16::size;      // tokens per K panel
constexpr float kMinusInfinity = -1e30f;  // finite: -ffast-math may assume there are no infinities

template <typename T>
constexpr bool kQuantized = std::is_same_v<T, int8_t> || std::is_same_v<T, vec::fp8_e4m3>;

// What every tile of one call reads: the tensors' pointers and strides.
template <typename T>
struct Inputs {
  const float* q;          // [rows, heads, D], fp32
  const T* k;              // caches [blocks, block_size, kv_heads, D]
  const T* v;
  const float* k_scales;   // a quantized cache's [blocks, block_size, kv_heads], else nullptr
  const float* v_scales;
  const int32_t* tables;   // [seqs, table_stride]
  const int32_t* lens;     // context of each sequence, its chunk included
  const int32_t* starts;   // query_start_loc [seqs + 1]
  int64_t heads, kv_heads, D, block_size, block_stride, row_stride, table_stride;
  float scale;
  const float* kt;         // the packed keys (pack_keys)
  const int64_t* kt_at;    // where sequence s's panels start in kt: kt_at[s] + h * panels_s * D * 16
};

// Sequence s's keys of KV head h as panels of 16 tokens, kt[p][d][lane] = K[16 p + lane, d] in
// fp32 (times the token's scale for a quantized cache); lanes past the context are 0.
template <typename T>
void pack_keys(const Inputs<T>& in, int64_t s, int64_t h, float* kt) {
  const int64_t n = in.lens[s], D = in.D, panels = (n + kLanes - 1) / kLanes;
  const int32_t* table = in.tables + s * in.table_stride;
  std::fill(kt + (panels - 1) * D * kLanes, kt + panels * D * kLanes, 0.f);  // the last panel's padding
  for (int64_t t = 0; t < n; ++t) {
    const int64_t block = table[t / in.block_size], offset = t % in.block_size;
    const T* row = in.k + block * in.block_stride + offset * in.row_stride + h * D;
    float scale = 1.f;
    if constexpr (kQuantized<T>) scale = in.k_scales[(block * in.block_size + offset) * in.kv_heads + h];
    float* dst = kt + (t / kLanes) * D * kLanes + t % kLanes;
    alignas(64) float widened[Vec16::size];
    for (int64_t d = 0; d < D; d += Vec16::size) {
      (Vec16::load(row + d) * Vec16::all(scale)).store(widened);
      for (int i = 0; i < Vec16::size; ++i) dst[(d + i) * kLanes] = widened[i];
    }
  }
}

// How many fp32 vectors of accumulators a register tile holds: AVX-512 has 32 registers of one
// Vec16, AVX2 16 of half of one (a Vec16 is two), the portable build plain arrays.
#if defined(LABKIT_VEC_AVX512)
constexpr int kScoreRows = 8, kScorePanels = 2, kValueAccs = 16;  // 16 + 2 + 1 of 32 registers
#else
constexpr int kScoreRows = 4, kScorePanels = 1, kValueAccs = 4;   // 8 + 2 + 2 of 16 (AVX2)
#endif

// Scores of rows [0, R) of the tile against panels [p0, p0 + P): s[r][16 p + lane]. qs[r][d]
// holds the tile's queries, already scaled (D floats a row).
template <int R, int P>
inline void score_block(const float* qs, const float* kt, int64_t D, int64_t p0, float* s, int64_t ld) {
  Vec16 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = Vec16::zero();
  for (int64_t d = 0; d < D; ++d) {
    Vec16 k[P];
    for (int p = 0; p < P; ++p) k[p] = Vec16::load(kt + ((p0 + p) * D + d) * kLanes);
    for (int r = 0; r < R; ++r) {
      const Vec16 qr = Vec16::all(qs[r * D + d]);
      for (int p = 0; p < P; ++p) acc[r][p] = vec::fma(qr, k[p], acc[r][p]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p].store(s + r * ld + (p0 + p) * kLanes);
}

// Rows [0, R) against every panel, kScorePanels at a time.
template <int R>
inline void score_rows(const float* qs, const float* kt, int64_t D, int64_t panels, float* s, int64_t ld) {
  int64_t p = 0;
  for (; p + kScorePanels <= panels; p += kScorePanels) score_block<R, kScorePanels>(qs, kt, D, p, s, ld);
  for (; p < panels; ++p) score_block<R, 1>(qs, kt, D, p, s, ld);
}

// 1. Scores of the tile's first `rows` rows against panels [0, panels): s[r][16 p + lane], ld
// floats a row. Blocks of kScoreRows rows; a short tile (a chunk of a few tokens after a long
// context, a chunk's last rows) takes the next power of two of its rows, not eight: a row's
// scores are the same bits whichever block computes them (queries past the chunk are 0).
inline void scores(const float* qs, const float* kt, int64_t D, int64_t panels, int rows, float* s, int64_t ld) {
  int r0 = 0;
  for (; r0 + kScoreRows <= rows; r0 += kScoreRows) score_rows<kScoreRows>(qs + r0 * D, kt, D, panels, s + r0 * ld, ld);
  const int left = rows - r0;
  if (left == 0) return;
  if (left <= 1) score_rows<1>(qs + r0 * D, kt, D, panels, s + r0 * ld, ld);
  else if (left <= 2) score_rows<2>(qs + r0 * D, kt, D, panels, s + r0 * ld, ld);
  else if (left <= 4) score_rows<4>(qs + r0 * D, kt, D, panels, s + r0 * ld, ld);
  else score_rows<kScoreRows>(qs + r0 * D, kt, D, panels, s + r0 * ld, ld);
}

// 2. One row's scores s[0, n) into probabilities, in place, and zeros over [n, padded); returns
// 1 / their sum. (The sum runs over whole 16-lane vectors in order; lanes past n add 0.)
inline float softmax_row(float* s, int64_t n, int64_t padded) {
  const int64_t vectors = padded / Vec16::size;
  Vec16 mx = Vec16::all(kMinusInfinity);
  for (int64_t i = 0; i < vectors; ++i) {
    const int64_t left = n - i * Vec16::size;
    if (left <= 0) break;
    mx = vec::max(mx, Vec16::load(s + i * Vec16::size).first(int(std::min<int64_t>(left, 16)), kMinusInfinity));
  }
  const Vec16 m = Vec16::all(mx.reduce_max());
  Vec16 sum = Vec16::zero();
  for (int64_t i = 0; i < vectors; ++i) {
    const int64_t left = std::clamp<int64_t>(n - i * Vec16::size, 0, 16);
    const Vec16 p = vec::exp(Vec16::load(s + i * Vec16::size) - m).first(int(left));
    p.store(s + i * Vec16::size);
    sum = sum + p;
  }
  return 1.f / sum.reduce_sum();
}

// 3. out[r] = sum over tokens t < n of p[r][t] V[t], for R rows of C vectors each (D = 16 C),
// the outputs in registers: R x C <= 16 accumulators.
template <typename T, int C, int R>
inline void values(const Inputs<T>& in, int64_t s, int64_t h, const float* p, int64_t ld, int64_t n,
                   const float* inv, float* const* out) {
  Vec16 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = Vec16::zero();
  const int32_t* table = in.tables + s * in.table_stride;
  for (int64_t t0 = 0; t0 < n; t0 += in.block_size) {
    const int64_t block = table[t0 / in.block_size];
    const int64_t used = std::min(in.block_size, n - t0);
    const T* vb = in.v + block * in.block_stride + h * in.D;
    for (int64_t o = 0; o < used; ++o) {
      Vec16 v[C];
      for (int c = 0; c < C; ++c) v[c] = Vec16::load(vb + o * in.row_stride + c * Vec16::size);
      float vs = 1.f;
      if constexpr (kQuantized<T>) vs = in.v_scales[(block * in.block_size + o) * in.kv_heads + h];
      for (int r = 0; r < R; ++r) {
        const Vec16 w = Vec16::all(p[r * ld + t0 + o] * vs);
        for (int c = 0; c < C; ++c) acc[r][c] = vec::fma(w, v[c], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) (acc[r][c] * Vec16::all(inv[r])).store(out[r] + c * Vec16::size);
}

// The tile's rows through `values`, as many at a time as fit in registers beside C vectors of V.
template <typename T, int C>
void values_for_tile(const Inputs<T>& in, int64_t s, int64_t h, const float* p, int64_t ld, int rows,
                     int64_t n, const float* inv, float* const* out) {
  constexpr int R = std::clamp(kValueAccs / C, 1, kTile);  // AVX-512: 4 rows for head_dim 64, 2 for 128
  int r = 0;
  for (; r + R <= rows; r += R) values<T, C, R>(in, s, h, p + r * ld, ld, n, inv + r, out + r);
  for (; r < rows; ++r) values<T, C, 1>(in, s, h, p + r * ld, ld, n, inv + r, out + r);
}

// One tile: rows [row0, row0 + rows) of sequence s's chunk, query head qh. work: kTile x ld
// floats for the scores, qs: kTile x D for the queries.
template <typename T>
void tile(const Inputs<T>& in, int64_t s, int64_t qh, int64_t row0, int rows, float* work, float* qs,
          float* out_base) {
  const int64_t D = in.D, group = in.heads / in.kv_heads, h = qh / group;
  const int64_t chunk = in.starts[s + 1] - in.starts[s], n_all = in.lens[s];
  const int64_t n_last = n_all - chunk + row0 + rows;  // the tile's last row sees the most
  const int64_t panels = (n_last + kLanes - 1) / kLanes, ld = panels * kLanes;
  const Vec16 scale = Vec16::all(in.scale);
  for (int r = 0; r < kTile; ++r) {  // rows past the chunk's end: queries of 0, their scores unused
    const float* qr = r < rows ? in.q + ((in.starts[s] + row0 + r) * in.heads + qh) * D : nullptr;
    for (int64_t d = 0; d < D; d += Vec16::size)
      (qr ? Vec16::load(qr + d) * scale : Vec16::zero()).store(qs + r * D + d);
  }
  const int64_t panels_s = (n_all + kLanes - 1) / kLanes;
  scores(qs, in.kt + in.kt_at[s] + h * panels_s * D * kLanes, D, panels, rows, work, ld);
  float inv[kTile];
  float* out[kTile];
  for (int r = 0; r < rows; ++r) {
    inv[r] = softmax_row(work + r * ld, n_all - chunk + row0 + r + 1, ld);
    out[r] = out_base + ((in.starts[s] + row0 + r) * in.heads + qh) * D;
  }
  switch (D / Vec16::size) {  // head_dim 16 .. 128 (the entry checks it): its vectors per row
    case 1: values_for_tile<T, 1>(in, s, h, work, ld, rows, n_last, inv, out); break;
    case 2: values_for_tile<T, 2>(in, s, h, work, ld, rows, n_last, inv, out); break;
    case 3: values_for_tile<T, 3>(in, s, h, work, ld, rows, n_last, inv, out); break;
    case 4: values_for_tile<T, 4>(in, s, h, work, ld, rows, n_last, inv, out); break;
    case 5: values_for_tile<T, 5>(in, s, h, work, ld, rows, n_last, inv, out); break;
    case 6: values_for_tile<T, 6>(in, s, h, work, ld, rows, n_last, inv, out); break;
    case 7: values_for_tile<T, 7>(in, s, h, work, ld, rows, n_last, inv, out); break;
    default: values_for_tile<T, 8>(in, s, h, work, ld, rows, n_last, inv, out); break;
  }
}

// A tile of work: rows [row0, row0 + rows) of sequence s's chunk, query head qh; cost is the
// context its last row sees.
struct Unit {
  int64_t cost, s, qh, row0;
};

// The tiles of the tiled sequences, `rows` query rows each, the costliest first (the last rows of
// the longest contexts), so that the work left at the end, when a thread may wait for another, is
// the smallest. `longest` gets the longest context among them.
template <typename T>
std::vector<Unit> tile_units(const Inputs<T>& in, int64_t num_seqs, const std::vector<bool>& tiled, int rows,
                             int64_t& longest) {
  std::vector<Unit> units;
  longest = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (!tiled[s]) continue;
    const int64_t chunk = in.starts[s + 1] - in.starts[s];
    longest = std::max<int64_t>(longest, in.lens[s]);
    for (int64_t row0 = 0; row0 < chunk; row0 += rows)
      for (int64_t qh = 0; qh < in.heads; ++qh)
        units.push_back({in.lens[s] - chunk + std::min<int64_t>(row0 + rows, chunk), s, qh, row0});
  }
  std::stable_sort(units.begin(), units.end(), [](const Unit& a, const Unit& b) { return a.cost > b.cost; });
  return units;
}

// pack(s, h) for every tiled sequence s and KV head h, one pair per piece of work.
template <typename Pack>
void pack_tiled_heads(int64_t num_seqs, int64_t kv_heads, const std::vector<bool>& tiled, Pack pack) {
  labkit::parallel_chunks(num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u)
      if (tiled[u / kv_heads]) pack(u / kv_heads, u % kv_heads);
  });
}

// Every unit through a worker: each thread makes one (its buffers; on AMX, its tile registers'
// configuration, released when the worker goes) and takes the next unit when it is free (parallel.h).
template <typename MakeWorker>
void run_tiles(const std::vector<Unit>& units, MakeWorker make_worker) {
  const int64_t num_units = int64_t(units.size());
  if (num_units == 0) return;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    auto work = make_worker();
    for (int64_t i = next++; i < num_units; i = next++) work(units[i]);
  });
}

template <typename T>
void prefill_tiles(Inputs<T> in, int64_t num_seqs, const std::vector<bool>& tiled, at::Tensor& out) {
  // Pack the keys of every tiled sequence, one (sequence, KV head) per unit of work.
  std::vector<int64_t> kt_at(num_seqs + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s)
    kt_at[s + 1] = kt_at[s] + (tiled[s] ? (in.lens[s] + kLanes - 1) / kLanes * kLanes * in.D * in.kv_heads : 0);
  std::unique_ptr<float[]> kt(new float[kt_at[num_seqs]]);  // pack_keys writes all that any tile reads
  in.kt = kt.get();
  in.kt_at = kt_at.data();
  pack_tiled_heads(num_seqs, in.kv_heads, tiled, [&](int64_t s, int64_t h) {
    const int64_t panels = (in.lens[s] + kLanes - 1) / kLanes;
    pack_keys(in, s, h, kt.get() + kt_at[s] + h * panels * in.D * kLanes);
  });
  int64_t longest;
  const std::vector<Unit> units = tile_units(in, num_seqs, tiled, kTile, longest);
  const int64_t ld_max = (longest + kLanes - 1) / kLanes * kLanes;
  float* o = out.data_ptr<float>();
  run_tiles(units, [&] {  // a worker: a thread's scores and queries, and the tile they go through
    std::vector<float> work(kTile * ld_max), qs(kTile * in.D);
    return [&, work = std::move(work), qs = std::move(qs)](const Unit& u) mutable {
      const int64_t chunk = in.starts[u.s + 1] - in.starts[u.s];
      tile(in, u.s, u.qh, u.row0, int(std::min<int64_t>(kTile, chunk - u.row0)), work.data(), qs.data(), o);
    };
  });
}

#if LABKIT_AMX
// ---- bf16 caches on a CPU with AMX: both multiplies on the matrix unit ------------------------
//
// Intel's Advanced Matrix Extensions (Sapphire Rapids and later) add eight tile registers of up to
// 16 rows x 64 bytes and one instruction, TDPBF16PS, that multiplies a 16 x 32 bf16 tile by a
// 32 x 16 one into 16 x 16 fp32 sums: 8,192 multiply-adds, against 16 for an AVX-512 FMA. With a
// bf16 cache the tiles above spend their time widening bf16 to fp32 and multiply-adding it;
// here the same three steps run on 16-row tiles, both multiplies on the matrix unit:
//
//   1. scores   S = (q * scale) K^T: the queries rounded to bf16 (as vLLM's and torch's bf16
//      attention do), keys packed per (sequence, KV head) in AMX's pair layout, kp[p][d / 2][16][2]
//      (panel p's 16 tokens, two dims of one token side by side: a 64-byte row of a tile);
//   2. softmax  in fp32, exact, as above; the probabilities then rounded to bf16;
//   3. values   P V, values packed the same way, token pairs side by side:
//      vp[g][c][t / 2][16][2] for groups g of 32 tokens and columns c of 16 dims.
//
// Rounding P to bf16 costs about three decimal digits of each weight, as vLLM's AMX kernel does;
// the sums are fp32. A row's result still depends only on its own query, cache and length (the
// unit sums each output in a fixed order, whatever the other rows): batch-invariant as before.
// Head sizes that are multiples of 32 take this path (a tile's row holds 32 bf16), others the fp32
// tiles; `amx=False` (paged_prefill_attention_tiles) asks for the fp32 tiles, to compare.
namespace amx {

constexpr int kRows = 16;    // query rows per tile: a tile register's rows
constexpr int kGroup = 32;   // tokens per step of P V: a 64-byte row of bf16 probabilities

// Linux hands out the tile registers' 8 KB of state per process, on request.
bool usable() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

// Every tile register as 16 rows of 64 bytes (palette 1), for this thread.
void configure() {
  struct alignas(64) Config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } c{};
  c.palette = 1;
  for (int i = 0; i < 8; ++i) c.colsb[i] = 64, c.rows[i] = kRows;
  _tile_loadconfig(&c);
}

// Sequence s's keys of KV head h: kp[p][i][lane][2] = K[16 p + lane, 2 i + (0, 1)]; zeros past n.
void pack_keys(const Inputs<uint16_t>& in, int64_t s, int64_t h, uint16_t* kp) {
  const int64_t n = in.lens[s], D = in.D, panels = (n + kLanes - 1) / kLanes;
  const int32_t* table = in.tables + s * in.table_stride;
  std::fill(kp + (panels - 1) * D * kLanes, kp + panels * D * kLanes, uint16_t(0));
  for (int64_t t = 0; t < n; ++t) {
    const uint16_t* row = in.k + table[t / in.block_size] * in.block_stride + t % in.block_size * in.row_stride + h * D;
    uint16_t* dst = kp + (t / kLanes) * D * kLanes + (t % kLanes) * 2;
    for (int64_t i = 0; i < D / 2; ++i) std::memcpy(dst + i * kLanes * 2, row + 2 * i, 4);
  }
}

// Sequence s's values of KV head h: vp[g][c][i][j][2] = V[32 g + 2 i + (0, 1), 16 c + j]; zeros past n.
void pack_values(const Inputs<uint16_t>& in, int64_t s, int64_t h, uint16_t* vp) {
  const int64_t n = in.lens[s], D = in.D, groups = (n + kGroup - 1) / kGroup;
  const int32_t* table = in.tables + s * in.table_stride;
  std::fill(vp + (groups - 1) * kGroup * D, vp + groups * kGroup * D, uint16_t(0));
  for (int64_t t = 0; t < n; ++t) {
    const uint16_t* row = in.v + table[t / in.block_size] * in.block_stride + t % in.block_size * in.row_stride + h * D;
    uint16_t* dst = vp + (t / kGroup) * kGroup * D + (t % kGroup / 2) * 32 + t % 2;
    for (int64_t c = 0; c < D / 16; ++c)
      for (int j = 0; j < 16; ++j) dst[c * 512 + 2 * j] = row[16 * c + j];
  }
}

// The tile's 16 x 16 scores against panels [0, panels): tmm2.. hold the queries' KC blocks of 32
// dims, tmm0 and tmm1 two panels' scores, tmm6 and tmm7 their keys.
template <int KC>
void scores(const uint16_t* qb, const uint16_t* kp, int64_t D, int64_t panels, float* s, int64_t ld) {
  const int64_t qstride = D * 2, panel = D * kLanes;
  _tile_loadd(2, qb, qstride);
  if constexpr (KC > 1) _tile_loadd(3, qb + 32, qstride);
  if constexpr (KC > 2) _tile_loadd(4, qb + 64, qstride);
  if constexpr (KC > 3) _tile_loadd(5, qb + 96, qstride);
  int64_t p = 0;
  for (; p + 2 <= panels; p += 2) {
    const uint16_t* k0 = kp + p * panel;
    const uint16_t* k1 = k0 + panel;
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(6, k0, 64); _tile_loadd(7, k1, 64); _tile_dpbf16ps(0, 2, 6); _tile_dpbf16ps(1, 2, 7);
    if constexpr (KC > 1) { _tile_loadd(6, k0 + 512, 64); _tile_loadd(7, k1 + 512, 64); _tile_dpbf16ps(0, 3, 6); _tile_dpbf16ps(1, 3, 7); }
    if constexpr (KC > 2) { _tile_loadd(6, k0 + 1024, 64); _tile_loadd(7, k1 + 1024, 64); _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); }
    if constexpr (KC > 3) { _tile_loadd(6, k0 + 1536, 64); _tile_loadd(7, k1 + 1536, 64); _tile_dpbf16ps(0, 5, 6); _tile_dpbf16ps(1, 5, 7); }
    _tile_stored(0, s + p * kLanes, ld * 4);
    _tile_stored(1, s + (p + 1) * kLanes, ld * 4);
  }
  if (p < panels) {  // an odd last panel: the same sums, one tile
    const uint16_t* k0 = kp + p * panel;
    _tile_zero(0);
    _tile_loadd(6, k0, 64); _tile_dpbf16ps(0, 2, 6);
    if constexpr (KC > 1) { _tile_loadd(6, k0 + 512, 64); _tile_dpbf16ps(0, 3, 6); }
    if constexpr (KC > 2) { _tile_loadd(6, k0 + 1024, 64); _tile_dpbf16ps(0, 4, 6); }
    if constexpr (KC > 3) { _tile_loadd(6, k0 + 1536, 64); _tile_dpbf16ps(0, 5, 6); }
    _tile_stored(0, s + p * kLanes, ld * 4);
  }
}

// o[r][d] = sum over the first `groups` x 32 tokens of pb[r][t] V[t][d], for 16 rows: up to four
// columns of 16 dims at a time in tmm0..tmm3, the probabilities in tmm4, the values in tmm5.
void values(const uint16_t* pb, const uint16_t* vp, int64_t D, int64_t groups, int64_t ld, float* o) {
  const int64_t columns = D / 16;
  for (int64_t c0 = 0; c0 < columns; c0 += 4) {
    const int64_t nc = std::min<int64_t>(4, columns - c0);
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t g = 0; g < groups; ++g) {
      _tile_loadd(4, pb + g * kGroup, ld * 2);
      const uint16_t* v = vp + (g * columns + c0) * 512;
      _tile_loadd(5, v, 64); _tile_dpbf16ps(0, 4, 5);
      if (nc > 1) { _tile_loadd(5, v + 512, 64); _tile_dpbf16ps(1, 4, 5); }
      if (nc > 2) { _tile_loadd(5, v + 1024, 64); _tile_dpbf16ps(2, 4, 5); }
      if (nc > 3) { _tile_loadd(5, v + 1536, 64); _tile_dpbf16ps(3, 4, 5); }
    }
    _tile_stored(0, o + c0 * 16, D * 4);
    if (nc > 1) _tile_stored(1, o + (c0 + 1) * 16, D * 4);
    if (nc > 2) _tile_stored(2, o + (c0 + 2) * 16, D * 4);
    if (nc > 3) _tile_stored(3, o + (c0 + 3) * 16, D * 4);
  }
}

// A thread's buffers: scores (fp32) and probabilities (bf16) of 16 rows, queries, outputs; and its
// tile registers, configured while it lives and released after (back to their initial state, for
// whoever runs on this thread next).
struct Worker {
  std::vector<float> s, o;
  std::vector<uint16_t> pb, qb;
  Worker(int64_t ld_max, int64_t D) : s(kRows * ld_max), o(kRows * D), pb(kRows * ld_max), qb(kRows * D) {
    configure();
  }
  ~Worker() { _tile_release(); }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;
};

// One tile: rows [row0, row0 + rows) of sequence s's chunk, query head qh.
void tile(const Inputs<uint16_t>& in, const uint16_t* kp_s, const uint16_t* vp_s, int64_t s, int64_t qh,
          int64_t row0, int rows, Worker& w, float* out_base) {
  const int64_t D = in.D, h = qh / (in.heads / in.kv_heads);
  const int64_t chunk = in.starts[s + 1] - in.starts[s], n_all = in.lens[s];
  const int64_t n_last = n_all - chunk + row0 + rows;
  const int64_t panels = (n_last + kLanes - 1) / kLanes, groups = (n_last + kGroup - 1) / kGroup, ld = groups * kGroup;
  const int64_t panels_s = (n_all + kLanes - 1) / kLanes, groups_s = (n_all + kGroup - 1) / kGroup;
  const Vec16 scale = Vec16::all(in.scale);
  for (int r = 0; r < kRows; ++r) {  // rows past the chunk: queries of 0, their results unused
    const float* qr = r < rows ? in.q + ((in.starts[s] + row0 + r) * in.heads + qh) * D : nullptr;
    for (int64_t d = 0; d < D; d += Vec16::size)
      (qr ? Vec16::load(qr + d) * scale : Vec16::zero()).store(w.qb.data() + r * D + d);
  }
  const uint16_t* kp = kp_s + h * panels_s * D * kLanes;
  switch (D / 32) {  // 32, 64, 96 or 128 (the caller checked)
    case 1: scores<1>(w.qb.data(), kp, D, panels, w.s.data(), ld); break;
    case 2: scores<2>(w.qb.data(), kp, D, panels, w.s.data(), ld); break;
    case 3: scores<3>(w.qb.data(), kp, D, panels, w.s.data(), ld); break;
    default: scores<4>(w.qb.data(), kp, D, panels, w.s.data(), ld); break;
  }
  float inv[kRows];
  for (int r = 0; r < kRows; ++r) {
    uint16_t* pr = w.pb.data() + r * ld;
    if (r >= rows) {
      std::fill(pr, pr + ld, uint16_t(0));
      continue;
    }
    float* sr = w.s.data() + r * ld;
    inv[r] = softmax_row(sr, n_all - chunk + row0 + r + 1, ld);
    for (int64_t t = 0; t < ld; t += Vec16::size) Vec16::load(sr + t).store(pr + t);
  }
  values(w.pb.data(), vp_s + h * groups_s * kGroup * D, D, groups, ld, w.o.data());
  for (int r = 0; r < rows; ++r) {
    float* out = out_base + ((in.starts[s] + row0 + r) * in.heads + qh) * D;
    for (int64_t d = 0; d < D; d += Vec16::size) (Vec16::load(w.o.data() + r * D + d) * Vec16::all(inv[r])).store(out + d);
  }
}

// The tiled chunks of a bf16 cache: keys and values packed per (sequence, KV head), then the
// tiles, the costliest first, each thread taking the next when it is free.
void prefill_tiles(const Inputs<uint16_t>& in, int64_t num_seqs, const std::vector<bool>& tiled, at::Tensor& out) {
  const int64_t D = in.D;
  std::vector<int64_t> kp_at(num_seqs + 1, 0), vp_at(num_seqs + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s) {
    kp_at[s + 1] = kp_at[s] + (tiled[s] ? (in.lens[s] + kLanes - 1) / kLanes * kLanes * D * in.kv_heads : 0);
    vp_at[s + 1] = vp_at[s] + (tiled[s] ? (in.lens[s] + kGroup - 1) / kGroup * kGroup * D * in.kv_heads : 0);
  }
  std::unique_ptr<uint16_t[]> kp(new uint16_t[kp_at[num_seqs]]), vp(new uint16_t[vp_at[num_seqs]]);
  pack_tiled_heads(num_seqs, in.kv_heads, tiled, [&](int64_t s, int64_t h) {
    const int64_t n = in.lens[s];
    pack_keys(in, s, h, kp.get() + kp_at[s] + h * ((n + kLanes - 1) / kLanes) * kLanes * D);
    pack_values(in, s, h, vp.get() + vp_at[s] + h * ((n + kGroup - 1) / kGroup) * kGroup * D);
  });
  int64_t longest;
  const std::vector<Unit> units = tile_units(in, num_seqs, tiled, kRows, longest);
  const int64_t ld_max = (longest + kGroup - 1) / kGroup * kGroup;
  float* o = out.data_ptr<float>();
  run_tiles(units, [&] {
    return [&, w = Worker(ld_max, D)](const Unit& u) mutable {
      const int64_t chunk = in.starts[u.s + 1] - in.starts[u.s];
      tile(in, kp.get() + kp_at[u.s], vp.get() + vp_at[u.s], u.s, u.qh, u.row0,
           int(std::min<int64_t>(kRows, chunk - u.row0)), w, o);
    };
  });
}

}  // namespace amx
#endif

}  // namespace

// The decode loop over prefill rows (paged_decode_attention.cpp): the short chunks' path.
bool supports(int64_t head_dim, int64_t group, int64_t block_size);
at::Tensor paged_prefill_attention_rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                        const at::Tensor& block_tables, const at::Tensor& row_lens,
                                        const at::Tensor& row_seq, double scale,
                                        const c10::optional<at::Tensor>& k_scales,
                                        const c10::optional<at::Tensor>& v_scales);

namespace {

// Chunks of fewer than kTile rows (a prompt's last few tokens after a long cached prefix, the
// tail of a chunked prompt) through the decode loop, a row at a time: a tile would pack the whole
// context's keys for those few rows, up to 5x slower than reading them in place (`python -m
// labkit.bench prefill --shapes 32x1@500`). Whether a sequence's rows take tiles or rows depends
// on its own chunk only, so a sequence's results do not depend on the other sequences of the call.
void short_chunks_as_rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_tables, const int32_t* lens, const int32_t* starts,
                          const std::vector<int64_t>& seqs, double scale, const c10::optional<at::Tensor>& k_scales,
                          const c10::optional<at::Tensor>& v_scales, at::Tensor& out) {
  int64_t n = 0;
  for (int64_t s : seqs) n += starts[s + 1] - starts[s];
  const auto ints = block_tables.options();
  at::Tensor row_seq = at::empty({n}, ints), row_lens = at::empty({n}, ints);
  at::Tensor rows_q = at::empty({n, q.size(1), q.size(2)}, q.options());
  const int64_t row_floats = q.size(1) * q.size(2);
  int64_t r = 0;
  for (int64_t s : seqs) {
    const int32_t chunk = starts[s + 1] - starts[s];
    for (int32_t j = 0; j < chunk; ++j, ++r) {
      row_seq.data_ptr<int32_t>()[r] = int32_t(s);
      row_lens.data_ptr<int32_t>()[r] = lens[s] - chunk + j + 1;
    }
    std::memcpy(rows_q.data_ptr<float>() + (r - chunk) * row_floats, q.data_ptr<float>() + starts[s] * row_floats,
                sizeof(float) * chunk * row_floats);
  }
  const at::Tensor o = paged_prefill_attention_rows(rows_q, k_cache, v_cache, block_tables, row_lens, row_seq, scale,
                                                    k_scales, v_scales);
  r = 0;
  for (int64_t s : seqs) {
    const int32_t chunk = starts[s + 1] - starts[s];
    std::memcpy(out.data_ptr<float>() + starts[s] * row_floats, o.data_ptr<float>() + r * row_floats,
                sizeof(float) * chunk * row_floats);
    r += chunk;
  }
}

}  // namespace

// Prefill chunks (the arguments kernels/paged_prefill_attention.py's wrapper checked, as the
// torch reference takes them): sequence i's rows query_start_loc[i] ..
// query_start_loc[i + 1] - 1, its row j attending to the first context_lens[i] - L_i + j + 1
// tokens of its cache. q fp32 [rows, heads, D], D a multiple of 16 up to 128; returns fp32 like q.
at::Tensor paged_prefill_attention_tiles(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                         const at::Tensor& block_tables, const at::Tensor& context_lens,
                                         const at::Tensor& query_start_loc, double scale,
                                         const c10::optional<at::Tensor>& k_scales,
                                         const c10::optional<at::Tensor>& v_scales, bool amx) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 3, "q must be contiguous fp32 [rows, heads, D]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "K and V caches must be contiguous [blocks, block_size, kv_heads, D], of one dtype");
  const int64_t D = q.size(2), heads = q.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(D % Vec16::size == 0 && D <= 128 && k_cache.size(3) == D, "head_dim ", D,
              ": the tiles take multiples of 16 up to 128, as q and the caches' last dimension");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, heads, " query heads are not groups of ", kv_heads, " KV heads");
  const int64_t num_seqs = context_lens.numel();
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.stride(1) == 1 &&
                  block_tables.size(0) == num_seqs && context_lens.scalar_type() == at::kInt &&
                  context_lens.is_contiguous() && query_start_loc.scalar_type() == at::kInt &&
                  query_start_loc.is_contiguous() && query_start_loc.numel() == num_seqs + 1,
              "block_tables [seqs, max_blocks], context_lens [seqs] and query_start_loc [seqs + 1] must be int32, "
              "rows contiguous");
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  TORCH_CHECK(starts[0] == 0 && starts[num_seqs] == q.size(0), "query_start_loc must run from 0 to q's ", q.size(0),
              " rows");
  for (int64_t s = 0; s < num_seqs; ++s)
    TORCH_CHECK(starts[s + 1] >= starts[s] && starts[s + 1] - starts[s] <= lens[s], "sequence ", s, ": a chunk of ",
                starts[s + 1] - starts[s], " rows in a context of ", lens[s]);
  const auto dtype = k_cache.scalar_type();
  const bool quantized = dtype == at::kChar || dtype == at::kFloat8_e4m3fn;
  TORCH_CHECK(k_scales.has_value() == quantized && v_scales.has_value() == quantized,
              quantized ? "a quantized (int8, fp8) cache needs its k_scales and v_scales"
                        : "k_scales and v_scales belong to a quantized (int8, fp8) cache");
  if (quantized)
    for (const at::Tensor* sc : {&*k_scales, &*v_scales})
      TORCH_CHECK(sc->scalar_type() == at::kFloat && sc->is_contiguous() && sc->dim() == 3 &&
                      sc->size(0) == k_cache.size(0) && sc->size(1) == k_cache.size(1) && sc->size(2) == kv_heads,
                  "scales must be contiguous fp32 [num_blocks, block_size, num_kv_heads]");
  at::Tensor out = at::empty_like(q);
  if (q.size(0) == 0) return out;
  // Which chunks take tiles: those of kTile rows or more, and any the row loop has no kernel for.
  const bool rows_run = supports(D, heads / kv_heads, k_cache.size(1));
  std::vector<bool> tiled(num_seqs);
  std::vector<int64_t> short_seqs;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t chunk = starts[s + 1] - starts[s];
    tiled[s] = chunk >= kTile || (chunk > 0 && !rows_run);
    if (chunk > 0 && !tiled[s]) short_seqs.push_back(s);
  }
  if (!short_seqs.empty())
    short_chunks_as_rows(q, k_cache, v_cache, block_tables, lens, starts, short_seqs, scale, k_scales, v_scales, out);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    Inputs<T> in{q.data_ptr<float>(), reinterpret_cast<const T*>(k_cache.data_ptr()),
                 reinterpret_cast<const T*>(v_cache.data_ptr()),
                 quantized ? k_scales->data_ptr<float>() : nullptr, quantized ? v_scales->data_ptr<float>() : nullptr,
                 block_tables.data_ptr<int32_t>(), lens, starts, heads, kv_heads, D, k_cache.size(1),
                 k_cache.stride(0), k_cache.stride(1), block_tables.stride(0), float(scale), nullptr, nullptr};
    prefill_tiles<T>(in, num_seqs, tiled, out);
  };
  if (dtype == at::kFloat) run(float{});
#if LABKIT_AMX
  else if (dtype == at::kBFloat16 && amx && D % 32 == 0 && amx::usable()) {
    const Inputs<uint16_t> in{q.data_ptr<float>(), reinterpret_cast<const uint16_t*>(k_cache.data_ptr()),
                              reinterpret_cast<const uint16_t*>(v_cache.data_ptr()), nullptr, nullptr,
                              block_tables.data_ptr<int32_t>(), lens, starts, heads, kv_heads, D, k_cache.size(1),
                              k_cache.stride(0), k_cache.stride(1), block_tables.stride(0), float(scale), nullptr,
                              nullptr};
    amx::prefill_tiles(in, num_seqs, tiled, out);
  }
#endif
  else if (dtype == at::kBFloat16) run(uint16_t{});
  else if (dtype == at::kChar) run(int8_t{});
  else if (dtype == at::kFloat8_e4m3fn) run(vec::fp8_e4m3{});
  else TORCH_CHECK(false, "no kernel for cache dtype ", dtype);
  return out;
}

// Whether paged_prefill_attention_tiles runs a bf16 cache's tiles on AMX here: this build has the
// instructions (-march=native on a CPU with AMX-BF16) and the kernel lets this process use them.
bool amx_tiles() {
#if LABKIT_AMX
  return amx::usable();
#else
  return false;
#endif
}
