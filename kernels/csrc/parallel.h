// Work handed out to torch's threads as they ask for it, not in equal shares fixed up front.
//
// at::parallel_for gives each thread one equal slice of the range, decided before any runs.
// That is the fastest split on an idle machine, and the slowest on a busy one: a step is as
// slow as its slowest thread, and on a small machine some thread is always slowed. A class's
// server shares its cores with its event loop, the benchmark client that measures it, a second
// notebook; when one of them takes a core for a millisecond, the thread on that core falls
// behind, and at the end of the loop the others wait for it. Here every thread takes the next
// chunk of the range when it has finished its last, so the others take the slowed thread's
// share as well. Measured on the 2-core Zen 4 (SmolLM2, fp32; the two splits alternated in one
// process, medians of six): beside a process busy 2 ms in every 20, a prefill of seven 128-token
// prompts took 1109 against 1172 ms with equal slices (the linear layers and the fused ops), a
// decode step of seven 31.9 against 32.5 ms; on a quiet machine 1031 against 1052 ms and 27.0
// against 28.4 ms.
//
// Each output is still computed by one thread, in one order: which thread computes it changes
// nothing in the result (the linear layers stay batch-invariant, linear.cpp).

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace labkit {

// Call body(begin, end) over [0, n) in chunks of `chunk` items, each chunk on whichever of
// torch's threads asks next. A range of at most one chunk runs on the calling thread, as
// at::parallel_for runs one under its grain: waking the pool costs more than a row or two.
template <typename Body>
inline void parallel_chunks(int64_t n, int64_t chunk, const Body& body) {
  if (n <= 0) return;
  if (n <= chunk) {
    body(int64_t(0), n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t b = next.fetch_add(chunk); b < n; b = next.fetch_add(chunk)) body(b, std::min(n, b + chunk));
  });
}

}  // namespace labkit
