// The command line's repeated flags: absl keeps a repeated flag's last value without a word, so
// each program (server, CLI, load generator) asks here which of its flags came more than once.
#pragma once

#include <algorithm>
#include <cstdint>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace pagedattn {

// A program's flags by name, true for a boolean one: those of `all` (absl::GetAllFlags(), passed
// in so that this header needs no absl) defined in a file whose path contains `file`.
template <typename AllFlags>
std::map<std::string, bool> FlagKinds(const AllFlags& all, std::string_view file) {
  std::map<std::string, bool> kinds;
  for (const auto& [name, flag] : all) {
    if (std::string_view(flag->Filename()).find(file) != std::string_view::npos) {
      kinds[std::string(name)] = flag->template IsOfType<bool>();
    }
  }
  return kinds;
}

// Whether argv asks for --help (or -h, --helpfull) or --version, which a program answers before
// parsing its flags (absl's own --help prints the flags' current values and exits 1).
enum class InfoFlag { kNone, kHelp, kVersion };
inline InfoFlag FindInfoFlag(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view a(argv[i]);
    if (a == "--") break;
    if (a == "--help" || a == "-help" || a == "-h" || a == "--helpfull" || a == "-helpfull") {
      return InfoFlag::kHelp;
    }
    if (a == "--version" || a == "-version") return InfoFlag::kVersion;
  }
  return InfoFlag::kNone;
}

// --help's list of `flags` (name -> flag, as FlagKinds takes them): each as "  --name (default:
// D)" and its help wrapped at 96 columns, never its current value (a token's would be a secret
// on the screen).
template <typename Flags>
void PrintFlagsHelp(std::ostream& out, const Flags& flags) {
  for (const auto& [name, flag] : flags) {
    out << "  --" << name << " (default: " << flag->DefaultValue() << ")\n";
    const std::string help = flag->Help();
    std::string line = "     ";
    for (size_t at = 0; at < help.size();) {
      const size_t end = std::min(help.find(' ', at), help.size());
      if (end > at) {
        if (line.size() + 1 + (end - at) > 96) {
          out << line << "\n";
          line = "     ";
        }
        line.push_back(' ');
        line.append(help, at, end - at);
      }
      at = end + 1;
    }
    out << line << "\n";
  }
}

// One argument of argv[1..argc) that names a flag, as absl reads it: --name=value or
// -name=value (value set), --name or -name (value unset: a non-boolean flag takes the next
// argument). "--" ends the flags; other arguments are not flags.
struct FlagArgument {
  std::string name;
  std::optional<std::string> value;
};

// Calls fn(arg, take_next) for each FlagArgument in order; take_next() consumes and returns the
// argument after it (nullopt at the end).
template <typename Fn>
void ForEachFlagArgument(int argc, char** argv, Fn&& fn) {
  for (int i = 1; i < argc; ++i) {
    std::string_view a(argv[i]);
    if (a == "--") break;
    if (a.size() < 2 || a[0] != '-') continue;
    a.remove_prefix(a[1] == '-' ? 2 : 1);
    const size_t eq = a.find('=');
    FlagArgument arg{std::string(a.substr(0, eq)), std::nullopt};
    if (eq != std::string_view::npos) arg.value = std::string(a.substr(eq + 1));
    fn(arg, [&]() -> std::optional<std::string> {
      if (i + 1 >= argc) return std::nullopt;
      return std::string(argv[++i]);
    });
  }
}

// The flags of argv[1..argc) that appear more than once, each with its values in order. `flags`:
// the program's flags by name, true for a boolean one. Reads argv as absl parses it:
// --name=value or -name=value, --name value (not for a boolean: --name and --noname take none),
// "--" ends the flags; names the program does not have are left to absl to refuse.
inline std::map<std::string, std::vector<std::string>> RepeatedFlags(
    int argc, char** argv, const std::map<std::string, bool>& flags) {
  std::map<std::string, std::vector<std::string>> seen;
  ForEachFlagArgument(argc, argv, [&](const FlagArgument& arg, auto&& take_next) {
    auto it = flags.find(arg.name);
    if (it == flags.end() && arg.name.rfind("no", 0) == 0) {
      it = flags.find(arg.name.substr(2));
      if (it != flags.end() && !it->second) it = flags.end();  // --noX is for booleans only
    }
    if (it == flags.end()) return;
    std::string value = arg.value.value_or("");
    if (!arg.value && !it->second) value = take_next().value_or("");
    seen[it->first].push_back(std::move(value));
  });
  std::erase_if(seen, [](const auto& entry) { return entry.second.size() < 2; });
  return seen;
}

// One line a repeated flag: "--name is given 2 times (a, b); give it once", the values of the
// `secret` flags (tokens) left out.
inline std::vector<std::string> RepeatedFlagErrors(
    const std::map<std::string, std::vector<std::string>>& repeated,
    const std::vector<std::string>& secret = {}) {
  std::vector<std::string> lines;
  for (const auto& [name, values] : repeated) {
    std::string line = "--" + name + " is given " + std::to_string(values.size()) + " times";
    bool hide = false;
    for (const std::string& s : secret) hide = hide || s == name;
    if (!hide) {
      line += " (";
      for (size_t i = 0; i < values.size(); ++i) line += (i ? ", " : "") + values[i];
      line += ")";
    }
    lines.push_back(line + "; give it once");
  }
  return lines;
}

// A program's flags by name, as PrintFlagsHelp and UnparsableFlags take them: those of `all`
// (absl::GetAllFlags()) defined in a file whose path contains `file`.
template <typename AllFlags>
auto ProgramFlags(const AllFlags& all, std::string_view file) {
  std::map<std::string, typename AllFlags::mapped_type> out;
  for (const auto& [name, flag] : all) {
    if (std::string_view(flag->Filename()).find(file) != std::string_view::npos) {
      out[std::string(name)] = flag;
    }
  }
  return out;
}

// The names in argv[1..argc) that are no flag and the values that do not parse as their flag's
// type, a line each ("--max_message_mb must be an integer (got 'abc')"): usage errors a program
// reports beside its others (exit 2), where absl's parser exits 1 on the first. Reads argv as
// RepeatedFlags does. `flags`: the program's (ProgramFlags); `known(name)`: whether absl has a
// flag of that name at all (its own, such as --flagfile, are left to it). A value that parses
// sets its flag, as absl's parser would after this.
template <typename Flags, typename Known>
std::vector<std::string> UnparsableFlags(int argc, char** argv, const Flags& flags, Known&& known) {
  std::vector<std::string> bad;
  ForEachFlagArgument(argc, argv, [&](const FlagArgument& arg, auto&& take_next) {
    const std::string& name = arg.name;
    auto it = flags.find(name);
    if (it == flags.end()) {
      auto no = name.rfind("no", 0) == 0 ? flags.find(name.substr(2)) : flags.end();
      if (no != flags.end() && no->second->template IsOfType<bool>()) {
        if (arg.value) bad.push_back("--" + name + " takes no value (--" + no->first + "=false)");
      } else if (arg.value &&
                 (name == "help" || name == "helpfull" || name == "h" || name == "version")) {
        // FindInfoFlag answers the bare word only.
        const std::string shown = (name == "h" ? "-" : "--") + name;
        bad.push_back(shown + " takes no value (" + shown + " alone)");
      } else if (!known(name)) {
        // "-1" (an argument meant as a negative number) reads as a flag named 1.
        const bool number = !name.empty() && name.find_first_not_of("0123456789.") == name.npos;
        bad.push_back(number ? "-" + name +
                                   ": no argument is negative, and a word that starts with - is "
                                   "read as a flag (see --help)"
                             : "unknown flag --" + name + " (see --help)");
      }
      return;
    }
    const auto& flag = it->second;
    if (!arg.value && flag->template IsOfType<bool>()) return;
    const std::optional<std::string> value = arg.value ? arg.value : take_next();
    if (!value) {
      bad.push_back("--" + name + " needs a value (--" + name + "=VALUE)");
      return;
    }
    std::string error;
    if (flag->ParseFrom(*value, &error)) return;
    std::string want;
    if (flag->template IsOfType<bool>()) {
      want = "must be true or false";
    } else if (flag->template IsOfType<int64_t>() || flag->template IsOfType<int32_t>()) {
      want = "must be an integer";
    } else if (flag->template IsOfType<double>()) {
      want = "must be a number";
    } else {  // an enum's own words follow absl's: "Illegal value ...; must be one of ..."
      const size_t own = error.rfind("; ");
      want = own != std::string::npos ? error.substr(own + 2) : error;
    }
    bad.push_back("--" + name + " " + want + " (got '" + *value + "')");
  });
  return bad;
}

// For a program that stops on any of them: writes "PROGRAM: <line>" to stderr for each of
// UnparsableFlags' lines and returns false when there was any.
template <typename Flags, typename Known>
bool NoUnparsableFlags(const char* program, int argc, char** argv, const Flags& flags,
                       Known&& known) {
  const std::vector<std::string> lines = UnparsableFlags(argc, argv, flags, known);
  for (const std::string& line : lines) std::cerr << program << ": " << line << "\n";
  return lines.empty();
}

// For a program whose every repeated flag is an error: writes "PROGRAM: <line>" to stderr for
// each (RepeatedFlagErrors) and returns false when there was any.
inline bool NoRepeatedFlags(const char* program, int argc, char** argv,
                            const std::map<std::string, bool>& flags,
                            const std::vector<std::string>& secret = {}) {
  const std::vector<std::string> lines =
      RepeatedFlagErrors(RepeatedFlags(argc, argv, flags), secret);
  for (const std::string& line : lines) std::cerr << program << ": " << line << "\n";
  return lines.empty();
}

}  // namespace pagedattn
