// Submission: a stream's operations recorded, then submitted one by one or as one cached graph.
#include "kernels/submission.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace pagedattn::kernels {
namespace {

LaunchStatus Error(const char* step, cudaError_t err) {
  (void)cudaGetLastError();
  return LaunchStatus::CudaError(std::string("submitting a Forward (") + step + "): " +
                                 cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

bool SameDim(dim3 a, dim3 b) { return a.x == b.x && a.y == b.y && a.z == b.z; }

using Op = Submission::Op;
using OpKind = Submission::OpKind;

// Whether a graph built for op `a` is kept for op `b`, its node updated where they differ: the
// same kind of operation, kernel and dependency, the same events.
bool SameShape(const Op& a, const Op& b) {
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case OpKind::kKernel:
      return a.kernel.func == b.kernel.func && a.programmatic == b.programmatic;
    case OpKind::kCopy:
      return a.copy_kind == b.copy_kind;
    case OpKind::kRecord:
    case OpKind::kWait:
      return a.event == b.event;
  }
  return false;
}

// A hash of what SameShape compares, over a submission's operations.
uint64_t ShapeKey(const Submission& s) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i, v >>= 8) h = (h ^ (v & 0xff)) * 1099511628211ull;
  };
  for (const Op& op : s.ops()) {
    mix(static_cast<uint64_t>(op.kind));
    switch (op.kind) {
      case OpKind::kKernel:
        mix(reinterpret_cast<uintptr_t>(op.kernel.func));
        mix(op.programmatic);
        break;
      case OpKind::kCopy:
        mix(static_cast<uint64_t>(op.copy_kind));
        break;
      case OpKind::kRecord:
      case OpKind::kWait:
        mix(reinterpret_cast<uintptr_t>(op.event));
        break;
    }
  }
  return h;
}

cudaKernelNodeParams NodeParams(const Op& op, void** args) {
  cudaKernelNodeParams node = {};
  node.func = const_cast<void*>(op.kernel.func);
  node.gridDim = op.kernel.grid;
  node.blockDim = op.kernel.block;
  node.sharedMemBytes = static_cast<unsigned>(op.kernel.smem);
  node.kernelParams = args;
  return node;
}

}  // namespace

void Submission::Kernel(const KernelLaunch& kernel, const void* params, size_t params_bytes,
                        bool programmatic) {
  Op op;
  op.kind = OpKind::kKernel;
  op.kernel = kernel;
  op.params_at = params_.size() * sizeof(ParamBlock);
  op.params_bytes = params_bytes;
  op.programmatic = programmatic && !ops_.empty() && ops_.back().kind == OpKind::kKernel;
  params_.resize(params_.size() + (params_bytes + sizeof(ParamBlock) - 1) / sizeof(ParamBlock));
  std::memcpy(reinterpret_cast<unsigned char*>(params_.data()) + op.params_at, params,
              params_bytes);
  ops_.push_back(op);
}

void Submission::Copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  if (bytes == 0) return;
  Op op;
  op.kind = OpKind::kCopy;
  op.dst = dst;
  op.src = src;
  op.bytes = bytes;
  op.copy_kind = kind;
  ops_.push_back(op);
}

LaunchStatus SubmitOps(const Submission& s, cudaStream_t stream, Launcher* launcher) {
  const std::vector<Op>& ops = s.ops();
  for (size_t i = 0; i < ops.size(); ++i) {
    const Op& op = ops[i];
    switch (op.kind) {
      case OpKind::kKernel: {
        if (launcher == nullptr) return LaunchStatus::CudaError("a kernel to submit, no launcher");
        const bool pair =
            i + 1 < ops.size() && ops[i + 1].kind == OpKind::kKernel && ops[i + 1].programmatic;
        // A pair takes one parameter (LaunchPair), recorded twice.
        LaunchStatus st =
            pair ? launcher->LaunchPair(op.kernel, ops[i + 1].kernel, stream, s.params(op),
                                        op.params_bytes, "Forward")
                 : launcher->Launch(op.kernel, stream, s.params(op), op.params_bytes, "Forward");
        if (!st.ok()) return st;
        if (pair) ++i;
        break;
      }
      case OpKind::kCopy:
        if (cudaError_t err = cudaMemcpyAsync(op.dst, op.src, op.bytes, op.copy_kind, stream);
            err != cudaSuccess) {
          return Error("cudaMemcpyAsync", err);
        }
        break;
      case OpKind::kRecord:
        if (cudaError_t err = cudaEventRecord(op.event, stream); err != cudaSuccess) {
          return Error("cudaEventRecord", err);
        }
        break;
      case OpKind::kWait:
        if (cudaError_t err = cudaStreamWaitEvent(stream, op.event, 0); err != cudaSuccess) {
          return Error("cudaStreamWaitEvent", err);
        }
        break;
    }
  }
  return LaunchStatus::Ok();
}

// One instantiated graph: a node per operation, in a chain, and what each node holds now.
struct SubmissionGraphs::Graph {
  uint64_t key = 0;  // ShapeKey
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  std::vector<cudaGraphNode_t> nodes;
  Submission held;
  uint64_t last_use = 0;

  ~Graph() {
    if (exec != nullptr) cudaGraphExecDestroy(exec);
    if (graph != nullptr) cudaGraphDestroy(graph);
  }

  bool Fits(const Submission& s) const {
    const std::vector<Op>& a = held.ops();
    const std::vector<Op>& b = s.ops();
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i) {
      if (!SameShape(a[i], b[i])) return false;
    }
    return true;
  }

  // Gives the nodes s's values where they differ from what they hold; false if one cannot take
  // them (the graph is then dropped).
  bool Update(const Submission& s) {
    const std::vector<Op>& was = held.ops();
    const std::vector<Op>& ops = s.ops();
    for (size_t i = 0; i < ops.size(); ++i) {
      const Op& op = ops[i];
      const Op& old = was[i];
      cudaError_t err = cudaSuccess;
      switch (op.kind) {
        case OpKind::kKernel: {
          const bool same = SameDim(op.kernel.grid, old.kernel.grid) &&
                            SameDim(op.kernel.block, old.kernel.block) &&
                            op.kernel.smem == old.kernel.smem &&
                            op.params_bytes == old.params_bytes &&
                            std::memcmp(s.params(op), held.params(old), op.params_bytes) == 0;
          if (same) break;
          void* args[] = {const_cast<unsigned char*>(s.params(op))};
          const cudaKernelNodeParams node = NodeParams(op, args);
          err = cudaGraphExecKernelNodeSetParams(exec, nodes[i], &node);
          break;
        }
        case OpKind::kCopy:
          if (op.dst == old.dst && op.src == old.src && op.bytes == old.bytes) break;
          err = cudaGraphExecMemcpyNodeSetParams1D(exec, nodes[i], op.dst, op.src, op.bytes,
                                                   op.copy_kind);
          break;
        case OpKind::kRecord:
        case OpKind::kWait:
          break;  // the same events (SameShape)
      }
      if (err != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
      }
    }
    held = s;
    return true;
  }

  // Builds and instantiates s's graph: each node after the one before it, a programmatic kernel
  // over a programmatic edge from the kernel before it.
  cudaError_t Build(const Submission& s) {
    cudaError_t err = cudaGraphCreate(&graph, 0);
    const std::vector<Op>& ops = s.ops();
    nodes.assign(ops.size(), nullptr);
    for (size_t i = 0; i < ops.size() && err == cudaSuccess; ++i) {
      const Op& op = ops[i];
      cudaGraphNode_t* node = &nodes[i];
      const cudaGraphNode_t* after = i > 0 && !op.programmatic ? &nodes[i - 1] : nullptr;
      const size_t num_after = after != nullptr ? 1 : 0;
      switch (op.kind) {
        case OpKind::kKernel: {
          void* args[] = {const_cast<unsigned char*>(s.params(op))};
          const cudaKernelNodeParams params = NodeParams(op, args);
          err = cudaGraphAddKernelNode(node, graph, after, num_after, &params);
          if (err == cudaSuccess && op.programmatic) {
            cudaGraphEdgeData edge = {};
            edge.from_port = cudaGraphKernelNodePortProgrammatic;
            edge.type = cudaGraphDependencyTypeProgrammatic;
            err = cudaGraphAddDependencies(graph, &nodes[i - 1], node, &edge, 1);
          }
          break;
        }
        case OpKind::kCopy:
          err = cudaGraphAddMemcpyNode1D(node, graph, after, num_after, op.dst, op.src, op.bytes,
                                         op.copy_kind);
          break;
        case OpKind::kRecord:
          err = cudaGraphAddEventRecordNode(node, graph, after, num_after, op.event);
          break;
        case OpKind::kWait:
          err = cudaGraphAddEventWaitNode(node, graph, after, num_after, op.event);
          break;
      }
    }
    if (err == cudaSuccess) err = cudaGraphInstantiate(&exec, graph, 0);
    if (err == cudaSuccess) held = s;
    return err;
  }
};

SubmissionGraphs::SubmissionGraphs() = default;
SubmissionGraphs::~SubmissionGraphs() = default;

void SubmissionGraphs::Clear() { graphs_.clear(); }

LaunchStatus SubmissionGraphs::Launch(const Submission& s, cudaStream_t stream) {
  if (s.ops().empty()) return LaunchStatus::Ok();
  const uint64_t key = ShapeKey(s);
  Graph* hit = nullptr;
  for (auto it = graphs_.begin(); it != graphs_.end(); ++it) {
    if ((*it)->key != key || !(*it)->Fits(s)) continue;
    if ((*it)->Update(s)) {
      hit = it->get();
    } else {
      graphs_.erase(it);  // these nodes cannot take it: a new graph below
    }
    break;
  }
  if (hit == nullptr) {
    auto g = std::make_unique<Graph>();
    g->key = key;
    if (cudaError_t err = g->Build(s); err != cudaSuccess) return Error("building its graph", err);
    ++builds_;
    if (graphs_.size() >= kMaxGraphs) {
      graphs_.erase(
          std::min_element(graphs_.begin(), graphs_.end(),
                           [](const auto& a, const auto& b) { return a->last_use < b->last_use; }));
    }
    graphs_.push_back(std::move(g));
    hit = graphs_.back().get();
  }
  hit->last_use = ++clock_;
  if (cudaError_t err = cudaGraphLaunch(hit->exec, stream); err != cudaSuccess) {
    return Error("cudaGraphLaunch", err);
  }
  ++launches_;
  return LaunchStatus::Ok();
}

}  // namespace pagedattn::kernels
