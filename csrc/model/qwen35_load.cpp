// qwen35_load.cpp — GGUF -> Model, with every shape checked against metadata.
#include <cmath>

#include "model/qwen35.h"
#include "quant/quant.h"

namespace dfl {

namespace {

struct Loader {
  const GGUFFile& f;
  const Qwen35Config& c;
  uint64_t bytes = 0;
  std::vector<uint8_t> used = std::vector<uint8_t>(f.tensors().size(), 0);  // by table index

  const GGUFTensor& get(const std::string& name) {
    const GGUFTensor* t = f.find_tensor(name);
    if (!t) fail("%s: missing tensor '%s'", f.path().c_str(), name.c_str());
    used[(size_t)(t - f.tensors().data())] = 1;
    bytes += t->nbytes;
    return *t;
  }
  // Every tensor of the file belongs to the model these settings describe, as llama.cpp's loader requires: a
  // leftover one means the metadata and the tensors disagree (a block_count one short runs a model without
  // its last layer; nextn_predict_layers 0 on an MTP file would run the MTP layer as a trunk layer).
  void check_all_used(int block_count, int nextn) const {
    for (size_t k = 0; k < used.size(); ++k)
      if (!used[k])
        fail("%s: tensor '%s' is not part of the model its metadata describes (qwen35.block_count %d, "
             "nextn_predict_layers %d): the metadata and the tensors disagree",
             f.path().c_str(), f.tensors()[k].name.c_str(), block_count, nextn);
  }
  static std::string shape_str(const GGUFTensor& t) {
    std::string out = "[";
    for (int d = 0; d < t.n_dims; ++d) out += (d ? ", " : "") + std::to_string(t.ne[d]);
    return out + "]";
  }
  void check_shape(const GGUFTensor& t, int64_t ne0, int64_t ne1) {
    int64_t want1 = ne1 < 0 ? 1 : ne1;
    int want_dims = ne1 < 0 ? 1 : 2;
    bool ok = t.ne[0] == ne0 && t.ne[1] == want1 && t.ne[2] == 1 && t.ne[3] == 1 &&
              (t.n_dims == want_dims || (want_dims == 2 && t.n_dims == 1 && want1 == 1));
    if (!ok) {
      if (ne1 < 0)
        fail("%s: tensor '%s' has shape %s but the metadata implies [%lld]", f.path().c_str(), t.name.c_str(),
             shape_str(t).c_str(), (long long)ne0);
      fail("%s: tensor '%s' has shape %s but the metadata implies [%lld, %lld]", f.path().c_str(), t.name.c_str(),
           shape_str(t).c_str(), (long long)ne0, (long long)ne1);
    }
  }
  Weight mat(const std::string& name, int64_t cols, int64_t rows) {
    const GGUFTensor& t = get(name);
    check_shape(t, cols, rows);
    Weight w;
    w.type = (DType)t.type;
    w.data = t.data;
    w.cols = cols;
    w.rows = rows;
    w.row_bytes = row_bytes(w.type, cols);
    if (w.type != DType::F32 && w.type != DType::F16 && w.type != DType::BF16 && cols % 32 != 0)
      fail("%s: tensor '%s' has %lld columns, not a multiple of 32", f.path().c_str(), name.c_str(), (long long)cols);
    return with_cpu_layout(w);
  }
  std::vector<float> vec(const std::string& name, int64_t n, int64_t n1 = -1) {
    const GGUFTensor& t = get(name);
    check_shape(t, n, n1);
    std::vector<float> out((size_t)(n * (n1 < 0 ? 1 : n1)));
    dequantize_row((DType)t.type, t.data, out.data(), (int64_t)out.size());
    return out;
  }
};

}  // namespace

std::unique_ptr<Model> load_qwen35(const std::string& path) {
  auto m = std::make_unique<Model>();
  m->file = std::make_unique<GGUFFile>(path);
  const GGUFFile& f = *m->file;
  const GGUFValue* arch = f.find("general.architecture");
  if (!arch) fail("%s: missing metadata key 'general.architecture'", path.c_str());
  if (arch->type != GGUFType::STRING) fail("%s: general.architecture is not a string", path.c_str());
  if (arch->s != "qwen35")
    fail("%s: unsupported architecture '%s' (this engine runs 'qwen35' models)", path.c_str(), arch->s.c_str());

  Qwen35Config& c = m->cfg;
  const std::string a = "qwen35.";
  int block_count = (int)f.get_u32(a + "block_count");
  int nextn = (int)f.get_u32(a + "nextn_predict_layers", 0);
  c.n_layer = block_count - nextn;
  c.n_embd = (int)f.get_u32(a + "embedding_length");
  c.n_ff = (int)f.get_u32(a + "feed_forward_length");
  c.n_head = (int)f.get_u32(a + "attention.head_count");
  c.n_head_kv = (int)f.get_u32(a + "attention.head_count_kv");
  c.head_dim = (int)f.get_u32(a + "attention.key_length");
  int vlen = (int)f.get_u32(a + "attention.value_length", (uint32_t)c.head_dim);
  c.rms_eps = f.get_f32(a + "attention.layer_norm_rms_epsilon");
  c.rope_base = f.get_f32(a + "rope.freq_base", 10000.f);
  c.n_rot = (int)f.get_u32(a + "rope.dimension_count", (uint32_t)c.head_dim);
  c.conv_kernel = (int)f.get_u32(a + "ssm.conv_kernel");
  c.ssm_dk = (int)f.get_u32(a + "ssm.state_size");
  c.ssm_nk = (int)f.get_u32(a + "ssm.group_count");
  c.ssm_nv = (int)f.get_u32(a + "ssm.time_step_rank");
  int inner = (int)f.get_u32(a + "ssm.inner_size");
  c.n_ctx_train = (int)f.get_u32(a + "context_length", 0);
  int interval = (int)f.get_u32(a + "full_attention_interval", 4);

  auto bad = [&](const char* what) { fail("%s: invalid metadata: %s", path.c_str(), what); };
  if (c.n_layer <= 0 || nextn < 0) bad("block_count must exceed nextn_predict_layers");
  if (c.n_embd <= 0 || c.n_ff <= 0 || c.n_head <= 0 || c.n_head_kv <= 0 || c.head_dim <= 0) bad("zero dimension");
  if (vlen != c.head_dim) bad("attention.value_length differs from key_length");
  if (c.n_head % c.n_head_kv != 0) bad("head_count is not a multiple of head_count_kv");
  if (c.n_rot <= 0 || c.n_rot > c.head_dim || c.n_rot % 2) bad("rope.dimension_count must be even and <= key_length");
  // llama.cpp's rope-scaling keys: published qwen35 GGUFs carry none (the model's
  // native context needs no scaling).  A file that asks for scaling is refused
  // rather than run unscaled: its logits would be wrong past the first positions.
  const std::string scaling = f.find(a + "rope.scaling.type") ? f.get_str(a + "rope.scaling.type") : "none";
  const float scale_factor = f.get_f32(a + "rope.scaling.factor", 0.f);
  const float scale_linear = f.get_f32(a + "rope.scale_linear", 1.f);
  if (scaling != "none" || (scale_factor != 0.f && scale_factor != 1.f) || scale_linear != 1.f)
    fail("%s: rope scaling is not supported for qwen35 targets (qwen35.rope.scaling.type '%s', factor %g); "
         "use a file converted without rope scaling",
         path.c_str(), scaling.c_str(), (double)(scale_factor != 0.f ? scale_factor : scale_linear));
  if (c.ssm_nk <= 0 || c.ssm_nv <= 0 || c.ssm_dk <= 0 || inner <= 0 || inner % c.ssm_nv) bad("ssm sizes");
  if (c.ssm_nv % c.ssm_nk) bad("ssm.time_step_rank is not a multiple of ssm.group_count");
  if (c.conv_kernel < 2 || c.conv_kernel > 16) bad("ssm.conv_kernel out of range");
  if (interval <= 0) bad("full_attention_interval must be positive");
  if (c.head_dim % 32 || c.ssm_dk % 32) bad("head dims must be multiples of 32");
  if (!std::isfinite(c.rms_eps) || c.rms_eps <= 0.f) bad("attention.layer_norm_rms_epsilon must be a positive number");
  if (!std::isfinite(c.rope_base) || c.rope_base <= 0.f) bad("rope.freq_base must be a positive number");
  // llama.cpp ships a model's MTP head alone too (ggml-org's mtp-*.gguf: the nextn layer, the embeddings and
  // the head, no trunk): say what the file is rather than name its first missing tensor.
  if (nextn > 0 && !f.find_tensor("blk.0.attn_norm.weight") &&
      f.find_tensor("blk." + std::to_string(block_count - 1) + ".nextn.eh_proj.weight"))
    fail("%s holds only the model's MTP head (blk.%d.nextn.*), not the model: load the model's own GGUF",
         path.c_str(), block_count - 1);
  // every layer has at least 9 tensors: a block_count the tensor table cannot hold is refused before the
  // layers are allocated (10^9 layers had taken a gigabyte first)
  if ((uint64_t)block_count * 9 > f.tensors().size())
    fail("%s: invalid metadata: qwen35.block_count is %d but the file has only %zu tensors", path.c_str(),
         block_count, f.tensors().size());
  c.ssm_dv = inner / c.ssm_nv;

  std::vector<int64_t> rec = f.get_int_array(a + "attention.recurrent_layers");
  if (!rec.empty() && (int)rec.size() < c.n_layer) bad("attention.recurrent_layers is shorter than block_count");
  c.is_recurrent.resize(c.n_layer);
  for (int i = 0; i < c.n_layer; ++i)
    c.is_recurrent[i] = rec.empty() ? (uint8_t)((i + 1) % interval != 0) : (uint8_t)(rec[i] != 0);

  Loader L{f, c};
  const GGUFTensor* emb = f.find_tensor("token_embd.weight");
  if (!emb) fail("%s: missing tensor 'token_embd.weight'", path.c_str());
  c.n_vocab = (int)emb->ne[1];
  if (const GGUFValue* toks = f.find("tokenizer.ggml.tokens"))
    if (toks->arr_n != (uint64_t)c.n_vocab)
      fail("%s: tokenizer has %llu tokens but token_embd.weight has %d rows", path.c_str(),
           (unsigned long long)toks->arr_n, c.n_vocab);
  m->tok_embd = L.mat("token_embd.weight", c.n_embd, c.n_vocab);
  c.tied_embeddings = f.find_tensor("output.weight") == nullptr;
  m->output = c.tied_embeddings ? m->tok_embd : L.mat("output.weight", c.n_embd, c.n_vocab);
  m->output_norm = L.vec("output_norm.weight", c.n_embd);

  const int H = c.n_embd, Cconv = c.conv_channels(), Cv = c.ssm_inner();
  auto attention_layer = [&](LayerWeights& w, const std::string& p) {
    w.attn_norm = L.vec(p + "attn_norm.weight", H);
    w.post_norm = L.vec(p + "post_attention_norm.weight", H);
    w.ffn_gate = L.mat(p + "ffn_gate.weight", H, c.n_ff);
    w.ffn_up = L.mat(p + "ffn_up.weight", H, c.n_ff);
    w.ffn_down = L.mat(p + "ffn_down.weight", c.n_ff, H);
    w.wq = L.mat(p + "attn_q.weight", H, 2 * c.q_dim());
    w.wk = L.mat(p + "attn_k.weight", H, c.kv_dim());
    w.wv = L.mat(p + "attn_v.weight", H, c.kv_dim());
    w.wo = L.mat(p + "attn_output.weight", c.q_dim(), H);
    w.q_norm = L.vec(p + "attn_q_norm.weight", c.head_dim);
    w.k_norm = L.vec(p + "attn_k_norm.weight", c.head_dim);
  };
  m->layers.resize(c.n_layer);
  for (int i = 0; i < c.n_layer; ++i) {
    LayerWeights& w = m->layers[i];
    std::string p = "blk." + std::to_string(i) + ".";
    if (!c.is_recurrent[i]) {
      attention_layer(w, p);
      continue;
    }
    w.attn_norm = L.vec(p + "attn_norm.weight", H);
    w.post_norm = L.vec(p + "post_attention_norm.weight", H);
    w.ffn_gate = L.mat(p + "ffn_gate.weight", H, c.n_ff);
    w.ffn_up = L.mat(p + "ffn_up.weight", H, c.n_ff);
    w.ffn_down = L.mat(p + "ffn_down.weight", c.n_ff, H);
    {
      w.wqkv = L.mat(p + "attn_qkv.weight", H, Cconv);
      w.wgate = L.mat(p + "attn_gate.weight", H, Cv);
      w.wbeta = L.mat(p + "ssm_beta.weight", H, c.ssm_nv);
      w.walpha = L.mat(p + "ssm_alpha.weight", H, c.ssm_nv);
      w.ssm_out = L.mat(p + "ssm_out.weight", Cv, H);
      w.conv1d = L.vec(p + "ssm_conv1d.weight", c.conv_kernel, Cconv);
      w.dt_bias = L.vec(p + "ssm_dt.bias", c.ssm_nv);
      w.ssm_a = L.vec(p + "ssm_a", c.ssm_nv);
      w.ssm_norm = L.vec(p + "ssm_norm.weight", c.ssm_dv);
    }
  }
  m->weight_bytes = L.bytes;
  // The first MTP layer, when the file has one (the head drafts; the trunk never runs it)
  const std::string mp = "blk." + std::to_string(c.n_layer) + ".";
  bool mtp_tensors = false;
  for (const GGUFTensor& t : f.tensors()) mtp_tensors |= t.name.rfind(mp, 0) == 0;
  if (nextn > 0 && mtp_tensors && !f.find_tensor(mp + "nextn.eh_proj.weight"))
    fail("%s: blk.%d has tensors but no '%snextn.eh_proj.weight': with nextn_predict_layers %d the last of "
         "qwen35.block_count %d layers is the MTP layer; the metadata and the tensors disagree",
         path.c_str(), c.n_layer, mp.c_str(), nextn, block_count);
  if (nextn > 0 && mtp_tensors) {
    MtpWeights& t = m->mtp;
    attention_layer(t.layer, mp);
    t.eh_proj = L.mat(mp + "nextn.eh_proj.weight", 2 * H, H);
    t.enorm = L.vec(mp + "nextn.enorm.weight", H);
    t.hnorm = L.vec(mp + "nextn.hnorm.weight", H);
    t.head_norm = L.vec(mp + "nextn.shared_head_norm.weight", H);
    m->mtp_bytes = L.bytes - m->weight_bytes;
  }
  L.check_all_used(block_count, nextn);
  return m;
}

}  // namespace dfl
