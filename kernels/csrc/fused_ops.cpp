// Fused element-wise ops for the CPU backend: one pass over memory where torch takes several.
//
// At batch 64 a decode step's element-wise work is many small torch ops (the rotary
// embedding alone is a chunk, four multiplies, a subtraction, an addition and a cat, then
// two index_copy_ into the cache), each reading and writing its whole tensor and paying a
// dispatch. Production engines fuse them (vLLM's CPU build: rotary_embedding,
// reshape_and_cache, fused_add_rms_norm, silu_and_mul). These are the same maths as the
// readable versions in labkit/model/llama.py, computed in fp32 whatever the storage dtype
// (fp32 or bf16), on torch's thread pool, rows handed out as threads ask for them (parallel.h).

// ATen's own headers, not <torch/extension.h>: these kernels need tensors, two factory
// functions and the thread pool, not pybind11 and torch's Python API (bindings.cpp alone
// includes those). Compiling a file that holds nothing but that header takes 30 s at -O3; these
// four headers, 6 s (2-core Zen 4): a build's CPU time went from 117 to 75-92 s.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "parallel.h"
#include "vec.h"

// Every loop below walks a row 16 elements at a time over vec::Vec16 (vec.h: AVX-512, AVX2 or
// portable, chosen at build time), in fp32 whatever the storage type T (float, or uint16_t
// holding bf16 bits: widened on load, rounded to nearest even on store). A row whose length
// is not a multiple of 16 ends with one partial step (vec::load / vec::store of n < 16
// elements): no scalar copy of the loop body.

namespace {

using vec::Vec16;

template <typename T>
T* ptr(const at::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

// Call body(i, n) for i = 0, 16, 32, ... < len, with n = min(16, len - i) elements at i.
template <typename F>
inline void for_each_vector(int64_t len, F body) {
  for (int64_t i = 0; i < len; i += Vec16::size) body(i, int(std::min<int64_t>(Vec16::size, len - i)));
}

// Rotate one head's pairs (x[i], x[i + d/2]) by the token's angles ("rotate half").
template <typename T>
inline void rotate(const T* x, T* out, const float* cos, const float* sin, int64_t half) {
  for_each_vector(half, [&](int64_t i, int n) {
    const Vec16 x1 = vec::load(x + i, n), x2 = vec::load(x + half + i, n);
    const Vec16 c = vec::load(cos + i, n), s = vec::load(sin + i, n);
    vec::store(x1 * c - x2 * s, out + i, n);
    vec::store(x2 * c + x1 * s, out + half + i, n);
  });
}

template <typename T>
void rope_and_cache_impl(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
                         int64_t num_heads, at::Tensor& q_out) {
  const int64_t n = qkv.size(0), kv_heads = k_cache.size(2), d = k_cache.size(3), half = d / 2;
  const int64_t block_size = k_cache.size(1), row = qkv.stride(0);
  const T* x = ptr<T>(qkv);
  T* q = ptr<T>(q_out);
  T* kc = ptr<T>(k_cache);
  T* vc = ptr<T>(v_cache);
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  labkit::parallel_chunks(n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* xt = x + t * row;
      const float* ct = c + t * half;
      const float* st = s + t * half;
      for (int64_t h = 0; h < num_heads; ++h) rotate(xt + h * d, q + (t * num_heads + h) * d, ct, st, half);
      // slot = block * block_size + offset; in the cache a token's K (or V) row is kv_heads * d long
      const int64_t at = (slot[t] / block_size) * (block_size * kv_heads * d) + (slot[t] % block_size) * kv_heads * d;
      const T* k = xt + num_heads * d;
      const T* v = k + kv_heads * d;
      for (int64_t h = 0; h < kv_heads; ++h) rotate(k + h * d, kc + at + h * d, ct, st, half);
      std::memcpy(vc + at, v, sizeof(T) * kv_heads * d);
    }
  });
}

template <typename T>
void add_rms_norm_impl(const at::Tensor& x, const at::Tensor* delta, const at::Tensor& weight, double eps,
                       at::Tensor& out) {
  const int64_t n = x.size(0), h = x.size(1);
  T* xp = ptr<T>(x);
  const T* rp = delta ? ptr<T>(*delta) : nullptr;
  const T* w = ptr<T>(weight);
  T* op = ptr<T>(out);
  const float e = float(eps);
  labkit::parallel_chunks(n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* xt = xp + t * h;
      const T* rt = rp ? rp + t * h : nullptr;
      // the residual stream x absorbs the sub-layer's output first (in place, rounded to its
      // dtype as torch's x + delta is), and the sum of squares is of what was stored
      Vec16 squares = Vec16::zero();  // 16 partial sums (the zero lanes of a partial step add nothing)
      for_each_vector(h, [&](int64_t i, int n) {
        Vec16 v = vec::load(xt + i, n);
        if (rt) {
          v = vec::round_to<T>(v + vec::load(rt + i, n));  // exact in T: the store below rounds no further
          vec::store(v, xt + i, n);
        }
        squares = vec::fma(v, v, squares);
      });
      const Vec16 inv = Vec16::all(1.f / std::sqrt(squares.reduce_sum() / float(h) + e));
      T* ot = op + t * h;
      // as the reference: normalise in fp32, round to the storage dtype (.to(x.dtype)), then
      // scale by the weight, rounded once more on the store
      for_each_vector(h, [&](int64_t i, int n) {
        const Vec16 y = vec::round_to<T>(vec::load(xt + i, n) * inv);
        vec::store(vec::load(w + i, n) * y, ot + i, n);
      });
    }
  });
}

template <typename T>
void silu_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t n = x.size(0), inter = out.size(1);
  const T* xp = ptr<T>(x);
  T* op = ptr<T>(out);
  labkit::parallel_chunks(n, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* gate = xp + t * 2 * inter;
      const T* up = gate + inter;
      T* ot = op + t * inter;
      for_each_vector(inter, [&](int64_t i, int n) {
        vec::store(vec::silu(vec::load(gate + i, n)) * vec::load(up + i, n), ot + i, n);
      });
    }
  });
}

void check_dtype(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, what, " must be fp32 or bf16");
  TORCH_CHECK(t.device().is_cpu(), what, " must be on the CPU");
}

}  // namespace

// q = rope(qkv's q heads), and rope(k), v written into the cache at each token's slot.
// qkv [n, (H + 2 KV) * d] rows contiguous; cos, sin fp32 [n, d/2]; slots int64 [n];
// caches [blocks, block_size, KV, d] contiguous, of qkv's dtype. Returns q [n, H, d].
at::Tensor rope_and_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
                          int64_t num_heads) {
  check_dtype(qkv, "qkv");
  TORCH_CHECK(k_cache.scalar_type() == qkv.scalar_type() && v_cache.scalar_type() == qkv.scalar_type(),
              "the caches must have qkv's dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be [n, width] with contiguous rows");
  const int64_t n = qkv.size(0), kv = k_cache.size(2), d = k_cache.size(3);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * kv) * d && d % 2 == 0, "qkv width does not match the heads");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.numel() == n * d / 2 && sin.numel() == n * d / 2,
              "cos and sin must be contiguous fp32 [n, d/2]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == n,
              "slot_mapping must be int64 [n]");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < n; ++t)  // the writes below trust the slots: check them once, here
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot ", slot[t], " of token ", t, " is outside the cache (",
                num_slots, " slots)");
  at::Tensor q = at::empty({n, num_heads, d}, qkv.options());
  if (qkv.scalar_type() == at::kFloat) rope_and_cache_impl<float>(qkv, cos, sin, k_cache, v_cache, slots, num_heads, q);
  else rope_and_cache_impl<uint16_t>(qkv, cos, sin, k_cache, v_cache, slots, num_heads, q);
  return q;
}

// x is the residual stream [n, hidden]. If delta (a sub-layer's output) is given, x += delta,
// in place. Returns rms_norm(x) * weight, computed in fp32.
at::Tensor add_rms_norm(at::Tensor x, const c10::optional<at::Tensor>& delta, const at::Tensor& weight,
                        double eps) {
  check_dtype(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && weight.numel() == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "x must be contiguous [n, hidden] and weight [hidden] of its dtype");
  if (delta) TORCH_CHECK(delta->sizes() == x.sizes() && delta->is_contiguous() &&
                             delta->scalar_type() == x.scalar_type(), "delta must match x");
  at::Tensor out = at::empty_like(x);
  const at::Tensor* r = delta ? &*delta : nullptr;
  if (x.scalar_type() == at::kFloat) add_rms_norm_impl<float>(x, r, weight, eps, out);
  else add_rms_norm_impl<uint16_t>(x, r, weight, eps, out);
  return out;
}

// SwiGLU's middle: x = [gate | up] per row ([n, 2 * inter]); returns silu(gate) * up [n, inter].
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_dtype(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0, "x must be contiguous [n, 2 * inter]");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  if (x.scalar_type() == at::kFloat) silu_and_mul_impl<float>(x, out);
  else silu_and_mul_impl<uint16_t>(x, out);
  return out;
}

// exp of every element of an fp32 tensor, by vec.h's vector exp: what softmax and SiLU use,
// exposed so that its accuracy is tested (tests/test_cpu_vec.py) on every build.
at::Tensor vec_exp(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), "x must be an fp32 CPU tensor");
  const at::Tensor in = x.contiguous();
  at::Tensor out = at::empty_like(in);
  const float* xp = in.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for_each_vector(in.numel(), [&](int64_t i, int n) { vec::store(vec::exp(vec::load(xp + i, n)), op + i, n); });
  return out;
}
