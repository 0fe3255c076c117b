// Fused element-wise ops for the CPU backend: one pass over memory where torch takes several.
//
// At batch 64 a decode step's element-wise work is many small torch ops (the rotary
// embedding alone is a chunk, four multiplies, a subtraction, an addition and a cat, then
// two index_copy_ into the cache), each reading and writing its whole tensor and paying a
// dispatch. Production engines fuse them (vLLM's CPU build: rotary_embedding,
// reshape_and_cache, fused_add_rms_norm, silu_and_mul). These are the same maths as the
// readable versions in labkit/model/llama.py, computed in fp32 whatever the storage dtype
// (fp32 or bf16), on torch's thread pool.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) {
  const uint32_t u = uint32_t(p[i]) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(uint16_t* p, int64_t i, float x) {  // fp32 -> bf16, round to nearest even
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  u += 0x7fff + ((u >> 16) & 1);
  p[i] = uint16_t(u >> 16);
}

template <typename T>
T* ptr(const at::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

// Rotate one head's pairs (x[i], x[i + d/2]) by the token's angles ("rotate half").
template <typename T>
inline void rotate(const T* x, T* out, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = load(x, i), x2 = load(x, i + half);
    store(out, i, x1 * cos[i] - x2 * sin[i]);
    store(out, i + half, x2 * cos[i] + x1 * sin[i]);
  }
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
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
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
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* xt = xp + t * h;
      float sum = 0.f;
      if (rp) {  // the residual stream x absorbs the sub-layer's output first (in place)
        const T* rt = rp + t * h;
        for (int64_t i = 0; i < h; ++i) {
          const float v = load(xt, i) + load(rt, i);
          store(xt, i, v);
        }
      }
      for (int64_t i = 0; i < h; ++i) {
        const float v = load(xt, i);
        sum += v * v;
      }
      const float inv = 1.f / std::sqrt(sum / float(h) + e);
      T* ot = op + t * h;
      // as the reference: normalise in fp32, round to the storage dtype, then scale by the weight
      for (int64_t i = 0; i < h; ++i) {
        float y = load(xt, i) * inv;
        if (sizeof(T) == 2) {  // round to bf16 before the weight, as .to(x.dtype) does
          T tmp;
          store(&tmp, 0, y);
          y = load(&tmp, 0);
        }
        store(ot, i, load(w, i) * y);
      }
    }
  });
}

template <typename T>
void silu_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t n = x.size(0), inter = out.size(1);
  const T* xp = ptr<T>(x);
  T* op = ptr<T>(out);
  at::parallel_for(0, n, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* gate = xp + t * 2 * inter;
      const T* up = gate + inter;
      T* ot = op + t * inter;
      for (int64_t i = 0; i < inter; ++i) {
        const float g = load(gate, i);
        store(ot, i, g / (1.f + std::exp(-g)) * load(up, i));
      }
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
