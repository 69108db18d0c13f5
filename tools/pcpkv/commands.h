// tools/pcpkv/commands.h: one function per subcommand; each lives in its own cmd_<name>.cpp.
#pragma once

namespace CLI {
class App;
}

namespace pcpkv::cli {

void add_run_command(CLI::App& app);    // cmd_run.cpp:   the main job (publish + verify + stage table)
void add_bench_command(CLI::App& app);  // cmd_bench.cpp: GPU benchmarks (CUDA builds; explains otherwise)
void add_info_command(CLI::App& app);   // cmd_info.cpp:  presets, layouts, backends
void add_launch_command(CLI::App& app); // cmd_launch.cpp: spawn N rank processes
void add_attention_command(CLI::App& app);  // cmd_attention.cpp: indexer + sparse MLA on the replicas
void add_serving_command(CLI::App& app);    // cmd_bench_serving.cpp: `pcpkv bench-serving` (router, all-reduce, PDL)

}  // namespace pcpkv::cli
