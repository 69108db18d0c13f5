// `pcpkv info`: the presets and their key dims, the byte layouts (SPEC section 3), and which backends can
// run here (and why not).
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "pcpkv/publish/backend.h"
#include "pcpkv/commands.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"
#include "pcpkv/core/layout.h"
#include "pcpkv/core/model.h"

namespace pcpkv::cli {
namespace {

std::string rope_text(const ModelConfig& m) {
  std::string s = m.rope.scaling == RopeScaling::kDeepseekYarn
                      ? fmt::format("yarn (factor {}, orig {}), theta {}", m.rope.factor,
                                    m.rope.original_max_position_embeddings, m.rope.theta)
                      : fmt::format("default, theta {}", m.rope.theta);
  s += fmt::format("; k_pe {}, indexer {}", m.mla_rope_interleave ? "interleaved" : "neox",
                   m.indexer_rope_interleave ? "interleaved" : "neox");
  return s;
}

void info(bool as_json) {
  using nlohmann::json;
  json j;
  std::string text;

  // ---- presets
  // preset() falls back to built-in values when configs/<name>.json is absent: say which one is used.
  const std::string dir = config_dir();
  std::vector<std::string> missing;
  for (const std::string& name : preset_names()) {
    std::error_code ec;
    if (!std::filesystem::exists(dir + "/" + name + ".json", ec)) missing.push_back(name);  // as preset() decides
  }
  if (missing.empty()) {
    text += "presets (configs in " + dir + ")\n";
  } else {
    text += fmt::format(
        "presets (configs in {}; not found there: {}, so built-in values; PCPKV_CONFIG_DIR sets the directory)\n",
        dir, fmt::join(missing, ", "));
  }
  j["config_dir"] = dir;
  json presets = json::array();
  for (const std::string& name : preset_names()) {
    const bool builtin = std::find(missing.begin(), missing.end(), name) != missing.end();
    ModelConfig m;
    try {
      m = preset(name);
    } catch (const Error& e) {
      // One broken preset file must not hide the rest of the report: its line says why.
      text += fmt::format("  {:<14} unusable: {}\n", name, clip_middle(e.what(), 500));
      presets.push_back({{"name", name}, {"source", dir + "/" + name + ".json"}, {"error", clip_middle(e.what())}});
      continue;
    }
    text += fmt::format(
        "  {:<14} {} : hidden {}, heads {}, q_lora_rank {}, kv_lora_rank {}, qk_nope/rope/v {}/{}/{},\n"
        "  {:<14} index heads/dim/topk {}/{}/{}, rms_norm_eps {:g}, layers {} ({} dense),\n"
        "  {:<14} rope {}; softmax scale {:.6f}\n",
        name, m.model_type, m.hidden_size, m.num_attention_heads, m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim,
        m.qk_rope_head_dim, m.v_head_dim, "", m.index_n_heads, m.index_head_dim, m.index_topk, m.rms_norm_eps,
        m.num_hidden_layers, m.first_k_dense_replace, "", rope_text(m), m.softmax_scale());
    presets.push_back({{"name", name},
                       {"source", builtin ? std::string("built-in") : dir + "/" + name + ".json"},
                       {"model_type", m.model_type},
                       {"hidden_size", m.hidden_size},
                       {"num_attention_heads", m.num_attention_heads},
                       {"q_lora_rank", m.q_lora_rank},
                       {"kv_lora_rank", m.kv_lora_rank},
                       {"qk_nope_head_dim", m.qk_nope_head_dim},
                       {"qk_rope_head_dim", m.qk_rope_head_dim},
                       {"v_head_dim", m.v_head_dim},
                       {"index_n_heads", m.index_n_heads},
                       {"index_head_dim", m.index_head_dim},
                       {"index_topk", m.index_topk},
                       {"rms_norm_eps", m.rms_norm_eps},
                       {"rope_theta", m.rope.theta},
                       {"rope_scaling", m.rope.scaling == RopeScaling::kDeepseekYarn ? "yarn" : "default"},
                       {"indexer_rope_interleave", m.indexer_rope_interleave},
                       {"num_hidden_layers", m.num_hidden_layers},
                       {"softmax_scale", m.softmax_scale()}});
  }
  j["presets"] = presets;

  // ---- layouts
  text += "\nbyte layouts (SPEC section 3)\n";
  text += "  MLA cache row   bf16       1152 B  kv_c 512 bf16 | k_pe 64 bf16\n";
  text += "                  fp8         576 B  kv_c 512 e4m3 | k_pe 64 e4m3 (x / k_scale)\n";
  text += fmt::format(
      "                  fp8_ds_mla  656 B  kv_c 512 e4m3 [{}, 512) | 4 fp32 tile scales [{}, 528) | "
      "k_pe 64 bf16 [{}, 656)\n",
      kDsMlaKvcOffset, kDsMlaScaleOffset, kDsMlaKpeOffset);
  text += fmt::format(
      "  indexer-K slot  {} B  per block of B slots: B x 128 e4m3, then B x fp32 UE8M0 scale; "
      "block stride B*132 (padding accepted)\n",
      kIndexerSlotBytes);
  text += "  transport row   (MLA row | indexer K 128 e4m3 | indexer scale fp32 | pad)\n";
  json layouts = json::array();
  for (KvFormat f : {KvFormat::kFp8DsMla, KvFormat::kFp8, KvFormat::kBf16}) {
    CacheFormat with;
    with.kv_format = f;
    with.has_indexer = true;
    CacheFormat without = with;
    without.has_indexer = false;
    const TransportRowLayout a = transport_row_layout(with);
    const TransportRowLayout b = transport_row_layout(without);
    text += fmt::format("                  {:<10} {:>4} B with an indexer (K at {}, scale at {}), {:>4} B without\n",
                        to_string(f), a.row_bytes, a.index_data_offset, a.index_scale_offset, b.row_bytes);
    layouts.push_back({{"kv_format", to_string(f)},
                       {"mla_row_bytes", mla_row_bytes(f)},
                       {"transport_row_bytes", a.row_bytes},
                       {"transport_row_bytes_no_indexer", b.row_bytes},
                       {"index_data_offset", a.index_data_offset},
                       {"index_scale_offset", a.index_scale_offset}});
  }
  text += "  staging         [2][ubatches][pcp_world][max_local_tokens][transport row] per rank\n";
  j["layouts"] = {{"rows", layouts}, {"indexer_slot_bytes", kIndexerSlotBytes}};

  // ---- backends
  text += "\nbackends\n";
  json backends = json::array();
  std::string cpu_device;
  try {
    cpu_device = make_cpu_backend()->device();
  } catch (const Error& e) {
    cpu_device = std::string("unavailable: ") + e.what();
  }
  text += fmt::format("  cpu   available: {} (the reference backend; ranks as threads)\n", cpu_device);
  backends.push_back({{"name", "cpu"}, {"available", true}, {"device", cpu_device}});
  std::string why;
  const bool cuda_ok = cuda_backend_available(&why);
  std::string cuda_device;
  if (cuda_ok) {
    try {
      cuda_device = make_backend("cuda")->device();
    } catch (const Error& e) {
      cuda_device = e.what();
    }
    text += fmt::format("  cuda  available: {}\n", cuda_device);
  } else {
    text += fmt::format("  cuda  unavailable: {}\n", why);
  }
  backends.push_back({{"name", "cuda"}, {"available", cuda_ok}, {"device", cuda_device}, {"why_not", why}});
  text += fmt::format("  auto  picks {}\n", cuda_ok ? "cuda" : "cpu");
  j["backends"] = backends;

  if (as_json) {
    std::fputs(j.dump(2).c_str(), stdout);
    std::fputs("\n", stdout);
  } else {
    std::fputs(text.c_str(), stdout);
  }
}

}  // namespace

void add_info_command(CLI::App& app) {
  auto as_json = std::make_shared<bool>(false);
  CLI::App* sub = app.add_subcommand("info", "List model presets, byte layouts and the backends available here");
  sub->add_flag("--json", *as_json, "Print as JSON");
  sub->callback([as_json] { info(*as_json); });
}

}  // namespace pcpkv::cli
