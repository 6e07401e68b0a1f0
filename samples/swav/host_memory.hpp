// What host memory the SwAV trainer may still take: the budget its data is read within
// (datasets.hpp) and its ranks are checked against before they start (rank_setup.hpp).
#pragma once

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

namespace swav {

// The host memory this process may still take, in bytes: what the kernel says is available
// (/proc/meminfo's MemAvailable), or what the process's memory cgroups leave where that is less
// (a container's limit -- cgroup v2's memory.max, v1's memory.limit_in_bytes -- less what the
// group holds that it could not drop, its inactive file pages aside); -1 where nothing says.
// The process's group and each group above it are read (a limit may sit on a parent: a slice,
// a pod), and where the group's own folder is not there -- a container that sees its own group
// at the hierarchy's mount point, under its host-side name -- the mount point's.
inline std::int64_t available_host_memory() {
  const auto number = [](const std::string& text) -> std::int64_t {
    errno = 0;
    char* end = nullptr;
    const long long value = std::strtoll(text.c_str(), &end, 10);
    return !text.empty() && end != nullptr && *end == '\0' && errno == 0 && value >= 0 ? value : -1;
  };
  std::int64_t available = -1;
  {
    std::ifstream meminfo("/proc/meminfo");
    std::string key, value;
    while (meminfo >> key >> value) {
      if (key == "MemAvailable:" && number(value) >= 0) {
        available = number(value) * 1024;
        break;
      }
      meminfo.ignore(256, '\n');
    }
  }
  // What one group leaves: its limit, less its usage, plus its inactive file pages; -1 where
  // it has no limit (v2's "max", v1's page-rounded 2^63 - 1) or its files are not there.
  const auto group_left = [&](const std::string& folder, const char* limit_file,
                              const char* usage_file, const char* inactive_key) -> std::int64_t {
    std::ifstream limit_in(folder + limit_file), usage_in(folder + usage_file),
        stat(folder + "/memory.stat");
    std::string limit_text, usage_text;
    if (!(limit_in >> limit_text) || !(usage_in >> usage_text)) return -1;
    const std::int64_t limit = number(limit_text), usage = number(usage_text);
    if (limit < 0 || usage < 0 || limit >= (std::int64_t{1} << 62)) return -1;
    std::int64_t inactive = 0;
    std::string key, value;
    while (stat >> key >> value)
      if (key == inactive_key) inactive = std::max<std::int64_t>(0, number(value));
    return std::max<std::int64_t>(0, limit - usage + inactive);
  };
  const auto take = [&](std::int64_t left) {
    if (left >= 0) available = available < 0 ? left : std::min(available, left);
  };
  std::ifstream self("/proc/self/cgroup");
  for (std::string line; std::getline(self, line);) {
    // "0::/path" (v2's one hierarchy) or "N:controllers:/path" (v1), one of them "memory".
    const auto first = line.find(':'), second = line.find(':', first + 1);
    if (first == std::string::npos || second == std::string::npos) continue;
    const std::string controllers = line.substr(first + 1, second - first - 1);
    const bool v2 = controllers.empty();
    if (!v2 && ("," + controllers + ",").find(",memory,") == std::string::npos) continue;
    const std::string mount = v2 ? "/sys/fs/cgroup" : "/sys/fs/cgroup/memory";
    const char* limit_file = v2 ? "/memory.max" : "/memory.limit_in_bytes";
    const char* usage_file = v2 ? "/memory.current" : "/memory.usage_in_bytes";
    const char* inactive_key = v2 ? "inactive_file" : "total_inactive_file";
    bool own_found = false;
    for (std::string path = line.substr(second + 1); !path.empty() && path != "/";
         path = path.substr(0, path.rfind('/'))) {
      own_found = own_found || std::filesystem::exists(mount + path);
      take(group_left(mount + path, limit_file, usage_file, inactive_key));
    }
    if (!own_found) take(group_left(mount, limit_file, usage_file, inactive_key));
  }
  return available;
}

// What the data of a run may take in memory: four fifths of what is available (the rest for
// the run itself), shared by the `local_processes` launched side by side on this machine, each
// of which reads its own copy (the ranks of one process share theirs); -1 (no limit) where
// nothing says.
inline std::int64_t data_memory_budget(int local_processes = 1) {
  const std::int64_t available = available_host_memory();
  return available < 0 ? -1 : available / 5 * 4 / std::max(1, local_processes);
}

}  // namespace swav
