//! Where the CPU backend uses instructions the baseline target lacks, chosen once at run time.
//!
//! Every kernel here has one definition of its arithmetic, in safe Rust (`numerics`, `matmul`),
//! and is compiled twice: as is, and inside a function with AVX2 and FMA enabled, which is
//! called only on a CPU that has them. `f32::mul_add` is a single correctly rounded operation
//! either way (an instruction with FMA, a C library call without), and integer sums are exact,
//! so both copies give bit-identical results: the choice changes speed, never output.
//!
//! This module and the dispatch in `blocks`, `kquants` and `forward` (the paged attention,
//! SiLU) are the only places of the CPU backend allowed `unsafe`: calling a function compiled for
//! features the caller's target does not promise, and unaligned vector loads after the lengths
//! they read were asserted.

#![allow(unsafe_code, reason = "calls into code compiled for CPU features detected at run time")]

/// Whether this CPU runs the AVX2 and FMA copies (detected once; the standard library caches it).
/// x86-64 only, as every caller: elsewhere only the portable copies exist.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn has_avx2_fma() -> bool {
    #[cfg(test)]
    if PORTABLE_ONLY.get() {
        return false;
    }
    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
}

/// Whether this CPU also converts half precision eight values at a time (F16C), as the paged
/// attention reads its cache. Every AVX2 CPU made has it; this checks rather than assumes.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn has_avx2_fma_f16c() -> bool {
    has_avx2_fma() && std::arch::is_x86_feature_detected!("f16c")
}

#[cfg(test)]
thread_local! {
    static PORTABLE_ONLY: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` on this thread as if the CPU had no AVX2 or FMA: tests compare the two copies.
#[cfg(test)]
pub(crate) fn force_portable<R>(f: impl FnOnce() -> R) -> R {
    PORTABLE_ONLY.set(true);
    let out = f();
    PORTABLE_ONLY.set(false);
    out
}

/// Runs `f` on a thread of the compute pool, so that the parallel products inside it are forked
/// from a pool thread (which works on them too) instead of each waking the pool from outside and
/// sleeping until it is done: at batch 1 that hand-off cost more than the products.
pub(crate) fn in_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| f())
}

/// Runs `f`, from inside a function compiled with AVX2 and FMA where the CPU has them, so that
/// whatever of `f` is inlined into it (the `#[inline(always)]` arithmetic of `numerics` and
/// `matmul`) uses those instructions.
#[inline(always)]
pub(crate) fn run<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU was just found to have AVX2 and FMA, all that `with_avx2_fma` assumes.
        return unsafe { with_avx2_fma(f) };
    }
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
fn with_avx2_fma<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// The integer heart of the quantized products in AVX2, as llama.cpp's kernels compute it:
/// `maddubs` multiplies unsigned by signed bytes and adds neighbours, `madd` with ones adds
/// those pairs, giving eight lanes that each hold the sum of four consecutive products; each
/// block's lanes are scaled and added with one fused multiply-add. The integer sums are exact
/// (no pair reaches the 16-bit saturation: 15 * 127 * 2 and 128 * 127 * 2 are below 32767), so
/// these equal `blocks`' portable definitions bit for bit.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    use super::super::kquants::Header;

    /// Lane accumulators of a row of 4-bit blocks (16 bytes each: element `i < 16` is the low
    /// nibble of byte `i`, element `16 + i` its high nibble) against 8-bit activations, each
    /// block scaled by `scales[b] * act_scales[b]`. With `centered` the nibbles are less 8 (Q4_0).
    /// Where `mins` is not empty (Q4_1), also `sum_b mins[b] * act_sums[b]`, in its own chain in
    /// the same loop, as llama.cpp's `summs`: two chains run side by side instead of one after
    /// the other.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn q4_lanes(
        scales: &[f32],
        mins: &[f32],
        quants: &[u8],
        act_scales: &[f32],
        act_sums: &[f32],
        act: &[i8],
        centered: bool,
    ) -> ([f32; 8], f32) {
        let n = scales.len();
        assert!(quants.len() >= 16 * n && act.len() >= 32 * n && act_scales.len() >= n);
        let with_mins = !mins.is_empty();
        assert!(!with_mins || (mins.len() >= n && act_sums.len() >= n));
        let acts = [(act_scales, act_sums, act)];
        // SAFETY: the asserts above are what `q4_lanes_body` requires.
        let [out] = unsafe {
            match (centered, with_mins) {
                (true, false) => q4_lanes_body::<true, false, 1>(scales, mins, quants, acts),
                (true, true) => q4_lanes_body::<true, true, 1>(scales, mins, quants, acts),
                (false, false) => q4_lanes_body::<false, false, 1>(scales, mins, quants, acts),
                (false, true) => q4_lanes_body::<false, true, 1>(scales, mins, quants, acts),
            }
        };
        out
    }

    /// `q4_lanes` of one weight row against four activations at once: each block's nibbles are
    /// loaded and unpacked once for all four. Each activation's lanes (and minimum sum)
    /// accumulate in the same order as alone, so the results equal four `q4_lanes` calls bit for
    /// bit. An activation is (scales, block sums, values).
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn q4_lanes4(
        scales: &[f32],
        mins: &[f32],
        quants: &[u8],
        acts: [(&[f32], &[f32], &[i8]); 4],
        centered: bool,
    ) -> [([f32; 8], f32); 4] {
        let n = scales.len();
        assert!(quants.len() >= 16 * n);
        let with_mins = !mins.is_empty();
        assert!(!with_mins || mins.len() >= n);
        for (act_scales, act_sums, act) in acts {
            assert!(act.len() >= 32 * n && act_scales.len() >= n);
            assert!(!with_mins || act_sums.len() >= n);
        }
        // The block loop is the products' whole cost at large batches: with `centered` and the
        // minimums as run-time flags and each access bounds-checked it ran twice the
        // instructions (a branch and a check per input per block). Compiled once per kind
        // instead, with the bounds asserted above.
        // SAFETY: the asserts above are what `q4_lanes_body` requires.
        unsafe {
            match (centered, with_mins) {
                (true, false) => q4_lanes_body::<true, false, 4>(scales, mins, quants, acts),
                (true, true) => q4_lanes_body::<true, true, 4>(scales, mins, quants, acts),
                (false, false) => q4_lanes_body::<false, false, 4>(scales, mins, quants, acts),
                (false, true) => q4_lanes_body::<false, true, 4>(scales, mins, quants, acts),
            }
        }
    }

    /// `q4_lanes`' and `q4_lanes4`'s loop for one kind of block and `N` activations.
    ///
    /// # Safety
    /// `quants` holds 16 bytes and every activation 32 values and one scale for each of the
    /// `scales.len()` blocks; with `MINS`, `mins` and every activation's sums one value each.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn q4_lanes_body<const CENTERED: bool, const MINS: bool, const N: usize>(
        scales: &[f32],
        mins: &[f32],
        quants: &[u8],
        acts: [(&[f32], &[f32], &[i8]); N],
    ) -> [([f32; 8], f32); N] {
        let low = _mm256_set1_epi8(0x0f);
        let eight = _mm256_set1_epi8(8);
        let ones = _mm256_set1_epi16(1);
        let act_scales = acts.map(|(d, _, _)| d.as_ptr());
        let act_sums = acts.map(|(_, s, _)| s.as_ptr());
        let act_values = acts.map(|(_, _, q)| q.as_ptr());
        let mut acc = [_mm256_setzero_ps(); N];
        let mut summs = [0f32; N];
        for b in 0..scales.len() {
            // SAFETY (every access below): the caller's bounds, block `b` < `scales.len()`.
            if MINS {
                let min = unsafe { *mins.get_unchecked(b) };
                for (summs, sums) in summs.iter_mut().zip(act_sums) {
                    *summs = min.mul_add(unsafe { *sums.add(b) }, *summs);
                }
            }
            let packed = unsafe { _mm_loadu_si128(quants.as_ptr().add(16 * b).cast()) };
            let nibbles =
                _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low);
            let (x, ax) = if CENTERED {
                let x = _mm256_sub_epi8(nibbles, eight);
                (x, _mm256_sign_epi8(x, x))
            } else {
                (nibbles, nibbles)
            };
            let scale = unsafe { *scales.get_unchecked(b) };
            for i in 0..N {
                let q = unsafe { _mm256_loadu_si256(act_values[i].add(32 * b).cast()) };
                let q = if CENTERED { _mm256_sign_epi8(q, x) } else { q };
                let lanes =
                    _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(ax, q), ones));
                let d = scale * unsafe { *act_scales[i].add(b) };
                acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(d), lanes, acc[i]);
            }
        }
        std::array::from_fn(|i| (to_array(acc[i]), summs[i]))
    }

    /// A `Q4_0` row against each of `acts` (scales, values) as llama.cpp's repacked path
    /// computes it (`blocks::repacked_dots`): each block's products summed in integers, then
    /// `acc = fma(sum, scales[b] * act_scales[b], acc)` in block order.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn q4_0_repacked<const N: usize>(
        scales: &[f32],
        quants: &[u8],
        acts: [(&[f32], &[i8]); N],
    ) -> [f32; N] {
        let n = scales.len();
        assert!(quants.len() >= 16 * n);
        for (act_scales, act) in acts {
            assert!(act.len() >= 32 * n && act_scales.len() >= n);
        }
        let low = _mm256_set1_epi8(0x0f);
        let eight = _mm256_set1_epi8(8);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [0f32; N];
        for b in 0..n {
            // SAFETY: the assert above puts 16 bytes of `quants` at block `b`.
            let packed = unsafe { _mm_loadu_si128(quants.as_ptr().add(16 * b).cast()) };
            let nibbles =
                _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low);
            let x = _mm256_sub_epi8(nibbles, eight);
            let ax = _mm256_sign_epi8(x, x);
            for (acc, (act_scales, act)) in acc.iter_mut().zip(acts) {
                // SAFETY: the asserts above put 32 bytes of every `act` at block `b`.
                let q = unsafe { _mm256_loadu_si256(act.as_ptr().add(32 * b).cast()) };
                let lanes =
                    _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(q, x)), ones);
                let half = _mm_add_epi32(
                    _mm256_castsi256_si128(lanes),
                    _mm256_extracti128_si256(lanes, 1),
                );
                let sum = add4(half);
                *acc = (sum as f32).mul_add(scales[b] * act_scales[b], *acc);
            }
        }
        acc
    }

    /// Lane accumulators of a row of 8-bit blocks (32 signed bytes each) against each of `acts`
    /// (scales, values), each block scaled by `scales[b] * act_scales[b]`; `N` activations share
    /// each block's load, each accumulating in the order it would alone (so four at once equal
    /// four alone, bit for bit).
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn q8_lanes<const N: usize>(
        scales: &[f32],
        quants: &[u8],
        acts: [(&[f32], &[i8]); N],
    ) -> [[f32; 8]; N] {
        let n = scales.len();
        assert!(quants.len() >= 32 * n);
        for (act_scales, act) in acts {
            assert!(act.len() >= 32 * n && act_scales.len() >= n);
        }
        let ones = _mm256_set1_epi16(1);
        // Pointers, as in `q4_lanes_body`: no check per input per block.
        let act_scales = acts.map(|(d, _)| d.as_ptr());
        let act_values = acts.map(|(_, q)| q.as_ptr());
        let mut acc = [_mm256_setzero_ps(); N];
        for (b, &scale) in scales.iter().enumerate() {
            // SAFETY (every access below): the asserts above put 32 bytes of `quants` and of
            // every activation, and one scale of every activation, at block `b`.
            let x = unsafe { _mm256_loadu_si256(quants.as_ptr().add(32 * b).cast()) };
            let ax = _mm256_sign_epi8(x, x);
            for i in 0..N {
                let q = unsafe { _mm256_loadu_si256(act_values[i].add(32 * b).cast()) };
                // |x| times q with x's sign: unsigned by signed, as maddubs takes them.
                // Activations never hold -128 (they are rounded into [-127, 127]), so negating
                // them is exact.
                let pairs = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(q, x));
                let lanes = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
                let d = scale * unsafe { *act_scales[i].add(b) };
                acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(d), lanes, acc[i]);
            }
        }
        acc.map(|acc| to_array(acc))
    }

    /// `q4_0_repacked` for eight consecutive rows against one activation, as llama.cpp's
    /// repacked gemv runs them: the rows' chains side by side in one vector, lane `j` the chain
    /// of row `j` (each lane's fused step is the scalar one, so the bits are). `scales` and
    /// `quants` hold the eight rows one after another, `n` blocks each.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn q4_0_repacked8(
        scales: &[f32],
        quants: &[u8],
        act_scales: &[f32],
        act: &[i8],
    ) -> [f32; 8] {
        let n = act_scales.len();
        assert!(scales.len() >= 8 * n && quants.len() >= 8 * 16 * n && act.len() >= 32 * n);
        let low = _mm256_set1_epi8(0x0f);
        let eight = _mm256_set1_epi8(8);
        let ones = _mm256_set1_epi16(1);
        let mut acc = _mm256_setzero_ps();
        for b in 0..n {
            // SAFETY: the assert above puts 32 bytes of `act` at block `b`.
            let q = unsafe { _mm256_loadu_si256(act.as_ptr().add(32 * b).cast()) };
            let mut lanes = [_mm256_setzero_si256(); 8];
            for (j, lanes) in lanes.iter_mut().enumerate() {
                // SAFETY: the assert above puts 16 bytes of `quants` at row `j`'s block `b`.
                let packed =
                    unsafe { _mm_loadu_si128(quants.as_ptr().add(16 * (j * n + b)).cast()) };
                let nibbles =
                    _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low);
                let x = _mm256_sub_epi8(nibbles, eight);
                let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(q, x));
                *lanes = _mm256_madd_epi16(pairs, ones);
            }
            let d = _mm256_set_ps(
                scales[7 * n + b],
                scales[6 * n + b],
                scales[5 * n + b],
                scales[4 * n + b],
                scales[3 * n + b],
                scales[2 * n + b],
                scales[n + b],
                scales[b],
            );
            let d = _mm256_mul_ps(d, _mm256_set1_ps(act_scales[b]));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(row_totals(lanes)), d, acc);
        }
        to_array(acc)
    }

    /// Attention scores: `numerics::dot_f16(key(p), q) * scale` into `out[p - first]` for every
    /// position `p` from `first` to `index.len() - 1`, position `p`'s key being the `q.len()`
    /// f16 values at `keys[index[p] * width + offset..]` (widened exactly by F16C). The same four
    /// accumulators of eight lanes, fused in the same order, and `reduce_lanes`' tree, in vector
    /// registers; `q.len()` must be a multiple of 32 (the caller keeps the portable loop for
    /// other head sizes).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn f16_scores(
        q: &[f32],
        keys: &[u16],
        (index, width, offset): (&[usize], usize, usize),
        first: usize,
        scale: f32,
        out: &mut [f32],
    ) {
        let d = q.len();
        assert!(d.is_multiple_of(32) && out.len() + first >= index.len());
        for (score, &at) in out.iter_mut().zip(&index[first..]) {
            let key = &keys[at * width + offset..][..d];
            let mut acc = [_mm256_setzero_ps(); 4];
            for step in 0..d / 32 {
                for (j, acc) in acc.iter_mut().enumerate() {
                    let at = 32 * step + 8 * j;
                    // SAFETY: `key` and `q` hold `d` values, and `at + 8 <= d`.
                    let (k, q) = unsafe {
                        (
                            _mm256_cvtph_ps(_mm_loadu_si128(key.as_ptr().add(at).cast())),
                            _mm256_loadu_ps(q.as_ptr().add(at)),
                        )
                    };
                    *acc = _mm256_fmadd_ps(k, q, *acc);
                }
            }
            // `reduce_lanes`: lanes (0 + 2) + (1 + 3), then l + (l + 4), then (0 + 1) + (2 + 3).
            let a = _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3]));
            let t = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
            let u = _mm_add_ps(t, _mm_shuffle_ps(t, t, 0b10_11_00_01));
            *score = _mm_cvtss_f32(_mm_add_ss(u, _mm_movehl_ps(u, u))) * scale;
        }
    }

    /// `forward::weigh_values` over f16 values: `out[i]`, the values' dimension `i` weighed by
    /// the softmax weights `weights[p]` from `first` (each rounded to half precision), position
    /// `p`'s values being the `out.len()` f16 values at `values[index[p] * width + offset..]`.
    /// The same 32 lanes of accumulators, lane `p % 32` of a position, each updated by its
    /// positions in increasing order; then `reduce_lanes`' tree for eight dimensions at a time.
    /// A lane is summed whole in registers (`lane_sums`) before the next: position by position,
    /// loading and storing every accumulator of a position's lane was most of the loop.
    /// `out.len()` must be a multiple of 32.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn weigh_values(
        weights: &[f32],
        first: usize,
        values: &[u16],
        (index, width, offset): (&[usize], usize, usize),
        out: &mut [f32],
    ) {
        let d = out.len();
        assert!(d.is_multiple_of(32) && weights.len() <= index.len());
        let rounded: Vec<f32> = weights[first..].iter().map(|&s| round_to_f16(s)).collect();
        let index = (&index[..weights.len()], width, offset);
        // Lane-major: lane `l`'s accumulators of all `d` dimensions at `l * d`.
        let mut lanes = vec![0f32; 32 * d];
        // Sixty-four dimensions a pass (eight registers of accumulators), the last 32 alone.
        for dims in (0..d).step_by(64) {
            for (l, lane) in lanes.chunks_exact_mut(d).enumerate() {
                let lane = &mut lane[dims..];
                if d - dims >= 64 {
                    let acc = lane_sums::<8>(&rounded, first, l, values, index, dims);
                    store(&mut lane[..64], &acc);
                } else {
                    let acc = lane_sums::<4>(&rounded, first, l, values, index, dims);
                    store(&mut lane[..32], &acc);
                }
            }
        }
        for k in (0..d).step_by(8) {
            // SAFETY: lane `l` holds `d` values at `l * d`, and `k + 8 <= d`.
            let lane = |l: usize| unsafe { _mm256_loadu_ps(lanes.as_ptr().add(l * d + k)) };
            // `reduce_lanes`: accumulators (0 + 2) + (1 + 3), lane by lane...
            let a: [__m256; 8] = std::array::from_fn(|l| {
                _mm256_add_ps(
                    _mm256_add_ps(lane(l), lane(16 + l)),
                    _mm256_add_ps(lane(8 + l), lane(24 + l)),
                )
            });
            // ...then lanes l + (l + 4), then (0 + 1) + (2 + 3).
            let t: [__m256; 4] = std::array::from_fn(|l| _mm256_add_ps(a[l], a[l + 4]));
            let sum = _mm256_add_ps(_mm256_add_ps(t[0], t[1]), _mm256_add_ps(t[2], t[3]));
            // SAFETY: `out` holds `d` values, and `k + 8 <= d`.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(k), sum) };
        }
    }

    /// Lane `lane` of `weigh_values` for dimensions `dims..dims + 8 * K`: the fused sum of
    /// `value(p) * rounded[p - first]` over positions `p` from `first` with `p % 32 == lane`, in
    /// increasing order.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn lane_sums<const K: usize>(
        rounded: &[f32],
        first: usize,
        lane: usize,
        values: &[u16],
        (index, width, offset): (&[usize], usize, usize),
        dims: usize,
    ) -> [__m256; K] {
        let mut acc = [_mm256_setzero_ps(); K];
        let mut p = first + (lane + 32 - first % 32) % 32;
        while p < index.len() {
            let w = _mm256_set1_ps(rounded[p - first]);
            let value = &values[index[p] * width + offset + dims..][..8 * K];
            for (k, acc) in acc.iter_mut().enumerate() {
                // SAFETY: `value` holds `8 * K` values, and `8 * k + 8 <= 8 * K`.
                let v =
                    unsafe { _mm256_cvtph_ps(_mm_loadu_si128(value.as_ptr().add(8 * k).cast())) };
                *acc = _mm256_fmadd_ps(v, w, *acc);
            }
            p += 32;
        }
        acc
    }

    /// `values` into `out`, eight f32s a vector.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn store<const K: usize>(out: &mut [f32], values: &[__m256; K]) {
        assert!(out.len() >= 8 * K);
        for (k, v) in values.iter().enumerate() {
            // SAFETY: the assert above puts `8 * K` f32s at `out`.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(8 * k), *v) };
        }
    }

    /// `gguf::round_to_f16` by F16C's conversion there and back (round to nearest even, as
    /// `f32_to_f16`), for every value but NaN, which keeps being NaN with another payload.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(crate) fn round_to_f16(x: f32) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(x))))
    }

    /// `numerics::swiglu` with ggml's exponential eight lanes at a time (`expf8`; a group with a
    /// lane past its simple range takes the scalar `expf`, the same function lane by lane); a
    /// remainder goes to the portable loop itself.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
        use super::super::numerics::{self, expf};
        let n = gate.len();
        assert!(up.len() >= n && out.len() >= n);
        let vectorized = n - n % 8;
        for at in (0..vectorized).step_by(8) {
            // SAFETY: the assert above puts `n` values at each, and `at + 8 <= n`.
            let (g, u) = unsafe {
                (_mm256_loadu_ps(gate.as_ptr().add(at)), _mm256_loadu_ps(up.as_ptr().add(at)))
            };
            // `0 - g`, not `-g`, as the portable loop (they differ at zero).
            let e = match expf8(_mm256_sub_ps(_mm256_setzero_ps(), g)) {
                Some(e) => e,
                None => {
                    let lanes: [f32; 8] = std::array::from_fn(|l| expf(0.0 - gate[at + l]));
                    // SAFETY: `lanes` is eight f32s, what the load reads.
                    unsafe { _mm256_loadu_ps(lanes.as_ptr()) }
                }
            };
            let y = _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0), e)), u);
            // SAFETY: as the loads above.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(at), y) };
        }
        // Fewer than eight: the portable loop takes the C library's exponential for all.
        let rest = vectorized..n;
        numerics::swiglu(&gate[rest.clone()], &up[rest.clone()], &mut out[rest]);
    }

    /// `numerics::softmax` in place, eight exponentials at a time by `expf8`; a group with a
    /// lane past `expf`'s simple range (a masked or far-below-the-maximum score) and a last
    /// partial group take the scalar `expf`, which is the same function lane by lane.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn softmax(scores: &mut [f32]) {
        use super::super::numerics::exp_group;
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut total = 0f64;
        let whole = scores.len() / 8 * 8;
        let (groups, rest) = scores.split_at_mut(whole);
        for group in groups.chunks_exact_mut(8) {
            // SAFETY: `group` is eight f32s, what the load and store touch.
            let x = _mm256_sub_ps(unsafe { _mm256_loadu_ps(group.as_ptr()) }, _mm256_set1_ps(max));
            let lanes = match expf8(x) {
                Some(e) => {
                    // SAFETY: as above.
                    unsafe { _mm256_storeu_ps(group.as_mut_ptr(), e) };
                    // `hsum8`: (0 + 4) + (2 + 6), plus (1 + 5) + (3 + 7).
                    let t = _mm_add_ps(_mm256_castps256_ps128(e), _mm256_extractf128_ps(e, 1));
                    let u = _mm_add_ps(t, _mm_movehl_ps(t, t));
                    _mm_cvtss_f32(_mm_add_ss(u, _mm_shuffle_ps(u, u, 0b01)))
                }
                None => exp_group(group, max),
            };
            total += f64::from(lanes);
        }
        if !rest.is_empty() {
            total += f64::from(exp_group(rest, max));
        }
        let inverse = (1.0 / total) as f32;
        for s in scores {
            *s *= inverse;
        }
    }

    /// `numerics::expf` of eight lanes, or `None` if a lane is past its simple range
    /// (`|n| > 126`), where the scalar function takes its other branch.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn expf8(x: __m256) -> Option<__m256> {
        use super::super::numerics::expf_constants as k;
        let z = _mm256_fmadd_ps(x, _mm256_set1_ps(k::LOG2E), _mm256_set1_ps(k::SHIFT));
        let n = _mm256_sub_ps(z, _mm256_set1_ps(k::SHIFT));
        let abs_n = _mm256_andnot_ps(_mm256_set1_ps(-0.0), n);
        // Not `<= 126` (NaN included): the scalar branch.
        let simple = _mm256_cmp_ps(abs_n, _mm256_set1_ps(126.0), _CMP_LE_OQ);
        if _mm256_movemask_ps(simple) != 0xff {
            return None;
        }
        // `-n` flips the sign bit (`0 - n` would differ at zero).
        let minus_n = _mm256_xor_ps(n, _mm256_set1_ps(-0.0));
        let b = _mm256_fmadd_ps(
            minus_n,
            _mm256_set1_ps(k::LN2_LO),
            _mm256_fmadd_ps(minus_n, _mm256_set1_ps(k::LN2_HI), x),
        );
        let e = _mm256_slli_epi32(_mm256_castps_si256(z), 23);
        let scale =
            _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_set1_epi32(1f32.to_bits() as i32)));
        let u = _mm256_mul_ps(b, b);
        let (c0, c1, c2) = (_mm256_set1_ps(k::C0), _mm256_set1_ps(k::C1), _mm256_set1_ps(k::C2));
        let (c3, c4) = (_mm256_set1_ps(k::C3), _mm256_set1_ps(k::C4));
        let j = _mm256_fmadd_ps(
            _mm256_fmadd_ps(_mm256_fmadd_ps(c4, b, c3), u, _mm256_fmadd_ps(c2, b, c1)),
            u,
            _mm256_mul_ps(c0, b),
        );
        Some(_mm256_fmadd_ps(j, scale, scale))
    }

    /// Lane `j`: the sum of the eight 32-bit integers of `v[j]` (exact, so in any order).
    #[target_feature(enable = "avx2")]
    #[inline]
    fn row_totals(v: [__m256i; 8]) -> __m256i {
        let pairs = [
            _mm256_hadd_epi32(v[0], v[1]),
            _mm256_hadd_epi32(v[2], v[3]),
            _mm256_hadd_epi32(v[4], v[5]),
            _mm256_hadd_epi32(v[6], v[7]),
        ];
        // Each 128-bit half: rows 0-3 (and 4-7), that half's lanes summed.
        let low = _mm256_hadd_epi32(pairs[0], pairs[1]);
        let high = _mm256_hadd_epi32(pairs[2], pairs[3]);
        _mm256_add_epi32(
            _mm256_permute2x128_si256(low, high, 0x20),
            _mm256_permute2x128_si256(low, high, 0x31),
        )
    }

    /// A row of `Q4_K` (not repacked), `Q5_K` or `Q6_K` blocks (`KIND` 4, 5 or 6) against each
    /// of `acts` (scales, values, sums of each 32) along `ggml_vec_dot_q*_K_q8_K`: each block's
    /// integer lanes (`q4k_sums`, `q5k_sums`, `q6k_sums`) scaled by `d * act_d` into eight
    /// fused lane accumulators; `Q4_K`'s minimums into four (`dmin * -act_d` times
    /// `Header::min_products`' pairs), `Q5_K`'s summed in integers into one chain. Returns
    /// (lanes, minimum lanes, minimum chain) for each, which `KBlockRows::dots` reduces. The
    /// block loop is here rather than around a call per block: a block's floating-point steps
    /// stay in vector registers (they went through arrays on the stack).
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn kquant_lanes<const KIND: u8, const N: usize>(
        heads: &[Header],
        quants: &[u8],
        acts: [(&[f32], &[i8], &[i16]); N],
    ) -> [([f32; 8], [f32; 4], f32); N] {
        let per_block = match KIND {
            4 => 128,
            5 => 160,
            _ => 192,
        };
        let n = heads.len();
        assert!(quants.len() >= per_block * n);
        for (d, q, sums32) in acts {
            assert!(d.len() >= n && q.len() >= 256 * n && sums32.len() >= 8 * n);
        }
        let mut lanes = [_mm256_setzero_ps(); N];
        let mut min_lanes = [_mm_setzero_ps(); N];
        let mut min_chain = [0f32; N];
        for (b, head) in heads.iter().enumerate() {
            let block = &quants[per_block * b..per_block * (b + 1)];
            let q8: [&[i8]; N] = std::array::from_fn(|i| {
                // SAFETY: the asserts above put 256 values of every activation at block `b`.
                unsafe { std::slice::from_raw_parts(acts[i].1.as_ptr().add(256 * b), 256) }
            });
            let sums = match KIND {
                4 => q4k_sums(block, &head.scales, q8),
                5 => q5k_sums(&block[0..32], &block[32..160], &head.scales, q8),
                _ => q6k_sums(&block[0..128], &block[128..192], &head.scales, q8),
            };
            // SAFETY: `head.scales` is 16 bytes; the load reads its last 8.
            let mins =
                _mm_cvtepi8_epi16(unsafe { _mm_loadl_epi64(head.scales.as_ptr().add(8).cast()) });
            for i in 0..N {
                // SAFETY: the asserts above put a scale and 8 sums of every activation at `b`.
                let (act_d, block_sums) = unsafe {
                    (
                        *acts[i].0.get_unchecked(b),
                        _mm_loadu_si128(acts[i].2.as_ptr().add(8 * b).cast()),
                    )
                };
                let d = act_d * head.d;
                lanes[i] =
                    _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sums[i]), lanes[i]);
                let dmin = -act_d * head.dmin;
                match KIND {
                    4 => {
                        let pairs = _mm_cvtepi32_ps(_mm_madd_epi16(mins, block_sums));
                        min_lanes[i] = _mm_fmadd_ps(_mm_set1_ps(dmin), pairs, min_lanes[i]);
                    }
                    5 => {
                        let minimum = add4(_mm_madd_epi16(mins, block_sums));
                        min_chain[i] = dmin.mul_add(minimum as f32, min_chain[i]);
                    }
                    _ => {}
                }
            }
        }
        std::array::from_fn(|i| {
            let mut min4 = [0f32; 4];
            // SAFETY: `min4` is four f32s, what the unaligned store writes.
            unsafe { _mm_storeu_ps(min4.as_mut_ptr(), min_lanes[i]) };
            (to_array(lanes[i]), min4, min_chain[i])
        })
    }

    /// A repacked `Q4_K` row against each of `acts` (scales, values, sums of each 32): each
    /// block's totals as `kquants::q4k_totals` sums them, then scaled in llama.cpp's gemv order,
    /// per block `row = fma(total, d * act_d, row)` and `min = fma(minimums, dmin * act_d, min)`;
    /// returns (row, min) for each. The block loop is here, not around a call per block, so
    /// nothing is checked or passed per block; a block's 8 scales are widened once and each
    /// 32's taken by a byte shuffle (llama.cpp's `get_scale_shuffle_k4`) instead of a broadcast
    /// from a general register. The integer sums are exact: the bits are `q4k_totals`'.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn q4k_repacked<const N: usize>(
        heads: &[Header],
        quants: &[u8],
        acts: [(&[f32], &[i8], &[i16]); N],
    ) -> [(f32, f32); N] {
        let n = heads.len();
        assert!(quants.len() >= 128 * n);
        for (d, q, sums32) in acts {
            assert!(d.len() >= n && q.len() >= 256 * n && sums32.len() >= 8 * n);
        }
        let low = _mm256_set1_epi8(0x0f);
        // Shuffles that copy 16-bit lane `k` of each 128-bit half to all eight of its lanes.
        let pick = |k: i16| _mm256_set1_epi16(((2 * k + 1) << 8) | (2 * k));
        let act_d = acts.map(|(d, _, _)| d.as_ptr());
        let act_q = acts.map(|(_, q, _)| q.as_ptr());
        let act_sums = acts.map(|(_, _, s)| s.as_ptr());
        let mut out = [(0f32, 0f32); N];
        // Four inputs' row and minimum chains, a lane each.
        let (mut rows4, mut mins4) = (_mm_setzero_ps(), _mm_setzero_ps());
        for (b, head) in heads.iter().enumerate() {
            // SAFETY (every load below): the asserts above put 128 bytes of `quants`, and 256
            // values, 8 sums and a scale of every activation, at block `b`; `head.scales` is 16
            // bytes.
            let (scales, mins) = unsafe {
                (
                    _mm_cvtepi8_epi16(_mm_loadl_epi64(head.scales.as_ptr().cast())),
                    _mm_cvtepi8_epi16(_mm_loadl_epi64(head.scales.as_ptr().add(8).cast())),
                )
            };
            let scales = _mm256_set_m128i(scales, scales);
            let mut sums = [_mm256_setzero_si256(); N];
            for c in 0..4 {
                let packed =
                    unsafe { _mm256_loadu_si256(quants.as_ptr().add(128 * b + 32 * c).cast()) };
                let nibbles = [
                    _mm256_and_si256(packed, low),
                    _mm256_and_si256(_mm256_srli_epi16(packed, 4), low),
                ];
                for (half, &q4) in nibbles.iter().enumerate() {
                    let scale = _mm256_shuffle_epi8(scales, pick((2 * c + half) as i16));
                    for (sum, q) in sums.iter_mut().zip(act_q) {
                        let at = 256 * b + 64 * c + 32 * half;
                        let q8 = unsafe { _mm256_loadu_si256(q.add(at).cast()) };
                        let scaled = _mm256_madd_epi16(scale, _mm256_maddubs_epi16(q4, q8));
                        *sum = _mm256_add_epi32(*sum, scaled);
                    }
                }
            }
            let wide = |sum: __m256i| {
                _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1))
            };
            let minimums = |i: usize| {
                let block_sums = unsafe { _mm_loadu_si128(act_sums[i].add(8 * b).cast()) };
                _mm_madd_epi16(mins, block_sums)
            };
            if N == 4 {
                // Four inputs' totals into the lanes of one vector (each lane's chain is the
                // scalar one below: exact integer totals, then the same product and fma).
                let four = |v: [__m128i; 4]| {
                    _mm_hadd_epi32(_mm_hadd_epi32(v[0], v[1]), _mm_hadd_epi32(v[2], v[3]))
                };
                let totals = four(std::array::from_fn(|i| wide(sums[i])));
                let minimum = four(std::array::from_fn(minimums));
                let d = unsafe {
                    _mm_set_ps(
                        *act_d[3].add(b),
                        *act_d[2].add(b),
                        *act_d[1].add(b),
                        *act_d[0].add(b),
                    )
                };
                let (row_d, min_d) =
                    (_mm_mul_ps(_mm_set1_ps(head.d), d), _mm_mul_ps(_mm_set1_ps(head.dmin), d));
                rows4 = _mm_fmadd_ps(_mm_cvtepi32_ps(totals), row_d, rows4);
                mins4 = _mm_fmadd_ps(_mm_cvtepi32_ps(minimum), min_d, mins4);
                continue;
            }
            for i in 0..N {
                let d = unsafe { *act_d[i].add(b) };
                let (row, min) = &mut out[i];
                *row = (add4(wide(sums[i])) as f32).mul_add(head.d * d, *row);
                *min = (add4(minimums(i)) as f32).mul_add(head.dmin * d, *min);
            }
        }
        if N == 4 {
            let (mut rows, mut mins) = ([0f32; 4], [0f32; 4]);
            // SAFETY: `rows` and `mins` are four f32s, what the unaligned stores write.
            unsafe {
                _mm_storeu_ps(rows.as_mut_ptr(), rows4);
                _mm_storeu_ps(mins.as_mut_ptr(), mins4);
            }
            for (i, o) in out.iter_mut().enumerate() {
                *o = (rows[i], mins[i]);
            }
        }
        out
    }

    /// `q4k_sums` for a `Q5_K` block: element `64c + l`'s fifth bit is bit `2c` of `qh[l]`,
    /// element `64c + 32 + l`'s bit `2c + 1` (`ggml_vec_dot_q5_K_q8_K`'s `hmask`). Values to 31
    /// by bytes to 128, pairs far from saturating.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn q5k_sums<const N: usize>(
        qh: &[u8],
        qs: &[u8],
        scales: &[i8; 16],
        acts: [&[i8]; N],
    ) -> [__m256i; N] {
        assert!(qh.len() >= 32 && qs.len() >= 128 && acts.iter().all(|a| a.len() >= 256));
        let low = _mm256_set1_epi8(0x0f);
        let one = _mm256_set1_epi8(1);
        // SAFETY: the assert above puts 32 bytes at `qh`.
        let high = unsafe { _mm256_loadu_si256(qh.as_ptr().cast()) };
        let mut sums = [_mm256_setzero_si256(); N];
        for c in 0..4 {
            // SAFETY: the assert above puts 128 bytes at `qs`.
            let packed = unsafe { _mm256_loadu_si256(qs.as_ptr().add(32 * c).cast()) };
            // Bit `b` of each byte to bit 4: shifting 16-bit lanes moves the high byte's bits
            // into the low byte's top, which the mask then drops.
            let fifth = |b: i32| {
                let bit = _mm256_and_si256(_mm256_srl_epi16(high, _mm_cvtsi32_si128(b)), one);
                _mm256_slli_epi16(bit, 4)
            };
            let values = [
                _mm256_or_si256(_mm256_and_si256(packed, low), fifth(2 * c as i32)),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(packed, 4), low),
                    fifth(2 * c as i32 + 1),
                ),
            ];
            for (sum, act) in sums.iter_mut().zip(acts) {
                for (half, &q5) in values.iter().enumerate() {
                    let scale = _mm256_set1_epi16(i16::from(scales[2 * c + half]));
                    // SAFETY: the assert above puts 256 bytes at every `act`.
                    let q8 =
                        unsafe { _mm256_loadu_si256(act.as_ptr().add(64 * c + 32 * half).cast()) };
                    let scaled = _mm256_madd_epi16(scale, _mm256_maddubs_epi16(q5, q8));
                    *sum = _mm256_add_epi32(*sum, scaled);
                }
            }
        }
        sums
    }

    /// The integer lanes of one `Q4_K` block's quants (128 bytes: element `64c + l` is the low
    /// nibble of byte `32c + l`, element `64c + 32 + l` its high nibble) against each of `acts`
    /// (256 bytes each), each 32 elements' products times their scale (the first 8 of
    /// `scales`): lane `k` sums the elements `e` with `(e % 32) / 4 == k`, as
    /// `ggml_vec_dot_q4_K_q8_K` leaves them. Unsigned nibbles by signed bytes is what `maddubs`
    /// takes; a pair is at most 2 * 15 * 128, far from saturating.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn q4k_sums<const N: usize>(qs: &[u8], scales: &[i8; 16], acts: [&[i8]; N]) -> [__m256i; N] {
        assert!(qs.len() >= 128 && acts.iter().all(|a| a.len() >= 256));
        let low = _mm256_set1_epi8(0x0f);
        let mut sums = [_mm256_setzero_si256(); N];
        for c in 0..4 {
            // SAFETY: the assert above puts 128 bytes at `qs`.
            let packed = unsafe { _mm256_loadu_si256(qs.as_ptr().add(32 * c).cast()) };
            let nibbles = [
                _mm256_and_si256(packed, low),
                _mm256_and_si256(_mm256_srli_epi16(packed, 4), low),
            ];
            for (sum, act) in sums.iter_mut().zip(acts) {
                for (half, &q4) in nibbles.iter().enumerate() {
                    let scale = _mm256_set1_epi16(i16::from(scales[2 * c + half]));
                    // SAFETY: the assert above puts 256 bytes at every `act`.
                    let q8 =
                        unsafe { _mm256_loadu_si256(act.as_ptr().add(64 * c + 32 * half).cast()) };
                    let scaled = _mm256_madd_epi16(scale, _mm256_maddubs_epi16(q4, q8));
                    *sum = _mm256_add_epi32(*sum, scaled);
                }
            }
        }
        sums
    }

    /// The four 32-bit integers of `v` added (exact, so in any order).
    #[target_feature(enable = "avx2")]
    #[inline]
    fn add4(v: __m128i) -> i32 {
        let v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0b01_00_11_10));
        _mm_cvtsi128_si32(_mm_add_epi32(v, _mm_shuffle_epi32(v, 0b10_11_00_01)))
    }

    /// The integer lanes of one `Q6_K` block (`ql`, 128 bytes of low nibbles, and `qh`, 64 bytes
    /// of high pairs, as `dequantize` reads them) against each of `acts`: `(q - 32) * a`, each 16
    /// elements' products times their signed scale, in the lanes of `q4k_sums`. The 6-bit
    /// values go into `maddubs` unsigned and `32 * a` is subtracted after, as
    /// `ggml_vec_dot_q6_K_q8_K` does (pairs of at most 2 * 63 * 128: no saturation).
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn q6k_sums<const N: usize>(
        ql: &[u8],
        qh: &[u8],
        scales: &[i8; 16],
        acts: [&[i8]; N],
    ) -> [__m256i; N] {
        assert!(ql.len() >= 128 && qh.len() >= 64 && acts.iter().all(|a| a.len() >= 256));
        let low = _mm256_set1_epi8(0x0f);
        let two_bits = _mm256_set1_epi8(3);
        let thirty_two = _mm256_set1_epi8(32);
        let mut sums = [_mm256_setzero_si256(); N];
        for half in 0..2 {
            // SAFETY: the assert above puts 128 bytes at `ql` and 64 at `qh`.
            let (first, second, high) = unsafe {
                (
                    _mm256_loadu_si256(ql.as_ptr().add(64 * half).cast()),
                    _mm256_loadu_si256(ql.as_ptr().add(64 * half + 32).cast()),
                    _mm256_loadu_si256(qh.as_ptr().add(32 * half).cast()),
                )
            };
            // Each element's two high bits, moved to bits 4 and 5 of its byte.
            let pairs = [
                _mm256_slli_epi16(_mm256_and_si256(high, two_bits), 4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2), two_bits), 4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 4), two_bits), 4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 6), two_bits), 4),
            ];
            // Elements 128 * half + 32 * g + l, g = 0 to 3.
            let values = [
                _mm256_or_si256(_mm256_and_si256(first, low), pairs[0]),
                _mm256_or_si256(_mm256_and_si256(second, low), pairs[1]),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(first, 4), low), pairs[2]),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(second, 4), low), pairs[3]),
            ];
            for (sum, act) in sums.iter_mut().zip(acts) {
                for (g, &q6) in values.iter().enumerate() {
                    let sub = 8 * half + 2 * g;
                    // Bytes 0-15 of the 32 fill 16-bit products 0-7, the low 128 bits.
                    let scale = _mm256_set_m128i(
                        _mm_set1_epi16(i16::from(scales[sub + 1])),
                        _mm_set1_epi16(i16::from(scales[sub])),
                    );
                    // SAFETY: the assert above puts 256 bytes at every `act`.
                    let q8 =
                        unsafe { _mm256_loadu_si256(act.as_ptr().add(128 * half + 32 * g).cast()) };
                    let centered = _mm256_sub_epi16(
                        _mm256_maddubs_epi16(q6, q8),
                        _mm256_maddubs_epi16(thirty_two, q8),
                    );
                    *sum = _mm256_add_epi32(*sum, _mm256_madd_epi16(scale, centered));
                }
            }
        }
        sums
    }

    #[target_feature(enable = "avx2")]
    #[inline]
    fn to_array(v: __m256) -> [f32; 8] {
        let mut out = [0f32; 8];
        // SAFETY: `out` is eight f32s, what the unaligned store writes.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), v) };
        out
    }
}
