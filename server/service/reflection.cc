// Reflection: each request of a stream read (bounded), answered from the generated descriptor
// pool, written; then the next.
#include "server/service/reflection.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/descriptor.pb.h>

#include <optional>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "server/service/request_parse.h"
#include "server/service/status.h"

namespace pagedattn {
namespace {

namespace pb = google::protobuf;
using grpc::reflection::v1alpha::FileDescriptorResponse;
using grpc::reflection::v1alpha::ServerReflectionRequest;
using grpc::reflection::v1alpha::ServerReflectionResponse;

// `file`, then every file it imports, transitively, each once: what a client needs to build it.
void AddFileWithImports(const pb::FileDescriptor* file, FileDescriptorResponse* out,
                        absl::flat_hash_set<const pb::FileDescriptor*>* added) {
  if (!added->insert(file).second) return;
  pb::FileDescriptorProto proto;
  file->CopyTo(&proto);
  out->add_file_descriptor_proto(proto.SerializeAsString());
  for (int i = 0; i < file->dependency_count(); ++i) {
    AddFileWithImports(file->dependency(i), out, added);
  }
}

}  // namespace

ServerReflectionResponse AnswerReflection(const ServerReflectionRequest& request,
                                          const std::vector<std::string>& services) {
  const pb::DescriptorPool* pool = pb::DescriptorPool::generated_pool();
  ServerReflectionResponse response;
  response.set_valid_host(request.host());
  *response.mutable_original_request() = request;
  response.mutable_original_request()->DiscardUnknownFields();  // echoed as understood
  auto not_found = [&response](absl::string_view what, absl::string_view name) {
    response.mutable_error_response()->set_error_code(grpc::StatusCode::NOT_FOUND);
    response.mutable_error_response()->set_error_message(
        absl::StrCat(what, " ", name, " is not known to this server"));
    return response;
  };
  auto files = [&response](const pb::FileDescriptor* file) {
    absl::flat_hash_set<const pb::FileDescriptor*> added;
    AddFileWithImports(file, response.mutable_file_descriptor_response(), &added);
    return response;
  };
  switch (request.message_request_case()) {
    case ServerReflectionRequest::kFileByFilename: {
      const pb::FileDescriptor* file = pool->FindFileByName(request.file_by_filename());
      return file != nullptr ? files(file) : not_found("file", request.file_by_filename());
    }
    case ServerReflectionRequest::kFileContainingSymbol: {
      const pb::FileDescriptor* file =
          pool->FindFileContainingSymbol(request.file_containing_symbol());
      return file != nullptr ? files(file) : not_found("symbol", request.file_containing_symbol());
    }
    case ServerReflectionRequest::kFileContainingExtension: {
      const auto& ext = request.file_containing_extension();
      const pb::Descriptor* type = pool->FindMessageTypeByName(ext.containing_type());
      if (type == nullptr) return not_found("message type", ext.containing_type());
      const pb::FieldDescriptor* field = pool->FindExtensionByNumber(type, ext.extension_number());
      return field != nullptr ? files(field->file())
                              : not_found("extension", absl::StrCat(ext.containing_type(), " ",
                                                                    ext.extension_number()));
    }
    case ServerReflectionRequest::kAllExtensionNumbersOfType: {
      const pb::Descriptor* type =
          pool->FindMessageTypeByName(request.all_extension_numbers_of_type());
      if (type == nullptr) {
        return not_found("message type", request.all_extension_numbers_of_type());
      }
      std::vector<const pb::FieldDescriptor*> extensions;
      pool->FindAllExtensions(type, &extensions);
      auto* numbers = response.mutable_all_extension_numbers_response();
      numbers->set_base_type_name(type->full_name());
      for (const pb::FieldDescriptor* e : extensions) numbers->add_extension_number(e->number());
      return response;
    }
    case ServerReflectionRequest::kListServices:
      for (const std::string& name : services) {
        response.mutable_list_services_response()->add_service()->set_name(name);
      }
      return response;
    case ServerReflectionRequest::MESSAGE_REQUEST_NOT_SET:
      break;
  }
  response.mutable_error_response()->set_error_code(grpc::StatusCode::INVALID_ARGUMENT);
  response.mutable_error_response()->set_error_message(
      "the request asks nothing: set one of file_by_filename, file_containing_symbol, "
      "file_containing_extension, all_extension_numbers_of_type, list_services");
  return response;
}

// One stream: a read, its answer written, the next read; it ends when the client closes its
// side, the stream breaks or is cancelled, or a request cannot be read. At most one read or one
// write is pending; Finish comes once, never with a write pending (a read may be: gRPC completes
// it, not ok, and a read started as a cancellation arrives is not always completed otherwise).
class ReflectionServiceImpl::Stream final
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  Stream(ReflectionServiceImpl* service, bool refused) : service_(service) {
    if (refused) {
      absl::MutexLock lock(&mu_);
      finished_ = true;
      Finish(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat("too many open reflection streams (", kMaxStreams,
                                       "); close one, or retry")));
      return;
    }
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    std::optional<grpc::Status> done;
    {
      absl::MutexLock lock(&mu_);
      if (!ok || cancelled_) {  // the client is done (or gone)
        done = FinishOnceLocked(grpc::Status::OK);
      } else {
        absl::StatusOr<grpc::ByteBuffer> answer = Answer();
        request_.Clear();
        if (!answer.ok()) {
          done = FinishOnceLocked(ToGrpcStatus(answer.status()));
        } else {
          response_ = *std::move(answer);
          writing_ = true;
          StartWrite(&response_);
        }
      }
    }
    if (done) Finish(*done);
  }
  void OnWriteDone(bool ok) override {
    std::optional<grpc::Status> done;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!ok || cancelled_) {  // the stream broke, or was cancelled while writing
        done = FinishOnceLocked(grpc::Status::OK);
      } else {
        StartRead(&request_);
      }
    }
    if (done) Finish(*done);
  }
  void OnCancel() override {
    std::optional<grpc::Status> done;
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
      if (!writing_) done = FinishOnceLocked(grpc::Status::CANCELLED);
    }
    if (done) Finish(*done);
  }
  void OnDone() override {
    service_->streams_.fetch_sub(1);
    delete this;
  }

 private:
  std::optional<grpc::Status> FinishOnceLocked(grpc::Status status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return std::nullopt;
    finished_ = true;
    return status;
  }

  absl::StatusOr<grpc::ByteBuffer> Answer() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    constexpr absl::string_view kMethod = "ServerReflectionInfo";
    if (absl::Status s = CheckRequestSize(request_, "reflection request names a file or a symbol",
                                          kMaxRequestBytes);
        !s.ok()) {
      return s;
    }
    ServerReflectionRequest request;
    if (absl::Status s = ParseRequest(request_, kMethod, &request); !s.ok()) return s;
    return SerializeResponse(AnswerReflection(request, service_->services_));
  }

  ReflectionServiceImpl* const service_;
  absl::Mutex mu_;
  grpc::ByteBuffer request_ ABSL_GUARDED_BY(mu_);
  grpc::ByteBuffer response_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>*
ReflectionServiceImpl::ServerReflectionInfo(grpc::CallbackServerContext*) {
  // Counted from here to OnDone; past the bound the stream is refused at once.
  const bool refused = streams_.fetch_add(1) >= static_cast<int>(kMaxStreams);
  return new Stream(this, refused);
}

}  // namespace pagedattn
