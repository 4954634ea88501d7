// dflash_draft.cpp — DFlash drafter config.json + model.safetensors loading.
#include "model/dflash_draft.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>
#include <thread>

#include "quant/quant.h"
#include "util/json.h"

namespace dfl {

namespace {

struct Cfg {
  const JsonValue& root;
  const JsonValue* dflash;  // dflash_config object or nullptr
  const std::string& path;

  // dflash_config[key] first, then the top level (z-lab's lookup order).
  const JsonValue* find_dflash(const char* key) const {
    if (dflash)
      if (const JsonValue* v = dflash->find(key)) return v;
    return root.find(key);
  }

  int64_t as_int(const JsonValue* v, const char* key, int64_t lo, int64_t hi) const {
    if (!v->is_number() || !v->is_int)
      fail("%s: config key '%s' should be an integer, found %s", path.c_str(), key,
           v->is_number() ? "a non-integer number" : json_kind_name(v->kind));
    if (v->i < lo || v->i > hi)
      fail("%s: config key '%s' = %lld is out of range [%lld, %lld]", path.c_str(), key, (long long)v->i,
           (long long)lo, (long long)hi);
    return v->i;
  }
  int64_t req_int(const char* key, int64_t lo, int64_t hi) const {
    const JsonValue* v = root.find(key);
    if (!v || v->is_null()) fail("%s: missing config key '%s'", path.c_str(), key);
    return as_int(v, key, lo, hi);
  }
  double as_num(const JsonValue* v, const char* key) const {
    if (!v->is_number())
      fail("%s: config key '%s' should be a number, found %s", path.c_str(), key, json_kind_name(v->kind));
    return v->num;
  }
  double req_pos_num(const char* key) const {
    const JsonValue* v = root.find(key);
    if (!v || v->is_null()) fail("%s: missing config key '%s'", path.c_str(), key);
    double d = as_num(v, key);
    if (!(d > 0) || !std::isfinite(d)) fail("%s: config key '%s' must be positive, found %g", path.c_str(), key, d);
    return d;
  }
  double opt_num(const char* key, double def) const {
    const JsonValue* v = find_dflash(key);
    return (!v || v->is_null()) ? def : as_num(v, key);
  }
  bool opt_bool(const char* key, bool def) const {
    const JsonValue* v = root.find(key);
    if (!v || v->is_null()) return def;
    if (!v->is_bool()) fail("%s: config key '%s' should be true or false", path.c_str(), key);
    return v->b;
  }
};

constexpr int64_t kMaxDim = int64_t(1) << 20;

// RoPE of a Qwen3-style drafter, read as transformers 5.23 standardises it and
// computed as its rope functions do (modeling_rope_utils: default, linear,
// yarn).  The parameters are `rope_scaling` when that is a non-empty object
// (files written by transformers 4), else `rope_parameters` (transformers 5);
// rope_theta comes from them, else from the top level, else 10000; the type is
// their rope_type, else the legacy `type`, else "default".  Other types, and
// anything transformers could not run on a Qwen3 model (per-layer-type
// parameters, partial rotary), are refused with the key named.
void parse_rope(const Cfg& c, DraftConfig& d) {
  const std::string& path = c.path;
  const JsonValue* block = nullptr;
  std::string key;
  for (const char* k : {"rope_parameters", "rope_scaling"}) {
    const JsonValue* v = c.root.find(k);
    if (v && !v->is_null() && !v->is_object())
      fail("%s: config key '%s' should be an object or null, found %s", path.c_str(), k, json_kind_name(v->kind));
  }
  if (const JsonValue* rs = c.root.find("rope_scaling"); rs && rs->is_object() && !rs->obj.empty())
    block = rs, key = "rope_scaling";
  else if (const JsonValue* rp = c.root.find("rope_parameters"); rp && rp->is_object())
    block = rp, key = "rope_parameters";
  auto name = [&](const char* k) { return key + "." + k; };
  auto get = [&](const char* k) -> const JsonValue* {
    const JsonValue* v = block ? block->find(k) : nullptr;
    return v && !v->is_null() ? v : nullptr;
  };
  auto number = [&](const char* k, const JsonValue* v) {
    const std::string n = name(k);
    const double x = c.as_num(v, n.c_str());
    if (!std::isfinite(x)) fail("%s: config key '%s' is not finite", path.c_str(), n.c_str());
    return x;
  };
  auto positive = [&](const char* k, const JsonValue* v) {
    const double x = number(k, v);
    if (!(x > 0)) fail("%s: config key '%s' must be positive, found %g", path.c_str(), name(k).c_str(), x);
    return x;
  };
  if (block)
    for (const char* lt : {"full_attention", "sliding_attention"})
      if (block->find(lt))
        fail("%s: config key '%s' holds per-layer-type parameters ('%s'); a Qwen3 drafter takes one RoPE for all "
             "layers", path.c_str(), key.c_str(), lt);

  // theta
  double theta = 10000.0;
  if (const JsonValue* t = get("rope_theta")) theta = positive("rope_theta", t);
  else if (c.root.find("rope_theta") && !c.root.find("rope_theta")->is_null()) theta = c.req_pos_num("rope_theta");
  // type
  std::string type = "default";
  const char* type_key = get("rope_type") ? "rope_type" : "type";
  if (const JsonValue* t = get(type_key)) {
    if (!t->is_string())
      fail("%s: config key '%s' should be a string, found %s", path.c_str(), name(type_key).c_str(),
           json_kind_name(t->kind));
    type = t->str;
  }
  if (type != "default" && type != "linear" && type != "yarn")
    fail("%s: config key '%s' is '%s': this RoPE type is not supported (only default, linear and yarn)",
         path.c_str(), name(type_key).c_str(), type.c_str());
  if (const JsonValue* prf = get("partial_rotary_factor"); prf && number("partial_rotary_factor", prf) != 1.0)
    fail("%s: config key '%s' is %g; the drafter's RoPE covers the whole head (only 1.0 is supported)",
         path.c_str(), name("partial_rotary_factor").c_str(), prf->num);

  RopeSpec& r = d.rope;
  r = RopeSpec{};
  r.n_rot = d.head_dim;
  r.base = (float)theta;
  d.rope_type = type;
  if (type == "default") return;

  // linear and yarn need a factor (yarn: null derives it from the context lengths)
  const JsonValue* fv = block->find("factor");
  if (!fv || (fv->is_null() && type == "linear"))
    fail("%s: config key '%s' is missing (required for %s RoPE)", path.c_str(), name("factor").c_str(), type.c_str());
  if (type == "linear") {
    r.factor = (float)positive("factor", fv);
    r.ramp_lo = -1.f, r.ramp_hi = 0.f;  // every pair interpolated
    return;
  }

  // yarn.  A top-level original_max_position_embeddings takes priority, as in
  // transformers; a yarn block without one anywhere is refused (transformers
  // would silently use max_position_embeddings, i.e. no scaling range at all).
  double orig = 0;
  const JsonValue* top_orig = c.root.find("original_max_position_embeddings");
  if (top_orig && !top_orig->is_null()) {
    orig = (double)c.as_int(top_orig, "original_max_position_embeddings", 1, int64_t(1) << 40);
  } else if (const JsonValue* o = get("original_max_position_embeddings")) {
    orig = (double)c.as_int(o, name("original_max_position_embeddings").c_str(), 1, int64_t(1) << 40);
  } else {
    fail("%s: config key '%s' is missing (required for yarn RoPE)", path.c_str(),
         name("original_max_position_embeddings").c_str());
  }
  const double factor = fv->is_null() ? (double)d.max_pos / orig : positive("factor", fv);
  auto opt = [&](const char* k) { const JsonValue* v = get(k); return v ? number(k, v) : 0.0; };
  const double mscale = opt("mscale"), mscale_all_dim = opt("mscale_all_dim");
  auto get_mscale = [](double scale, double m) { return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; };
  double attn = 0;
  if (const JsonValue* af = get("attention_factor")) attn = positive("attention_factor", af);
  else if (mscale != 0 && mscale_all_dim != 0) attn = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim);
  else attn = get_mscale(factor, 1.0);
  // beta_fast / beta_slow: transformers reads `value or default`, so 0 means the default too
  const double beta_fast = opt("beta_fast") != 0 ? opt("beta_fast") : 32.0;
  const double beta_slow = opt("beta_slow") != 0 ? opt("beta_slow") : 1.0;
  bool truncate = true;
  if (const JsonValue* t = get("truncate")) {
    if (!t->is_bool()) fail("%s: config key '%s' should be true or false", path.c_str(), name("truncate").c_str());
    truncate = t->b;
  }
  // Pair-index range of the ramp: the dimensions whose wavelength makes
  // beta_fast / beta_slow turns over the original context.
  const double dim = d.head_dim;
  auto correction_dim = [&](double turns) {
    return dim * std::log(orig / (turns * 2 * 3.14159265358979323846)) / (2 * std::log(theta));
  };
  double lo = correction_dim(beta_fast), hi = correction_dim(beta_slow);
  if (truncate) lo = std::floor(lo), hi = std::ceil(hi);
  r.factor = (float)factor;
  r.ramp_lo = (float)std::max(lo, 0.0);
  r.ramp_hi = (float)std::min(hi, dim - 1);
  r.attn_factor = (float)attn;
}

bool is_dir(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}
bool exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}

std::string dims_str(const std::vector<int64_t>& d) {
  std::string s = "[";
  for (size_t k = 0; k < d.size(); ++k) s += (k ? ", " : "") + std::to_string(d[k]);
  return s + "]";
}

struct Loader {
  const SafetensorsFile& f;
  std::set<std::string> used;

  const STTensor& get(const std::string& name, std::vector<int64_t> shape) {
    const STTensor* t = f.find(name);
    if (!t) fail("%s: missing tensor '%s' (expected shape %s)", f.path().c_str(), name.c_str(), dims_str(shape).c_str());
    if (t->shape != shape)
      fail("%s: tensor '%s' has shape %s, expected %s from config.json", f.path().c_str(), name.c_str(),
           t->shape_str().c_str(), dims_str(shape).c_str());
    used.insert(name);
    return *t;
  }
  Weight mat(const std::string& name, int64_t rows, int64_t cols) {
    const STTensor& t = get(name, {rows, cols});
    Weight w;
    w.type = t.dtype;
    w.data = t.data;
    w.rows = rows;
    w.cols = cols;
    w.row_bytes = (size_t)(t.nbytes() / (uint64_t)rows);
    return w;
  }
  std::vector<float> vec(const std::string& name, int64_t n) { return f32(name, {n}); }
  // any shape, read as f32 values in row-major order
  std::vector<float> f32(const std::string& name, std::vector<int64_t> shape) {
    const STTensor& t = get(name, shape);
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    std::vector<float> out((size_t)n);
    // The mapping need not be aligned for the element type: copy first.
    std::vector<uint8_t> tmp(t.nbytes());
    if (!tmp.empty()) std::memcpy(tmp.data(), t.data, tmp.size());
    dequantize_row(t.dtype, tmp.data(), out.data(), n);
    return out;
  }
};

// 1 for DFlashDraftModel (or no `architectures`: older configs), 2 for DFlash2DraftModel; anything else is refused.
int draft_architecture(const JsonValue& root, const std::string& path) {
  const JsonValue* a = root.find("architectures");
  if (!a || a->is_null()) return 1;
  if (!a->is_array() || a->arr.size() != 1 || !a->arr[0].is_string())
    fail("%s: config key 'architectures' should be a list of one name", path.c_str());
  const std::string& name = a->arr[0].str;
  if (name == "DFlashDraftModel") return 1;
  if (name == "DFlash2DraftModel") return 2;
  fail("%s: architectures '%s' is not a DFlash drafter (DFlashDraftModel or DFlash2DraftModel)", path.c_str(),
       name.c_str());
}

// DFlash2's keys, read from dflash_config only (as vLLM does) and checked against the shapes they imply.
void parse_dflash2(const Cfg& c, DraftConfig& d) {
  const char* p = c.path.c_str();
  auto req = [&](const char* key, int64_t lo, int64_t hi) {
    const JsonValue* v = c.dflash ? c.dflash->find(key) : nullptr;
    if (!v || v->is_null()) fail("%s: missing config key 'dflash_config.%s' (a DFlash2 drafter needs it)", p, key);
    return (int)c.as_int(v, key, lo, hi);
  };
  d.conv_kernel = req("conv_kernel_size", 1, d.block_size);
  d.conv_group = req("conv_group_size", 1, d.hidden);
  if (d.hidden % d.conv_group != 0)
    fail("%s: conv_group_size %d does not divide hidden_size %d", p, d.conv_group, d.hidden);
  d.selector_top_k = req("selector_top_k", 1, std::min(d.n_vocab, 64));
  d.selector_rank = req("selector_rank", 1, 1 << 16);
}

}  // namespace

std::vector<int> build_target_layer_ids(int n_target, int n_draft) {
  if (n_draft == 1) return {n_target / 2};
  const int start = 1, end = n_target - 3, span = end - start;
  std::vector<int> ids;
  for (int i = 0; i < n_draft; ++i)
    ids.push_back((int)std::nearbyint(start + (double)i * span / (n_draft - 1)));  // ties to even, as Python's round
  return ids;
}

DraftConfig parse_draft_config(const std::string& path) {
  JsonLimits lim;
  lim.max_bytes = size_t(16) << 20;
  lim.max_depth = 32;
  JsonValue root = parse_json_file(path, lim);
  if (!root.is_object()) fail("%s: config.json is a JSON %s, expected an object", path.c_str(), json_kind_name(root.kind));
  const JsonValue* dfc = root.find("dflash_config");
  if (dfc && !dfc->is_null() && !dfc->is_object())
    fail("%s: config key 'dflash_config' should be an object, found %s", path.c_str(), json_kind_name(dfc->kind));
  Cfg c{root, dfc && dfc->is_object() ? dfc : nullptr, path};
  DraftConfig d;
  d.dflash2 = draft_architecture(root, path) == 2;

  d.n_layer = (int)c.req_int("num_hidden_layers", 1, 1024);
  d.hidden = (int)c.req_int("hidden_size", 1, kMaxDim);
  d.n_head = (int)c.req_int("num_attention_heads", 1, 4096);
  d.n_head_kv = (int)c.req_int("num_key_value_heads", 1, 4096);
  d.head_dim = (int)c.req_int("head_dim", 2, 4096);
  d.n_ff = (int)c.req_int("intermediate_size", 1, kMaxDim);
  d.rms_eps = (float)c.req_pos_num("rms_norm_eps");
  d.n_vocab = (int)c.req_int("vocab_size", 1, int64_t(1) << 30);
  d.max_pos = c.req_int("max_position_embeddings", 1, int64_t(1) << 40);
  if (d.n_head % d.n_head_kv != 0)
    fail("%s: num_attention_heads %d is not a multiple of num_key_value_heads %d", path.c_str(), d.n_head, d.n_head_kv);
  if (d.head_dim % 2 != 0) fail("%s: head_dim %d is odd (RoPE needs pairs)", path.c_str(), d.head_dim);

  if (const JsonValue* a = root.find("hidden_act"))
    if (!a->is_null() && (!a->is_string() || a->str != "silu"))
      fail("%s: config key 'hidden_act' must be \"silu\"", path.c_str());
  if (c.opt_bool("attention_bias", false))
    fail("%s: config key 'attention_bias' is true; DFlash drafters have no attention biases", path.c_str());

  parse_rope(c, d);

  // Sliding layers as transformers' Qwen3Config derives them: the window is
  // `sliding_window` (4096 when the key is absent) only when use_sliding_window
  // is true, else none; layer kinds come from `layer_types`, else every layer
  // from max_window_layers (28 when absent) on slides when there is a window.
  // z-lab's drafter makes sliding layers causal and windowed; one without a
  // window is refused (transformers' sliding cache cannot even be built for it).
  const bool use_sw = c.opt_bool("use_sliding_window", false);
  int64_t window = 4096;
  if (const JsonValue* sw = root.find("sliding_window"))
    window = sw->is_null() ? 0 : c.as_int(sw, "sliding_window", 1, int64_t(1) << 30);
  d.sliding_window = use_sw ? (int)window : 0;
  d.is_sliding.assign((size_t)d.n_layer, 0);
  const JsonValue* lt = root.find("layer_types");
  if (lt && !lt->is_null()) {
    if (!lt->is_array()) fail("%s: config key 'layer_types' should be an array", path.c_str());
    if ((int)lt->arr.size() != d.n_layer)
      fail("%s: config key 'layer_types' has %zu entries but num_hidden_layers is %d", path.c_str(), lt->arr.size(),
           d.n_layer);
    for (int i = 0; i < d.n_layer; ++i) {
      const JsonValue& e = lt->arr[(size_t)i];
      if (e.is_string() && e.str == "full_attention") continue;
      if (e.is_string() && e.str == "sliding_attention") { d.is_sliding[(size_t)i] = 1; continue; }
      fail("%s: layer_types[%d] is %s%s%s; expected \"full_attention\" or \"sliding_attention\"", path.c_str(), i,
           e.is_string() ? "'" : "a JSON ", e.is_string() ? e.str.c_str() : json_kind_name(e.kind),
           e.is_string() ? "'" : "");
    }
  } else if (d.sliding_window > 0) {
    int64_t mwl = 28;
    if (const JsonValue* m = root.find("max_window_layers"); m && !m->is_null())
      mwl = c.as_int(m, "max_window_layers", 0, 1 << 20);
    for (int i = 0; i < d.n_layer; ++i) d.is_sliding[(size_t)i] = i >= mwl;
  }
  for (int i = 0; i < d.n_layer; ++i)
    if (d.is_sliding[(size_t)i] && d.sliding_window == 0)
      fail("%s: layer_types[%d] is sliding_attention but there is no window (%s)", path.c_str(), i,
           use_sw ? "'sliding_window' is null" : "'use_sliding_window' is false, which makes transformers drop "
                                                 "'sliding_window'");
  if (const JsonValue* ic = root.find("is_causal"); ic && !ic->is_null()) {
    if (!ic->is_bool()) fail("%s: config key 'is_causal' should be true, false or null", path.c_str());
    d.is_causal = ic->b ? 1 : 0;
  }

  // DFlash keys
  if (const JsonValue* v = c.find_dflash("block_size"); v && !v->is_null())
    d.block_size = (int)c.as_int(v, "block_size", 1, 4096);
  const JsonValue* mt = c.find_dflash("mask_token_id");
  if (!mt || mt->is_null()) fail("%s: missing config key 'dflash_config.mask_token_id'", path.c_str());
  d.mask_token_id = (int)c.as_int(mt, "mask_token_id", 0, int64_t(1) << 30);
  if (d.mask_token_id >= d.n_vocab)
    fail("%s: mask_token_id %d is outside the drafter's vocab_size %d", path.c_str(), d.mask_token_id, d.n_vocab);
  if (const JsonValue* v = c.find_dflash("num_target_layers"); v && !v->is_null())
    d.num_target_layers = (int)c.as_int(v, "num_target_layers", 1, 1 << 20);
  const JsonValue* ids = c.find_dflash("target_layer_ids");
  if (ids && !ids->is_null()) {
    if (!ids->is_array()) fail("%s: config key 'target_layer_ids' should be an array", path.c_str());
    if (ids->arr.empty()) fail("%s: config key 'target_layer_ids' is empty", path.c_str());
    if (ids->arr.size() > 1024) fail("%s: config key 'target_layer_ids' has %zu entries", path.c_str(), ids->arr.size());
    for (const JsonValue& e : ids->arr) d.target_layer_ids.push_back((int)c.as_int(&e, "target_layer_ids[]", 0, 1 << 20));
  } else if (d.num_target_layers > 0) {
    if (d.n_layer > 1 && d.num_target_layers < 4)
      fail("%s: num_target_layers %d is too small to derive target_layer_ids", path.c_str(), d.num_target_layers);
    d.target_layer_ids = build_target_layer_ids(d.num_target_layers, d.n_layer);
    d.layer_ids_derived = true;
  } else {
    fail("%s: missing config key 'dflash_config.target_layer_ids' (and no 'num_target_layers' to derive it from)",
         path.c_str());
  }
  std::set<int> seen;
  for (int id : d.target_layer_ids)
    if (!seen.insert(id).second) fail("%s: target_layer_ids lists layer %d twice", path.c_str(), id);
  if ((int64_t)d.hidden * (int64_t)d.target_layer_ids.size() > (int64_t(1) << 30))
    fail("%s: fc input size hidden_size x len(target_layer_ids) is absurd", path.c_str());

  d.input_embedding_scale = (float)c.opt_num("input_embedding_scale", 1.0);
  d.output_multiplier = (float)c.opt_num("output_multiplier", 1.0);
  d.final_logit_softcapping = (float)c.opt_num("final_logit_softcapping", 0.0);
  if (!(d.output_multiplier > 0.f) || !std::isfinite(d.output_multiplier))
    fail("%s: config key 'output_multiplier' must be positive, found %g", path.c_str(), (double)d.output_multiplier);
  if (!(d.final_logit_softcapping >= 0.f) || !std::isfinite(d.final_logit_softcapping))
    fail("%s: config key 'final_logit_softcapping' must be >= 0 (0 or null: off), found %g", path.c_str(),
         (double)d.final_logit_softcapping);
  if (d.dflash2) parse_dflash2(c, d);
  return d;
}

DraftFiles draft_files(const std::string& path, bool need_weights) {
  DraftFiles f;
  if (is_dir(path)) {
    std::string dir = path;
    while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
    f.config = dir + "/config.json";
    f.weights = dir + "/model.safetensors";
  } else if (exists(path)) {
    const size_t slash = path.find_last_of('/');
    const std::string dir = slash == std::string::npos ? std::string() : path.substr(0, slash + 1);
    const std::string base = path.substr(dir.size());
    f.config = base == "config.json" ? path : dir + "config.json";
    f.weights = base == "config.json" ? dir + "model.safetensors" : path;
  } else {
    fail("%s: cannot open drafter: no such file or directory", path.c_str());
  }
  if (!exists(f.config)) fail("%s: drafter config.json not found (expected %s)", path.c_str(), f.config.c_str());
  if (need_weights && !exists(f.weights))
    fail("%s: drafter model.safetensors not found (expected %s)", path.c_str(), f.weights.c_str());
  return f;
}

// A matrix converted row by row (BF16 or Q8_0) into memory the model owns, on
// all cores: the 27B drafter's 1.6 G matrix values take seconds, not minutes.
static Weight convert_matrix(const Weight& w, DType to, std::vector<std::vector<uint8_t>>& owned) {
  if (w.type == to) return w;
  if (to == DType::Q8_0 && w.cols % QK8_0)
    fail("cannot quantise the drafter to Q8_0: a matrix has %lld columns, not a multiple of %d", (long long)w.cols,
         QK8_0);
  Weight out = w;
  out.type = to;
  out.row_bytes = row_bytes(to, w.cols);
  owned.emplace_back((size_t)w.rows * out.row_bytes);
  uint8_t* dst = owned.back().data();
  out.data = dst;
  const int nt = std::max(1, std::min((int)std::thread::hardware_concurrency(), 32));
  std::vector<std::thread> th;
  for (int t = 0; t < nt; ++t)
    th.emplace_back([&, t] {
      std::vector<float> row((size_t)w.cols);
      std::vector<uint8_t> src(w.row_bytes);
      for (int64_t r = t; r < w.rows; r += nt) {
        std::memcpy(src.data(), w.row(r), w.row_bytes);  // the mapping need not be aligned
        dequantize_row(w.type, src.data(), row.data(), w.cols);
        quantize_row(to, row.data(), dst + (size_t)r * out.row_bytes, w.cols);
      }
    });
  for (auto& x : th) x.join();
  return out;
}

std::unique_ptr<DraftModel> load_draft(const std::string& path, std::optional<DType> weight_type) {
  if (weight_type && *weight_type != DType::BF16 && *weight_type != DType::Q8_0)
    fail("drafter weights can be kept as stored or converted to BF16 or Q8_0 (asked for type %u)",
         (unsigned)*weight_type);
  const DraftFiles files = draft_files(path, true);
  const std::string& cfg_path = files.config;
  const std::string& st_path = files.weights;
  auto m = std::make_unique<DraftModel>();
  m->config_path = cfg_path;
  m->cfg = parse_draft_config(cfg_path);
  m->file = std::make_unique<SafetensorsFile>(st_path);
  const DraftConfig& c = m->cfg;
  Loader L{*m->file, {}};
  const int64_t H = c.hidden, Q = c.q_dim(), KV = c.kv_dim(), F = c.n_ff, D = c.head_dim;
  m->fc = L.mat("fc.weight", H, c.fc_in());
  m->hidden_norm = L.vec("hidden_norm.weight", H);
  m->norm = L.vec("norm.weight", H);
  m->layers.resize((size_t)c.n_layer);
  for (int i = 0; i < c.n_layer; ++i) {
    DraftLayerWeights& l = m->layers[(size_t)i];
    const std::string p = "layers." + std::to_string(i) + ".";
    l.input_norm = L.vec(p + "input_layernorm.weight", H);
    l.post_norm = L.vec(p + "post_attention_layernorm.weight", H);
    l.wq = L.mat(p + "self_attn.q_proj.weight", Q, H);
    l.wk = L.mat(p + "self_attn.k_proj.weight", KV, H);
    l.wv = L.mat(p + "self_attn.v_proj.weight", KV, H);
    l.wo = L.mat(p + "self_attn.o_proj.weight", H, Q);
    l.q_norm = L.vec(p + "self_attn.q_norm.weight", D);
    l.k_norm = L.vec(p + "self_attn.k_norm.weight", D);
    l.gate = L.mat(p + "mlp.gate_proj.weight", F, H);
    l.up = L.mat(p + "mlp.up_proj.weight", F, H);
    l.down = L.mat(p + "mlp.down_proj.weight", H, F);
    if (c.dflash2) {
      const int64_t K = c.conv_kernel, G = c.conv_groups();
      for (auto [conv, name] : {std::pair{&l.attn_conv, "attention_conv"}, std::pair{&l.mlp_conv, "mlp_conv"}}) {
        conv->base = L.f32(p + name + ".base_kernel", {2, K, H});
        conv->proj = L.mat(p + name + ".kernel_projection.weight", 2 * K * G, H);
      }
    }
  }
  if (c.dflash2) {
    const int64_t R = c.selector_rank, V = c.n_vocab;
    m->selector.hidden_projection = L.mat("candidate_selector.hidden_projection.weight", R, H);
    m->selector.predecessor = L.mat("candidate_selector.predecessor_codebook", V, R);
    m->selector.successor = L.mat("candidate_selector.successor_codebook", V, R);
  }
  for (const STTensor& t : m->file->tensors()) {
    if (!L.used.count(t.name))
      fail("%s: unexpected tensor '%s' (not part of a %d-layer %s drafter)", st_path.c_str(), t.name.c_str(),
           c.n_layer, c.dflash2 ? "DFlash2" : "DFlash");
    m->weight_bytes += t.nbytes();
  }
  if (weight_type) {
    std::vector<Weight*> mats{&m->fc};
    for (DraftLayerWeights& l : m->layers)
      for (Weight* w : {&l.wq, &l.wk, &l.wv, &l.wo, &l.gate, &l.up, &l.down, &l.attn_conv.proj, &l.mlp_conv.proj})
        if (w->data) mats.push_back(w);
    for (Weight* w : {&m->selector.hidden_projection, &m->selector.predecessor, &m->selector.successor})
      if (w->data) mats.push_back(w);
    for (Weight* w : mats) {
      const uint64_t before = (uint64_t)w->rows * w->row_bytes;
      *w = convert_matrix(*w, *weight_type, m->converted);
      m->weight_bytes = m->weight_bytes - before + (uint64_t)w->rows * w->row_bytes;
    }
  }
  return m;
}

void validate_pair(const DraftConfig& d, const Qwen35Config& t) {
  if (d.hidden != t.n_embd)
    fail("drafter/target mismatch: drafter hidden_size %d != target hidden size %d", d.hidden, t.n_embd);
  for (int id : d.target_layer_ids)
    if (id < 0 || id >= t.n_layer)
      fail("drafter/target mismatch: target_layer_id %d is outside the target's layers [0, %d)", id, t.n_layer);
  if (d.layer_ids_derived && d.num_target_layers != t.n_layer)
    fail("drafter/target mismatch: drafter num_target_layers %d (its target_layer_ids derive from it) != target layers %d",
         d.num_target_layers, t.n_layer);
  if (d.mask_token_id < 0 || d.mask_token_id >= t.n_vocab)
    fail("drafter/target mismatch: mask_token_id %d is outside the target vocab [0, %d)", d.mask_token_id, t.n_vocab);
  if (d.n_vocab != t.n_vocab)
    fail("drafter/target mismatch: drafter vocab_size %d != target vocab size %d", d.n_vocab, t.n_vocab);
}

}  // namespace dfl
