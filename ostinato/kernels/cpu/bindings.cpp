// Python bindings (pybind11 only, no torch headers: the extension builds in seconds).
// Tensors cross as raw addresses; ostinato/layers/moe/cpu_experts.py checks dtypes,
// shapes and contiguity and keeps the tensors alive until wait().
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>

#include "dequant.h"  // built here without an ISA target: the tests' dequant_rows_bf16, on any host
#include "experts.h"
#include "graph_worker.h"
#include "kernels.h"

namespace py = pybind11;
using namespace ostinato;

namespace {

template <class T>
void def_ptr(py::class_<ColdArgs>& c, const char* name, T ColdArgs::*field) {
  c.def_property(
      name, [field](const ColdArgs& a) { return reinterpret_cast<uintptr_t>(a.*field); },
      [field](ColdArgs& a, uintptr_t v) { a.*field = reinterpret_cast<T>(v); });
}

const char* isa_str(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx512Bf16: return "avx512_bf16";
    case Isa::kAmx: return "amx";
    default: return "auto";
  }
}

template <class C, class T>
void def_addr(py::class_<C>& c, const char* name, T C::*field) {
  c.def_property(
      name, [field](const C& a) { return reinterpret_cast<uintptr_t>(a.*field); },
      [field](C& a, uintptr_t v) { a.*field = reinterpret_cast<T>(v); });
}

// The decode graph's CPU worker (graph_worker.h); ostinato/layers/moe/graph_worker.py owns
// the buffers and keeps them alive while the worker runs.
void bind_graph_worker(py::module_& m) {
  py::class_<GraphShared> sh(m, "GraphShared");
  sh.def(py::init<>());
  def_addr(sh, "post_flag", &GraphShared::post_flag);
  def_addr(sh, "has_cold", &GraphShared::has_cold);
  def_addr(sh, "done_flag", &GraphShared::done_flag);
  def_addr(sh, "ids", &GraphShared::ids);
  def_addr(sh, "weights", &GraphShared::weights);
  def_addr(sh, "x", &GraphShared::x);
  def_addr(sh, "out", &GraphShared::out);
  def_addr(sh, "tokens", &GraphShared::tokens);
  def_addr(sh, "staged", &GraphShared::staged);
  sh.def_property(
      "x_dtype", [](const GraphShared& a) { return int(a.x_dtype); },
      [](GraphShared& a, int v) { a.x_dtype = DType(v); });
  sh.def_readwrite("flag_stride", &GraphShared::flag_stride)
      .def_readwrite("L", &GraphShared::L)
      .def_readwrite("K", &GraphShared::K)
      .def_readwrite("D", &GraphShared::D)
      .def_readwrite("T", &GraphShared::T);

  py::class_<GraphWorkerOptions>(m, "GraphWorkerOptions")
      .def(py::init<>())
      .def_readwrite("cpu", &GraphWorkerOptions::cpu)
      .def_readwrite("spin_us", &GraphWorkerOptions::spin_us)
      .def_readwrite("sleep_us", &GraphWorkerOptions::sleep_us)
      .def_readwrite("idle_sleep_us", &GraphWorkerOptions::idle_sleep_us);

  py::class_<GraphWorker>(m, "GraphWorker")
      .def(py::init<ColdExperts&, const GraphShared&, std::vector<ColdArgs>, int64_t, const GraphWorkerOptions&>(),
           py::arg("runner"), py::arg("shared"), py::arg("layers"), py::arg("num_experts"), py::arg("options"),
           py::keep_alive<1, 2>())
      .def(
          "set_compact",
          [](GraphWorker& self, int64_t i, uintptr_t table, int32_t at_seq) {
            self.set_compact(i, reinterpret_cast<const int32_t*>(table), at_seq);
          },
          py::arg("i"), py::arg("table"), py::arg("at_seq"))
      .def("start", &GraphWorker::start, py::call_guard<py::gil_scoped_release>())
      .def("stop", &GraphWorker::stop, py::call_guard<py::gil_scoped_release>())
      .def("reset", &GraphWorker::reset, py::call_guard<py::gil_scoped_release>())
      .def("running", &GraphWorker::running)
      .def("last_error", &GraphWorker::last_error)
      .def("active_table", &GraphWorker::active_table)
      .def("stats", [](const GraphWorker& self) {
        const GraphWorkerStats s = self.stats();
        py::dict d;
        d["steps"] = s.steps;
        d["layers_served"] = s.layers_served;
        d["layers_skipped"] = s.layers_skipped;
        d["cold_routes"] = s.cold_routes;
        d["cold_experts"] = s.cold_experts;
        d["staged_experts"] = s.staged_experts;
        d["staged_routes"] = s.staged_routes;
        d["bad_tokens"] = s.bad_tokens;
        d["desync"] = s.desync;
        d["bad_ids"] = s.bad_ids;
        d["resyncs"] = s.resyncs;
        d["errors"] = s.errors;
        d["wait_ns"] = s.wait_ns;
        d["idle_ns"] = s.idle_ns;
        d["compute_ns"] = s.compute_ns;
        d["last_seq"] = s.last_seq;
        d["last_wait_ns"] = s.last_wait_ns;
        d["last_compute_ns"] = s.last_compute_ns;
        d["last_layers"] = s.last_layers;
        d["last_routes"] = s.last_routes;
        d["seq"] = s.seq;
        d["layer"] = s.layer;
        d["running"] = s.running;
        return d;
      });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Ostinato cold-expert CPU kernels and resident thread pool";

  m.def("cpu_features", [] {
    const CpuFeatures& f = cpu_features();
    py::dict d;
    d["avx512"] = f.avx512;
    d["avx512_bf16"] = f.avx512_bf16;
    d["amx"] = f.amx;
    d["avx512_vnni"] = f.avx512_vnni;
    d["amx_int8"] = f.amx_int8;
    return d;
  });

  m.def(
      "quantize_activations",
      [](uintptr_t v, int64_t n, uintptr_t q, uintptr_t d) {
        if (!cpu_features().avx512) throw std::runtime_error("quantize_activations needs AVX-512");
        if (n % 32) throw std::invalid_argument("quantize_activations: n must be a multiple of 32");
        quantize_activations(reinterpret_cast<const float*>(v), n, reinterpret_cast<int8_t*>(q),
                             reinterpret_cast<float*>(d));
      },
      py::arg("v"), py::arg("n"), py::arg("q"), py::arg("d"),
      "fp32 v[n] -> int8 q[n], fp32 d[n / 32] (the quantized experts' activations)");

  m.def(
      "dequant_rows_bf16",
      [](int qt, uintptr_t w, int64_t rows, int64_t n, uintptr_t out, bool avx512) {
        const QType q = QType(qt);
        if (qtype_block_values(q) == 0) throw std::invalid_argument("dequant_rows_bf16: not a block format");
        if (n % qtype_block_values(q)) throw std::invalid_argument("dequant_rows_bf16: n is not whole blocks");
        const auto* src = reinterpret_cast<const uint8_t*>(w);
        auto* dst = reinterpret_cast<uint16_t*>(out);
        if (avx512) {  // the build the AMX path runs
          if (!cpu_features().avx512) throw std::runtime_error("dequant_rows_bf16: this CPU lacks AVX-512");
          return dequant_rows_bf16_avx512(q, src, rows, n, dst);
        }
        const int64_t rb = qtype_row_bytes(q, n);
        for (int64_t r = 0; r < rows; ++r) dequant_row_bf16(q, src + r * rb, n, dst + r * n);
      },
      py::arg("qt"), py::arg("w"), py::arg("rows"), py::arg("n"), py::arg("out"), py::arg("avx512") = false,
      "uint8 w[rows, row bytes] of format qt -> bf16 out[rows, n], as the AMX path decodes quantized experts "
      "(avx512: its own build; else dequant.h built portably)");

  py::class_<ColdArgs> args(m, "ColdArgs");
  args.def(py::init<>());
  def_ptr(args, "w13", &ColdArgs::w13);
  def_ptr(args, "w2", &ColdArgs::w2);
  def_ptr(args, "x", &ColdArgs::x);
  def_ptr(args, "token_idx", &ColdArgs::token_idx);
  def_ptr(args, "expert_ids", &ColdArgs::expert_ids);
  def_ptr(args, "weights", &ColdArgs::weights);
  def_ptr(args, "out", &ColdArgs::out);
  def_ptr(args, "b13", &ColdArgs::b13);
  def_ptr(args, "b2", &ColdArgs::b2);
  def_ptr(args, "notify", &ColdArgs::notify);
  args.def_property(
      "act", [](const ColdArgs& a) { return int(a.act); }, [](ColdArgs& a, int v) { a.act = Act(v); });
  args.def_property(
      "w_dtype", [](const ColdArgs& a) { return int(a.w_dtype); },
      [](ColdArgs& a, int v) { a.w_dtype = DType(v); });
  args.def_property(
      "x_dtype", [](const ColdArgs& a) { return int(a.x_dtype); },
      [](ColdArgs& a, int v) { a.x_dtype = DType(v); });
  args.def_property(
      "isa", [](const ColdArgs& a) { return int(a.isa); }, [](ColdArgs& a, int v) { a.isa = Isa(v); });
  args.def_property(
      "qt13", [](const ColdArgs& a) { return int(a.qt13); }, [](ColdArgs& a, int v) { a.qt13 = QType(v); });
  args.def_property(
      "qt2", [](const ColdArgs& a) { return int(a.qt2); }, [](ColdArgs& a, int v) { a.qt2 = QType(v); });
  args.def_readwrite("E", &ColdArgs::E)
      .def_readwrite("D", &ColdArgs::D)
      .def_readwrite("F", &ColdArgs::F)
      .def_readwrite("T", &ColdArgs::T)
      .def_readwrite("x_stride", &ColdArgs::x_stride)
      .def_readwrite("R", &ColdArgs::R)
      .def_readwrite("out_stride", &ColdArgs::out_stride)
      .def_readwrite("amx_min_tokens", &ColdArgs::amx_min_tokens)
      .def_readwrite("amx_quant_min_tokens", &ColdArgs::amx_quant_min_tokens)
      .def_readwrite("amx_int8_min_tokens", &ColdArgs::amx_int8_min_tokens)
      .def_readwrite("notify_value", &ColdArgs::notify_value)
      .def_readwrite("act_alpha", &ColdArgs::act_alpha)
      .def_readwrite("act_limit", &ColdArgs::act_limit)
      .def_readwrite("down_mode", &ColdArgs::down_mode)
      .def_readwrite("prefetch", &ColdArgs::prefetch)
      .def_readwrite("prefetch_bytes", &ColdArgs::prefetch_bytes);

  py::class_<ColdExperts>(m, "ColdExperts")
      .def(py::init<const std::vector<int>&, int64_t>(), py::arg("cpus"), py::arg("spin_us"))
      .def("submit", &ColdExperts::submit, py::call_guard<py::gil_scoped_release>())
      .def("wait", &ColdExperts::wait, py::call_guard<py::gil_scoped_release>())
      .def("forward",
           [](ColdExperts& self, const ColdArgs& a) { cold_experts_forward(a, self); },
           py::call_guard<py::gil_scoped_release>())
      .def(
          "timed_forward",
          [](ColdExperts& self, const ColdArgs& a) {  // seconds of submit + wait, from C++
            auto t0 = std::chrono::steady_clock::now();
            cold_experts_forward(a, self);
            return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "read_seconds",
          [](ColdExperts& self, uintptr_t data, int64_t bytes) {
            return self.read_seconds(reinterpret_cast<const void*>(data), bytes);
          },
          py::arg("data"), py::arg("bytes"), py::call_guard<py::gil_scoped_release>())
      .def("ready", &ColdExperts::ready)
      .def("reserve", &ColdExperts::reserve, py::arg("routes"), py::arg("tokens"), py::arg("E"),
           py::arg("D"), py::arg("F"), py::arg("int8_tiles") = false)
      .def("num_threads", &ColdExperts::num_threads)
      .def("set_spin_us", &ColdExperts::set_spin_us)
      .def("last_stats", [](const ColdExperts& self) {
        ColdStats s = self.last_stats();
        py::dict d;
        d["isa"] = s.quant && !s.amx_experts ? "avx512_vnni" : isa_str(s.isa);
        d["quant"] = s.quant;
        d["experts"] = s.experts;
        d["amx_experts"] = s.amx_experts;
        d["int8_experts"] = s.int8_experts;
        d["routes"] = s.routes;
        d["scatter"] = s.scatter;
        d["phase_end_us"] = py::make_tuple(s.phase_end_us[0], s.phase_end_us[1], s.phase_end_us[2],
                                           s.phase_end_us[3]);
        return d;
      });

  bind_graph_worker(m);
}
