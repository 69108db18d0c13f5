// A rank's BootstrapConfig from its launcher's environment (see bootstrap_config_from_env in
// pcpkv/ranks/bootstrap.h): `pcpkv launch`'s PCPKV_* variables or torchrun's, every variable read through the
// registry of pcpkv/core/env.h.
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "pcpkv/core/env.h"
#include "pcpkv/core/error.h"
#include "core/fnv1a.h"
#include "pcpkv/core/input_limits.h"
#include "pcpkv/ranks/bootstrap.h"

namespace pcpkv {
namespace {

const char* env(const char* name) {
  const char* v = read_env(name);
  return (v && *v) ? v : nullptr;
}

constexpr int32_t kMaxEnvInt = 1 << 20;

// A variable the launch must set: unset or empty is named as such, a malformed value by read_env_int.
int32_t required_int(const char* name, int32_t lo, int32_t hi = kMaxEnvInt) {
  const std::optional<int64_t> v = read_env_int(name, lo, hi, "bootstrap");
  PCPKV_CHECK(v.has_value(), "bootstrap: environment variable {} is {}", name,
              read_env(name) ? "set but empty" : "not set");
  return static_cast<int32_t>(*v);
}

// A launcher sets a rank's variables together; one set without the other is a broken launch, not a
// single-process run (which would silently do other work than the job asked for).
void check_set_together(const char* rank, const char* world, const std::vector<const char*>& others) {
  std::vector<const char*> all = {rank, world};
  all.insert(all.end(), others.begin(), others.end());
  for (const char* name : all) {
    if (!env(name)) continue;
    for (const char* needed : {rank, world}) {
      PCPKV_CHECK(env(needed) != nullptr,
                  "bootstrap: {}='{}' is set but {} is not; a launcher sets {} and {} together (unset {} for a "
                  "single-process run)",
                  name, clip(env(name)), needed, rank, world, name);
    }
  }
}

// pcpkv's rendezvous is single-host: every rank of the job is local, so the local values equal the global
// ones. Different values mean a multi-host job (its other hosts could never connect) or a broken launcher.
void check_local(const BootstrapConfig& c, const char* rank, const char* world, const char* local_rank,
                 const char* local_world) {
  PCPKV_CHECK(c.local_world_size == c.world_size,
              "bootstrap: {}={} differs from {}={}: the job spans more than this host, but pcpkv's rendezvous and "
              "symmetric memory are single-host",
              local_world, c.local_world_size, world, c.world_size);
  PCPKV_CHECK(c.local_rank == c.rank,
              "bootstrap: {}={} differs from {}={}: on one host every rank's local rank equals its rank", local_rank,
              c.local_rank, rank, c.rank);
}

// FNV-1a of this process's command line (/proc/self/cmdline): the ranks of one torchrun-style job run one
// command; two jobs on one MASTER_PORT (other seeds, other flags) run different ones.
std::pair<uint64_t, std::string> command_line() {
  std::ifstream f("/proc/self/cmdline", std::ios::binary);
  const std::string raw((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const uint64_t h = fnv1a(raw.data(), raw.size());
  std::string text = raw;
  std::replace(text.begin(), text.end(), '\0', ' ');
  while (!text.empty() && text.back() == ' ') text.pop_back();
  return {h, text};
}

bool address_is_local(const std::string& addr) {
  if (addr == "localhost" || addr == "localhost.localdomain" || addr == "ip6-localhost") return true;
  in_addr a4{};
  in6_addr a6{};
  if (::inet_pton(AF_INET, addr.c_str(), &a4) == 1 && (ntohl(a4.s_addr) >> 24) == 127) return true;
  if (::inet_pton(AF_INET6, addr.c_str(), &a6) == 1 && IN6_IS_ADDR_LOOPBACK(&a6)) return true;
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) == 0) {
    const std::string h(host);
    if (addr == h || addr == h.substr(0, h.find('.'))) return true;
  }
  // One of this host's own interface addresses.
  ifaddrs* list = nullptr;
  bool found = false;
  if (::getifaddrs(&list) == 0) {
    for (ifaddrs* i = list; i && !found; i = i->ifa_next) {
      if (!i->ifa_addr) continue;
      char buf[INET6_ADDRSTRLEN] = {};
      if (i->ifa_addr->sa_family == AF_INET)
        ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf, sizeof(buf));
      else if (i->ifa_addr->sa_family == AF_INET6)
        ::inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(i->ifa_addr)->sin6_addr, buf, sizeof(buf));
      found = addr == buf;
    }
    ::freeifaddrs(list);
  }
  return found;
}

}  // namespace

std::optional<BootstrapConfig> bootstrap_config_from_env() {
  BootstrapConfig c;
  if (const char* t = env(kEnvTimeout)) {
    char* end = nullptr;
    c.timeout_s = std::strtod(t, &end);
    PCPKV_CHECK(end != t && *end == '\0' && c.timeout_s > 0, "bootstrap: {}='{}' is not a positive number of seconds",
                kEnvTimeout, clip(t));
  }
  const bool launched = env(kEnvRank) || env(kEnvWorldSize) || env(kEnvLocalRank) || env(kEnvLocalWorldSize);
  if (launched) {
    check_set_together(kEnvRank, kEnvWorldSize, {kEnvLocalRank, kEnvLocalWorldSize});
    c.world_size = required_int(kEnvWorldSize, 1);
    c.rank = required_int(kEnvRank, 0);
    c.local_world_size = env(kEnvLocalWorldSize) ? required_int(kEnvLocalWorldSize, 1) : c.world_size;
    c.local_rank = env(kEnvLocalRank) ? required_int(kEnvLocalRank, 0) : c.rank;
    const char* addr = env(kEnvBootstrap);
    const char* token = env(kEnvJobToken);
    PCPKV_CHECK(addr != nullptr, "bootstrap: {} is set but {} (the socket path) is not", kEnvRank, kEnvBootstrap);
    PCPKV_CHECK(token != nullptr, "bootstrap: {} is set but {} is not", kEnvRank, kEnvJobToken);
    c.address = addr;
    c.token = token;
    c.job = fmt::format("pcpkv launch (pid {})", ::getppid());
    c.source = "pcpkv launch";
    c.token_per_attempt = true;  // a fresh token per launch (a retry is another launch)
    PCPKV_CHECK(c.rank < c.world_size, "bootstrap: {}={} must be < {}={}", kEnvRank, c.rank, kEnvWorldSize,
                c.world_size);
    check_local(c, kEnvRank, kEnvWorldSize, kEnvLocalRank, kEnvLocalWorldSize);
    return c;
  }
  if (!(env("RANK") || env("WORLD_SIZE") || env("LOCAL_RANK") || env("LOCAL_WORLD_SIZE"))) return std::nullopt;
  check_set_together("RANK", "WORLD_SIZE", {"LOCAL_RANK", "LOCAL_WORLD_SIZE"});
  c.world_size = required_int("WORLD_SIZE", 1);
  c.rank = required_int("RANK", 0);
  c.local_world_size = env("LOCAL_WORLD_SIZE") ? required_int("LOCAL_WORLD_SIZE", 1) : c.world_size;
  c.local_rank = env("LOCAL_RANK") ? required_int("LOCAL_RANK", 0) : c.rank;
  PCPKV_CHECK(c.rank < c.world_size, "bootstrap: RANK={} must be < WORLD_SIZE={}", c.rank, c.world_size);
  check_local(c, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE");
  const char* master = env("MASTER_ADDR");
  const std::string master_addr = master ? master : "127.0.0.1";
  // A switch: "yes" or "true" is refused by name rather than read as off (and then as "not this host").
  const bool allow = read_env_switch(kEnvAllowNonlocal);
  PCPKV_CHECK(allow || address_is_local(master_addr),
              "bootstrap: MASTER_ADDR='{}' is not this host; pcpkv's rendezvous and symmetric memory are "
              "single-host (a Unix-domain socket and file-descriptor passing); run the ranks of one host "
              "together, or set {}=1 if '{}' is this host under another name",
              clip(master_addr), kEnvAllowNonlocal, clip(master_addr));
  const int32_t port = required_int("MASTER_PORT", 1, 65535);
  const char* dir = env("PCPKV_BOOTSTRAP_DIR");
  if (!dir) dir = env("TMPDIR");
  c.address = fmt::format("{}/pcpkv-{}/port{}.sock", dir ? dir : "/tmp", ::geteuid(), port);
  // The job's identity: an explicit one, else the run id and the command line. torchrun's default run id
  // is "none" for every job, so it alone cannot tell two jobs apart.
  const char* run_id = env("TORCHELASTIC_RUN_ID");
  if (run_id && std::string(run_id) == "none") run_id = nullptr;
  const auto [cmd_hash, cmd] = command_line();
  if (const char* t = env(kEnvJobToken)) {
    c.token = t;
    c.job = fmt::format("MASTER_PORT {}, {}", port, kEnvJobToken);
  } else if (const char* id = env(kEnvJobId)) {
    c.token = fmt::format("job:{}", id);
    c.job = fmt::format("MASTER_PORT {}, {}={}", port, kEnvJobId, clip(id, 64));
  } else {
    c.token = fmt::format("{}/cmd:{:016x}", run_id ? fmt::format("torchelastic:{}", run_id) : fmt::format("port:{}", port),
                          cmd_hash);
    c.job = fmt::format("MASTER_PORT {}{}, command '{}'", port,
                        run_id ? fmt::format(", TORCHELASTIC_RUN_ID={}", clip(run_id, 64)) : std::string(),
                        clip(cmd, 120));
  }
  c.source = "torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)";
  return c;
}

}  // namespace pcpkv
