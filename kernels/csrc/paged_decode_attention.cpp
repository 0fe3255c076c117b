// Paged decode attention on a CPU, in C++: what production CPU engines compile.
//
// The same algorithm as the Triton kernel (paged_decode_attention.py) and the Numba loop
// (paged_decode_attention_cpu.py): each sequence walks its block table, block by block,
// with an online softmax. What C++ adds, and why it is faster than the Numba loop:
//
// * head_dim and the GQA group are compile-time constants (one instantiation per common
//   size), so every inner loop has a fixed trip count the compiler unrolls;
// * the block update (attend_block) is written once, over vec::Vec16 (vec.h: one AVX-512
//   register, two AVX2 registers, or 16 plain floats, chosen when the extension is built for
//   this CPU): the query group and its running output stay in vector registers for a whole
//   block, a token's scores are summed across lanes 16 tokens at a time, and exp is a vector
//   polynomial;
// * decode attention reads every cached K and V of the batch once and does little
//   arithmetic on each: it is bound by memory, and a block table scatters a sequence's
//   blocks, so the hardware prefetcher, which follows one contiguous stream, stalls at each
//   block boundary. While a block is computed, the next block of the table is prefetched,
//   row by row, as the current one is read (kPrefetchNextBlock);
// * the work is split with at::parallel_for, i.e. on torch's own OpenMP thread pool, the
//   one its matrix multiplies use: one pool for the whole step, no second runtime spinning
//   beside it.
//
// Measured on the 2-core Zen 4 (64 sequences of 200-600 tokens, SmolLM2's 9 query and
// 3 KV heads of 64, fp32): a scalar loop without prefetching 2.5-2.9 ms per layer
// (14-16 GB/s of K and V); with the next block prefetched into L1 (prefetcht0) 1.9 ms; with
// registers and lane sums as well 1.7-1.8 ms; prefetched into L2 (prefetcht1) 0.95 ms,
// 42 GB/s: the rate of a loop that only sums the same blocks, i.e. memory's.
// Prefetches into L1 queue behind its few miss buffers and stall the loads the arithmetic
// waits on; L2 has room for a whole block in flight.

// Cache layout (labkit.model.kv_cache): [num_blocks, block_size, num_kv_heads, head_dim],
// fp32 or bf16 (bf16 is widened to fp32 in registers: a bf16 number is the top half of the
// fp32 number with the same bits), or quantized (kernels/kv_quant.py): int8 or fp8 e4m3, one
// byte per number, with one fp32 scale per token and KV head in k_scales / v_scales
// [num_blocks, block_size, num_kv_heads]. The bytes are widened in registers as bf16 is, and the
// scales applied where they cost least: a token's K scale multiplies its score (q . (s k) =
// s (q . k): one multiply per token, not per number), its V scale its weight in the sum of
// values (the softmax denominator takes the weight unscaled). q is fp32 [num_seqs, num_heads,
// head_dim]; out likewise.
// The Python wrapper has checked every shape, dtype, context length and block id: this
// loop trusts them.

// ATen's own headers, not <torch/extension.h>: these kernels need tensors, two factory
// functions and the thread pool, not pybind11 and torch's Python API (bindings.cpp alone
// includes those). Compiling a file that holds nothing but that header takes 30 s at -O3; these
// four headers, 6 s (2-core Zen 4): a build's CPU time went from 117 to 75-92 s.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

using vec::Vec16;

constexpr int kMaxGroup = 8;       // query heads per KV head (GQA group), at most
constexpr int kMaxBlockSize = 64;  // tokens per block, at most
constexpr int kChunks = kMaxBlockSize / Vec16::size;  // 16-token vectors of scores per block, at most
constexpr bool kPrefetchNextBlock = true;
constexpr float kMinusInfinity = -1e30f;  // finite: exp(-1e30 - m) is 0 all the same, and -ffast-math
                                          // may assume there are no infinities

// Ask for one cache line to be brought into L2 (locality 2: prefetcht1 on x86), not L1:
// see the measurements at the top.
inline void prefetch_line(const void* p) { __builtin_prefetch(p, 0, 2); }

// Whether a cache of T stores quantized numbers, which come with one scale per token and head.
template <typename T>
constexpr bool kQuantized = std::is_same_v<T, int8_t> || std::is_same_v<T, vec::fp8_e4m3>;

template <typename T, int D>
inline void prefetch_head_row(const T* row) {
  constexpr int kBytes = D * int(sizeof(T));
  for (int x = 0; x < kBytes; x += 64) prefetch_line(reinterpret_cast<const char*>(row) + x);
}

// Where the next block of the sequence lies, so that its rows can be prefetched while the
// current block is computed; rows == 0 on the last block.
template <typename T>
struct NextBlock {
  const T* k;
  const T* v;
  int rows;
};

// One KV head's query group and its running softmax state: the maximum score m, the
// denominator total and the unnormalised output acc, per query head. In memory between
// blocks; in registers within one (attend_block).
template <int D>
struct GroupState {
  float q[kMaxGroup][D];
  float acc[kMaxGroup][D];
  float m[kMaxGroup];
  float total[kMaxGroup];
};

// Fold the first `used` tokens of one block into the running state of every query group
// (the FlashAttention update). kb / vb point at the block's first token row (KV head 0);
// consecutive tokens are row_stride elements apart. The block is read one KV head at a time
// (that head's part of each token row, 64-256 bytes); the next block's rows of that head are
// prefetched as they are read. A quantized cache's block comes with its scales, ksb / vsb
// (token o, head h at o * num_kv_heads + h); nullptr otherwise.
//
// G > 0 fixes the group size at compile time (the common ones): the G x D query and the G x D
// running output then fit in vector registers (AVX-512: 3 x 4 + 3 x 4 zmm for SmolLM2) and
// every loop over g and c unrolls. G == 0 takes the group at run time (up to kMaxGroup), the
// same code with a loop bound the compiler cannot unroll: correct for any group, not tuned.
template <typename T, int D, int G>
inline void attend_block(GroupState<D>* st, int64_t num_kv_heads, int group_at_run_time, const T* kb,
                         const T* vb, const float* ksb, const float* vsb, int used, int64_t row_stride,
                         NextBlock<T> next) {
  static_assert(D % Vec16::size == 0, "head_dim must be a multiple of 16");
  constexpr int C = D / Vec16::size;  // vectors per head row
  constexpr int kG = G > 0 ? G : kMaxGroup;  // room for the group
  const int group = G > 0 ? G : group_at_run_time;
  const int chunks = (used + Vec16::size - 1) / Vec16::size;
  const auto tokens_in = [used](int ch) { return std::min(Vec16::size, used - ch * Vec16::size); };  // 1..16
  for (int64_t h = 0; h < num_kv_heads; ++h) {
    GroupState<D>& s = st[h];
    Vec16 p[kG][kChunks];  // scores, then probabilities: lane i of p[g][ch] is token 16 ch + i
    // A quantized block: this head's scales of its tokens, side by side (lanes past `used`: 0).
    alignas(64) float k_scale[kQuantized<T> ? kMaxBlockSize : 1];
    alignas(64) float v_scale[kQuantized<T> ? kMaxBlockSize : 1];
    if constexpr (kQuantized<T>) {
      for (int o = 0; o < chunks * Vec16::size; ++o) {
        k_scale[o] = o < used ? ksb[o * num_kv_heads + h] : 0.f;
        v_scale[o] = o < used ? vsb[o * num_kv_heads + h] : 0.f;
      }
    }
    // 1. scores, 16 tokens at a time. A token's dot product with query head g is left as 16
    //    lane-wise partial sums (part[g][i]); once 16 tokens are in, one transpose-and-add
    //    (vec::sum_lanes) turns them into one vector of 16 scores, instead of 16 horizontal sums.
    {
      Vec16 q[kG][C];
      for (int g = 0; g < group; ++g)
        for (int c = 0; c < C; ++c) q[g][c] = Vec16::load(s.q[g] + c * Vec16::size);
      for (int ch = 0; ch < chunks; ++ch) {
        Vec16 part[kG][Vec16::size];
        const int n = tokens_in(ch);
        for (int i = 0; i < n; ++i) {
          const int o = ch * Vec16::size + i;
          if (kPrefetchNextBlock && o < next.rows) prefetch_head_row<T, D>(next.k + o * row_stride + h * D);
          const T* k = kb + o * row_stride + h * D;
          Vec16 kv[C];
          for (int c = 0; c < C; ++c) kv[c] = Vec16::load(k + c * Vec16::size);  // bf16: widened here
          for (int g = 0; g < group; ++g) {
            Vec16 acc = q[g][0] * kv[0];
            for (int c = 1; c < C; ++c) acc = vec::fma(q[g][c], kv[c], acc);
            part[g][i] = acc;
          }
        }
        for (int i = n; i < Vec16::size; ++i)  // past the block's last token: scores of 0, masked below
          for (int g = 0; g < group; ++g) part[g][i] = Vec16::zero();
        for (int g = 0; g < group; ++g) p[g][ch] = vec::sum_lanes(part[g]);
        if constexpr (kQuantized<T>) {  // q . (s k) = s (q . k): each token's K scale, once per score
          const Vec16 ks = Vec16::load(k_scale + ch * Vec16::size);
          for (int g = 0; g < group; ++g) p[g][ch] = p[g][ch] * ks;
        }
      }
    }
    // 2. online softmax: a new maximum rescales what was accumulated so far. Lanes past
    //    `used` (in the last chunk) take no part: -infinity for the maximum, 0 after exp.
    float alpha[kG];  // how much the new maximum shrinks what was accumulated so far
    for (int g = 0; g < group; ++g) {
      Vec16 mx = Vec16::all(s.m[g]);
      for (int ch = 0; ch < chunks; ++ch)
        mx = vec::max(mx, p[g][ch].first(tokens_in(ch), kMinusInfinity));
      const float m_new = mx.reduce_max();
      const Vec16 m = Vec16::all(m_new);
      Vec16 sum = Vec16::zero();
      for (int ch = 0; ch < chunks; ++ch) {
        p[g][ch] = vec::exp(p[g][ch] - m).first(tokens_in(ch));
        sum = sum + p[g][ch];
      }
      alpha[g] = std::exp(s.m[g] - m_new);
      s.total[g] = s.total[g] * alpha[g] + sum.reduce_sum();
      s.m[g] = m_new;
    }
    // 3. values, weighted by the unnormalised probabilities, into the running output (in
    //    registers for the block). Each token's weight is broadcast to a whole vector, so the
    //    probabilities go through memory once, as plain floats.
    alignas(64) float w[kG][kMaxBlockSize];
    for (int g = 0; g < group; ++g)
      for (int ch = 0; ch < chunks; ++ch) {
        if constexpr (kQuantized<T>)  // each token's V scale joins its weight (the denominator has it unscaled)
          (p[g][ch] * Vec16::load(v_scale + ch * Vec16::size)).store(w[g] + ch * Vec16::size);
        else
          p[g][ch].store(w[g] + ch * Vec16::size);
      }
    Vec16 acc[kG][C];
    for (int g = 0; g < group; ++g) {
      const Vec16 a = Vec16::all(alpha[g]);
      for (int c = 0; c < C; ++c) acc[g][c] = Vec16::load(s.acc[g] + c * Vec16::size) * a;
    }
    for (int o = 0; o < used; ++o) {
      if (kPrefetchNextBlock && o < next.rows) prefetch_head_row<T, D>(next.v + o * row_stride + h * D);
      const T* v = vb + o * row_stride + h * D;
      Vec16 vv[C];
      for (int c = 0; c < C; ++c) vv[c] = Vec16::load(v + c * Vec16::size);
      for (int g = 0; g < group; ++g) {
        const Vec16 wg = Vec16::all(w[g][o]);
        for (int c = 0; c < C; ++c) acc[g][c] = vec::fma(wg, vv[c], acc[g][c]);
      }
    }
    for (int g = 0; g < group; ++g)
      for (int c = 0; c < C; ++c) acc[g][c].store(s.acc[g] + c * Vec16::size);
  }
}

template <typename T, int D, int G>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& context_lens, const int32_t* row_seq, float scale,
            const float* k_scales, const float* v_scales, at::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int group = int(num_heads / num_kv_heads);
  const int64_t block_stride = k_cache.stride(0), row_stride = k_cache.stride(1);
  const int64_t scale_block_stride = block_size * num_kv_heads;  // scales: contiguous [blocks, block_size, kv_heads]
  const int64_t table_stride = block_tables.stride(0);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const T* kp = reinterpret_cast<const T*>(k_cache.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v_cache.data_ptr());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();

  // One task per query row (decode: per sequence); it visits each block once and serves
  // all its KV heads from it, so every cache line of the block is fetched once. Rows differ
  // in length (16 to thousands of tokens), so a static split of the batch would leave one
  // thread idle while the other finishes the long ones: each thread takes the next row
  // when it is free, longest first. Prefill rows (row_seq given) come chunk by chunk, each
  // chunk's last (longest) row first: the rows that read the same blocks run together,
  // while those blocks are in cache, and each chunk ends with its shortest rows.
  std::vector<int64_t> order(num_seqs);
  for (int64_t s = 0; s < num_seqs; ++s) order[s] = s;
  if (row_seq == nullptr)
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return lens[a] > lens[b]; });
  else
    std::reverse(order.begin(), order.end());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<GroupState<D>> state(num_kv_heads);
    for (int64_t i = next++; i < num_seqs; i = next++) {
      const int64_t s = order[i];
      const float* qs = qp + s * num_heads * D;
      for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
        GroupState<D>& st = state[kvh];
        for (int g = 0; g < group; ++g) {
          for (int d = 0; d < D; ++d) {
            st.q[g][d] = qs[(kvh * group + g) * D + d] * scale;
            st.acc[g][d] = 0.f;
          }
          st.m[g] = kMinusInfinity;
          st.total[g] = 0.f;
        }
      }
      const int64_t n = lens[s];
      const int32_t* table = tables + (row_seq == nullptr ? s : row_seq[s]) * table_stride;
      const int64_t num_blocks = (n + block_size - 1) / block_size;
      for (int64_t b = 0; b < num_blocks; ++b) {
        const int used = int(std::min(block_size, n - b * block_size));
        const T* kb = kp + table[b] * block_stride;
        const T* vb = vp + table[b] * block_stride;
        const bool last = b + 1 == num_blocks;
        const int64_t nb = last ? table[b] : table[b + 1];
        const NextBlock<T> next{kp + nb * block_stride, vp + nb * block_stride,
                                last ? 0 : int(std::min(block_size, n - (b + 1) * block_size))};
        const float* ksb = k_scales ? k_scales + table[b] * scale_block_stride : nullptr;
        const float* vsb = v_scales ? v_scales + table[b] * scale_block_stride : nullptr;
        attend_block<T, D, G>(state.data(), num_kv_heads, group, kb, vb, ksb, vsb, used, row_stride, next);
      }
      float* os = op + s * num_heads * D;
      for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
        const GroupState<D>& st = state[kvh];
        for (int g = 0; g < group; ++g) {
          const float inv = n > 0 ? 1.f / st.total[g] : 0.f;
          for (int d = 0; d < D; ++d) os[(kvh * group + g) * D + d] = st.acc[g][d] * inv;
        }
      }
    }
  });
}

// The group sizes of common models get their own compiled loop (see attend_block).
// (ks, vs: a quantized cache's scales, nullptr otherwise.)
template <typename T, int D>
void decode_for_group(int64_t group, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& bt, const at::Tensor& cl, const int32_t* row_seq, float scale,
                      const float* ks, const float* vs, at::Tensor& out) {
  switch (group) {
    case 1: decode<T, D, 1>(q, k, v, bt, cl, row_seq, scale, ks, vs, out); break;
    case 2: decode<T, D, 2>(q, k, v, bt, cl, row_seq, scale, ks, vs, out); break;
    case 3: decode<T, D, 3>(q, k, v, bt, cl, row_seq, scale, ks, vs, out); break;
    case 4: decode<T, D, 4>(q, k, v, bt, cl, row_seq, scale, ks, vs, out); break;
    case 8: decode<T, D, 8>(q, k, v, bt, cl, row_seq, scale, ks, vs, out); break;
    default: decode<T, D, 0>(q, k, v, bt, cl, row_seq, scale, ks, vs, out);
  }
}

template <typename T>
bool decode_for_head_dim(int64_t head_dim, int64_t group, const at::Tensor& q, const at::Tensor& k,
                         const at::Tensor& v, const at::Tensor& bt, const at::Tensor& cl, const int32_t* row_seq,
                         float scale, const float* ks, const float* vs, at::Tensor& out) {
  switch (head_dim) {  // small head sizes (test models) share the run-time-group loop
    case 16: decode<T, 16, 0>(q, k, v, bt, cl, row_seq, scale, ks, vs, out); return true;
    case 32: decode<T, 32, 0>(q, k, v, bt, cl, row_seq, scale, ks, vs, out); return true;
    case 64: decode_for_group<T, 64>(group, q, k, v, bt, cl, row_seq, scale, ks, vs, out); return true;
    case 128: decode_for_group<T, 128>(group, q, k, v, bt, cl, row_seq, scale, ks, vs, out); return true;
    default: return false;
  }
}

}  // namespace

// True when this build has a kernel for these shapes (the wrapper falls back otherwise).
bool supports(int64_t head_dim, int64_t group, int64_t block_size) {
  return (head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128) && group >= 1 &&
         group <= kMaxGroup && block_size >= 1 && block_size <= kMaxBlockSize;
}

// True when (head_dim, group) runs vectorized: SIMD registers (an AVX-512 or AVX2 build, not
// the portable one) and a head size and group with their own compiled loop. The prefill
// wrapper takes the row kernel only then, where it was measured faster than SDPA.
bool vectorized(int64_t head_dim, int64_t group) {
  const bool simd = std::string(vec::kIsa) != "portable";
  return simd && (head_dim == 64 || head_dim == 128) &&
         (group == 1 || group == 2 || group == 3 || group == 4 || group == 8);
}

// Which of vec.h's implementations this build was compiled with: "avx512", "avx2" or "portable".
std::string isa() { return vec::kIsa; }

namespace {

at::Tensor attend_rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_tables, const at::Tensor& context_lens, const int32_t* row_seq,
                       double scale, const c10::optional<at::Tensor>& k_scales,
                       const c10::optional<at::Tensor>& v_scales) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be contiguous fp32");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "K and V caches must be contiguous and of one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt &&
                  context_lens.is_contiguous() && block_tables.stride(1) == 1,
              "block tables and context lengths must be int32, rows contiguous");
  const int64_t head_dim = q.size(2), group = q.size(1) / k_cache.size(2);
  TORCH_CHECK(supports(head_dim, group, k_cache.size(1)), "no kernel for head_dim ", head_dim, ", group ", group,
              ", block size ", k_cache.size(1));
  const auto dtype = k_cache.scalar_type();
  const bool quantized = dtype == at::kChar || dtype == at::kFloat8_e4m3fn;
  TORCH_CHECK(k_scales.has_value() == quantized && v_scales.has_value() == quantized,
              quantized ? "a quantized (int8, fp8) cache needs its k_scales and v_scales"
                        : "k_scales and v_scales belong to a quantized (int8, fp8) cache");
  const float* ks = nullptr;
  const float* vs = nullptr;
  if (quantized) {
    for (const at::Tensor* s : {&*k_scales, &*v_scales})
      TORCH_CHECK(s->scalar_type() == at::kFloat && s->is_contiguous() && s->dim() == 3 &&
                      s->size(0) == k_cache.size(0) && s->size(1) == k_cache.size(1) && s->size(2) == k_cache.size(2),
                  "scales must be contiguous fp32 [num_blocks, block_size, num_kv_heads]");
    ks = k_scales->data_ptr<float>();
    vs = v_scales->data_ptr<float>();
  }
  at::Tensor out = at::empty_like(q);
  bool done = false;
  if (dtype == at::kFloat)
    done = decode_for_head_dim<float>(head_dim, group, q, k_cache, v_cache, block_tables, context_lens, row_seq,
                                      float(scale), ks, vs, out);
  else if (dtype == at::kBFloat16)
    done = decode_for_head_dim<uint16_t>(head_dim, group, q, k_cache, v_cache, block_tables, context_lens, row_seq,
                                         float(scale), ks, vs, out);
  else if (dtype == at::kChar)
    done = decode_for_head_dim<int8_t>(head_dim, group, q, k_cache, v_cache, block_tables, context_lens, row_seq,
                                       float(scale), ks, vs, out);
  else if (dtype == at::kFloat8_e4m3fn)
    done = decode_for_head_dim<vec::fp8_e4m3>(head_dim, group, q, k_cache, v_cache, block_tables, context_lens,
                                              row_seq, float(scale), ks, vs, out);
  TORCH_CHECK(done, "no kernel for cache dtype ", dtype);
  return out;
}

}  // namespace

// q fp32 [seqs, heads, d]; caches fp32, bf16, int8 or fp8 e4m3 [blocks, block_size, kv_heads, d],
// contiguous (the quantized ones with their fp32 scales [blocks, block_size, kv_heads], else None);
// block_tables int32 [seqs, max_blocks]; context_lens int32 [seqs]. Returns fp32 [seqs, heads, d].
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  const c10::optional<at::Tensor>& k_scales,
                                  const c10::optional<at::Tensor>& v_scales) {
  return attend_rows(q, k_cache, v_cache, block_tables, context_lens, nullptr, scale, k_scales, v_scales);
}

// Prefill as independent query rows: row r of q attends to the first row_lens[r] tokens of
// sequence row_seq[r] (its block table row), i.e. causally up to its own position. Rows of
// one chunk are consecutive. The same loop as decode, one query row at a time; it computes
// only the causal half and reads the cache in place, no gather. The simplest correct prefill
// on the paged cache; the CPU backend runs prefill_attention.cpp's tiles, which share each key
// among eight rows (1.8x faster), and its tests check the tiles against these rows.
at::Tensor paged_prefill_attention_rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                        const at::Tensor& block_tables, const at::Tensor& row_lens,
                                        const at::Tensor& row_seq, double scale,
                                        const c10::optional<at::Tensor>& k_scales,
                                        const c10::optional<at::Tensor>& v_scales) {
  TORCH_CHECK(row_seq.scalar_type() == at::kInt && row_seq.is_contiguous() && row_seq.numel() == q.size(0) &&
                  row_lens.numel() == q.size(0),
              "row_seq and row_lens must be contiguous int32, one per query row");
  return attend_rows(q, k_cache, v_cache, block_tables, row_lens, row_seq.data_ptr<int32_t>(), scale, k_scales,
                     v_scales);
}
