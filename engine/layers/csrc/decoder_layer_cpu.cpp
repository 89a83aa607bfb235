// A Llama-family decoder layer of a few rows (float32 or bfloat16) as one op: the
// same ops as the layer's Python (engine/models/llama.py), called in the same order on the same
// tensors, so the result is bitwise the same; what it saves is the Python between them (about a
// tenth of a millisecond a layer: a fifth of a one-stream step on a 58 MB model). Calls go
// through torch's dispatcher, so each op keeps its one implementation and its checks.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

namespace {

using OptTensor = c10::optional<at::Tensor>;

template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// w: packed in panels ([panels, in, 16], float32: linear_panels), or [out, in] (linear_few_rows: bfloat16
// or float32 over a column-major weight), as parallel.Linear picks for a call of a few rows
at::Tensor linear(const at::Tensor& x, const OptTensor& w, const OptTensor& b, int64_t out) {
  static auto panels = op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t)>(
      "pagoda::linear_panels");
  static auto few_rows = op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&)>(
      "pagoda::linear_few_rows");
  return w->dim() == 3 ? panels.call(x, *w, b, out) : few_rows.call(x, *w, b);
}

at::Tensor rms_norm(const at::Tensor& x, const OptTensor& w, double eps) {
  static auto h = op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("pagoda::rms_norm");
  return h.call(x, *w, eps);
}

at::Tensor add_rms_norm_(const at::Tensor& x, at::Tensor& residual, const OptTensor& w, double eps) {
  static auto h = op<at::Tensor(const at::Tensor&, at::Tensor&, const at::Tensor&, double)>("pagoda::add_rms_norm_");
  return h.call(x, residual, *w, eps);
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& tables, const OptTensor& start_loc, const at::Tensor& lens, double scale) {
  static auto h = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const OptTensor&, const at::Tensor&, double, bool, int64_t, double, const OptTensor&,
                                const OptTensor&, const OptTensor&)>("pagoda::paged_attention");
  return h.call(q, k_cache, v_cache, tables, start_loc, lens, scale, false, 0, 0., c10::nullopt, c10::nullopt,
                c10::nullopt);
}

// weights: [input_norm, post_attention_norm, qkv, qkv_bias, q_norm, k_norm, o, o_bias, gate_up, gate_up_bias,
// down, down_bias] (each linear's as `linear` above takes it; a missing bias or q/k norm: None);
// sizes: [num_heads, num_kv_heads, head_dim, hidden, intermediate].
// x: [num_tokens, hidden]; residual: the same shape, or None in the first layer (x is then the residual).
// The first num_decode tokens are single-token queries (decode_*), the rest prefill chunks (prefill_*), as
// attention.AttentionMetadata. -> (the layer's output, the residual), as LlamaDecoderLayer.forward.
std::tuple<at::Tensor, at::Tensor> decoder_layer(
    const at::Tensor& x, const OptTensor& residual_in, const c10::List<OptTensor>& weights, at::IntArrayRef sizes,
    double eps, double scale, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
    at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping, int64_t num_decode,
    const at::Tensor& decode_tables, const at::Tensor& decode_lens, const at::Tensor& prefill_tables,
    const at::Tensor& prefill_start_loc, const at::Tensor& prefill_lens) {
  static auto silu_and_mul = op<at::Tensor(const at::Tensor&)>("pagoda::silu_and_mul");
  static auto rotary_ = op<void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
      "pagoda::rotary_");
  static auto write_kv_cache = op<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                                       const at::Tensor&, const OptTensor&, const OptTensor&)>("pagoda::write_kv_cache");
  TORCH_CHECK(weights.size() == 12 && sizes.size() == 5, "weights must hold 12 entries and sizes 5");
  std::vector<OptTensor> w;
  for (size_t i = 0; i < weights.size(); ++i) w.push_back(weights.get(i));
  TORCH_CHECK(w[0] && w[1] && w[2] && w[6] && w[8] && w[10], "norm and linear weights are required");
  const int64_t heads = sizes[0], kv_heads = sizes[1], head_dim = sizes[2], hidden = sizes[3], inter = sizes[4];
  const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim, tokens = x.size(0);

  at::Tensor residual, h;
  if (residual_in && residual_in->defined()) {
    residual = *residual_in;
    h = add_rms_norm_(x, residual, w[0], eps);
  } else {
    residual = x;
    h = rms_norm(x, w[0], eps);
  }
  // attention: qkv: [num_tokens, q_size + 2 * kv_size] -> q: [num_tokens, heads, head_dim], k and v: kv_heads
  const at::Tensor qkv = linear(h, w[2], w[3], q_size + 2 * kv_size);
  at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, heads, head_dim});
  at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, kv_heads, head_dim});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, kv_heads, head_dim});
  if (w[4]) {
    q = rms_norm(q, w[4], eps);
    k = rms_norm(k, w[5], eps);
  }
  rotary_.call(q, k, positions, cos, sin);
  write_kv_cache.call(k, v, k_cache, v_cache, slot_mapping, c10::nullopt, c10::nullopt);
  at::Tensor attn;
  if (num_decode == tokens) {
    attn = paged_attention(q, k_cache, v_cache, decode_tables, c10::nullopt, decode_lens, scale);
  } else {
    attn = at::empty_like(q);
    if (num_decode > 0)
      attn.narrow(0, 0, num_decode)
          .copy_(paged_attention(q.narrow(0, 0, num_decode), k_cache, v_cache, decode_tables, c10::nullopt,
                                 decode_lens, scale));
    attn.narrow(0, num_decode, tokens - num_decode)
        .copy_(paged_attention(q.narrow(0, num_decode, tokens - num_decode), k_cache, v_cache, prefill_tables,
                               prefill_start_loc, prefill_lens, scale));
  }
  const at::Tensor o = linear(attn.flatten(1), w[6], w[7], hidden);
  // MLP: gate_up: [num_tokens, 2 * intermediate]
  h = add_rms_norm_(o, residual, w[1], eps);
  const at::Tensor gate_up = linear(h, w[8], w[9], 2 * inter);
  return {linear(silu_and_mul.call(gate_up), w[10], w[11], hidden), residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda, m) {
  m.def("decoder_layer(Tensor x, Tensor? residual, Tensor?[] weights, int[] sizes, float eps, float scale, "
        "Tensor positions, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "int num_decode, Tensor decode_tables, Tensor decode_lens, Tensor prefill_tables, Tensor prefill_start_loc, "
        "Tensor prefill_lens) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) { m.impl("decoder_layer", &decoder_layer); }
