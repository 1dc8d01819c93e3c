// pagedattn-cli: talk to a pagedattn server from the shell.
//   pagedattn-cli [--target=host:port] <command> [args]
// Commands: info, health, validate, create-cache, list, describe ID, delete ID, release ID SEQ...,
// stats, smoke, help. Results print as JSON (the API's messages); errors print the status and
// exit 1.
#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/client.h"
#include "client/smoke.h"
#include "common/cmdline.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"

ABSL_FLAG(std::string, target, "localhost:50051",
          "server address: host:port, [ipv6]:port or unix:/path/to.sock");
ABSL_FLAG(double, timeout_s, 60, "deadline of each RPC, seconds");
ABSL_FLAG(std::string, token, "", "bearer token (or set PAGEDATTN_TOKEN)");
ABSL_FLAG(std::string, tls_ca, "", "PEM file of CA roots: connect with TLS");
ABSL_FLAG(std::string, tls_cert, "", "client certificate PEM (mTLS)");
ABSL_FLAG(std::string, tls_key, "", "client private key PEM (mTLS)");
ABSL_FLAG(std::string, tls_server_name, "", "name to expect in the server certificate");
ABSL_FLAG(std::string, request_id, "",
          "an id every call of the command carries as x-request-id metadata, shown as req= on "
          "the server's log lines for them (printable ASCII; empty: none)");
// CacheConfig for validate / create-cache / smoke.
ABSL_FLAG(int32_t, num_layers, 32, "cache config: layers");
ABSL_FLAG(int32_t, num_q_heads, 32, "cache config: query heads");
ABSL_FLAG(int32_t, num_kv_heads, 8, "cache config: KV heads");
ABSL_FLAG(int32_t, head_dim, 128, "cache config: head dim");
ABSL_FLAG(int32_t, page_size, 16, "cache config: tokens per page");
ABSL_FLAG(std::string, kv_dtype, "BFLOAT16",
          "cache config: FLOAT16, BFLOAT16, FLOAT32 or FLOAT8_E4M3 (any case; FLOAT32 on the "
          "CPU backend only)");
ABSL_FLAG(std::string, kv_scaling, "",
          "cache config, FLOAT8_E4M3 only: PER_TOKEN (the default: a scale per row, computed at "
          "append) or STATIC (with --kv_scales)");
ABSL_FLAG(std::vector<std::string>, kv_scales, {},
          "cache config, --kv_scaling=STATIC: K's and V's scale, comma-separated, for every layer "
          "(2 values) or per layer (2 x num_layers)");
ABSL_FLAG(int64_t, num_pages, 0, "cache config: pages (0: use --max_bytes or the server default)");
ABSL_FLAG(int64_t, max_bytes, 0, "cache config: byte budget (0: unset)");
ABSL_FLAG(int32_t, device, 0, "cache config: device index");
ABSL_FLAG(std::string, layers, "",
          "cache config: the layers' attention variants as JSON, one entry for every layer or "
          "one per layer, e.g. '[{\"slidingWindow\": 4096, \"logitSoftcap\": 50}, "
          "{\"logitSoftcap\": 50}]' (fields as pagedattn.v1.LayerAttention's)");
ABSL_FLAG(std::string, name, "", "create-cache: a label for the cache");
ABSL_FLAG(std::string, service, "", "health: service name to check (\"\" = whole server)");
ABSL_FLAG(std::string, metrics_target, "localhost:9464",
          "stats: host:port of the server's --metrics_listen endpoint");

namespace {

using pagedattn::v1::CacheConfig;

constexpr char kUsage[] =
    "command-line client of a pagedattn server.\n\n"
    "usage: pagedattn-cli [flags] <command> [args]\n\n"
    "commands:\n"
    "  info                     server version, backend, device, capability table and limits\n"
    "  health                   grpc.health.v1 check; exit 0 only when SERVING\n"
    "  validate                 dry-run a cache config (--num_layers, --head_dim, ...)\n"
    "  create-cache             create a cache from the config flags (--name)\n"
    "  list                     list caches\n"
    "  describe CACHE_ID        one cache's config and stats\n"
    "  delete CACHE_ID          delete a cache\n"
    "  release CACHE_ID SEQ...  free sequences' pages\n"
    "  help                     this text (--help: with every flag)\n"
    "  stats                    the server's Prometheus metrics (--metrics_target)\n"
    "  smoke                    end-to-end check: random mixed prefill/decode batch through\n"
    "                           Forward, compared with a float64 reference; prints PASS/FAIL\n"
    "                           (a 2-layer cache of its own: --head_dim, --page_size, the heads,\n"
    "                           --kv_dtype and its scaling, --device, and --layers: 1 entry for\n"
    "                           both layers or 2)\n\n"
    "--request_id=ID makes every call of the command carry ID, which the server's log lines\n"
    "for them show as req= (stats excepted: it is no gRPC call).\n";

void PrintJson(const google::protobuf::Message& m) {
  std::string json;
  google::protobuf::util::JsonPrintOptions opts;
  opts.add_whitespace = true;
  opts.always_print_primitive_fields = true;
  (void)google::protobuf::util::MessageToJsonString(m, &json, opts);
  std::cout << json;
}

// What the caller can do about a call's failure, where the code alone tells it: set by main
// from the connection's flags.
std::string unavailable_hint, unauthenticated_hint;

// The field violations of the server's details (google.rpc.BadRequest, the first ten), each on
// a line of its own, when its message (cut to 1 KiB by the server) left some of them out; and
// where to read them all when it was cut.
void PrintViolationsLeftOut(const absl::Status& s) {
  if (absl::StartsWith(s.message(), "invalid cache config") &&
      absl::EndsWith(s.message(), " bytes)")) {
    std::cerr << "hint: the server cut its message; `pagedattn-cli validate` with the same flags "
                 "lists every violation\n";
  }
  const auto payload = s.GetPayload(pagedattn::kStatusDetailsPayload);
  google::rpc::Status rich;
  if (!payload.has_value() || !rich.ParseFromString(std::string(*payload))) return;
  std::vector<std::string> lines;
  bool left_out = false;
  for (const google::protobuf::Any& detail : rich.details()) {
    google::rpc::BadRequest bad;
    if (!detail.UnpackTo(&bad)) continue;
    for (const google::rpc::BadRequest::FieldViolation& v : bad.field_violations()) {
      lines.push_back(absl::StrCat("  ", v.field(), ": ", v.description()));
      left_out = left_out || !absl::StrContains(s.message(), v.description());
    }
  }
  if (!left_out) return;
  std::cerr << "every violation (" << lines.size() << "):\n";
  for (const std::string& line : lines) std::cerr << line << "\n";
}

int Fail(const absl::Status& s) {
  std::cerr << "error: " << absl::StatusCodeToString(s.code()) << ": " << s.message() << "\n";
  PrintViolationsLeftOut(s);
  // A server that answered it is shutting down was reached: no hint about reaching it.
  if (s.code() == absl::StatusCode::kUnavailable && !unavailable_hint.empty() &&
      !absl::StrContains(s.message(), "shutting down")) {
    std::cerr << "hint: " << unavailable_hint << "\n";
  } else if (s.code() == absl::StatusCode::kUnauthenticated && !unauthenticated_hint.empty()) {
    std::cerr << "hint: " << unauthenticated_hint << "\n";
  }
  return 1;
}

// A bad flag: nothing was sent; exit 2 like any usage error.
int Usage(const absl::Status& s) {
  std::cerr << "pagedattn-cli: " << s.message() << "\n";
  return 2;
}

// --kv_dtype, case-insensitive; DTYPE_UNSPECIFIED is no choice.
absl::StatusOr<pagedattn::v1::DType> ParseDType(const std::string& s) {
  pagedattn::v1::DType t;
  if (!pagedattn::v1::DType_Parse(absl::AsciiStrToUpper(s), &t) ||
      t == pagedattn::v1::DTYPE_UNSPECIFIED) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv_dtype must be FLOAT16, BFLOAT16, FLOAT32 or FLOAT8_E4M3 (got '", s, "')"));
  }
  return t;
}

absl::StatusOr<CacheConfig> ConfigFromFlags() {
  CacheConfig c;
  c.set_num_layers(absl::GetFlag(FLAGS_num_layers));
  c.set_num_q_heads(absl::GetFlag(FLAGS_num_q_heads));
  c.set_num_kv_heads(absl::GetFlag(FLAGS_num_kv_heads));
  c.set_head_dim(absl::GetFlag(FLAGS_head_dim));
  c.set_page_size(absl::GetFlag(FLAGS_page_size));
  absl::StatusOr<pagedattn::v1::DType> t = ParseDType(absl::GetFlag(FLAGS_kv_dtype));
  if (!t.ok()) return t.status();
  c.set_kv_dtype(*t);
  if (const std::string scaling = absl::AsciiStrToUpper(absl::GetFlag(FLAGS_kv_scaling));
      !scaling.empty()) {
    pagedattn::v1::KvScaling s;
    if (!pagedattn::v1::KvScaling_Parse(scaling, &s) ||
        s == pagedattn::v1::KV_SCALING_UNSPECIFIED) {
      return absl::InvalidArgumentError(
          absl::StrCat("--kv_scaling must be PER_TOKEN or STATIC (got '",
                       absl::GetFlag(FLAGS_kv_scaling), "')"));
    }
    c.set_kv_scaling(s);
  }
  for (const std::string& text : absl::GetFlag(FLAGS_kv_scales)) {
    double scale = 0;
    if (!absl::SimpleAtod(text, &scale)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--kv_scales must be numbers, comma-separated (got '", text, "')"));
    }
    // The wire's type is float: a value that would arrive as 0 or inf is refused as typed,
    // rather than named by the server as the 0 or inf it became.
    const float narrowed = static_cast<float>(scale);
    if (std::isfinite(scale) && (std::isinf(narrowed) || (narrowed == 0 && scale != 0))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--kv_scales value '", text, "' is outside float's range (scales are floats)"));
    }
    c.add_kv_scales(narrowed);
  }
  if (absl::GetFlag(FLAGS_num_pages) != 0 && absl::GetFlag(FLAGS_max_bytes) != 0) {
    return absl::InvalidArgumentError("set --num_pages or --max_bytes, not both");
  }
  // Any value but 0 (unset) goes to the server, whose validation names it: a negative one must
  // not quietly become the default capacity (most of the GPU's free memory).
  if (absl::GetFlag(FLAGS_num_pages) != 0) c.set_num_pages(absl::GetFlag(FLAGS_num_pages));
  if (absl::GetFlag(FLAGS_max_bytes) != 0) c.set_max_bytes(absl::GetFlag(FLAGS_max_bytes));
  c.set_device(absl::GetFlag(FLAGS_device));
  if (const std::string layers = absl::GetFlag(FLAGS_layers); !layers.empty()) {
    CacheConfig parsed;
    const auto st = google::protobuf::util::JsonStringToMessage(
        absl::StrCat("{\"layers\": ", layers, "}"), &parsed);
    if (!st.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--layers must be a JSON array of LayerAttention objects, e.g. "
                       "'[{\"slidingWindow\": 4096}, {}]' (", st.message().as_string(), ")"));
    }
    *c.mutable_layers() = parsed.layers();
  }
  return c;
}

}  // namespace

// --help: the usage and every flag with its default (never its value: --token's would be a
// secret on the screen), on stdout, exit 0.
void PrintHelp() {
  std::cout << kUsage << "\nflags:\n";
  std::map<std::string, absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (absl::StrContains(flag->Filename(), "client/cli.cc")) flags[std::string(name)] = flag;
  }
  pagedattn::PrintFlagsHelp(std::cout, flags);
}

int main(int argc, char** argv) {
  switch (pagedattn::FindInfoFlag(argc, argv)) {
    case pagedattn::InfoFlag::kHelp:
      PrintHelp();
      return 0;
    case pagedattn::InfoFlag::kVersion:
      std::cout << "pagedattn-cli " << PAGEDATTN_VERSION << "\n";
      return 0;
    case pagedattn::InfoFlag::kNone:
      break;
  }
  absl::SetProgramUsageMessage(kUsage);
  absl::FlagsUsageConfig usage_config;
  // --help names the program, not the build machine's path to its source (and matches on that
  // name: absl hands contains_help_flags the normalized one).
  usage_config.normalize_filename = [](absl::string_view path) {
    return absl::StrContains(path, "client/cli.cc") ? std::string("pagedattn-cli")
                                                    : std::string(path);
  };
  usage_config.contains_help_flags = [](absl::string_view path) {
    return path == "pagedattn-cli" || absl::StrContains(path, "client/cli.cc");
  };
  absl::SetFlagsUsageConfig(usage_config);
  // A name that is no flag or a value that does not parse: usage errors, each named (absl's
  // parser exits 1 on the first).
  if (!pagedattn::NoUnparsableFlags(
          "pagedattn-cli", argc, argv,
          pagedattn::ProgramFlags(absl::GetAllFlags(), "pagedattn-cli"),
          [](absl::string_view name) { return absl::FindCommandLineFlag(name) != nullptr; })) {
    return 2;
  }
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (!pagedattn::NoRepeatedFlags("pagedattn-cli", argc, argv,
                                  pagedattn::FlagKinds(absl::GetAllFlags(), "pagedattn-cli"),
                                  {"token"})) {
    return 2;
  }
  if (args.size() < 2) {
    std::cerr << kUsage << "\nrun with --help for the flags\n";
    return 2;
  }
  const std::string command = args[1];
  if (command == "help") {
    if (args.size() > 2) {
      std::cerr << "pagedattn-cli help: unexpected argument '" << args[2] << "'\n";
      return 2;
    }
    std::cout << kUsage << "\nrun with --help for the flags\n";
    return 0;
  }

  pagedattn::ClientOptions options;
  options.target = absl::GetFlag(FLAGS_target);
  if (const double t = absl::GetFlag(FLAGS_timeout_s); !(t > 0) || std::isinf(t)) {
    std::cerr << "pagedattn-cli: --timeout_s must be a positive number of seconds (got " << t
              << ")\n";
    return 2;
  }
  options.timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout_s));
  options.bearer_token = absl::GetFlag(FLAGS_token);
  if (options.bearer_token.empty() && std::getenv("PAGEDATTN_TOKEN") != nullptr) {
    options.bearer_token = std::getenv("PAGEDATTN_TOKEN");
  }
  options.tls_ca_file = absl::GetFlag(FLAGS_tls_ca);
  options.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  options.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  // A target with no port (and no scheme) goes to gRPC's default, 443: not the server's 50051.
  const bool no_port = options.target.find_first_of(":/") == std::string::npos;
  unavailable_hint = absl::StrCat(
      "no answer from --target=", options.target, ": is the server up and listening there?",
      no_port ? " It names no port, so gRPC connects to 443 (the server listens on 50051 "
                "unless --listen says otherwise)."
              : "",
      options.tls_ca_file.empty()
          ? " If it serves TLS, give its CA with --tls_ca (and --tls_server_name if the "
            "certificate names another host)."
          : " If it serves plaintext, leave out --tls_ca; if TLS, its certificate must be "
            "signed by --tls_ca's CA and name the target's host (else --tls_server_name).");
  if (command == "stats") {  // plain HTTP to the metrics port, not the gRPC target
    unavailable_hint =
        absl::StrCat("stats reads --metrics_target=", absl::GetFlag(FLAGS_metrics_target),
                     " over plain HTTP: the address of the server's --metrics_listen");
  }
  unauthenticated_hint =
      options.bearer_token.empty()
          ? "the server takes bearer tokens: give yours with --token or PAGEDATTN_TOKEN"
          : "the token given (--token or PAGEDATTN_TOKEN) is not in the server's "
            "--auth_tokens_file";
  // Every call below, on this thread, carries the id.
  const std::string request_id = absl::GetFlag(FLAGS_request_id);
  std::optional<pagedattn::RequestId> request_id_scope;
  if (!request_id.empty()) {
    if (absl::Status s = pagedattn::RequestId::Check(request_id); !s.ok()) {
      return Usage(absl::InvalidArgumentError(absl::StrCat("--request_id: ", s.message())));
    }
    request_id_scope.emplace(request_id);
  }
  auto need_arg = [&](size_t n, const char* what) {
    if (args.size() < n + 2) {
      std::cerr << "usage: pagedattn-cli " << command << " " << what << "\n";
      std::exit(2);
    }
  };
  // Arguments a command would ignore are a mistake to report (a flag given without its --, a
  // word too many), not to drop: release takes any number of sequence ids, the others a fixed
  // count.
  const bool one_arg = command == "describe" || command == "delete";
  const bool no_args = command == "info" || command == "health" || command == "validate" ||
                       command == "create-cache" || command == "list" || command == "stats" ||
                       command == "smoke";
  const size_t takes = one_arg ? 1 : 0;
  // A flag the command does not read is a mistake to report too (a config flag given to list,
  // say): each one given, named with the commands that take it.
  if (one_arg || no_args || command == "release") {
    const std::vector<std::string> config_commands = {"validate", "create-cache", "smoke"};
    const std::pair<const absl::CommandLineFlag*, std::vector<std::string>> uses[] = {
        {&absl::GetFlagReflectionHandle(FLAGS_num_layers), config_commands},
        {&absl::GetFlagReflectionHandle(FLAGS_num_q_heads), config_commands},
        {&absl::GetFlagReflectionHandle(FLAGS_num_kv_heads), config_commands},
        {&absl::GetFlagReflectionHandle(FLAGS_head_dim), config_commands},
        {&absl::GetFlagReflectionHandle(FLAGS_page_size), config_commands},
        {&absl::GetFlagReflectionHandle(FLAGS_kv_dtype), config_commands},
        {&absl::GetFlagReflectionHandle(FLAGS_kv_scaling), config_commands},
        {&absl::GetFlagReflectionHandle(FLAGS_kv_scales), config_commands},
        {&absl::GetFlagReflectionHandle(FLAGS_num_pages), config_commands},
        {&absl::GetFlagReflectionHandle(FLAGS_max_bytes), config_commands},
        {&absl::GetFlagReflectionHandle(FLAGS_device), config_commands},
        {&absl::GetFlagReflectionHandle(FLAGS_layers), config_commands},
        {&absl::GetFlagReflectionHandle(FLAGS_name), {"create-cache"}},
        {&absl::GetFlagReflectionHandle(FLAGS_service), {"health"}},
    };
    std::vector<std::string> unread;
    for (const auto& [flag, commands] : uses) {
      if (flag->CurrentValue() != flag->DefaultValue() &&
          std::find(commands.begin(), commands.end(), command) == commands.end()) {
        unread.push_back(absl::StrCat("--", flag->Name(), " is for ", absl::StrJoin(commands, ", "),
                                      ", not ", command));
      }
    }
    if (!unread.empty()) {
      return Usage(absl::InvalidArgumentError(absl::StrJoin(unread, "; ")));
    }
  }
  if ((one_arg || no_args) && args.size() > takes + 2) {
    std::cerr << "pagedattn-cli " << command << ": unexpected argument '" << args[takes + 2]
              << "'\n"
              << kUsage;
    return 2;
  }

  absl::StatusOr<std::unique_ptr<pagedattn::Client>> client = pagedattn::Client::Connect(options);
  // Connect sends nothing: what it refuses is a flag's value (the target, the TLS files).
  if (!client.ok()) {
    const absl::StatusCode code = client.status().code();
    return code == absl::StatusCode::kInvalidArgument || code == absl::StatusCode::kNotFound
               ? Usage(client.status())  // a TLS file that is not there is NOT_FOUND
               : Fail(client.status());
  }
  pagedattn::Client& c = **client;

  if (command == "info") {
    auto r = c.GetServerInfo();
    if (!r.ok()) return Fail(r.status());
    PrintJson(*r);
  } else if (command == "health") {
    auto r = c.CheckHealth(absl::GetFlag(FLAGS_service));
    if (!r.ok()) return Fail(r.status());
    std::cout << (*r ? "SERVING" : "NOT_SERVING") << "\n";
    return *r ? 0 : 1;
  } else if (command == "validate" || command == "create-cache") {
    absl::StatusOr<CacheConfig> config = ConfigFromFlags();
    if (!config.ok()) return Usage(config.status());
    if (command == "validate") {
      auto r = c.ValidateCacheConfig(*config);
      if (!r.ok()) return Fail(r.status());
      PrintJson(*r);
      return r->valid() ? 0 : 1;
    }
    auto r = c.CreateCache(*config, absl::GetFlag(FLAGS_name));
    if (!r.ok()) return Fail(r.status());
    PrintJson(*r);
  } else if (command == "list") {
    auto r = c.ListCaches();
    if (!r.ok()) return Fail(r.status());
    pagedattn::v1::ListCachesResponse resp;
    for (auto& info : *r) *resp.add_caches() = info;
    PrintJson(resp);
  } else if (command == "describe") {
    need_arg(1, "CACHE_ID");
    auto r = c.GetCache(args[2]);
    if (!r.ok()) return Fail(r.status());
    PrintJson(*r);
  } else if (command == "delete") {
    need_arg(1, "CACHE_ID");
    auto r = c.DeleteCache(args[2]);
    if (!r.ok()) return Fail(r.status());
    std::cout << "deleted " << args[2] << " (" << *r << " bytes freed)\n";
  } else if (command == "release") {
    need_arg(2, "CACHE_ID SEQ_ID...");
    std::vector<uint64_t> ids;
    for (size_t i = 3; i < args.size(); ++i) {
      uint64_t id;
      if (!absl::SimpleAtoi(args[i], &id)) {
        return Usage(absl::InvalidArgumentError(absl::StrCat(
            "release: not a sequence id: '", args[i], "' (ids are unsigned 64-bit integers)")));
      }
      ids.push_back(id);
    }
    auto r = c.ReleaseSequences(args[2], ids);
    if (!r.ok()) return Fail(r.status());
    PrintJson(*r);
  } else if (command == "stats") {
    absl::StatusOr<std::string> text =
        pagedattn::FetchMetrics(absl::GetFlag(FLAGS_metrics_target), options.timeout);
    if (!text.ok()) return Fail(text.status());
    // The samples without the HELP/TYPE comments: one "name{labels} value" per line.
    for (absl::string_view line : absl::StrSplit(*text, '\n', absl::SkipEmpty())) {
      if (line[0] != '#') std::cout << line << "\n";
    }
  } else if (command == "smoke") {
    // The smoke makes its own cache of 2 layers and the pages its steps need: a capacity or a
    // layer count given for it is a mistake to report, not a value to drop.
    for (const absl::CommandLineFlag* f :
         {&absl::GetFlagReflectionHandle(FLAGS_num_layers),
          &absl::GetFlagReflectionHandle(FLAGS_num_pages),
          &absl::GetFlagReflectionHandle(FLAGS_max_bytes)}) {
      if (f->CurrentValue() != f->DefaultValue()) {
        return Usage(absl::InvalidArgumentError(
            absl::StrCat("smoke makes its own cache (2 layers, the pages its steps need): --",
                         f->Name(), " is validate's and create-cache's")));
      }
    }
    absl::StatusOr<CacheConfig> config = ConfigFromFlags();
    if (!config.ok()) return Usage(config.status());
    pagedattn::SmokeOptions so;
    so.head_dim = config->head_dim();
    so.page_size = config->page_size();
    so.num_q_heads = config->num_q_heads();
    so.num_kv_heads = config->num_kv_heads();
    so.kv_dtype = config->kv_dtype();
    so.kv_scaling = config->kv_scaling();
    so.kv_scales.assign(config->kv_scales().begin(), config->kv_scales().end());
    so.device = config->device();
    so.layers.assign(config->layers().begin(), config->layers().end());
    if (so.layers.size() > 2) {
      return Usage(absl::InvalidArgumentError(
          absl::StrCat("--layers: the smoke cache has 2 layers; give 1 entry (both) or 2, not ",
                       so.layers.size())));
    }
    auto info = c.GetServerInfo();
    if (!info.ok()) return Fail(info.status());
    auto r = pagedattn::RunSmoke(c, so);
    if (!r.ok()) return Fail(r.status());
    std::cout << "smoke against " << options.target << " (backend " << info->backend() << ", "
              << info->device_name() << "), cache " << r->cache_id << ":\n"
              << r->summary << "max relative error " << r->max_rel_error << " (tolerance "
              << r->tolerance << "), max lse error " << r->max_lse_error << ", " << r->spans_checked
              << " spans checked\n"
              << (r->passed ? "PASS" : "FAIL") << "\n";
    return r->passed ? 0 : 1;
  } else {
    std::cerr << "pagedattn-cli: unknown command '" << command << "'\n\n" << kUsage;
    return 2;
  }
  return 0;
}
