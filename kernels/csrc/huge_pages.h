// Packed weights on 2 MB pages, for every GEMM that packs its weight once at load.
//
// A decode step streams every weight once: on 4 KB pages that is a TLB miss every 4 KB, each a
// page walk that a virtual machine makes twice as long; on 2 MB pages the whole model needs a few
// hundred TLB entries. Measured on a Zen 3 VM: a batch-1 pass of SmolLM2's fp32 linears 4-8%
// faster. The mapping is aligned to 2 MB and exactly as long as the tensor (its last partial 2 MB
// stay 4 KB pages), so nothing is wasted; where huge pages are unavailable the pages are 4 KB.

#pragma once

#include <ATen/ATen.h>
#include <sys/mman.h>

#include <cstdint>

namespace compiled_llm_cpu {

// An uninitialised tensor whose memory the kernel is asked to back with 2 MB pages (transparent
// huge pages; most distributions enable them on request, "madvise"). Below 2 MB: at::empty.
inline at::Tensor huge_page_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  constexpr size_t kHuge = size_t{2} << 20, kPage = 4096;
  const size_t bytes = static_cast<size_t>(c10::multiply_integers(sizes)) * options.dtype().itemsize();
  if (bytes < kHuge) return at::empty(sizes, options);
  const size_t length = (bytes + kPage - 1) / kPage * kPage;
  void* raw = mmap(nullptr, length + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return at::empty(sizes, options);
  const uintptr_t base = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t start = (base + kHuge - 1) & ~(uintptr_t{kHuge} - 1);
  if (start > base) munmap(raw, start - base);  // the slack before the aligned range, then after it
  munmap(reinterpret_cast<void*>(start + length), base + kHuge - start);
  void* data = reinterpret_cast<void*>(start);
  madvise(data, length, MADV_HUGEPAGE);  // best effort
  return at::from_blob(data, sizes, [length](void* p) { munmap(p, length); }, options);
}

}  // namespace compiled_llm_cpu
