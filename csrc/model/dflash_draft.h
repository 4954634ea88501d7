// dflash_draft.h — z-lab's DFlash drafter: configuration (config.json) and
// weights (model.safetensors), every shape validated against the config.
//
// A drafter is a small Qwen3-style transformer without embedding or lm_head
// (it borrows the target's); it reads features captured from the target after
// each layer in `target_layer_ids`, concatenated and projected by `fc`.
// Loading checks that every tensor z-lab's checkpoint has is present with the
// shape the config implies (and nothing else); `validate_pair` checks the
// drafter against a target.  Failures are one-line dfl::Errors naming the
// file (or the pair) and the problem.
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "model/qwen35.h"
#include "model/rope.h"
#include "safetensors/safetensors.h"

namespace dfl {

struct DraftConfig {
  // the drafter's own transformer (standard Qwen3 keys)
  int n_layer = 0;        // num_hidden_layers
  int hidden = 0;         // hidden_size (= the target's hidden size)
  int n_head = 0;         // num_attention_heads
  int n_head_kv = 0;      // num_key_value_heads
  int head_dim = 0;
  int n_ff = 0;           // intermediate_size
  float rms_eps = 0.f;    // rms_norm_eps
  // RoPE over the whole head (NeoX rotate-half), read as transformers 5.23
  // standardises it (rope_parameters, or rope_theta + rope_scaling): type
  // "default", "linear" or "yarn", frequencies and attention factor in `rope`.
  std::string rope_type = "default";
  RopeSpec rope;
  int n_vocab = 0;        // vocab_size (= the target's; no embedding of its own)
  int64_t max_pos = 0;    // max_position_embeddings
  std::vector<uint8_t> is_sliding;  // per layer: sliding_attention (causal unless is_causal says otherwise)
  int sliding_window = 0;           // window of the sliding layers (> 0 when one slides); 0: none slides
  int is_causal = -1;               // config `is_causal`: -1 absent, else 0/1 (applies to every layer)
  // DFlash keys (dflash_config first, then top level)
  int block_size = 16;
  int mask_token_id = -1;
  std::vector<int> target_layer_ids;  // 0-based target layers whose outputs are captured
  int num_target_layers = 0;          // 0: absent
  bool layer_ids_derived = false;     // ids came from build_target_layer_ids(num_target_layers, n_layer)
  // optional scalars, neutral by default
  float input_embedding_scale = 1.f;
  float output_multiplier = 1.f;
  float final_logit_softcapping = 0.f;  // 0: off
  // DFlash2 (architectures ["DFlash2DraftModel"]; docs/research/dflash2-spec.md): a dynamic grouped causal
  // convolution of conv_kernel taps around each layer's attention and MLP (kernels per token from a
  // projection, one per group of conv_group channels), and a candidate selector ranking transitions between
  // each position's selector_top_k candidates through two vocab x selector_rank codebooks
  bool dflash2 = false;
  int conv_kernel = 0;      // conv_kernel_size
  int conv_group = 0;       // conv_group_size (channels per group)
  int selector_top_k = 0;
  int selector_rank = 0;
  int conv_groups() const { return conv_group > 0 ? hidden / conv_group : 0; }

  int q_dim() const { return n_head * head_dim; }
  int kv_dim() const { return n_head_kv * head_dim; }
  int fc_in() const { return hidden * (int)target_layer_ids.size(); }
};

// DFlash2's dynamic grouped convolution around a sublayer: a static kernel [side][tap][channel] (side 0
// before the sublayer, 1 after) plus, per token, a projection of its normed input giving [side][tap][group].
struct DraftConvWeights {
  std::vector<float> base;  // base_kernel [2][conv_kernel][H]
  Weight proj;              // kernel_projection [2 * conv_kernel * groups, H]
};

struct DraftLayerWeights {
  std::vector<float> input_norm, post_norm;  // [hidden]
  std::vector<float> q_norm, k_norm;         // [head_dim]
  Weight wq, wk, wv, wo;                     // q_proj [q_dim, H], k/v [kv_dim, H], o [H, q_dim]
  Weight gate, up, down;                     // [F, H], [F, H], [H, F]
  DraftConvWeights attn_conv, mlp_conv;      // DFlash2 only
};

// DFlash2's candidate selector: transition score of candidate b after a = <pred[a] * (P h), succ[b]>.
struct DraftSelectorWeights {
  Weight hidden_projection;  // P [rank, H]
  Weight predecessor, successor;  // codebooks [vocab, rank]
};

struct DraftModel {
  std::unique_ptr<SafetensorsFile> file;
  std::vector<std::vector<uint8_t>> converted;  // matrices converted at load (Weight::data points here)
  std::string config_path;
  DraftConfig cfg;
  Weight fc;                            // [H, H * n_target_layers]
  std::vector<float> hidden_norm, norm; // [H]
  std::vector<DraftLayerWeights> layers;
  DraftSelectorWeights selector;        // DFlash2 only
  uint64_t weight_bytes = 0;            // bytes of all tensors in the file

  // Its own tensors in a fixed order (the target's embedding and lm_head it reads are the target's):
  // mat(const Weight&) per matrix, vec(const std::vector<float>&) per non-empty f32 vector.
  template <class Mat, class Vec>
  void for_each_tensor(Mat&& mat, Vec&& vec) const {
    auto v = [&](const std::vector<float>& x) { if (!x.empty()) vec(x); };
    auto m = [&](const Weight& w) { if (w.data) mat(w); };
    m(fc), v(hidden_norm), v(norm);
    for (const DraftLayerWeights& L : layers) {
      for (const Weight* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.gate, &L.up, &L.down, &L.attn_conv.proj,
                              &L.mlp_conv.proj})
        m(*w);
      for (const std::vector<float>* x : {&L.input_norm, &L.post_norm, &L.q_norm, &L.k_norm, &L.attn_conv.base,
                                          &L.mlp_conv.base})
        v(*x);
    }
    for (const Weight* w : {&selector.hidden_projection, &selector.predecessor, &selector.successor}) m(*w);
  }
};

// z-lab's build_target_layer_ids(N target layers, n draft layers).
std::vector<int> build_target_layer_ids(int n_target_layers, int n_draft_layers);

// Parses and validates config.json; errors name `path`.
DraftConfig parse_draft_config(const std::string& path);

// A drafter's two files from `path`: a directory holding them, the
// .safetensors file with config.json beside it, or config.json itself.
// Fails naming what is missing (the weights only when need_weights).
struct DraftFiles {
  std::string config, weights;
};
DraftFiles draft_files(const std::string& path, bool need_weights);

// weight_type: the matrices' type in memory — none for the file's own, or
// BF16 / Q8_0 converted at load (norm vectors stay f32 either way).
// The drafter only proposes, so its weight type changes acceptance, never
// the output.
std::unique_ptr<DraftModel> load_draft(const std::string& path, std::optional<DType> weight_type = {});

// Refuses a drafter that cannot run against `target`: hidden sizes, every
// target_layer_id inside [0, target n_layer), mask token id, vocab sizes.
void validate_pair(const DraftConfig& draft, const Qwen35Config& target);

}  // namespace dfl
