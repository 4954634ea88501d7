// qwen35.h — the qwen35 target model: configuration and weights from GGUF.
//
// Everything about the model's shape comes from the file's metadata and is
// checked against every tensor's shape at load time, so a file that loads is
// one the forward can run.  Weights are views into the mmapped GGUF (no
// copies); the small 1-D tensors (norms, gates' biases) are dequantised into
// owned f32 vectors because every op reads them in f32.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "gguf/gguf.h"
#include "model/rope.h"
#include "quant/blocks.h"
#include "quant/weight.h"

namespace dfl {

struct Qwen35Config {
  int n_layer = 0;        // trunk layers (block_count - nextn_predict_layers)
  int n_embd = 0;         // H
  int n_ff = 0;           // F
  int n_head = 0;         // attention q heads
  int n_head_kv = 0;
  int head_dim = 0;
  int n_rot = 0;          // rotary dims per head (NeoX half-split)
  float rope_base = 0.f;  // unscaled: a GGUF asking for rope scaling is refused at load
  float rms_eps = 0.f;
  RopeSpec rope() const {
    RopeSpec r;
    r.n_rot = n_rot;
    r.base = rope_base;
    return r;
  }
  int conv_kernel = 0;    // K
  int ssm_dk = 0;         // linear key head dim (state_size)
  int ssm_nk = 0;         // linear key heads (group_count)
  int ssm_nv = 0;         // linear value heads (time_step_rank)
  int ssm_dv = 0;         // linear value head dim (inner_size / nv)
  int n_vocab = 0;
  int n_ctx_train = 0;
  bool tied_embeddings = false;
  std::vector<uint8_t> is_recurrent;  // per trunk layer: GDN (1) or full attention (0)

  int conv_channels() const { return 2 * ssm_nk * ssm_dk + ssm_nv * ssm_dv; }
  int ssm_inner() const { return ssm_nv * ssm_dv; }
  int q_dim() const { return n_head * head_dim; }
  int kv_dim() const { return n_head_kv * head_dim; }
};

struct LayerWeights {
  std::vector<float> attn_norm, post_norm;
  Weight ffn_gate, ffn_up, ffn_down;
  // full attention
  Weight wq, wk, wv, wo;  // wq rows: per head [q (hd) | gate (hd)]
  std::vector<float> q_norm, k_norm;
  // gated delta-net
  Weight wqkv, wgate, wbeta, walpha, ssm_out;
  std::vector<float> conv1d;     // [Cconv][K], tap 0 oldest
  std::vector<float> dt_bias, ssm_a, ssm_norm;
};

// The model's multi-token-prediction head (llama.cpp's "-MTP" files: qwen35.nextn_predict_layers = 1, stored as
// blk.{n_layer}): x = eh_proj · [enorm(embed(token)) ‖ hnorm(h)], h the trunk's hidden after output_norm at the
// previous position, then one full-attention decoder layer with its own KV, then shared_head_norm and the
// trunk's output head.  Its norms carry llama.cpp's +1 like every other (plain multipliers here).
struct MtpWeights {
  LayerWeights layer;            // a full-attention layer (wq with its gate, q/k norms) + SwiGLU
  Weight eh_proj;                // [2H] -> [H]: columns 0..H-1 take the embedding, H..2H-1 the hidden
  std::vector<float> enorm, hnorm, head_norm;
  bool present() const { return eh_proj.data != nullptr; }
};

struct Model {
  std::unique_ptr<GGUFFile> file;
  Qwen35Config cfg;
  Weight tok_embd, output;
  std::vector<float> output_norm;
  std::vector<LayerWeights> layers;
  MtpWeights mtp;             // absent (eh_proj null) unless the file carries the head
  uint64_t weight_bytes = 0;  // bytes of the trunk's weight tensors (what one AR step reads)
  uint64_t mtp_bytes = 0;     // bytes of the MTP head's own tensors

  // The one list of the tensors the forward reads, in a fixed order: mat(const Weight&) for each matrix
  // present, vec(const std::vector<float>&) for each f32 vector present.  Uploads and plans walk it.
  template <class Mat, class Vec>
  void for_each_tensor(Mat&& mat, Vec&& vec) const {
    auto m = [&](const Weight& w) { if (w.data) mat(w); };
    auto v = [&](const std::vector<float>& x) { if (!x.empty()) vec(x); };
    m(tok_embd), m(output), v(output_norm);
    auto layer = [&](const LayerWeights& l) {
      for (const Weight* w : {&l.ffn_gate, &l.ffn_up, &l.ffn_down, &l.wq, &l.wk, &l.wv, &l.wo, &l.wqkv, &l.wgate,
                              &l.wbeta, &l.walpha, &l.ssm_out})
        m(*w);
      for (const std::vector<float>* x : {&l.attn_norm, &l.post_norm, &l.q_norm, &l.k_norm, &l.conv1d, &l.dt_bias,
                                          &l.ssm_a, &l.ssm_norm})
        v(*x);
    };
    for (const LayerWeights& l : layers) layer(l);
    if (mtp.present()) {
      layer(mtp.layer);
      m(mtp.eh_proj), v(mtp.enorm), v(mtp.hnorm), v(mtp.head_norm);
    }
  }
};

// Loads and validates; throws dfl::Error naming the file and the problem.
std::unique_ptr<Model> load_qwen35(const std::string& path);

}  // namespace dfl
