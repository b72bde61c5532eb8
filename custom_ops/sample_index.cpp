// gpt2forge::build_sample_idx: the GPT sample index of Megatron-LM's GPTDataset.
//
// The C++ twin of Megatron's megatron/data/helpers.cpp `build_sample_idx`, as a torch op (no
// pybind11 module of its own): it joins the one gpt2forge library through
// TORCH_LIBRARY_FRAGMENT (custom_ops/build_info.cpp owns TORCH_LIBRARY). Its numpy reference,
// the fallback when the library is not built and the oracle of tests/data/test_readers.py, is
// `gpt2forge.data.mmap.build_sample_idx_reference`.
//
// Differences from Megatron's helper: the same rows, computed per chunk of doc_idx on OpenMP
// threads, looping over documents rather than samples; every counter is int64 and the output is
// int64 once doc_idx holds 2^31 - 1 entries (Megatron's int32 rows overflow there); the inputs
// are checked instead of asserted.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace gpt2forge {
namespace {

// Documents per thread below which one thread does it all (starting a parallel region costs more
// than it saves; measured: docs/benchmarks.md, Design measurements).
constexpr int64_t kChunkDocs = 1 << 16;

template <typename DocT, typename OutT>
void fill_sample_idx(const int32_t* sizes, int64_t num_sizes, const DocT* doc_idx,
                     int64_t num_doc_idx, int64_t seq_length, int64_t num_samples, OutT* out) {
  // out: (num_samples + 1, 2) row-major. Sample i starts at token i * seq_length of the documents
  // laid end to end in doc_idx order and spans seq_length + 1 tokens (consecutive samples share
  // one); its row is (position in doc_idx of the non-empty document holding that token, offset).
  // This is exactly what Megatron's sequential loop computes (row 0 is (0, 0) there too), but
  // found per chunk of doc_idx, so threads can fill disjoint rows: the thread owning a chunk
  // writes the samples that start inside it.
  int num_chunks = 1;
#ifdef _OPENMP
  if (num_doc_idx >= 2 * kChunkDocs) {
    num_chunks = static_cast<int>(std::min<int64_t>(omp_get_max_threads(), num_doc_idx / kChunkDocs));
  }
#endif
  for (int64_t j = 0; j < num_doc_idx; ++j) {  // sequential read: cheap next to the gathers
    const int64_t doc = static_cast<int64_t>(doc_idx[j]);
    TORCH_CHECK_VALUE(doc >= 0 && doc < num_sizes, "gpt2forge::build_sample_idx: doc_idx[", j,
                      "] = ", doc, " is not a document (sizes has ", num_sizes, ")");
  }
  auto first_doc = [&](int c) { return num_doc_idx * c / num_chunks; };
  // Pass 1, only with several chunks: where each chunk's first document starts. The random
  // gather sizes[doc_idx[j]] dominates the time, so one thread does without this pass.
  std::vector<int64_t> chunk_start(num_chunks + 1, 0);
  if (num_chunks > 1) {
#pragma omp parallel for schedule(static) num_threads(num_chunks)
    for (int c = 0; c < num_chunks; ++c) {
      int64_t tokens = 0;
      for (int64_t j = first_doc(c); j < first_doc(c + 1); ++j) {
        tokens += sizes[doc_idx[j]];
      }
      chunk_start[c + 1] = tokens;
    }
    for (int c = 0; c < num_chunks; ++c) {
      chunk_start[c + 1] += chunk_start[c];
    }
  }
  // Pass 2: each chunk writes the rows of the samples starting inside it. The outer loop runs over
  // documents (one gather each) and the inner one over the samples starting in the document: a
  // branch per document instead of one mispredicted per sample.
  std::vector<int64_t> rows(num_chunks, 0);  // rows >= 1 written per chunk
  const int64_t last = num_samples * seq_length;  // where the last sample starts
#pragma omp parallel for schedule(static) num_threads(num_chunks) if (num_chunks > 1)
  for (int c = 0; c < num_chunks; ++c) {
    int64_t doc_pos = chunk_start[c];  // token position where document j starts
    int64_t i = (doc_pos + seq_length - 1) / seq_length;  // next sample to place
    const int64_t first_row = std::max<int64_t>(i, 1);
    int64_t next = i * seq_length;  // its first token's position
    for (int64_t j = first_doc(c); j < first_doc(c + 1) && next <= last; ++j) {
      const int64_t doc_end = doc_pos + sizes[doc_idx[j]];
      for (; next < doc_end && next <= last; next += seq_length, ++i) {
        out[2 * i] = static_cast<OutT>(j);
        out[2 * i + 1] = static_cast<OutT>(next - doc_pos);
      }
      doc_pos = doc_end;
    }
    rows[c] = std::max<int64_t>(i - first_row, 0);
  }
  int64_t written = 0;
  for (int64_t r : rows) {
    written += r;
  }
  TORCH_CHECK_VALUE(written == num_samples, "gpt2forge::build_sample_idx: doc_idx holds fewer than "
                    "num_epochs * tokens_per_epoch tokens (samples ", written + 1, " to ",
                    num_samples, " have no start)");
  out[0] = 0;
  out[1] = 0;
}

// gpt2forge::build_sample_idx(Tensor sizes, Tensor doc_idx, int seq_length, int num_epochs,
//                             int tokens_per_epoch) -> Tensor
// sizes: int32 (num_documents,) token counts; doc_idx: int32/int64 document ids in training
// order (num_epochs passes, shuffled); returns (num_samples + 1, 2) with
// num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length, int32 when doc_idx has fewer
// than 2^31 - 1 entries, else int64.
at::Tensor build_sample_idx(const at::Tensor& sizes, const at::Tensor& doc_idx, int64_t seq_length,
                            int64_t num_epochs, int64_t tokens_per_epoch) {
  TORCH_CHECK_TYPE(sizes.scalar_type() == at::kInt,
                   "gpt2forge::build_sample_idx: sizes must be int32, got ", sizes.scalar_type());
  TORCH_CHECK_TYPE(doc_idx.scalar_type() == at::kInt || doc_idx.scalar_type() == at::kLong,
                   "gpt2forge::build_sample_idx: doc_idx must be int32 or int64, got ",
                   doc_idx.scalar_type());
  TORCH_CHECK_VALUE(sizes.dim() == 1 && doc_idx.dim() == 1 && sizes.is_contiguous() &&
                        doc_idx.is_contiguous() && sizes.device().is_cpu() &&
                        doc_idx.device().is_cpu(),
                    "gpt2forge::build_sample_idx: sizes and doc_idx must be 1-D contiguous CPU "
                    "tensors");
  TORCH_CHECK_VALUE(seq_length >= 1 && num_epochs >= 1 && tokens_per_epoch >= 1,
                    "gpt2forge::build_sample_idx: seq_length, num_epochs and tokens_per_epoch "
                    "must be >= 1, got ", seq_length, ", ", num_epochs, ", ", tokens_per_epoch);
  const int64_t num_samples = (num_epochs * tokens_per_epoch - 1) / seq_length;
  const bool wide = doc_idx.numel() >= std::numeric_limits<int32_t>::max();
  at::Tensor out = at::empty({num_samples + 1, 2}, sizes.options().dtype(wide ? at::kLong : at::kInt));
  const int32_t* sp = sizes.const_data_ptr<int32_t>();
  const int64_t ns = sizes.numel(), nd = doc_idx.numel();
  if (doc_idx.scalar_type() == at::kInt) {
    const int32_t* dp = doc_idx.const_data_ptr<int32_t>();
    if (wide) {
      fill_sample_idx(sp, ns, dp, nd, seq_length, num_samples, out.mutable_data_ptr<int64_t>());
    } else {
      fill_sample_idx(sp, ns, dp, nd, seq_length, num_samples, out.mutable_data_ptr<int32_t>());
    }
  } else {
    const int64_t* dp = doc_idx.const_data_ptr<int64_t>();
    if (wide) {
      fill_sample_idx(sp, ns, dp, nd, seq_length, num_samples, out.mutable_data_ptr<int64_t>());
    } else {
      fill_sample_idx(sp, ns, dp, nd, seq_length, num_samples, out.mutable_data_ptr<int32_t>());
    }
  }
  return out;
}

}  // namespace
}  // namespace gpt2forge

TORCH_LIBRARY_FRAGMENT(gpt2forge, m) {
  m.def("build_sample_idx(Tensor sizes, Tensor doc_idx, int seq_length, int num_epochs, "
        "int tokens_per_epoch) -> Tensor");
}

TORCH_LIBRARY_IMPL(gpt2forge, CPU, m) {
  m.impl("build_sample_idx", &gpt2forge::build_sample_idx);
}
