// Paged decode attention on a CPU, in C++: what production CPU engines compile.
//
// The same algorithm as the Triton kernel (paged_decode_attention.py) and the Numba loop
// (paged_decode_attention_cpu.py): each sequence walks its block table, block by block,
// with an online softmax. What C++ adds, and why it is faster than the Numba loop:
//
// * head_dim and the GQA group are compile-time constants (one instantiation per common
//   size), so every inner loop has a fixed trip count the compiler unrolls;
// * on AVX-512 CPUs the query group and its running output stay in vector registers for a
//   whole block, a token's scores are summed across lanes 16 tokens at a time, and exp is a
//   vector polynomial (attend_block_avx512); elsewhere a portable loop (attend_block);
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
// 3 KV heads of 64, fp32): the portable loop without prefetching 2.5-2.9 ms per layer
// (14-16 GB/s of K and V); with the next block prefetched into L1 (prefetcht0) 1.9 ms; with
// registers and lane sums as well 1.7-1.8 ms; prefetched into L2 (prefetcht1) 0.95 ms,
// 42 GB/s: the rate of a loop that only sums the same blocks, i.e. memory's.
// Prefetches into L1 queue behind its few miss buffers and stall the loads the arithmetic
// waits on; L2 has room for a whole block in flight.

// Cache layout (labkit.model.kv_cache): [num_blocks, block_size, num_kv_heads, head_dim],
// fp32 or bf16 (bf16 is widened to fp32 in registers: a bf16 number is the top half of the
// fp32 number with the same bits). q is fp32 [num_seqs, num_heads, head_dim]; out likewise.
// The Python wrapper has checked every shape, dtype, context length and block id: this
// loop trusts them.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kMaxGroup = 8;       // query heads per KV head (GQA group), at most
constexpr int kMaxBlockSize = 64;  // tokens per block, at most
constexpr int kMaxKvHeads = 16;    // KV heads per pass over a block (more: several passes)
constexpr bool kPrefetchNextBlock = true;

// Ask for one cache line to be brought into L2 (locality 2: prefetcht1 on x86), not L1:
// see the measurements at the top.
inline void prefetch_line(const void* p) { __builtin_prefetch(p, 0, 2); }

// Where the next block of the sequence lies, so that its rows can be prefetched while the
// current block is computed; rows == 0 on the last block.
template <typename T>
struct NextBlock {
  const T* k;
  const T* v;
  int rows;
};

inline float widen(float x) { return x; }
inline float widen(uint16_t bits) {  // bf16 -> fp32: the 16 bits become the high half
  const uint32_t u = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// One KV head's query group and its running softmax state: the maximum score m, the
// denominator total and the unnormalised output acc, per query head.
template <int D>
struct GroupState {
  float q[kMaxGroup][D];
  float acc[kMaxGroup][D];
  float m[kMaxGroup];
  float total[kMaxGroup];
};

// Fold the first `used` tokens of one block into the running state of every query group
// (the FlashAttention update), portably. kb / vb point at the first token's row for KV head
// 0 of this range of KV heads; consecutive tokens are row_stride elements apart. The block
// is read token by token, each token's row (all its KV heads, contiguous) once, front to
// back, and the same rows of the next block are prefetched as it goes.
//
// G > 0 fixes the group size at compile time (the common ones), G == 0 takes it at run
// time: with G and D fixed, every inner loop has a constant trip count that the compiler
// unrolls and vectorizes.
template <typename T, int D, int G>
inline void attend_block(GroupState<D>* st, int64_t num_kv_heads, int group_at_run_time, const T* kb,
                         const T* vb, int used, int64_t row_stride, NextBlock<T> next) {
  const int group = G > 0 ? G : group_at_run_time;
  constexpr int kRows = G > 0 ? G : kMaxGroup;
  const int64_t row_bytes = num_kv_heads * D * sizeof(T);
  float p[kMaxKvHeads][kRows][kMaxBlockSize];  // scores, then probabilities; never leave L1
  // 1. scores: each key row against every query head of its group
  for (int o = 0; o < used; ++o) {
    if (kPrefetchNextBlock && o < next.rows)
      for (int64_t x = 0; x < row_bytes; x += 64) {
        prefetch_line(reinterpret_cast<const char*>(next.k + o * row_stride) + x);
        prefetch_line(reinterpret_cast<const char*>(next.v + o * row_stride) + x);
      }
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      float k[D];
      for (int d = 0; d < D; ++d) k[d] = widen(kb[o * row_stride + h * D + d]);
      for (int g = 0; g < group; ++g) {
        float s = 0.f;
        for (int d = 0; d < D; ++d) s += st[h].q[g][d] * k[d];
        p[h][g][o] = s;
      }
    }
  }
  // 2. online softmax: a new maximum rescales what was accumulated so far
  for (int64_t h = 0; h < num_kv_heads; ++h)
    for (int g = 0; g < group; ++g) {
      float m_new = st[h].m[g];
      for (int o = 0; o < used; ++o) m_new = std::max(m_new, p[h][g][o]);
      const float alpha = std::exp(st[h].m[g] - m_new);
      st[h].total[g] *= alpha;
      for (int d = 0; d < D; ++d) st[h].acc[g][d] *= alpha;
      float sum = 0.f;
      for (int o = 0; o < used; ++o) {
        p[h][g][o] = std::exp(p[h][g][o] - m_new);
        sum += p[h][g][o];
      }
      st[h].total[g] += sum;
      st[h].m[g] = m_new;
    }
  // 3. values, weighted by the unnormalised probabilities
  for (int o = 0; o < used; ++o)
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      float v[D];
      for (int d = 0; d < D; ++d) v[d] = widen(vb[o * row_stride + h * D + d]);
      for (int g = 0; g < group; ++g) {
        const float w = p[h][g][o];
        for (int d = 0; d < D; ++d) st[h].acc[g][d] += w * v[d];
      }
    }
}

#if defined(__AVX512F__)
// ---- AVX-512: the same block update, with the query group in registers -------------------
// Against attend_block: the G x D query and the G x D running output of one KV head stay in
// vector registers for the whole block instead of being re-read from memory per token; a
// token's G dot products are left as 16-lane partial sums and summed across lanes 16 tokens
// at a time (one transpose-and-add instead of 16 horizontal sums); exp is a vector
// polynomial. The block is read one KV head at a time (its rows are 64-256 bytes of each
// token's row); the next block's rows of that head are prefetched as they are read.

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // 16 bf16 -> 16 fp32: the bits become the high half
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// exp(x) = 2^n * exp(r), n = round(x / ln 2), |r| <= ln(2)/2: Cephes' degree-6 polynomial
// for exp(r) (about 1 ulp), 2^n applied by scalef, which underflows to 0 cleanly.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // x - n ln 2, ln 2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// Lane i of the result is the sum of the 16 lanes of r[i]: sixteen horizontal sums done as
// one transpose-and-add, four rounds of pairwise shuffles (45 instructions, not ~130).
inline __m512 sum_lanes16(const __m512* r) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] for a = r[2i], b = r[2i+1]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]), _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: that lane's sums of r[4i .. 4i+3]
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(3, 1, 3, 1)));
}

template <typename T, int D>
inline void prefetch_head_row(const T* row) {
  constexpr int kBytes = D * int(sizeof(T));
  for (int x = 0; x < kBytes; x += 64) prefetch_line(reinterpret_cast<const char*>(row) + x);
}

template <typename T, int D, int G>
inline void attend_block_avx512(GroupState<D>* st, int64_t num_kv_heads, const T* kb, const T* vb, int used,
                                int64_t row_stride, NextBlock<T> next) {
  constexpr int C = D / 16;  // 16-float vectors per head row
  const int chunks = (used + 15) / 16;
  for (int64_t h = 0; h < num_kv_heads; ++h) {
    GroupState<D>& s = st[h];
    __m512 p[G][kMaxBlockSize / 16];  // scores, then probabilities, 16 tokens per vector
    // 1. scores, 16 tokens at a time
    {
      __m512 q[G][C];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) q[g][c] = _mm512_loadu_ps(s.q[g] + c * 16);
      for (int ch = 0; ch < chunks; ++ch) {
        __m512 part[G][16];  // part[g][i]: the 16 lane products of token i, summed lane-wise
        const int n = std::min(16, used - ch * 16);
        for (int i = 0; i < n; ++i) {
          const int o = ch * 16 + i;
          if (kPrefetchNextBlock && o < next.rows) prefetch_head_row<T, D>(next.k + o * row_stride + h * D);
          const T* k = kb + o * row_stride + h * D;
          __m512 kv[C];
          for (int c = 0; c < C; ++c) kv[c] = load16(k + c * 16);
          for (int g = 0; g < G; ++g) {
            __m512 acc = _mm512_mul_ps(q[g][0], kv[0]);
            for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(q[g][c], kv[c], acc);
            part[g][i] = acc;
          }
        }
        for (int i = n; i < 16; ++i)
          for (int g = 0; g < G; ++g) part[g][i] = _mm512_setzero_ps();
        for (int g = 0; g < G; ++g) p[g][ch] = sum_lanes16(part[g]);
      }
    }
    // 2. online softmax; lanes past `used` are masked out
    float alpha[G];  // how much the new maximum shrinks what was accumulated so far
    for (int g = 0; g < G; ++g) {
      float m_new = s.m[g];
      for (int ch = 0; ch < chunks; ++ch) {
        const __mmask16 valid = __mmask16((1u << std::min(16, used - ch * 16)) - 1u);
        m_new = std::max(m_new, _mm512_mask_reduce_max_ps(valid, p[g][ch]));
      }
      __m512 sum = _mm512_setzero_ps();
      for (int ch = 0; ch < chunks; ++ch) {
        const __mmask16 valid = __mmask16((1u << std::min(16, used - ch * 16)) - 1u);
        p[g][ch] = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(p[g][ch], _mm512_set1_ps(m_new))));
        sum = _mm512_add_ps(sum, p[g][ch]);
      }
      alpha[g] = std::exp(s.m[g] - m_new);
      s.total[g] = s.total[g] * alpha[g] + _mm512_reduce_add_ps(sum);
      s.m[g] = m_new;
    }
    // 3. values, weighted by the unnormalised probabilities, into the running output
    alignas(64) float w[G][kMaxBlockSize];
    for (int g = 0; g < G; ++g)
      for (int ch = 0; ch < chunks; ++ch) _mm512_store_ps(w[g] + ch * 16, p[g][ch]);
    __m512 acc[G][C];
    for (int g = 0; g < G; ++g) {
      const __m512 a = _mm512_set1_ps(alpha[g]);
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_mul_ps(_mm512_loadu_ps(s.acc[g] + c * 16), a);
    }
    for (int o = 0; o < used; ++o) {
      if (kPrefetchNextBlock && o < next.rows) prefetch_head_row<T, D>(next.v + o * row_stride + h * D);
      const T* v = vb + o * row_stride + h * D;
      __m512 vv[C];
      for (int c = 0; c < C; ++c) vv[c] = load16(v + c * 16);
      for (int g = 0; g < G; ++g) {
        const __m512 wg = _mm512_set1_ps(w[g][o]);
        for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(wg, vv[c], acc[g][c]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(s.acc[g] + c * 16, acc[g][c]);
  }
}
#endif  // __AVX512F__

template <typename T, int D, int G>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& context_lens, const int32_t* row_seq, float scale,
            at::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int group = int(num_heads / num_kv_heads);
  const int64_t block_stride = k_cache.stride(0), row_stride = k_cache.stride(1);
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
          st.m[g] = -1e30f;  // a finite "minus infinity": exp(-1e30 - m) is 0 all the same
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
#if defined(__AVX512F__)
        if constexpr (G > 0) {
          attend_block_avx512<T, D, G>(state.data(), num_kv_heads, kb, vb, used, row_stride, next);
          continue;
        }
#endif
        for (int64_t h0 = 0; h0 < num_kv_heads; h0 += kMaxKvHeads)
          attend_block<T, D, G>(state.data() + h0, std::min<int64_t>(kMaxKvHeads, num_kv_heads - h0), group,
                                kb + h0 * D, vb + h0 * D, used, row_stride,
                                NextBlock<T>{next.k + h0 * D, next.v + h0 * D, next.rows});
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
template <typename T, int D>
void decode_for_group(int64_t group, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& bt, const at::Tensor& cl, const int32_t* row_seq, float scale, at::Tensor& out) {
  switch (group) {
    case 1: decode<T, D, 1>(q, k, v, bt, cl, row_seq, scale, out); break;
    case 2: decode<T, D, 2>(q, k, v, bt, cl, row_seq, scale, out); break;
    case 3: decode<T, D, 3>(q, k, v, bt, cl, row_seq, scale, out); break;
    case 4: decode<T, D, 4>(q, k, v, bt, cl, row_seq, scale, out); break;
    case 8: decode<T, D, 8>(q, k, v, bt, cl, row_seq, scale, out); break;
    default: decode<T, D, 0>(q, k, v, bt, cl, row_seq, scale, out);
  }
}

template <typename T>
bool decode_for_head_dim(int64_t head_dim, int64_t group, const at::Tensor& q, const at::Tensor& k,
                         const at::Tensor& v, const at::Tensor& bt, const at::Tensor& cl, const int32_t* row_seq,
                         float scale, at::Tensor& out) {
  switch (head_dim) {  // small head sizes (test models) share the run-time-group loop
    case 16: decode<T, 16, 0>(q, k, v, bt, cl, row_seq, scale, out); return true;
    case 32: decode<T, 32, 0>(q, k, v, bt, cl, row_seq, scale, out); return true;
    case 64: decode_for_group<T, 64>(group, q, k, v, bt, cl, row_seq, scale, out); return true;
    case 128: decode_for_group<T, 128>(group, q, k, v, bt, cl, row_seq, scale, out); return true;
    default: return false;
  }
}

}  // namespace

// True when this build has a kernel for these shapes (the wrapper falls back otherwise).
bool supports(int64_t head_dim, int64_t group, int64_t block_size) {
  return (head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128) && group >= 1 &&
         group <= kMaxGroup && block_size >= 1 && block_size <= kMaxBlockSize;
}

// True when (head_dim, group) runs the AVX-512 block update (compiled for this CPU, and a
// head size and group with their own loop): the prefill wrapper takes the row kernel only
// then, where it was measured faster than SDPA.
bool vectorized(int64_t head_dim, int64_t group) {
#if defined(__AVX512F__)
  return (head_dim == 64 || head_dim == 128) && (group == 1 || group == 2 || group == 3 || group == 4 || group == 8);
#else
  (void)head_dim;
  (void)group;
  return false;
#endif
}

namespace {

at::Tensor attend_rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_tables, const at::Tensor& context_lens, const int32_t* row_seq,
                       double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be contiguous fp32");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "K and V caches must be contiguous and of one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt &&
                  context_lens.is_contiguous() && block_tables.stride(1) == 1,
              "block tables and context lengths must be int32, rows contiguous");
  const int64_t head_dim = q.size(2), group = q.size(1) / k_cache.size(2);
  TORCH_CHECK(supports(head_dim, group, k_cache.size(1)), "no kernel for head_dim ", head_dim, ", group ", group,
              ", block size ", k_cache.size(1));
  at::Tensor out = at::empty_like(q);
  bool done = false;
  if (k_cache.scalar_type() == at::kFloat)
    done = decode_for_head_dim<float>(head_dim, group, q, k_cache, v_cache, block_tables, context_lens, row_seq,
                                      float(scale), out);
  else if (k_cache.scalar_type() == at::kBFloat16)
    done = decode_for_head_dim<uint16_t>(head_dim, group, q, k_cache, v_cache, block_tables, context_lens, row_seq,
                                         float(scale), out);
  TORCH_CHECK(done, "no kernel for cache dtype ", k_cache.scalar_type());
  return out;
}

}  // namespace

// q fp32 [seqs, heads, d]; caches fp32 or bf16 [blocks, block_size, kv_heads, d], contiguous;
// block_tables int32 [seqs, max_blocks]; context_lens int32 [seqs]. Returns fp32 [seqs, heads, d].
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  return attend_rows(q, k_cache, v_cache, block_tables, context_lens, nullptr, scale);
}

// Prefill as independent query rows: row r of q attends to the first row_lens[r] tokens of
// sequence row_seq[r] (its block table row), i.e. causally up to its own position. Rows of
// one chunk are consecutive. The same loop as decode, one query row at a time; it computes
// only the causal half and reads the cache in place, no gather.
at::Tensor paged_prefill_attention_rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                        const at::Tensor& block_tables, const at::Tensor& row_lens,
                                        const at::Tensor& row_seq, double scale) {
  TORCH_CHECK(row_seq.scalar_type() == at::kInt && row_seq.is_contiguous() && row_seq.numel() == q.size(0) &&
                  row_lens.numel() == q.size(0),
              "row_seq and row_lens must be contiguous int32, one per query row");
  return attend_rows(q, k_cache, v_cache, block_tables, row_lens, row_seq.data_ptr<int32_t>(), scale);
}
