// ConsumerBenchResult::describe (pcpkv_bench/consumers.h): the markdown table `pcpkv attention --bench` prints.
// Host code in every build.
#include <string>

#include <fmt/format.h>

#include "pcpkv_bench/consumers.h"

namespace pcpkv {

std::string ConsumerBenchResult::describe() const {
  std::string s = fmt::format("device: {}\nmeasured ceilings: copy {:.2f} TB/s, fp32 FMA {:.1f} TFLOP/s\n\n", device,
                              copy_tbps, fp32_tflops);
  s += "| kernel | time (ms) | TFLOP/s | % of ceiling | ceiling | unique TB/s | % copy bw |\n"
       "|---|---|---|---|---|---|---|\n";
  for (const ConsumerBenchRow& r : rows)
    s += fmt::format("| {} | {:.2f} | {:.1f} | {:.0f}% | {} {:.1f} | {:.3f} | {:.1f}% |\n", r.name, r.ms, r.tflops,
                     r.peak_tflops > 0 ? 100.0 * r.tflops / r.peak_tflops : 0.0, r.peak_name, r.peak_tflops, r.tbps,
                     100.0 * r.tbps / copy_tbps);
  s += fmt::format("\nfirst attention kernel: rows gathered (L2-served, per token and head group): {:.2f} TB/s\n",
                   attention_gathered_tbps);
  s += "ceilings: fp32 FMA is measured here; fp64 tensor (DMMA) and dense bf16 tensor are the H100/H200 SXM "
       "datasheet peaks (67 and 989 TFLOP/s), scaled by the measured fp32 / 67 TFLOP/s clock ratio.\n";
  return s;
}

}  // namespace pcpkv
