// quantized_adam's CPU kernel: one pass per block of a param.
//
// What the Pallas kernel does on GPUs, for XLA:CPU, whose fusions cannot:
// per block it decodes mu and nu, applies Adam's update in float32, keeps the
// new moments in a block-sized buffer (in L1), takes each new moment's
// outlier and scale from them and writes the codes. Every state array is read
// once and written once (in place when donated). Blocks are split among
// XLA's intra-op threads.
//
// It writes what the XLA path (jmp_lite/low_precision/_blockwise.py,
// quantize/dequantize around optax.adam) writes, its float operations
// following that path's HLO as XLA:CPU's optimized code computes it: a
// division by a scalar is a product with its reciprocal, each new moment one
// fused multiply-add, subnormals flushed to zero (XLA:CPU's threads run with
// FTZ and DAZ set; set here on x86). XLA contracts differently under other
// flags, so a code a hair from a rounding threshold may come out one apart
// (a few per million), and a scale or outlier an ulp apart. Both moments' codes draw their random
// bits from one hash per element (_rounding.pair_bits: mu the high half,
// nu the low). jmp_lite/low_precision/_cpu_kernel.py builds, loads and calls it;
// tests/test_fused_quantized.py holds it to the XLA path.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int32_t kInfBits = 0x7F800000;
constexpr int32_t kMaxBits = 0x7F7FFFFF;
constexpr int32_t kBf16MaxBits = 0x7F7F0000;

inline float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

inline uint32_t ToBits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// MurmurHash3's finaliser, as jmp_lite.low_precision._rounding._mix.
inline uint32_t Mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  return x ^ (x >> 16);
}

// XLA's max and min propagate NaN.
inline float XMax(float a, float b) {
  return std::isnan(a) ? a : (std::isnan(b) ? b : (a > b ? a : b));
}

inline float Clip(float x, float low, float high) {
  // jnp.clip on values that are never NaN here.
  return std::min(std::max(x, low), high);
}

inline float RoundHalfUp(float x) {
  const float low = std::floor(x);
  return low + (x - low >= 0.5f ? 1.0f : 0.0f);
}

inline float Bf16Ceiling(float x) {
  const int32_t bits = static_cast<int32_t>(ToBits(x) & 0x7FFFFFFFu);
  const int32_t up = (bits + 0xFFFF) & -0x10000;
  return FromBits(static_cast<uint32_t>(std::min(up, kBf16MaxBits)));
}

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1Fu) return FromBits(sign | 0x7F800000u | (mantissa << 13));
  if (exponent != 0) {
    return FromBits(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  }
  if (mantissa == 0) return FromBits(sign);
  // A float16 subnormal is a float32 normal: normalise it.
  int shift = 0;
  while (!(mantissa & 0x400u)) {
    mantissa <<= 1;
    ++shift;
  }
  return FromBits(sign | ((113u - shift) << 23) | ((mantissa & 0x3FFu) << 13));
}

// One moment's old state (inputs), new state (outputs) and maps.
struct Moment {
  const uint8_t* codes;
  const void* scales;
  const float* outliers;
  const void* where;
  uint8_t* codes_out;
  void* scales_out;
  float* outliers_out;
  void* where_out;
  bool form_signed;  // The map the old codes were written with.
  bool ok;           // Their bits and block size are this optimizer's.
  bool signed_leaf;  // The map the new codes take.
};

struct Params {
  const void* g;
  int g_kind;  // 0: float32, 1: bfloat16, 2: float16.
  float* updates;
  Moment mu, nu;
  int64_t rows, n, r, c, col_blocks;
  int bits;
  bool stochastic, scale_bf16, where_i32;
  uint32_t key;  // The param's random stream (_rounding.stream_key).
  float omb1, b1, omb2, b2, eps, neg_lr, inv_bc1, inv_bc2;
};

// A block's scratch arrays (r * c floats each: in L1 for blocks of 256).
struct Scratch {
  std::vector<float> g, kmu, knu, mu, nu, u;
  std::vector<int32_t> keys;
  std::vector<uint32_t> bits;
  std::vector<uint8_t> codes;

  void Resize(int64_t size) {
    for (auto* v : {&g, &kmu, &knu, &mu, &nu, &u}) v->assign(size, 0.0f);
    keys.assign(size, 0);
    bits.assign(size, 0);
    codes.assign(size, 0);
  }
};

// Calls f with the flag as a compile-time constant.
template <typename F>
inline void WithFlag(bool flag, F&& f) {
  if (flag) {
    f(std::true_type());
  } else {
    f(std::false_type());
  }
}

inline float LoadScale(const void* s, bool bf16, int64_t b) {
  if (bf16) {
    return FromBits(static_cast<uint32_t>(static_cast<const uint16_t*>(s)[b])
                    << 16);
  }
  return static_cast<const float*>(s)[b];
}

inline int64_t LoadWhere(const void* w, bool i32, int64_t b) {
  return i32 ? static_cast<const int32_t*>(w)[b]
             : static_cast<const uint8_t*>(w)[b];
}

// One row segment of the gradient, as float32.
void LoadG(const Params& p, int64_t at, int64_t count, float* out) {
  if (p.g_kind == 1) {
    const uint16_t* g = static_cast<const uint16_t*>(p.g) + at;
    for (int64_t j = 0; j < count; ++j) {
      out[j] = FromBits(static_cast<uint32_t>(g[j]) << 16);
    }
  } else if (p.g_kind == 2) {
    const uint16_t* g = static_cast<const uint16_t*>(p.g) + at;
    for (int64_t j = 0; j < count; ++j) out[j] = HalfToFloat(g[j]);
  } else {
    std::memcpy(out, static_cast<const float*>(p.g) + at, count * 4);
  }
}

// One row segment of codes (from an even column), as float32.
void LoadCodes(const Params& p, const uint8_t* codes, int64_t row,
               int64_t col0, int64_t count, float* out) {
  if (p.bits == 8) {
    const uint8_t* in = codes + row * p.n + col0;
    for (int64_t j = 0; j < count; ++j) out[j] = in[j];
    return;
  }
  const uint8_t* in = codes + row * ((p.n + 1) / 2) + col0 / 2;
  const int64_t pairs = count / 2;
  for (int64_t j = 0; j < pairs; ++j) {
    out[2 * j] = in[j] & 0xF;
    out[2 * j + 1] = in[j] >> 4;
  }
  if (count % 2) out[count - 1] = in[pairs] & 0xF;
}

// A block's old moment (_blockwise.decode_blocks): y from the codes k, the
// map's square: sign(a) a**2 * scale, squared again for the unsigned map.
void Decode(const Params& p, const Moment& m, int64_t b, const float* k,
            float* y, int64_t size) {
  const float top = static_cast<float>((1 << (p.bits - 1)) - 1);
  const float levels = static_cast<float>(1 << p.bits);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float scale = m.ok ? LoadScale(m.scales, p.scale_bf16, b) : nan;
  const float offset = m.form_signed ? -top : 1.0f;
  const float step = m.form_signed ? 1.0f / top : 1.0f / levels;
  if (m.form_signed) {
    for (int64_t e = 0; e < size; ++e) {
      const float a = (k[e] + offset) * step;
      y[e] = a * std::fabs(a) * scale;
    }
  } else {
    for (int64_t e = 0; e < size; ++e) {
      const float a = (k[e] + offset) * step;
      const float root = a * std::fabs(a) * scale;
      y[e] = root * root;
    }
  }
  // The outlier back at its index (an index past the block matches none).
  const int64_t where = LoadWhere(m.where, p.where_i32, b);
  if (where >= 0 && where < size) y[where] = m.ok ? m.outliers[b] : nan;
}

// A magnitude's order as its bits: any NaN above inf.
inline int32_t Key(float mag) {
  return static_cast<int32_t>(ToBits(mag) & 0x7FFFFFFFu);
}

inline int32_t Saturated(int32_t key) {
  return key > kInfBits ? 0 : std::min(key, kMaxBits);
}

// One row segment's codes (_blockwise.encode_blocks' elementwise part):
// u = Q**2 |y| / s, between the codes' squares low**2 and (low + 1)**2.
template <bool kSigned, bool kStochastic, int kBits>
void CodeRow(const float* raw, int64_t count, const uint32_t* bits, int half,
             float r, uint8_t* codes) {
  constexpr float q = kSigned ? static_cast<float>((1 << (kBits - 1)) - 1)
                              : static_cast<float>(1 << kBits);
  constexpr float ns = 0x1p-16f;  // _rounding.NOISE_SCALE
  const uint32_t shift = half == 0 ? 16 : 0;  // mu the high half, nu the low
  for (int64_t j = 0; j < count; ++j) {
    const float x = raw[j];
    float mag;
    if constexpr (kSigned) {
      mag = std::fabs(x);
      mag = std::isnan(mag) ? 0.0f : mag;
    } else {
      // NaN stays NaN (XLA's max and min propagate it): the lowest code.
      mag = std::sqrt(XMax(x, 0.0f));
    }
    const float scaled = (mag * r) * r;
    const float u = std::isnan(scaled) ? scaled : std::min(scaled, q * q);
    const float c = std::sqrt(u);
    float k;
    if constexpr (!kStochastic) {
      const float m = RoundHalfUp(c);
      if constexpr (kSigned) {
        k = x < 0.0f ? q - m : q + m;
      } else {
        k = m > 1.0f ? m - 1.0f : 0.0f;
      }
    } else {
      // Through int32 (16 bits fit): a vectorized conversion.
      const float noise = static_cast<float>(
          static_cast<int32_t>((bits[j] >> shift) & 0xFFFFu));
      float low = std::floor(c);
      if constexpr (!kSigned) low = low > 1.0f ? low : 1.0f;
      const float gap = std::fma(low, 2.0f * ns, ns);
      const bool up = noise * gap < u - low * low;
      if constexpr (kSigned) {
        const float m = up ? low + 1.0f : low;
        k = x < 0.0f ? q - m : q + m;
      } else {
        k = up ? low : low - 1.0f;
      }
    }
    codes[j] = static_cast<uint8_t>(static_cast<int32_t>(k));
  }
}

// Encodes one block's new values (_blockwise.encode_blocks with
// _block_stats.outlier_and_scale): ``raw`` holds the block's r * c values,
// zero where the block runs past the leaf.
void Encode(const Params& p, const Moment& m, int64_t b, int64_t row0,
            int64_t col0, int64_t nrows, int64_t ncols, const float* raw,
            Scratch& s) {
  const int64_t size = p.r * p.c;
  const bool signed_leaf = m.signed_leaf;
  int32_t* keys = s.keys.data();
  // The outlier: the largest magnitude (NaN above all; the first of equals).
  if (signed_leaf) {
    for (int64_t e = 0; e < size; ++e) keys[e] = Key(std::fabs(raw[e]));
  } else {
    for (int64_t e = 0; e < size; ++e) keys[e] = Key(XMax(raw[e], 0.0f));
  }
  int32_t best = -1;
  for (int64_t e = 0; e < size; ++e) best = std::max(best, keys[e]);
  int64_t where = 0;
  while (keys[where] != best) ++where;
  // The scale: the largest of the others, saturated.
  keys[where] = 0;
  int32_t rest = 0;
  for (int64_t e = 0; e < size; ++e) rest = std::max(rest, Saturated(keys[e]));
  const float top_mag = FromBits(static_cast<uint32_t>(rest));
  const float absmax = signed_leaf ? top_mag : std::sqrt(top_mag);
  const float wide = p.scale_bf16 ? Bf16Ceiling(absmax) : absmax;
  if (p.scale_bf16) {
    static_cast<uint16_t*>(m.scales_out)[b] =
        static_cast<uint16_t>(ToBits(wide) >> 16);
  } else {
    static_cast<float*>(m.scales_out)[b] = wide;
  }
  m.outliers_out[b] = raw[where];
  if (p.where_i32) {
    static_cast<int32_t*>(m.where_out)[b] = static_cast<int32_t>(where);
  } else {
    static_cast<uint8_t*>(m.where_out)[b] = static_cast<uint8_t>(where);
  }
  // r = Q / sqrt(s), divided as the XLA path divides it per block.
  const float q = signed_leaf ? static_cast<float>((1 << (p.bits - 1)) - 1)
                              : static_cast<float>(1 << p.bits);
  const float r = q / std::max(std::sqrt(wide > 0.0f ? wide : 1.0f),
                               std::numeric_limits<float>::min());
  uint8_t* codes = s.codes.data();
  const int half = signed_leaf ? 0 : 1;
  auto rows = [&](auto kernel) {
    for (int64_t i = 0; i < nrows; ++i) {
      kernel(raw + i * p.c, ncols, s.bits.data() + i * p.c, half, r,
             codes + i * p.c);
    }
  };
  // One loop per (map, rounding, bits), each compiled on its own.
  WithFlag(signed_leaf, [&](auto is_signed) {
    WithFlag(p.stochastic, [&](auto stochastic) {
      WithFlag(p.bits == 8, [&](auto eight) {
        rows(CodeRow<decltype(is_signed)::value, decltype(stochastic)::value,
                     decltype(eight)::value ? 8 : 4>);
      });
    });
  });
  // The codes into the leaf (two per byte, low nibble first, for 4 bits).
  for (int64_t i = 0; i < nrows; ++i) {
    const int64_t row = row0 + i;
    const uint8_t* in = codes + i * p.c;
    if (p.bits == 8) {
      std::memcpy(m.codes_out + row * p.n + col0, in, ncols);
    } else {
      uint8_t* out = m.codes_out + row * ((p.n + 1) / 2) + col0 / 2;
      const int64_t pairs = ncols / 2;
      for (int64_t j = 0; j < pairs; ++j) {
        out[j] = static_cast<uint8_t>(in[2 * j] | (in[2 * j + 1] << 4));
      }
      if (ncols % 2) out[pairs] = in[ncols - 1];
    }
  }
}

void RunBlocks(const Params& p, int64_t begin, int64_t end, Scratch& s) {
  const int64_t size = p.r * p.c;
  s.Resize(size);
  float *g = s.g.data(), *kmu = s.kmu.data(), *knu = s.knu.data();
  float *mu = s.mu.data(), *nu = s.nu.data(), *u = s.u.data();
  for (int64_t b = begin; b < end; ++b) {
    const int64_t row0 = (b / p.col_blocks) * p.r;
    const int64_t col0 = (b % p.col_blocks) * p.c;
    const int64_t nrows = std::min(p.r, p.rows - row0);
    const int64_t ncols = std::min(p.c, p.n - col0);
    const bool partial = nrows < p.r || ncols < p.c;
    for (int64_t i = 0; i < nrows; ++i) {
      const int64_t row = row0 + i;
      LoadG(p, row * p.n + col0, ncols, g + i * p.c);
      LoadCodes(p, p.mu.codes, row, col0, ncols, kmu + i * p.c);
      LoadCodes(p, p.nu.codes, row, col0, ncols, knu + i * p.c);
    }
    Decode(p, p.mu, b, kmu, mu, size);
    Decode(p, p.nu, b, knu, nu, size);
    for (int64_t e = 0; e < size; ++e) {
      const float ge = g[e];
      // optax: (1 - b1) * g + b1 * mu, (1 - b2) * g**2 + b2 * nu, each one
      // multiply-add, as XLA:CPU's optimized code contracts them.
      const float m = std::fma(p.omb1, ge, p.b1 * mu[e]);
      const float v = std::fma(p.omb2, ge * ge, p.b2 * nu[e]);
      u[e] = p.neg_lr *
             ((m * p.inv_bc1) / (std::sqrt(v * p.inv_bc2) + p.eps));
      mu[e] = m;
      nu[e] = v;
    }
    if (partial) {
      // The XLA path pads a partial block's new moments with zeros.
      for (int64_t e = 0; e < size; ++e) {
        if (e / p.c >= nrows || e % p.c >= ncols) mu[e] = nu[e] = 0.0f;
      }
    }
    for (int64_t i = 0; i < nrows; ++i) {
      std::memcpy(p.updates + (row0 + i) * p.n + col0, u + i * p.c,
                  ncols * 4);
    }
    if (p.stochastic) {
      // One hash per element for both moments (_rounding.pair_bits).
      for (int64_t i = 0; i < nrows; ++i) {
        const uint32_t flat0 =
            static_cast<uint32_t>(row0 + i) * static_cast<uint32_t>(p.n) +
            static_cast<uint32_t>(col0);
        uint32_t* out = s.bits.data() + i * p.c;
        for (int64_t j = 0; j < ncols; ++j) {
          out[j] = Mix(((flat0 + static_cast<uint32_t>(j)) * 0x9E3779B9u) ^
                       p.key);
        }
      }
    }
    Encode(p, p.mu, b, row0, col0, nrows, ncols, mu, s);
    Encode(p, p.nu, b, row0, col0, nrows, ncols, nu, s);
  }
}

// XLA:CPU's arithmetic: subnormals flushed (inputs and results).
class FlushDenormals {
 public:
  FlushDenormals() {
#if defined(__x86_64__) || defined(__i386__)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ | 0x8040u);
#endif
  }
  ~FlushDenormals() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_setcsr(saved_);
#endif
  }

 private:
  unsigned int saved_ = 0;
};

struct Progress {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mutex;
  std::condition_variable finished;
};

// Blocks per task: about 16K elements.
int64_t ChunkBlocks(int64_t size) {
  return std::max<int64_t>(1, (int64_t{1} << 14) / size);
}

ffi::Error QuantizedAdamImpl(
    ffi::ThreadPool pool, ffi::Buffer<ffi::U32> meta, ffi::Buffer<ffi::F32> coef,
    ffi::AnyBuffer g, ffi::Buffer<ffi::U8> mc, ffi::AnyBuffer ms,
    ffi::Buffer<ffi::F32> mo, ffi::AnyBuffer mw, ffi::Buffer<ffi::U8> nc,
    ffi::AnyBuffer ns, ffi::Buffer<ffi::F32> no, ffi::AnyBuffer nw,
    ffi::ResultBuffer<ffi::F32> u, ffi::ResultBuffer<ffi::U8> mc_out,
    ffi::Result<ffi::AnyBuffer> ms_out, ffi::ResultBuffer<ffi::F32> mo_out,
    ffi::Result<ffi::AnyBuffer> mw_out, ffi::ResultBuffer<ffi::U8> nc_out,
    ffi::Result<ffi::AnyBuffer> ns_out, ffi::ResultBuffer<ffi::F32> no_out,
    ffi::Result<ffi::AnyBuffer> nw_out, int64_t rows, int64_t n, int64_t r,
    int64_t c, int32_t bits, bool stochastic, float omb1, float b1,
    float omb2, float b2, float eps, float neg_lr) {
  Params p;
  switch (g.element_type()) {
    case ffi::DataType::F32: p.g_kind = 0; break;
    case ffi::DataType::BF16: p.g_kind = 1; break;
    case ffi::DataType::F16: p.g_kind = 2; break;
    default:
      return ffi::Error::InvalidArgument(
          "jmp_lite quantized_adam CPU kernel: gradients must be float32,"
          " bfloat16 or float16");
  }
  if ((bits != 8 && bits != 4) || rows < 1 || n < 1 || r < 1 || c < 1 ||
      c > n) {
    return ffi::Error::InvalidArgument(
        "jmp_lite quantized_adam CPU kernel: bad layout");
  }
  // Every buffer's size against the layout: the kernel indexes them by it.
  const int64_t n_blocks = ((rows + r - 1) / r) * ((n + c - 1) / c);
  const int64_t n_codes = rows * (bits == 8 ? n : (n + 1) / 2);
  const size_t elements = static_cast<size_t>(rows * n);
  const size_t codes_size = static_cast<size_t>(n_codes);
  const size_t blocks_size = static_cast<size_t>(n_blocks);
  const bool scale_ok =
      ms.element_type() == ns.element_type() &&
      (ms.element_type() == ffi::DataType::F32 ||
       ms.element_type() == ffi::DataType::BF16);
  const bool where_ok =
      mw.element_type() == nw.element_type() &&
      (mw.element_type() == ffi::DataType::U8 ||
       mw.element_type() == ffi::DataType::S32);
  if (g.element_count() != elements || u->element_count() != elements ||
      mc.element_count() != codes_size || nc.element_count() != codes_size ||
      ms.element_count() != blocks_size || ns.element_count() != blocks_size ||
      mo.element_count() != blocks_size || no.element_count() != blocks_size ||
      mw.element_count() != blocks_size || nw.element_count() != blocks_size ||
      !scale_ok || !where_ok || meta.element_count() != 5 ||
      coef.element_count() != 2) {
    return ffi::Error::InvalidArgument(
        "jmp_lite quantized_adam CPU kernel: the state's arrays do not match"
        " the layout");
  }
  p.g = g.untyped_data();
  p.updates = u->typed_data();
  p.rows = rows;
  p.n = n;
  p.r = r;
  p.c = c;
  p.col_blocks = (n + c - 1) / c;
  p.bits = bits;
  p.stochastic = stochastic;
  p.scale_bf16 = ms.element_type() == ffi::DataType::BF16;
  p.where_i32 = mw.element_type() == ffi::DataType::S32;
  p.omb1 = omb1;
  p.b1 = b1;
  p.omb2 = omb2;
  p.b2 = b2;
  p.eps = eps;
  p.neg_lr = neg_lr;
  const uint32_t* m = meta.typed_data();
  const float* bc = coef.typed_data();
  {
    // XLA:CPU divides by a scalar as a product with its reciprocal.
    FlushDenormals flush;
    volatile float one = 1.0f;
    p.inv_bc1 = one / bc[0];
    p.inv_bc2 = one / bc[1];
  }
  // meta: the count, the param's stream key, each form's map (1: signed),
  // the forms' check bits.
  p.key = m[1];
  p.mu = Moment{mc.typed_data(), ms.untyped_data(), mo.typed_data(),
                mw.untyped_data(), mc_out->typed_data(),
                ms_out->untyped_data(), mo_out->typed_data(),
                mw_out->untyped_data(), m[2] == 1, (m[4] & 1u) != 0, true};
  p.nu = Moment{nc.typed_data(), ns.untyped_data(), no.typed_data(),
                nw.untyped_data(), nc_out->typed_data(),
                ns_out->untyped_data(), no_out->typed_data(),
                nw_out->untyped_data(), m[3] == 1, (m[4] & 2u) != 0, false};
  const int64_t groups = (rows + r - 1) / r;
  const int64_t blocks = groups * p.col_blocks;
  const int64_t chunk = ChunkBlocks(r * c);
  const int64_t chunks = (blocks + chunk - 1) / chunk;
  auto progress = std::make_shared<Progress>();
  // The caller works too, so the step finishes even if no helper starts
  // (a busy pool); a helper that starts late finds nothing left.
  auto work = [progress, p, chunk, chunks, blocks]() {
    FlushDenormals flush;
    Scratch scratch;
    int64_t i;
    while ((i = progress->next.fetch_add(1)) < chunks) {
      RunBlocks(p, i * chunk, std::min(blocks, (i + 1) * chunk), scratch);
      if (progress->done.fetch_add(1) + 1 == chunks) {
        std::lock_guard<std::mutex> lock(progress->mutex);
        progress->finished.notify_all();
      }
    }
  };
  const int64_t helpers =
      std::min<int64_t>(pool.num_threads(), chunks) - 1;
  for (int64_t h = 0; h < helpers; ++h) {
    auto copy = work;  // Schedule takes the task by value.
    pool.Schedule(std::move(copy));
  }
  work();
  std::unique_lock<std::mutex> lock(progress->mutex);
  progress->finished.wait(lock, [&] { return progress->done.load() == chunks; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JmpLiteQuantizedAdam, QuantizedAdamImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::ThreadPool>()
        .Arg<ffi::Buffer<ffi::U32>>()   // meta
        .Arg<ffi::Buffer<ffi::F32>>()   // bias corrections
        .Arg<ffi::AnyBuffer>()          // gradients
        .Arg<ffi::Buffer<ffi::U8>>()    // mu: codes, scales, outliers, where
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::Buffer<ffi::F32>>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::Buffer<ffi::U8>>()    // nu
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::Buffer<ffi::F32>>()
        .Arg<ffi::AnyBuffer>()
        .Ret<ffi::Buffer<ffi::F32>>()   // updates
        .Ret<ffi::Buffer<ffi::U8>>()
        .Ret<ffi::AnyBuffer>()
        .Ret<ffi::Buffer<ffi::F32>>()
        .Ret<ffi::AnyBuffer>()
        .Ret<ffi::Buffer<ffi::U8>>()
        .Ret<ffi::AnyBuffer>()
        .Ret<ffi::Buffer<ffi::F32>>()
        .Ret<ffi::AnyBuffer>()
        .Attr<int64_t>("rows")
        .Attr<int64_t>("n")
        .Attr<int64_t>("r")
        .Attr<int64_t>("c")
        .Attr<int32_t>("bits")
        .Attr<bool>("stochastic")
        .Attr<float>("omb1")
        .Attr<float>("b1")
        .Attr<float>("omb2")
        .Attr<float>("b2")
        .Attr<float>("eps")
        .Attr<float>("neg_lr"));
