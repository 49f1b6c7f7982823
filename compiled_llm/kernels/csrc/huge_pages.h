// Packed weights on 2 MB pages, for the GEMMs that pack their weight once at load.
//
// A decode step streams every weight once: on 4 KB pages that is a TLB miss every 4 KB, each a
// page walk that a virtual machine makes twice as long; on 2 MB pages the whole model needs a few
// hundred TLB entries. Measured on a Zen 3 VM: a batch-1 pass of SmolLM2's fp32 linears 4-8%
// faster. Where huge pages are unavailable the pages are simply 4 KB.
//
// Two allocators:
// - huge_page_empty (the fp32 GEMM's): a tensor of 2 MB or more gets its own 2 MB-aligned mapping,
//   exactly as long as the tensor (its last partial 2 MB stay 4 KB pages); a smaller one is an
//   ordinary allocation.
// - packed_weight_empty (the quantized and 16-bit GEMMs'): tensors are carved one after the other
//   from shared 2 MB-aligned chunks, so small weights (most 4-bit ones are under 1 MB) sit on huge
//   pages too, and the weights of a model lie in memory in the order they were packed, which is the
//   order a forward pass reads them. Measured on an AVX-512 Xeon VM: batch-1 Q4_1 passes over
//   SmolLM2's 576 x 576 weights 5.5 -> 9.7 GB/s, 576 x 1536 7.1 -> 10.9 GB/s. A chunk is unmapped
//   when the last tensor in it is freed; pages are only backed once written, so the unused tail of
//   a chunk costs address space, not memory.

#pragma once

#include <ATen/ATen.h>
#include <sys/mman.h>

#include <cstdint>
#include <memory>
#include <mutex>

namespace compiled_llm_cpu {

constexpr size_t kHugePage = size_t{2} << 20;

// A 2 MB-aligned mapping of `length` bytes (a multiple of 4 KB) asked to be backed by huge pages
// (transparent huge pages; most distributions grant them on request, "madvise"), or nullptr.
inline void* map_huge(size_t length) {
  void* raw = mmap(nullptr, length + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const uintptr_t base = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t start = (base + kHugePage - 1) & ~(uintptr_t{kHugePage} - 1);
  if (start > base) munmap(raw, start - base);  // the slack before the aligned range, then after it
  munmap(reinterpret_cast<void*>(start + length), base + kHugePage - start);
  void* data = reinterpret_cast<void*>(start);
  madvise(data, length, MADV_HUGEPAGE);  // best effort
  return data;
}

inline size_t tensor_bytes(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return static_cast<size_t>(c10::multiply_integers(sizes)) * options.dtype().itemsize();
}

// An uninitialised tensor of its own mapping on huge pages (2 MB or more; below that, at::empty).
inline at::Tensor huge_page_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  constexpr size_t kPage = 4096;
  const size_t bytes = tensor_bytes(sizes, options);
  if (bytes < kHugePage) return at::empty(sizes, options);
  const size_t length = (bytes + kPage - 1) / kPage * kPage;
  void* data = map_huge(length);
  if (!data) return at::empty(sizes, options);
  return at::from_blob(data, sizes, [length](void* p) { munmap(p, length); }, options);
}

// An uninitialised tensor carved from the packed-weight chunks (64-byte aligned).
inline at::Tensor packed_weight_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  struct Chunk {
    void* base;
    size_t length;
    ~Chunk() { munmap(base, length); }
  };
  constexpr size_t kChunk = size_t{64} << 20, kAlign = 64;
  static std::mutex mutex;
  static std::shared_ptr<Chunk> current;  // held by its tensors and, until it is full, here
  static size_t used = 0;
  const size_t bytes = (tensor_bytes(sizes, options) + kAlign - 1) / kAlign * kAlign;
  std::shared_ptr<Chunk> chunk;
  size_t offset;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (!current || used + bytes > current->length) {
      const size_t length = std::max(kChunk, (bytes + kHugePage - 1) / kHugePage * kHugePage);
      void* base = map_huge(length);
      if (!base) return at::empty(sizes, options);
      current.reset(new Chunk{base, length});
      used = 0;
    }
    chunk = current;
    offset = used;
    used += std::max(bytes, kAlign);
  }
  void* data = static_cast<char*>(chunk->base) + offset;
  return at::from_blob(data, sizes, [chunk](void*) mutable { chunk.reset(); }, options);
}

}  // namespace compiled_llm_cpu
