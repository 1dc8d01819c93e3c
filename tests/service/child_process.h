// A program run in a child process of the test (a pagedattn-server the test starts and kills).
#pragma once

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

namespace pagedattn {

// Starts args[0] with args (execv: a path, no search); its pid, or -1 where fork failed. A
// program that cannot be run exits 127.
inline pid_t SpawnProcess(std::vector<std::string> args) {
  const pid_t pid = fork();
  if (pid == 0) {
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  return pid;
}

// Sends signal to the child (if any) and waits for its end; pid is -1 after.
inline void StopProcess(pid_t& pid, int signal) {
  if (pid <= 0) return;
  kill(pid, signal);
  waitpid(pid, nullptr, 0);
  pid = -1;
}

}  // namespace pagedattn
