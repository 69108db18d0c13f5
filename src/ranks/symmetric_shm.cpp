// Host symmetric memory over POSIX shared memory (see pcpkv/ranks/symmetric.h).
#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>

#include <fmt/format.h>

#include "pcpkv/ranks/bootstrap.h"
#include "pcpkv/core/error.h"
#include "pcpkv/ranks/symmetric.h"

namespace pcpkv {

uint8_t* SymmetricMemory::ptr(int32_t r) const {
  PCPKV_CHECK(r >= 0 && r < world_size(), "symmetric memory '{}': rank {} is outside [0, {})", name_, r, world_size());
  return ptrs_[r];
}

namespace {

std::atomic<int32_t> g_fail_rank{-1};
std::string g_fail_why;  // written by tests before any rank runs

int64_t page_round(int64_t bytes) {
  const int64_t page = ::sysconf(_SC_PAGESIZE);
  return (bytes + page - 1) / page * page;
}

// The fill below makes every page resident, and /dev/shm (tmpfs) pages are RAM: a buffer past its free space does
// not fail cleanly (3.4 TB asked through pcpkv_torch's SymmetricCaches: the OOM killer ends the process with
// SIGKILL). The ranks of a group share this host (they meet on a Unix socket), so it must hold world x the
// buffer. Empty when it fits or when statvfs cannot tell (ftruncate and the mapping then decide).
std::string shm_space_problem(int64_t map_bytes, int32_t world) {
  struct statvfs s {};
  if (::statvfs("/dev/shm", &s) != 0) return {};
  const long double free_bytes = static_cast<long double>(s.f_bavail) * static_cast<long double>(s.f_frsize);
  const long double need = static_cast<long double>(map_bytes) * world;
  if (need <= free_bytes) return {};
  return fmt::format("{} rank(s) x {} bytes need {:.4g} GB of shared memory, more than the {:.4g} GB free in /dev/shm",
                     world, map_bytes, static_cast<double>(need / 1e9), static_cast<double>(free_bytes / 1e9));
}

class HostSymmetric final : public SymmetricMemory {
 public:
  HostSymmetric(std::string name, int32_t rank, int64_t bytes, int32_t world)
      : SymmetricMemory(std::move(name), rank, bytes), map_bytes_(page_round(bytes)) {
    ptrs_.assign(world, nullptr);
  }
  ~HostSymmetric() override {
    for (uint8_t*& p : ptrs_)
      if (p) {
        ::munmap(p, map_bytes_);
        p = nullptr;
      }
  }
  bool on_device() const override { return false; }
  int64_t map_bytes() const { return map_bytes_; }
  // Maps fd at ptrs_[r]; returns an empty string or the reason it failed.
  std::string map(int32_t r, int fd) {
    struct stat st {};
    if (::fstat(fd, &st) != 0) return fmt::format("fstat of rank {}'s buffer failed: {}", r, std::strerror(errno));
    if (st.st_size < map_bytes_)
      return fmt::format("rank {}'s buffer has {} bytes, expected {}", r, st.st_size, map_bytes_);
    void* p = ::mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) return fmt::format("mmap of rank {}'s buffer failed: {}", r, std::strerror(errno));
    ptrs_[r] = static_cast<uint8_t*>(p);
    return {};
  }

 private:
  int64_t map_bytes_;
};

}  // namespace

void agree_symmetric_size(Bootstrap& group, int64_t bytes, const std::string& what) {
  const int32_t world = group.world_size();
  std::vector<int64_t> sizes(static_cast<size_t>(world));
  group.all_gather(&bytes, sizeof(bytes), sizes.data());
  for (size_t r = 0; r < sizes.size(); ++r)
    PCPKV_CHECK(sizes[r] == sizes[0] && sizes[r] > 0,
                "{}: rank {} asks for {} bytes, rank 0 for {}; every rank must allocate the same size (> 0)", what,
                r, sizes[r], sizes[0]);
}

void set_host_symmetric_failure_for_test(int32_t group_rank, const std::string& why) {
  g_fail_why = why;
  g_fail_rank = group_rank;
}

std::unique_ptr<SymmetricMemory> make_host_symmetric(Bootstrap& group, int64_t bytes, const std::string& name,
                                                     uint8_t fill) {
  const int32_t world = group.world_size();
  const int32_t me = group.rank();
  const std::string what = fmt::format("symmetric memory '{}' ({} bytes per rank, {} ranks)", name, bytes, world);
  agree_symmetric_size(group, bytes, what);

  auto mem = std::make_unique<HostSymmetric>(name, me, bytes, world);
  // 1. Create and fill the local buffer. The name is unlinked at once: the descriptors and mappings keep
  //    the memory alive, and a killed job leaves nothing behind in /dev/shm.
  UniqueFd fd;
  std::string why = shm_space_problem(mem->map_bytes(), world);
  group.agree(why.empty(), why, what + ": create");
  static std::atomic<uint64_t> counter{0};
  std::string tag = name.substr(0, 40);
  for (char& ch : tag)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  const std::string shm_name = fmt::format("/pcpkv-{}-{}-{}", ::getpid(), counter++, tag);
  fd.reset(::shm_open(shm_name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600));
  if (!fd) {
    why = fmt::format("shm_open('{}') failed: {}", shm_name, std::strerror(errno));
  } else {
    ::shm_unlink(shm_name.c_str());
    ::fchmod(fd.get(), 0600);
    if (::ftruncate(fd.get(), mem->map_bytes()) != 0)
      why = fmt::format("ftruncate to {} bytes failed: {}", mem->map_bytes(), std::strerror(errno));
    else
      why = mem->map(me, fd.get());
    if (why.empty()) std::memset(mem->ptrs()[me], fill, mem->map_bytes());
  }
  group.agree(why.empty(), why, what + ": create");

  // 2. Exchange descriptors and map every peer.
  std::vector<UniqueFd> fds = group.all_gather_fds(fd.get());
  fd.reset();
  why.clear();
  if (g_fail_rank.load() == me) why = g_fail_why.empty() ? "injected failure (test)" : g_fail_why;
  for (int32_t r = 0; r < world && why.empty(); ++r)
    if (r != me) why = mem->map(r, fds[r].get());
  fds.clear();  // the mappings keep the memory alive; no descriptor outlives setup
  // 3. All or nothing: on failure every rank drops what it mapped (mem's destructor) and throws.
  group.agree(why.empty(), why, what + ": map peers");
  return mem;
}

ResourceCounts count_process_resources() {
  ResourceCounts c;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (const dirent* e = ::readdir(d))
      if (e->d_name[0] != '.') ++c.open_fds;
    ::closedir(d);
    --c.open_fds;  // the directory stream's own descriptor
  }
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find("/dev/shm/") != std::string::npos) ++c.shm_mappings;
    if (line.find("/dev/nvidia") != std::string::npos) ++c.device_mappings;
  }
  return c;
}

}  // namespace pcpkv
