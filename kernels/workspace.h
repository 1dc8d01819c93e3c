// ForwardWorkspace: the buffers of Forwards on one stream (a pinned image, its device twin and
// the split-KV counters), grown to the largest Forward seen, and the two copies of each Forward.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/attention_plan.h"
#include "kernels/launch_status.h"
#include "kernels/paged_attention.h"
#include "kernels/submission.h"

namespace pagedattn::kernels {

// One Forward at a time: Reserve, StageInputs, Upload (one host-to-device copy), the kernels
// (Bind), Download (one device-to-host copy), the stream's synchronization, ReadResults. The
// copies and marks are recorded into a Submission (the server submits a Forward's as one graph),
// or issued on a stream. Frees its buffers on the current device when destroyed.
class ForwardWorkspace {
 public:
  ForwardWorkspace() = default;
  ~ForwardWorkspace();
  ForwardWorkspace(const ForwardWorkspace&) = delete;
  ForwardWorkspace& operator=(const ForwardWorkspace&) = delete;

  // Grows the pinned image to hold a Forward's inputs (InputsLayout) so that the caller can
  // write q, k and v there before planning; StageInputs then leaves them where they are.
  LaunchStatus ReserveInputs(const InputsLayout& inputs);
  // Grows the buffers to the plan's staging (at least doubling, so that growth is amortized);
  // the inputs already written (ReserveInputs) are kept. New split counters are zeroed on
  // stream; every launch leaves them zero again.
  LaunchStatus Reserve(const AttentionPlan& plan, cudaStream_t stream);

  // Writes the plan's inputs (metadata, q, k, v: the caller's host buffers) into the pinned image.
  void StageInputs(const AttentionPlan& plan, const void* q, const void* k, const void* v) {
    plan.WriteStaging(host_, q, k, v);
  }
  // The pinned image's inputs to the device: one copy.
  void Upload(const AttentionPlan& plan, Submission& s) const {
    s.Copy(device_, host_, plan.staging().upload_bytes, cudaMemcpyHostToDevice);
  }
  LaunchStatus Upload(const AttentionPlan& plan, cudaStream_t stream) const {
    Submission s;
    Upload(plan, s);
    return SubmitOps(s, stream, nullptr);
  }
  // The kernels' params bound to this workspace's device image and the layer's K/V pools.
  ForwardLaunch Bind(const AttentionPlan& plan, void* k_cache, void* v_cache,
                     const ExternalTensors& external = {}) const {
    return plan.Bind(device_, counters_, k_cache, v_cache, external);
  }
  // The results (out, then lse) into the pinned image: one copy.
  void Download(const AttentionPlan& plan, Submission& s) const;
  LaunchStatus Download(const AttentionPlan& plan, cudaStream_t stream) const {
    Submission s;
    Download(plan, s);
    return SubmitOps(s, stream, nullptr);
  }
  // After the stream has synchronized: out (in q's dtype) and, when asked for, lse to the caller.
  void ReadResults(const AttentionPlan& plan, void* out, float* lse) const;

  // Where a Forward's phases went on the stream: around the upload, the kernels and the
  // download (Mark: an event recorded), read after the stream's synchronization (Elapsed:
  // milliseconds, 0 when the marks are not there).
  enum MarkPoint { kBeforeUpload, kAfterUpload, kAfterKernels, kAfterDownload, kNumMarks };
  LaunchStatus Mark(MarkPoint point, Submission& s);
  float Elapsed(MarkPoint from, MarkPoint to) const;

  // Counts the buffers' reallocations: what names one of them (a graph's copy node) is stale
  // once it moves on, even where the new buffer lies at the old address.
  uint64_t generation() const { return generation_; }

  char* host() const { return host_; }
  void* device() const { return device_; }
  int32_t* merge_counters() const { return counters_; }

 private:
  char* host_ = nullptr;
  size_t host_bytes_ = 0;
  char* device_ = nullptr;
  size_t device_bytes_ = 0;
  int32_t* counters_ = nullptr;
  size_t counter_bytes_ = 0;
  size_t inputs_bytes_ = 0;  // the image's prefix the caller wrote (kept when it grows)
  uint64_t generation_ = 0;
  cudaEvent_t marks_[kNumMarks] = {};
};

}  // namespace pagedattn::kernels
