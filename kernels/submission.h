// A Forward's work on its stream as a list of operations (copies, event records and waits,
// kernels), submitted either as one cached CUDA graph or operation by operation.
//
// Every CUDA runtime call costs host time, several microseconds when the host's caches are cold,
// as they are when a request has just been received and copied; a Forward makes about a dozen:
// its upload, timing marks, event waits and records, the append and attention kernels, its
// download. Recorded into a Submission first (kernels through a Launcher made over it), they
// reach the GPU as a cudaGraphLaunch of a graph that SubmissionGraphs keeps per stream and shape
// (docs/PERFORMANCE.md#design-decisions).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/launch.h"
#include "kernels/launch_status.h"

namespace pagedattn::kernels {

// The operations of one submission to a stream, in stream order (each after the one before it).
class Submission {
 public:
  enum class OpKind : uint8_t { kKernel, kCopy, kRecord, kWait };
  struct Op {
    OpKind kind = OpKind::kKernel;
    // kKernel: the kernel and its launch, its parameter's bytes (params_bytes at params_at in
    // the submission), and whether it may start while the kernel before it runs (a programmatic
    // dependency, Launcher::LaunchPair).
    KernelLaunch kernel;
    size_t params_at = 0, params_bytes = 0;
    bool programmatic = false;
    // kCopy: a cudaMemcpyAsync's arguments.
    void* dst = nullptr;
    const void* src = nullptr;
    size_t bytes = 0;
    cudaMemcpyKind copy_kind = cudaMemcpyDefault;
    // kRecord, kWait: the event recorded, or waited for.
    cudaEvent_t event = nullptr;
  };

  void Clear() {
    ops_.clear();
    params_.clear();
  }
  void Kernel(const KernelLaunch& kernel, const void* params, size_t params_bytes,
              bool programmatic);
  // A copy of no bytes adds nothing.
  void Copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind);
  void Record(cudaEvent_t event) { AddEvent(OpKind::kRecord, event); }
  void Wait(cudaEvent_t event) { AddEvent(OpKind::kWait, event); }

  const std::vector<Op>& ops() const { return ops_; }
  const unsigned char* params(const Op& op) const {
    return reinterpret_cast<const unsigned char*>(params_.data()) + op.params_at;
  }

 private:
  void AddEvent(OpKind kind, cudaEvent_t event) {
    Op op;
    op.kind = kind;
    op.event = event;
    ops_.push_back(op);
  }

  // Each kernel's parameter at a 64-byte boundary, as the kernel's own type would lie
  // (PagedAttentionParams holds tensor maps, alignas(64)): a copy through the type may use
  // aligned loads.
  struct alignas(64) ParamBlock {
    unsigned char bytes[64];
  };
  std::vector<Op> ops_;
  std::vector<ParamBlock> params_;
};

// Each operation as its own runtime call on stream; kernels through launcher (a kernel and the
// programmatic one after it as one LaunchPair). launcher may be null when there are no kernels.
LaunchStatus SubmitOps(const Submission& submission, cudaStream_t stream, Launcher* launcher);

// One stream's graphs of submissions. A submission shaped like one launched before (the same
// operations, kernels, dependencies and events) launches that graph, its nodes first given
// whatever differs (kernel parameters and grids, copy addresses and sizes); another shape builds
// and instantiates a new graph. One graph updated for every layer beat a graph per layer that
// needs no update: reused, its driver state stays in the host's caches
// (docs/PERFORMANCE.md#design-decisions). A graph holds the events of its record and wait
// nodes: they must outlive it (a Forward's are its workspace's own). Up to kMaxGraphs are kept,
// the least recently used dropped. Not thread-safe: one per stream, one Forward at a time.
class SubmissionGraphs {
 public:
  static constexpr size_t kMaxGraphs = 8;

  SubmissionGraphs();
  ~SubmissionGraphs();  // destroys the graphs (work in flight finishes)
  SubmissionGraphs(const SubmissionGraphs&) = delete;
  SubmissionGraphs& operator=(const SubmissionGraphs&) = delete;

  LaunchStatus Launch(const Submission& submission, cudaStream_t stream);
  // Drops every graph (work in flight finishes): for when a buffer their nodes name has been
  // reallocated. A copy node keeps the driver's state of the allocation it was given, and a
  // node handed the same address again is not updated, so a buffer freed and reallocated at
  // its old address left nodes on the freed allocation (a segfault inside the driver).
  void Clear();

  // Graph launches so far, and how many of them needed a new graph.
  int64_t launches() const { return launches_; }
  int64_t builds() const { return builds_; }

 private:
  struct Graph;
  std::vector<std::unique_ptr<Graph>> graphs_;
  uint64_t clock_ = 0;
  int64_t launches_ = 0;
  int64_t builds_ = 0;
};

}  // namespace pagedattn::kernels
