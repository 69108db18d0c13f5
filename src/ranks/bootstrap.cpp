// Bootstrap's collectives (see pcpkv/ranks/bootstrap.h): each is a gather at rank 0 and its answer to every rank,
// over the links the rendezvous made (bootstrap_rendezvous.cpp, messaging in bootstrap_star.cpp).
#include "pcpkv/ranks/bootstrap.h"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "pcpkv/core/error.h"
#include "core/fnv1a.h"
#include "ranks/bootstrap_impl.h"
#include "ranks/bootstrap_socket.h"

namespace pcpkv {

using namespace bootstrap_wire;
using bootstrap_socket::errno_text;

int32_t Bootstrap::rank() const { return impl_->cfg.rank; }
int32_t Bootstrap::world_size() const { return impl_->cfg.world_size; }
int32_t Bootstrap::local_rank() const { return impl_->cfg.local_rank; }
int32_t Bootstrap::local_world_size() const { return impl_->cfg.local_world_size; }
const BootstrapConfig& Bootstrap::config() const { return impl_->cfg; }
const std::vector<int64_t>& Bootstrap::pids() const { return impl_->pids; }

std::vector<std::vector<uint8_t>> Bootstrap::all_gather_v(const void* send, size_t bytes) {
  Impl& m = *impl_;
  const int world = m.cfg.world_size;
  std::vector<std::vector<uint8_t>> out(world);
  const auto* src = static_cast<const uint8_t*>(send);
  if (world == 1) {
    out[0].assign(src, src + bytes);
    return out;
  }
  if (m.is_root()) {
    std::vector<Frame> frames = m.root_gather(FrameType::kData, "all_gather");
    frames[0].payload.assign(src, src + bytes);
    std::vector<uint8_t> packed;
    for (int r = 0; r < world; ++r) {
      const uint64_t n = frames[r].payload.size();
      packed.insert(packed.end(), reinterpret_cast<const uint8_t*>(&n), reinterpret_cast<const uint8_t*>(&n) + 8);
      packed.insert(packed.end(), frames[r].payload.begin(), frames[r].payload.end());
      out[r] = std::move(frames[r].payload);
    }
    m.root_send_all(FrameType::kData, packed, "all_gather");
    return out;
  }
  m.follower_send(FrameType::kData, send, bytes, "all_gather");
  const Frame f = m.follower_recv(FrameType::kData, "all_gather");
  size_t pos = 0;
  for (int r = 0; r < world; ++r) {
    uint64_t n = 0;
    PCPKV_CHECK(pos + 8 <= f.payload.size(), "bootstrap: all_gather reply from rank 0 is truncated");
    std::memcpy(&n, f.payload.data() + pos, 8);
    pos += 8;
    PCPKV_CHECK(pos + n <= f.payload.size(), "bootstrap: all_gather reply from rank 0 is truncated");
    out[r].assign(f.payload.begin() + static_cast<std::ptrdiff_t>(pos),
                  f.payload.begin() + static_cast<std::ptrdiff_t>(pos + n));
    pos += n;
  }
  return out;
}

void Bootstrap::all_gather(const void* send, size_t bytes, void* recv) {
  const auto blobs = all_gather_v(send, bytes);
  auto* dst = static_cast<uint8_t*>(recv);
  for (size_t r = 0; r < blobs.size(); ++r) {
    if (blobs[r].size() != bytes) {
      const std::string why = fmt::format("all_gather: {} contributed {} bytes, rank {} expected {}",
                                          impl_->who(static_cast<int>(r)), blobs[r].size(), rank(), bytes);
      abort(why);
      throw Error("bootstrap: " + why);
    }
    std::memcpy(dst + r * bytes, blobs[r].data(), bytes);
  }
}

std::vector<UniqueFd> Bootstrap::all_gather_fds(int fd) {
  Impl& m = *impl_;
  const int world = m.cfg.world_size;
  PCPKV_CHECK(fd >= 0, "bootstrap: all_gather_fds: fd {} is not open", fd);
  std::vector<UniqueFd> out(world);
  UniqueFd own(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
  PCPKV_CHECK(own, "bootstrap: all_gather_fds: dup of fd {} failed: {}", fd, errno_text(errno));
  if (world == 1) {
    out[0] = std::move(own);
    return out;
  }
  const uint8_t tag = 0;
  if (m.is_root()) {
    std::vector<Frame> frames = m.root_gather(FrameType::kFd, "all_gather_fds");
    out[0] = std::move(own);
    for (int r = 1; r < world; ++r) {
      if (frames[r].fds.size() != 1)
        m.fail_job(fmt::format("all_gather_fds: {} sent {} descriptors, expected 1", m.who(r), frames[r].fds.size()));
      out[r] = std::move(frames[r].fds[0]);
    }
    const Deadline dl = m.deadline();
    for (int p = 1; p < world; ++p)
      for (int r = 0; r < world; ++r)
        if (send_frame(m.conns[p].get(), FrameType::kFd, &tag, 1, dl, out[r].get()) != IoStatus::kOk)
          m.fail_job(fmt::format("all_gather_fds: sending to {} failed (exited or killed?)", m.who(p)), p);
    return out;
  }
  m.follower_send(FrameType::kFd, &tag, 1, "all_gather_fds", fd);
  for (int r = 0; r < world; ++r) {
    Frame f = m.follower_recv(FrameType::kFd, "all_gather_fds");
    PCPKV_CHECK(f.fds.size() == 1, "bootstrap: all_gather_fds: rank 0 sent {} descriptors for rank {}, expected 1",
                f.fds.size(), r);
    out[r] = std::move(f.fds[0]);
  }
  out[m.cfg.rank] = std::move(own);  // the caller's own descriptor, not the round trip through rank 0
  return out;
}

void Bootstrap::barrier() {
  const uint8_t b = 0;
  (void)all_gather_v(&b, 1);
}

void Bootstrap::agree(bool ok, const std::string& why, const std::string& what, const std::string& outcome) {
  std::string mine(1, ok ? '1' : '0');
  mine += why;
  const auto all = all_gather_v(mine.data(), mine.size());
  std::vector<std::string> failures;
  for (size_t r = 0; r < all.size(); ++r) {
    if (!all[r].empty() && all[r][0] == '1') continue;
    const std::string reason = all[r].size() > 1 ? std::string(all[r].begin() + 1, all[r].end()) : "(no reason given)";
    failures.push_back(fmt::format("rank {}: {}", r, reason));
  }
  if (!failures.empty())
    throw Error(fmt::format("{} failed on {} of {} ranks ({}): {}", what, failures.size(), all.size(), outcome,
                            fmt::join(failures, "; ")));
}

namespace {

// (field, value) pairs as one blob: each string's length (8 bytes) then its bytes, so no separator can be forged.
std::vector<uint8_t> pack_fields(const std::vector<std::pair<std::string, std::string>>& fields) {
  std::vector<uint8_t> out;
  auto put = [&](const std::string& s) {
    const uint64_t n = s.size();
    out.insert(out.end(), reinterpret_cast<const uint8_t*>(&n), reinterpret_cast<const uint8_t*>(&n) + 8);
    out.insert(out.end(), s.begin(), s.end());
  };
  for (const auto& [k, v] : fields) {
    put(k);
    put(v);
  }
  return out;
}

std::vector<std::pair<std::string, std::string>> unpack_fields(const std::vector<uint8_t>& blob) {
  std::vector<std::pair<std::string, std::string>> out;
  size_t pos = 0;
  auto get = [&](std::string* s) {
    uint64_t n = 0;
    if (pos + 8 > blob.size()) return false;
    std::memcpy(&n, blob.data() + pos, 8);
    pos += 8;
    if (n > blob.size() - pos) return false;
    s->assign(blob.begin() + static_cast<std::ptrdiff_t>(pos), blob.begin() + static_cast<std::ptrdiff_t>(pos + n));
    pos += n;
    return true;
  };
  std::string k, v;
  while (pos < blob.size() && get(&k) && get(&v)) out.emplace_back(k, v);
  return out;
}

// "field: rank a has x, rank b has y" for the first field where a and b differ ("" when they do not).
std::string first_difference(const std::vector<std::pair<std::string, std::string>>& a,
                             const std::vector<std::pair<std::string, std::string>>& b, size_t ra, size_t rb) {
  for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    if (i >= a.size() || i >= b.size() || a[i].first != b[i].first)
      return fmt::format("the fields themselves (another pcpkv version?): rank {} has '{}', rank {} has '{}'", ra,
                         i < a.size() ? a[i].first : "(none)", rb, i < b.size() ? b[i].first : "(none)");
    if (a[i].second != b[i].second)
      return fmt::format("{}: rank {} has {}, rank {} has {}", a[i].first, ra, a[i].second, rb, b[i].second);
  }
  return {};
}

}  // namespace

void Bootstrap::agree_on(const std::string& what, const std::vector<std::pair<std::string, std::string>>& fields) {
  const std::vector<uint8_t> mine = pack_fields(fields);
  uint64_t digest = fnv1a(mine.data(), mine.size());
  std::vector<uint64_t> digests(static_cast<size_t>(world_size()));
  all_gather(&digest, sizeof(digest), digests.data());
  if (std::all_of(digests.begin(), digests.end(), [&](uint64_t d) { return d == digests[0]; })) return;
  // Every rank saw the same digests, so every rank takes this exchange and builds the same message.
  const auto blobs = all_gather_v(mine.data(), mine.size());
  const auto first = unpack_fields(blobs[0]);
  std::vector<size_t> differ;
  std::string diff;
  for (size_t r = 1; r < blobs.size(); ++r) {
    const std::string d = first_difference(first, unpack_fields(blobs[r]), 0, r);
    if (d.empty()) continue;
    if (diff.empty()) diff = d;
    differ.push_back(r);
  }
  if (diff.empty()) diff = "their digests only (a hash collision of the fields?)";
  throw Error(fmt::format("{}ranks disagree on {}{}; every rank must run the same configuration (nothing was "
                          "allocated or written)",
                          what.empty() ? std::string() : what + ": ", diff,
                          differ.size() > 1 ? fmt::format(" (ranks {} differ from rank 0)", fmt::join(differ, ", "))
                                            : std::string()));
}

std::unique_ptr<Bootstrap> Bootstrap::split(int32_t color, int32_t key) {
  Impl& m = *impl_;
  const int32_t seq = m.split_seq++;
  int32_t mine[2] = {color, key};
  std::vector<int32_t> all(2 * m.cfg.world_size);
  all_gather(mine, sizeof(mine), all.data());
  if (color < 0) return nullptr;
  std::vector<std::pair<int32_t, int32_t>> members;  // (key, rank)
  for (int r = 0; r < m.cfg.world_size; ++r)
    if (all[2 * r] == color) members.emplace_back(all[2 * r + 1], r);
  std::sort(members.begin(), members.end());
  BootstrapConfig sub = m.cfg;
  sub.world_size = static_cast<int32_t>(members.size());
  for (size_t i = 0; i < members.size(); ++i)
    if (members[i].second == m.cfg.rank) sub.rank = static_cast<int32_t>(i);
  sub.token = fmt::format("{}/split{}/color{}", m.cfg.token, seq, color);
  sub.address = fmt::format("{}.s{}c{}", m.cfg.address, seq, color);
  sub.source = fmt::format("{} (split {} color {})", m.cfg.source, seq, color);
  // Every sub-group needs at least its own socket path; world-size-1 groups need none.
  return connect(sub);
}

void Bootstrap::abort(const std::string& why) noexcept {
  try {
    Impl& m = *impl_;
    const std::string msg = fmt::format("{} aborted: {}", m.who(m.cfg.rank), why);
    const Deadline dl = Clock::now() + std::chrono::milliseconds(200);
    if (m.is_root()) {
      for (int r = 1; r < m.cfg.world_size; ++r)
        if (m.conns[r]) send_frame(m.conns[r].get(), FrameType::kAbort, msg.data(), msg.size(), dl);
    } else if (!m.conns.empty() && m.conns[0]) {
      // Rank 0 forwards it, naming this rank, at its next gather.
      send_frame(m.conns[0].get(), FrameType::kAbort, why.data(), why.size(), dl);
    }
  } catch (...) {
  }
}

}  // namespace pcpkv
